"""One TP rank's view of a request stream, for ``test_rank_determinism.py``.

    python rank_stream.py MODEL_DIR OUT.json [--noise N] [--group RENDEZVOUS RANK DELAY_S]
                          [--exclusive]

Builds SGLang's real Scheduler (CPU token worker, ``--radix-cache hybrid`` with the host tier and
coalescing), runs a fixed stream (groups arriving together with new shared prefixes, multi-turn
continuations, repeats, an abort mid-prefill, pressure on a small KV pool and host tier) and
writes every pass's ``PassRecord``. ``--noise N`` allocates and frees N objects of assorted sizes
between submissions, so CPython hands out different addresses than in a run without it, as on
rank 0 (which unpickles every request) against the other ranks. ``--group`` joins a two-process
gloo group the host tier's poll MIN-all-reduces over, and delays this rank's copies by DELAY_S
each, so the ranks finish copies at different times (asynchronous host tier, issue #13).
``--exclusive`` holds each block on one tier (``index/demotion.py``): demotions are issued from
what the ranks' copies have retired, so they too must follow the agreed count.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "python"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def noise(n: int, rng: random.Random) -> None:
    keep = [bytearray(rng.randrange(1, 4096)) for _ in range(n)]
    objs = [{"k": i, "v": [i] * rng.randrange(1, 50)} for i in range(n)]
    del keep[::2], objs[1::3]


def main() -> None:
    model, out = sys.argv[1], sys.argv[2]
    n_noise = int(sys.argv[sys.argv.index("--noise") + 1]) if "--noise" in sys.argv else 0
    from checking_worker import CheckingWorker
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_hybrid.cpu.loop import InProcessScheduler
    from sglang_hybrid.sglang import plugin
    from sglang_hybrid.sglang.flags import HybridOptions
    from sglang_hybrid.sglang.ranks import RankCheck

    plugin.register()
    HookRegistry.apply_hooks()
    s = InProcessScheduler(
        model,
        worker="tokens",
        worker_class=CheckingWorker,
        page_size=1,
        chunked_prefill_size=128,
        max_total_tokens=4096,
        max_running_requests=4,
        max_mamba_cache_size=24,
        radix_cache_backend="hybrid",
        server_args_attrs={
            "_hybrid_options": HybridOptions(
                host_cache_mib=8, host_exclusive="--exclusive" in sys.argv
            )
        },
    )
    stats = {"held_back": 0}
    if "--group" in sys.argv:  # RENDEZVOUS_FILE RANK DELAY: the host tier polls over a real group
        import time

        import torch.distributed as dist

        i = sys.argv.index("--group")
        store = dist.FileStore(sys.argv[i + 1], 2)
        group = dist.ProcessGroupGloo(store, int(sys.argv[i + 2]), 2)
        delay = float(sys.argv[i + 3])
        host = s.tree_cache.host_tier
        host.group, host.world = group, 2
        agree, issue = host._agree, host.queue.issue

        def counted(k: int) -> int:  # how often this rank had finished more than all had
            got = agree(k)
            stats["held_back"] += k - got
            return got

        def slowed(op):  # this rank's copies take longer (another GPU, another load)
            return issue(lambda: (time.sleep(delay), op())[1])

        host._agree, host.queue.issue = counted, slowed
    s.tree_cache.rank_check = RankCheck(keep=True)
    s.tree_cache.coalescer.record_held()  # what --hybrid-check-ranks turns on
    data = random.Random(42)  # the stream: the same on every "rank"
    jitter = random.Random(os.getpid())  # the noise: different per process
    toks = lambda n: [data.randrange(10, 2000) for _ in range(n)]  # noqa: E731
    shared = [toks(600) for _ in range(3)]
    convs: list[list[int]] = []
    step = 0
    for wave in range(6):
        for i in range(5):
            prompt = shared[(wave + i) % 3] + toks(data.randrange(20, 200))
            if convs and data.random() < 0.4:
                prompt = data.choice(convs) + toks(30)  # a continuation
            rid = f"w{wave}-{i}"
            s.submit(rid, prompt, data.randrange(4, 60))
            convs.append(prompt)
            noise(n_noise, jitter)
        for _ in range(data.randrange(3, 12)):
            s.step()
            step += 1
            if wave == 2 and step % 7 == 0:
                s.abort(f"w{wave}-{step % 5}")
            noise(n_noise, jitter)
        s.run_until_idle()
    records = s.tree_cache.rank_check.records
    Path(out).write_text(json.dumps([list(r) for r in records]))
    stats["blocks_demoted"] = s.tree_cache.index.stats.blocks_demoted
    Path(out + ".stats").write_text(json.dumps(stats))
    s.close()


if __name__ == "__main__":
    main()
