"""Decode API against the reference: every option, pairwise, on tiny awkward shapes (interpreter)
and on realistic shapes (GPU)."""

import dataclasses

import pytest
import torch

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan

from conftest import DEVICE

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass
class Case:
    kv_lens: tuple
    page_size: int = 4
    heads: tuple = (4, 2)
    head_dim: int = 32
    layout: str = "NHD"
    form: str = "5d"
    q_dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype = torch.float16
    pos: str = "NONE"
    window: int = -1
    soft_cap: float = None
    sm_scale: float = None
    split: str = "auto"  # auto | disable | fixed
    strided: bool = False
    tensor_cores: bool = False

    def id(self):
        return (f"B{len(self.kv_lens)}-p{self.page_size}-h{self.heads[0]}/{self.heads[1]}-d{self.head_dim}-"
                f"{self.layout}-{self.form}-{str(self.q_dtype)[6:]}-{str(self.kv_dtype)[6:]}-{self.pos}-"
                f"w{self.window}-cap{self.soft_cap}-{self.split}{'-strided' if self.strided else ''}")


# Pairwise-ish coverage: every option appears with several others, shapes stay tiny.
CASES = [
    Case((5, 0, 37, 18)),
    Case((1,), page_size=1, form="tuple3d", heads=(7, 1), head_dim=40),
    Case((33, 9), layout="HND", form="tuple", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, pos="ROPE_LLAMA"),
    Case((70,), heads=(2, 2), head_dim=64, pos="ALIBI", window=20),
    Case((17, 3, 40), page_size=3, heads=(6, 2), soft_cap=5.0, sm_scale=0.3, split="disable"),
    Case((50, 26), page_size=16, heads=(8, 1), kv_dtype=torch.float8_e4m3fn, layout="HND", tensor_cores=True, split="fixed"),
    Case((29,), page_size=1, form="4d", heads=(3, 3), q_dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2, window=0),
    Case((12, 45), page_size=5, form="tuple", strided=True, pos="ROPE_LLAMA", window=7, soft_cap=2.0),
    Case((64, 0, 2), head_dim=56, heads=(5, 1), layout="HND", strided=True, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    # a GQA group of one: the dot-free single-row path (Tiles.lanes)
    Case((70, 0, 33), heads=(2, 2), q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, soft_cap=3.0,
         split="fixed", strided=True, tensor_cores=True),
    Case((90, 7), page_size=16, heads=(4, 4), head_dim=64, layout="HND", kv_dtype=torch.float8_e5m2, window=40),
]


def _make(case: Case, device=DEVICE, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    scale = 0.5 if case.kv_dtype in FP8 else None
    kv = testing.make_paged_kv(case.kv_lens, case.page_size, case.heads[1], case.head_dim, layout=case.layout,
                               form=case.form, dtype=case.kv_dtype, device=device, generator=g,
                               strided=case.strided, k_scale=scale, v_scale=scale)
    q = testing.randn((len(case.kv_lens), case.heads[0], case.head_dim), case.q_dtype, device, generator=g)
    return kv, q


def _plan(wrapper, case, kv, **extra):
    kw = dict(pos_encoding_mode=case.pos, window_left=case.window, logits_soft_cap=case.soft_cap,
              q_data_type=case.q_dtype, kv_data_type=case.kv_dtype, sm_scale=case.sm_scale)
    if case.split == "disable":
        kw["disable_split_kv"] = True
    elif case.split == "fixed":
        kw["fixed_split_size"] = 2
    kw.update(extra)
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.heads[0], case.heads[1],
                 case.head_dim, case.page_size, **kw)


def _reference(case, kv, q, **extra):
    return reference.batch_decode_with_paged_kv_cache(
        q, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.layout,
        pos_encoding_mode=case.pos, window_left=case.window, logits_soft_cap=case.soft_cap,
        sm_scale=case.sm_scale, k_scale=kv.k_scale, v_scale=kv.v_scale, **extra)


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_batch_decode_matches_reference(case):
    kv, q = _make(case)
    ws = testing.make_workspace(1 << 20, DEVICE)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, case.layout, use_tensor_cores=case.tensor_cores)
    _plan(wrapper, case, kv)
    o, lse = wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale, return_lse=True)
    ref_o, ref_lse = _reference(case, kv, q)
    testing.assert_close(o, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
    empty = [i for i, n in enumerate(case.kv_lens) if n == 0]
    if empty:
        assert torch.all(o[empty] == 0) and torch.all(lse[empty] == float("-inf"))


@pytest.mark.parametrize("case", CASES[:6], ids=Case.id)
def test_kv_as_m_orientation_matches_reference(case, monkeypatch):
    """The transposed dot orientation (KV positions as M) computes the same attention."""
    from tritoninfer import decode, _plan as plan_mod

    def tiles(*args):
        return dataclasses.replace(plan_mod.decode_tiles(*args), kv_as_m=True)

    monkeypatch.setattr(decode, "_decode_tiles", tiles)
    test_batch_decode_matches_reference(case)


@pytest.mark.parametrize("case", [
    Case((5, 0, 300, 129), page_size=16, heads=(8, 2), head_dim=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((1, 140), page_size=1, form="tuple3d", heads=(2, 2), head_dim=64, q_dtype=torch.float16,
         kv_dtype=torch.float16, window=50),
    Case((70, 0, 33), page_size=16, heads=(7, 1), head_dim=256, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
         soft_cap=5.0),
    Case((40, 97), page_size=64, layout="HND", heads=(2, 2), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, pos="ROPE_LLAMA"),
], ids=Case.id)
def test_gpu_decode_tiles_of_head_dims_match_reference(case, monkeypatch):
    """The GPU's one-token tiles at head_dim 64 (128-position KV-as-M) and 256 (32-position KV-as-M, 3 stages, page
    ids ahead), run by the interpreter (which otherwise takes its own small tiles) on lengths off the tiles:
    the masks, the page prefetch and the splits at those tile sizes."""
    from tritoninfer import _plan as plan_mod
    from tritoninfer import decode

    taken = []

    def gpu_tiles(*args):
        with monkeypatch.context() as m:
            m.setattr(plan_mod._device, "is_interpreter", lambda: False)
            tiles = plan_mod.decode_tiles(*args)
        taken.append(tiles)
        return tiles

    monkeypatch.setattr(decode, "_decode_tiles", gpu_tiles)
    decode._decode_config.cache_clear()  # (plans of earlier tests would keep their tiles)
    test_batch_decode_matches_reference(case)
    assert taken and all(t.kv_as_m and t.block_n == (128 if case.head_dim == 64 else 32) for t in taken)


@pytest.mark.parametrize("fixed_pages", [None, 1])
def test_split_kv_is_exercised_and_correct(fixed_pages):
    """One long request and one KV head: the planner must split, and the merge (the last split of a
    group merges them all, kernels/attention.py) must be exact, also with more splits (19) than the
    merge loads at once; every arrival counter is back at zero after a run, so a second run with
    other values is exact too."""
    # the planner's own choice (None) splits 150 tokens only with the interpreter's 16-position tiles and 4
    # "SMs": 1,500 split with the GPU's tiles and SMs too; one page a split cuts 150 into 19
    case = Case((1500 if fixed_pages is None else 150, 3, 90), heads=(4, 1), page_size=8)
    kv, q = _make(case)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE),
                                                 use_tensor_cores=fixed_pages is not None)
    _plan(wrapper, case, kv, fixed_split_size=fixed_pages)
    plan = wrapper._step.device_plan
    assert plan.has_splits and int(plan.work[:, 5].max()) >= 3
    for seed in (1, 2):
        o, lse = wrapper.run_return_lse(q, kv.cache)
        ref_o, ref_lse = _reference(case, kv, q)
        testing.assert_close(o, ref_o, case.q_dtype)
        testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
        assert plan.counters.buffers and not plan.counters.buffers[-1].any()
        q = testing.randn(tuple(q.shape), case.q_dtype, DEVICE, generator=torch.Generator().manual_seed(seed))


def test_out_lse_buffers_sinks_and_scales():
    case = Case((21, 0, 9), heads=(4, 2))
    kv, q = _make(case)
    sinks = torch.randn(4, device=DEVICE)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    _plan(wrapper, case, kv)
    out = testing.nan_like(torch.empty(3, 4, 32, dtype=case.q_dtype, device=DEVICE))
    lse = torch.full((3, 4), float("nan"), device=DEVICE)
    res = wrapper.run(q, kv.cache, out=out, lse=lse, return_lse=True, sinks=sinks, q_scale=1.3, k_scale=0.7, v_scale=1.5)
    assert res[0] is out and res[1] is lse
    ref_o, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, "NHD", sinks=sinks, q_scale=1.3,
        k_scale=0.7, v_scale=1.5)
    testing.assert_close(out, ref_o, case.q_dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)


def test_q_len_per_req_is_causal_within_request():
    case = Case((9, 30), heads=(4, 2), tensor_cores=True)
    kv, _ = _make(case)
    q = testing.randn((2 * 3, 4, 32), torch.float16, DEVICE, generator=torch.Generator().manual_seed(3))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_tensor_cores=True)
    _plan(wrapper, case, kv)
    o, lse = wrapper.run(q, kv.cache, q_len_per_req=3, return_lse=True)
    ref_o, ref_lse = _reference(case, kv, q, q_len_per_req=3)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
    with pytest.raises(ValueError, match="use_tensor_cores"):
        w2 = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
        _plan(w2, case, kv)
        w2.run(q, kv.cache, q_len_per_req=3)


@pytest.mark.parametrize("mode", ["disable", "fixed"])
def test_batch_invariance(mode):
    """The same request gives bit-identical output whatever the batch around it."""
    case = Case((90,), heads=(4, 1), page_size=4, split=mode, tensor_cores=True)
    kv_a, q_a = _make(case)
    big = Case((90, 13, 60, 5), heads=(4, 1), page_size=4, split=mode, tensor_cores=True)
    kv_b, _ = _make(big, gen_seed=1)
    # put request 0 of kv_a into slot 2 of the big batch's cache, same pages layout
    k_a = reference.gather_paged_kv(kv_a.cache, kv_a.kv_indptr, kv_a.kv_indices, kv_a.kv_last_page_len)[0][0]
    pages_b = kv_b.kv_indices[kv_b.kv_indptr[0]:kv_b.kv_indptr[1]]
    pages_a = kv_a.kv_indices[kv_a.kv_indptr[0]:kv_a.kv_indptr[1]]
    kv_b.cache[pages_b] = kv_a.cache[pages_a]
    q_b = testing.randn((4, 4, 32), torch.float16, DEVICE, generator=torch.Generator().manual_seed(5))
    q_b[0] = q_a[0]
    outs = []
    for kv, q in ((kv_a, q_a), (kv_b, q_b)):
        w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_tensor_cores=True)
        _plan(w, case, kv)
        outs.append(w.run(q, kv.cache)[0])
    assert k_a.shape[0] == 90
    assert torch.equal(outs[0], outs[1])


def test_cuda_graph_mode_replan_keeps_grid():
    """With use_cuda_graph the launch grid is fixed by the batch; re-planning with other lengths
    (and splits) stays correct."""
    case = Case((7, 3), heads=(4, 1), page_size=4)
    batch, max_pages = 2, 64
    indptr_buf = torch.empty(batch + 1, dtype=torch.int32, device=DEVICE)
    indices_buf = torch.empty(max_pages, dtype=torch.int32, device=DEVICE)
    last_buf = torch.empty(batch, dtype=torch.int32, device=DEVICE)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_cuda_graph=True,
                                                 paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
                                                 paged_kv_last_page_len_buffer=last_buf)
    grids = []
    for seed, lens in ((0, (7, 3)), (1, (120, 1)), (2, (0, 61))):
        case = dataclasses.replace(case, kv_lens=lens)
        kv, q = _make(case, gen_seed=seed)
        _plan(wrapper, case, kv)
        grids.append(wrapper._step.device_plan.capacity)
        o = wrapper.run(q, kv.cache)
        testing.assert_close(o, _reference(case, kv, q)[0], torch.float16)
    assert len(set(grids)) == 1
    with pytest.raises(ValueError, match="batch size"):
        kv, _ = _make(Case((3, 3, 3)))
        wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 1, 32, 4)


def test_fast_decode_plan_and_block_tables():
    case = Case((14, 27, 0), heads=(4, 2), page_size=4)
    kv, q = _make(case)
    ref_o = _reference(case, kv, q)[0]
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    fast_decode_plan(wrapper, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4,
                     q_data_type=torch.float16, global_override_indptr_cpu=kv.kv_indptr.cpu())
    testing.assert_close(wrapper.run(q, kv.cache), ref_o, torch.float16)
    wrapper.plan(None, kv.kv_indices, None, 4, 2, 32, 4, block_tables=kv.block_tables, seq_lens=kv.seq_lens)
    testing.assert_close(wrapper.run(q, kv.cache), ref_o, torch.float16)


def test_forward_overwrites_planned_settings():
    case = Case((25, 8), heads=(4, 2), pos="ROPE_LLAMA", soft_cap=3.0)
    kv, q = _make(case)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    _plan(wrapper, case, kv)
    # forward's defaults (NONE, no cap) replace the planned ROPE_LLAMA and soft cap
    o, lse = wrapper.forward_return_lse(q, kv.cache, sm_scale=0.2)
    plain = dataclasses.replace(case, pos="NONE", soft_cap=None, sm_scale=0.2)
    ref_o, ref_lse = _reference(plain, kv, q)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
    wrapper.begin_forward(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    testing.assert_close(wrapper.forward(q, kv.cache, pos_encoding_mode="ALIBI"),
                         _reference(dataclasses.replace(case, pos="ALIBI", soft_cap=None), kv, q)[0], torch.float16)
    wrapper.end_forward()


def test_bound_launches_are_kept_per_run_variant_and_rebound_by_a_new_plan():
    """run() reuses the launch bound by an earlier run (launch_attention's key): one per variant (LSE or
    not, q_len_per_req), a new one when forward() replaces the parameters. A new plan (other lengths,
    another split) keeps the launches and rebinds them to its own tensors; every call still reads its
    own q and the plan it runs."""
    case = Case((9, 30), heads=(4, 2), tensor_cores=True)
    kv, q = _make(case)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_tensor_cores=True)
    _plan(wrapper, case, kv)
    launches = wrapper._step.device_plan.attention_launches
    for seed in (1, 2):
        q = testing.randn(q.shape, q.dtype, DEVICE, generator=torch.Generator().manual_seed(seed))
        testing.assert_close(wrapper.run(q, kv.cache), _reference(case, kv, q)[0], torch.float16)
    assert len(launches) == 1
    wrapper.run(q, kv.cache, return_lse=True)
    assert len(launches) == 2
    q3 = testing.randn((2 * 3, 4, 32), torch.float16, DEVICE, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        testing.assert_close(wrapper.run(q3, kv.cache, q_len_per_req=3),
                             _reference(case, kv, q3, q_len_per_req=3)[0], torch.float16)
    assert len(launches) == 3
    wrapper.forward(q, kv.cache, sm_scale=0.2)
    assert len(launches) == 4
    testing.assert_close(wrapper.run(q, kv.cache), _reference(dataclasses.replace(case, sm_scale=0.2), kv, q)[0],
                         torch.float16)
    assert len(launches) == 4
    plain = next(b for b in launches.values() if b.plan is wrapper._step.device_plan and b.variant.write_lse is False
                 and b.state_mult == 1 and b.sm_scale != 0.2)
    for lens, splits in (((40, 3), 4), ((1, 64), 1), ((9, 30), None)):
        other = dataclasses.replace(case, kv_lens=lens)
        kv2, q2 = _make(other)
        _plan(wrapper, other, kv2, fixed_split_size=splits)
        assert wrapper._step.device_plan.attention_launches is launches
        testing.assert_close(wrapper.run(q2, kv2.cache), _reference(other, kv2, q2)[0], torch.float16)
        assert len(launches) == 4 and plain.plan is wrapper._step.device_plan


def test_plans_of_the_same_sizes_keep_the_device_plan():
    """A wrapper's plans go to one device buffer: a plan of the same sizes as the last (new lengths,
    the same batch and work items) keeps its ``DevicePlan`` (views, bound launches) with the new
    values and its page-id check reset; other sizes get a new one. Every run reads the plan it
    follows."""
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    first = None
    for lens in ((9, 30), (12, 29), (40, 2), (7, 8, 9)):
        case = Case(lens, split="disable")
        kv, q = _make(case, gen_seed=sum(lens))
        _plan(wrapper, case, kv)
        plan = wrapper._step.device_plan
        if first is None:
            first = plan
            plan.pages_checked = 5  # as a Gluon run leaves it
        elif len(lens) == 2:
            assert plan is first and plan.pages_checked == -1
        else:
            assert plan is not first
        testing.assert_close(wrapper.run(q, kv.cache), _reference(case, kv, q)[0], torch.float16)


def test_fp8_close_to_unquantized_data():
    case = Case((40, 23), heads=(4, 1), kv_dtype=torch.float8_e4m3fn, page_size=8)
    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv(case.kv_lens, 8, 1, 32, dtype=torch.float8_e4m3fn, device=DEVICE, generator=g,
                               k_scale=0.05, v_scale=0.05)
    q = testing.randn((2, 4, 32), torch.float16, DEVICE, generator=g)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    _plan(wrapper, case, kv)
    o = wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale)
    for i in range(2):
        ref_o = reference.attention(q[i:i + 1], kv.k_float[i], kv.v_float[i])[0][0]
        assert testing.rel_error(o[i].float(), ref_o) < testing.FP8_VS_UNQUANTIZED[torch.float8_e4m3fn]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode(layout):
    g = torch.Generator().manual_seed(0)
    kv_len, hq, hk, d = 45, 6, 2, 48
    q = testing.randn((hq, d), torch.bfloat16, DEVICE, generator=g)
    shape = (kv_len, hk, d) if layout == "NHD" else (hk, kv_len, d)
    k = testing.randn(shape, torch.bfloat16, DEVICE, generator=g)
    v = testing.randn(shape, torch.bfloat16, DEVICE, generator=g)
    o, lse = tritoninfer.single_decode_with_kv_cache(q, k, v, layout, "ROPE_LLAMA", window_left=30,
                                                     logits_soft_cap=4.0, return_lse=True)
    ref_o, ref_lse = reference.single_decode_with_kv_cache(q, k, v, layout, "ROPE_LLAMA", window_left=30,
                                                           logits_soft_cap=4.0, return_lse=True)
    testing.assert_close(o, ref_o, torch.bfloat16)
    testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
    o0, lse0 = tritoninfer.single_decode_with_kv_cache(q, k[:0] if layout == "NHD" else k[:, :0],
                                                       v[:0] if layout == "NHD" else v[:, :0], layout, return_lse=True)
    assert torch.all(o0 == 0) and torch.all(lse0 == float("-inf"))


def test_single_functions_reuse_their_plan_across_layers(monkeypatch):
    """A model calls single_decode / single_prefill once per layer with the same shapes: the first
    call's plan serves the others (one kept step per shape), and each layer still gets its own
    inputs' result; another length plans again."""
    from tritoninfer import _step

    _step._SINGLE_STEPS.clear()
    planned = []
    real = _step._plan_single

    def spy(*args, **kwargs):
        planned.append((kwargs["qo_len"], kwargs["kv_len"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(_step, "_plan_single", spy)
    g = torch.Generator().manual_seed(4)
    hq, hk, d = 4, 2, 32
    for layer in range(3):
        q = testing.randn((hq, d), torch.float16, DEVICE, generator=g)
        k = testing.randn((40, hk, d), torch.float16, DEVICE, generator=g)
        v = testing.randn((40, hk, d), torch.float16, DEVICE, generator=g)
        testing.assert_close(tritoninfer.single_decode_with_kv_cache(q, k, v),
                             reference.single_decode_with_kv_cache(q, k, v), torch.float16)
        qp = testing.randn((7, hq, d), torch.float16, DEVICE, generator=g)
        testing.assert_close(tritoninfer.single_prefill_with_kv_cache(qp, k, v, causal=True),
                             reference.single_prefill_with_kv_cache(qp, k, v, causal=True), torch.float16)
    assert planned.count((1, 40)) == 1, "decode planned once for three layers"
    assert planned.count((7, 40)) == 1, planned
    tritoninfer.single_decode_with_kv_cache(q, k[:30], v[:30])
    assert planned.count((1, 30)) == 1


def test_errors_name_the_argument():
    case = Case((5, 9), heads=(4, 2))
    kv, q = _make(case)
    ws = testing.make_workspace(1 << 20, DEVICE)
    w = BatchDecodeWithPagedKVCacheWrapper(ws)
    with pytest.raises(ValueError, match="before plan"):
        w.run(q, kv.cache)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 5, 2, 32, 4)
    with pytest.raises(ValueError, match="head_dim"):
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 30, 4)
    with pytest.raises(ValueError, match="backend"):
        BatchDecodeWithPagedKVCacheWrapper(ws, backend="cudnn-magic")
    with pytest.raises(NotImplementedError, match="jit_args"):
        BatchDecodeWithPagedKVCacheWrapper(ws, jit_args=["x"])
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer"):
        BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True)
    with pytest.raises(ValueError, match="fixed_split_size"):
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, fixed_split_size=4)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, window_left=3)
    with pytest.raises(ValueError, match="q_data_type"):
        w.run(q.to(torch.bfloat16), kv.cache)
    with pytest.raises(ValueError, match="kv_data_type"):
        w.run(q, tuple(t.to(torch.bfloat16) for t in (kv.cache[:, 0], kv.cache[:, 1])))
    with pytest.raises(ValueError, match="window_left"):
        w.run(q, kv.cache, window_left=5)
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q[:1], kv.cache)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        w.run(q, kv.cache[:, :, :2])
    with pytest.raises(TypeError, match="keyword"):
        w.run(q, kv.cache, 1.0)
    with pytest.raises(ValueError, match="out"):
        w.run(q, kv.cache, out=torch.empty(2, 4, 16, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="last_page_len"):
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len + 10, 4, 2, 32, 4)
    # a workspace too small for the splits the planner wants: automatic splits get coarser (here
    # none), a fixed split size is refused in plan()
    small = BatchDecodeWithPagedKVCacheWrapper(torch.empty(8, dtype=torch.uint8, device=DEVICE), use_tensor_cores=True)
    big = Case((300,), heads=(4, 1), page_size=16)
    kvb, qb = _make(big)
    _plan(small, big, kvb)
    assert not small._step.device_plan.has_splits
    testing.assert_close(small.run(qb, kvb.cache), _reference(big, kvb, qb)[0], torch.float16)
    with pytest.raises(ValueError, match="float_workspace_buffer"):
        _plan(small, dataclasses.replace(big, split="fixed"), kvb)


# ---------------------------------------------------------------- GPU: realistic shapes

GPU_CASES = [
    Case((4096, 1000, 17, 8191), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((4096,) * 4, page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
    Case((2048, 33), page_size=1, form="tuple3d", heads=(28, 4), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((3000, 700), page_size=16, layout="HND", heads=(32, 32), head_dim=64, q_dtype=torch.float16, kv_dtype=torch.float8_e5m2),
    Case((1500, 900), page_size=16, heads=(16, 2), head_dim=256, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, pos="ROPE_LLAMA", soft_cap=30.0),
    Case((5000, 64), page_size=8, heads=(8, 8), head_dim=96, q_dtype=torch.float16, kv_dtype=torch.float16, pos="ALIBI", window=1000),
    Case((8192,), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, split="disable"),
    Case((4096, 1000, 17, 8191), page_size=16, heads=(32, 32), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn, window=1000),
    Case((4000, 1, 300), page_size=16, heads=(16, 16), head_dim=96, q_dtype=torch.float16, kv_dtype=torch.float8_e4m3fn,
         soft_cap=30.0),
    # 16-bit KV at head_dim 64 and 256 (their own one-token tiles, session 25): lengths off the tiles, pages 1/16/64
    Case((4000, 1, 37, 1029), page_size=16, heads=(32, 8), head_dim=64, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((2000, 130), page_size=1, form="tuple3d", heads=(32, 32), head_dim=64, q_dtype=torch.float16,
         kv_dtype=torch.float16, window=500),
    Case((4000, 1, 37, 1029), page_size=64, heads=(28, 4), head_dim=256, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16),
    Case((3000, 65), page_size=16, layout="HND", heads=(32, 32), head_dim=256, q_dtype=torch.bfloat16,
         kv_dtype=torch.bfloat16, soft_cap=30.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=Case.id)
def test_gpu_batch_decode(case):
    test_batch_decode_matches_reference(case)


def test_hopper_fp8_decode_binds_one_launch_per_plan(monkeypatch):
    """The Gluon fp8 decode's host side, with the launch path faked on the CPU (the kernel runs only on
    an H200): a plan the route takes runs one launch on min(items, SMs) programs (split states merged
    inside it), with the uploader's zeroed arrival counters; the wrapper's plans with and without splits
    share that launch (rebound to each plan) and one compiled kernel; a run with sinks takes the core."""
    from tritoninfer import _device, _hopper, _route

    monkeypatch.setattr(_route, "DECODE_HOPPER_FP8", True)
    bound = []
    real = _hopper._DecodeLaunch

    class Recorded(real):
        def __init__(self, *args):
            real.__init__(self, *args)
            bound.append(self)

    monkeypatch.setattr(_hopper, "_DecodeLaunch", Recorded)
    with testing.fake_driver_launches(hopper=True) as record:
        sms = _device.num_sms(torch.device("cpu"))
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8))
        for lens, splits in (((9000, 40, 0), True), ((40, 30, 20), False)):
            kv = testing.make_paged_kv(lens, 16, 2, 128, device="cpu", generator=torch.Generator().manual_seed(0))
            cache = kv.cache.to(torch.float8_e4m3fn)
            w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16,
                   kv_data_type=torch.float8_e4m3fn)
            plan = w._step.device_plan
            assert w._step.route.kernel == "decode_hopper" and plan.has_splits == splits
            w.run(torch.randn(3, 8, 128).to(torch.bfloat16), cache, k_scale=0.5)
            launch = bound[-1].launch
            assert launch.grid == (min(plan.capacity * 2, sms), 1, 1)
            counters = launch.tail[2]
            assert counters.dtype == torch.int32 and counters.numel() >= plan.capacity * 2 and not counters.any()
        # one launch and one compile of the decode kernel for both plans (beside the page-id check's)
        assert len(bound) == 1
        assert len([g for g in record.compiles if g != (3,)]) == 1, record.compiles
        count = len(bound)
        w.run(torch.randn(3, 8, 128).to(torch.bfloat16), cache, sinks=torch.zeros(8))
        assert len(bound) == count


# the Gluon fp8 decode (kernels/decode_hopper.py, _route.DECODE_HOPPER_FP8): e4m3 pages TMA boxes, GQA,
# head_dim 128; splits (a long request beside short ones), empty requests, a 5-D and a tuple cache
HOPPER_FP8_CASES = [
    Case((4096, 1000, 0, 8191, 17), page_size=16, heads=(32, 8), head_dim=128, q_dtype=torch.bfloat16,
         kv_dtype=torch.float8_e4m3fn),
    Case((300, 129, 128, 1), page_size=64, heads=(64, 8), head_dim=128, q_dtype=torch.float16,
         kv_dtype=torch.float8_e4m3fn, form="tuple"),
    Case((20000,), page_size=8, heads=(28, 4), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
    Case((700, 3000), page_size=32, heads=(16, 2), head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
         split="disable"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", HOPPER_FP8_CASES, ids=Case.id)
def test_gpu_hopper_fp8_decode(case, monkeypatch):
    """With ``_route.DECODE_HOPPER_FP8`` on, e4m3 decode under GQA runs on the Gluon fp8 decode (split
    requests merged by their last split), and matches the reference, with scales, with and without an LSE,
    and again after a re-plan with other lengths; sinks take the core."""
    from tritoninfer import _hopper, _route

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon fp8 decode is for sm_90")
    monkeypatch.setattr(_route, "DECODE_HOPPER_FP8", True)
    calls = []
    launch = _hopper.decode_launch
    monkeypatch.setattr(_hopper, "decode_launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    for seed, lens in ((0, case.kv_lens), (1, tuple(n + 17 for n in case.kv_lens))):
        run_case = dataclasses.replace(case, kv_lens=lens)
        kv, q = _make(run_case, device="cuda", gen_seed=seed)
        _plan(wrapper, run_case, kv)
        assert wrapper._step.route.kernel == "decode_hopper", wrapper._step.route
        if run_case.split != "disable" and max(lens) >= 8000:
            assert wrapper._step.device_plan.has_splits
        out = testing.nan_like(torch.empty_like(q))
        lse = torch.full(q.shape[:2], float("nan"), device="cuda")
        calls.clear()
        wrapper.run(q, kv.cache, out=out, lse=lse, k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=1.25)
        ref_o, ref_lse = _reference(run_case, kv, q, q_scale=1.25)
        testing.assert_close(out, ref_o, case.q_dtype)
        testing.assert_lse_close(lse, ref_lse, dtype=q.dtype)
        testing.assert_close(wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=1.25), ref_o,
                             case.q_dtype)
        assert len(calls) == 2
        counters = wrapper._step.device_plan.counters.buffers
        assert not counters or not counters[-1].any()  # every arrival counter back at zero
    sinks = torch.randn(case.heads[0], device="cuda")
    calls.clear()
    o = wrapper.run(q, kv.cache, k_scale=kv.k_scale, v_scale=kv.v_scale, sinks=sinks)
    testing.assert_close(o, _reference(run_case, kv, q, sinks=sinks)[0], case.q_dtype)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_cuda_graph_capture_then_replan(q_len):
    batch, hq, hk, d, page = 8, 32, 8, 128, 16
    max_pages = 8 * 1024
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bufs = (torch.zeros(batch + 1, dtype=torch.int32, device="cuda"), torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
            torch.ones(batch, dtype=torch.int32, device="cuda"))
    w = BatchDecodeWithPagedKVCacheWrapper(ws, use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=bufs[0],
                                           paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    g = torch.Generator().manual_seed(0)
    # extra pages so that later plans' caches fit in the captured cache tensor
    kv = testing.make_paged_kv([16 * (i + 1) for i in range(batch)], page, hk, d, dtype=torch.bfloat16, device="cuda",
                               generator=g, extra_pages=4000)
    q = testing.randn((batch * q_len, hq, d), torch.bfloat16, "cuda", generator=g)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    w.run(q, kv.cache, out=out, q_len_per_req=q_len)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    cache = kv.cache
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out, q_len_per_req=q_len)
    for seed, lens in ((1, [5000, 17, 4096, 1, 300, 8000, 64, 9]), (2, [40000] + [16] * 7)):
        g = torch.Generator().manual_seed(seed)
        kv2 = testing.make_paged_kv(lens, page, hk, d, dtype=torch.bfloat16, device="cuda", generator=g, extra_pages=0)
        # the graph reads the captured cache tensor: copy the new pages into it
        cache[:kv2.cache.shape[0]].copy_(kv2.cache)
        q.copy_(testing.randn(q.shape, torch.bfloat16, "cuda", generator=g))
        w.plan(kv2.kv_indptr, kv2.kv_indices, kv2.kv_last_page_len, hq, hk, d, page, q_data_type=torch.bfloat16)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.batch_decode_with_paged_kv_cache(q, cache, kv2.kv_indptr, kv2.kv_indices,
                                                         kv2.kv_last_page_len, q_len_per_req=q_len)[0]
        testing.assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cache_beyond_2_31_elements():
    """Pages at the end of a cache larger than 2^31 elements are addressed correctly (int64)."""
    hk, d, page = 8, 128, 16
    per_page = 2 * page * hk * d
    num_pages = (2 ** 31) // per_page + 64
    cache = torch.empty((num_pages, 2, page, hk, d), dtype=torch.bfloat16, device="cuda")
    assert cache.numel() > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [700, 333]
    pages = [num_pages - 1 - i for i in range(sum(-(-n // page) for n in lens))]
    indices = torch.tensor(pages, dtype=torch.int32, device="cuda")
    cache[indices] = torch.randn((len(pages), 2, page, hk, d), generator=g, device="cuda").to(torch.bfloat16)
    indptr = torch.tensor([0, 44, 44 + 21], dtype=torch.int32, device="cuda")
    last = torch.tensor([700 - 43 * 16, 333 - 20 * 16], dtype=torch.int32, device="cuda")
    q = torch.randn((2, 32, d), generator=g, device="cuda").to(torch.bfloat16)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, 32, hk, d, page, q_data_type=torch.bfloat16)
    ref = reference.batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last)[0]
    testing.assert_close(w.run(q, cache), ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_matches_flashinfer():
    flashinfer = pytest.importorskip("flashinfer")
    case = GPU_CASES[0]
    kv, q = _make(case, device="cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for tc in (False, True):
        fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        fi.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        ref = fi.run(q, kv.cache)
        ours = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        _plan(ours, case, kv)
        testing.assert_close(ours.run(q, kv.cache), ref.float(), torch.bfloat16)


def test_caches_made_per_call_are_not_kept_alive():
    """A run() keeps nothing of a cache object it met once (a cache a caller makes per call: a view of a
    bigger buffer, a cache grown by concatenation): a PyTorch view keeps its base, so remembering one
    would hold the cache's memory. A cache passed again is remembered, its views made once."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(7)
    kv = testing.make_paged_kv([40, 7], 4, 2, 16, dtype=torch.float16, device=DEVICE, generator=g)
    q = torch.randn(2, 4, 16, generator=g).to(DEVICE, torch.float16)
    w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 16, 4, q_data_type=torch.float16)
    refs = []
    for form in ("5d", "tuple"):
        for _ in range(3):
            cache = kv.cache.clone() if form == "5d" else tuple(t.clone() for t in kv.cache.unbind(1))
            w.run(q, cache)
            refs += [weakref.ref(t) for t in ((cache,) if form == "5d" else cache)]
            del cache
    gc.collect()
    assert all(r() is None for r in refs)
    kept = kv.cache.clone()
    for _ in range(3):
        w.run(q, kept)
    (entry,) = w._caches._entries.values()
    views = entry.kv.k
    w.run(q, kept)
    assert w._caches._entries[id(kept)].kv.k is views


def test_decode_loop_replans_of_one_size_read_each_plans_lengths():
    """A decode loop: each step's plan has the last one's batch and page counts (so its upload reuses the
    same buffers, copy slices and device plan) and one more token a request; each step's run (two layers:
    the second replayed on a GPU) matches the reference for that step's lengths. A stale upload would
    attend to the last step's lengths, whose next entry holds random values."""
    g = torch.Generator().manual_seed(5)
    heads, head_dim = ((32, 8), 128) if DEVICE == "cuda" else ((4, 2), 64)
    kv = testing.make_paged_kv([112, 48, 512], 16, heads[1], head_dim, dtype=torch.bfloat16, device=DEVICE,
                               generator=g)
    pages = [7, 3, 32]
    w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(64 << 20, DEVICE))
    for step in range(4):
        lens = [n + step for n in (100, 37, 500)]  # (the page counts stay 7, 3 and 32)
        last = torch.tensor([n - 16 * (p - 1) for n, p in zip(lens, pages)], dtype=torch.int32)
        w.plan(kv.kv_indptr.cpu(), kv.kv_indices, last, heads[0], heads[1], head_dim, 16, q_data_type=torch.bfloat16)
        for _ in range(2):
            q = testing.randn((3, heads[0], head_dim), torch.bfloat16, DEVICE, g)
            expected = reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                  last.to(DEVICE), "NHD")[0]
            testing.assert_close(w.run(q, kv.cache), expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_loop_replans_of_one_size():
    test_decode_loop_replans_of_one_size_read_each_plans_lengths()
