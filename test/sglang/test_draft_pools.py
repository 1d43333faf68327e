"""Which draft KV pools the cache copies with the target's (``sglang/draft.py``, issue #14).

The end-to-end checks are in ``test_speculative.py`` (the CPU workers' MTP layer pool, found
through SGLang's scheduler and copied with every tail and host restore) and the exactness suite's
``+mtp`` configurations; here the selection rules on stand-in runners.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hybrid.index import ConfigError
from sglang_hybrid.sglang.draft import collect
from sglang_hybrid.store.device import DevicePools


def _pool(layers: int = 1, **extra: object) -> SimpleNamespace:
    bufs = [torch.zeros(8, 2, 4) for _ in range(layers)]
    return SimpleNamespace(k_buffer=bufs, v_buffer=[b.clone() for b in bufs], **extra)


def _target() -> SimpleNamespace:
    kv = SimpleNamespace(full_kv_pool=_pool(2))
    r2t = SimpleNamespace(mamba_pool=object())
    return SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=kv, req_to_token_pool=r2t))


def _spec(*runners: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(_draft_model_runners=lambda: runners)


def test_draft_pools_are_collected_once_and_the_targets_left_out() -> None:
    target = _target()
    r2t = target.model_runner.req_to_token_pool
    mtp = _pool()
    runners = (
        SimpleNamespace(token_to_kv_pool=mtp, req_to_token_pool=r2t),
        SimpleNamespace(token_to_kv_pool=mtp, req_to_token_pool=r2t),  # multi-step: one pool
        SimpleNamespace(
            token_to_kv_pool=target.model_runner.token_to_kv_pool, req_to_token_pool=r2t
        ),
    )
    assert collect(_spec(*runners), target) == (mtp,)
    assert collect(SimpleNamespace(), target) == ()  # a worker without draft runners (NGRAM)


def test_a_draft_with_recurrent_state_of_its_own_is_refused() -> None:
    target = _target()
    own = SimpleNamespace(mamba_pool=object())
    runner = SimpleNamespace(token_to_kv_pool=_pool(), req_to_token_pool=own)
    with pytest.raises(ConfigError, match="keeps recurrent state of its own"):
        collect(_spec(runner), target)


def test_a_draft_pool_with_per_token_scales_is_refused() -> None:
    target = _target()
    scaled = _pool(k_scale_buffer=[0], v_scale_buffer=[0])
    runner = SimpleNamespace(
        token_to_kv_pool=scaled, req_to_token_pool=target.model_runner.req_to_token_pool
    )
    with pytest.raises(ConfigError, match="per-token scales"):
        collect(_spec(runner), target)


def test_draft_layers_follow_the_targets_in_k_then_v_order() -> None:
    """``kv_buffers`` is every K buffer then every V buffer, the draft's after the target's: the
    order the slab layout and the copies read (``store/layout.py``)."""
    target, draft = _pool(2), _pool(1)
    pools = DevicePools(SimpleNamespace(full_kv_pool=target), None, "cpu", (draft,))  # type: ignore[arg-type]
    want = [*target.k_buffer, *draft.k_buffer, *target.v_buffer, *draft.v_buffer]
    assert all(a is b for a, b in zip(pools.kv_buffers, want, strict=True))
    assert pools.draft_layers == 1
    wrapped = DevicePools(target, None, "cpu", (SimpleNamespace(full_kv_pool=draft),))  # type: ignore[arg-type]
    assert wrapped.draft_kv_pools == (draft,)  # a hybrid draft pool's buffers are its full pool's
    pools.copy_kv(torch.tensor([5]), torch.tensor([1]))
    draft.k_buffer[0][1] = 7.0
    pools.copy_kv(torch.tensor([6]), torch.tensor([1]))
    assert float(draft.k_buffer[0][6, 0, 0]) == 7.0  # a tail copy moves the draft's rows too
