"""Cascade attention (MultiLevelCascadeAttentionWrapper and the two legacy shared-prefix wrappers)
against the reference: attention of each query over the concatenation of the KV it sees in every
level. Tiny shapes through the interpreter; the issue's shapes (a 1000-token shared prefix, 8
requests with their own suffixes) on the GPU."""

import dataclasses
import inspect

import pytest
import torch
from conftest import DEVICE

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer.cascade import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)


# --------------------------------------------------------------------------------------------------
# inputs: one page pool holding every level's KV, and a page table per level
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cascade:
    """``levels[i]`` lists the KV lengths of level i's requests; ``owners[i][r]`` is the level-i
    request that final request r belongs to (non-decreasing; the last level's owners are r)."""

    levels: tuple
    owners: tuple
    qo_lens: tuple
    page_size: int = 4
    heads: tuple = (4, 2)
    head_dim: int = 32
    layout: str = "NHD"
    form: str = "5d"
    dtype: torch.dtype = torch.float16
    causal: bool = False

    def id(self):
        return (f"L{len(self.levels)}-{'-'.join(str(list(lv)) for lv in self.levels)}-q{list(self.qo_lens)}-"
                f"p{self.page_size}-h{self.heads[0]}/{self.heads[1]}-d{self.head_dim}-{self.layout}-{self.form}-"
                f"{str(self.dtype)[6:]}-c{int(self.causal)}")


def _build_many(cases, seed: int = 0, device=DEVICE):
    """One page pool holding the KV of every level of every case (the cases share page size,
    heads, layout, form and dtype); per case: q, qo_indptr, per-level page tables and
    qo_indptrs, and per final request the dense K/V it sees (levels concatenated)."""
    g = torch.Generator().manual_seed(seed)
    c0 = cases[0]
    hq, hk = c0.heads
    all_lens = [n for case in cases for lv in case.levels for n in lv]
    pool = testing.make_paged_kv(all_lens, c0.page_size, hk, c0.head_dim, layout=c0.layout, form=c0.form,
                                 dtype=c0.dtype, device=device, generator=g)
    ind = pool.kv_indptr.cpu().tolist()
    built, offset = [], 0
    for case in cases:
        q, qo_indptr = testing.random_qo(case.qo_lens, hq, case.head_dim, dtype=case.dtype, device=device, generator=g)
        tables, qo_arr = [], []
        for lv, owner in zip(case.levels, case.owners):
            n = len(lv)
            base = ind[offset]
            indptr = torch.tensor([x - base for x in ind[offset:offset + n + 1]], dtype=torch.int32)
            indices = pool.kv_indices[base:ind[offset + n]]
            last = pool.kv_last_page_len[offset:offset + n]
            tables.append((indptr.to(device), indices, last, offset))
            rows = [0] * n
            for r, j in enumerate(owner):
                rows[j] += case.qo_lens[r]
            qo_arr.append(torch.tensor([0] + [sum(rows[:j + 1]) for j in range(n)], dtype=torch.int32, device=device))
            offset += n
        kv_seen = []
        for r in range(len(case.qo_lens)):
            ids = [t[3] + owner[r] for t, owner in zip(tables, case.owners)]
            kv_seen.append((torch.cat([pool.k_list[i] for i in ids]), torch.cat([pool.v_list[i] for i in ids])))
        built.append((q, qo_indptr, tables, qo_arr, kv_seen))
    return pool, built


def _build(case: Cascade, seed: int = 0, device=DEVICE):
    pool, [(q, qo_indptr, tables, qo_arr, kv_seen)] = _build_many([case], seed, device)
    return q, qo_indptr, pool, tables, qo_arr, kv_seen


def _reference(q, qo_indptr, kv_seen, causal):
    """Per final request: attention over the concatenated K/V of every level."""
    qo = qo_indptr.cpu().tolist()
    outs, lses = [], []
    for r, (k, v) in enumerate(kv_seen):
        o, s = reference.attention(q[qo[r]:qo[r + 1]], k, v, causal=causal)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def _flat_table(case: Cascade, pool, tables):
    """Each final request's pages of every level concatenated in one page table: valid when every
    level but the last has whole pages (the brief's "plain batch attention over the pages")."""
    indptr, indices, last = [0], [], []
    for r in range(len(case.qo_lens)):
        pages = []
        for (ip, ix, lp, _), owner in zip(tables, case.owners):
            j = owner[r]
            a, b = int(ip[j]), int(ip[j + 1])
            pages += ix[a:b].cpu().tolist()
        n_last = case.levels[-1][r]
        indptr.append(indptr[-1] + len(pages))
        indices += pages
        last.append(((n_last - 1) % case.page_size) + 1 if n_last else case.page_size)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)


def _whole_pages(case: Cascade) -> bool:
    return all(n % case.page_size == 0 for lv in case.levels[:-1] for n in lv)


def _plan_multilevel(wrapper, case, tables, qo_arr, **kw):
    wrapper.plan(qo_arr, [t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], case.heads[0],
                 case.heads[1], case.head_dim, case.page_size, causal=case.causal, q_data_type=case.dtype, **kw)


# --------------------------------------------------------------------------------------------------
# MultiLevelCascadeAttentionWrapper
# --------------------------------------------------------------------------------------------------

CASES = [
    # decode: one query per request, a prefix of whole pages (also checked on the flat page table)
    Cascade(levels=((8,), (5, 3, 7)), owners=((0, 0, 0), (0, 1, 2)), qo_lens=(1, 1, 1)),
    # decode, HND tuple cache, bf16: a partial prefix page, a prefix long enough for split-KV, an
    # empty suffix (its last level is 0 / -inf and the merge keeps the prefix's state)
    Cascade(levels=((37,), (5, 0, 6)), owners=((0, 0, 0), (0, 1, 2)), qo_lens=(1, 1, 1), layout="HND",
            form="tuple", dtype=torch.bfloat16, heads=(4, 1)),
    # the issue's case, scaled down: a shared prefix, requests appending to their own suffixes,
    # 2 levels, causal on the last level (query tokens at the end of each suffix)
    Cascade(levels=((8,), (6, 9, 4)), owners=((0, 0, 0), (0, 1, 2)), qo_lens=(3, 5, 1), causal=True),
    # 3 levels (a system prompt, two group prefixes, suffixes), HND, causal, GQA 3
    Cascade(levels=((5,), (4, 7), (3, 2, 6, 2)), owners=((0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 2, 3)),
            qo_lens=(2, 1, 4, 2), layout="HND", heads=(6, 2), head_dim=16, causal=True),
]


@pytest.mark.parametrize("case", CASES, ids=Cascade.id)
def test_multilevel_matches_reference(case):
    q, qo_indptr, pool, tables, qo_arr, kv_seen = _build(case)
    wrapper = MultiLevelCascadeAttentionWrapper(len(case.levels), testing.make_workspace(1 << 20, DEVICE),
                                                case.layout)
    _plan_multilevel(wrapper, case, tables, qo_arr)
    o = wrapper.run(q, pool.cache)
    ref_o, _ = _reference(q, qo_indptr, kv_seen, case.causal)
    testing.assert_close(o, ref_o, case.dtype)
    if _whole_pages(case):
        flat = _flat_table(case, pool, tables)
        flat_o, _ = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, pool.cache, *flat, case.layout,
                                                                causal=case.causal)
        testing.assert_close(o, flat_o, case.dtype)


def test_multilevel_forward_alias_and_replan():
    """``begin_forward``/``forward`` are ``plan``/``run``; a second plan with other lengths is honoured."""
    wrapper = MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(1 << 20, DEVICE))
    for seed, case in enumerate((Cascade(levels=((4,), (3, 2)), owners=((0, 0), (0, 1)), qo_lens=(1, 1)),
                                 Cascade(levels=((9,), (1,)), owners=((0,), (0,)), qo_lens=(1,)))):
        q, qo_indptr, pool, tables, qo_arr, kv_seen = _build(case, seed=seed)
        wrapper.begin_forward(qo_arr, [t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables],
                              4, 2, 32, 4)
        testing.assert_close(wrapper.forward(q, pool.cache), _reference(q, qo_indptr, kv_seen, False)[0])


def test_multilevel_cuda_graph_buffers():
    """Fixed per-level buffers; re-planned with other lengths; rows beyond the plan give 0."""
    sizes = (1, 3)  # requests per level
    bufs = dict(
        qo_indptr_buf_arr=[torch.empty(b + 1, dtype=torch.int32, device=DEVICE) for b in sizes],
        paged_kv_indptr_buf_arr=[torch.empty(b + 1, dtype=torch.int32, device=DEVICE) for b in sizes],
        paged_kv_indices_buf_arr=[torch.empty(16, dtype=torch.int32, device=DEVICE) for _ in sizes],
        paged_kv_last_page_len_buf_arr=[torch.empty(b, dtype=torch.int32, device=DEVICE) for b in sizes],
    )
    wrapper = MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(1 << 20, DEVICE), "NHD", True, **bufs)
    assert wrapper.is_cuda_graph_enabled
    for seed, (levels, qo_lens) in enumerate(((((8,), (2, 5, 3)), (2, 3, 1)), (((13,), (6, 1, 4)), (1, 1, 2)))):
        case = Cascade(levels=levels, owners=((0, 0, 0), (0, 1, 2)), qo_lens=qo_lens, causal=True)
        q, qo_indptr, pool, tables, qo_arr, kv_seen = _build(case, seed=seed)
        _plan_multilevel(wrapper, case, tables, qo_arr)
        q_pad = torch.cat([q, testing.randn((8 - q.shape[0],) + tuple(q.shape[1:]), q.dtype, DEVICE)])
        o = wrapper.run(q_pad, pool.cache)
        testing.assert_close(o[:q.shape[0]], _reference(q, qo_indptr, kv_seen, True)[0])
        assert torch.all(o[q.shape[0]:] == 0)
    with pytest.raises(ValueError, match="qo_indptr_buf_arr: expected 2 entries"):
        MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(64, DEVICE), "NHD", True,
                                          **{**bufs, "qo_indptr_buf_arr": bufs["qo_indptr_buf_arr"][:1]})
    with pytest.raises(ValueError, match="paged_kv_indices_buf_arr: expected a list"):
        MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(64, DEVICE), "NHD", True,
                                          **{**bufs, "paged_kv_indices_buf_arr": None})


# --------------------------------------------------------------------------------------------------
# legacy shared-prefix wrappers
# --------------------------------------------------------------------------------------------------


def _shared_kv(shared_len, hk, d, layout, dtype, g):
    k = testing.randn((shared_len, hk, d), dtype, DEVICE, generator=g)
    v = testing.randn((shared_len, hk, d), dtype, DEVICE, generator=g)
    if layout == "HND":
        return k, v, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    return k, v, k, v


@pytest.mark.parametrize("layout,dtype,data_type,shared_len", [
    ("NHD", torch.float16, "float16", 7),
    ("HND", torch.bfloat16, torch.bfloat16, 40),  # split-KV in the shared part
])
def test_shared_prefix_decode(layout, dtype, data_type, shared_len):
    g = torch.Generator().manual_seed(1)
    hq, hk, d, page = 4, 2, 32, 4
    unique_lens = (3, 0, 9)
    k_nhd, v_nhd, k_shared, v_shared = _shared_kv(shared_len, hk, d, layout, dtype, g)
    kv = testing.make_paged_kv(unique_lens, page, hk, d, layout=layout, dtype=dtype, device=DEVICE, generator=g)
    q = testing.randn((len(unique_lens), hq, d), dtype, DEVICE, generator=g)
    wrapper = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), layout)
    wrapper.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, data_type=data_type)
    o = wrapper.forward(q, k_shared, v_shared, kv.cache)
    ref = torch.cat([reference.attention(q[i:i + 1], torch.cat([k_nhd, kv.k_list[i]]),
                                         torch.cat([v_nhd, kv.v_list[i]]))[0] for i in range(len(unique_lens))])
    testing.assert_close(o, ref, dtype)
    wrapper.end_forward()


def test_shared_prefix_decode_q_dtype_other_than_data_type():
    """FlashInfer plans fp16 queries whatever ``data_type`` is; tritoninfer follows q's dtype."""
    g = torch.Generator().manual_seed(2)
    kv = testing.make_paged_kv((5, 2), 4, 1, 16, dtype=torch.bfloat16, device=DEVICE, generator=g)
    k, v, _, _ = _shared_kv(6, 1, 16, "NHD", torch.bfloat16, g)
    q = testing.randn((2, 2, 16), torch.float16, DEVICE, generator=g)
    wrapper = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    wrapper.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 2, 1, 16, 4, data_type="bfloat16")
    o = wrapper.forward(q, k, v, kv.cache)
    ref = torch.cat([reference.attention(q[i:i + 1], torch.cat([k, kv.k_list[i]]), torch.cat([v, kv.v_list[i]]))[0]
                     for i in range(2)])
    testing.assert_close(o, ref, torch.float16)


@pytest.mark.parametrize("layout,dtype,causal,shared_len", [
    ("NHD", torch.bfloat16, True, 9),   # bf16: begin_forward has no dtype, forward re-plans
    ("HND", torch.float16, False, 3),
])
def test_shared_prefix_prefill(layout, dtype, causal, shared_len):
    g = torch.Generator().manual_seed(3)
    hq, hk, d, page = 4, 2, 32, 4
    unique_lens, qo_lens = (6, 3, 8), (4, 3, 1)
    k_nhd, v_nhd, k_shared, v_shared = _shared_kv(shared_len, hk, d, layout, dtype, g)
    kv = testing.make_paged_kv(unique_lens, page, hk, d, layout=layout, form="tuple", dtype=dtype, device=DEVICE,
                               generator=g)
    q, qo_indptr = testing.random_qo(qo_lens, hq, d, dtype=dtype, device=DEVICE, generator=g)
    wrapper = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), layout)
    wrapper.begin_forward(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page)
    o = wrapper.forward(q, k_shared, v_shared, kv.cache, causal=causal, sm_scale=0.3)
    qo = qo_indptr.tolist()
    ref = torch.cat([reference.attention(q[qo[i]:qo[i + 1]], torch.cat([k_nhd, kv.k_list[i]]),
                                         torch.cat([v_nhd, kv.v_list[i]]), causal=causal, sm_scale=0.3)[0]
                     for i in range(len(qo_lens))])
    testing.assert_close(o, ref, dtype)


# --------------------------------------------------------------------------------------------------
# API surface and bad input
# --------------------------------------------------------------------------------------------------

SIGNATURES = {
    MultiLevelCascadeAttentionWrapper.__init__: "num_levels float_workspace_buffer kv_layout=NHD use_cuda_graph=False "
    "qo_indptr_buf_arr=None paged_kv_indptr_buf_arr=None paged_kv_indices_buf_arr=None "
    "paged_kv_last_page_len_buf_arr=None",
    MultiLevelCascadeAttentionWrapper.plan: "qo_indptr_arr paged_kv_indptr_arr paged_kv_indices_arr "
    "paged_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size causal=False pos_encoding_mode=NONE "
    "use_fp16_qk_reduction=False sm_scale=None window_left=-1 logits_soft_cap=None rope_scale=None "
    "rope_theta=None q_data_type=float16 kv_data_type=None",
    MultiLevelCascadeAttentionWrapper.run: "q paged_kv_cache",
    MultiLevelCascadeAttentionWrapper.reset_workspace_buffer: "float_workspace_buffer int_workspace_buffers",
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper.__init__: "float_workspace_buffer kv_layout=NHD",
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper.begin_forward: "unique_kv_indptr unique_kv_indices "
    "unique_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size data_type=float16",
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward: "q k_shared v_shared unique_kv_cache",
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer: "float_workspace_buffer int_workspace_buffer",
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper.__init__: "float_workspace_buffer kv_layout=NHD",
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper.begin_forward: "qo_indptr paged_kv_indptr paged_kv_indices "
    "paged_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size",
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward: "q k_shared v_shared unique_kv_cache causal=False "
    "use_fp16_qk_reduction=False sm_scale=None rope_scale=None rope_theta=None",
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer: "float_workspace_buffer int_workspace_buffer",
}


def test_signatures_match_flashinfer_0_5_3():
    for fn, expected in SIGNATURES.items():
        params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
        got = " ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default}" for p in params)
        assert got == expected, fn.__qualname__
    assert MultiLevelCascadeAttentionWrapper.begin_forward is MultiLevelCascadeAttentionWrapper.plan
    assert MultiLevelCascadeAttentionWrapper.forward is MultiLevelCascadeAttentionWrapper.run
    for name in ("MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
                 "BatchPrefillWithSharedPrefixPagedKVCacheWrapper"):
        assert getattr(tritoninfer, name) is getattr(tritoninfer.cascade, name)
        assert name in tritoninfer.__all__


def test_errors_name_the_argument():
    case = CASES[0]
    q, qo_indptr, pool, tables, qo_arr, kv_seen = _build(case)
    ws = testing.make_workspace(1 << 20, DEVICE)
    indptrs, indices, lasts = [t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables]
    with pytest.raises(ValueError, match="num_levels"):
        MultiLevelCascadeAttentionWrapper(0, ws)
    w = MultiLevelCascadeAttentionWrapper(2, ws)
    with pytest.raises(ValueError, match="before plan"):
        w.run(q, pool.cache)
    with pytest.raises(ValueError, match=r"qo_indptr_arr: expected 2 entries .*got 3"):
        w.plan(qo_arr + qo_arr[:1], indptrs, indices, lasts, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="paged_kv_last_page_len: expected 2 entries"):
        w.plan(qo_arr, indptrs, indices, lasts[:1], 4, 2, 32, 4)
    with pytest.raises(TypeError, match="paged_kv_indices_arr: expected a list"):
        w.plan(qo_arr, indptrs, indices[0], lasts, 4, 2, 32, 4)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[0\]: every level covers every query row"):
        w.plan([torch.tensor([0, 2], dtype=torch.int32), qo_arr[1]], indptrs, indices, lasts, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="level 1: .*batch size"):
        w.plan(qo_arr, [indptrs[0], indptrs[1][:-1]], indices, [lasts[0], lasts[1][:-1]], 4, 2, 32, 4)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(qo_arr, indptrs, indices, lasts, 5, 2, 32, 4)
    with pytest.raises(NotImplementedError, match="use_fp16_qk_reduction"):
        w.plan(qo_arr, indptrs, indices, lasts, 4, 2, 32, 4, use_fp16_qk_reduction=True)
    w.plan(qo_arr, indptrs, indices, lasts, 4, 2, 32, 4)  # q_data_type defaults to float16, as FlashInfer
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q.to(torch.bfloat16), pool.cache)
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q[:-1], pool.cache)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        w.run(q, pool.cache[:, :, :2])  # page size 2, planned 4
    with pytest.raises(ValueError, match="int_workspace_buffers: expected 2 entries"):
        w.reset_workspace_buffer(ws, [ws])
    w.reset_workspace_buffer(ws, [ws, ws])

    d = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws)
    k, v, _, _ = _shared_kv(5, 2, 32, "NHD", torch.float16, torch.Generator().manual_seed(0))
    kv = testing.make_paged_kv((3, 4, 2), 4, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="before begin_forward"):
        d.forward(q, k, v, kv.cache)
    with pytest.raises(ValueError, match="data_type"):
        d.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, data_type="int8")
    with pytest.raises(ValueError, match="begin_forward.*last_page_len"):
        d.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len * 0, 4, 2, 32, 4)
    d.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="q: expected shape"):
        d.forward(q[:2], k, v, kv.cache)
    with pytest.raises(ValueError, match="k_shared: expected shape"):
        d.forward(q, k[:, :1], v, kv.cache)
    with pytest.raises(ValueError, match="v_shared: expected shape"):
        d.forward(q, k, v[:4], kv.cache)
    with pytest.raises(ValueError, match="v_shared: dtype"):
        d.forward(q, k, v.to(torch.bfloat16), kv.cache)
    with pytest.raises(ValueError, match="unique_kv_cache: dtype"):
        d.forward(q, k, v, kv.cache.to(torch.bfloat16))

    p = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws)
    with pytest.raises(ValueError, match="before begin_forward"):
        p.forward(q, k, v, kv.cache)
    p.begin_forward(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="q: expected shape"):
        p.forward(q[:1], k, v, kv.cache)
    with pytest.raises(ValueError, match="k_shared: expected a 3-D"):
        p.forward(q, k[None], v, kv.cache)
    with pytest.raises(NotImplementedError, match="use_fp16_qk_reduction"):
        p.forward(q, k, v, kv.cache, use_fp16_qk_reduction=True)


# --------------------------------------------------------------------------------------------------
# GPU: the issue's shapes (shared prefix of 1000 tokens, 8 requests with their own suffixes)
# --------------------------------------------------------------------------------------------------

GPU_UNIQUE = (37, 300, 1, 129, 64, 250, 16, 77)


def _gpu_case(form, layout, page_size):
    decode = form == "decode"
    qo = (1,) * 8 if decode else (17, 300, 1, 64, 5, 128, 16, 40)
    return Cascade(levels=((1000,), GPU_UNIQUE), owners=((0,) * 8, tuple(range(8))), qo_lens=qo,
                   page_size=page_size, heads=(32, 8), head_dim=128, layout=layout, dtype=torch.bfloat16,
                   causal=not decode)


@pytest.mark.gpu
@pytest.mark.parametrize("form,layout,page_size", [("decode", "NHD", 16), ("decode", "HND", 8),
                                                   ("prefill", "NHD", 8), ("prefill", "HND", 16)])
def test_gpu_issue_case(form, layout, page_size):
    """Cascade equals plain batch attention over the concatenated pages (page size 8: the prefix
    is whole pages, so the flat page table exists; page size 16: per-request reference)."""
    case = _gpu_case(form, layout, page_size)
    q, qo_indptr, pool, tables, qo_arr, kv_seen = _build(case)
    wrapper = MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(128 << 20, DEVICE), layout)
    _plan_multilevel(wrapper, case, [(t[0].cpu(), t[1], t[2].cpu(), t[3]) for t in tables],
                     [x.cpu() for x in qo_arr])
    o = wrapper.run(q, pool.cache)
    if _whole_pages(case):
        ref_o, _ = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, pool.cache, *_flat_table(case, pool, tables),
                                                               layout, causal=case.causal)
    else:
        ref_o, _ = _reference(q, qo_indptr, kv_seen, case.causal)
    testing.assert_close(o, ref_o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["decode", "prefill"])
def test_gpu_legacy_shared_prefix(form):
    g = torch.Generator().manual_seed(5)
    hq, hk, d, page, layout = 32, 8, 128, 16, "HND" if form == "decode" else "NHD"
    qo_lens = (1,) * 8 if form == "decode" else (17, 300, 1, 64, 5, 128, 16, 40)
    k_nhd, v_nhd, k_shared, v_shared = _shared_kv(1000, hk, d, layout, torch.bfloat16, g)
    kv = testing.make_paged_kv(GPU_UNIQUE, page, hk, d, layout=layout, dtype=torch.bfloat16, device=DEVICE, generator=g)
    q, qo_indptr = testing.random_qo(qo_lens, hq, d, dtype=torch.bfloat16, device=DEVICE, generator=g)
    ws = testing.make_workspace(128 << 20, DEVICE)
    if form == "decode":
        w = BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws, layout)
        w.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, data_type=torch.bfloat16)
        o = w.forward(q, k_shared, v_shared, kv.cache)
    else:
        w = BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws, layout)
        w.begin_forward(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page)
        o = w.forward(q, k_shared, v_shared, kv.cache, causal=True)
    qo = qo_indptr.tolist()
    ref = torch.cat([reference.attention(q[qo[i]:qo[i + 1]], torch.cat([k_nhd, kv.k_list[i]]),
                                         torch.cat([v_nhd, kv.v_list[i]]), causal=form == "prefill")[0]
                     for i in range(8)])
    testing.assert_close(o, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_then_replan():
    """Capture run() once in CUDA-graph mode; re-plan with other lengths; replay: still correct."""
    sizes = (1, 8)
    bufs = dict(
        qo_indptr_buf_arr=[torch.empty(b + 1, dtype=torch.int32, device=DEVICE) for b in sizes],
        paged_kv_indptr_buf_arr=[torch.empty(b + 1, dtype=torch.int32, device=DEVICE) for b in sizes],
        paged_kv_indices_buf_arr=[torch.empty(4096, dtype=torch.int32, device=DEVICE) for _ in sizes],
        paged_kv_last_page_len_buf_arr=[torch.empty(b, dtype=torch.int32, device=DEVICE) for b in sizes],
    )
    wrapper = MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(128 << 20, DEVICE), "NHD", True, **bufs)
    cases = [_gpu_case("decode", "NHD", 16),
             dataclasses.replace(_gpu_case("decode", "NHD", 16), levels=((2500,), (5, 900, 1, 1, 33, 2, 17, 100)))]
    pool, built = _build_many(cases)
    q_static = torch.empty_like(built[0][0])
    graph = o_static = None
    for case, (q, qo_indptr, tables, qo_arr, kv_seen) in zip(cases, built):
        _plan_multilevel(wrapper, case, [(t[0].cpu(), t[1], t[2].cpu(), t[3]) for t in tables],
                         [x.cpu() for x in qo_arr])
        q_static.copy_(q)
        if graph is None:
            wrapper.run(q_static, pool.cache)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                o_static = wrapper.run(q_static, pool.cache)
        graph.replay()
        torch.cuda.synchronize()
        testing.assert_close(o_static, _reference(q, qo_indptr, kv_seen, False)[0], torch.bfloat16)
