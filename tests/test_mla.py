"""Multi-head latent attention: ``BatchMLAPagedAttentionWrapper``, ``BatchDecodeMlaWithPagedKVCacheWrapper``
and ``append_paged_mla_kv_cache`` against ``tritoninfer.reference.mla``.

CPU cases use small latent dims (ckv 32, kpe 16) through the interpreter; the ``gpu`` cases use
DeepSeek's (512 / 64, 128 and 16 heads, pages of 1 and 64, bf16, and an fp8 e4m3 cache).
"""

import itertools
import math

import pytest
import torch

import tritoninfer
from tritoninfer import mla, reference
from tritoninfer.mla import (
    BatchDecodeMlaWithPagedKVCacheWrapper,
    BatchMLAPagedAttentionWrapper,
    append_paged_mla_kv_cache,
)
from tritoninfer.testing import assert_close, assert_lse_close, make_workspace

from conftest import DEVICE, ON_GPU

WS = 8 << 20


def make_case(qo_lens, kv_lens, heads, d_ckv, d_kpe, page_size, dtype, strided=False, device=DEVICE, seed=0,
              extra_pages=3, kv_dtype=None):
    """Queries, a paged latent cache with shuffled page ids and the page table. With ``strided``, q and
    the cache are slices of one wider buffer each (as SGLang passes them). ``kv_dtype``: the cache's
    dtype when it differs from q's (an fp8 cache: the random data cast, unscaled)."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(qo_lens)
    pages_per = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per) + extra_pages
    width = d_ckv + d_kpe + (8 if strided else 0)
    q_full = torch.randn(rows, heads, width, generator=g).to(dtype).to(device)
    cache_full = torch.randn(num_pages, page_size, width, generator=g).to(kv_dtype or dtype).to(device)
    if strided:
        q_nope, q_pe = q_full[..., :d_ckv], q_full[..., d_ckv:d_ckv + d_kpe]
        ckv, kpe = cache_full[..., :d_ckv], cache_full[..., d_ckv:d_ckv + d_kpe]
    else:
        q_nope, q_pe = q_full[..., :d_ckv].contiguous(), q_full[..., d_ckv:d_ckv + d_kpe].contiguous()
        ckv, kpe = cache_full[..., :d_ckv].contiguous(), cache_full[..., d_ckv:d_ckv + d_kpe].contiguous()
    perm = torch.randperm(num_pages, generator=g)[: sum(pages_per)].to(torch.int32)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0)), dtype=torch.int32)
    kv_len = torch.tensor(kv_lens, dtype=torch.int32)
    return dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, qo_indptr=qo_indptr.to(device),
                kv_indptr=kv_indptr.to(device), kv_indices=perm.to(device), kv_len=kv_len.to(device))


def ref_of(c, sm_scale, causal, ckv_scale=1.0, kpe_scale=1.0):
    return reference.mla_paged_attention(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], c["qo_indptr"], c["kv_indptr"],
                                         c["kv_indices"], c["kv_len"], sm_scale, causal, ckv_scale, kpe_scale)


def plan(wrapper, c, heads, page_size, causal, sm_scale, dtype, kv_dtype=None):
    wrapper.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"], heads, c["ckv"].shape[-1],
                 c["kpe"].shape[-1], page_size, causal, sm_scale, dtype, kv_dtype or dtype)


# (qo_lens, kv_lens, heads, page_size, causal, dtype, strided): sizes covered pairwise
CASES = [
    pytest.param([1, 1, 1], [5, 17, 0], 4, 1, False, torch.float16, True, id="decode-p1-empty-strided"),
    pytest.param([3, 1, 2], [9, 6, 20], 4, 4, True, torch.float16, False, id="causal-p4"),
    pytest.param([1, 2], [33, 7], 8, 4, True, torch.bfloat16, True, id="causal-bf16-strided"),
    pytest.param([5], [11], 2, 3, True, torch.float16, False, id="causal-p3-two-heads"),
    pytest.param([1, 1], [20, 3], 32, 4, False, torch.float16, False, id="two-row-programs"),
]


@pytest.mark.parametrize("qo_lens,kv_lens,heads,page_size,causal,dtype,strided", CASES)
def test_mla_matches_reference(qo_lens, kv_lens, heads, page_size, causal, dtype, strided):
    c = make_case(qo_lens, kv_lens, heads, 32, 16, page_size, dtype, strided)
    if strided:
        assert c["ckv"].stride(1) != c["ckv"].shape[-1] and c["q_nope"].stride(1) != c["q_nope"].shape[-1]
    sm_scale = 1 / math.sqrt(24)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    plan(w, c, heads, page_size, causal, sm_scale, dtype)
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True)
    ref_o, ref_lse = ref_of(c, sm_scale, causal)
    assert_close(out, ref_o, dtype)
    assert_lse_close(lse, ref_lse, dtype=dtype)


def test_mla_kv_as_m_tiles(monkeypatch):
    """The GPU's 16-row tiles put KV positions as the dots' M (transposed dots): same numbers."""
    from tritoninfer import _plan, mla

    monkeypatch.setattr(mla, "mla_tiles", lambda heads, q, *_: _plan.Tiles(16, 16, 1, 1, 2, 1, prefetch_pages=False,
                                                                       kv_as_m=True, programs_per_sm=1,
                                                                       mask_free_tiles=True))
    c = make_case([2, 1], [19, 40], 8, 32, 16, 4, torch.float16, strided=True)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    plan(w, c, 8, 4, True, 0.2, torch.float16)
    assert w._step.tiles.kv_as_m
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True)
    ref_o, ref_lse = ref_of(c, 0.2, True)
    assert_close(out, ref_o, torch.float16)
    assert_lse_close(lse, ref_lse, dtype=torch.float16)


@pytest.mark.parametrize("causal", [False, True])
def test_mla_one_masked_loop(monkeypatch, causal):
    """The GPU's 64-row tiles run one loop with every tile masked (no mask-free first loop): same
    numbers, with KV lengths that end inside a tile and a causal diagonal across tiles."""
    from tritoninfer import _plan, mla

    monkeypatch.setattr(mla, "mla_tiles", lambda heads, q, *_: _plan.Tiles(16, 16, 1, 1, 4, 1, prefetch_pages=False,
                                                                       programs_per_sm=1, mask_free_tiles=False))
    c = make_case([4, 1, 3], [37, 16, 5], 4, 32, 16, 4, torch.bfloat16, strided=True)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    plan(w, c, 4, 4, causal, 0.2, torch.bfloat16)
    assert not w._step.tiles.mask_free_tiles
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True)
    ref_o, ref_lse = ref_of(c, 0.2, causal)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)


@pytest.mark.interpreter_plan  # its split counts: on the GPU the DeepSeek-dims tests split
@pytest.mark.parametrize("merge_pass,columns", [(False, 32), (True, 32), (True, 16), (True, 8)],
                         ids=["fused", "pass-one-chunk", "pass-2-chunks", "pass-4-chunks"])
def test_mla_split_kv_merges_and_lse_base_e(monkeypatch, merge_pass, columns):
    """A long request on few SMs is split; its states are merged by the last split to arrive (fused)
    or by a second launch where each split merges a share of the value columns (groups of 2 and 4
    splits: with 2 chunks some splits merge nothing, with 4 some merge two)."""
    monkeypatch.setattr(mla, "_MERGE_PASS", merge_pass)
    monkeypatch.setattr(mla, "_MERGE_COLUMNS", columns)
    c = make_case([2, 1], [150, 90], 4, 32, 16, 4, torch.float16)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    plan(w, c, 4, 4, True, 0.2, torch.float16)
    assert w._step.device_plan.has_splits
    splits = w._step.device_plan.work[:, 5].cpu()
    assert {2, 4} <= set(splits.tolist()), splits.tolist()
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True, return_lse_base_on_e=True)
    ref_o, ref_lse = ref_of(c, 0.2, True)
    assert_close(out, ref_o, torch.float16)
    assert_lse_close(lse, ref_lse * math.log(2), dtype=torch.float16)


def test_mla_out_and_lse_buffers():
    """A caller's ``out`` and ``lse`` are written (``lse`` even without ``return_lse``); longer
    ``qo_indptr``/``kv_indptr`` than the batch (``kv_len_arr`` defines it) are accepted."""
    c = make_case([1, 2], [7, 12], 4, 32, 16, 4, torch.float16)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    qo = torch.cat([c["qo_indptr"], c["qo_indptr"][-1:]])
    kvp = torch.cat([c["kv_indptr"], c["kv_indptr"][-1:]])
    w.plan(qo, kvp, c["kv_indices"], c["kv_len"], 4, 32, 16, 4, False, 0.3, "float16", torch.float16)
    out = torch.full_like(c["q_nope"], float("nan"))
    lse = torch.full(c["q_nope"].shape[:2], float("nan"), device=DEVICE)
    res = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, lse=lse)
    assert res is out
    ref_o, ref_lse = ref_of(c, 0.3, False)
    assert_close(out, ref_o, torch.float16)
    assert_lse_close(lse, ref_lse, dtype=torch.float16)


def test_mla_cuda_graph_mode_replan_keeps_buffers():
    """CUDA-graph mode: the first plan (empty KV, as a warmup) fixes the grid and the device buffers; a
    re-plan with real lengths writes the same buffers, and the kernel reads page ids from the fixed
    ``kv_indices`` buffer."""
    heads, ps = 4, 4
    c = make_case([1, 1, 1], [13, 40, 2], heads, 32, 16, ps, torch.float16)
    batch = 3
    bufs = dict(qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                kv_indices=torch.zeros(64, dtype=torch.int32, device=DEVICE),
                kv_len_arr=torch.empty(batch, dtype=torch.int32, device=DEVICE))
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE), use_cuda_graph=True, **bufs)
    zeros = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    w.plan(c["qo_indptr"], zeros, torch.arange(batch, dtype=torch.int32, device=DEVICE),
           torch.zeros(batch, dtype=torch.int32, device=DEVICE), heads, 32, 16, ps, False, 0.25, torch.float16,
           torch.float16)
    first = w._step.device_plan
    out = torch.empty_like(c["q_nope"])
    w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out)
    assert bool((out == 0).all())
    plan(w, c, heads, ps, False, 0.25, torch.float16)
    again = w._step.device_plan
    assert again.work.data_ptr() == first.work.data_ptr() and again.capacity == first.capacity
    assert w._step.kv_indices is bufs["kv_indices"]
    assert torch.equal(bufs["kv_indices"][: c["kv_indices"].numel()], c["kv_indices"])
    w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out)
    assert_close(out, ref_of(c, 0.25, False)[0], torch.float16)


def test_mla_page_ids_from_device_buffers_are_bounded():
    """A bad page id in the CUDA-graph ``kv_indices`` buffer (written by an engine, unseen by plan())
    is never followed: the kernel reports it and ``check_errors`` raises."""
    c = make_case([1], [8], 4, 32, 16, 4, torch.float16)
    bufs = dict(qo_indptr=torch.empty(2, dtype=torch.int32, device=DEVICE),
                kv_indptr=torch.empty(2, dtype=torch.int32, device=DEVICE),
                kv_indices=torch.zeros(8, dtype=torch.int32, device=DEVICE),
                kv_len_arr=torch.empty(1, dtype=torch.int32, device=DEVICE))
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE), use_cuda_graph=True, **bufs)
    plan(w, c, 4, 4, False, 0.25, torch.float16)
    bufs["kv_indices"][1] = 10_000
    w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"])
    with pytest.raises(ValueError, match="kv_indices"):
        tritoninfer.check_errors()


def test_mla_bad_inputs_name_the_argument():
    c = make_case([1, 1], [6, 9], 4, 32, 16, 4, torch.float16)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    with pytest.raises(ValueError, match="run\\(\\) was called before plan"):
        w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"])
    with pytest.raises(ValueError, match="kv_indptr.dtype"):
        w.plan(c["qo_indptr"], c["kv_indptr"].long(), c["kv_indices"], c["kv_len"], 4, 32, 16, 4, False, 0.3,
               torch.float16, torch.float16)
    with pytest.raises(ValueError, match="kv_len_arr"):
        w.plan(c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["kv_len"] + 8, 4, 32, 16, 4, False, 0.3,
               torch.float16, torch.float16)
    with pytest.raises(ValueError, match="backend"):
        BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE), backend="nope")
    with pytest.raises(NotImplementedError, match="cutlass"):
        BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE), backend="cutlass")
    plan(w, c, 4, 4, False, 0.3, torch.float16)
    q_nope, q_pe, ckv, kpe = c["q_nope"], c["q_pe"], c["ckv"], c["kpe"]
    with pytest.raises(ValueError, match="ckv_cache: latent dim 16 differs from the planned head_dim_ckv 32"):
        w.run(q_nope, q_pe, ckv[..., :16], kpe)
    with pytest.raises(ValueError, match="kpe_cache: latent dim 8 differs from the planned head_dim_kpe 16"):
        w.run(q_nope, q_pe, ckv, kpe[..., :8])
    with pytest.raises(ValueError, match="ckv_cache: page_size 2"):
        w.run(q_nope, q_pe, ckv[:, :2], kpe[:, :2])
    with pytest.raises(ValueError, match="kpe_cache: .* pages, but ckv_cache has"):
        w.run(q_nope, q_pe, ckv, kpe[:-1])
    with pytest.raises(ValueError, match="q_pe"):
        w.run(q_nope, q_pe[..., :8], ckv, kpe)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q_nope.to(torch.bfloat16), q_pe, ckv, kpe)
    with pytest.raises(ValueError, match="kv_indices: page id"):
        w.run(q_nope, q_pe, ckv[:2], kpe[:2])
    with pytest.raises(ValueError, match="out"):
        w.run(q_nope, q_pe, ckv, kpe, out=torch.empty(1, 4, 32, dtype=torch.float16))


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# fp8 caches (beyond FlashInfer 0.5.3): (qo_lens, kv_lens, heads, page_size, causal, q dtype, kv dtype,
# strided, ckv_scale, kpe_scale); the reference reads the same fp8 values times their scales
FP8_CASES = [
    pytest.param([1, 1, 1], [5, 17, 0], 4, 1, False, torch.bfloat16, E4M3, True, 0.5, 2.0, id="e4m3-bf16-strided"),
    pytest.param([3, 1, 2], [9, 6, 20], 4, 4, True, torch.float16, E4M3, False, None, None, id="e4m3-fp16-causal"),
    pytest.param([1, 2], [150, 90], 4, 4, True, torch.bfloat16, E4M3, True, 1.5, 1.5, id="e4m3-split-kv"),
    pytest.param([2, 1], [19, 40], 8, 4, True, E4M3, E4M3, True, 0.25, 3.0, id="e4m3-q-e4m3"),
    pytest.param([1, 1], [20, 3], 32, 4, False, torch.float16, E5M2, True, 2.0, 0.5, id="e5m2-two-row-programs"),
]


@pytest.mark.parametrize("qo_lens,kv_lens,heads,page_size,causal,q_dtype,kv_dtype,strided,ckv_scale,kpe_scale",
                         FP8_CASES)
def test_mla_fp8_cache_matches_reference(qo_lens, kv_lens, heads, page_size, causal, q_dtype, kv_dtype, strided,
                                         ckv_scale, kpe_scale):
    """An fp8 latent cache (ckv and kpe slices of one fp8 buffer with ``strided``, as SGLang's) with
    per-tensor scales: the dequantised reference within the output dtype's tolerance (fp8 queries
    give bfloat16); split-KV partial states are merged before the output scale."""
    c = make_case(qo_lens, kv_lens, heads, 32, 16, page_size, q_dtype, strided, kv_dtype=kv_dtype)
    assert c["ckv"].dtype == kv_dtype and c["q_nope"].dtype == q_dtype
    sm_scale = 1 / math.sqrt(24)
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    plan(w, c, heads, page_size, causal, sm_scale, q_dtype, kv_dtype)
    scales = {k: v for k, v in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale)) if v is not None}
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True, **scales)
    o_dtype = torch.bfloat16 if q_dtype == E4M3 else q_dtype
    assert out.dtype == o_dtype
    ref_o, ref_lse = ref_of(c, sm_scale, causal, ckv_scale or 1.0, kpe_scale or 1.0)
    assert_close(out, ref_o, o_dtype)
    assert_lse_close(lse, ref_lse, dtype=o_dtype)
    if kv_lens[0] == 150:
        assert w._step.device_plan.has_splits


def test_mla_fp8_decode_wrapper_k_scale_v_scale():
    """The deprecated decode wrapper keeps FlashInfer's ``k_scale``/``v_scale`` for an fp8 cache:
    ``k_scale`` multiplies the scores (ckv and kpe parts), ``v_scale`` the output."""
    heads, ps = 4, 4
    c = make_case([1, 1], [6, 13], heads, 32, 16, ps, torch.bfloat16, strided=True, kv_dtype=E4M3)
    kv_lens = c["kv_len"].cpu()
    last = torch.where(kv_lens > 0, (kv_lens - 1) % ps + 1, torch.zeros_like(kv_lens)).to(torch.int32)
    w = BatchDecodeMlaWithPagedKVCacheWrapper(make_workspace(WS, DEVICE))
    w.plan(c["kv_indptr"], c["kv_indices"], last.to(DEVICE), heads, 32, ps, 0.25, data_type=E4M3,
           q_data_type=torch.bfloat16)
    out = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], k_scale=0.75, v_scale=0.75)
    assert_close(out, ref_of(c, 0.25, False, 0.75, 0.75)[0], torch.bfloat16)


def test_mla_fp8_bad_inputs_name_the_argument():
    """A cache whose dtype differs from the plan's, scales with a 16-bit cache or out of range, fp8
    queries without an fp8 cache and FlashInfer's unimplemented fp8 extras each raise naming the
    argument."""
    c = make_case([1, 1], [6, 9], 4, 32, 16, 4, torch.bfloat16, strided=True, kv_dtype=E4M3)
    q_nope, q_pe, ckv, kpe = c["q_nope"], c["q_pe"], c["ckv"], c["kpe"]
    w = BatchMLAPagedAttentionWrapper(make_workspace(WS, DEVICE))
    with pytest.raises(ValueError, match="q_data_type: fp8 queries"):
        plan(w, c, 4, 4, False, 0.3, E4M3, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_data_type"):
        plan(w, c, 4, 4, False, 0.3, torch.bfloat16, torch.int8)
    plan(w, c, 4, 4, False, 0.3, torch.bfloat16)  # a bf16 plan, an fp8 cache
    with pytest.raises(ValueError, match="ckv_cache .* does not match the kv_data_type"):
        w.run(q_nope, q_pe, ckv, kpe)
    with pytest.raises(ValueError, match="ckv_scale: only valid with an fp8 cache"):
        w.run(q_nope, q_pe, ckv.to(torch.bfloat16), kpe.to(torch.bfloat16), ckv_scale=1.0)
    plan(w, c, 4, 4, False, 0.3, torch.bfloat16, E4M3)
    with pytest.raises(ValueError, match="ckv_cache .* does not match the kv_data_type"):
        w.run(q_nope, q_pe, ckv.to(torch.bfloat16), kpe.to(torch.bfloat16))
    with pytest.raises(ValueError, match="kpe_cache .* does not match the kv_data_type"):
        w.run(q_nope, q_pe, ckv, kpe.to(E5M2))
    with pytest.raises(ValueError, match="ckv_scale: expected a finite positive"):
        w.run(q_nope, q_pe, ckv, kpe, ckv_scale=0.0)
    with pytest.raises(ValueError, match="kpe_scale: expected a finite positive"):
        w.run(q_nope, q_pe, ckv, kpe, kpe_scale=float("nan"))
    with pytest.raises(ValueError, match="kpe_scale: expected a float"):
        w.run(q_nope, q_pe, ckv, kpe, kpe_scale=torch.tensor(1.0))
    with pytest.raises(NotImplementedError, match="ckv_scale_arr"):
        w.run(q_nope, q_pe, ckv, kpe, ckv_scale_arr=torch.ones(1))
    with pytest.raises(ValueError, match="o_scale"):
        w.run(q_nope, q_pe, ckv, kpe, o_scale=1.0)
    with pytest.raises(TypeError):
        w.run(q_nope, q_pe, ckv, kpe, None, None, False, None, None, None, False, None, 1.0)  # keyword-only
    plan(w, c, 4, 4, False, 0.3, E4M3, E4M3)
    with pytest.raises(ValueError, match="out"):
        w.run(q_nope.to(E4M3), q_pe.to(E4M3), ckv, kpe, out=torch.empty(q_nope.shape, dtype=E4M3))


def test_append_paged_mla_kv_cache_fp8():
    """An fp8 cache takes fp8 rows as they are (FlashInfer's only case) and 16/32-bit rows converted on
    store, unscaled (the caller divides by its scale); mismatched dtypes name the argument. The
    conversion is checked on the GPU only (the interpreter's fp32 -> fp8 cast is wrong, see test_page)."""
    page_size, d_ckv, d_kpe = 4, 32, 16
    kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    kv_indices = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
    last = torch.tensor([1, 1], dtype=torch.int32, device=DEVICE)
    batch_indices = torch.tensor([0] * 5 + [1] * 3, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    ckv_app = (torch.randn(8, d_ckv, generator=g) * 4).to(torch.bfloat16)
    kpe_app = (torch.randn(8, d_kpe, generator=g) * 4).to(torch.bfloat16)
    for src in (E4M3,) + ((torch.bfloat16, torch.float32) if ON_GPU else ()):
        full = torch.zeros(4, page_size, d_ckv + d_kpe, dtype=E4M3, device=DEVICE)
        append_paged_mla_kv_cache(ckv_app.to(src).to(DEVICE), kpe_app.to(src).to(DEVICE), batch_indices, positions,
                                  full[..., :d_ckv], full[..., d_ckv:], kv_indices, kv_indptr, last)
        ref = torch.zeros(4, page_size, d_ckv + d_kpe, dtype=E4M3)
        reference.append_paged_mla_kv_cache(ckv_app.to(src), kpe_app.to(src), batch_indices.cpu(), positions.cpu(),
                                            ref[..., :d_ckv], ref[..., d_ckv:], kv_indices.cpu(), kv_indptr.cpu(),
                                            last.cpu())
        assert torch.equal(full.cpu().view(torch.uint8), ref.view(torch.uint8)), src
    full = torch.zeros(4, page_size, d_ckv + d_kpe, dtype=E4M3, device=DEVICE)
    args = (batch_indices, positions, full[..., :d_ckv], full[..., d_ckv:], kv_indices, kv_indptr, last)
    with pytest.raises(ValueError, match="append_kpe: dtype"):
        append_paged_mla_kv_cache(ckv_app.to(DEVICE), kpe_app.half().to(DEVICE), *args)
    with pytest.raises(ValueError, match="kpe_cache: dtype"):
        append_paged_mla_kv_cache(ckv_app.to(DEVICE), kpe_app.to(DEVICE), batch_indices, positions, full[..., :d_ckv],
                                  full[..., d_ckv:].to(E5M2), kv_indices, kv_indptr, last)
    bf16 = torch.zeros(4, page_size, d_ckv + d_kpe, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="append_ckv: dtype"):
        append_paged_mla_kv_cache(ckv_app.half().to(DEVICE), kpe_app.half().to(DEVICE), batch_indices, positions,
                                  bf16[..., :d_ckv], bf16[..., d_ckv:], kv_indices, kv_indptr, last)


def test_append_paged_mla_kv_cache_matches_reference():
    page_size, d_ckv, d_kpe = 4, 32, 16
    kv_lens = [5, 1, 9]
    pages_per = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per) + 2
    kv_indptr = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    kv_indices = torch.tensor([4, 0, 6, 1, 3, 2], dtype=torch.int32)
    last = torch.tensor([1, 1, 1], dtype=torch.int32)
    append_indptr = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    batch_indices, positions = tritoninfer.get_batch_indices_positions(append_indptr.to(DEVICE), seq_lens.to(DEVICE),
                                                                     15)
    ckv_app = torch.randn(15, d_ckv).half()
    kpe_app = torch.randn(15, d_kpe).half()
    # one 48-wide buffer sliced into ckv and kpe, as SGLang's
    full = torch.zeros(num_pages, page_size, d_ckv + d_kpe, dtype=torch.float16)
    ref_full = full.clone()
    reference.append_paged_mla_kv_cache(ckv_app, kpe_app, batch_indices.cpu(), positions.cpu(), ref_full[..., :d_ckv],
                                        ref_full[..., d_ckv:], kv_indices, kv_indptr, last)
    full = full.to(DEVICE)
    append_paged_mla_kv_cache(ckv_app.to(DEVICE), kpe_app.to(DEVICE), batch_indices, positions, full[..., :d_ckv],
                              full[..., d_ckv:], kv_indices.to(DEVICE), kv_indptr.to(DEVICE), last.to(DEVICE))
    assert torch.equal(full.cpu(), ref_full)
    with pytest.raises(ValueError, match="kpe_cache"):
        append_paged_mla_kv_cache(ckv_app, kpe_app, batch_indices, positions, full[..., :d_ckv],
                                  full[:-1, :, d_ckv:], kv_indices, kv_indptr, last)


def test_decode_mla_wrapper_matches_reference():
    heads, ps = 4, 4
    c = make_case([1, 1], [6, 13], heads, 32, 16, ps, torch.float16)
    kv_lens = c["kv_len"].cpu()
    last = torch.where(kv_lens > 0, (kv_lens - 1) % ps + 1, torch.zeros_like(kv_lens)).to(torch.int32)
    w = BatchDecodeMlaWithPagedKVCacheWrapper(make_workspace(WS, DEVICE))
    w.plan(c["kv_indptr"], c["kv_indices"], last.to(DEVICE), heads, 32, ps, 0.25, data_type=torch.float16)
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], k_scale=2.0, v_scale=0.5, return_lse=True)
    ref_o, ref_lse = ref_of(c, 0.5, False)
    assert_close(out, ref_o * 0.5, torch.float16)
    assert_lse_close(lse, ref_lse, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="window_left"):
        w.plan(c["kv_indptr"], c["kv_indices"], last, heads, 32, ps, 0.25, window_left=4)


def test_compat_mla_fast_plan_and_private_attributes():
    """SGLang's ``fast_mla_decode_plan``: it sets ``_causal``/``_page_size``/``_sm_scale``, then calls
    ``_cached_module.plan`` with FlashInfer's argument list (host indptrs and lengths; the page ids
    are in ``_kv_indices_buf``)."""
    from tritoninfer import _compat

    heads, ps = 4, 1
    c = make_case([1, 1], [5, 9], heads, 32, 16, ps, torch.float16)
    c2 = make_case([1, 1], [11, 3], heads, 32, 16, ps, torch.float16, seed=1)
    bufs = dict(qo_indptr=torch.arange(3, dtype=torch.int32, device=DEVICE),
                kv_indptr=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                kv_indices=torch.zeros(64, dtype=torch.int32, device=DEVICE),
                kv_len_arr=torch.ones(2, dtype=torch.int32, device=DEVICE))
    mods = _compat._module_contents()
    cls = mods["flashinfer.mla"]["BatchMLAPagedAttentionWrapper"]
    assert mods["flashinfer"]["BatchMLAPagedAttentionWrapper"] is cls
    w = cls(make_workspace(WS, DEVICE), use_cuda_graph=True, backend="auto", **bufs)
    plan(w, c, heads, ps, False, 0.3, torch.float16)
    for name in ("_float_workspace_buffer", "_int_workspace_buffer", "_pin_memory_int_workspace_buffer",
                 "_qo_indptr_buf", "_kv_indptr_buf", "_kv_indices_buf", "_kv_len_arr_buf"):
        assert torch.is_tensor(getattr(w, name)), name
    assert (w._causal, w._page_size, w._sm_scale) == (False, ps, 0.3)
    # the engine writes the page table into the fixed buffer, then re-plans from host copies
    bufs["kv_indices"][: c2["kv_indices"].numel()] = c2["kv_indices"]
    w._causal, w._page_size, w._sm_scale = False, ps, 0.3
    w._cached_module.plan(w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
                          c2["qo_indptr"].cpu(), c2["kv_indptr"].cpu(), c2["kv_len"].cpu(), heads, 32, False)
    out = w.run(c2["q_nope"], c2["q_pe"], c2["ckv"], c2["kpe"])
    assert_close(out, ref_of(c2, 0.3, False)[0], torch.float16)
    w._sm_scale = 0.5  # FlashInfer's run() reads it: it takes effect at once
    assert_close(w.run(c2["q_nope"], c2["q_pe"], c2["ckv"], c2["kpe"]), ref_of(c2, 0.5, False)[0], torch.float16)
    assert mods["flashinfer.page"]["append_paged_mla_kv_cache"] is append_paged_mla_kv_cache
    assert not getattr(mods["flashinfer.decode"]["BatchDecodeMlaWithPagedKVCacheWrapper"],
                       "__tritoninfer_unsupported__", None)


# --------------------------------------------------------------------------------------------------
# GPU: DeepSeek dims
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("qo_len,causal", [(1, False), (4, True)])
def test_mla_deepseek_dims_gpu(heads, page_size, qo_len, causal):
    _deepseek_case_checked(heads, page_size, qo_len, causal, [1, 77, 1000, 4133, 0, 129])


def _deepseek_case_checked(heads, page_size, qo_len, causal, kv_lens, route=None):
    """One bf16 case at DeepSeek's dims, q and cache as slices of wider buffers (SGLang's form): output
    and LSE against the reference (``route``: the kernel the plan must take). Returns (wrapper, case,
    reference output)."""
    if causal:
        kv_lens = [max(n, qo_len) for n in kv_lens]
    c = make_case([qo_len] * len(kv_lens), kv_lens, heads, 512, 64, page_size, torch.bfloat16, strided=True)
    sm_scale = 1 / math.sqrt(192)
    w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    plan(w, c, heads, page_size, causal, sm_scale, torch.bfloat16)
    if route is not None:
        assert w._step.route.kernel == route, w._step.route
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True)
    ref_o, ref_lse = ref_of(c, sm_scale, causal)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)
    return w, c, ref_o


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("qo_len,causal", [(1, False), (4, True)])
def test_mla_fp8_deepseek_dims_gpu(heads, page_size, qo_len, causal):
    """An e4m3 576-wide cache sliced into ckv/kpe, bf16 queries (SGLang's call), scales != 1: the
    dequantised reference within bf16's tolerance."""
    kv_lens = [1, 77, 1000, 4133, 0, 129]
    if causal:
        kv_lens = [max(n, qo_len) for n in kv_lens]
    c = make_case([qo_len] * len(kv_lens), kv_lens, heads, 512, 64, page_size, torch.bfloat16, strided=True,
                  kv_dtype=E4M3)
    sm_scale = 1 / math.sqrt(192)
    w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    plan(w, c, heads, page_size, causal, sm_scale, torch.bfloat16, E4M3)
    out, lse = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], return_lse=True, ckv_scale=0.05, kpe_scale=0.08)
    ref_o, ref_lse = ref_of(c, sm_scale, causal, 0.05, 0.08)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
def test_mla_cuda_graph_capture_replan_gpu(heads):
    """A graph captured after a warmup plan stays valid after a re-plan with other lengths (splits)."""
    batch, ps = 4, 64
    c = make_case([1] * batch, [9000, 12, 700, 3000], heads, 512, 64, ps, torch.bfloat16, strided=True)
    bufs = dict(qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                kv_indices=torch.empty(1 << 16, dtype=torch.int32, device="cuda"),
                kv_len_arr=torch.empty(batch, dtype=torch.int32, device="cuda"))
    w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), True, **bufs)
    w.plan(c["qo_indptr"], torch.zeros(batch + 1, dtype=torch.int32, device="cuda"), c["kv_indices"][:batch],
           torch.zeros(batch, dtype=torch.int32, device="cuda"), heads, 512, 64, ps, False, 0.07, torch.bfloat16,
           torch.bfloat16)
    out = torch.empty_like(c["q_nope"])
    lse = torch.empty(c["q_nope"].shape[:2], dtype=torch.float32, device="cuda")
    w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, lse=lse)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"], out=out, lse=lse)
    plan(w, c, heads, ps, False, 0.07, torch.bfloat16)
    out.fill_(float("nan"))
    g.replay()
    ref_o, ref_lse = ref_of(c, 0.07, False)
    assert_close(out, ref_o, torch.bfloat16)
    assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)


def _gluon_case_checked(monkeypatch, heads, page_size, qo_len, causal, kv_lens):
    """One case on the Gluon MLA kernel (``_route.MLA_HOPPER`` on) at DeepSeek's dims, q and cache as
    slices of wider buffers (SGLang's form): the plan took the route, the kernel ran, output and LSE
    match the reference. Returns (wrapper, case, reference output, the kernel's run record)."""
    from tritoninfer import _route

    monkeypatch.setattr(_route, "MLA_HOPPER", True)
    ran = []
    real = mla.MLALaunch._launch_hopper
    monkeypatch.setattr(mla.MLALaunch, "_launch_hopper", lambda self, *a: ran.append(1) or real(self, *a))
    w, c, ref_o = _deepseek_case_checked(heads, page_size, qo_len, causal, kv_lens, route="hopper")
    assert ran
    return w, c, ref_o, ran


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page_size", [64, 16])
@pytest.mark.parametrize("qo_len,causal", [(1, False), (4, True)])
@pytest.mark.parametrize("kv_lens", [[1, 77, 1000, 4133, 0, 129], [8192]], ids=["varied", "one-long-split"])
@pytest.mark.parametrize("mode", ["share-p", "both"])
def test_mla_gluon_kernel_gpu(monkeypatch, heads, page_size, qo_len, causal, kv_lens, mode):
    """The Gluon MLA kernel (``_route.MLA_HOPPER`` on) in each mode (``mla._HOPPER_MODE``: P shared
    between its consumers; both consumers computing the scores), at
    DeepSeek's dims, q and cache as slices of wider buffers (SGLang's form): output and LSE against the
    reference, with and without split-KV (one long request is split over the SMs and merged by the merge
    pass); the kernel ran (not the fallback)."""
    monkeypatch.setattr(mla, "_HOPPER_MODE", mode)
    w, c, ref_o, ran = _gluon_case_checked(monkeypatch, heads, page_size, qo_len, causal, kv_lens)
    # q rows not evenly spaced: the same plan on kernels/mla.py
    ran.clear()
    q_nope = torch.empty(c["q_nope"].shape[0], heads + 1, 512, dtype=torch.bfloat16, device="cuda")[:, :heads]
    q_nope.copy_(c["q_nope"])
    out2 = w.run(q_nope, c["q_pe"], c["ckv"], c["kpe"])
    assert not ran
    assert_close(out2, ref_o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("qo_len,causal", [(1, False), (4, True)])
@pytest.mark.parametrize("kv_lens", [[1, 77, 1000, 4133, 0, 129], [8192]], ids=["varied", "one-long-split"])
def test_mla_gluon_gather_gpu(monkeypatch, heads, page_size, qo_len, causal, kv_lens):
    """Pages TMA cannot box on the Gluon kernel (``_route.MLA_HOPPER_GATHER``: rows gathered by cp.async),
    SGLang's page 1 and a small page, q and cache as slices of wider buffers: output and LSE against the
    reference, with and without split-KV; the kernel ran."""
    from tritoninfer import _route

    monkeypatch.setattr(_route, "MLA_HOPPER_GATHER", True)
    _gluon_case_checked(monkeypatch, heads, page_size, qo_len, causal, kv_lens)


@pytest.mark.gpu
def test_mla_gluon_kernel_cuda_graph_gpu(monkeypatch):
    """CUDA-graph mode on the Gluon route: a graph captured after a warmup plan stays valid after a
    re-plan with other lengths (splits grown by the graph's cap start on the kernel's tiles)."""
    from tritoninfer import _route

    monkeypatch.setattr(_route, "MLA_HOPPER", True)
    test_mla_cuda_graph_capture_replan_gpu(128)


@pytest.mark.parametrize("hopper", [False, True], ids=["core", "gluon"])
def test_mla_replans_move_one_launch(hopper):
    """The launch path on the CPU (``testing.fake_driver_launches``; ``hopper``: the route sees an sm_90 GPU
    and takes the Gluon kernel): a wrapper's plans of other batches and lengths, split or not, keep one
    launch per kind of plan, moved to each new plan (``MLALaunch.bind_plan``). After the first plan of a
    kind nothing compiles, every run takes the driver path and its parameters point at the new plan's
    work list, lengths and page table."""
    from tritoninfer import testing

    heads, page = 128, 64
    ckv = torch.zeros(300, page, 512, dtype=torch.bfloat16)
    kpe = torch.zeros(300, page, 64, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with testing.fake_driver_launches(params_read=64, hopper=hopper) as record:
        w = tritoninfer.BatchMLAPagedAttentionWrapper(make_workspace(64 << 20, "cpu"))
        seen = {}
        for step, lens in enumerate(([9000], [100] * 40, [300, 17, 4000], [64] * 9)):
            pages = [-(-n // page) for n in lens]
            kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
            kv_indices = torch.randperm(ckv.shape[0], generator=g)[:sum(pages)].to(torch.int32)
            qo_indptr = torch.arange(len(lens) + 1, dtype=torch.int32)
            w.plan(qo_indptr, kv_indptr, kv_indices, torch.tensor(lens, dtype=torch.int32), heads, 512, 64, page,
                   False, 0.1, torch.bfloat16, torch.bfloat16)
            assert w._step.route.is_core != hopper
            q_nope = torch.zeros(len(lens), heads, 512, dtype=torch.bfloat16)
            q_pe = torch.zeros(len(lens), heads, 64, dtype=torch.bfloat16)
            compiles = len(record.compiles)
            record.launches.clear()
            w.run(q_nope, q_pe, ckv, kpe)
            plan = w._step.device_plan
            launches = [v for v in plan.attention_launches.values() if isinstance(v, mla.MLALaunch)]
            assert all(v is seen.setdefault(plan.has_splits, v) for v in launches if v.step is w._step)
            if step >= 2:  # a kind of plan met before: its launch, no compile, the driver path
                assert len(record.compiles) == compiles
                assert len(record.launches) == 1 + plan.has_splits  # (+ the merge pass)
            for _, params in record.launches[-1 - plan.has_splits:]:
                for t in (plan.work, plan.kv_len, w._step.kv_indptr, w._step.kv_indices):
                    assert t.data_ptr() in params
        assert set(seen) == {False, True}


def test_mla_gluon_mode_names(monkeypatch):
    """``mla._HOPPER_MODE`` names one of the kernel's modes; another name is an error, not a default."""
    assert [mla._HOPPER_MODES[m] for m in ("both", "share-p")] == [0, 1]
    monkeypatch.setattr(mla, "_HOPPER_MODE", "both")
    assert mla.hopper_mode() == 0
    monkeypatch.setattr(mla, "_HOPPER_MODE", "shared")
    with pytest.raises(ValueError, match="_HOPPER_MODE"):
        mla.hopper_mode()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["share-p", "both"])
@pytest.mark.parametrize("page_size", [64, 16])
def test_mla_gluon_kernel_nan_past_the_end_gpu(monkeypatch, mode, page_size):
    """NaN in the slots of each request's last page past its length (FlashInfer's
    test_batch_mla_oob_kv_nan) never reaches the Gluon kernel's output: those value rows are zeroed."""
    from tritoninfer import _route

    monkeypatch.setattr(_route, "MLA_HOPPER", True)
    monkeypatch.setattr(mla, "_HOPPER_MODE", mode)
    kv_lens = [1000, 77, 35]
    c = make_case([1] * len(kv_lens), kv_lens, 128, 512, 64, page_size, torch.bfloat16, extra_pages=0)
    pages = [math.ceil(n / page_size) for n in kv_lens]
    ends = torch.tensor(pages).cumsum(0).tolist()
    for n, end in zip(kv_lens, ends):
        last = c["kv_indices"][end - 1]
        tail = n - (math.ceil(n / page_size) - 1) * page_size
        c["ckv"][last, tail:] = float("nan")
        c["kpe"][last, tail:] = float("nan")
    w = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    plan(w, c, 128, page_size, False, 0.07, torch.bfloat16)
    out = w.run(c["q_nope"], c["q_pe"], c["ckv"], c["kpe"])
    clean = {k: v.nan_to_num(0.0) if k in ("ckv", "kpe") else v for k, v in c.items()}
    assert not out.isnan().any()
    assert_close(out, ref_of(clean, 0.07, False)[0], torch.bfloat16)


@pytest.mark.parametrize("qo_len", [1, 7])
def test_mla_plan_without_kv_over_an_empty_cache(qo_len):
    """A plan of kv_len 0 over a cache of no pages (FlashInfer's test_batch_mla_page_attention with
    kv_len 0): zeros and LSE -inf, and no page id reported (an empty cache has no id 0). On an H200
    these shapes are the Gluon route's, which leaves such a plan to the Triton kernel (an empty cache
    has no TMA descriptor)."""
    from tritoninfer import testing

    batch, heads, ps = 3, 16, 16
    d_ckv, d_kpe = (512, 64) if ON_GPU else (32, 16)
    w = BatchMLAPagedAttentionWrapper(make_workspace(128 << 20, DEVICE))
    i32 = dict(dtype=torch.int32, device=DEVICE)
    w.plan(torch.arange(batch + 1, **i32) * qo_len, torch.zeros(batch + 1, **i32), torch.empty(0, **i32),
           torch.zeros(batch, **i32), heads, d_ckv, d_kpe, ps, False, 0.07, torch.bfloat16, torch.bfloat16)
    q_nope = testing.randn((batch * qo_len, heads, d_ckv), torch.bfloat16, DEVICE)
    q_pe = testing.randn((batch * qo_len, heads, d_kpe), torch.bfloat16, DEVICE)
    ckv = torch.empty(0, ps, d_ckv, dtype=torch.bfloat16, device=DEVICE)
    kpe = torch.empty(0, ps, d_kpe, dtype=torch.bfloat16, device=DEVICE)
    out, lse = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    tritoninfer.check_errors()
    assert (out == 0).all() and torch.isneginf(lse).all()
