"""tritoninfer.quantization: packbits / segment_packbits against numpy.packbits (via the reference),
and the quantize_fp8 helper."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import tritoninfer
from tritoninfer import quantization as q
from tritoninfer import reference as ref

from conftest import DEVICE, ON_GPU


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 100])
def test_packbits_matches_numpy(n, bitorder):
    x = torch.rand(n, device=DEVICE) < 0.5
    got = q.packbits(x, bitorder)
    want = np.packbits(x.cpu().numpy(), bitorder=bitorder)
    assert got.dtype == torch.uint8 and got.device == x.device and got.shape == ((n + 7) // 8,)
    assert got.cpu().numpy().tolist() == want.tolist()
    assert torch.equal(got, ref.packbits(x, bitorder))


def test_packbits_default_is_big_and_nonbool_inputs():
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], device=DEVICE)
    assert q.packbits(x).tolist() == [128, 128]
    assert q.packbits(x, "little").tolist() == [1, 1]
    xf = torch.tensor([0.5, 0.0, -2.0], device=DEVICE)  # nonzero means 1
    assert q.packbits(xf).tolist() == [0b10100000]


SEGMENTS = [
    [3, 0, 8, 9, 1, 17, 16],
    [0],
    [0, 0],
    [5],
    [64, 7],
]


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("lens", SEGMENTS, ids=lambda lens: "-".join(map(str, lens)))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_segment_packbits_matches_reference(lens, bitorder, dtype):
    indptr = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=dtype, device=DEVICE)
    x = torch.rand(sum(lens), device=DEVICE) < 0.5
    y, new_indptr = q.segment_packbits(x, indptr, bitorder)
    ry, rindptr = ref.segment_packbits(x, indptr, bitorder)
    assert y.dtype == torch.uint8 and new_indptr.dtype == dtype
    assert torch.equal(new_indptr, rindptr) and torch.equal(y, ry)
    assert (new_indptr[1:] - new_indptr[:-1]).tolist() == [(n + 7) // 8 for n in lens]
    # each segment on its own is numpy.packbits of that segment
    for i, n in enumerate(lens):
        seg = x[int(indptr[i]):int(indptr[i + 1])].cpu().numpy()
        assert y[int(new_indptr[i]):int(new_indptr[i + 1])].cpu().numpy().tolist() == \
            np.packbits(seg, bitorder=bitorder).tolist()


def test_segment_packbits_attention_mask_use():
    """The packed custom-mask use: per-request flattened [qo, kv] masks, little bit order."""
    masks = [torch.rand(3, 5, device=DEVICE) < 0.5, torch.rand(2, 4, device=DEVICE) < 0.5]
    flat = torch.cat([m.flatten() for m in masks])
    indptr = torch.tensor([0, 15, 23], dtype=torch.int32, device=DEVICE)
    y, new_indptr = q.segment_packbits(flat, indptr, bitorder="little")
    assert new_indptr.tolist() == [0, 2, 3]
    # unpack and compare bit by bit: bit j of segment i is byte j // 8, bit j % 8 (LSB first)
    for i, m in enumerate(masks):
        seg = y[int(new_indptr[i]):int(new_indptr[i + 1])].long()
        j = torch.arange(m.numel(), device=DEVICE)
        bits = (seg[j // 8] >> (j % 8)) & 1
        assert torch.equal(bits.bool(), m.flatten())


def test_packbits_errors():
    x = torch.ones(4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="bitorder"):
        q.packbits(x, "middle")
    with pytest.raises(ValueError, match="bitorder"):
        q.segment_packbits(x, torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), "LITTLE")
    with pytest.raises(ValueError, match="indptr"):
        q.segment_packbits(x, torch.tensor([0.0, 4.0], device=DEVICE))
    with pytest.raises(ValueError, match="indptr"):
        q.segment_packbits(x, torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="indptr"):
        q.segment_packbits(x, torch.tensor([0, 9], dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="x"):
        q.packbits([1, 0, 1])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, "float8_e4m3fn", "e5m2"])
def test_quantize_fp8(dtype):
    x = torch.randn(7, 2, 16, device=DEVICE, dtype=torch.bfloat16) * 3
    x_fp8, scale = q.quantize_fp8(x, dtype)
    fp8 = x_fp8.dtype
    assert fp8 in (torch.float8_e4m3fn, torch.float8_e5m2) and x_fp8.shape == x.shape
    assert isinstance(scale, float)
    amax = x.float().abs().max().item()
    assert scale == pytest.approx(amax / torch.finfo(fp8).max, rel=1e-6)
    # the largest element maps to the format's max; dequantised error is within half an fp8 ulp
    assert x_fp8.float().abs().max().item() == pytest.approx(torch.finfo(fp8).max, rel=2 ** -3)
    deq = x_fp8.float() * scale
    rel_ulp = 2.0 ** -3 if fp8 == torch.float8_e4m3fn else 2.0 ** -2
    err = (deq - x.float()).abs()
    assert bool((err <= x.float().abs() * rel_ulp / 2 + scale * 2 ** -9 + 1e-12).all())


def test_quantize_fp8_zeros_and_errors():
    z, scale = q.quantize_fp8(torch.zeros(4, 8, device=DEVICE))
    assert scale == 1.0 and z.dtype == torch.float8_e4m3fn and not bool(z.float().any())
    e, scale = q.quantize_fp8(torch.zeros(0, device=DEVICE))
    assert scale == 1.0 and e.numel() == 0
    with pytest.raises(ValueError, match="dtype"):
        q.quantize_fp8(torch.ones(3, device=DEVICE), torch.float16)
    with pytest.raises(ValueError, match="x"):
        q.quantize_fp8(torch.tensor([1.0, float("inf")], device=DEVICE))
    with pytest.raises(ValueError, match="x"):
        q.quantize_fp8(torch.ones(3, dtype=torch.int32, device=DEVICE))


SIGNATURES = {
    "packbits": "(x: torch.Tensor, bitorder: str = 'big') -> torch.Tensor",
    "segment_packbits": "(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = 'big') "
    "-> Tuple[torch.Tensor, torch.Tensor]",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_flashinfer(name):
    fn = getattr(q, name)
    assert str(inspect.signature(fn, eval_str=True)).replace("typing.", "") == SIGNATURES[name]
    assert name in q.__all__ and getattr(tritoninfer, name) is fn


def test_quantize_fp8_is_exported():
    assert "quantize_fp8" in q.__all__ and tritoninfer.quantize_fp8 is q.quantize_fp8


@pytest.mark.gpu
def test_gpu_segment_packbits_large():
    lens = torch.randint(0, 5000, (257,)).tolist()
    indptr = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device="cuda")
    x = torch.rand(sum(lens), device="cuda") < 0.3
    y, new_indptr = q.segment_packbits(x, indptr, "little")
    ry, rindptr = ref.segment_packbits(x, indptr, "little")
    assert torch.equal(new_indptr, rindptr) and torch.equal(y, ry)
    assert torch.equal(q.packbits(x, "little"), ref.packbits(x, "little"))
    assert ON_GPU
