"""The GPU check of the whole ``--radix-cache hybrid`` path: one run, at most 8 minutes on one H200.

Stages (each in its own process with its own time limit; a stage that fails, raises or runs out
of time is recorded and the next one runs):

  P   probe    (<1 min): imports SGLang (carried in, ``sgl_kernel`` stubbed), our backend and the
               Triton GDN kernels; versions, the GPU, what was stubbed.
  A1  pools    (~1.5 min): the helper-path, host-tier and scenario tests of ``test/sglang``
               (SGLang's real pools, allocators and Scheduler; the checking worker proves every
               resumed state and prefix KV slot) with the pools on CUDA
               (``SGLANG_HYBRID_TEST_DEVICE=cuda``).
  A2  shapes   (~1 min): SGLang's pools at Qwen3-Next-80B-A3B and Qwen3.5-27B per-rank shapes (TP 1
               and TP 4; bf16 KV and conv, fp32 SSM; pages 1 and 64) driven through SGLang's
               helpers, timing the backend's HostTier: write-through, snapshot write, restore
               (ms per call, GB/s, and the ratio to a pinned contiguous copy of the same bytes
               measured in the same process).
  B   scheduler (~3.5 min): SGLang's real Scheduler with the CUDA build of our model worker
               (tiny Qwen3-Next in bf16, GDN through SGLang's Triton ``chunk_gated_delta_rule``)
               on the exactness programs, cancel, coalescing, pressure and retraction included,
               against same-schedule uncached references: greedy tokens identical, KV and conv
               state bitwise, SSM state within 1e-5 (``stage_scheduler.py``).
  C   chunk    (~1 min): SGLang's Triton ``chunk_gated_delta_rule`` at Qwen3-Next per-rank shapes:
               the per-chunk state ``h`` (and the fp32 ``TRACK_STATE`` snapshot) at chunk i
               against the final state of a pass split at 64·i, and the cost of gathering ``h``:
               the basis of zero-split taps (``stage_chunk.py``).
  I   inpass   (~40 s): in-pass taps through SGLang's own prefill tracking with the Triton and
               (when carried) FlashInfer GDN prefill: captured states against a pass ending at
               the tap, the cache's checkpoint plan against SGLang's (``stage_inpass.py``).
  H   host     (~45 s): the host tier's copies off the scheduler thread (issue #13): a 32k-token
               write-through and restore while a request decodes, async vs inline copies; issue
               time under 1 ms, decode stall, resume position (``stage_host_copies.py``).
  K   kernels  (what the budget leaves, at most 1 min): ``sgl_kernel_ext``'s CUDA ops bit-exact
               against their torch references, and timed (``stage_kernels.py``,
               docs/kernel-ext.md; its library travels in the carry when it was built here).

How to run it:

  make gpu-carry                      # here: SGLang + missing deps into .gpu-carry/ (~21 MiB)
  # the device tool's run, with carry [".gpu-carry"], timeout_s 540:
  PYTHONUNBUFFERED=1 python3 benchmark/gpu/check_backend.py --carry .gpu-carry
  # -> $OUT/gpu-backend-h200.json and $OUT/gpu-backend-h200.log

The JSON comes back in the run's files; copy it to ``docs/results/gpu-backend-h200.json`` and
commit it (``docs/gpu.md`` says what it verifies). Without $OUT it is written to
``out/gpu/gpu-backend-<mode>.json``.

On a machine without a GPU:

  python benchmark/gpu/check_backend.py --dry-run          # stages, imports, code paths; no CUDA
  python benchmark/gpu/check_backend.py --device cpu --quick   # CPU smoke: every stage's logic
                                                           # on the CPU at tiny shapes

The dry run imports everything each stage imports, twice: in this venv, and (when
``.gpu-carry/`` is built) with CUDA faked present, the device's package set simulated and the
carry on the path, as on the H200. The smoke mode runs the same stage code on the CPU with the
device's package set simulated when the carry is built (SGLang's Triton GDN kernel replaced by a
torch stand-in with its signature, ``torch_gdn.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

# name: (title, module, seconds on the device, seconds in the CPU smoke mode)
STAGES: dict[str, tuple[str, str, int, int]] = {
    "P": ("imports, versions, device", "stage_probe", 50, 240),
    "A1": ("backend tests with SGLang's pools on the device", "stage_pools", 100, 600),
    "A2": ("HostTier copies at real per-rank shapes", "stage_shapes", 55, 300),
    "B": ("SGLang's Scheduler, CUDA model worker, exactness", "stage_scheduler", 210, 900),
    "C": ("Triton chunk_gated_delta_rule per-chunk states", "stage_chunk", 50, 300),
    "H": ("host tier off the scheduler thread: issue, stall", "stage_host_copies", 45, 300),
    "I": ("in-pass taps through SGLang's prefill tracking", "stage_inpass", 40, 180),
    # Another engineer's stage (docs/kernel-ext.md): last, on whatever the budget leaves.
    "K": ("sgl_kernel_ext CUDA ops: bit-exact vs references, timed", "stage_kernels", 60, 180),
}
BUDGET_S = 480  # the whole check on the device (8 minutes)


def result_name(mode: str) -> str:
    return "gpu-backend-h200" if mode == "device" else f"gpu-backend-{mode}"


# ---------------------------------------------------------------- the child: one stage
def run_stage(args: argparse.Namespace) -> int:
    """Runs in the stage's own process: activate the environment, run, write the result."""
    import gpu_env

    carry = Path(args.carry) if args.carry and not args.no_carry else None
    info = gpu_env.activate(
        carry if carry and carry.exists() else None,
        simulate_device=args.simulate_device,
        fake_cuda=args.fake_cuda,
    )
    import importlib

    from common import Ctx, jsonable, log

    out = Path(args.result)
    done: dict[str, Any] = {}

    def write(result: dict[str, Any]) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(jsonable({**done, current: result}), indent=1))
        tmp.replace(out)

    # A dry run takes every stage in one process (imports are the slow part); a real run one.
    for current in args.stage.split(","):
        ctx = Ctx(
            device=args.device,
            quick=args.quick,
            tmp=Path(args.tmp),
            carry=carry,
            on_flush=write,
        )
        ctx.result["environment"] = info
        title, module, _, _ = STAGES[current]
        log(f"[{current}] {title} ({'dry run' if args.dry_run else args.device})")
        try:
            mod = importlib.import_module(module)
            if args.dry_run:
                mod.dry(ctx)
            else:
                gpu_env.imports_done()
                mod.run(ctx)
            ctx.result["error"] = None
        except BaseException as e:  # recorded; the parent moves on to the next stage
            ctx.result["error"] = "".join(traceback.format_exception(e))[-6000:]
            log(f"[{current}] raised: {e!r}")
        ctx.result["stubs"] = gpu_env.report()
        ctx.result["seconds"] = ctx.elapsed()
        done[current] = ctx.result
        write(ctx.result)
    return 0


# ---------------------------------------------------------------- the parent
def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    for mod in ("torch", "triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # reported, not fatal
            env[mod] = f"unavailable: {e!r}"
    try:
        import torch

        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["device"] = torch.cuda.get_device_name(0)
            env["device_memory_gib"] = round(p.total_memory / 2**30, 1)
            env["capability"] = list(torch.cuda.get_device_capability(0))
    except Exception as e:
        env["cuda_error"] = repr(e)
    try:
        env["git"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        env["git_dirty_files"] = len(dirty.splitlines())
    except Exception:  # the working tree may travel without .git
        env["git"] = None
    # What ran, when .git did not travel: a digest of the package, the tests and the check.
    import hashlib

    digest = hashlib.sha256()
    for base in ("python", "test", "benchmark/gpu"):
        for f in sorted((ROOT / base).rglob("*.py")):
            digest.update(f.relative_to(ROOT).as_posix().encode())
            digest.update(f.read_bytes())
    env["sources_sha256"] = digest.hexdigest()[:16]
    return env


def summarize(stage: dict[str, Any]) -> str:
    if stage.get("timed_out"):
        return "timeout"
    if stage.get("error"):
        return "error"
    checks = stage.get("checks", {})
    if checks and not all(c["ok"] for c in checks.values()):
        return "fail"
    return "pass"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dry-run", action="store_true", help="no CUDA: stages, imports, code paths")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, fewer cases")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ",".join(STAGES))
    ap.add_argument("--carry", default=str(ROOT / ".gpu-carry"))
    ap.add_argument("--out", default=None, help="the JSON file (default: $OUT/... or out/gpu/)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all stages")
    ap.add_argument(
        "--simulate-device",
        choices=("auto", "on", "off"),
        default="auto",
        help="hide packages the H200 lacks (auto: on in dry/smoke runs when the carry is built)",
    )
    # Internal: run one stage in this process.
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--fake-cuda", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-carry", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--simulate", dest="simulate_device_flag", action="store_true", help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.stage:
        args.simulate_device = args.simulate_device_flag
        return run_stage(args)

    carry = Path(args.carry)
    carry_built = (carry / "MANIFEST.json").exists()
    if args.device is None:
        import torch

        args.device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    mode = "dry-run" if args.dry_run else ("device" if args.device == "cuda" else "cpu-smoke")
    simulate = {
        "on": True,
        "off": False,
        "auto": carry_built and mode != "device",
    }[args.simulate_device]
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stages {unknown}; choose from {list(STAGES)}")

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "out" / "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else out_dir / f"{result_name(mode)}.json"
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "schema": 1,
        "check": "benchmark/gpu/check_backend.py",
        "mode": mode,
        "quick": args.quick,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(),
        "carry": _carry_summary(carry) if carry_built else None,
        "simulate_device": simulate,
        "stages": {},
    }
    print(f"GPU backend check: mode {mode}, device {args.device}, stages {','.join(stages)}")
    print(f"  carry: {carry if carry_built else 'not built (make gpu-carry)'}")
    if mode == "device" and not carry_built:
        print("  WARNING: no carry; SGLang must be importable from this Python")
    if mode == "dry-run":
        for s in stages:
            print(f"  {s:3s} {STAGES[s][0]}")

    runs = _plan_runs(mode, stages, carry_built, simulate)
    for label, group, flags in runs:
        left = args.budget - (time.perf_counter() - t_start) if mode == "device" else None
        limit = sum(STAGES[s][2] if mode == "device" else STAGES[s][3] for s in group)
        if left is not None:
            limit = int(min(limit, max(left - 5, 0)))
            if limit < 15:
                for s in group:
                    report["stages"][s] = {"status": "skipped", "reason": "out of time budget"}
                print(f"[{label}] skipped: out of time budget")
                continue
        results = _run_child(args, group, flags, limit, carry)
        for s, res in results.items():
            key = s if label == s else f"{s}.{label}"
            res["status"] = summarize(res)
            report["stages"][key] = res
            print(f"[{key}] {res['status']} in {res.get('seconds', 0):.1f} s")
        report["total_seconds"] = time.perf_counter() - t_start
        out.write_text(json.dumps(report, indent=1))
    statuses = {k: v.get("status") for k, v in report["stages"].items()}
    report["summary"] = {
        "status": "pass" if all(s == "pass" for s in statuses.values()) else "fail",
        "stages": statuses,
        "failed_checks": [
            f"{label}: {name}"
            for label, st in report["stages"].items()
            for name, c in st.get("checks", {}).items()
            if not c["ok"]
        ],
    }
    report["total_seconds"] = time.perf_counter() - t_start
    out.write_text(json.dumps(report, indent=1))
    print(f"\n{report['summary']['status'].upper()}: {statuses}")
    for f in report["summary"]["failed_checks"][:30]:
        print(f"  failed: {f}")
    print(f"wrote {out} ({report['total_seconds']:.0f} s)")
    return 0 if report["summary"]["status"] == "pass" else 1


def _plan_runs(
    mode: str, stages: list[str], carry_built: bool, simulate: bool
) -> list[tuple[str, list[str], list[str]]]:
    """(label, stages, flags) per child process."""
    if mode == "dry-run":
        runs = [("venv", stages, ["--dry-run", "--no-carry"])]
        if carry_built:
            runs.append(("device-imports", stages, ["--dry-run", "--fake-cuda", "--simulate"]))
        return runs
    flags = ["--simulate"] if simulate else []
    return [(s, [s], flags) for s in stages]


def _run_child(
    args: argparse.Namespace, group: list[str], flags: list[str], limit: int, carry: Path
) -> dict[str, dict[str, Any]]:
    """Run ``group`` in one child process; each stage's result (partial ones kept)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--stage",
            ",".join(group),
            "--device",
            args.device,
            "--result",
            str(result),
            "--tmp",
            tmp,
            "--carry",
            str(carry),
            *flags,
        ]
        if args.quick:
            cmd.append("--quick")
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (stage B)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        t0 = time.perf_counter()
        timed_out = False
        try:
            proc = subprocess.run(cmd, env=env, timeout=limit, cwd=str(ROOT))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            timed_out, code = True, None
        got: dict[str, Any] = {}
        if result.exists():
            try:
                got = json.loads(result.read_text())
            except json.JSONDecodeError as e:
                got = {group[0]: {"error": f"unreadable result: {e}"}}
        seconds = time.perf_counter() - t0
        out = {}
        for s in group:
            res = got.get(s)
            if res is None:
                res = {}
                if not timed_out:
                    res["error"] = f"the stage process exited with {code} before this stage ended"
            if timed_out and "seconds" not in res:
                res["timed_out"] = True
                res["error"] = (res.get("error") or "") + f"stopped at the {limit} s limit"
            res.setdefault("seconds", seconds)
            res["limit_s"] = limit
            out[s] = res
        return out


def _carry_summary(carry: Path) -> dict[str, Any]:
    m = json.loads((carry / "MANIFEST.json").read_text())
    return {
        "sglang": m.get("sglang"),
        "mib": round(m["sizes_bytes"]["total"] / 2**20, 1),
        "packages": {k: v["version"] for k, v in sorted(m["packages"].items())},
        "stubbed_on_device": m.get("stubbed_on_device"),
    }


if __name__ == "__main__":
    sys.exit(main())
