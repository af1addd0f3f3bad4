"""Block-sparse attention (``tritoninfer.sparse``) against ``tritoninfer.reference.sparse`` (float32).

CPU cases are tiny and cover the parameters pairwise: GQA groups, M not a multiple of R, empty block
rows, block-internal masks (bool and packed), causal, RoPE, ALiBi, soft cap, fp8 K/V and fp8 queries
with per-head scales, output dtypes, LSE, ``out=`` buffers and the deprecated ``forward``. The ``gpu``
cases run FlashInfer-sized problems.
"""

import numpy as np
import pytest
import torch

from tritoninfer import reference as ref
from tritoninfer import sparse
from tritoninfer.quantization import segment_packbits
from tritoninfer.testing import FP8_VS_UNQUANTIZED, assert_close, assert_lse_close, make_workspace, randn

from conftest import DEVICE
from test_fp8_query import _quant_per_head


def _bsr(mb: int, nb: int, density: float, gen: torch.Generator, empty_rows=()):
    """A random BSR pattern: int32 indptr [mb + 1] and indices [nnz] (columns ascending per row)."""
    dense = torch.rand(mb, nb, generator=gen) < density
    for r in empty_rows:
        dense[r] = False
    indptr = torch.zeros(mb + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(dense.sum(1), 0)
    return indptr, torch.nonzero(dense)[:, 1].to(torch.int32)


def _shuffle_within_rows(indptr, indices, gen):
    """The same pattern with each row's blocks listed in a random order (BSR allows it; the per-row
    requests then see their keys in that order)."""
    out = indices.clone()
    for i in range(indptr.numel() - 1):
        a, b = int(indptr[i]), int(indptr[i + 1])
        out[a:b] = indices[a:b][torch.randperm(b - a, generator=gen)]
    return out


def _wrapper(cls=sparse.BlockSparseAttentionWrapper):
    return cls(make_workspace(4 << 20, DEVICE))


# id, M, N, R, C, H_qo, H_kv, D, dtype, options
CASES = [
    pytest.param(10, 12, 4, 3, 2, 1, 16, torch.float16, dict(), id="M%R-gqa2"),
    pytest.param(8, 8, 2, 2, 3, 3, 16, torch.float16, dict(mask=True, return_lse=True), id="mask-lse"),
    pytest.param(9, 8, 3, 4, 4, 2, 32, torch.float16, dict(causal=True, rope=True), id="causal-rope"),
    pytest.param(6, 6, 1, 1, 2, 2, 16, torch.float16, dict(alibi=True, soft_cap=True, shuffled=True),
                 id="R1C1-alibi-cap"),
    pytest.param(8, 12, 4, 4, 2, 1, 16, torch.bfloat16, dict(packed=True, o_dtype=torch.bfloat16), id="bf16-packed"),
    pytest.param(8, 8, 4, 2, 4, 1, 16, torch.float16, dict(kv_fp8=True, o_dtype=torch.float32, empty=(1,)),
                 id="fp8kv-empty-row"),
]


@pytest.mark.parametrize("M,N,R,C,hq,hk,D,dtype,opts", CASES)
def test_block_sparse_matches_reference(M, N, R, C, hq, hk, D, dtype, opts):
    gen = torch.Generator().manual_seed(M * 100 + N)
    mb, nb = -(-M // R), N // C
    indptr, indices = _bsr(mb, nb, 0.6, gen, opts.get("empty", ()))
    if opts.get("shuffled"):
        indices = _shuffle_within_rows(indptr, indices, gen)
    nnz = int(indptr[-1])
    q = randn((M, hq, D), dtype, DEVICE, gen)
    kv_dtype = torch.float8_e4m3fn if opts.get("kv_fp8") else dtype
    k = randn((N, hk, D), dtype, DEVICE, gen).to(kv_dtype)
    v = randn((N, hk, D), dtype, DEVICE, gen).to(kv_dtype)
    mask = (torch.rand(nnz, R, C, generator=gen) > 0.3) if opts.get("mask") or opts.get("packed") else None
    packed = None
    if opts.get("packed"):
        # the packed layout: convert_bsr_mask_layout's rows, packed per block row
        qo = np.minimum(np.arange(mb + 1) * R, M)
        bits = np.diff(qo) * np.diff(indptr.numpy()) * C
        bit_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(bits)]))
        flat = sparse.convert_bsr_mask_layout(mask, indptr)[:int(bit_indptr[-1])]
        packed = segment_packbits(flat, bit_indptr, bitorder="little")[0].to(DEVICE)
    o_dtype = opts.get("o_dtype", torch.float16)
    scores = dict(causal=opts.get("causal", False),
                  pos_encoding_mode="ROPE_LLAMA" if opts.get("rope") else "ALIBI" if opts.get("alibi") else "NONE",
                  logits_soft_cap=8.0 if opts.get("soft_cap") else None)
    w = _wrapper()
    w.plan(indptr.to(DEVICE), indices.to(DEVICE), M, N, R, C, hq, hk, D,
           mask=None if packed is not None or mask is None else mask.to(DEVICE), packed_mask=packed,
           q_data_type=dtype, kv_data_type=kv_dtype, o_data_type=o_dtype, **scores)
    want, want_lse = ref.block_sparse_attention(q, k, v, indptr, indices, M, N, R, C, mask=mask, return_lse=True,
                                                **scores)
    if opts.get("return_lse"):
        o, lse = w.run(q, k, v, return_lse=True)
        assert_lse_close(lse, want_lse, dtype=dtype)
    else:
        o = w.run(q, k, v)
    assert o.dtype == o_dtype and o.shape == (M, hq, D)
    assert_close(o, want, dtype=dtype if o_dtype == torch.float32 else o_dtype)
    if not (scores["causal"] or opts.get("rope") or opts.get("alibi")):
        # FlashInfer's own check: dense attention under the BSR matrix's mask
        dense = ref.bsr_dense_mask(indptr, indices, M, N, R, C, mask)
        want_dense = ref.single_prefill_with_kv_cache(q, k, v, custom_mask=dense.to(DEVICE),
                                                      logits_soft_cap=scores["logits_soft_cap"])
        assert_close(o, want_dense, dtype=dtype if o_dtype == torch.float32 else o_dtype)
    # a second run into a caller's buffer, with a caller's lse
    buf = torch.full_like(o, float("nan"))
    lse_buf = torch.full((M, hq), float("nan"), device=DEVICE)
    assert w.run(q, k, v, out=buf, lse=lse_buf) is buf
    assert torch.equal(buf, o)
    assert_lse_close(lse_buf, want_lse, dtype=dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_block_sparse_fp8_queries_with_head_scales(fp8):
    M, N, R, C, hq, hk, D = 8, 8, 4, 2, 4, 2, 16
    gen = torch.Generator().manual_seed(7)
    indptr, indices = _bsr(2, 4, 0.7, gen)
    q, k, v = (randn(shape, torch.float16, DEVICE, gen) for shape in ((M, hq, D), (N, hk, D), (N, hk, D)))
    (q8, sq), (k8, sk), (v8, sv) = (_quant_per_head(x, fp8) for x in (q, k, v))
    w = _wrapper()
    w.plan(indptr, indices, M, N, R, C, hq, hk, D, causal=True, q_data_type=fp8, kv_data_type=fp8,
           o_data_type=torch.float16)
    o = w.run(q8, k8, v8, sq, sk, sv)
    assert o.dtype == torch.float16
    # tight: the reference on the same fp8 values and scales; loose: against the unquantised data
    want = ref.block_sparse_attention(q8, k8, v8, indptr, indices, M, N, R, C, causal=True, scale_q=sq, scale_k=sk,
                                      scale_v=sv)
    assert_close(o, want)
    unquantised = ref.block_sparse_attention(q, k, v, indptr, indices, M, N, R, C, causal=True)
    # q, k and v are all quantised here (the table's bound is for K/V alone): twice its error
    assert_close(o, unquantised, tol=2 * FP8_VS_UNQUANTIZED[fp8])
    # scales not given are ones (FlashInfer's defaults)
    o1 = w.run(q8, k8, v8, sq)
    assert_close(o1, ref.block_sparse_attention(q8, k8, v8, indptr, indices, M, N, R, C, causal=True, scale_q=sq))


def test_block_sparse_forward_replaces_the_scores_and_an_empty_pattern_gives_zeros():
    M, N, R, C, h, D = 8, 8, 4, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    indptr, indices = _bsr(2, 2, 1.0, gen)
    q, k, v = (randn(s, torch.float16, DEVICE, gen) for s in ((M, h, D), (N, h, D), (N, h, D)))
    w = _wrapper()
    w.plan(indptr, indices, M, N, R, C, h, h, D, causal=True)
    o = w.forward(q, k, v, logits_soft_cap=5.0, sm_scale=0.3)  # causal stays planned
    assert_close(o, ref.block_sparse_attention(q, k, v, indptr, indices, M, N, R, C, causal=True,
                                               logits_soft_cap=5.0, sm_scale=0.3))
    w.plan(torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), M, N, R, C, h, h, D)
    o, lse = w.run(q, k, v, return_lse=True)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == float("-inf")).all())


def test_convert_bsr_mask_layout_is_flashinfers():
    gen = torch.Generator().manual_seed(1)
    indptr, _ = _bsr(5, 6, 0.5, gen)
    mask = torch.rand(int(indptr[-1]), 3, 2, generator=gen) > 0.5
    want = torch.empty(mask.numel(), dtype=torch.bool)
    for i in range(5):  # FlashInfer 0.5.3's definition, one block row at a time
        a, b = int(indptr[i]), int(indptr[i + 1])
        want[a * 6:b * 6] = mask[a:b].transpose(0, 1).reshape(-1)
    assert torch.equal(sparse.convert_bsr_mask_layout(mask, indptr), want)


def _random_sizes(total: int, parts: int, heads: int, gen) -> torch.Tensor:
    """[heads, parts] sizes summing to ``total`` per head (zeros allowed)."""
    out = torch.empty(heads, parts, dtype=torch.int32)
    for h in range(heads):
        cuts = torch.sort(torch.randint(0, total + 1, (parts - 1,), generator=gen)).values
        out[h] = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([total])])).to(torch.int32)
    return out


@pytest.mark.parametrize("hq,hk,qo_len,kv_len,mb,nb,dtype,opts", [
    pytest.param(4, 2, 9, 11, 3, 4, torch.float16, dict(), id="gqa2"),
    pytest.param(2, 2, 7, 10, 2, 3, torch.float16, dict(causal=True, rope=True, kv_fp8=True), id="causal-rope-fp8kv"),
    pytest.param(3, 1, 6, 8, 3, 2, torch.bfloat16, dict(soft_cap=True, noncontig_out=True), id="bf16-cap"),
])
def test_variable_block_sparse_matches_reference(hq, hk, qo_len, kv_len, mb, nb, dtype, opts):
    gen = torch.Generator().manual_seed(hq * 10 + qo_len)
    rows = _random_sizes(qo_len, mb, hk, gen)
    cols = _random_sizes(kv_len, nb, hk, gen)
    block_mask = torch.rand(hk, mb, nb, generator=gen) > 0.4
    block_mask[0, 0] = False  # a request with no key
    kv_dtype = torch.float8_e4m3fn if opts.get("kv_fp8") else dtype
    q = randn((hq, qo_len, 16), dtype, DEVICE, gen)
    k = randn((hk, kv_len, 16), dtype, DEVICE, gen).to(kv_dtype)
    v = randn((hk, kv_len, 16), dtype, DEVICE, gen).to(kv_dtype)
    scores = dict(causal=opts.get("causal", False), pos_encoding_mode="ROPE_LLAMA" if opts.get("rope") else "NONE",
                  logits_soft_cap=6.0 if opts.get("soft_cap") else None)
    w = _wrapper(sparse.VariableBlockSparseAttentionWrapper)
    w.plan(block_mask.to(DEVICE), rows.to(DEVICE), cols.to(DEVICE), hq, hk, 16, q_data_type=dtype,
           kv_data_type=kv_dtype, **scores)
    out = lse = None
    if opts.get("noncontig_out"):
        # strided buffers (not viewable as the kernel's rows): written through a copy
        out = torch.full((qo_len, hq, 16), float("nan"), dtype=dtype, device=DEVICE).transpose(0, 1)
        lse = torch.full((hq, qo_len + 3), float("nan"), device=DEVICE)[:, :qo_len]
    o, o_lse = w.run(q, k, v, out=out, lse=lse, return_lse=True)
    if out is not None:
        assert o is out and o_lse is lse
    want, want_lse = ref.variable_block_sparse_attention(q, k, v, block_mask, rows, cols, return_lse=True, **scores)
    assert o.dtype == dtype
    assert_close(o, want)
    assert_lse_close(o_lse, want_lse, dtype=dtype)
    if not (scores["causal"] or opts.get("rope")):
        dense = ref.variable_block_dense_mask(block_mask, rows, cols)
        group = hq // hk
        for h in range(hk):
            heads = slice(h * group, (h + 1) * group)
            want_h = ref.single_prefill_with_kv_cache(q[heads].transpose(0, 1), k[h:h + 1].transpose(0, 1),
                                                      v[h:h + 1].transpose(0, 1), custom_mask=dense[h].to(DEVICE),
                                                      logits_soft_cap=scores["logits_soft_cap"])
            assert_close(o[heads], want_h.transpose(0, 1))


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------


def _plan_args(**over):
    args = dict(indptr=torch.tensor([0, 1, 2], dtype=torch.int32), indices=torch.tensor([0, 1], dtype=torch.int32),
                M=8, N=8, R=4, C=4, num_qo_heads=2, num_kv_heads=1, head_dim=16)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(N=9), ValueError, "N: expected a multiple of C"),
    (dict(indptr=torch.tensor([0, 1, 2, 2], dtype=torch.int32)), ValueError, "indptr: expected ceil"),
    (dict(indices=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "indices: block column 2"),
    (dict(indices=torch.tensor([0], dtype=torch.int32)), ValueError, "indices: indptr"),
    (dict(mask=torch.ones(2, 4, 3, dtype=torch.bool)), ValueError, "mask: expected shape"),
    (dict(packed_mask=torch.zeros(3, dtype=torch.uint8)), ValueError, "packed_mask: expected 4 bytes"),
    (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(o_data_type=torch.float8_e4m3fn), ValueError, "o_data_type"),
    (dict(q_data_type=torch.float8_e4m3fn, kv_data_type=torch.float16), ValueError, "kv_data_type"),
    (dict(q_data_type=torch.float8_e4m3fn, pos_encoding_mode="ROPE_LLAMA"), NotImplementedError, "ROPE_LLAMA"),
    (dict(use_fp16_qk_reduction=True), NotImplementedError, "use_fp16_qk_reduction"),
    (dict(R=0), ValueError, "R"),
])
def test_block_sparse_plan_rejects(over, exc, match):
    with pytest.raises(exc, match=match):
        _wrapper().plan(**_plan_args(**over))


def test_block_sparse_run_rejects():
    w = _wrapper()
    q = torch.zeros(8, 2, 16, dtype=torch.float16, device=DEVICE)
    kv = torch.zeros(8, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="before plan"):
        w.run(q, kv, kv)
    w.plan(**_plan_args())
    with pytest.raises(ValueError, match="q"):
        w.run(q.to(torch.bfloat16), kv, kv)
    with pytest.raises(ValueError, match=r"k: expected shape \(8, 1, 16\)"):
        w.run(q, kv[:4], kv)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(q, kv, kv.to(torch.bfloat16))
    with pytest.raises(ValueError, match="scale_k: expected a float32 tensor of 1"):
        w.run(q, kv, kv, scale_k=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        w.run(q, kv, kv, out=torch.empty(8, 2, 16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        sparse.BlockSparseAttentionWrapper(make_workspace(16, DEVICE), backend="cudnn")


def test_variable_block_sparse_rejects():
    w = _wrapper(sparse.VariableBlockSparseAttentionWrapper)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    rows = torch.tensor([[2, 2]], dtype=torch.int32)
    cols = torch.tensor([[1, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_row_sz: expected shape"):
        w.plan(mask, rows[:, :1], cols, 1, 1, 16)
    with pytest.raises(ValueError, match="block_col_sz: every KV head"):
        w.plan(torch.ones(2, 2, 2, dtype=torch.bool), rows.repeat(2, 1),
               torch.tensor([[1, 3], [2, 3]], dtype=torch.int32), 2, 2, 16)
    with pytest.raises(ValueError, match="block_mask_map: expected num_kv_heads"):
        w.plan(mask, rows, cols, 2, 2, 16)
    with pytest.raises(NotImplementedError, match="ALIBI"):
        w.plan(mask, rows, cols, 1, 1, 16, pos_encoding_mode="ALIBI")
    with pytest.raises(ValueError, match="q_data_type"):
        w.plan(mask, rows, cols, 1, 1, 16, q_data_type=torch.float8_e4m3fn)
    w.plan(mask, rows, cols, 1, 1, 16)
    with pytest.raises(ValueError, match=r"v: expected shape \(1, 4, 16\)"):
        w.run(torch.zeros(1, 4, 16, dtype=torch.float16), torch.zeros(1, 4, 16, dtype=torch.float16),
              torch.zeros(1, 5, 16, dtype=torch.float16))


# --------------------------------------------------------------------------------------------------
# GPU: FlashInfer-sized problems
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("R,C", [(64, 64), (16, 16), (4, 1), (1, 16)])
@pytest.mark.parametrize("dtype,causal,mask_inside", [(torch.float16, False, True), (torch.bfloat16, True, False)])
def test_block_sparse_gpu(R, C, dtype, causal, mask_inside):
    M, N, hq, hk, D = 1024 + R // 2, 2048, 32, 8, 128
    gen = torch.Generator().manual_seed(R * 1000 + C)
    mb, nb = -(-M // R), N // C
    indptr, indices = _bsr(mb, nb, 0.25, gen)
    q, k, v = (randn(s, dtype, "cuda", gen) for s in ((M, hq, D), (N, hk, D), (N, hk, D)))
    mask = (torch.rand(int(indptr[-1]), R, C, generator=gen) > 0.5) if mask_inside else None
    w = sparse.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr.cuda(), indices.cuda(), M, N, R, C, hq, hk, D, mask=None if mask is None else mask.cuda(),
           causal=causal, q_data_type=dtype, o_data_type=dtype)
    o, lse = w.run(q, k, v, return_lse=True)
    if causal:
        want, want_lse = ref.block_sparse_attention(q, k, v, indptr, indices, M, N, R, C, causal=True, return_lse=True)
    else:
        dense = ref.bsr_dense_mask(indptr, indices, M, N, R, C, mask).cuda()
        want, want_lse = ref.single_prefill_with_kv_cache(q, k, v, custom_mask=dense, return_lse=True)
    assert_close(o, want)
    assert_lse_close(lse, want_lse, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("R,C", [(16, 16), (4, 1)])
def test_block_sparse_fp8_gpu(fp8, R, C):
    M = N = 1024
    h, D = 8, 128
    gen = torch.Generator().manual_seed(11)
    indptr, indices = _bsr(M // R, N // C, 0.25, gen)
    q, k, v = (randn(s, torch.float16, "cuda", gen) for s in ((M, h, D), (N, h, D), (N, h, D)))
    (q8, sq), (k8, sk), (v8, sv) = (_quant_per_head(x, fp8) for x in (q, k, v))
    w = sparse.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), backend="fa3")
    w.plan(indptr.cuda(), indices.cuda(), M, N, R, C, h, h, D, q_data_type=fp8, kv_data_type=fp8,
           o_data_type=torch.float16)
    o = w.run(q8, k8, v8, sq, sk, sv)
    dense = ref.bsr_dense_mask(indptr, indices, M, N, R, C).cuda()
    assert_close(o, ref.single_prefill_with_kv_cache(q8, k8, v8, sq, sk, sv, custom_mask=dense))
    assert_close(o, ref.single_prefill_with_kv_cache(q, k, v, custom_mask=dense), tol=2 * FP8_VS_UNQUANTIZED[fp8])


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hk", [(16, 4), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_variable_block_sparse_gpu(hq, hk, causal):
    seq, mb, nb, D = 4096, 20, 50, 128
    gen = torch.Generator().manual_seed(hq + causal)
    rows = _random_sizes(seq, mb, hk, gen)
    cols = _random_sizes(seq, nb, hk, gen)
    block_mask = torch.rand(hk, mb, nb, generator=gen) > 0.7
    q, k, v = (randn(s, torch.float16, "cuda", gen) for s in ((hq, seq, D), (hk, seq, D), (hk, seq, D)))
    w = sparse.VariableBlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(block_mask.cuda(), rows.cuda(), cols.cuda(), hq, hk, D, causal=causal, q_data_type=torch.float16)
    o = w.run(q, k, v)
    if causal:
        want = ref.variable_block_sparse_attention(q, k, v, block_mask, rows, cols, causal=True)
    else:
        dense = ref.variable_block_dense_mask(block_mask, rows, cols).cuda()
        group = hq // hk
        want = torch.cat([ref.single_prefill_with_kv_cache(
            q[h * group:(h + 1) * group].transpose(0, 1), k[h:h + 1].transpose(0, 1), v[h:h + 1].transpose(0, 1),
            custom_mask=dense[h]).transpose(0, 1) for h in range(hk)])
    assert_close(o, want)


@pytest.mark.gpu
def test_block_sparse_long_block_rows_gpu():
    """Block rows of 1024 bf16 rows over 64-token blocks: the prefill route may take the Gluon kernel
    (sm_90) in its paged mode, the column blocks being its pages."""
    M = N = 4096
    R, C, h, D = 1024, 64, 8, 128
    gen = torch.Generator().manual_seed(5)
    indptr, indices = _bsr(M // R, N // C, 0.5, gen)
    q, k, v = (randn((M, h, D), torch.bfloat16, "cuda", gen) for _ in range(3))
    w = sparse.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, M, N, R, C, h, h, D, q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    o, lse = w.run(q, k, v, return_lse=True)
    dense = ref.bsr_dense_mask(indptr, indices, M, N, R, C).cuda()
    want, want_lse = ref.single_prefill_with_kv_cache(q, k, v, custom_mask=dense, return_lse=True)
    assert_close(o, want)
    assert_lse_close(lse, want_lse, dtype=torch.bfloat16)
