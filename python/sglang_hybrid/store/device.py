"""Device-side bytes: copies inside SGLang's own pools (spec §7.4, §7.7, §11.3).

The index stores a block's or a tail's device copy as an opaque handle (``handles.py``: packed
slot ids, or a device tensor of them); this module moves state and KV between slots; it decides
nothing.

Streams (issue #35). Under overlap scheduling the copies are enqueued on SGLang's forward stream
(``DevicePools.stream``), which orders them after the pass that wrote their sources and before
the next pass that reads their destinations. Their index tensors and freshly allocated pages are
made on the caller's stream (SGLang's schedule stream), so every copy first makes the forward
stream wait for it (a device-side wait, never the host) and marks those tensors used by the
forward stream (``record_stream``), so the caching allocator does not hand their memory to the
next scheduling tensor before the copy has read them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .handles import (
    DeviceSlots,
    block_handles,
    handle_to_slots,
    handles_to_slots,
    slots_to_handle,
    to_device,
)

__all__ = [
    "DevicePools",
    "DeviceSlots",
    "block_handles",
    "handle_to_slots",
    "handles_to_slots",
    "pool_device",
    "register_pool_device",
    "slots_to_handle",
    "to_device",
]


# A stand-in for a GPU (``cpu/stream_model``) presents SGLang's CPU pools as a CUDA device while
# it is installed, so the cache takes its CUDA branches there; registration only.
_pool_device_view: list[Callable[[Any], torch.device] | None] = [None]


def register_pool_device(
    view: Callable[[Any], torch.device] | None,
) -> Callable[[Any], torch.device] | None:
    """Install ``view`` (a pool's ``device`` attribute -> the device the cache sees); returns
    the previous one, for the caller to restore."""
    previous, _pool_device_view[0] = _pool_device_view[0], view
    return previous


def pool_device(pool: Any) -> torch.device:
    """The device of an SGLang pool, as the cache sees it (see ``register_pool_device``)."""
    view = _pool_device_view[0]
    return view(pool.device) if view is not None else torch.device(pool.device)


class MambaState(Protocol):
    """What is read of SGLang's ``MambaPool.State``: per-layer-group conv tensors and the
    recurrent (temporal) tensor, ``[linear layers, slots, ...]`` each."""

    @property
    def conv(self) -> Sequence[torch.Tensor]: ...
    @property
    def temporal(self) -> torch.Tensor: ...


class MambaPoolLike(Protocol):
    """What is used of SGLang's ``MambaPool``."""

    @property
    def mamba_cache(self) -> MambaState: ...
    def copy_from(self, src_indices: torch.Tensor, dst_indices: torch.Tensor) -> object: ...


class DevicePools:
    """SGLang's device pools seen as byte stores: the KV pool and the MambaPool, and the draft
    model's KV pools under speculative decoding (same slot ids as the target's: a block's KV is
    its rows in all of them)."""

    def __init__(
        self,
        # SGLang's KV pool: a plain MHA pool or a hybrid one whose full_kv_pool holds the buffers
        kv_pool: Any,
        mamba_pool: MambaPoolLike,
        device: torch.device | str,
        draft_kv_pools: Sequence[Any] = (),
    ) -> None:
        self.kv_pool = kv_pool
        self.mamba_pool = mamba_pool
        # A draft runner of a hybrid model may build a hybrid pool too: its full_kv_pool holds them
        self.draft_kv_pools = tuple(getattr(p, "full_kv_pool", p) for p in draft_kv_pools)
        # a torch.device whatever was passed: HostTier's copy queue reads device.type
        self.device = torch.device(device)
        # The CUDA stream the copies are enqueued on (None: the current one). Under overlap
        # scheduling it is SGLang's forward stream, which orders them between passes.
        self.stream: torch.cuda.Stream | None = None

    def _on_stream(self, *used: torch.Tensor) -> contextlib.AbstractContextManager[object]:
        """The copy stream for the caller's work: ordered after what the caller's stream
        enqueued so far, and ``used`` (tensors made there) kept until it has read them."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in used:
            t.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    @property
    def kv_buffers(self) -> list[torch.Tensor]:
        """Every full-attention layer's K buffer, then every V buffer, ``[slots, heads,
        head_dim]`` each: the target's layers, then the draft pools' (``draft_layers``)."""
        pools = [getattr(self.kv_pool, "full_kv_pool", self.kv_pool), *self.draft_kv_pools]
        return [b for p in pools for b in p.k_buffer] + [b for p in pools for b in p.v_buffer]

    @property
    def draft_layers(self) -> int:
        """Attention layers of the draft pools: the last ones of ``kv_buffers``' K and V."""
        return sum(len(p.k_buffer) for p in self.draft_kv_pools)

    def copy_kv(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """K and V of every full-attention layer, token slots ``src`` -> ``dst``.

        Plain index copies: SGLang's ``move_kv_cache`` needs a pool built with its copy kernels
        enabled, which a default server does not do.
        """
        if not dst.numel():
            return
        with self._on_stream(dst, src):
            dst, src = dst.to(self.device, torch.int64), src.to(self.device, torch.int64)
            for buf in self.kv_buffers:
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def copy_state(self, src: int | torch.Tensor, dst: int | torch.Tensor) -> None:
        """Conv and recurrent state of every linear layer, MambaPool slot -> slot. A slot is a
        host int, or a one-element device tensor (a slot id the host does not know without
        waiting: a request's own slot right after its pass was launched).

        A plain pair of slot copies per state tensor (one device copy of the image, spec §11.3).
        Pools with extra per-slot state (ReplaySSM rings, sibling pools) go through SGLang's own
        ``copy_from``, which knows them; on the CPU that path costs ~15 ms per call.
        """
        pool = self.mamba_pool
        used = [x for x in (src, dst) if isinstance(x, torch.Tensor)]
        with self._on_stream(*used):
            if getattr(pool, "replayssm_write_pos", None) is not None or getattr(
                pool, "_slot_siblings", None
            ):
                pool.copy_from(self._slot_index(src), self._slot_index(dst))
                return
            cache = pool.mamba_cache
            if not used:
                for t in (*cache.conv, cache.temporal):
                    t[:, dst] = t[:, src]
                return
            s, d = self._slot_index(src), self._slot_index(dst)
            for t in (*cache.conv, cache.temporal):
                t.index_copy_(1, d, t.index_select(1, s))

    def _slot_index(self, slot: int | torch.Tensor) -> torch.Tensor:
        """A slot as a one-element int64 index on the pools' device (no host wait)."""
        if isinstance(slot, torch.Tensor):
            return slot.reshape(1).to(torch.int64)
        return to_device(torch.tensor([slot], dtype=torch.int64), self.device)

    def state_bytes(self) -> int:
        """Bytes of one MambaPool slot: the snapshot image size."""
        cache = self.mamba_pool.mamba_cache
        per_slot = 0
        for t in [*cache.conv, cache.temporal]:
            per_slot += t[:, 0].numel() * t.element_size()
        return per_slot
