"""Op qualification: every refusal is raised before any launch, with the same message whichever
path was asked for (``reference``, ``auto`` or ``cuda``), and the destination is left untouched."""

from __future__ import annotations

import pytest
import sgl_kernel_ext as kx
import torch

IMPLS = ["reference", "auto", "cuda"]


def _kv(slots=100, dtype=torch.bfloat16):
    return [torch.randn(slots, 2, 8).to(dtype) for _ in range(4)]


def _staging(n, kv):
    return torch.zeros(n, kx.bundle_layout(kv).slab_bytes, dtype=torch.uint8)


def _blocks(*starts, rows=64):
    return torch.stack([torch.arange(s, s + rows) for s in starts])


def _bad_layout(kv):
    return kx.bundle_layout(kv)._replace(row_bytes=(1, 1, 1, 1))


def kv_cases():
    kv = _kv()
    odd = kv[:3]
    non_contig = [t.transpose(1, 2) for t in kv]
    return {
        "slot out of range": (
            lambda i: kx.kv_blocks_to_staging(kv, _blocks(0, 40), _staging(2, kv), impl=i),
            r"slot 100 \(block 1, token 60\) is out of range \[0, 100\)",
        ),
        "negative slot": (
            lambda i: kx.staging_to_kv_blocks(_staging(1, kv), kv, torch.full((1, 64), -1), impl=i),
            r"slot -1 .* out of range",
        ),
        "duplicate destination slot": (
            lambda i: kx.staging_to_kv_blocks(_staging(2, kv), kv, _blocks(0, 30), impl=i),
            "duplicate destination slot 30",
        ),
        "more than 64 rows": (
            lambda i: kx.kv_blocks_to_staging(kv, _blocks(0, rows=65), _staging(1, kv), impl=i),
            "1..64 token slots, got 65",
        ),
        "staging dtype": (
            lambda i: kx.kv_blocks_to_staging(kv, _blocks(0), torch.zeros(1, 8192), impl=i),
            "staging must be a 2-dim uint8 tensor",
        ),
        "staging too small": (
            lambda i: kx.kv_blocks_to_staging(
                kv, _blocks(0), torch.zeros(1, 100, dtype=torch.uint8), impl=i
            ),
            "must be contiguous and hold 8192 bytes",
        ),
        "staging rows vs blocks": (
            lambda i: kx.kv_blocks_to_staging(kv, _blocks(0, 30), _staging(3, kv), impl=i),
            "staging has 3 rows for 2 blocks",
        ),
        "odd buffer count": (
            lambda i: kx.kv_blocks_to_staging(odd, _blocks(0), _staging(1, kv), impl=i),
            "K buffers then V buffers",
        ),
        "rows not contiguous": (
            lambda i: kx.kv_blocks_to_staging(non_contig, _blocks(0), _staging(1, kv), impl=i),
            r"kv_buffers\[0\]: each token row must be contiguous",
        ),
        "layer out of range": (
            lambda i: kx.kv_blocks_to_staging(kv, _blocks(0), _staging(1, kv), layers=[2], impl=i),
            r"layer 2 \(entry 0\) is out of range \[0, 2\)",
        ),
        "duplicate layer": (
            lambda i: kx.staging_to_kv_blocks(
                _staging(1, kv), kv, _blocks(0), layers=[1, 1], impl=i
            ),
            "duplicate destination layer 1",
        ),
        "ragged slot lists": (
            lambda i: kx.kv_blocks_to_staging(kv, [[0, 1], [2]], _staging(2, kv), impl=i),
            "rows of different lengths",
        ),
        "float slot lists": (
            lambda i: kx.kv_blocks_to_staging(kv, torch.zeros(1, 64), _staging(1, kv), impl=i),
            "slot_lists must be an integer tensor",
        ),
        "layout mismatch": (
            lambda i: kx.kv_blocks_to_staging(
                kv, _blocks(0), _staging(1, kv), layout=_bad_layout(kv), impl=i
            ),
            r"layout does not match kv_buffers\[0\]",
        ),
    }


def state_cases():
    h = torch.randn(1, 4, 2, 4, 8).bfloat16()
    pool = torch.zeros(3, 6, 2, 4, 8)
    return {
        "chunk out of range": (
            lambda i: kx.gather_state_taps(h, pool, [(4, 0)], impl=i),
            r"chunk 4 \(entry 0\) is out of range \[0, 4\)",
        ),
        "slot out of range": (
            lambda i: kx.gather_state_taps(h, pool, [(0, 6)], impl=i),
            r"slot 6 \(entry 0\) is out of range \[0, 6\)",
        ),
        "duplicate destination slot": (
            lambda i: kx.gather_state_taps(h, pool, [(0, 2), (1, 2)], impl=i),
            "duplicate destination slot 2",
        ),
        "duplicate layer": (
            lambda i: kx.gather_state_taps([h, h], pool, [(0, 1)], layers=[1, 1], impl=i),
            "duplicate destination layer 1",
        ),
        "layer out of range": (
            lambda i: kx.gather_state_taps(h, pool, [(0, 1)], layers=[3], impl=i),
            r"layer 3 \(entry 0\) is out of range \[0, 3\)",
        ),
        "layer count": (
            lambda i: kx.gather_state_taps(h, pool, [(0, 1)], layers=[0, 1], impl=i),
            "layers has 2 entries for 1 input layers",
        ),
        "integer dtype": (
            lambda i: kx.gather_state_taps(h.int(), pool, [(0, 1)], impl=i),
            "h dtype torch.int32 is not float32, float16 or bfloat16",
        ),
        "state shape": (
            lambda i: kx.gather_state_taps(h[..., :4], pool, [(0, 1)], impl=i),
            "state shape .* differs from the pool's",
        ),
        "state not contiguous": (
            lambda i: kx.gather_state_taps(
                h.transpose(-1, -2).contiguous().transpose(-1, -2), pool, [(0, 1)], impl=i
            ),
            r"\[H, V, K\] state of h and of the pool must be contiguous",
        ),
        "taps shape": (
            lambda i: kx.gather_state_taps(h, pool, torch.zeros(2, 3, dtype=torch.long), impl=i),
            r"taps must be \[n, 2\], got shape \[2, 3\]",
        ),
        "layers of different shapes": (
            lambda i: kx.gather_state_taps([h, h[:, :2]], pool, [(0, 1)], impl=i),
            "every layer needs the same shape",
        ),
        "pool dims": (
            lambda i: kx.gather_state_taps(h, pool[0], [(0, 1)], impl=i),
            r"ssm_states must be \[layers, slots, H, V, K\]",
        ),
    }


def conv_cases():
    x = torch.randn(10, 6).bfloat16()
    pool = torch.zeros(2, 8, 6, 3).bfloat16()
    inc = torch.zeros(4, 6, 3).bfloat16()
    return {
        "position past the segment": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 6, 0, 1)], inc, impl=i),
            "tap 0: position 6 is outside 0..5",
        ),
        "negative position": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, -1, 0, 1)], inc, impl=i),
            "position -1 is outside",
        ),
        "segment outside the pass": (
            lambda i: kx.gather_conv_taps(x, pool, [(6, 5, 4, 0, 1)], inc, impl=i),
            r"tap 0: segment \[6, 11\) is outside mixed_qkv's 10 tokens",
        ),
        "slot out of range": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 4, 0, 8)], inc, impl=i),
            r"slot 8 \(entry 0\) is out of range \[0, 8\)",
        ),
        "duplicate destination slot": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 4, 0, 1), (5, 5, 5, 0, 1)], inc, impl=i),
            "duplicate destination slot 1",
        ),
        "incoming needed": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 5, 0, 1), (0, 5, 2, 0, 2)], impl=i),
            "tap 1 at position 2 < W = 3 needs incoming_conv",
        ),
        "incoming row out of range": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 1, 4, 1)], inc, impl=i),
            r"incoming row 4 \(entry 0\) is out of range \[0, 4\)",
        ),
        "destination overlaps an incoming state read": (
            lambda i: kx.gather_conv_taps(
                x, pool, [(0, 5, 1, 3, 1), (5, 5, 0, 2, 3)], pool[0:1], impl=i
            ),
            "a destination slot overlaps an incoming conv state read by the same launch",
        ),
        "channel mismatch": (
            lambda i: kx.gather_conv_taps(x[:, :5], pool, [(0, 5, 4, 0, 1)], inc, impl=i),
            r"does not match mixed_qkv's D = 5",
        ),
        "integer dtype": (
            lambda i: kx.gather_conv_taps(x.int(), pool, [(0, 5, 4, 0, 1)], inc, impl=i),
            "mixed_qkv dtype torch.int32 is not",
        ),
        "incoming shape": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 1, 0, 1)], inc[:, :, :2], impl=i),
            r"incoming_conv rows must be \[D, W\] = \[6, 3\]",
        ),
        "taps width": (
            lambda i: kx.gather_conv_taps(x, pool, [(0, 5, 4, 1)], inc, impl=i),
            r"taps must be \[n, 5\]",
        ),
    }


def _all_cases():
    out = []
    for group, cases in (("kv", kv_cases), ("state", state_cases), ("conv", conv_cases)):
        out += [pytest.param(group, name, id=f"{group}: {name}") for name in cases()]
    return out


GROUPS = {"kv": kv_cases, "state": state_cases, "conv": conv_cases}


@pytest.mark.parametrize(("group", "name"), _all_cases())
def test_refused_identically_on_every_path(group, name):
    messages = set()
    for impl in IMPLS:
        call, pattern = GROUPS[group]()[name]
        with pytest.raises(kx.KernelArgError, match=pattern) as e:
            call(impl)
        messages.add(str(e.value))
    assert len(messages) == 1, messages


def test_a_refused_scatter_leaves_the_destination_untouched():
    kv = _kv()
    before = [t.clone() for t in kv]
    slots = _blocks(0, 30)  # slots 30..63 appear twice
    with pytest.raises(kx.KernelArgError):
        kx.staging_to_kv_blocks(_staging(2, kv).fill_(1), kv, slots)
    assert all(torch.equal(a, b) for a, b in zip(kv, before))


def test_impl_selection():
    kv = _kv()
    good = (kv, _blocks(0), _staging(1, kv))
    with pytest.raises(kx.KernelArgError, match="impl='cuda' needs CUDA tensors"):
        kx.kv_blocks_to_staging(*good, impl="cuda")
    with pytest.raises(kx.KernelArgError, match="impl must be one of"):
        kx.kv_blocks_to_staging(*good, impl="triton")
    assert kx.kv_blocks_to_staging(*good) == 64 * 4 * 32  # auto on CPU: the reference
    assert kx.kv_blocks_to_staging(kv, torch.zeros(0, 64, dtype=torch.long), _staging(0, kv)) == 0
