# Two commands for a fresh clone: `make demo` and `make test`. Both build or reuse .venv.
# The venv is pinned: torch/torchvision from the local index first (constraints keep pip
# from swapping them), then every other package at the exact version of requirements/cpu-lock.txt
# with --no-deps, then this package in editable mode (its entry point registers the plugin).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv test lint demo bench-index stress-index bench-replay clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu-lock.txt requirements/constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c requirements/constraints.txt torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps -c requirements/constraints.txt -r requirements/cpu-lock.txt
	$(PIP) install -q --no-deps -e .
	$(PY) -c "import torch, sglang, sglang_hybrid; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	@touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check python test benchmark
	$(VENV)/bin/ruff format --check python test benchmark

test: $(STAMP) lint
	$(PY) -m pytest -q

# SGLang's server on the CPU with --radix-cache hybrid, then its built-in cache, then none,
# replaying an embedded agent session (python -m sglang_hybrid.demo --help for options).
demo: $(STAMP)
	$(PY) -m sglang_hybrid.demo --out out/demo

bench-index: $(STAMP)
	$(PY) benchmark/index/bench_index.py --repeat 7 --json docs/results/index-bench.json

# The trace-replay results of docs/benchmarks.md (each NAME: benchmark/replay/bench_replay.py --help).
bench-replay: $(STAMP)
	$(PY) benchmark/replay/bench_replay.py agent

stress-index: $(STAMP)
	$(PY) -m pytest -q test/index/test_random_ops.py --index-ops 400000

clean-venv:
	rm -rf $(VENV)
