"""The tap-mode comparison (``replay/tap_modes.py``) and the replay's ``--tap-mode`` default."""

from __future__ import annotations

import argparse

import pytest

from sglang_hybrid.replay import tap_modes
from sglang_hybrid.replay.cli import resolve_tap_mode
from sglang_hybrid.sglang import inpass


def _run(cache: str, passes: int, tokens: int, p50: float, p95: float, n: int = 10) -> dict:
    summary = dict(
        requests=n,
        prefill_tokens=tokens,
        reused_tokens=0,
        ttft_p50_s=p50,
        ttft_p95_s=p95,
        ttft_mean_s=p50,
    )
    stats = {"taps_in_pass": 3, "split_declined": 2} if cache == "hybrid" else None
    return dict(
        cache=cache, extend_passes=passes, summary=summary, prefill_s=1.0, cache_stats=stats
    )


def _doc(*runs: dict, gib: float = 32.0) -> dict:
    return {"command": "replay run ...", "points": [{"device_gib": gib, "runs": list(runs)}]}


def test_every_variant_is_held_to_passes_tokens_and_ttft() -> None:
    doc = tap_modes.compare(
        [
            (
                "agent",
                {
                    "auto": _doc(
                        _run("hybrid", 170, 1050, 0.2, 1.0), _run("no_buffer", 100, 1500, 0.3, 1.5)
                    ),
                    "chunk": _doc(_run("hybrid", 108, 1009, 0.2, 1.4)),
                    "zero_split": _doc(_run("hybrid", 90, 1000, 0.2, 1.6)),
                },
            )
        ]
    )
    (row,) = doc["rows"]
    assert row["auto_passes_vs_reference"] == 1.7 and not row["auto_within_target"]
    assert row["chunk_tokens_vs_best"] == 1.009 and row["chunk_within_target"]
    # Fewer passes and tokens, but a worse TTFT p95 than no_buffer's: not within the target.
    assert not row["zero_split_ttft_ok"] and not row["zero_split_within_target"]
    md = tap_modes.markdown(doc)
    assert (
        "| agent | 32 GiB | hybrid, in-pass on the 64-token grid | 1.08 | 1.0090 | yes | yes |"
        in md
    )
    assert "| agent | 32 GiB | no_buffer | 100 |" in md


def test_mismatched_reports_are_refused() -> None:
    hy, nb = _run("hybrid", 1, 1, 0.1, 0.1), _run("no_buffer", 1, 1, 0.1, 0.1)
    with pytest.raises(ValueError, match="no zero_split run"):
        tap_modes.compare([("t", {"auto": _doc(hy, nb)})])
    with pytest.raises(ValueError, match="no no_buffer run"):
        tap_modes.compare([("t", {"zero_split": _doc(hy)})])
    with pytest.raises(ValueError, match="other budgets"):
        tap_modes.compare([("t", {"zero_split": _doc(hy, nb), "auto": _doc(hy, gib=16)})])
    with pytest.raises(ValueError, match="requests differ"):
        tap_modes.compare([("t", {"zero_split": _doc(hy, _run("no_buffer", 1, 1, 0.1, 0.1, n=9))})])
    with pytest.raises(ValueError, match="unknown variants"):
        tap_modes.compare([("t", {"zero_split": _doc(hy, nb), "fast": _doc(hy)})])


def _args(**kw) -> argparse.Namespace:
    base = dict(tap_mode="auto", capture_grid=None, split_threshold=1.0)
    return argparse.Namespace(**{**base, **kw})


def test_the_replay_default_is_what_auto_picks_on_an_h200(monkeypatch) -> None:
    args = _args()
    note = resolve_tap_mode(args)
    assert args.tap_mode == inpass.replay_default().mode == "split" and "auto -> split" in note
    with pytest.raises(SystemExit, match="add --tap-mode zero-split"):
        resolve_tap_mode(_args(capture_grid="chunk"))
    # Once stage I has verified SGLang's FlashInfer tracking on an H200, the default follows.
    monkeypatch.setitem(inpass.VERIFIED, inpass.H200_DEFAULT.key, "stage I, an H200")
    args = _args()
    resolve_tap_mode(args)
    assert (args.tap_mode, args.capture_grid) == ("zero-split", "any")
    args = _args(tap_mode="zero-split")
    assert "capture grid any" in resolve_tap_mode(args) and args.tap_mode == "zero-split"


def test_the_split_rule_prices_a_pass_as_the_clock_does() -> None:
    from sglang_hybrid.replay.clock import BatchClock

    clock = BatchClock("h200", "qwen3.5-27b")
    cost = clock.split_cost()
    # The prefill preset with one more read of the weights: a decode step's.
    assert cost.token_s == clock.prefill.token_s and cost.chunk_s == clock.prefill.chunk_s
    assert cost.weight_read_s == clock.decode.step_s == 14e-3
    assert cost.split_seconds() == clock.prefill.chunk_s + 14e-3
