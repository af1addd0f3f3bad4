"""The launch cache (``tritoninfer._launch``): its key must separate every pair of arguments that
Triton specialises differently, or a cached kernel would run with the wrong assumptions."""
import ctypes
import itertools

import numpy as np
import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tritoninfer._launch import _arg_key, _args_key

INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 16,
        (1 << 40) + 16, (1 << 63) - 1, -(1 << 63), 1 << 63, (1 << 63) + 16]


def _triton(a):
    return native_specialize_impl(BaseBackend, a, False, True, True)


def _values():
    base = torch.empty(64, dtype=torch.bfloat16)
    tensors = [base, base[1:], base[8:], base.view(torch.float16), base.float()[4:], base.float()[1:]]
    return INTS + [True, False, 0.0, 1.0, 2.5, None] + tensors


@pytest.mark.parametrize("a,b", list(itertools.combinations(_values(), 2)))
def test_key_separates_what_triton_specialises_differently(a, b):
    if _arg_key(a) == _arg_key(b):
        assert _triton(a) == _triton(b)
    if _args_key((a,)) == _args_key((b,)):
        assert _triton(a) == _triton(b)


def test_key_merges_values_triton_treats_alike():
    """The cache must hit across calls, e.g. for a new token count or a new tensor."""
    assert _arg_key(32) == _arg_key(48) and _arg_key(17) == _arg_key(3)
    assert _arg_key(torch.empty(8)) == _arg_key(torch.empty(16))
    assert _arg_key(0.5) == _arg_key(3.0)


@pytest.mark.gpu
def test_cached_launches_follow_alignment_and_call_profiler_hooks():
    """Decode through the launch cache: a q view 2 bytes off 16-byte alignment must get its own
    kernel (a wrong cache hit would read misaligned vectors), and a registered launch hook must be
    called on cached launches too."""
    from triton import knobs

    import tritoninfer
    from tritoninfer import reference, testing

    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv([300, 77, 1024], 16, 2, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    base = torch.randn(3 * 8 * 128 + 1, generator=g).to("cuda", torch.bfloat16)
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(32 << 20, "cuda"))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16)
    calls = []

    def hook(metadata):
        calls.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for offset in (0, 1, 0, 1):
            q = base[offset:offset + 3 * 8 * 128].view(3, 8, 128)
            o = wrapper.run(q, kv.cache)
            ref, _ = reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                 kv.kv_last_page_len, "NHD")
            testing.assert_close(o, ref, torch.bfloat16)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls.count("attention_fwd_kernel") == 4


@pytest.mark.gpu
def test_bound_launch_rejects_tensors_on_another_device():
    """The bound launch passes addresses to Triton's launcher, which then cannot catch a CPU tensor:
    the launch checks every tensor's device itself."""
    import tritoninfer
    from tritoninfer import testing

    kv = testing.make_paged_kv([40, 7], 16, 2, 128, dtype=torch.bfloat16, device="cuda",
                               generator=torch.Generator().manual_seed(0))
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(32 << 20, "cuda"))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16)
    q = torch.randn(2, 8, 128, dtype=torch.bfloat16)
    wrapper.run(q.cuda(), kv.cache)  # binds the launch
    with pytest.raises(ValueError, match="device"):
        wrapper.run(q, kv.cache.cpu())


class _FakeMeta:
    num_ctas, launch_pdl, launch_cooperative_grid = 1, False, False
    global_scratch_size = profile_scratch_size = 0
    num_warps, shared = 4, 1024
    tensordesc_meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 128], "fp4_padded": False}]


class _FakeCompiled:
    def __init__(self, signature):
        self.src = type("Src", (), {"signature": signature})()
        self.metadata = _FakeMeta()
        self.function = 0xF00


_READ = {"Q": ctypes.c_uint64, "i": ctypes.c_int32, "q": ctypes.c_int64, "f": ctypes.c_float, "d": ctypes.c_double,
         "b": ctypes.c_int8}


def _decode(params, codes):
    return [_READ[c].from_address(params[k]).value for k, c in enumerate(codes)]


def test_driver_launch_lays_out_parameters_as_tritons_launcher(monkeypatch):
    """The driver path's parameter array: one slot per non-constexpr parameter in signature order,
    head values written per call, tail values packed once, a TMA box expanded to map, shape and
    strides, then the two scratch pointers. A fake ``cuLaunchKernel`` decodes what it gets."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    from tritoninfer import _driver, _launch

    assert _launch._TMA_DTYPE == TMA_DTYPE_DEVICE_TO_HOST
    signature = {"q": "*bf16", "stride": "i32", "one": "constexpr", "box": "tensordesc<bf16[64, 128]>",
                 "scale": "fp32", "big": "i64", "flag": "i1", "work": "*i32", "n": "i32", "log2": "fp64",
                 "BLOCK": "constexpr"}
    seen = []
    encoded = []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # the driver call has no argument types (_driver.launch_kernel): ctypes converts by Python type,
        # so the pointers must come as c_void_p and the unsigned ints as Python ints that fit a C int
        assert type(function) is ctypes.c_void_p and type(stream) is ctypes.c_void_p and extra is None
        assert all(type(x) is int and 0 <= x < 2**31 for x in (gx, gy, gz, bx, by, bz, shared))
        assert isinstance(params, ctypes.Array)
        seen.append(((function.value, gx, gy, gz, bx, shared, stream.value), params))
        return 0

    monkeypatch.setattr(_driver, "available", lambda: True)
    monkeypatch.setattr(_driver, "launch_kernel", lambda: fake_launch)
    monkeypatch.setattr(_driver, "encode_tiled", lambda tmap, *args: encoded.append((tmap.address,) + args))
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    q = torch.empty(64, dtype=torch.bfloat16)
    work = torch.empty(8, dtype=torch.int32)
    kv = torch.empty(4096, dtype=torch.bfloat16)
    box = _launch.TmaBox(kv, (32, 128), (128, 1), (64, 128), None)
    head = (q, 4096, 1, box, 0.125, 1 << 40)
    tail = (True, work, 7, 0.5)
    launch = _launch.DriverLaunch.build((_FakeCompiled(signature), (64,)), (3, 2, 1), head, tail, 0)
    assert launch is not None
    launch([q.data_ptr()], (4096, 1, 1 << 40), (0.125,), (box,))
    (config, params), = seen
    assert config == (0xF00, 3, 2, 1, 128, 1024, 77)
    codes = "Qi" + "Q" + "iiqq" + "fqbQidQQ"
    values = _decode(params, codes)
    map_address = encoded[0][0]
    assert values[0] == q.data_ptr() and values[1] == 4096
    assert params[2] == map_address
    assert values[3:7] == [32, 128, 128, 1]
    assert values[7] == 0.125 and values[8] == 1 << 40 and values[9] == 1 and values[10] == work.data_ptr()
    assert values[11] == 7 and values[12] == 0.5 and values[13:] == [0, 0]
    assert encoded[0][1:] == (TMA_DTYPE_DEVICE_TO_HOST[10], kv.data_ptr(), (32, 128), (128, 1), [64, 128], 2, 3, False)
    # a second call with other head values rewrites only those; the box's encoding is reused
    q2 = torch.empty(64, dtype=torch.bfloat16)
    launch([q2.data_ptr()], (8192, 1, 1 << 40), (2.0,), (box,))
    values = _decode(seen[1][1], codes)
    assert values[0] == q2.data_ptr() and values[1] == 8192 and values[7] == 2.0 and values[10] == work.data_ptr()
    assert len(encoded) == 1
    # a replay (_replay.py) passes the head values after the addresses, the boxes' bases and view ids; a
    # box of another view at the same address is encoded anew, even after the table of view ids is cleared
    views = _launch.box_views_of((box,))
    monkeypatch.setattr(_launch, "_VIEW_IDS", {})
    other = _launch.TmaBox(kv, (16, 256), (256, 1), (64, 128), None)
    other_views = _launch.box_views_of((other,))
    assert other_views != views
    launch.replay([q.data_ptr()], (4096, 1, 1 << 40, 0.125, 16, 256, 256, 1), (other,), [kv.data_ptr()], other_views)
    assert len(encoded) == 2 and encoded[1][3:5] == ((16, 256), (256, 1))
    assert params[2] == encoded[1][0] and _decode(seen[2][1], codes)[3:7] == [16, 256, 256, 1]
    launch.replay([q2.data_ptr()], (4096, 1, 1 << 40, 0.125, 32, 128, 128, 1), (box,), [kv.data_ptr()], views)
    assert len(encoded) == 2 and params[2] == map_address
    values = _decode(seen[3][1], codes)
    assert values[:2] == [q2.data_ptr(), 4096] and values[3:7] == [32, 128, 128, 1]
    # a plan's grid may hold numpy ints (work-list sizes): the driver call gets Python ints
    launch.set_tail(tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail), (np.int64(5), np.int32(2), 1))
    launch([q.data_ptr()], (4096, 1, 1 << 40), (0.125,), (box,))
    assert seen[4][0][1:4] == (5, 2, 1)


def test_driver_launch_refuses_what_it_cannot_pass(monkeypatch):
    from tritoninfer import _driver, _launch

    monkeypatch.setattr(_driver, "available", lambda: True)
    q = torch.empty(64, dtype=torch.bfloat16)
    assert _launch.DriverLaunch.build((_FakeCompiled({"q": "*bf16", "x": "fp16"}), ()), (1,), (q, 1.0), (), 0) is None
    scratch = _FakeCompiled({"q": "*bf16"})
    scratch.metadata.global_scratch_size = 128
    assert _launch.DriverLaunch.build((scratch, ()), (1,), (q,), (), 0) is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "paged_prefill", "ragged_prefill"])
def test_driver_path_runs_and_matches_reference(kind, monkeypatch, caplog):
    """After the first call of a plan (Triton's launcher) every launch of decode and of the Gluon
    prefill goes through ``cuLaunchKernel`` (``DriverLaunch``), eagerly and under CUDA-graph capture,
    with new q/out tensors each call, and gives the reference's result."""
    import tritoninfer
    from tritoninfer import _launch, reference, testing

    driver_calls, triton_calls = [], []
    original, original_triton = _launch.DriverLaunch._launch, _launch.BoundLaunch._triton_path

    # (the driver call itself: a full call and a replayed one (_replay.py) both end there)
    def counting(self, *args):
        driver_calls.append(self.function)
        return original(self, *args)

    def counting_triton(self, head):
        triton_calls.append(self.launcher.kernel.__name__)
        return original_triton(self, head)

    monkeypatch.setattr(_launch.DriverLaunch, "_launch", counting)
    monkeypatch.setattr(_launch.BoundLaunch, "_triton_path", counting_triton)
    g = torch.Generator().manual_seed(1)
    ws = testing.make_workspace(128 << 20, "cuda")
    lens = [300, 4100, 1500] if kind != "decode" else [300, 77, 5000]
    kv = testing.make_paged_kv(lens, 16, 8, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    if kind == "decode":
        w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws)
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        qo_indptr = torch.arange(len(lens) + 1, dtype=torch.int32)
    else:
        qo_indptr = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    if kind == "paged_prefill":
        w = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws)
        w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, causal=True,
               q_data_type=torch.bfloat16)
    if kind == "ragged_prefill":
        k = torch.randn(int(qo_indptr[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(int(qo_indptr[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
        w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws)
        w.plan(qo_indptr, qo_indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)

    def run(q):
        return w.run(q, k, v) if kind == "ragged_prefill" else w.run(q, kv.cache)

    def expected(q):
        if kind == "decode":
            return reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                              kv.kv_last_page_len, "NHD")[0]
        if kind == "paged_prefill":
            return reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                               kv.kv_last_page_len, "NHD", causal=True)[0]
        return reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, qo_indptr, "NHD", causal=True)[0]

    tokens = int(qo_indptr[-1])
    for i in range(3):
        if i == 1:  # the first run compiled (or loaded) and launched through Triton; no later one may
            triton_calls.clear()
        q = torch.randn(tokens, 32, 128, generator=g).to("cuda", torch.bfloat16)
        testing.assert_close(run(q), expected(q), torch.bfloat16)
    assert driver_calls and not triton_calls, triton_calls
    eager_calls = len(driver_calls)
    q = torch.randn(tokens, 32, 128, generator=g).to("cuda", torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(run(q))
    q.copy_(torch.randn(tokens, 32, 128, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert len(driver_calls) > eager_calls
    testing.assert_close(out, expected(q), torch.bfloat16)
    # a new plan with other lengths: its first run neither compiles nor binds through Triton's
    # kernel[grid] (the core's launch is rebound, the Gluon kernel's found by its specialisation)
    compiles = []
    original_compile = _launch.CachedLauncher.compile_and_launch
    monkeypatch.setattr(_launch.CachedLauncher, "compile_and_launch",
                        lambda self, *a: compiles.append(1) or original_compile(self, *a))
    # (as an engine's next step: other lengths, the same number of pages in the cache; a cache of another
    # size is another int in the launch's driver key, a new driver launch built through _triton_path)
    lens = [lens[2] - 3, lens[0] + 2, lens[1] + 1]
    kv = testing.make_paged_kv(lens, 16, 8, 128, dtype=torch.bfloat16, device="cuda", generator=g)
    triton_calls.clear()
    caplog.set_level("DEBUG", logger="tritoninfer.launch")
    if kind == "decode":
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    else:
        qo_indptr = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    if kind == "paged_prefill":
        w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, causal=True,
               q_data_type=torch.bfloat16)
    if kind == "ragged_prefill":
        k = torch.randn(int(qo_indptr[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
        v = torch.randn(int(qo_indptr[-1]), 8, 128, generator=g).to("cuda", torch.bfloat16)
        w.plan(qo_indptr, qo_indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)
    q = torch.randn(int(qo_indptr[-1]), 32, 128, generator=g).to("cuda", torch.bfloat16)
    testing.assert_close(run(q), expected(q), torch.bfloat16)
    why = [r.getMessage() for r in caplog.records]  # a bound launch whose tail specialised anew says where
    assert not compiles, why
    if kind == "decode":
        assert not triton_calls, why


def test_a_new_plan_rebinds_the_driver_launch():
    """The GPU launch path on the CPU (``testing.fake_driver_launches``): a decode wrapper's first run
    compiles, the next takes the driver path; after a new plan with other lengths (another grid, a
    split where there was none) the first run compiles nothing and its parameters point at the new
    plan's work list, lengths and page table, with its grid."""
    from tritoninfer import BatchDecodeWithPagedKVCacheWrapper, testing

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 64, generator=g).to(torch.bfloat16)
    cache = torch.zeros(2600, 2, 16, 2, 64, dtype=torch.bfloat16)  # an engine's cache: one size
    capacities = []
    with testing.fake_driver_launches(params_read=40) as record:
        w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, "cpu"), use_tensor_cores=True)
        for step, lens in enumerate(([70, 5, 300], [71, 6, 301], [40000, 1, 2])):
            kv = testing.make_paged_kv(lens, 16, 2, 64, dtype=torch.bfloat16, device="cpu", generator=g)
            w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 64, 16, q_data_type=torch.bfloat16,
                   fixed_split_size=64 if step == 2 else None)
            record.launches.clear()
            for _ in range(2):
                w.run(q, cache)
            plan = w._step.device_plan
            assert len(record.compiles) == 1, record.compiles  # the first plan's first run only
            assert len(record.launches) == (1 if step == 0 else 2)  # the first plan's first run compiled
            grid, params = record.launches[-1]
            assert grid == (plan.capacity, 2, 1)
            capacities.append(plan.capacity)
            for t in (plan.work, plan.kv_len, plan.state_offset, w._step.kv_indptr, w._step.kv_indices):
                assert t.data_ptr() in params
    assert capacities[2] != capacities[1] and w._step.device_plan.has_splits


def test_a_plan_with_splits_after_one_without_compiles_nothing():
    """A decode wrapper whose first plan has no KV split (every item writes its output) and whose next plan
    splits: the split plan's run takes the same compiled kernel (the partial states' stand-in has their dtype;
    an int32 one made Triton specialise the kernel again, a compile mid-serving)."""
    from tritoninfer import BatchDecodeWithPagedKVCacheWrapper, testing

    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 128, generator=g).to(torch.bfloat16)
    cache = torch.zeros(2600, 2, 16, 2, 128, dtype=torch.bfloat16)
    splits = []
    with testing.fake_driver_launches() as record:
        w = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, "cpu"), use_tensor_cores=True)
        for lens, fixed in (([100, 60, 90], None), ([40000, 1, 2], 64)):
            kv = testing.make_paged_kv(lens, 16, 2, 128, dtype=torch.bfloat16, device="cpu", generator=g)
            w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16,
                   fixed_split_size=fixed)
            w.run(q, cache)
            splits.append(w._step.device_plan.has_splits)
    assert splits == [False, True]
    assert len(record.compiles) == 1, record.compiles


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
def test_a_new_plan_rebinds_the_gluon_prefill_launch(paged):
    """The Gluon prefill's launch path on the CPU (``fake_driver_launches(hopper=True)``: the route sees
    an sm_90 GPU): plans with other lengths keep one bound launch of the kernel, so a plan's first run
    compiles nothing and takes the driver path, with parameters pointing at the new plan's tiles,
    lengths and indptrs and the new plan's grid (each plan built a launch of its own before)."""
    from tritoninfer import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, _device, testing

    hq, hk, d = 8, 2, 128
    cache = torch.zeros(1200, 2, 16, hk, d, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with testing.fake_driver_launches(params_read=35, hopper=True) as record:
        ws = testing.make_workspace(8 << 20, "cpu")
        w = BatchPrefillWithPagedKVCacheWrapper(ws) if paged else BatchPrefillWithRaggedKVCacheWrapper(ws)
        seen = []
        for step, lens in enumerate(([1300, 1500], [2000, 1030, 1200], [4100])):
            qo_indptr = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
            q = torch.zeros(int(qo_indptr[-1]), hq, d, dtype=torch.bfloat16)
            if paged:  # one cache for every plan, as an engine has
                pages = [-(-n // 16) for n in lens]
                kv_indptr = torch.tensor([0, *np.cumsum(pages)], dtype=torch.int32)
                kv_indices = torch.randperm(cache.shape[0], generator=g)[:sum(pages)].to(torch.int32)
                last = torch.tensor([n - 16 * (p - 1) for n, p in zip(lens, pages)], dtype=torch.int32)
                w.plan(qo_indptr, kv_indptr, kv_indices, last, hq, hk, d, 16, causal=True, q_data_type=torch.bfloat16)
                args = (cache,)
            else:
                w.plan(qo_indptr, qo_indptr, hq, hk, d, q_data_type=torch.bfloat16)  # (causal: from 4K tokens)
                args = (torch.zeros(int(qo_indptr[-1]), hk, d, dtype=torch.bfloat16),) * 2
            assert not w._step.route.is_core
            record.launches.clear()
            for _ in range(2):
                w.run(q, *args)
            plan, tiles = w._step.device_plan, w._step.route_work
            seen += [launch for key, launch in plan.attention_launches.items() if key[0] == "hopper"]
            # (host page ids: run() checked them against the cache, so no page-id check kernel launches;
            # the first plan compiles unless an earlier test in this process compiled that specialisation)
            if step == 0:
                compiled = len(record.compiles)
                assert compiled <= 1, record.compiles
            assert len(record.compiles) == compiled, record.compiles
            hopper_launches = [entry for entry in record.launches if len(entry[1]) == 35]
            assert len(hopper_launches) == len(record.launches) == (2 - compiled if step == 0 else 2)
            grid, params = hopper_launches[-1]
            assert grid == (min(tiles.shape[1] * hq, _device.num_sms("cpu")), 1, 1)
            for t in (plan.qo_indptr, w._step.kv_indptr, plan.kv_len, tiles[0], tiles[1]):
                assert t.data_ptr() in params
            if paged:
                assert w._step.kv_indices.data_ptr() in params
        assert len(seen) == 3 and all(launch is seen[0] for launch in seen)


def test_rebind_keeps_the_kernel_only_while_the_tail_specialises_alike():
    """``BoundLaunch.rebind``: a new tail whose only change Triton does not specialise on (a
    ``do_not_specialize`` int crossing a multiple of 16) keeps the compiled kernel and the driver
    launch, repacked with the new values and grid; a change it does specialise on (a pointer's
    16-byte alignment) drops them, and the next call compiles that specialisation."""
    from tritoninfer import _launch, testing

    signature = {"x": "*fp32", "n": "i32", "count": "i32", "work": "*i32"}
    x = torch.empty(64)
    work, work2 = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    with testing.fake_driver_launches(params_read=4) as record:
        launcher = _launch.CachedLauncher(None)
        launcher.unspecialized = frozenset({2})  # "count"
        launcher.compile_and_launch = lambda grid, args, kwargs: record.compiles.append(grid) or (
            _FakeCompiled(signature), ())
        bound = launcher.bind((3,), (17, work), {})
        bound(x, 4096)
        bound(x, 4096)
        bound.rebind((5,), (32, work2))
        bound(x, 4096)
        assert record.compiles == [(3, 1, 1)]
        grid, values = record.launches[-1]
        assert grid == (5, 1, 1) and values[0] == x.data_ptr() and values[1] & 0xFFFFFFFF == 4096
        assert values[2] & 0xFFFFFFFF == 32 and values[3] == work2.data_ptr()
        bound.rebind((6,), (32, work2[1:]))
        bound(x, 4096)
        assert record.compiles == [(3, 1, 1), (6, 1, 1)]


def test_cached_launcher_takes_the_driver_path_from_a_keys_second_call(monkeypatch):
    """``CachedLauncher`` (the ops' launcher: sampling, norm, rope, ...): a specialisation's first call
    compiles through Triton, its later calls go through ``cuLaunchKernel`` with that call's grid and
    values (``None`` arguments are constexprs, no slot); a launch hook sends a call back to Triton's
    launcher. A fake ``cuLaunchKernel`` decodes what it gets."""
    from tritoninfer import _device, _driver, _launch

    signature = {"x": "*fp32", "idx": "constexpr", "n": "i32", "scale": "fp32", "one": "constexpr",
                 "BLOCK": "constexpr"}
    seen, compiled, triton_path = [], [], []

    def fake_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        seen.append(((gx, gy, gz), _decode(params, "QifQQ")))
        return 0

    monkeypatch.setattr(_device, "is_interpreter", lambda: False)
    # the CPU tensors' device (-1) plays the current CUDA device
    monkeypatch.setattr(_launch, "_current_device", lambda: -1)
    monkeypatch.setattr(_launch, "_current_index", lambda: -1)
    monkeypatch.setattr(_launch, "_run", lambda *args: triton_path.append(args[1]))
    monkeypatch.setattr(_driver, "available", lambda: True)
    monkeypatch.setattr(_driver, "launch_kernel", lambda: fake_launch)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    launcher = _launch.CachedLauncher(None)
    monkeypatch.setattr(launcher, "compile_and_launch",
                        lambda grid, args, kwargs: compiled.append(grid) or (_FakeCompiled(signature), (64,)))
    x, x2 = torch.empty(64), torch.empty(64)
    launcher[(5,)](x, None, 4096, 0.5, 1, BLOCK=64)
    assert compiled == [(5,)] and not seen
    launcher[(7, 2)](x2, None, 8192, 2.0, 1, BLOCK=64)
    assert seen == [((7, 2, 1), [x2.data_ptr(), 8192, 2.0, 0, 0])] and not triton_path
    # another specialisation (n divisible by 16 -> not): compiled, then its own driver launch
    launcher[(3,)](x, None, 4095, 1.0, 1, BLOCK=64)
    assert compiled == [(5,), (3,)]
    # a tensor on another device than the current one: Triton's launcher (which refuses it)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 3)
    launcher[(6,)](x, None, 4096, 0.5, 1, BLOCK=64)
    assert triton_path == [(6,)] and len(seen) == 1
    monkeypatch.undo()
    monkeypatch.setattr(_device, "is_interpreter", lambda: False)
    monkeypatch.setattr(_launch, "_current_device", lambda: -1)
    monkeypatch.setattr(_launch, "_run", lambda *args: triton_path.append(args[1]))
    monkeypatch.setattr(_launch, "_no_hooks", lambda: False)
    launcher[(4,)](x, None, 4096, 0.5, 1, BLOCK=64)
    assert triton_path == [(6,), (4,)] and len(seen) == 1


@pytest.mark.gpu
def test_ops_take_the_driver_path_from_the_second_call(monkeypatch):
    """The ops' launcher (``CachedLauncher``): RMSNorm and plain sampling (whose kernels take ``None``
    arguments) launch through ``cuLaunchKernel`` from a specialisation's second call, with new
    tensors and another grid, and still give the reference's result and valid samples; with the
    switch off they take Triton's launcher."""
    from tritoninfer import _launch, norm, reference, sampling

    driver_calls = []
    original = _launch.DriverLaunch.__call__

    def counting(self, *args):
        driver_calls.append(self.function)
        return original(self, *args)

    monkeypatch.setattr(_launch.DriverLaunch, "__call__", counting)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, generator=g).to("cuda", torch.bfloat16)
    for rows in (8, 8, 24):
        x = torch.randn(rows, 4096, generator=g).to("cuda", torch.bfloat16)
        torch.testing.assert_close(norm.rmsnorm(x, w).float(), reference.rmsnorm(x, w), atol=2e-2, rtol=2e-2)
    assert len(driver_calls) == 2
    with pytest.raises((ValueError, RuntimeError)):  # a CPU weight: refused, never launched with its address
        norm.rmsnorm(x, w.cpu())
    assert len(driver_calls) == 2
    probs = torch.softmax(torch.randn(16, 32000, generator=g).cuda(), -1)
    for _ in range(3):
        s = sampling.sampling_from_probs(probs).long()
        assert (probs[torch.arange(16, device="cuda"), s] > 0).all()
    assert len(driver_calls) >= 2 + 2 * 2  # the mass and pick kernels' second and third calls
    monkeypatch.setattr(_launch, "CACHED_DRIVER_PATH", False)
    before = len(driver_calls)
    norm.rmsnorm(x, w)
    assert len(driver_calls) == before


@pytest.mark.gpu
def test_single_request_functions_do_not_wait_for_the_gpu():
    """``single_prefill_with_kv_cache`` / ``single_decode_with_kv_cache`` plan at every call; their
    plan copies must not wait for earlier GPU work (a wait per layer made batch-1 prefill under
    transformers 2.5x slower than SDPA): as many planning calls as the ring has pinned buffers,
    queued behind a long GPU sleep, return while it runs, and still give the reference's output."""
    from tritoninfer import _step, decode, prefill
    from tritoninfer import reference as ref
    from tritoninfer.testing import rel_error, tolerance

    g = torch.Generator().manual_seed(5)
    q = torch.randn(64, 8, 128, generator=g).to("cuda", torch.float16)
    k = torch.randn(256, 2, 128, generator=g).to("cuda", torch.float16)
    v = torch.randn(256, 2, 128, generator=g).to("cuda", torch.float16)
    calls = _step.SINGLE_UPLOAD_SLOTS

    def run_all():
        # a new KV length each call, so that each plans and uploads once the kept steps are cleared
        return [prefill.single_prefill_with_kv_cache(q, k[:200 + i], v[:200 + i], causal=True) if i % 2 else
                decode.single_decode_with_kv_cache(q[i], k[:200 + i], v[:200 + i]) for i in range(calls)]

    run_all()  # every variant compiled before the timed part
    torch.cuda.synchronize()
    _step._SINGLE_STEPS.clear()
    asleep = torch.cuda.Event()
    torch.cuda._sleep(1 << 31)  # about a second of GPU time
    asleep.record()
    outs = run_all()
    assert not asleep.query(), "a single-request call waited for the GPU"
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        kk, vv = k[:200 + i], v[:200 + i]
        want = (ref.single_prefill_with_kv_cache(q, kk, vv, causal=True) if i % 2 else
                ref.single_decode_with_kv_cache(q[i], kk, vv))
        err = rel_error(o, want)
        assert err <= tolerance(torch.float16), f"call {i}: relative error {err:.3g}"
