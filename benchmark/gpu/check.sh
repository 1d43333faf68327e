#!/usr/bin/env bash
# The GPU check (benchmark/gpu/check.py): needs only python with torch; skips without CUDA.
# On the lent GPU box: run from the repository root; results land in $OUT (or the cwd).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec "$PY" benchmark/gpu/check.py "$@"
