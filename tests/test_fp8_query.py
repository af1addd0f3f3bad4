"""fp8 queries in prefill: ``single_prefill_with_kv_cache(q, k, v, scale_q, scale_k, scale_v, o_dtype=...)``
with e4m3/e5m2 q, k, v and per-head float32 scales (FlashInfer 0.5.3's fa3 fp8 path, as in its
``tests/attention/test_hopper_fp8_attention.py``). The block-sparse wrapper's fp8 path is in
``test_sparse.py``.

Each case is checked tightly against the float32 reference on the same fp8 values and scales, and
loosely against the unquantised data (the quantisation error, :data:`FP8_VS_UNQUANTIZED`).
"""

import pytest
import torch

from tritoninfer import reference as ref
from tritoninfer import single_prefill_with_kv_cache
from tritoninfer.testing import FP8_VS_UNQUANTIZED, assert_close, assert_lse_close, randn

from conftest import DEVICE


def _quant_per_head(x: torch.Tensor, dtype, head_dim: int = 1):
    """Per-head symmetric quantisation (FlashInfer's test helper): ``x ~ x_fp8 * scale[head]``."""
    amax = x.float().abs().amax(dim=tuple(d for d in range(x.dim()) if d != head_dim))
    scale = torch.clamp(amax / torch.finfo(dtype).max, min=1e-6)
    shape = [1] * x.dim()
    shape[head_dim] = -1
    return (x.float() / scale.view(shape)).to(dtype), scale.float()


@pytest.mark.parametrize("fp8,qo_len,kv_len,hq,hk,o_dtype,opts", [
    pytest.param(torch.float8_e4m3fn, 13, 13, 2, 2, torch.float16, dict(causal=True), id="e4m3-causal"),
    pytest.param(torch.float8_e5m2, 5, 21, 4, 2, torch.float32, dict(lse=True), id="e5m2-gqa-lse"),
    pytest.param(torch.float8_e4m3fn, 9, 17, 2, 1, torch.bfloat16, dict(mask=True, layout="HND"), id="mask-hnd"),
    pytest.param(torch.float8_e4m3fn, 7, 30, 2, 2, torch.float16, dict(window=4, soft_cap=True, causal=True),
                 id="window-cap"),
    pytest.param(torch.float8_e5m2, 6, 11, 3, 3, torch.float16, dict(alibi=True, partial_scales=True), id="alibi"),
])
def test_single_prefill_fp8_queries(fp8, qo_len, kv_len, hq, hk, o_dtype, opts):
    gen = torch.Generator().manual_seed(qo_len * 31 + kv_len)
    D = 16
    q = randn((qo_len, hq, D), torch.float16, DEVICE, gen)
    k = randn((kv_len, hk, D), torch.float16, DEVICE, gen)
    v = randn((kv_len, hk, D), torch.float16, DEVICE, gen)
    (q8, sq), (k8, sk), (v8, sv) = (_quant_per_head(x, fp8) for x in (q, k, v))
    if opts.get("partial_scales"):
        sk = None  # ones
    layout = opts.get("layout", "NHD")
    kk, vv = (k8, v8) if layout == "NHD" else (k8.transpose(0, 1).contiguous(), v8.transpose(0, 1).contiguous())
    mask = (torch.rand(qo_len, kv_len, generator=gen) > 0.4).to(DEVICE) if opts.get("mask") else None
    kwargs = dict(causal=opts.get("causal", False), custom_mask=mask, window_left=opts.get("window", -1),
                  logits_soft_cap=6.0 if opts.get("soft_cap") else None,
                  pos_encoding_mode="ALIBI" if opts.get("alibi") else "NONE")
    got = single_prefill_with_kv_cache(q8, kk, vv, sq, sk, sv, o_dtype=o_dtype, kv_layout=layout, backend="fa3",
                                       return_lse=opts.get("lse", False), **kwargs)
    o, lse = got if opts.get("lse") else (got, None)
    assert o.dtype == o_dtype and o.shape == (qo_len, hq, D)
    want, want_lse = ref.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, return_lse=True, **kwargs)
    tol_dtype = torch.float16 if o_dtype == torch.float32 else o_dtype
    assert_close(o, want, dtype=tol_dtype)
    if lse is not None:
        assert_lse_close(lse, want_lse, dtype=torch.float16)
    if sk is not None:
        unquantised = ref.single_prefill_with_kv_cache(q, k, v, **kwargs)
        # q, k and v are all quantised here (the table's bound is for K/V alone): twice its error
        assert_close(o, unquantised, tol=2 * FP8_VS_UNQUANTIZED[fp8])


def test_single_prefill_fp8_query_errors():
    q8 = torch.zeros(4, 2, 16, device=DEVICE).to(torch.float8_e4m3fn)
    k16 = torch.zeros(4, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="k: fp8 queries need fp8 K/V"):
        single_prefill_with_kv_cache(q8, k16, k16, o_dtype=torch.float16)
    with pytest.raises(ValueError, match="o_dtype: required"):
        single_prefill_with_kv_cache(q8, q8, q8)
    with pytest.raises(NotImplementedError, match="ROPE_LLAMA"):
        single_prefill_with_kv_cache(q8, q8, q8, o_dtype=torch.float16, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="o_dtype"):
        single_prefill_with_kv_cache(q8, q8, q8, o_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_q: expected a float32 tensor of 2"):
        single_prefill_with_kv_cache(q8, q8, q8, torch.ones(3, device=DEVICE), o_dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("seq_len,head_dim,causal", [(117, 64, True), (2372, 128, False), (1011, 256, True),
                                                     (4096, 128, True)])
def test_single_prefill_fp8_queries_gpu(fp8, seq_len, head_dim, causal):
    h = 32
    gen = torch.Generator().manual_seed(seq_len)
    q, k, v = (randn((seq_len, h, head_dim), torch.float16, "cuda", gen) for _ in range(3))
    (q8, sq), (k8, sk), (v8, sv) = (_quant_per_head(x, fp8) for x in (q, k, v))
    o = single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, causal=causal, backend="fa3", o_dtype=torch.float16)
    assert_close(o, ref.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, causal=causal))
    assert_close(o, ref.single_prefill_with_kv_cache(q, k, v, causal=causal), tol=2 * FP8_VS_UNQUANTIZED[fp8])
