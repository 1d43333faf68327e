"""Tap metadata from a pass's batch layout (SGLang's varlen extend: the requests' tokens back to
back, ``B = 1``; ``h`` holds ``ceil(len / 64)`` chunks per request, request by request)."""

from __future__ import annotations

from collections.abc import Sequence

from .ops import ConvTap, KernelArgError

CHUNK = 64


def _starts(seq_lens: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for n in seq_lens:
        out.append(acc)
        acc += int(n)
    return out


def state_tap_chunks(
    seq_lens: Sequence[int], requests: Sequence[int], positions: Sequence[int], chunk: int = CHUNK
) -> list[int]:
    """Flat chunk index into ``h`` (``[1, NT, ...]``) of the state after ``positions[i]`` tokens
    of request ``requests[i]`` in this pass; a position must be a multiple of ``chunk`` in
    ``[0, len)`` (``h[c]`` is the state at the start of chunk c; the state at ``len`` is the
    pass's final state, already in the request's own slot)."""
    offsets, acc = [], 0
    for n in seq_lens:
        offsets.append(acc)
        acc += -(-int(n) // chunk)
    out = []
    for r, p in zip(requests, positions):
        if not 0 <= r < len(seq_lens):
            raise KernelArgError(f"sgl_kernel_ext.state_tap_chunks: no request {r}")
        n = int(seq_lens[r])
        if p % chunk or not 0 <= p < n:
            raise KernelArgError(
                f"sgl_kernel_ext.state_tap_chunks: position {p} of request {r} is not a multiple "
                f"of {chunk} in [0, {n}) (the state at {n} is the final state)"
            )
        out.append(offsets[r] + p // chunk)
    return out


def conv_taps_for(
    seq_lens: Sequence[int],
    requests: Sequence[int],
    positions: Sequence[int],
    incoming: Sequence[int],
    slots: Sequence[int],
) -> list[ConvTap]:
    """``ConvTap`` rows for taps at ``positions`` (0..len) of ``requests`` in a pass whose
    segments have lengths ``seq_lens``; ``incoming[i]``: the row of ``incoming_conv`` holding that
    request's conv state at the pass start (its MambaPool slot when ``incoming_conv`` is the
    pool's layer view), ``slots[i]``: the destination."""
    starts = _starts(seq_lens)
    return [
        ConvTap(starts[r], int(seq_lens[r]), int(p), int(i), int(s))
        for r, p, i, s in zip(requests, positions, incoming, slots)
    ]
