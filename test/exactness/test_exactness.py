"""Exactness in SGLang's real Scheduler loop with a real tiny model (spec §13.3), host tier on
and off. "Uncached" is the same loop and chunk size with the radix cache disabled; every cached
output is compared with it, and SGLang's built-in cache's reuse is printed beside ours.
"""

from __future__ import annotations

import pytest
import torch
from programs import CHUNK, deep_edit_expectation, floor64

from sglang_hybrid.index import HintKind

HYBRID = [
    "hybrid",
    "hybrid+host",
    "zero_split",
    "zero_split+host",
    "hybrid+host+overlap",
    "zero_split+overlap",
    "zero_split+host+mtp",
    "zero_split+host+mtp+overlap",
]


def same_tokens(suite, config: str, prefix: str) -> None:
    ref, got = suite["uncached"].results, suite[config].results
    rids = [r for r in got if r.startswith(prefix)]
    assert rids, f"{config}: no results for {prefix}"
    for rid in rids:
        assert got[rid].output_ids == ref[rid].output_ids, f"{config}/{rid}: tokens differ"


def cached(suite, config: str, rid: str) -> int:
    return suite[config].results[rid].cached_tokens


def agreement(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k / max(n, 1)


def test_print_reuse_side_by_side(suite) -> None:
    rows = sorted(suite["uncached"].results)
    print("\nrid              hybrid  +host  built-in")
    for rid in rows:
        vals = [suite[c].results.get(rid) for c in ("hybrid", "hybrid+host", "builtin")]
        if rid.startswith("pr-"):
            vals = [suite[c].results.get(rid) for c in ("hybrid-small", "hybrid-small+host")]
            vals.append(None)
        print(f"{rid:15s} " + " ".join(f"{v.cached_tokens if v else '-':>7}" for v in vals))


@pytest.mark.parametrize("config", HYBRID)
def test_resume_equivalence(suite, config: str) -> None:
    assert cached(suite, config, "re-resume") == 599  # the prompt-tail tap at n - 1
    same_tokens_count = agreement(
        suite[config].results["re-resume"].output_ids,
        suite["uncached"].results["re-resume"].output_ids,
    )
    base_tokens = agreement(
        suite["uncached-96"].results["re-resume"].output_ids,
        suite["uncached"].results["re-resume"].output_ids,
    )
    ref = suite["uncached"].logits["re-resume"]
    base = (suite["uncached-96"].logits["re-resume"] - ref).abs().max().item()
    diff = (suite[config].logits["re-resume"] - ref).abs().max().item()
    print(
        f"\n{config}: first-token |dlogits| {diff:.2e} (chunk-decomposition baseline "
        f"{base:.2e}); greedy agreement over 256 tokens {same_tokens_count:.3f} "
        f"(baseline {base_tokens:.3f})"
    )
    assert len(suite[config].results["re-resume"].output_ids) == 256
    assert diff <= max(base, 1e-6)
    assert same_tokens_count >= base_tokens


@pytest.mark.parametrize("config", HYBRID)
def test_multi_turn_exact_endpoint_with_a_copied_tail(suite, config: str) -> None:
    run = suite[config]
    first = run.asked["mt-1"]
    end = len(first.ids) + len(run.results["mt-1"].output_ids) - 1
    assert end % 64, "the scenario needs an endpoint inside a block"
    if "+mtp" in config:
        # The last verify round accepted one token past the budget: the live state, and so the
        # endpoint, includes the last output token, which mt-2's prompt repeats (one later).
        end += 1
    assert cached(suite, config, "mt-2") == end
    assert run.reqs["mt-2"].hybrid.tail_copied == end % 64  # copied, not shared
    same_tokens(suite, config, "mt-")


@pytest.mark.parametrize(
    "config", ["zero_split+host+mtp", "zero_split+host+mtp+overlap", "hybrid-small+host+mtp"]
)
def test_speculative_runs_carried_the_draft_kv(suite, config: str) -> None:
    """Every pass of the +mtp runs checked that the reused prefix holds the draft model's KV
    rows of its own positions (``cpu/draft_kv.py``): the cache moved them with every copied
    tail and host restore, on the real tiny model."""
    assert suite[config].draft_checked > 1000
    assert suite[config].overlap is ("+overlap" in config)


@pytest.mark.parametrize("config", HYBRID)
def test_rerendered_history_keeps_the_turn(suite, config: str) -> None:
    n1 = len(suite[config].asked["rr-1"].ids)
    assert cached(suite, config, "rr-2") >= floor64(n1 - 1)
    same_tokens(suite, config, "rr-")


@pytest.mark.parametrize("config", HYBRID)
def test_edit_deep_in_history_resumes_at_the_deepest_tap_below_it(suite, config: str) -> None:
    run = suite[config]
    want = deep_edit_expectation(
        run.asked["de-1"], run.asked["de-2"], run.pieces["de-1"], run.captures["de-1"]
    )
    assert want > 0
    assert cached(suite, config, "de-2") == want
    same_tokens(suite, config, "de-")


@pytest.mark.parametrize("config", HYBRID)
def test_shared_preamble_is_stored_once_and_hit_by_every_session(suite, config: str) -> None:
    run = suite[config]
    end = next(h.position for h in run.asked["sp-0"].hints if h.kind is HintKind.STRUCTURAL)
    for i in range(1, 8):
        assert cached(suite, config, f"sp-{i}") >= floor64(end)
    depths = run.cache["shared_preamble"]["nodes_by_depth"]
    assert all(depths[d] == 1 for d in range(end // 64))  # one node per preamble block
    same_tokens(suite, config, "sp-")


@pytest.mark.parametrize("config", HYBRID)
def test_identical_prompts_arriving_together(suite, config: str) -> None:
    for i in range(8):
        assert cached(suite, config, f"it-{i}") == 499  # the warm-up's prompt-tail tap
    same_tokens(suite, config, "it-")
    if "+host" in config:  # the prefix lived on the host only: its blocks came back once
        assert suite[config].cache["identical_together"]["restored_blocks"] == 7


@pytest.mark.parametrize("config", HYBRID)
def test_a_new_prefix_arriving_together_is_computed_once(suite, config: str) -> None:
    # Spec §12.2: five wait for the first one's snapshot at the divergence (700 -> 640).
    got = sorted(cached(suite, config, f"np-{i}") for i in range(6))
    assert got == [0] + [640] * 5
    same_tokens(suite, config, "np-")


@pytest.mark.parametrize("config", ["hybrid", "zero_split"])
def test_host_only_restore_equals_a_device_resume(suite, config: str) -> None:
    host, dev = suite[f"{config}+host"], suite[config]
    end = len(host.asked["ho-1"].ids) + 80 - 1
    assert cached(suite, f"{config}+host", "ho-2") == cached(suite, config, "ho-2") == end
    assert host.reqs["ho-2"].hybrid.restored_bytes > 0
    assert dev.reqs["ho-2"].hybrid.restored_bytes == 0
    assert host.results["ho-2"].output_ids == dev.results["ho-2"].output_ids
    assert torch.equal(host.logits["ho-2"], dev.logits["ho-2"])  # bit-exact restore
    same_tokens(suite, f"{config}+host", "ho-")


@pytest.mark.parametrize("config", HYBRID)
def test_cancel_mid_prefill_publishes_what_it_computed(suite, config: str) -> None:
    assert suite[config].results["cm-1"].finish_type == "abort"
    assert cached(suite, config, "cm-2") == 3 * CHUNK
    same_tokens(suite, config, "cm-2")


@pytest.mark.parametrize(
    "config",
    ["hybrid-small", "hybrid-small+host", "hybrid-small+host+overlap", "hybrid-small+host+mtp"],
)
def test_pressure_with_active_growth(suite, config: str) -> None:
    assert len(suite[config].results["pr-grow"].output_ids) == 300  # nothing active was lost
    same_tokens(suite, config, "pr-")
    stats = suite[config].cache["pressure"]["stats"]
    if config == "hybrid-small":  # no host: eviction loses last copies, whole subtrees go
        assert stats.device_evicted_unbacked > 0 and stats.subtree_deletions > 0
    else:
        assert stats.device_evicted_backed > 0


@pytest.mark.parametrize("config", HYBRID)
def test_disabled_request_leaves_nothing_behind(suite, config: str) -> None:
    run = suite[config]
    assert run.cache["disabled_before"] == run.cache["disabled_after"]
    same_tokens(suite, config, "dr-")


@pytest.mark.parametrize("config", HYBRID)
def test_zero_split_captures_taps_inside_passes(suite, config: str) -> None:
    """The zero-split configurations ran their grid taps inside passes (the model worker copied
    the states); the split ones never did. Every test above ran on both."""
    in_pass = sum(c["taps_in_pass"] for c in suite[config].cache.values() if "taps_in_pass" in c)
    calls = sum(len(p) for p in suite[config].pieces.values())
    if config.startswith("zero_split"):
        assert in_pass > 0
        assert sum(len(c) for c in suite[config].captures.values()) > 0
        if "+mtp" in config:
            return  # verify rounds make other calls than plain decode: no split twin to count
        # Captured taps cost no model call: fewer calls than the same programs split.
        split = suite[config.replace("zero_split", "hybrid").replace("+overlap", "")]
        assert calls < sum(len(p) for p in split.pieces.values())
    else:
        assert in_pass == 0
        assert not any(suite[config].captures.values())
