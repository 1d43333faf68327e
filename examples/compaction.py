"""A compaction harness against ``--radix-cache hybrid``: cut where a state exists (issue #16).

A long conversation grows turn by turn; when its prompt passes a budget, the harness keeps a head,
replaces the middle with a (here: fixed) summary and keeps the recent tail. Before cutting it asks
the server where the head may end (``POST /hybrid/boundaries`` with the proposed cut) and cuts
there; the next request then reuses exactly the head the server said it would. Four compactions
show the four verdicts:

  aligned          the harness pinned a checkpoint at its proposal first (POST /hybrid/checkpoint)
  snapped          a checkpoint lies below the proposal within the tolerance: cut there (here
                   one the harness pinned at an earlier candidate head)
  partial-reuse    the nearest checkpoint is farther back: keep the proposed head, the tokens after
                   the checkpoint are prefilled again
  full-re-prefill  no checkpoint below the proposal

For each it prints the verdict, the reason, the tokens the server said would be kept, and the
``cached_tokens`` the next request got; they are equal. Token ids stand in for text so the run is
the same with any tokenizer.

    python examples/compaction.py                       # starts the CPU server (tiny model)
    python examples/compaction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from sglang_hybrid.client import HybridClient

# (where the harness proposes the head to end, the snap tolerance). A real harness has one
# policy; these four show the four verdicts:
#   "turn"  a little before the end of the first turn (a summariser's choice, not a turn end),
#           with a checkpoint pinned there first;
#   "below" 10 tokens before the previous proposal, a checkpoint having been pinned 40 before it;
#   "into"  20 tokens into the summary after the previous head (the head grows a little);
#   "early" inside the system prompt, before any checkpoint.
PLANS: list[tuple[str, int]] = [
    ("turn", 512),  # aligned
    ("below", 512),  # snapped
    ("into", 0),  # partial-reuse
    ("early", 512),  # full-re-prefill
]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(20, 1500) for _ in range(n)]


def run(
    client: HybridClient,
    *,
    budget: int = 1800,
    system_tokens: int = 600,
    turn_tokens: int = 170,
    reply_tokens: int = 24,
    tail_tokens: int = 300,
    seed: int = 0,
    out: Any = sys.stdout,
) -> list[dict[str, Any]]:
    """Run the conversation through one compaction per plan; one record per compaction."""
    rng = random.Random(seed)
    summary = _ids(rng, 40)
    seq = _ids(rng, system_tokens)
    first_turn_end = last_proposal = last_head = 0
    records: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None
    plans = list(PLANS)
    while plans or pending is not None:
        prompt = seq + _ids(rng, turn_tokens)
        reply, cached = client.generate(prompt, reply_tokens)
        if pending is not None:  # the first request after a compaction
            pending["cached_tokens"] = cached
            same = cached == pending["retained_prefix_tokens"]
            print(
                f"  next request reused {cached} tokens ({'as' if same else 'NOT as'} reported)",
                file=out,
            )
            records.append(pending)
            pending = None
        seq = prompt + reply
        if not first_turn_end:
            first_turn_end = len(seq)
        if len(seq) <= budget or not plans:
            continue
        name, tolerance = plans.pop(0)
        pin = None
        if name == "turn":
            proposal = pin = first_turn_end - 8
        elif name == "below":
            proposal, pin = last_proposal - 10, last_proposal - 40
        elif name == "into":
            proposal = last_head + 20
        else:
            proposal = system_tokens // 5
        last_proposal = proposal
        if pin is not None:
            point, computed = client.checkpoint(input_ids=seq[:pin])
            print(f"pinned a checkpoint at {point.position} ({computed} tokens computed)", file=out)
        plan = client.boundaries(input_ids=seq, cut=proposal, snap_tolerance=tolerance)
        cut = plan.cut
        assert cut is not None
        head = cut.retained_prefix_tokens if cut.verdict in ("aligned", "snapped") else proposal
        print(
            f"compaction at {len(seq)} tokens: proposed head {proposal}, tolerance {tolerance}: "
            f"{cut.verdict.upper()} ({cut.reason}); keep {head}, "
            f"reuse {cut.retained_prefix_tokens}",
            file=out,
        )
        pending = {
            "prompt_tokens": len(seq),
            "proposal": proposal,
            "tolerance": tolerance,
            "verdict": cut.verdict,
            "reason": cut.reason,
            "head": head,
            "retained_prefix_tokens": cut.retained_prefix_tokens,
        }
        last_head = head
        seq = seq[:head] + summary + seq[-tail_tokens:]
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="a running server (default: start the CPU server here)")
    args = p.parse_args(argv)
    if args.url:
        records = run(HybridClient(args.url))
    else:
        from sglang_hybrid.cpu.server import CpuServer, ServerConfig
        from sglang_hybrid.cpu.tiny_model import write_tiny_model

        work = Path(tempfile.mkdtemp(prefix="compaction-"))
        model = write_tiny_model(work / "model", "qwen3_next", seed=0)
        cfg = ServerConfig(model, cache="hybrid", chunked_prefill_size=256, host_cache_mib=64)
        print(f"starting the CPU server (log: {work / 'server.log'})", file=sys.stderr)
        with CpuServer(cfg, work / "server.log", on_progress=print) as server:
            records = run(HybridClient(server.url))
    ok = all(r["cached_tokens"] == r["retained_prefix_tokens"] for r in records)
    print("every next request reused what the server reported" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
