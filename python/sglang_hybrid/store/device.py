"""Device-side bytes: copies inside SGLang's own pools (spec §7.4, §7.7, §11.3).

The index stores a block's or a tail's device copy as an opaque handle; here that handle is the
packed int32 KV slot ids (``bytes``), so the index stays free of tensors and a path's slots are one
``b"".join`` away. This module converts handles to index tensors and moves state and KV between
slots; it decides nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, cast

import numpy as np
import torch

from ..index.keys import BLOCK_TOKENS


def slots_to_handle(slots: torch.Tensor) -> bytes:
    """KV slot ids (any integer tensor) as the packed int32 handle the index keeps."""
    return slots.to(device="cpu", dtype=torch.int32).numpy().tobytes()


def block_handles(slots: torch.Tensor) -> list[bytes]:
    """The handles of consecutive 64-token blocks (``slots``: their KV slot ids, in order), one
    per block: ``slots_to_handle`` of each block's slots, split in C (a chunk's commit takes
    ~128)."""
    host = slots.to(device="cpu", dtype=torch.int32).contiguous()  # no copy if it is already
    handles: list[bytes] = host.numpy().view(f"V{4 * BLOCK_TOKENS}").tolist()
    return handles  # a void element's ``tolist`` value is its bytes (a copy, not a view)


# The index keeps device handles opaque (``object``: ``BlockNode.device``, ``tail_device``); every
# handle this package gives it is made by ``slots_to_handle``, so the converters below take what
# the index hands back and read it as those bytes.


def handle_to_slots(handle: object, device: torch.device | str) -> torch.Tensor:
    """Slot ids of a handle as int64 on ``device``: the pool's device for anything handed to
    SGLang's pools and allocators, ``"cpu"`` only for copy metadata (``store.transfer``)."""
    if not handle:
        return torch.empty(0, dtype=torch.int64, device=device)
    data = cast(bytes, handle)  # a slots_to_handle handle (see above)
    out = torch.from_numpy(np.frombuffer(data, dtype=np.int32).astype(np.int64))
    return out.to(device, non_blocking=True)  # a no-op on the CPU


def handles_to_slots(handles: Iterable[object], device: torch.device | str) -> torch.Tensor:
    """The slots of several handles, concatenated (one ``b"".join``)."""
    return handle_to_slots(b"".join(cast(list[bytes], list(handles))), device)  # (see above)


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

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self.stream is None:
            return contextlib.nullcontext()
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
        with self._on_stream():
            dst, src = dst.to(self.device, torch.int64), src.to(self.device, torch.int64)
            for buf in self.kv_buffers:
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Conv and recurrent state of every linear layer, MambaPool slot -> slot.

        A plain pair of slot copies per state tensor (one device copy of the image, spec §11.3).
        Pools with extra per-slot state (ReplaySSM rings, sibling pools) go through SGLang's own
        ``copy_from``, which knows them; on the CPU that path costs ~15 ms per call.
        """
        pool = self.mamba_pool
        with self._on_stream():
            if getattr(pool, "replayssm_write_pos", None) is not None or getattr(
                pool, "_slot_siblings", None
            ):
                idx = torch.tensor([src_slot], dtype=torch.int64, device=self.device)
                dst = torch.tensor([dst_slot], dtype=torch.int64, device=self.device)
                pool.copy_from(idx, dst)
                return
            cache = pool.mamba_cache
            for t in (*cache.conv, cache.temporal):
                t[:, dst_slot] = t[:, src_slot]

    def state_bytes(self) -> int:
        """Bytes of one MambaPool slot: the snapshot image size."""
        cache = self.mamba_pool.mamba_cache
        per_slot = 0
        for t in [*cache.conv, cache.temporal]:
            per_slot += t[:, 0].numel() * t.element_size()
        return per_slot
