"""The exactness suite's runner: every program against every cache configuration, once.

One scheduler per configuration (SGLang builds its process groups once per process, and a build
costs seconds), flushed between programs through SGLang's own ``flush_cache``. Results are
computed on first use and shared by every test of the session.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from programs import CHUNK, LADDER, MIN_GAP, PROGRAMS, TAPS, Cancel, Chat, EvictDevice, Req, Wave

BASE = dict(
    page_size=1,
    chunked_prefill_size=CHUNK,
    max_total_tokens=24576,
    max_running_requests=8,
    max_mamba_cache_size=40,
    max_prefill_tokens=4096,
)
# A pool that cannot hold the working set: an active request grows by evicting cache.
SMALL: dict[str, Any] = dict(max_total_tokens=2304, max_running_requests=2, max_mamba_cache_size=12)
CONFIGS: dict[str, dict[str, Any]] = {
    "uncached": dict(disable_radix_cache=True),
    "uncached-96": dict(disable_radix_cache=True, chunked_prefill_size=96),
    # Taps that end a pass (split) and taps the model worker captures inside it (zero_split).
    "hybrid": dict(host_mib=0, tap_mode="split"),
    "hybrid+host": dict(host_mib=64, tap_mode="split"),
    "zero_split": dict(host_mib=0, tap_mode="zero-split"),
    "zero_split+host": dict(host_mib=64, tap_mode="zero-split"),
    "builtin": dict(),
    "hybrid-small": dict(host_mib=0, tap_mode="split", **SMALL),
    "hybrid-small+host": dict(host_mib=32, tap_mode="zero-split", **SMALL),
    # SGLang's overlap loop (issue #14): batch N+1 runs before batch N's results are processed.
    "hybrid+host+overlap": dict(host_mib=64, tap_mode="split", overlap=True),
    "zero_split+overlap": dict(host_mib=0, tap_mode="zero-split", overlap=True),
    "hybrid-small+host+overlap": dict(host_mib=32, tap_mode="split", overlap=True, **SMALL),
    # SGLang's speculative path (issue #14, cpu/speculative.py): verify rounds of 1..4 tokens.
    "zero_split+host+mtp": dict(host_mib=64, tap_mode="zero-split", mtp=True),
    "hybrid-small+host+mtp": dict(host_mib=32, tap_mode="split", mtp=True, **SMALL),
    # Both: a verify round launched before the previous round's result is processed.
    "zero_split+host+mtp+overlap": dict(host_mib=64, tap_mode="zero-split", mtp=True, overlap=True),
}


@dataclass
class Run:
    config: str
    results: dict[str, Any] = field(default_factory=dict)
    logits: dict[str, Any] = field(default_factory=dict)
    pieces: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # worker's model calls
    captures: dict[str, list[int]] = field(default_factory=dict)  # positions captured in calls
    reqs: dict[str, Any] = field(default_factory=dict)
    asked: dict[str, Req] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)  # per program: stats after it ran
    draft_checked: int = 0  # +mtp: reused positions whose draft KV rows were checked
    overlap: bool = False  # the scheduler ran SGLang's overlap loop


def _pressure(chat: Chat, rng: random.Random):
    convs = [list(rng.randrange(20, 1500) for _ in range(300)) for _ in range(4)]
    for i, c in enumerate(convs):
        results = yield Wave([Req(f"pr-{i}", c, 60)])
        convs[i] = c + list(results[f"pr-{i}"].output_ids)
    yield Wave([Req("pr-grow", list(rng.randrange(20, 1500) for _ in range(900)), 300)])
    yield Wave([Req("pr-again", convs[0] + [5, 6], 8)])


PROGRAMS_SMALL = {"pressure": _pressure}


def run_config(make_scheduler, model_dir: Path, chat: Chat, name: str) -> Run:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_hybrid.sglang.flags import HybridOptions

    cfg = {**BASE, **CONFIGS[name]}
    host_mib = cfg.pop("host_mib", None)
    tap_mode = cfg.pop("tap_mode", "auto")
    cfg["disable_overlap_schedule"] = not cfg.pop("overlap", False)
    if cfg.pop("mtp", False):
        cfg.update(speculative_algorithm="CPU_MTP", speculative_num_steps=3)
    kw: dict[str, Any] = {}
    if host_mib is not None:
        cfg["radix_cache_backend"] = "hybrid"
        kw["server_args_attrs"] = {
            "_hybrid_options": HybridOptions(
                host_cache_mib=host_mib,
                tap_ladder=LADDER,
                tap_min_gap=MIN_GAP,
                taps_per_request=TAPS,
                tap_mode=tap_mode,
            )
        }
    sched = make_scheduler(model_dir, worker="model", record_logits=True, **cfg, **kw)
    spec = sched.scheduler.model_worker if "speculative_algorithm" in cfg else None
    if spec is not None:
        spec.check_draft = True  # every pass: the reused prefix carries its draft KV rows
    run = Run(name, overlap=bool(sched.overlap))
    small = name.startswith("hybrid-small")
    programs = PROGRAMS_SMALL if small else PROGRAMS
    if name == "uncached":
        programs = {**PROGRAMS, **PROGRAMS_SMALL}
    if name == "uncached-96":
        programs = {"resume_equivalence": PROGRAMS["resume_equivalence"]}
    for pname, program in programs.items():
        sched.scheduler.flush_cache()
        gen = program(chat, random.Random(pname))
        step = next(gen)
        while True:
            if isinstance(step, Wave):
                for r in step.reqs:
                    run.reqs[r.rid] = sched.submit(r.rid, r.ids, r.max_new, **r.submit_attrs())
                    run.asked[r.rid] = r
                if pname == "disabled_request" and step.reqs[0].disabled:
                    run.cache["disabled_before"] = _counts(sched)
                sched.run_until_idle()
                if pname == "disabled_request" and step.reqs[0].disabled:
                    run.cache["disabled_after"] = _counts(sched)
            elif isinstance(step, Cancel):
                r = step.req
                run.reqs[r.rid] = sched.submit(r.rid, r.ids, r.max_new)
                run.asked[r.rid] = r
                for _ in range(step.after_chunks):
                    sched.step()
                sched.abort(r.rid)
                sched.run_until_idle()
            elif isinstance(step, EvictDevice):
                tc = sched.tree_cache
                if "+host" in name:
                    tc.evict(EvictParams(num_tokens=1 << 30))
                    for s in list(tc.index.snapshots.values()):
                        if s.image_on_host and s.image_on_device and not s.restore_pins:
                            tc.index.drop_image_device(s)
            for rid, res in sched.results().items():
                if rid not in run.results and res.finished:
                    run.results[rid] = res
                    run.pieces[rid] = list(sched.worker.pieces.get(rid, []))
                    run.captures[rid] = list(sched.worker.captured_taps.get(rid, []))
                    with contextlib.suppress(KeyError):  # aborted before its first token
                        run.logits[rid] = sched.first_token_logits(rid).clone()
            try:
                step = gen.send(run.results)
            except StopIteration:
                break
        tc = sched.tree_cache
        if hasattr(tc, "index"):
            host = getattr(tc, "host_tier", None)
            run.cache[pname] = dict(
                stats=tc.index.stats,
                restored_blocks=host.restored_blocks if host else 0,
                taps_in_pass=tc.publisher.taps_in_pass,
                nodes_by_depth=_depths(tc.index),
            )
    if spec is not None:
        run.draft_checked = spec.draft_kv.checked_tokens
    return run


def _counts(sched) -> tuple[int, int] | None:
    idx = getattr(sched.tree_cache, "index", None)  # SGLang's own cache has none
    return (idx.tree.n_nodes, len(idx.snapshots)) if idx is not None else None


def _depths(index) -> dict[int, int]:
    out: dict[int, int] = {}
    for n in index.tree.subtree_postorder(index.tree.root):
        if n.parent is not None:
            out[n.depth] = out.get(n.depth, 0) + 1
    return out


@pytest.fixture(scope="session")
def _plugin(sglang_plugin: None) -> None:
    pass


@pytest.fixture(scope="session")
def suite(_plugin, tiny_models, tmp_path_factory):
    """All configurations' runs, computed once (a few minutes on 2 cores)."""
    from transformers import AutoTokenizer

    from sglang_hybrid.cpu.loop import InProcessScheduler

    model = tiny_models["qwen3_next"]
    chat = Chat(AutoTokenizer.from_pretrained(model))
    live: list[InProcessScheduler] = []

    def make(model_dir, **kw):
        while live:
            live.pop().close()
        s = InProcessScheduler(model_dir, **kw)
        live.append(s)
        return s

    runs = {name: run_config(make, model, chat, name) for name in CONFIGS}
    while live:
        live.pop().close()
    return runs
