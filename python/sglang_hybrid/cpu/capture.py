"""In-pass state capture: every linear layer's state at positions inside one model call.

SGLang's Triton GDN prefill already computes ``h``, the recurrent state at the start of every
64-token chunk of a pass, and the conv state at a position is just the last ``W - 1``
pre-convolution inputs before it (sgl-kernel-ext issue; ``gather_state_taps`` /
``gather_conv_taps`` gather both on a GPU; SGLang's own extra_buffer tracking advances a chunk
state by the few tokens to an unaligned position). ``PassCapture`` does the same inside one
transformers forward of the CPU model worker, so a zero-split tap costs no extra model call:

- the chunked gated-delta rule (``torch_chunk_gated_delta_rule``, a module global of the modeling
  module) runs segment by segment, cut only at multiples of its 64-token chunk counted from the
  call's start, so every chunk is the chunk of the uncut call (``h``). A tap at offset ``o``
  takes the state at ``c = 64 * (o // 64)``; off that grid, the rule is run once more over the
  ``o - c`` (< 64) tokens from it, its output discarded (the recompute);
- the conv function (``causal_conv1d_fn``) receives the incoming conv columns followed by the
  call's ``T`` new inputs; the window at offset ``o`` is the ``W - 1`` columns before new input
  ``o``, zero-padded on the left when the call started fresh closer than ``W - 1`` before it.

Everything else in the forward (projections, MoE, attention) runs once over all ``T`` rows.
Calls are counted: the ``k``-th call of either function belongs to the ``k``-th linear layer in
layer order (transformers runs the layers in order, one call each per prefill forward).

What a capture equals: the state a pass ending at the offset stores, up to the rounding of the
row-count-dependent GEMMs before the rule (~1e-7 relative; ``split_invariant``), exactly as a
later split of an uncached run differs. The exactness suite checks tokens against uncached runs.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .split_invariant import patched_modeling
from .state_io import PoolView

CHUNK = 64  # transformers' chunk_size for the chunked gated-delta rule (its default)
CHUNK_FN = "torch_chunk_gated_delta_rule"
CONV_FN = "causal_conv1d_fn"


class PassCapture:
    """Collects, for one model call of ``n_tokens`` new tokens, every linear layer's states at
    ``offsets`` (call-relative, strictly inside the call)."""

    def __init__(self, offsets: Sequence[int], n_tokens: int, conv_keep: int) -> None:
        bad = [o for o in offsets if not 0 < o < n_tokens]
        if bad:
            raise ValueError(f"capture offsets {bad} are not inside a call of {n_tokens} tokens")
        self.offsets = tuple(sorted(set(offsets)))
        self.n_tokens = n_tokens
        self.conv_keep = conv_keep
        # Per linear layer (call order): one tensor per offset.
        self.conv: list[list[torch.Tensor]] = []
        self.recurrent: list[list[torch.Tensor]] = []

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module, module_fns: dict[str, Any]) -> Iterator[None]:
        """Within the block, ``model``'s conv and chunked rule capture (wrapping ``module_fns``,
        the functions the modeling module holds at entry)."""
        names = {
            CONV_FN: self._conv_wrapper(module_fns[CONV_FN]),
            CHUNK_FN: self._rule_wrapper(module_fns[CHUNK_FN]),
        }
        with patched_modeling(model, names):
            yield

    def store(self, view: PoolView, offset: int, slot: int) -> None:
        """Write the states captured at ``offset`` into mamba ``slot`` (pool layout, as
        ``state_io.store_linear_states`` writes a request's own slot)."""
        dense_ids = [view.mamba_index[i] for i in sorted(view.mamba_index)]
        if len(self.conv) != len(dense_ids) or len(self.recurrent) != len(dense_ids):
            raise RuntimeError(
                f"captured {len(self.conv)} conv / {len(self.recurrent)} recurrent layer calls "
                f"for {len(dense_ids)} linear layers: the forward did not run the chunked path"
            )
        k = self.offsets.index(offset)
        for dense, conv, rec in zip(dense_ids, self.conv, self.recurrent, strict=True):
            view.conv[dense, slot].copy_(conv[k])
            view.temporal[dense, slot].copy_(rec[k][0].transpose(-1, -2))

    # ------------------------------------------------------------ the wrapped functions
    def _conv_wrapper(self, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def conv(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # [B, C, L]: L - T incoming columns, then the call's T new inputs.
            lead = hidden_states.shape[-1] - self.n_tokens
            keep = self.conv_keep
            windows = []
            for o in self.offsets:
                lo, hi = lead + o - keep, lead + o
                w = hidden_states[0, :, max(lo, 0) : hi]
                if lo < 0:
                    w = F.pad(w, (-lo, 0))
                windows.append(w.clone())
            self.conv.append(windows)
            return inner(hidden_states, *args, **kwargs)

        return conv

    def _rule_wrapper(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def rule(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            g: torch.Tensor,
            beta: torch.Tensor,
            *args: Any,
            initial_state: torch.Tensor | None = None,
            output_final_state: bool = False,
            **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if args:
                raise TypeError("the chunked rule is called with keyword state arguments")
            if kwargs.get("cu_seqlens") is not None:
                raise NotImplementedError("capture runs one unpadded sequence per call")
            n = query.shape[1]
            # Cut the rule only on its own chunk grid, at the chunk start below each offset.
            cuts = sorted({CHUNK * (o // CHUNK) for o in self.offsets} - {0})
            bounds = (0, *cuts, n)
            at: dict[int, torch.Tensor | None] = {0: initial_state}
            state = initial_state
            outs = []
            for lo, hi in itertools.pairwise(bounds):
                out, state = inner(
                    query[:, lo:hi],
                    key[:, lo:hi],
                    value[:, lo:hi],
                    g[:, lo:hi],
                    beta[:, lo:hi],
                    initial_state=state,
                    output_final_state=True,
                    **kwargs,
                )
                outs.append(out)
                at[hi] = state
            states = []
            for o in self.offsets:
                c = CHUNK * (o // CHUNK)
                base = at[c]
                if o > c:  # off the grid: advance the chunk state by o - c tokens
                    _, base = inner(
                        query[:, c:o],
                        key[:, c:o],
                        value[:, c:o],
                        g[:, c:o],
                        beta[:, c:o],
                        initial_state=base,
                        output_final_state=True,
                        **kwargs,
                    )
                assert base is not None
                states.append(base.clone())
            self.recurrent.append(states)
            return torch.cat(outs, dim=1), (state if output_final_state else None)

        return rule


def modeling_fns(model: torch.nn.Module) -> dict[str, Any]:
    """The conv and chunked-rule functions ``model``'s modeling module holds right now."""
    import importlib
    import sys

    module = sys.modules.get(type(model).__module__) or importlib.import_module(
        type(model).__module__
    )
    return {name: getattr(module, name) for name in (CONV_FN, CHUNK_FN)}
