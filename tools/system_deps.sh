#!/usr/bin/env bash
# System libraries the pinned wheels load but do not ship (run once per machine by `make venv`).
# Debian's libibverbs1: Mooncake's client (mooncake-transfer-engine-non-cuda, the store behind
# --hybrid-l3 mooncake://, docs/l3.md) links libibverbs.so.1 even when it talks TCP only.
# CI runs as root on a fresh machine: apt-get installs it. Elsewhere, without root or apt-get,
# this says what to run and carries on: file:// L3 works, the Mooncake tests skip with the reason.
set -u
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing Debian's libibverbs1 (Mooncake's client needs libibverbs.so.1)"
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) \
      >/tmp/sglang-hybrid-apt.log 2>&1; then
    exit 0
  fi
  echo "system-deps: apt-get install libibverbs1 failed (log: /tmp/sglang-hybrid-apt.log)" >&2
fi
echo "system-deps: libibverbs.so.1 is missing and was not installed (needs root and apt-get:" \
  "'apt-get install libibverbs1'); --hybrid-l3 mooncake:// cannot start here and its tests" \
  "skip; --hybrid-l3 file:// is unaffected." >&2
exit 0
