"""The model worker: a cached run (SGLang's built-in hybrid cache) reproduces an uncached one.

Every comparison is between two runs of the same worker through SGLang's real Scheduler: one
with the built-in cache (``no_buffer``, page 1) and one with the radix cache disabled. Nothing
is compared against numbers produced ahead of time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

CHUNK = 64
MAX_NEW = 8
LOGIT_TOL = 1e-5


def _rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 2048) for _ in range(n)]


def _run_scenario(sched: Any) -> dict[str, dict[str, Any]]:
    """Sequential turns, then three requests together, then two seeded samples."""
    rng = random.Random(1234)
    a = _rand_ids(rng, 300)
    new20, diff50, tail3 = _rand_ids(rng, 20), _rand_ids(rng, 50), _rand_ids(rng, 3)
    prompts: dict[str, list[int]] = {}

    def run_alone(rid: str, ids: list[int]) -> list[int]:
        prompts[rid] = ids
        sched.submit(rid, ids, MAX_NEW)
        sched.run_until_idle()
        return sched.results()[rid].output_ids

    out1 = run_alone("fresh", a)
    run_alone("continuation", a + out1 + new20)  # multi-turn: previous turn + its answer
    run_alone("shared_prefix", a[:200] + diff50)
    run_alone("repeat", a)
    together = {
        "b_continuation": a + out1 + new20 + tail3,
        "b_shared": a[:130] + diff50,
        "b_repeat": a,
    }
    for rid, ids in together.items():
        prompts[rid] = ids
        sched.submit(rid, ids, MAX_NEW)
    sched.run_until_idle()
    for rid, seed in (("sample_a", 7), ("sample_b", 8)):
        prompts[rid] = a[:250]
        sched.submit(rid, a[:250], MAX_NEW, temperature=0.8, seed=seed)
        sched.run_until_idle()
    sched.on_idle()  # pool and tree invariants hold after all of it

    worker = sched.worker
    return {
        rid: {
            "result": sched.results()[rid],
            "logits": sched.first_token_logits(rid),
            "pieces": [p for p in worker.pieces[rid] if p[1] <= len(ids)],
        }
        for rid, ids in prompts.items()
    }


def _same_decomposition(cached: int, uncached_pieces: list, cached_pieces: list) -> bool:
    """Whether both runs computed the prompt in the same pieces (then logits must be bitwise).

    The cached run's state at ``cached`` was computed by earlier requests in CHUNK-aligned
    pieces from position 0 (every cached prefix here comes from the first prompt), so the
    uncached run must have used those same pieces before ``cached`` and the cached run's own
    pieces after it.
    """
    before = [p for p in uncached_pieces if p[1] <= cached]
    after = [p for p in uncached_pieces if p[0] >= cached]
    aligned = [(s, s + CHUNK) for s in range(0, cached, CHUNK)]
    return before == aligned and after == cached_pieces


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_cached_runs_reproduce_uncached_runs(make_scheduler, tiny_models: dict[str, Path], arch):
    common = {"worker": "model", "record_logits": True, "chunked_prefill_size": CHUNK}
    cached = _run_scenario(make_scheduler(tiny_models[arch], **common))
    uncached = _run_scenario(make_scheduler(tiny_models[arch], disable_radix_cache=True, **common))

    assert set(cached) == set(uncached)
    # The built-in cache did hit (otherwise this compares nothing interesting).
    for rid in ("continuation", "shared_prefix", "repeat", "b_continuation", "b_shared"):
        assert cached[rid]["result"].cached_tokens > 0, rid
    assert all(u["result"].cached_tokens == 0 for u in uncached.values())

    bitwise_cases = 0
    for rid, c in cached.items():
        u = uncached[rid]
        assert c["result"].output_ids == u["result"].output_ids, rid
        assert c["result"].finish_type == u["result"].finish_type == "length"
        diff = (c["logits"] - u["logits"]).abs().max().item()
        assert diff <= LOGIT_TOL, (rid, diff)
        if _same_decomposition(c["result"].cached_tokens, u["pieces"], c["pieces"]):
            bitwise_cases += 1
            assert torch.equal(c["logits"], u["logits"]), (rid, diff, c["pieces"])
    # fresh, shared_prefix (192 cached) and repeat (256 cached) split the prompt identically.
    assert bitwise_cases >= 3

    # Seeded sampling: same seed, same draws with or without the cache; another seed differs.
    assert cached["sample_a"]["result"].output_ids != cached["sample_b"]["result"].output_ids
    assert cached["sample_a"]["result"].output_ids != cached["shared_prefix"]["result"].output_ids


def _slot_state(sched: Any, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = sched.scheduler.req_to_token_pool.mamba_pool.mamba_cache
    return cache.conv[0][:, slot].clone(), cache.temporal[:, slot].clone()


def _own_slot(sched: Any, req: Any) -> int:
    pool = sched.scheduler.req_to_token_pool
    return int(pool.translate_mamba_indices(req.kv.mamba_pool_idx.unsqueeze(0))[0])


def test_state_tap_equals_the_state_of_a_run_ending_there(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(
        qwen35_dir,
        worker="model",
        chunked_prefill_size=CHUNK,
        disable_radix_cache=True,
        record_logits=True,
    )
    pool = sched.scheduler.req_to_token_pool
    ids = _rand_ids(random.Random(99), 170)
    dst = pool.mamba_allocator.alloc(4)
    slots = [int(s) for s in pool.translate_mamba_indices(dst)]
    pool.mamba_pool.clear_slots(torch.tensor(slots))
    # 100 lies inside the second chunk, 150 inside the third; 128 is a chunk end (the cache's
    # business, not a tap) and 170 is the prompt end.
    taps = [(100, slots[0]), (150, slots[1]), (128, slots[2])]
    tapped = sched.submit("tapped", ids, 4, hybrid_state_taps=taps)
    # The destination slots are ours, not SGLang's: its idle leak check would (rightly) object
    # until they are freed at the end.
    sched.run_until_idle(idle_check=False)
    assert sorted(tapped.hybrid_state_taps_done) == [100, 150]
    tap_states = {p: _slot_state(sched, slot) for p, slot in taps}
    untouched_conv, untouched_rec = tap_states[128]
    assert not untouched_conv.any() and not untouched_rec.any()
    assert not torch.equal(tap_states[100][1], tap_states[150][1])

    # A run that ends at p stores the tapped state, up to the rounding of the GEMMs before the
    # gated-delta rule (they saw the whole chunk's rows, not p's: ~1e-6; cpu/capture.py).
    for p in (100, 150):
        req = sched.submit(f"until_{p}", ids[:p], 2)
        while len(req.output_ids) < 1:  # step until its prompt is done, before its decode
            sched.step(idle_check=False)
        conv, rec = _slot_state(sched, _own_slot(sched, req))
        tap_conv, tap_rec = tap_states[p]
        torch.testing.assert_close(tap_conv, conv, rtol=1e-4, atol=1e-5, msg=str(p))
        torch.testing.assert_close(tap_rec, rec, rtol=1e-4, atol=1e-5, msg=str(p))
        sched.run_until_idle(idle_check=False)

    # A tap costs no model call and no different answer: the same calls as an untapped run.
    sched.submit("untapped", ids, 4)
    sched.run_until_idle(idle_check=False)
    assert sched.results()["untapped"].output_ids == sched.results()["tapped"].output_ids
    assert sched.worker.pieces["tapped"] == sched.worker.pieces["untapped"]
    assert sched.worker.captured_taps["tapped"] == [100, 150]
    pool.mamba_allocator.free(dst)
    sched.on_idle()


def test_model_worker_refuses_a_bf16_conv_state(monkeypatch):
    from sglang_hybrid.cpu.conv_dtype import CONV_DTYPE_ENV
    from sglang_hybrid.cpu.install import install_cpu_worker

    monkeypatch.setenv(CONV_DTYPE_ENV, "bfloat16")
    with pytest.raises(RuntimeError, match="float32"):
        install_cpu_worker("model")


def test_model_worker_pools_are_float32(make_scheduler, qwen35_dir: Path):
    sched = make_scheduler(qwen35_dir, worker="model")
    cache = sched.scheduler.req_to_token_pool.mamba_pool.mamba_cache
    assert cache.conv[0].dtype == torch.float32
    assert cache.temporal.dtype == torch.float32
    assert sched.scheduler.token_to_kv_pool_allocator.get_kvcache().get_key_buffer(3).dtype == (
        torch.float32
    )
