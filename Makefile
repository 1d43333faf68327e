# Two commands for a fresh clone: `make demo` and `make test`. Both build or reuse .venv.
# The venv is pinned: torch/torchvision from the local index first (constraints keep pip
# from swapping them), then every other package at the exact version of requirements/cpu-lock.txt
# with --no-deps, then this package in editable mode (its entry point registers the plugin).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
KEXT_STAMP := $(VENV)/.kernel-ext
NATIVE_STAMP := $(VENV)/.index-native
SYSDEPS_STAMP := $(VENV)/.system-deps

.PHONY: venv test lint demo bench-index stress-index stress bench-replay gpu-carry clean-venv \
	kernel-ext gpu-smoke index-native

venv: $(STAMP) $(KEXT_STAMP) $(NATIVE_STAMP) $(SYSDEPS_STAMP)

# Debian's libibverbs1 for Mooncake's client (--hybrid-l3 mooncake://, docs/l3.md): installed with
# apt-get when missing and run as root (CI); otherwise a message says what to run and the Mooncake
# tests skip. Once per venv.
$(SYSDEPS_STAMP): tools/system_deps.sh
	@mkdir -p $(VENV)
	@bash tools/system_deps.sh
	@touch $@

$(STAMP): pyproject.toml requirements/cpu-lock.txt requirements/constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c requirements/constraints.txt torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q --no-deps -c requirements/constraints.txt -r requirements/cpu-lock.txt
	$(PIP) install -q --no-deps -e .
	$(PY) -c "import torch, sglang, sglang_hybrid; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	@touch $@

# sgl-kernel-ext/ (docs/kernel-ext.md): CUDA copy kernels, compiled when a CUDA toolkit matching
# torch's CUDA version is found (sm_80, sm_90 + PTX; ~1 min on 2 cores), else skipped with the
# reason; every op then runs its torch reference. make venv / make test attempt it once per change
# of its build files and carry on if it fails; make kernel-ext rebuilds it.
KEXT_DEPS  := $(wildcard sgl-kernel-ext/csrc/*.cu sgl-kernel-ext/setup.py sgl-kernel-ext/build.py \
	sgl-kernel-ext/sgl_kernel_ext/toolkit.py)

$(KEXT_STAMP): $(STAMP) $(KEXT_DEPS)
	-$(PY) sgl-kernel-ext/build.py
	@touch $@

kernel-ext: $(STAMP)
	$(PY) sgl-kernel-ext/build.py
	@touch $(KEXT_STAMP)

# The index compiled by mypyc (tools/build_index.py, docs/index.md "Compiled"): built into
# python/sglang_hybrid/index/_compiled/ (~40 s on 2 cores), used only while it matches the sources
# (an edited module falls back to Python until the next build); a failed build (no C compiler,
# say) prints its log's tail and leaves the sources in use, and is tried again when a source
# changes; SGLANG_HYBRID_PURE_PYTHON=1 runs the sources. make index-native rebuilds.
INDEX_SRC := $(wildcard python/sglang_hybrid/index/*.py) tools/build_index.py

$(NATIVE_STAMP): $(STAMP) $(INDEX_SRC)
	-$(PY) tools/build_index.py
	@touch $@

index-native: $(STAMP)
	$(PY) tools/build_index.py --force
	@touch $(NATIVE_STAMP)

# mypy: the package (and sgl-kernel-ext, which it imports), strict on index/ and store/; the
# configuration is pyproject.toml's [tool.mypy]. Cold (no .mypy_cache) ~1 min on 2 cores, warm
# a few seconds.
lint: $(STAMP)
	$(VENV)/bin/ruff check python test benchmark sgl-kernel-ext examples tools
	$(VENV)/bin/ruff format --check python test benchmark sgl-kernel-ext examples tools
	$(VENV)/bin/mypy

# Two pytest-xdist workers, one test file each at a time (--dist loadfile keeps a file's
# module-scoped servers and schedulers in one process): 10 min instead of 29 on 2 cores.
# TEST_WORKERS=0 runs serially (pytest-xdist's -n 0).
TEST_WORKERS ?= 2

# The GPU check's CPU smoke mode (every stage at tiny shapes, ~8 min) is its own target: CI runs
# the check's dry run (its imports and CUDA-free paths) and the suites it reuses.
test: $(STAMP) $(KEXT_STAMP) $(NATIVE_STAMP) $(SYSDEPS_STAMP) lint
	$(PY) -m pytest -q -m "not gpu_smoke" -n $(TEST_WORKERS) --dist loadfile

gpu-smoke: $(STAMP) $(KEXT_STAMP)
	$(PY) -m pytest -q -m gpu_smoke test/gpu

# SGLang's server on the CPU with --radix-cache hybrid, then its built-in cache, then none,
# replaying an embedded agent session (python -m sglang_hybrid.demo --help for options).
demo: $(STAMP) $(NATIVE_STAMP)
	$(PY) -m sglang_hybrid.demo --out out/demo

bench-index: $(STAMP)
	$(PY) benchmark/index/bench_index.py --repeat 7 --json docs/results/index-bench.json

# The trace-replay results of docs/benchmarks.md (each NAME: benchmark/replay/bench_replay.py --help).
bench-replay: $(STAMP)
	$(PY) benchmark/replay/bench_replay.py agent

stress-index: $(STAMP)
	$(PY) -m pytest -q test/index/test_random_ops.py --index-ops 400000

# The scheduler reliability suite (docs/exactness.md, "Reliability") at 10^6 random operations;
# RELIABILITY_SEED=S for another seed.
stress: $(STAMP)
	$(PY) -m pytest -q test/reliability --reliability-ops 1000000 --reliability-seed $(or $(RELIABILITY_SEED),0)

# What travels to the GPU box for benchmark/gpu/check_backend.py (docs/gpu.md): SGLang's sources
# and the packages the H200 image lacks, into .gpu-carry/; prints its size, fails over 60 MiB.
gpu-carry: $(STAMP)
	$(PY) benchmark/gpu/make_carry.py --out .gpu-carry --limit-mib 60

clean-venv:
	rm -rf $(VENV)
