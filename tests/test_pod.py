"""POD attention (``PODWithPagedKVCacheWrapper``, ``BatchPODWithPagedKVCacheWrapper``): a prefill and a
decode batch in one launch, each half against the reference of its own attention (single prefill,
batch decode, batch prefill), on tiny shapes (interpreter) and realistic ones (GPU)."""

import numpy as np
import pytest
import torch
from conftest import DEVICE

from tritoninfer import _route, reference, testing
from tritoninfer.pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper
from tritoninfer.quantization import packbits

# (qo_p, kv_p, causal_p, heads, page_size, decode kv_lens, layout, form, options)
POD_CASES = [
    (5, 9, True, (4, 2), 4, (5, 9, 1), "NHD", "5d", {}),
    (6, 4, False, (3, 1), 1, (7, 0, 3), "HND", "tuple", dict(window_left_p=2, pos_encoding_mode_p="ROPE_LLAMA")),
    (3, 7, False, (2, 2), 3, (11, 4), "NHD", "5d", dict(mask=True, plan=dict(window_left=3, sm_scale=0.2))),
    (4, 30, True, (4, 1), 4, (40,), "NHD", "tuple", dict(return_lse=True, plan=dict(pos_encoding_mode="ALIBI"))),
]


def _pod_case_id(c):
    return f"p{c[0]}x{c[1]}-c{int(c[2])}-h{c[3][0]}/{c[3][1]}-ps{c[4]}-d{list(c[5])}-{c[6]}-{c[7]}-{sorted(c[8])}"


@pytest.mark.parametrize("case", POD_CASES, ids=_pod_case_id)
def test_pod_matches_reference(case, device=DEVICE):
    qo_p, kv_p, causal, (h, hk), page, kv_lens, layout, form, opts = case
    d, dtype = 16, torch.float16
    g = torch.Generator().manual_seed(1)
    kv = testing.make_paged_kv(kv_lens, page, hk, d, layout=layout, form=form, dtype=dtype, device=device, generator=g)
    q_p = testing.randn((qo_p, h, d), dtype, device, g)
    k_p = testing.randn((kv_p, hk, d), dtype, device, g)
    v_p = testing.randn((kv_p, hk, d), dtype, device, g)
    q_d = testing.randn((len(kv_lens), h, d), dtype, device, g)
    plan_opts = opts.get("plan", {})
    pod = PODWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, device), layout)
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype, **plan_opts)
    run_opts = {k: v for k, v in opts.items() if k not in ("mask", "plan", "return_lse")}
    mask = None
    if opts.get("mask"):
        mask = torch.rand(qo_p, kv_p, generator=g).to(device) > 0.3
        run_opts["packed_custom_mask_p"] = packbits(mask.reshape(-1), bitorder="little")
    lse_flag = opts.get("return_lse", False)
    k_in, v_in = (k_p.transpose(0, 1), v_p.transpose(0, 1)) if layout == "HND" else (k_p, v_p)
    res_p, res_d = pod.run(q_p, k_in, v_in, q_d, kv.cache, causal_p=causal, kv_layout_p=layout,
                           return_lse_p=lse_flag, return_lse_d=lse_flag, **run_opts)
    ref_p, ref_lse_p = reference.single_prefill_with_kv_cache(
        q_p, k_p, v_p, causal=causal, custom_mask=mask, return_lse=True,
        pos_encoding_mode=run_opts.get("pos_encoding_mode_p", "NONE"), window_left=run_opts.get("window_left_p", -1))
    ref_d, ref_lse_d = reference.batch_decode_with_paged_kv_cache(
        q_d, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, layout, **plan_opts)
    o_p, o_d = (res_p[0], res_d[0]) if lse_flag else (res_p, res_d)
    testing.assert_close(o_p, ref_p, dtype, name="out_p")
    testing.assert_close(o_d, ref_d, dtype, name="out_d")
    if lse_flag:
        testing.assert_lse_close(res_p[1], ref_lse_p, dtype=dtype, name="lse_p")
        testing.assert_lse_close(res_d[1], ref_lse_d, dtype=dtype, name="lse_d")
    # the same prefill shape again reuses the prefill half's plan and the fused launch
    n_plans, n_launches = len(pod._prefill_steps), len(pod._launches)
    pod.run(q_p, k_in, v_in, q_d, kv.cache, causal_p=causal, kv_layout_p=layout, return_lse_p=lse_flag,
            return_lse_d=lse_flag, **run_opts)
    assert (len(pod._prefill_steps), len(pod._launches)) == (n_plans, n_launches)


def test_pod_decode_scales_and_splits():
    """q_scale/k_scale scale the decode half's logits and v_scale its output only; a long decode
    request splits its KV (the fused merge runs inside the pair launch)."""
    g = torch.Generator().manual_seed(2)
    kv = testing.make_paged_kv((1500, 3), 8, 1, 16, device=DEVICE, generator=g)
    q_p, k_p, v_p = (testing.randn(s, torch.float16, DEVICE, g) for s in ((5, 4, 16), (12, 1, 16), (12, 1, 16)))
    q_d = testing.randn((2, 4, 16), torch.float16, DEVICE, g)
    pod = PODWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 1, 16, 8)
    assert pod._step_d.device_plan.has_splits
    o_p, o_d = pod.run(q_p, k_p, v_p, q_d, kv.cache, causal_p=True, q_scale=0.5, k_scale=2.0 / 3, v_scale=1.5)
    testing.assert_close(o_p, reference.single_prefill_with_kv_cache(q_p, k_p, v_p, causal=True), torch.float16)
    ref_d, _ = reference.batch_decode_with_paged_kv_cache(q_d, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                          kv.kv_last_page_len, q_scale=0.5, k_scale=2.0 / 3,
                                                          v_scale=1.5)
    testing.assert_close(o_d, ref_d, torch.float16)


def test_pod_cuda_graph_mode_replans_into_fixed_buffers():
    g = torch.Generator().manual_seed(3)
    bufs = (torch.zeros(4, dtype=torch.int32, device=DEVICE), torch.zeros(32, dtype=torch.int32, device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE))
    pod = PODWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE), "NHD", True, *bufs)
    assert pod.is_cuda_graph_enabled
    q_p, k_p, v_p = (testing.randn(s, torch.float16, DEVICE, g) for s in ((3, 2, 16), (6, 1, 16), (6, 1, 16)))
    for kv_lens in ((9, 2, 5), (1, 13, 4)):
        kv = testing.make_paged_kv(kv_lens, 4, 1, 16, device=DEVICE, generator=g)
        q_d = testing.randn((3, 2, 16), torch.float16, DEVICE, g)
        pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 2, 1, 16, 4)
        work = pod._step_d.device_plan.work
        o_p, o_d = pod.run(q_p, k_p, v_p, q_d, kv.cache)
        ref_d, _ = reference.batch_decode_with_paged_kv_cache(q_d, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                              kv.kv_last_page_len)
        testing.assert_close(o_d, ref_d, torch.float16)
        testing.assert_close(o_p, reference.single_prefill_with_kv_cache(q_p, k_p, v_p), torch.float16)
    assert pod._step_d.device_plan.work.data_ptr() == work.data_ptr()
    with pytest.raises(ValueError, match="batch size should be fixed"):
        kv = testing.make_paged_kv((3, 3), 4, 1, 16, device=DEVICE, generator=g)
        pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 2, 1, 16, 4)


# (prefill qo/kv lens, decode qo/kv lens, causal_p, heads, page_size, layout, options)
BATCH_POD_CASES = [
    ((5, 0, 3), (7, 2, 9), (1, 1, 1, 1), (3, 12, 1, 6), True, (4, 2), 4, "NHD", {}),
    ((4, 2), (4, 9), (2, 1), (5, 8), False, (2, 1), 1, "HND", dict(mask=True, return_lse=True, window_left=3)),
    ((6,), (20,), (1, 3), (33, 4), True, (4, 4), 8, "NHD", dict(pos_encoding_mode="ROPE_LLAMA", scales=True)),
]


@pytest.mark.parametrize("case", BATCH_POD_CASES, ids=lambda c: f"p{c[0]}/{c[1]}-d{c[2]}/{c[3]}-c{int(c[4])}-{c[7]}")
def test_batch_pod_matches_reference(case, device=DEVICE):
    qo_p, kv_p_lens, qo_d, kv_d_lens, causal, (h, hk), page, layout, opts = case
    d, dtype = 16, torch.float16
    g = torch.Generator().manual_seed(4)
    kv_p = testing.make_paged_kv(kv_p_lens, page, hk, d, layout=layout, device=device, generator=g)
    kv_d = testing.make_paged_kv(kv_d_lens, page, hk, d, layout=layout, form="tuple", device=device, generator=g)
    q_p, qo_indptr_p = testing.random_qo(qo_p, h, d, dtype, device, g)
    q_d, qo_indptr_d = testing.random_qo(qo_d, h, d, dtype, device, g)
    plan_opts = {k: v for k, v in opts.items() if k in ("window_left", "pos_encoding_mode")}
    pod = BatchPODWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, device), layout)
    pod.plan(qo_indptr_p, kv_p.kv_indptr, kv_p.kv_indices, kv_p.kv_last_page_len, qo_indptr_d, kv_d.kv_indptr,
             kv_d.kv_indices, kv_d.kv_last_page_len, h, hk, d, page, q_data_type=dtype, **plan_opts)
    run_opts, mask = {}, None
    if opts.get("mask"):
        mask = torch.cat([(torch.rand(a, b, generator=g) > 0.3).reshape(-1) for a, b in zip(qo_p, kv_p_lens)]).to(device)
        run_opts["custom_mask_p"] = mask
    scales = dict(q_scale=0.5, k_scale=1.5, v_scale=0.75) if opts.get("scales") else {}
    lse_flag = opts.get("return_lse", False)
    res = pod.run(q_p, kv_p.cache, q_d, kv_d.cache, causal_p=causal, return_lse=lse_flag, **run_opts, **scales)
    (o_p, o_d), lses = (res if lse_flag else (res, None))
    ref_p, ref_lse_p = reference.batch_prefill_with_paged_kv_cache(
        q_p, qo_indptr_p, kv_p.cache, kv_p.kv_indptr, kv_p.kv_indices, kv_p.kv_last_page_len, layout,
        custom_mask=mask, causal=causal, **plan_opts)
    ref_d, ref_lse_d = reference.batch_prefill_with_paged_kv_cache(
        q_d, qo_indptr_d, kv_d.cache, kv_d.kv_indptr, kv_d.kv_indices, kv_d.kv_last_page_len, layout,
        causal=False, **plan_opts, **scales)
    testing.assert_close(o_p, ref_p, dtype, name="out_p")
    testing.assert_close(o_d, ref_d, dtype, name="out_d")
    if lse_flag:
        testing.assert_lse_close(lses[0], ref_lse_p, dtype=dtype, name="lse_p")
        testing.assert_lse_close(lses[1], ref_lse_d, dtype=dtype, name="lse_d")


def _small_pod():
    g = torch.Generator().manual_seed(5)
    kv = testing.make_paged_kv((5, 2), 4, 1, 16, device=DEVICE, generator=g)
    pod = PODWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 2, 1, 16, 4, window_left=3)
    t = dict(q_p=testing.randn((3, 2, 16), torch.float16, DEVICE, g), k_p=testing.randn((4, 1, 16), torch.float16, DEVICE, g),
             v_p=testing.randn((4, 1, 16), torch.float16, DEVICE, g), q_d=testing.randn((2, 2, 16), torch.float16, DEVICE, g),
             paged_kv_cache_d=kv.cache)
    return pod, t


def test_batch_pod_replans_rebind_one_pair_launch():
    """The launch path on the CPU (``testing.fake_driver_launches``): a BatchPOD wrapper's plans with other
    batches and lengths (causal prefill half, one cache) keep one pair launch, rebound to each plan. Every
    plan after the first, with splits or without (the partial states' stand-in has their dtype, so it
    specialises the kernel as they do), compiles nothing and runs on the driver path, with the new plans'
    work lists and page tables and a grid of both halves' capacities."""
    from tritoninfer._pair import PairLaunch

    hq, hk, d, page = 8, 2, 64, 16
    cache = torch.zeros(400, 2, page, hk, d, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)

    def table(lens):
        pages = [-(-n // page) for n in lens]
        indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
        indices = torch.randperm(cache.shape[0], generator=g)[:sum(pages)].to(torch.int32)
        last = torch.tensor([n - page * (p - 1) for n, p in zip(lens, pages)], dtype=torch.int32)
        return indptr, indices, last

    with testing.fake_driver_launches(params_read=80) as record:
        w = BatchPODWithPagedKVCacheWrapper(testing.make_workspace(16 << 20, "cpu"))
        pairs = []
        plans = (([300], [50, 900, 7]), ([310], [60, 901, 8, 40]), ([290, 20], [1]), ([200, 100], [40] * 10))
        for step, (prefill, decode) in enumerate(plans):
            qo_p = torch.tensor([0, *np.cumsum(prefill)], dtype=torch.int32)
            w.plan(qo_p, *table(prefill), torch.arange(len(decode) + 1, dtype=torch.int32), *table(decode), hq, hk,
                   d, page, q_data_type=torch.bfloat16)
            record.launches.clear()
            w.run(torch.zeros(int(qo_p[-1]), hq, d, dtype=torch.bfloat16), cache,
                  torch.zeros(len(decode), hq, d, dtype=torch.bfloat16), cache, causal_p=True)
            pairs += [v for v in w._launches.values() if isinstance(v, PairLaunch)]
            assert w._step_p.device_plan.has_splits == (step < 2)
            assert len(record.compiles) == 1 and len(record.launches) == (step > 0)
            if step > 0:
                grid, params = record.launches[0]
                plan_p, plan_d = w._step_p.device_plan, w._step_d.device_plan
                assert grid[0] == plan_p.capacity + plan_d.capacity
                for t in (plan_p.work, plan_d.work, w._step_p.kv_indices, w._step_d.kv_indices):
                    assert t.data_ptr() in params
        assert len(pairs) == 4 and all(p is pairs[0] for p in pairs)


@pytest.mark.parametrize("change,match", [
    (dict(window_left_d=5), "window_left_d"),
    (dict(sm_scale_d=0.3), "sm_scale_d"),
    (dict(custom_mask_d=torch.ones(4, dtype=torch.bool)), "custom_mask_d"),
    (dict(kv_layout_d="HND"), "kv_layout_d"),  # the wrapper is NHD, and NHD is the default
    (dict(q_p=torch.zeros(3, 2, 16, dtype=torch.bfloat16)), "q_p"),
    (dict(k_p=torch.zeros(4, 2, 16, dtype=torch.float16), v_p=torch.zeros(4, 2, 16, dtype=torch.float16)), "k_p"),
    (dict(q_d=torch.zeros(3, 2, 16, dtype=torch.float16)), "q_d"),
    (dict(packed_custom_mask_p=torch.zeros(5, dtype=torch.uint8)), "packed_custom_mask_p"),
])
def test_pod_bad_inputs_name_the_argument(change, match):
    pod, t = _small_pod()
    pod.run(**t, window_left_d=3)  # the planned value is accepted
    t.update({k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        pod.run(**t)


def test_pod_unsupported_raise():
    pod, t = _small_pod()
    with pytest.raises(NotImplementedError, match="use_fp16_qk_reduction"):
        pod.run(**t, use_fp16_qk_reduction=True)
    with pytest.raises(NotImplementedError, match="jit_args"):
        PODWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), jit_args=["x"])
    fresh = BatchPODWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    with pytest.raises(ValueError, match="before plan"):
        fresh.run(t["q_p"], t["paged_kv_cache_d"], t["q_d"], t["paged_kv_cache_d"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,qo_p,kv_p,causal", [((32, 8), 4096, 4096, True), ((8, 8), 127, 12288, False),
                                                     ((32, 8), 1024, 5000, True)])
def test_pod_gpu_realistic(dtype, heads, qo_p, kv_p, causal):
    h, hk = heads
    d, page = 128, 16
    g = torch.Generator().manual_seed(6)
    kv_lens = [4096] * 48 + list(np.random.default_rng(0).integers(1, 9000, 16))
    kv = testing.make_paged_kv(kv_lens, page, hk, d, dtype=dtype, device="cuda", generator=g)
    q_p, k_p, v_p = (testing.randn(s, dtype, "cuda", g) for s in ((qo_p, h, d), (kv_p, hk, d), (kv_p, hk, d)))
    q_d = testing.randn((len(kv_lens), h, d), dtype, "cuda", g)
    pod = PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype)
    o_p, o_d = pod.run(q_p, k_p, v_p, q_d, kv.cache, causal_p=causal)
    testing.assert_close(o_p, reference.single_prefill_with_kv_cache(q_p, k_p, v_p, causal=causal), dtype)
    ref_d, _ = reference.batch_decode_with_paged_kv_cache(q_d, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                          kv.kv_last_page_len)
    testing.assert_close(o_d, ref_d, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_batch_pod_gpu_realistic(monkeypatch, one_launch):
    """Prefill requests of 1,280 query tokens on average: on sm_90 the prefill half takes the Gluon
    kernel's paged mode (two launches) unless POD_PREFILL_ON_HOPPER is off (one pair launch)."""
    monkeypatch.setattr(_route, "POD_PREFILL_ON_HOPPER", not one_launch)
    dtype, h, hk, d, page = torch.bfloat16, 32, 8, 128, 16
    g = torch.Generator().manual_seed(7)
    kv_p = testing.make_paged_kv([2048, 1000], page, hk, d, dtype=dtype, device="cuda", generator=g)
    kv_d = testing.make_paged_kv([2048] * 64, page, hk, d, dtype=dtype, device="cuda", generator=g)
    q_p, qo_indptr_p = testing.random_qo([2048, 512], h, d, dtype, "cuda", g)
    q_d, qo_indptr_d = testing.random_qo([1] * 64, h, d, dtype, "cuda", g)
    pod = BatchPODWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    pod.plan(qo_indptr_p, kv_p.kv_indptr, kv_p.kv_indices, kv_p.kv_last_page_len, qo_indptr_d, kv_d.kv_indptr,
             kv_d.kv_indices, kv_d.kv_last_page_len, h, hk, d, page, q_data_type=dtype)
    assert pod._step_p.route.is_core == (one_launch or not _route.is_sm90(torch.device("cuda"))), pod._step_p.route
    (o_p, o_d), (lse_p, lse_d) = pod.run(q_p, kv_p.cache, q_d, kv_d.cache, causal_p=True, return_lse=True)
    ref_p, ref_lse_p = reference.batch_prefill_with_paged_kv_cache(
        q_p, qo_indptr_p, kv_p.cache, kv_p.kv_indptr, kv_p.kv_indices, kv_p.kv_last_page_len, causal=True)
    ref_d, ref_lse_d = reference.batch_prefill_with_paged_kv_cache(
        q_d, qo_indptr_d, kv_d.cache, kv_d.kv_indptr, kv_d.kv_indices, kv_d.kv_last_page_len)
    testing.assert_close(o_p, ref_p, dtype)
    testing.assert_close(o_d, ref_d, dtype)
    testing.assert_lse_close(lse_p, ref_lse_p, dtype=dtype)
    testing.assert_lse_close(lse_d, ref_lse_d, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_pod_gpu_gluon_prefill_half(monkeypatch, one_launch):
    """bench pod's shape (64 x 4K decode, a causal 4K bf16 chunk): on sm_90 the prefill half takes the
    Gluon kernel and the decode half its own launch, unless POD_PREFILL_ON_HOPPER is off (one pair
    launch); outputs and LSEs of both halves match the reference either way."""
    monkeypatch.setattr(_route, "POD_PREFILL_ON_HOPPER", not one_launch)
    dtype, h, hk, d, page, n = torch.bfloat16, 32, 8, 128, 16, 4096
    g = torch.Generator().manual_seed(8)
    kv = testing.make_paged_kv([4096] * 64, page, hk, d, dtype=dtype, device="cuda", generator=g)
    q_p, k_p, v_p = (testing.randn(s, dtype, "cuda", g) for s in ((n, h, d), (n, hk, d), (n, hk, d)))
    q_d = testing.randn((64, h, d), dtype, "cuda", g)
    pod = PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype)
    (o_p, lse_p), (o_d, lse_d) = pod.run(q_p, k_p, v_p, q_d, kv.cache, causal_p=True, return_lse_p=True,
                                         return_lse_d=True)
    (step_p,) = pod._prefill_steps.values()
    assert step_p.route.is_core == (one_launch or not _route.is_sm90(torch.device("cuda"))), step_p.route
    ref_p, ref_lse_p = reference.single_prefill_with_kv_cache(q_p, k_p, v_p, causal=True, return_lse=True)
    ref_d, ref_lse_d = reference.batch_decode_with_paged_kv_cache(q_d, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                  kv.kv_last_page_len)
    testing.assert_close(o_p, ref_p, dtype)
    testing.assert_close(o_d, ref_d, dtype)
    testing.assert_lse_close(lse_p, ref_lse_p, dtype=dtype)
    testing.assert_lse_close(lse_d, ref_lse_d, dtype=dtype)
