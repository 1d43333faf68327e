"""Two CPU servers sharing one Mooncake Store (``--hybrid-l3``, issue #39), on loopback.

The fixture starts ``mooncake_master`` (with its embedded HTTP metadata server) and one
``mooncake_client`` storage process, then two real SGLang servers (the tiny Qwen3-Next,
``--radix-cache hybrid``) pointed at the store. A conversation started on server A continues on
server B, which never saw it, with its state and KV from the store; B's output equals the
uncached output (the same prompt under a fresh ``cache_salt`` reuses nothing, which is asserted).
Then A is restarted, without a cache file, and resumes the conversation from the store; then the
master is killed and both servers go on serving.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from server_helpers import generate, toks

from sglang_hybrid.cpu.server import CpuServer, ServerConfig
from sglang_hybrid.index.keys import BLOCK_TOKENS
from sglang_hybrid.index.l3_keys import chain_digests, snapshot_digest
from sglang_hybrid.sglang.request import token_bytes
from sglang_hybrid.store.l3.backend import parse_url
from sglang_hybrid.store.l3.local_store import LocalMooncake, mooncake_usable

pytestmark = pytest.mark.skipif(mooncake_usable() is not None, reason=str(mooncake_usable()))


class Runs(NamedTuple):
    turn1: dict
    turn2_b: dict  # the continuation on B
    turn2_uncached: dict  # the same prompt on B under a fresh cache_salt
    turn3_restarted: dict  # the next turn on A restarted without a cache file
    after_kill: list[dict]  # both servers with the master dead
    logs: dict[str, str]
    stored: dict[int, int]  # turn -> the deepest snapshot of it the servers wrote to the store


def _key_base(log: str) -> str:
    m = re.search(r"L3 mooncake://\S+: objects keyed (\S+) \(rank 0", log)
    assert m, log[-3000:]
    return m.group(1)


def _stored_frontier(store: LocalMooncake, base: str, ids: list[int], least: int) -> int:
    """The deepest snapshot of ``ids`` the servers stored, once one at ``least`` or deeper is
    (the write thread runs after the request finished)."""
    from sglang_hybrid.store.l3.mooncake import MooncakeBackend

    data = token_bytes(ids)
    d = chain_digests(data, 0, len(ids) // BLOCK_TOKENS, None)
    keys = {
        f: f"{base}-s-{snapshot_digest(d[f // 64 - 1], f, data[4 * (f - f % 64) : 4 * f]).hex()}"
        for f in range(BLOCK_TOKENS, len(ids))
    }
    backend = MooncakeBackend(parse_url(store.url))
    try:
        end = time.monotonic() + 30
        while True:
            found = [f for f, ok in zip(keys, backend.exists(list(keys.values()))) if ok]
            if found and max(found) >= least:
                return max(found)
            assert time.monotonic() < end, f"no snapshot of {len(ids)} tokens at {least}+: {found}"
            time.sleep(0.1)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def runs(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("l3")
    model = tiny_models["qwen3_next"]
    logs: dict[str, str] = {}
    with LocalMooncake(root, segment_mib=128) as store:

        def cfg() -> ServerConfig:  # one each: a server writes its port into its config
            return ServerConfig(
                model,
                cache="hybrid",
                chunked_prefill_size=128,
                host_cache_mib=64,
                extra=["--hybrid-l3", store.url],
            )

        turn1_ids = toks(71, 300)
        stored: dict[int, int] = {}  # turn -> the deepest snapshot of it in the store
        with CpuServer(cfg(), root / "b.log", on_progress=print) as b:
            with CpuServer(cfg(), root / "a.log", on_progress=print) as a:
                turn1 = generate(a, turn1_ids)
                base = _key_base(a.log_path.read_text(errors="replace"))
                stored[1] = _stored_frontier(store, base, turn1_ids + turn1["output_ids"], 256)
            logs["a"] = a.log_path.read_text(errors="replace")
            turn2_ids = turn1_ids + turn1["output_ids"] + toks(72, 70)
            turn2_b = generate(b, turn2_ids)
            status, turn2_uncached = b.post_json(
                "/generate",
                {
                    "input_ids": turn2_ids,
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                    "cache_salt": "a-fresh-namespace",
                },
            )
            assert status == 200, turn2_uncached
            seq2 = turn2_ids + turn2_b["output_ids"]
            stored[2] = _stored_frontier(store, base, seq2, stored[1] + BLOCK_TOKENS)
            turn3_ids = turn2_ids + turn2_b["output_ids"] + toks(73, 40)
            with CpuServer(cfg(), root / "a-restarted.log", on_progress=print) as a2:
                turn3 = generate(a2, turn3_ids)
                store.kill_master()
                after = [generate(s, toks(80 + i, 300)) for i, s in enumerate((a2, b, a2))]
            logs["a-restarted"] = a2.log_path.read_text(errors="replace")
        logs["b"] = b.log_path.read_text(errors="replace")
    yield Runs(turn1, turn2_b, turn2_uncached, turn3, after, logs, stored)


def test_a_conversation_started_on_a_continues_on_b_from_the_store(runs: Runs) -> None:
    meta = runs.turn2_b["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    # turn 1's deepest snapshot came from the store (B never saw turn 1)
    assert meta["cached_tokens"] == runs.stored[1], (meta, runs.stored)
    assert details.get("hybrid_l3_tokens", 0) == runs.stored[1], meta


def test_bs_output_equals_the_uncached_one(runs: Runs) -> None:
    assert runs.turn2_uncached["meta_info"]["cached_tokens"] == 0, runs.turn2_uncached
    assert runs.turn2_b["output_ids"] == runs.turn2_uncached["output_ids"]


def test_a_server_restarted_without_a_cache_file_resumes_from_the_store(runs: Runs) -> None:
    meta = runs.turn3_restarted["meta_info"]
    assert meta["cached_tokens"] == runs.stored[2], (meta, runs.stored)  # written by B
    assert (meta.get("cached_tokens_details") or {}).get("hybrid_l3_tokens", 0) > 0, meta


def test_the_master_killed_mid_run_costs_only_l3(runs: Runs) -> None:
    assert all(len(r["output_ids"]) == 8 for r in runs.after_kill), runs.after_kill
    log = runs.logs["a-restarted"]
    assert log.count("is off:") == 1, log[-3000:]  # logged once, however many requests follow
    assert "Traceback" not in log
