"""Request helpers shared by the server tests."""

from __future__ import annotations

import random

from sglang_hybrid.cpu.process import ManagedProcess


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 1500) for _ in range(n)]


def generate(
    server: ManagedProcess, ids: list[int], max_new: int = 8, headers: dict | None = None
) -> dict:
    """Greedy ``/generate`` on token ids (a server or a router); the reply (asserting HTTP 200)."""
    status, out = server.post_json(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}},
        headers=headers,
    )
    assert status == 200, out
    return out
