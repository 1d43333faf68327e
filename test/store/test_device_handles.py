"""Device handles: the packed slot ids the index keeps for a block (``store.device``)."""

from __future__ import annotations

import torch

from sglang_hybrid.index import BLOCK_TOKENS
from sglang_hybrid.store.device import block_handles, handles_to_slots, slots_to_handle


def test_block_handles_split_a_chunk_into_per_block_copies() -> None:
    row = torch.arange(10 * BLOCK_TOKENS, dtype=torch.int32) * 3 + 7  # a request's row
    for slots in (
        row[2 * BLOCK_TOKENS : 8 * BLOCK_TOKENS],  # a slice of the row, as a commit takes it
        row[2 * BLOCK_TOKENS : 8 * BLOCK_TOKENS].to(torch.int64),  # another dtype
        torch.stack([row, row], 1)[2 * BLOCK_TOKENS : 8 * BLOCK_TOKENS, 0],  # not contiguous
    ):
        got = block_handles(slots)
        want = [slots_to_handle(slots[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]) for b in range(6)]
        assert got == want and all(type(h) is bytes for h in got)
        assert torch.equal(handles_to_slots(got, "cpu"), slots.to(torch.int64))
    handles = block_handles(row[:BLOCK_TOKENS])
    row[0] = -1  # the row is reused by the next request: the handles must not see it
    assert handles_to_slots(handles, "cpu")[0].item() == 7
