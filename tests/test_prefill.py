"""Prefill API (single, paged, ragged) against the reference: every option, pairwise, on tiny
awkward shapes (interpreter) and realistic shapes (GPU)."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import DEVICE

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from tritoninfer.quantization import segment_packbits


@dataclasses.dataclass
class Case:
    qo_lens: tuple
    kv_lens: tuple
    page_size: int = 4
    heads: tuple = (4, 2)
    head_dim: int = 32
    head_dim_vo: int = None
    layout: str = "NHD"
    form: str = "5d"
    q_dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype = torch.float16
    causal: bool = False
    mask: str = "none"  # none | bool | packed
    pos: str = "NONE"
    window: int = -1
    soft_cap: float = None
    sinks: bool = False
    split: str = "auto"

    def id(self):
        return (f"q{list(self.qo_lens)}-kv{list(self.kv_lens)}-p{self.page_size}-h{self.heads[0]}/{self.heads[1]}-"
                f"d{self.head_dim}/{self.head_dim_vo}-{self.layout}-{self.form}-{str(self.q_dtype)[6:]}-"
                f"{str(self.kv_dtype)[6:]}-c{int(self.causal)}-m{self.mask}-{self.pos}-w{self.window}-"
                f"cap{self.soft_cap}-s{int(self.sinks)}-{self.split}")


PAGED_CASES = [
    Case((3, 0, 5, 1), (10, 4, 5, 30), causal=True),
    Case((6,), (3,), layout="HND", form="tuple", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True),
    Case((4, 3), (9, 3), page_size=1, form="tuple3d", heads=(7, 1), head_dim=40, mask="bool"),
    Case((2, 5), (7, 11), page_size=3, mask="packed", heads=(2, 2), window=3),
    Case((5, 2), (12, 20), page_size=3, pos="ROPE_LLAMA", window=4, soft_cap=3.0, layout="HND"),
    Case((7,), (19,), heads=(4, 4), head_dim=64, pos="ALIBI", causal=True, sinks=True, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16),
    Case((3, 4), (8, 13), heads=(8, 2), kv_dtype=torch.float8_e4m3fn, causal=True, form="tuple"),
    Case((2, 3), (5, 9), head_dim=48, head_dim_vo=32, form="tuple", q_dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2),
    Case((2,), (1500,), heads=(4, 1), page_size=8, causal=True, split="auto"),
    Case((3, 1), (70, 41), heads=(4, 1), page_size=4, split="fixed", window=20),
]

RAGGED_CASES = [
    Case((4, 0, 6), (4, 3, 9), heads=(6, 2), causal=True, layout="HND"),
    Case((3, 5), (6, 2), mask="bool", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, pos="ROPE_LLAMA"),
    Case((5,), (33,), heads=(2, 1), head_dim=24, head_dim_vo=40, soft_cap=2.0, window=9),
]


def _inputs(case, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q, qo_indptr = testing.random_qo(case.qo_lens, case.heads[0], case.head_dim, dtype=case.q_dtype, generator=g)
    q = q.to(device)
    bits = [torch.rand(qo, kv, generator=g) > 0.4 for qo, kv in zip(case.qo_lens, case.kv_lens)]
    mask = torch.cat([b.reshape(-1) for b in bits]).to(device) if bits else None
    sinks = torch.randn(case.heads[0], generator=g).to(device) if case.sinks else None
    return g, q, qo_indptr, mask, sinks


def _mask_args(case, mask):
    if case.mask == "bool":
        return {"custom_mask": mask}
    if case.mask == "packed":
        lens = np.array(case.qo_lens) * np.array(case.kv_lens)
        indptr = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=mask.device)
        return {"packed_custom_mask": segment_packbits(mask, indptr, bitorder="little")[0]}
    return {}


def _opts(case):
    opts = dict(causal=case.causal, pos_encoding_mode=case.pos, window_left=case.window, logits_soft_cap=case.soft_cap)
    if case.split == "fixed":
        opts["fixed_split_size"] = 2
    elif case.split == "disable":
        opts["disable_split_kv"] = True
    return opts


@pytest.mark.parametrize("case", PAGED_CASES, ids=Case.id)
def test_paged_prefill_matches_reference(case, device=DEVICE):
    g, q, qo_indptr, mask, sinks = _inputs(case, device=device)
    scale = 0.5 if case.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
    kv = testing.make_paged_kv(case.kv_lens, case.page_size, case.heads[1], case.head_dim, head_dim_vo=case.head_dim_vo,
                               layout=case.layout, form=case.form, dtype=case.kv_dtype, device=device, generator=g,
                               k_scale=scale, v_scale=scale)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, device), case.layout)
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.heads[0], case.heads[1],
                 case.head_dim, case.page_size, head_dim_vo=case.head_dim_vo, q_data_type=case.q_dtype,
                 kv_data_type=case.kv_dtype, **_opts(case), **_mask_args(case, mask))
    if case is PAGED_CASES[8]:  # one long request, one KV head: splits with the interpreter's and the GPU's tiles and SMs
        assert wrapper._step.device_plan.has_splits
    o, lse = wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=sinks, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr.to(device), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.layout,
        custom_mask=mask if case.mask != "none" else None, k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=sinks,
        **{k: v for k, v in _opts(case).items() if k not in ("fixed_split_size", "disable_split_kv")})
    testing.assert_close(o, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.q_dtype)


def test_a_new_plan_keeps_the_bound_launch():
    """A paged prefill wrapper's plans of other lengths (and another shape) reuse the launch bound by
    the first run (its tiles are one object per choice, ``_plan.canonical``) with the new plan's
    tensors; every run matches the reference."""
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    for seed, (qo_lens, kv_lens) in enumerate((((6, 3), (9, 20)), ((5, 4), (12, 18)), ((2, 7, 1), (3, 30, 8)))):
        case = Case(qo_lens, kv_lens, causal=True)
        g, q, qo_indptr, _, _ = _inputs(case, seed=seed)
        kv = testing.make_paged_kv(case.kv_lens, case.page_size, 2, 32, device=DEVICE, generator=g)
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, case.page_size,
                     causal=True, q_data_type=case.q_dtype)
        o = wrapper.run(q, kv.cache)
        ref = reference.batch_prefill_with_paged_kv_cache(
            q, qo_indptr.to(DEVICE), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, "NHD", causal=True)[0]
        testing.assert_close(o, ref, case.q_dtype)
        launches = wrapper._step.device_plan.attention_launches
        assert len(launches) == 1 and next(iter(launches.values())).plan is wrapper._step.device_plan


@pytest.mark.parametrize("sm_scale,k_scale", [(0.3, None), (-0.3, None), (0.25, -2.0), (0.0, None)])
def test_folded_softmax_scale_of_any_sign(sm_scale, k_scale):
    """Prefill tiles apply the softmax scale inside exp2 (``FOLD_SCALE``), with the row max taken on
    raw scores, for positive scales; a scale <= 0 (from plan() or from run()'s k_scale) takes the
    unfolded launch. Rows that see no key (causal, more queries than keys) stay 0 / -inf. (73 query tokens:
    above 64 packed rows a request, the GPU's planner too takes prefill tiles, not decode's.)"""
    case = Case((70, 3), (67, 20), heads=(4, 2), causal=True)
    g, q, qo_indptr, _, _ = _inputs(case)
    kv = testing.make_paged_kv(case.kv_lens, case.page_size, 2, 32, device=DEVICE, generator=g)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, case.page_size,
                 causal=True, sm_scale=sm_scale, q_data_type=case.q_dtype)
    o, lse = wrapper.run(q, kv.cache, k_scale=k_scale, return_lse=True)
    bound = next(iter(wrapper._step.device_plan.attention_launches.values()))
    assert bound.attention.kwargs["FOLD_SCALE"] and not bound.unfolded.kwargs["FOLD_SCALE"]
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr.to(DEVICE), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, "NHD", causal=True,
        sm_scale=sm_scale, k_scale=k_scale)
    testing.assert_close(o, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.q_dtype)
    assert torch.all(o[:3] == 0) and torch.all(lse[:3] == float("-inf"))  # rows before the first key


# GPU tile choices run through the interpreter: decode-shaped tiles for short queries (FlashInfer's
# small query tile), and 128-row tiles whose split states are merged 16 rows per program
GPU_TILE_CASES = [
    (Case((1, 1, 2, 1), (37, 5, 70, 0), heads=(8, 2), causal=True), 16),
    (Case((1, 3), (90, 41), heads=(8, 2), q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, split="fixed"), 16),
    (Case((3, 2, 1), (20, 33, 9), heads=(12, 2), head_dim=48, head_dim_vo=32, form="tuple", split="fixed", sinks=True),
     16),
    (Case((40,), (300,), heads=(4, 1), causal=True, split="fixed"), 128),
]


@pytest.mark.parametrize("case,block_m", GPU_TILE_CASES, ids=lambda c: c.id() if isinstance(c, Case) else str(c))
def test_gpu_tile_choices_match_reference(case, block_m, monkeypatch):
    from types import SimpleNamespace

    from tritoninfer import _plan

    monkeypatch.setattr(_plan, "_device", SimpleNamespace(is_interpreter=lambda: False))
    g, q, qo_indptr, mask, sinks = _inputs(case)
    kv = testing.make_paged_kv(case.kv_lens, case.page_size, case.heads[1], case.head_dim, head_dim_vo=case.head_dim_vo,
                               form=case.form, dtype=case.kv_dtype, device=DEVICE, generator=g,
                               k_scale=0.5 if case.kv_dtype.itemsize == 1 else None,
                               v_scale=0.5 if case.kv_dtype.itemsize == 1 else None)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.heads[0], case.heads[1],
                 case.head_dim, case.page_size, head_dim_vo=case.head_dim_vo, q_data_type=case.q_dtype,
                 kv_data_type=case.kv_dtype, **_opts(case))
    assert wrapper._step.tiles.block_m == block_m
    assert wrapper._step.tiles.kv_as_m == (block_m < 128 and case.kv_dtype.itemsize == 2 and case.head_dim <= 128)
    if case.split == "fixed":
        assert wrapper._step.device_plan.has_splits
    o, lse = wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=sinks, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr.to(DEVICE), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, "NHD",
        k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=sinks, causal=case.causal)
    testing.assert_close(o, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.q_dtype)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=Case.id)
def test_ragged_prefill_matches_reference(case, device=DEVICE, hopper=False):
    g, q, qo_indptr, mask, _ = _inputs(case, device=device)
    hk, d, dvo = case.heads[1], case.head_dim, case.head_dim_vo or case.head_dim
    k, kv_indptr = testing.make_ragged(case.kv_lens, hk, d, dtype=case.kv_dtype, device=device, generator=g)
    v, _ = testing.make_ragged(case.kv_lens, hk, dvo, dtype=case.kv_dtype, device=device, generator=g)
    if case.layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # strided [H, nnz, D] views
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(4 << 20, device), case.layout)
    wrapper.plan(qo_indptr, kv_indptr, case.heads[0], hk, d, head_dim_vo=case.head_dim_vo, q_data_type=case.q_dtype,
                 kv_data_type=case.kv_dtype, **_opts(case), **_mask_args(case, mask))
    assert (wrapper._step.route_work is not None) == hopper
    o, lse = wrapper.run_return_lse(q, k, v)
    ref_o, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, kv_layout=case.layout, custom_mask=mask if case.mask != "none" else None,
        **_opts(case))
    testing.assert_close(o, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.q_dtype)


def test_hopper_kernel_is_not_planned_off_hopper():
    """On this machine (no Hopper GPU) every ragged plan stays on the attention core."""
    case = RAGGED_CASES[0]
    g, q, qo_indptr, _, _ = _inputs(case)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    wrapper.plan(qo_indptr, qo_indptr, 4, 2, 64, q_data_type=torch.bfloat16)
    assert wrapper._step.route_work is None or torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill(layout):
    g = torch.Generator().manual_seed(1)
    qo, kv, hq, hk, d = 5, 12, 4, 2, 32
    q = testing.randn((qo, hq, d), torch.float16, DEVICE, generator=g)
    shape = (kv, hk, d) if layout == "NHD" else (hk, kv, d)
    k = testing.randn(shape, torch.float16, DEVICE, generator=g)
    v = testing.randn(shape, torch.float16, DEVICE, generator=g)
    scales = [(torch.rand(n, generator=g) + 0.5).to(DEVICE) for n in (hq, hk, hk)]
    o, lse = tritoninfer.single_prefill_with_kv_cache_return_lse(
        q, k, v, *scales, torch.float32, causal=True, kv_layout=layout, pos_encoding_mode="ROPE_LLAMA", window_left=6)
    assert o.dtype == torch.float32
    ref_o, ref_lse = reference.single_prefill_with_kv_cache(
        q, k, v, *scales, causal=True, kv_layout=layout, pos_encoding_mode="ROPE_LLAMA", window_left=6, return_lse=True)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse)
    mask = torch.rand(qo, kv, generator=g).to(DEVICE) > 0.5
    o = tritoninfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, kv_layout=layout, logits_soft_cap=4.0)
    ref_o = reference.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, kv_layout=layout, logits_soft_cap=4.0)
    testing.assert_close(o, ref_o, torch.float16)
    # the mask flattened, as FlashInfer's multi-item test passes it: the same result
    flat = tritoninfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.reshape(-1), kv_layout=layout,
                                                    logits_soft_cap=4.0)
    assert torch.equal(flat, o)
    with pytest.raises(ValueError, match="custom_mask: expected qo_len"):
        tritoninfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.reshape(-1)[1:], kv_layout=layout)


def _graph_wrapper(batch, **extra_bufs):
    """A CUDA-graph paged prefill wrapper with fixed buffers for ``batch`` requests (64 pages)."""
    bufs = dict(qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
                paged_kv_indices_buf=torch.empty(64, dtype=torch.int32, device=DEVICE),
                paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32, device=DEVICE), **extra_bufs)
    return BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_cuda_graph=True, **bufs)


def _check_graph_run(wrapper, q, qo_indptr, kv, rows, **ref_kw):
    """Runs ``q`` padded to ``rows`` rows (as a captured graph sees it) against the reference; the
    padding rows must come out 0."""
    q_full = torch.zeros((rows,) + tuple(q.shape[1:]), dtype=q.dtype, device=DEVICE)
    q_full[:q.shape[0]] = q
    o = wrapper.run(q_full, kv.cache)
    ref_o, _ = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                           kv.kv_last_page_len, **ref_kw)
    testing.assert_close(o[:q.shape[0]], ref_o, q.dtype)
    assert torch.all(o[q.shape[0]:] == 0)


def test_tree_mask_cuda_graph_buffers_replan():
    """Speculative verification: tree masks through the fixed mask buffers, re-planned with other
    lengths; the launch grid stays the one of the first plan."""
    batch, hq, hk, d, page = 2, 4, 2, 32, 4
    wrapper = _graph_wrapper(batch, custom_mask_buf=torch.empty(256, dtype=torch.uint8, device=DEVICE),
                             mask_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE))
    capacities = []
    for seed, (qo_lens, kv_lens) in enumerate((((4, 4), (9, 6)), ((3, 4), (30, 5)), ((4, 2), (4, 17)))):
        case = Case(qo_lens, kv_lens, heads=(hq, hk), head_dim=d, mask="bool")
        g, q, qo_indptr, mask, _ = _inputs(case, seed=seed)
        kv = testing.make_paged_kv(kv_lens, page, hk, d, device=DEVICE, generator=g)
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page,
                     custom_mask=mask, q_data_type=torch.float16)
        capacities.append(wrapper._step.device_plan.capacity)
        _check_graph_run(wrapper, q, qo_indptr, kv, 8, custom_mask=mask)
    assert len(set(capacities)) == 1
    with pytest.raises(ValueError, match="first plan"):
        case = Case((8, 8), (9, 9))
        g, q, qo_indptr, _, _ = _inputs(case)
        kv = testing.make_paged_kv((9, 9), page, hk, d, device=DEVICE, generator=g)
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page,
                     custom_mask=torch.ones(2 * 8 * 9, dtype=torch.bool, device=DEVICE))
    # a wrapper made with mask buffers applies them on every run (FlashInfer): a plan without a mask is refused
    with pytest.raises(ValueError, match="custom_mask_buf"):
        case = Case((4, 4), (9, 6))
        g, q, qo_indptr, _, _ = _inputs(case)
        kv = testing.make_paged_kv((9, 6), page, hk, d, device=DEVICE, generator=g)
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=True)


def test_cuda_graph_keeps_the_first_plans_tiles(monkeypatch):
    """With GPU tile choices, a CUDA-graph wrapper first planned with long queries (128-row tiles)
    keeps them when a later plan has short queries (decode-shaped tiles otherwise): a captured
    graph holds the first plan's kernel."""
    from types import SimpleNamespace

    from tritoninfer import _plan

    monkeypatch.setattr(_plan, "_device", SimpleNamespace(is_interpreter=lambda: False))
    batch, hq, hk, d, page = 2, 4, 2, 32, 4
    wrapper = _graph_wrapper(batch)
    fresh = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    for seed, (qo_lens, kv_lens) in enumerate((((40, 30), (50, 41)), ((1, 2), (33, 7)))):
        case = Case(qo_lens, kv_lens, heads=(hq, hk), head_dim=d, causal=True)
        g, q, qo_indptr, _, _ = _inputs(case, seed=seed)
        kv = testing.make_paged_kv(kv_lens, page, hk, d, device=DEVICE, generator=g)
        for w in (wrapper, fresh):
            w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=True,
                   q_data_type=torch.float16)
        _check_graph_run(wrapper, q, qo_indptr, kv, 70, causal=True)
        assert wrapper._step.tiles.block_m == 128
    assert fresh._step.tiles.block_m == 16


def test_forward_overwrites_planned_settings():
    case = Case((3, 4), (7, 9), causal=True, pos="ROPE_LLAMA")
    g, q, qo_indptr, _, _ = _inputs(case)
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE, generator=g)
    w = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    w.begin_forward(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, causal=True,
                    pos_encoding_mode="ROPE_LLAMA")
    o, lse = w.forward_return_lse(q, kv.cache)  # defaults: not causal, no rope
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                 kv.kv_last_page_len)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse)
    k, kv_indptr = testing.make_ragged(case.kv_lens, 2, 32, dtype=torch.float16, device=DEVICE, generator=g)
    r = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    r.plan(qo_indptr, kv_indptr, 4, 2, 32)
    o = r.forward(q, k, k, causal=True, sm_scale=0.3)
    ref_o, _ = reference.batch_prefill_with_ragged_kv_cache(q, k, k, qo_indptr, kv_indptr, causal=True, sm_scale=0.3)
    testing.assert_close(o, ref_o, torch.float16)
    r.end_forward()


def test_prefill_errors():
    case = Case((3, 4), (7, 9))
    g, q, qo_indptr, mask, _ = _inputs(case)
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE, generator=g)
    ws = testing.make_workspace(1 << 20, DEVICE)
    w = BatchPrefillWithPagedKVCacheWrapper(ws)
    args = (qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="before plan"):
        w.run(q, kv.cache)
    with pytest.raises(ValueError, match="custom_mask"):
        w.plan(*args, custom_mask=mask[:-1])
    with pytest.raises(NotImplementedError, match="fp16_qk"):
        w.plan(*args, use_fp16_qk_reduction=True)
    with pytest.raises(ValueError, match="max_item_len_ptr: multi-item scoring needs"):
        w.plan(*args, prefix_len_ptr=qo_indptr)  # the other multi-item arguments missing (tests/test_multi_item.py)
    with pytest.raises(ValueError, match="backend"):
        BatchPrefillWithPagedKVCacheWrapper(ws, backend="nope")
    with pytest.raises(ValueError, match="qo_indptr_buf"):
        BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True)
    w.plan(*args)
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q[:-1], kv.cache)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q.to(torch.bfloat16), kv.cache)
    with pytest.raises(ValueError, match="window_left"):
        w.run(q, kv.cache, window_left=2)
    with pytest.raises(ValueError, match="max_sequence_kv"):
        w.plan(*args, max_sequence_kv=3)
    r = BatchPrefillWithRaggedKVCacheWrapper(ws)
    k, kv_indptr = testing.make_ragged(case.kv_lens, 2, 32, dtype=torch.float16, device=DEVICE, generator=g)
    r.plan(qo_indptr, kv_indptr, 4, 2, 32)
    with pytest.raises(ValueError, match="k: expected"):
        r.run(q, k[:-1], k[:-1])
    with pytest.raises(TypeError, match="keyword"):
        r.run(q, k, k, None)


# ---------------------------------------------------------------- GPU: realistic shapes

GPU_CASES = [
    Case((1024,) * 4, (1024,) * 4, page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True),
    Case((300, 17, 1), (2000, 500, 4000), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True, pos="ROPE_LLAMA"),
    Case((257, 64), (257, 1000), page_size=1, form="tuple3d", heads=(28, 4), head_dim=64, q_dtype=torch.float16,
         kv_dtype=torch.float16, causal=True),
    Case((128, 100), (600, 130), page_size=16, layout="HND", heads=(16, 2), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, soft_cap=30.0, window=100),
    Case((200, 200), (900, 700), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn, causal=True, sinks=True),
    Case((64, 31), (800, 95), page_size=8, heads=(8, 8), head_dim=96, head_dim_vo=64, form="tuple",
         q_dtype=torch.float16, kv_dtype=torch.float16, mask="bool", pos="ALIBI"),
    Case((16,), (32768,), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=Case.id)
def test_gpu_paged_prefill(case):
    test_paged_prefill_matches_reference(case, device="cuda")


# ragged plans on the H200: those the Gluon Hopper kernel takes (bf16, head_dim 128 and 64: uneven lengths,
# empty requests, GQA groups of 4 and 7, causal with long requests) and neighbours that keep the
# attention core (fp16, causal with short requests); (case, takes the Gluon kernel)
HOPPER_CASES = [
    (Case((8200, 0, 77, 8200), (8200, 5, 0, 8300), heads=(16, 4), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16, causal=True), True),
    (Case((1000, 0, 77, 300), (1000, 5, 0, 2100), heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16, causal=True), False),
    (Case((1500, 700), (1500, 1000), heads=(28, 4), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
     True),
    (Case((513, 129), (513, 1000), heads=(28, 4), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
     False),
    (Case((300, 64), (200, 64), heads=(8, 8), head_dim=64, q_dtype=torch.float16, kv_dtype=torch.float16,
          causal=True), False),
    (Case((4096,), (4096,), heads=(16, 4), head_dim=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), True),
]


# paged plans the Gluon kernel's paged mode takes (page sizes 8 to 64, 5-D and tuple caches, shuffled
# pages, empty requests, causal with long requests) and neighbours that keep the core (HND, short causal
# requests) or take it unless _route.HOPPER_GATHER is on (pages of 1 or 48 tokens, which TMA cannot box);
# (case, takes the Gluon kernel: True, False or GATHERED)
GATHERED = "gathered"
HOPPER_PAGED_CASES = [
    (Case((6000, 0, 77, 3000), (6000, 5, 0, 6100), page_size=16, heads=(32, 8), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True), True),
    (Case((1500, 700), (1500, 1000), page_size=64, form="tuple", heads=(28, 4), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), True),
    (Case((700, 500), (900, 500), page_size=32, heads=(16, 2), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16), True),
    (Case((1100, 1000), (1300, 1000), page_size=1, form="tuple3d", heads=(16, 2), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), GATHERED),
    (Case((2048, 2100), (2100, 4000), page_size=8, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16, causal=True), True),
    (Case((1024, 1024), (1100, 1024), page_size=32, layout="HND", heads=(32, 8), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), False),
    (Case((1024, 1024), (1100, 1024), page_size=48, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16), GATHERED),
    (Case((1000, 0, 77, 300), (1000, 5, 0, 2100), page_size=16, heads=(32, 8), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True), False),
]


def _count_hopper_launches(monkeypatch) -> list:
    """A list that gets an entry for each launch of the Gluon kernel (which still runs)."""
    from tritoninfer import _hopper

    calls = []
    launch = _hopper.launch
    monkeypatch.setattr(_hopper, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    return calls


def _needs_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon prefill kernel is for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("case,gluon", HOPPER_CASES, ids=lambda c: c.id() if isinstance(c, Case) else str(c))
def test_gpu_hopper_ragged_prefill(case, gluon, monkeypatch):
    _needs_hopper()
    calls = _count_hopper_launches(monkeypatch)
    test_ragged_prefill_matches_reference(case, device="cuda", hopper=gluon)
    assert bool(calls) == gluon


@pytest.mark.gpu
@pytest.mark.parametrize("case,gluon", HOPPER_PAGED_CASES, ids=lambda c: c.id() if isinstance(c, Case) else str(c))
def test_gpu_hopper_paged_prefill(case, gluon, monkeypatch):
    from tritoninfer import _route

    _needs_hopper()
    calls = _count_hopper_launches(monkeypatch)
    test_paged_prefill_matches_reference(case, device="cuda")
    assert bool(calls) == (_route.HOPPER_GATHER if gluon == GATHERED else gluon)


# pages TMA cannot box, on the Gluon kernel's gathering producer (_route.HOPPER_GATHER): page 1 (SGLang's,
# as 3-D tuples), 4 (5-D, causal, empty requests), 48 (not dividing the 128-token tile), 128 at head_dim 256
# (a page spans two 64-position tiles)
HOPPER_GATHER_CASES = [
    Case((1100, 1000), (1300, 1000), page_size=1, form="tuple3d", heads=(16, 2), head_dim=128,
         q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((6000, 0, 77, 3000), (6000, 5, 0, 6100), page_size=4, heads=(32, 8), head_dim=128,
         q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True),
    Case((1024, 1024), (1100, 1024), page_size=48, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16),
    Case((1100, 1000), (1300, 2000), page_size=128, heads=(16, 8), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_GATHER_CASES, ids=lambda c: c.id())
def test_gpu_hopper_paged_prefill_gather(case, monkeypatch):
    """With ``_route.HOPPER_GATHER`` on, paged plans whose pages TMA cannot box run on the Gluon kernel
    (its producer gathers the rows by cp.async) and match the reference."""
    from tritoninfer import _route

    _needs_hopper()
    monkeypatch.setattr(_route, "HOPPER_GATHER", True)
    calls = _count_hopper_launches(monkeypatch)
    test_paged_prefill_matches_reference(case, device="cuda")
    assert calls


# e4m3 K/V with bf16 queries on the Gluon kernel's fp8 mode (_route.HOPPER_FP8): paged (pages 16 and 64,
# causal, with the fp8 scales make_paged_kv draws) and ragged
HOPPER_FP8_PAGED_CASES = [
    Case((1500, 1024), (1700, 1024), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn, causal=True),
    Case((2048, 700), (2048, 3000), page_size=64, heads=(16, 2), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn),
]
HOPPER_FP8_RAGGED_CASES = [
    Case((1100, 1500), (1100, 1600), heads=(16, 4), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_FP8_PAGED_CASES + HOPPER_FP8_RAGGED_CASES, ids=lambda c: c.id())
def test_gpu_hopper_fp8_prefill(case, monkeypatch):
    """With ``_route.HOPPER_FP8`` on, e4m3 K/V run on the Gluon kernel's fp8 mode (the producer
    warpgroup converting each tile to fp16) and match the reference, scales included."""
    from tritoninfer import _route

    _needs_hopper()
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    calls = _count_hopper_launches(monkeypatch)
    if case in HOPPER_FP8_RAGGED_CASES:
        test_ragged_prefill_matches_reference(case, device="cuda", hopper=True)
    else:
        test_paged_prefill_matches_reference(case, device="cuda")
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_hopper_ragged_prefill_192_128(causal, monkeypatch):
    """With ``_route.HOPPER_192_128`` on, DeepSeek's non-absorbed prefill (ragged, head_dim_qk 192 / vo 128,
    one KV head a query head) runs on the Gluon kernel, Q and K in three 64-column chunks, and matches the
    reference, LSE included: requests of lengths off the 128-token tile, one of them empty of queries."""
    from tritoninfer import _route

    _needs_hopper()
    monkeypatch.setattr(_route, "HOPPER_192_128", True)
    monkeypatch.setattr(_route, "HOPPER_FORCE", True)  # lengths below the route's threshold
    calls = _count_hopper_launches(monkeypatch)
    g = torch.Generator().manual_seed(11)
    qo_lens, kv_lens, heads = (300, 0, 1100, 77), (300, 40, 1500, 77), 16
    q, qo_indptr = testing.random_qo(qo_lens, heads, 192, dtype=torch.bfloat16, generator=g)
    k, kv_indptr = testing.make_ragged(kv_lens, heads, 192, torch.bfloat16, "cpu", g)
    v, _ = testing.make_ragged(kv_lens, heads, 128, torch.bfloat16, "cpu", g)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    w = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(64 << 20, "cuda"))
    w.plan(qo_indptr, kv_indptr, heads, heads, 192, head_dim_vo=128, causal=causal, q_data_type=torch.bfloat16)
    assert w._step.route.kernel == "hopper", w._step.route
    out = testing.nan_like(q[..., :128])
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    w.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr.cuda(), kv_indptr.cuda(),
                                                                  causal=causal)
    testing.assert_close(out, ref_o, torch.bfloat16)
    testing.assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)
    assert calls


# head_dim 64 on the Gluon kernel's three consumer warpgroups (_route.HOPPER_D64, 192-token query tiles) and 256 on
# its 64-position K/V stages (_route.HOPPER_D256): ragged and paged, causal with requests off the tiles and an
# empty one, GQA groups of 1 to 8
HOPPER_HEAD_DIM_CASES = [  # (case, ragged: False runs the paged wrapper over the case's pages)
    (Case((1000, 0, 77, 400), (1000, 5, 0, 2100), heads=(32, 8), head_dim=64, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True), True),
    (Case((1500, 193), (1500, 1000), heads=(8, 8), head_dim=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), True),
    (Case((2000, 0, 385), (2100, 5, 900), page_size=16, heads=(32, 8), head_dim=64, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True), False),
    (Case((700, 500), (900, 500), page_size=64, form="tuple", heads=(16, 4), head_dim=64, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16), False),
    (Case((1000, 0, 77, 400), (1000, 5, 0, 2100), heads=(16, 2), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True), True),
    (Case((1500, 193), (1500, 1000), heads=(8, 8), head_dim=256, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16), True),
    (Case((2000, 0, 385), (2100, 5, 900), page_size=16, heads=(32, 4), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, causal=True), False),
    (Case((700, 500), (900, 500), page_size=64, form="tuple", heads=(16, 8), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16), False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,ragged", HOPPER_HEAD_DIM_CASES,
                         ids=lambda c: c.id() if isinstance(c, Case) else "ragged" if c else "paged")
def test_gpu_hopper_prefill_head_dims(case, ragged, monkeypatch):
    """With ``_route.HOPPER_D64`` / ``HOPPER_D256`` on, head_dim 64 (three consumer warpgroups) and 256
    (64-position stages) run on the Gluon kernel and match the reference (LSE included)."""
    from tritoninfer import _route

    _needs_hopper()
    monkeypatch.setattr(_route, "HOPPER_D64", True)
    monkeypatch.setattr(_route, "HOPPER_D256", True)
    monkeypatch.setattr(_route, "HOPPER_FORCE", True)  # lengths below the route's threshold
    calls = _count_hopper_launches(monkeypatch)
    if ragged:
        test_ragged_prefill_matches_reference(case, device="cuda", hopper=True)
    else:
        test_paged_prefill_matches_reference(case, device="cuda")
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("case,ragged", HOPPER_HEAD_DIM_CASES + [
    (Case((1000, 0, 77, 300), (1000, 5, 0, 2100), heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16, causal=True), True),
    (Case((300, 17, 1, 700), (2000, 500, 4000, 700), page_size=16, heads=(32, 8), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True), False)],
    ids=lambda c: c.id() if isinstance(c, Case) else "ragged" if c else "paged")
@pytest.mark.parametrize("idle_skip", [True, False], ids=["idle-skip", "no-idle-skip"])
def test_gpu_hopper_prefill_idle_skip(case, ragged, monkeypatch, idle_skip):
    """Consumers whose rows lie past their request's last query token release the item's tiles unread
    (``_hopper.IDLE_SKIP``, on by default) or read them as every other consumer does; outputs and LSE match
    the reference either way (requests off the query tiles)."""
    from tritoninfer import _hopper

    monkeypatch.setattr(_hopper, "IDLE_SKIP", idle_skip)
    test_gpu_hopper_prefill_head_dims(case, ragged, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case,ragged", HOPPER_HEAD_DIM_CASES + [
    (Case((1000, 0, 77, 300), (1000, 5, 0, 2100), heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
          kv_dtype=torch.bfloat16, causal=True), True),
    (Case((300, 17, 1, 700), (2000, 500, 4000, 700), page_size=16, heads=(24, 24), head_dim=128,
          q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, causal=True), False),
    (HOPPER_FP8_PAGED_CASES[0], False), (None, True)],
    ids=lambda c: c.id() if isinstance(c, Case) else "192-128" if c is None else "ragged" if c else "paged")
def test_gpu_hopper_prefill_head_sections(case, ragged, monkeypatch):
    """With ``_hopper.HEAD_SECTIONS`` on at every head_dim, work items run in sections of a few query heads (here 2, or the GQA
    group where it is larger: every case has several sections) and outputs and LSE still match the reference:
    head_dim 64, 128, 256, e4m3 K/V and (``case`` None) DeepSeek's 192 / 128 with 16 heads."""
    from tritoninfer import _hopper, _route

    monkeypatch.setattr(_hopper, "HEAD_SECTIONS", True)
    monkeypatch.setattr(_hopper, "SECTIONS_FROM_HEAD_DIM", 0)  # (by default only from head_dim 192)
    monkeypatch.setattr(_hopper, "SECTION_HEADS", 2)
    if case is None:
        assert _hopper.section_heads(16, 1) == 2
        test_gpu_hopper_ragged_prefill_192_128(True, monkeypatch)
        return
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    hq, hk = case.heads
    assert _hopper.section_heads(hq, hq // hk) < hq
    test_gpu_hopper_prefill_head_dims(case, ragged, monkeypatch)


@pytest.mark.gpu
def test_gpu_hopper_paged_fallbacks(monkeypatch):
    """A paged plan in the Gluon kernel's range still takes the core for a run with fp8 scales or sinks
    (which the kernel lacks); the kernel's own run matches the reference with and without an LSE."""
    _needs_hopper()
    calls = _count_hopper_launches(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, qo_indptr = testing.random_qo((1200, 900), 16, 128, dtype=torch.bfloat16, generator=g)
    q = q.cuda()
    kv = testing.make_paged_kv((1300, 900), 16, 4, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    sinks = torch.randn(16, generator=g).cuda()
    w = BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 16, 4, 128, 16, q_data_type=torch.bfloat16)
    assert w._step.route_work is not None
    args = (q, qo_indptr.cuda(), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, "NHD")
    for kw, gluon in (({}, True), ({"k_scale": 0.5, "v_scale": 2.0}, False), ({"sinks": sinks}, False)):
        calls.clear()
        o, lse = w.run(q, kv.cache, return_lse=True, **kw)
        ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(*args, **kw)
        testing.assert_close(o, ref_o, torch.bfloat16)
        testing.assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)
        assert bool(calls) == gluon, kw
    calls.clear()
    testing.assert_close(w.run(q, kv.cache), reference.batch_prefill_with_paged_kv_cache(*args)[0], torch.bfloat16)
    assert calls


@pytest.mark.gpu
def test_gpu_hopper_single_prefill_and_fallbacks(monkeypatch):
    """single_prefill takes the Gluon kernel; a soft cap (which it lacks), a short causal request and
    a non-TMA-ready q (heads not contiguous) keep the attention core; all match the reference."""
    _needs_hopper()
    calls = _count_hopper_launches(monkeypatch)
    g = torch.Generator().manual_seed(3)
    q = testing.randn((1100, 16, 128), torch.bfloat16, "cuda", generator=g)
    k = testing.randn((900, 4, 128), torch.bfloat16, "cuda", generator=g)
    v = testing.randn((900, 4, 128), torch.bfloat16, "cuda", generator=g)
    # the Gluon kernel for the plain call; the core for a soft cap and for causal 1100 tokens
    for kw in ({}, {"causal": True}, {"logits_soft_cap": 20.0}):
        calls.clear()
        o, lse = tritoninfer.single_prefill_with_kv_cache_return_lse(q, k, v, **kw)
        ref_o, ref_lse = reference.single_prefill_with_kv_cache(q, k, v, return_lse=True, **kw)
        testing.assert_close(o, ref_o, torch.bfloat16)
        testing.assert_lse_close(lse, ref_lse, dtype=torch.bfloat16)
        assert bool(calls) == (not kw)
    calls.clear()
    o = tritoninfer.single_prefill_with_kv_cache(q, k, v)  # no LSE asked for
    testing.assert_close(o, reference.single_prefill_with_kv_cache(q, k, v), torch.bfloat16)
    assert calls
    calls.clear()
    q_strided = testing.randn((16, 1100, 128), torch.bfloat16, "cuda", generator=g).transpose(0, 1)
    o = tritoninfer.single_prefill_with_kv_cache(q_strided, k, v)
    testing.assert_close(o, reference.single_prefill_with_kv_cache(q_strided, k, v), torch.bfloat16)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_single_prefill_captured_in_a_cuda_graph(causal):
    """single_prefill_with_kv_cache captured in a CUDA graph (the POD bench times ours that way):
    4096 causal tokens take the Gluon kernel, 1024 non-causal the core (bf16, 32/8 heads). Replays match
    the eager result, also after 40 eager calls of other shapes have planned in between (the
    single-request plans' pinned upload buffers are reused by those calls)."""
    g = torch.Generator().manual_seed(5)
    n = 4096 if causal else 1024
    q, k, v = (testing.randn((n, h, 128), torch.bfloat16, "cuda", generator=g) for h in (32, 8, 8))
    want = tritoninfer.single_prefill_with_kv_cache(q, k, v, causal=causal)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tritoninfer.single_prefill_with_kv_cache(q, k, v, causal=causal)  # warm-up, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = tritoninfer.single_prefill_with_kv_cache(q, k, v, causal=causal)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    got.zero_()
    for i in range(40):
        m = 200 + 8 * i
        tritoninfer.single_prefill_with_kv_cache(q[:m], k[:m], v[:m], causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_matches_flashinfer_fa2():
    flashinfer = pytest.importorskip("flashinfer")
    case = GPU_CASES[1]
    g, q, qo_indptr, _, _ = _inputs(case, device="cuda")
    kv = testing.make_paged_kv(case.kv_lens, 16, 8, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    outs = []
    for mod in (flashinfer, tritoninfer):
        kw = {"backend": "fa2"}
        w = mod.BatchPrefillWithPagedKVCacheWrapper(ws if mod is flashinfer else torch.empty_like(ws), "NHD", **kw)
        w.plan(qo_indptr.cuda(), kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, causal=True,
               pos_encoding_mode="ROPE_LLAMA", q_data_type=torch.bfloat16)
        outs.append(w.run(q, kv.cache))
    testing.assert_close(outs[1], outs[0].float(), torch.bfloat16)


def test_ragged_run_checks_k_and_v(device):
    """run()'s K/V checks (one comparison chain on the common path) still name what is wrong, and a
    tensor subclass (an nn.Parameter) takes the careful path and runs."""
    hq, hk, d, n = 4, 2, 16, 8
    qo = torch.tensor([0, n], dtype=torch.int32)
    w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(qo, qo, hq, hk, d, causal=True, q_data_type=torch.float16)
    q = torch.randn(n, hq, d, dtype=torch.float16, device=device)
    k = torch.randn(n, hk, d, dtype=torch.float16, device=device)
    v = torch.randn(n, hk, d, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="must share a dtype"):
        w.run(q, k, v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="v: shape"):
        w.run(q, k, v[: n - 1])
    with pytest.raises(ValueError, match="v: the last"):
        w.run(q, k, torch.randn(n, hk, 2 * d, dtype=torch.float16, device=device)[..., ::2])
    with pytest.raises(ValueError, match="k: expected a 3-D"):
        w.run(q, k[0], v)
    want = w.run(q, k, v)
    got = w.run(q, torch.nn.Parameter(k, requires_grad=False), v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
