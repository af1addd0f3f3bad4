"""``torch.compile(fullgraph=True)`` over tritoninfer's ops (``tritoninfer/_ops.py``): a small decoder
layer compiles without graph breaks and gives the eager result; a re-plan needs no recompilation.
On the CPU with the ``aot_eager`` backend (the custom ops then run their kernels through the
interpreter); on the GPU with the default backend too."""

import collections
import importlib
import itertools

import pytest
import torch
from conftest import DEVICE, ON_GPU

import tritoninfer
from tritoninfer import testing

B, HQ, HK, D, PAGE = 3, 4, 2, 32, 4


@pytest.fixture(autouse=True)
def _nan_poison():
    """conftest's NaN-poisoned torch.empty is a Python wrapper Dynamo cannot trace; these tests compare
    compiled results with eager ones on the same inputs instead."""
    yield


def _layer(x, w_norm, w_up, pos, cache, wrapper, residual):
    """RMSNorm -> RoPE (q and k from the normed input) -> paged decode -> SiLU-and-mul, and a fused
    residual add + RMSNorm."""
    h = tritoninfer.rmsnorm(x, w_norm)
    q = h.view(B, HQ, D)
    k = h[:, : HK * D].reshape(B, HK, D).contiguous()
    q, k = tritoninfer.apply_rope_pos_ids(q, k, pos)
    o = wrapper.run(q.contiguous(), cache)
    y = tritoninfer.silu_and_mul(torch.cat([o.reshape(B, -1), h], dim=-1) @ w_up)
    tritoninfer.fused_add_rmsnorm(y, residual, w_norm[: y.shape[-1]])
    return y, k


def _inputs(seed, kv_lens):
    g = torch.Generator().manual_seed(seed)
    x = testing.randn((B, HQ * D), torch.float16, DEVICE, g)
    w_norm = testing.randn((HQ * D,), torch.float16, DEVICE, g)
    w_up = testing.randn((2 * HQ * D, 2 * 64), torch.float16, DEVICE, g, scale=0.05)
    pos = torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE) - 1
    # the same cache size for every plan, as an engine's cache: only the page table changes
    extra = 12 - sum(-(-n // PAGE) for n in kv_lens)
    kv = testing.make_paged_kv(kv_lens, PAGE, HK, D, device=DEVICE, generator=g, extra_pages=extra)
    residual = testing.randn((B, 64), torch.float16, DEVICE, g)
    return x, w_norm, w_up, pos, kv, residual


@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if ON_GPU else []))
def test_decoder_layer_compiles_fullgraph_and_matches_eager(backend):
    torch._dynamo.reset()
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, DEVICE))
    compiled = torch.compile(_layer, fullgraph=True, backend=backend)
    for seed, kv_lens in enumerate(((5, 9, 3), (17, 2, 8))):
        x, w_norm, w_up, pos, kv, residual = _inputs(seed, kv_lens)
        wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, HQ, HK, D, PAGE)
        eager_res = residual.clone()
        y_ref, k_ref = _layer(x, w_norm, w_up, pos, kv.cache, wrapper, eager_res)
        res = residual.clone()
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):  # a re-plan must not recompile
            y, k = compiled(x, w_norm, w_up, pos, kv.cache, wrapper, res)
        testing.assert_close(k, k_ref, torch.float16, tol=0.0)
        testing.assert_close(y, y_ref, torch.float16, tol=1e-3)
        testing.assert_close(res, eager_res, torch.float16, tol=1e-3)


def test_ops_are_registered_custom_ops():
    # the submodules load lazily (tritoninfer/__init__.py); each registers its ops on import
    for module in ("activation", "cascade", "decode", "norm", "page", "prefill", "quantization", "rope", "sampling"):
        importlib.import_module(f"tritoninfer.{module}")
    for name in ("rmsnorm", "fused_add_rmsnorm", "act_and_mul", "rope", "rope_inplace", "rope_cos_sin_cache",
                 "rope_cos_sin_cache_inplace", "segment_packbits", "wrapper_run", "rope_quantize_fp8",
                 "rope_quantize_fp8_append_paged_kv_cache", "layernorm", "sample", "renorm", "softmax",
                 "chain_speculative_sampling"):
        assert hasattr(torch.ops.tritoninfer, name), name


def test_prefill_wrappers_compile(monkeypatch):
    """The paged and ragged prefill wrappers' run() under fullgraph compile: one op, the eager result."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    qo_lens, kv_lens = (3, 5), (7, 9)
    q, qo_indptr = testing.random_qo(qo_lens, HQ, D, torch.float16, DEVICE, g)
    kv = testing.make_paged_kv(kv_lens, PAGE, HK, D, device=DEVICE, generator=g)
    k, kv_indptr = testing.make_ragged(kv_lens, HK, D, torch.float16, DEVICE, g)
    v, _ = testing.make_ragged(kv_lens, HK, D, torch.float16, DEVICE, g)
    paged = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, DEVICE))
    paged.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, HQ, HK, D, PAGE, causal=True)
    ragged = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(8 << 20, DEVICE))
    ragged.plan(qo_indptr, kv_indptr, HQ, HK, D, causal=True)

    def both(q, cache, k, v):
        o1, lse1 = paged.run(q, cache, return_lse=True)
        return o1, lse1, ragged.run(q, k, v)

    o1, lse1, o2 = torch.compile(both, fullgraph=True, backend="aot_eager")(q, kv.cache, k, v)
    testing.assert_close(o1, paged.run(q, kv.cache), torch.float16, tol=0.0)
    testing.assert_lse_close(lse1, paged.run(q, kv.cache, return_lse=True)[1], atol=0.0, rtol=0.0)
    testing.assert_close(o2, ragged.run(q, k, v), torch.float16, tol=0.0)


def test_single_functions_merges_and_append_compile():
    """single decode/prefill, the state merges, the cascade wrapper and the append under fullgraph
    compile give the eager results (outputs compared bit for bit: the same kernels run)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    q1 = testing.randn((HQ, D), torch.float16, DEVICE, g)
    qs = testing.randn((5, HQ, D), torch.float16, DEVICE, g)
    k = testing.randn((9, HK, D), torch.float16, DEVICE, g)
    v = testing.randn((9, HK, D), torch.float16, DEVICE, g)
    mask = torch.rand(5, 9, generator=g) < 0.7

    def singles(q1, qs, k, v, mask):
        o1, l1 = tritoninfer.single_decode_with_kv_cache(q1, k, v, return_lse=True)
        o2 = tritoninfer.single_prefill_with_kv_cache(qs, k, v, causal=True)
        o3, l3 = tritoninfer.single_prefill_with_kv_cache(qs, k, v, custom_mask=mask, return_lse=True)
        return o1, l1, o2, o3, l3

    got = torch.compile(singles, fullgraph=True, backend="aot_eager")(q1, qs, k, v, mask)
    want = singles(q1, qs, k, v, mask)
    for a, b in zip(got, want):
        assert torch.equal(a, b)

    va, vb = testing.randn((6, HQ, D), torch.float16, DEVICE, g), testing.randn((6, HQ, D), torch.float16, DEVICE, g)
    sa, sb = testing.randn((6, HQ), torch.float32, DEVICE, g), testing.randn((6, HQ), torch.float32, DEVICE, g)
    vs, ss = testing.randn((6, 3, HQ, D), torch.float16, DEVICE, g), testing.randn((6, 3, HQ), torch.float32, DEVICE, g)

    def merges(va, sa, vb, sb, vs, ss):
        v1, s1 = tritoninfer.merge_state(va, sa, vb, sb)
        v2, s2 = tritoninfer.merge_states(vs, ss)
        v3, s3 = va.clone(), sa.clone()
        tritoninfer.merge_state_in_place(v3, s3, vb, sb)
        return v1, s1, v2, s2, v3, s3

    got = torch.compile(merges, fullgraph=True, backend="aot_eager")(va, sa, vb, sb, vs, ss)
    for a, b in zip(got, merges(va, sa, vb, sb, vs, ss)):
        assert torch.equal(a, b)

    kv = testing.make_paged_kv((6, 10), PAGE, HK, D, device=DEVICE, generator=g)
    cascade = tritoninfer.MultiLevelCascadeAttentionWrapper(2, testing.make_workspace(8 << 20, DEVICE))
    shared_pages = kv.kv_indices[:1].clone()
    cascade.plan([torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)],
                 [torch.tensor([0, 1], dtype=torch.int32), kv.kv_indptr], [shared_pages, kv.kv_indices],
                 [torch.tensor([PAGE], dtype=torch.int32), kv.kv_last_page_len], HQ, HK, D, PAGE)
    q2 = testing.randn((2, HQ, D), torch.float16, DEVICE, g)
    compiled_cascade = torch.compile(lambda q, c: cascade.run(q, c), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled_cascade(q2, kv.cache), cascade.run(q2, kv.cache))

    lens = torch.tensor(kv.kv_lens, dtype=torch.int32, device=DEVICE)
    append_indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    bi, pos = tritoninfer.get_batch_indices_positions(append_indptr, lens, 3)
    new_k = testing.randn((3, HK, D), torch.float16, DEVICE, g)

    def append(cache):
        tritoninfer.append_paged_kv_cache(new_k, new_k, bi, pos, cache, kv.kv_indices, kv.kv_indptr,
                                          kv.kv_last_page_len)
        return cache

    eager_cache = kv.cache.clone()
    append(eager_cache)
    compiled_cache = torch.compile(append, fullgraph=True, backend="aot_eager")(kv.cache.clone())
    assert torch.equal(compiled_cache, eager_cache)


def test_run_compiled_in_place_of_the_class_attribute(monkeypatch):
    """FlashInfer's compile tests replace ``Wrapper.run`` on the class by ``torch.compile(run)``: the op
    must run the wrapper's own work, not the (now compiled) ``run`` attribute again."""
    torch._dynamo.reset()
    cls = tritoninfer.BatchDecodeWithPagedKVCacheWrapper
    original = cls.run
    compiled = torch.compile(original, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(cls, "run", lambda self, *args, **kwargs: compiled(self, *args, **kwargs))
    x, w_norm, w_up, pos, kv, residual = _inputs(5, (5, 9, 3))
    wrapper = cls(testing.make_workspace(8 << 20, DEVICE))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, HQ, HK, D, PAGE)
    q = testing.randn((B, HQ, D), torch.float16, DEVICE, torch.Generator().manual_seed(6))
    o, lse = wrapper.run(q, kv.cache, return_lse=True)
    o_ref, lse_ref = original(wrapper, q, kv.cache, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def _matches_eager(fn, *args):
    """``fn(*args)`` compiled with fullgraph gives eager's outputs, and leaves its tensor arguments as
    eager leaves them (the in-place forms), bit for bit: the same kernels run on the same inputs. On
    the GPU also with the default backend, which FlashInfer's compile tests use."""
    clone = lambda: [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    eager_args = clone()
    want = fn(*eager_args)
    want = want if isinstance(want, tuple) else (want,)
    for backend in ["aot_eager"] + (["inductor"] if ON_GPU else []):
        torch._dynamo.reset()
        compiled_args = clone()
        got = torch.compile(fn, fullgraph=True, backend=backend)(*compiled_args)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(want)
        for a, b in zip(list(got) + compiled_args, list(want) + eager_args):
            if isinstance(b, torch.Tensor):
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), backend


def _rope_inputs():
    g = torch.Generator().manual_seed(7)
    # q and k as views of one qkv tensor, as a model splits them (the in-place forms write through)
    qkv = testing.randn((5, HQ + 2 * HK, 16), torch.float16, DEVICE, g)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=DEVICE)
    return qkv, i32(0, 2, 5), i32(3, 9), i32(0, 4, 1, 7, 30)


def _qk(qkv):
    return qkv[:, :HQ], qkv[:, HQ:HQ + HK]


def _in_place(fn):
    """A function of ``qkv`` that applies the in-place ``fn`` to its q and k views."""
    def apply(qkv, *args, **kwargs):
        fn(*_qk(qkv), *args, **kwargs)
        return qkv
    return apply


_ROPE_CASES = {
    "apply_rope": lambda qkv, indptr, offsets, pos: tritoninfer.apply_rope(*_qk(qkv), indptr, offsets, rotary_dim=8),
    "apply_rope_inplace": lambda qkv, indptr, offsets, pos: _in_place(tritoninfer.apply_rope_inplace)(
        qkv, indptr, offsets, interleave=True),
    "apply_rope_pos_ids_inplace": lambda qkv, indptr, offsets, pos: _in_place(tritoninfer.apply_rope_pos_ids_inplace)(
        qkv, pos, rope_theta=500.0),
    "apply_llama31_rope": lambda qkv, indptr, offsets, pos: tritoninfer.apply_llama31_rope(
        *_qk(qkv), indptr, offsets, rope_scale=4, old_context_len=64),
    "apply_llama31_rope_inplace": lambda qkv, indptr, offsets, pos: _in_place(tritoninfer.apply_llama31_rope_inplace)(
        qkv, indptr, offsets, old_context_len=64),
    "apply_llama31_rope_pos_ids": lambda qkv, indptr, offsets, pos: tritoninfer.apply_llama31_rope_pos_ids(
        *_qk(qkv), pos, interleave=True, old_context_len=64),
    "apply_llama31_rope_pos_ids_inplace": lambda qkv, indptr, offsets, pos: _in_place(
        tritoninfer.apply_llama31_rope_pos_ids_inplace)(qkv, pos, rotary_dim=12, old_context_len=64),
}


@pytest.mark.parametrize("name", sorted(_ROPE_CASES))
def test_rope_forms_compile(name):
    """Every RoPE form FlashInfer's compile tests wrap, ragged and pos_ids, out of place and in place
    (on views of one qkv tensor)."""
    _matches_eager(_ROPE_CASES[name], *_rope_inputs())


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_with_cos_sin_cache_compiles(in_place, is_neox):
    """The SGLang/vLLM form: 2-D ``[nnz, heads * head_size]`` views of qkv, rotary_dim 12 of 16."""
    qkv, _, _, pos = _rope_inputs()
    g = torch.Generator().manual_seed(8)
    cos_sin = torch.randn((32, 12), generator=g).to(DEVICE)

    def rope(qkv, pos):
        flat = qkv.flatten(1)
        q, k = flat[:, :HQ * 16], flat[:, HQ * 16:(HQ + HK) * 16]
        if in_place:
            tritoninfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 16, cos_sin, is_neox)
            return qkv
        return tritoninfer.apply_rope_with_cos_sin_cache(pos, q, k, 16, cos_sin, is_neox=is_neox)

    _matches_eager(rope, qkv, pos)


@pytest.mark.parametrize("name", ["gemma_rmsnorm", "gemma_fused_add_rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_norm_and_activation_forms_compile(name):
    """The Gemma norms and the GELU activations (RMSNorm and SiLU are in the decoder layer above)."""
    g = torch.Generator().manual_seed(9)
    x, r = (testing.randn((3, 2, 24), torch.float16, DEVICE, g) for _ in range(2))
    w = testing.randn((24,), torch.float16, DEVICE, g)
    fns = {
        "gemma_rmsnorm": lambda x, r, w: tritoninfer.gemma_rmsnorm(x, w, eps=1e-5),
        # the fused form overwrites both of its inputs
        "gemma_fused_add_rmsnorm": lambda x, r, w: tritoninfer.gemma_fused_add_rmsnorm(x, r, w),
        "gelu_and_mul": lambda x, r, w: tritoninfer.gelu_and_mul(x),
        "gelu_tanh_and_mul": lambda x, r, w: tritoninfer.gelu_tanh_and_mul(x[:, 1]),
    }
    _matches_eager(fns[name], x, r, w)


@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_packbits_compile(bitorder):
    """packbits traces as torch ops; segment_packbits, whose size is data-dependent, is one op."""
    g = torch.Generator().manual_seed(10)
    x = torch.rand(21, generator=g).to(DEVICE) < 0.5
    indptr = torch.tensor([0, 9, 9, 21], dtype=torch.int32, device=DEVICE)
    _matches_eager(lambda x: tritoninfer.packbits(x, bitorder), x)
    _matches_eager(lambda x, indptr: tritoninfer.segment_packbits(x, indptr, bitorder), x, indptr)


def _merge_in_place_case(g):
    import tritoninfer.cascade as module

    v, v_other = (testing.randn((2, HQ, D), torch.float16, DEVICE, g) for _ in range(2))
    s, s_other = (testing.randn((2, HQ), torch.float32, DEVICE, g) for _ in range(2))

    def call(fn):
        v_, s_ = v.clone(), s.clone()
        fn(v_, s_, v_other, s_other)
        return v_, s_

    return module, "merge_state_in_place", call


def _single_decode_case(g):
    import tritoninfer.decode as module

    q = testing.randn((HQ, D), torch.float16, DEVICE, g)
    k, v = (testing.randn((9, HK, D), torch.float16, DEVICE, g) for _ in range(2))
    return module, "single_decode_with_kv_cache", lambda fn: fn(q, k, v)


def _single_prefill_case(g):
    import tritoninfer.prefill as module

    q = testing.randn((5, HQ, D), torch.float16, DEVICE, g)
    k, v = (testing.randn((7, HK, D), torch.float16, DEVICE, g) for _ in range(2))
    return module, "single_prefill_with_kv_cache", lambda fn: fn(q, k, v, causal=True)


def _append_case(g):
    import tritoninfer.page as module

    kv = testing.make_paged_kv([5, 3], 4, HK, D, dtype=torch.float16, device=DEVICE, generator=g)
    key, value = (testing.randn((3, HK, D), torch.float16, DEVICE, g) for _ in range(2))
    batch = torch.tensor([0, 0, 1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([3, 4, 2], dtype=torch.int32, device=DEVICE)

    def call(fn):
        cache = kv.cache.clone()
        fn(key, value, batch, pos, cache, kv.kv_indices, kv.kv_indptr, kv.kv_last_page_len)
        return cache

    return module, "append_paged_kv_cache", call


@pytest.mark.parametrize("case", [_merge_in_place_case, _single_decode_case, _single_prefill_case, _append_case],
                         ids=["merge_state_in_place", "single_decode", "single_prefill", "append_paged_kv_cache"])
def test_op_does_not_call_a_replaced_public_function(case, monkeypatch):
    """A caller may replace a public function by its compiled self: the op behind it must run the
    work, not that name again (which recursed)."""
    torch._dynamo.reset()
    module, name, call = case(torch.Generator().manual_seed(11))
    original = getattr(module, name)
    expected = call(original)
    monkeypatch.setattr(module, name, torch.compile(original, fullgraph=True, backend="aot_eager"))
    got = call(getattr(module, name))
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, expected))):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_decode_layer_reduce_overhead_with_replans(monkeypatch):
    """``mode="reduce-overhead"`` (CUDA graphs) over RMSNorm -> RoPE -> paged decode -> SiLU-and-mul,
    with a CUDA-graph-mode wrapper: the graph captured at the second call keeps the wrapper's fixed
    buffers, so re-plans with new page tables (same batch) are read at replay, without recompiling
    or re-recording."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # CUDA-graph captures and replays, counted: reduce-overhead falls back to plain runs silently
    events = collections.Counter()
    for method in ("capture_begin", "replay"):
        def counted(self, *args, _method=getattr(torch.cuda.CUDAGraph, method), _name=method, **kwargs):
            events[_name] += 1
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(torch.cuda.CUDAGraph, method, counted)
    batch, hq, hk, d, page, num_pages = 4, 8, 2, 64, 16, 64
    bufs = (torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
            torch.zeros(num_pages, dtype=torch.int32, device="cuda"),
            torch.ones(batch, dtype=torch.int32, device="cuda"))
    wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(
        testing.make_workspace(32 << 20, "cuda"), use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])
    g = torch.Generator().manual_seed(12)
    cache = testing.randn((num_pages, 2, page, hk, d), torch.float16, "cuda", g)
    w_norm = testing.randn((hq * d,), torch.float16, "cuda", g)
    w_up = testing.randn((hq * d, 2 * 128), torch.float16, "cuda", g, scale=0.05)
    # the engine's cache and weights: one address for every call, not copied into the graph at replay
    for t in (cache, w_norm, w_up):
        torch._dynamo.mark_static_address(t)

    def layer(x, pos, cache):
        h = tritoninfer.rmsnorm(x, w_norm)
        q, k = tritoninfer.apply_rope_pos_ids(h.view(batch, hq, d), h[:, : hk * d].reshape(batch, hk, d), pos)
        o = wrapper.run(q, cache)
        return tritoninfer.silu_and_mul(o.reshape(batch, -1) @ w_up), o, k

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    # call 1 warms up, call 2 records the CUDA graph, calls 3-5 replay it; a plan before each call (new
    # page ids every time, new lengths at calls 3 and 5)
    steps = ((40, 3, 17, 100), (40, 3, 17, 100), (1, 250, 64, 9), (1, 250, 64, 9), (16, 16, 33, 200))
    for step, kv_lens in enumerate(steps):
        pages = [-(-n // page) for n in kv_lens]
        indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
        indices = torch.randperm(num_pages, generator=g)[: sum(pages)].to(torch.int32)
        last = torch.tensor([(n - 1) % page + 1 for n in kv_lens], dtype=torch.int32)
        wrapper.plan(indptr, indices, last, hq, hk, d, page)
        x = testing.randn((batch, hq * d), torch.float16, "cuda", g)
        pos = torch.tensor(kv_lens, dtype=torch.int32, device="cuda") - 1
        want = layer(x, pos, cache)
        before = events.copy()
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            got = [t.clone() for t in compiled(x, pos, cache)]  # a replay overwrites the graph's outputs
        torch.cuda.synchronize()
        if step >= 2:  # the graph recorded at call 2 replays, whatever the plan
            assert (events["capture_begin"], events["replay"]) == (before["capture_begin"], before["replay"] + 1)
        testing.assert_close(got[1], want[1], torch.float16, tol=0.0)
        testing.assert_close(got[2], want[2], torch.float16, tol=0.0)
        testing.assert_close(got[0], want[0], torch.float16, tol=1e-3)
    assert counters["inductor"]["cudagraph_skips"] == 0


def _rope_quantize_inputs(g, mla):
    """q/k rope and nope parts as slices of 24-wide q/k (rope 8), a cos/sin cache, positions."""
    q = testing.randn((5, HQ, 24), torch.float16, DEVICE, g, scale=3.0)
    k = testing.randn((5, 24) if mla else (5, HK, 24), torch.float16, DEVICE, g, scale=3.0)
    ang = torch.arange(32, dtype=torch.float32)[:, None] * torch.rand(4, generator=g)[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).to(DEVICE)
    pos = torch.tensor([0, 4, 1, 7, 30], dtype=torch.int32, device=DEVICE)
    return q, k, cos_sin, pos


@pytest.mark.parametrize("mla", [False, True])
def test_rope_quantize_fp8_compiles(mla):
    """rope_quantize_fp8 (outputs allocated, and given as slices of one buffer) and its MLA name under
    fullgraph compile: the eager fp8 codes."""
    q, k, cos_sin, pos = _rope_quantize_inputs(torch.Generator().manual_seed(11), mla)

    def fn(q, k, cos_sin, pos):
        a = tritoninfer.rope.rope_quantize_fp8(q[..., :8], k[..., :8], q[..., 8:], k[..., 8:], cos_sin, pos,
                                               is_neox=False, quant_scale_q=2.0)
        q_out = torch.empty(q.shape, dtype=torch.float8_e5m2, device=q.device)
        k_out = torch.empty(k.shape, dtype=torch.float8_e5m2, device=k.device)
        tritoninfer.rope.mla_rope_quantize_fp8(q[..., :8], k[..., :8], q[..., 8:], k[..., 8:], cos_sin, pos,
                                               q_rope_out=q_out[..., :8], k_rope_out=k_out[..., :8],
                                               q_nope_out=q_out[..., 8:], k_nope_out=k_out[..., 8:])
        return tuple(t.view(torch.uint8) for t in a) + (q_out.view(torch.uint8), k_out.view(torch.uint8))

    _matches_eager(fn, q, k, cos_sin, pos)


@pytest.mark.parametrize("mla", [False, True])
def test_rope_quantize_fp8_append_and_layernorm_compile(mla):
    """The fused RoPE + fp8 + paged append (GQA HND cache, and MLA's pair) and layernorm under fullgraph
    compile: the eager q codes, cache bytes and normalised rows."""
    g = torch.Generator().manual_seed(12)
    q, k, cos_sin, pos = _rope_quantize_inputs(g, mla)
    v = None if mla else testing.randn((5, HK, 24), torch.float16, DEVICE, g)
    kv_indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    kv_indices = torch.tensor([3, 0, 2], dtype=torch.int32, device=DEVICE)
    batch_indices = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([2, 3, 4, 0, 1], dtype=torch.int32, device=DEVICE)
    shapes = [(4, PAGE, 16), (4, PAGE, 8)] if mla else [(4, HK, PAGE, 24)] * 2
    c0, c1 = (torch.zeros(s, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn) for s in shapes)
    x = testing.randn((3, 40), torch.bfloat16, DEVICE, g)
    gemma, beta = testing.randn((40,), torch.float32, DEVICE, g), testing.randn((40,), torch.float32, DEVICE, g)

    def fn(q, k, v, c0, c1, x):
        q_rope_out, q_nope_out = tritoninfer.rope.rope_quantize_fp8_append_paged_kv_cache(
            q[..., :8], k[..., :8], q[..., 8:], k[..., 8:], v, cos_sin, pos, (c0, c1), kv_indices, kv_indptr,
            batch_indices, positions, is_neox=True, quant_scale_kv=0.5, page_size=PAGE, kv_layout="HND")
        return q_rope_out.view(torch.uint8), q_nope_out.view(torch.uint8), tritoninfer.norm.layernorm(x, gemma, beta)

    _matches_eager(fn, q, k, v, c0, c1, x)


SAMPLING_CASES = {
    "softmax": lambda p, l, i, d, t: tritoninfer.sampling.softmax(l, 0.7),
    "sampling_from_probs": lambda p, l, i, d, t: tritoninfer.sampling.sampling_from_probs(p, i),
    "sampling_from_logits": lambda p, l, i, d, t: tritoninfer.sampling.sampling_from_logits(l),
    "top_p_sampling_from_probs": lambda p, l, i, d, t: tritoninfer.sampling.top_p_sampling_from_probs(p, 0.8),
    "top_k_sampling_from_probs": lambda p, l, i, d, t: tritoninfer.sampling.top_k_sampling_from_probs(p, 5),
    "min_p_sampling_from_probs": lambda p, l, i, d, t: tritoninfer.sampling.min_p_sampling_from_probs(p, 0.1),
    "top_k_top_p_sampling_from_probs":
        lambda p, l, i, d, t: tritoninfer.sampling.top_k_top_p_sampling_from_probs(p, 6, 0.9),
    "top_k_top_p_sampling_from_logits":
        lambda p, l, i, d, t: tritoninfer.sampling.top_k_top_p_sampling_from_logits(l, 6, 0.9),
    "top_p_renorm_probs": lambda p, l, i, d, t: tritoninfer.sampling.top_p_renorm_probs(p, 0.7),
    "top_k_renorm_probs": lambda p, l, i, d, t: tritoninfer.sampling.top_k_renorm_probs(p, 4),
    "top_k_mask_logits": lambda p, l, i, d, t: tritoninfer.sampling.top_k_mask_logits(l, 4),
    "chain_speculative_sampling": lambda p, l, i, d, t: tritoninfer.sampling.chain_speculative_sampling(d, i, t),
}


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_sampling_compiles(name):
    """FlashInfer's compile tests wrap the sampling functions too: each is one custom op around its
    kernel (its uniforms drawn in the traced code), and gives eager's result for the same seed."""
    g = torch.Generator().manual_seed(13)
    logits = testing.randn((3, 40), torch.float32, DEVICE, g)
    probs = torch.softmax(logits, -1)
    draft = torch.softmax(testing.randn((3, 2, 40), torch.float32, DEVICE, g), -1)
    target = torch.softmax(testing.randn((3, 3, 40), torch.float32, DEVICE, g), -1)
    ids = torch.tensor([[1, 7], [3, 3], [39, 0]], dtype=torch.int32, device=DEVICE)
    if name == "sampling_from_probs":
        ids = torch.tensor([2, 0, 0, 1], dtype=torch.int32, device=DEVICE)  # indices: rows shared
    fn = SAMPLING_CASES[name]
    torch.manual_seed(123)  # the default generator: eager and compiled calls draw the same uniforms
    want = fn(probs, logits, ids, draft, target)
    for backend in ["aot_eager"] + (["inductor"] if ON_GPU else []):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        torch.manual_seed(123)
        got = compiled(probs, logits, ids, draft, target)
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), backend
    # a second batch size: Dynamo recompiles with symbolic sizes (FlashInfer's tests call one compiled
    # function at many sizes); the uniforms' draw once failed there
    rows = 5 if name != "sampling_from_probs" else 3
    more = [torch.cat([t, t[:rows - 3]]) for t in (probs, logits, draft, target)]
    ids5 = torch.cat([ids, ids[:rows - 3]]) if name != "sampling_from_probs" else ids
    torch.manual_seed(123)
    want = fn(more[0], more[1], ids5, more[2], more[3])
    torch.manual_seed(123)
    got = compiled(more[0], more[1], ids5, more[2], more[3])
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), "second batch size"


def test_sparse_wrappers_compile():
    """The block-sparse wrappers' run() under fullgraph compile (``tritoninfer::sparse_run``; fp8 queries
    with per-head scales and an fp32 output): the eager result."""
    from tritoninfer import sparse

    torch._dynamo.reset()
    assert hasattr(torch.ops.tritoninfer, "sparse_run")
    g = torch.Generator().manual_seed(5)
    fp8 = torch.float8_e4m3fn
    q = testing.randn((8, HQ, D), torch.float16, DEVICE, g).to(fp8)
    k = testing.randn((8, HK, D), torch.float16, DEVICE, g).to(fp8)
    v = testing.randn((8, HK, D), torch.float16, DEVICE, g).to(fp8)
    sq, sk, sv = (torch.rand(n, generator=g).to(DEVICE) + 0.5 for n in (HQ, HK, HK))
    bsr = sparse.BlockSparseAttentionWrapper(testing.make_workspace(8 << 20, DEVICE))
    bsr.plan(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([1, 0, 1], dtype=torch.int32), 8, 8, 4, 4,
             HQ, HK, D, causal=True, q_data_type=fp8, kv_data_type=fp8, o_data_type=torch.float32)
    var = sparse.VariableBlockSparseAttentionWrapper(testing.make_workspace(8 << 20, DEVICE))
    var.plan(torch.tensor([[[True, False], [True, True]]] * HK), torch.tensor([[3, 5]] * HK, dtype=torch.int32),
             torch.tensor([[2, 6]] * HK, dtype=torch.int32), HQ, HK, D)
    qh = testing.randn((HQ, 8, D), torch.float16, DEVICE, g)
    kh, vh = (testing.randn((HK, 8, D), torch.float16, DEVICE, g) for _ in range(2))

    def both(q, k, v, qh, kh, vh):
        o1, lse1 = bsr.run(q, k, v, sq, sk, sv, return_lse=True)
        return o1, lse1, var.run(qh, kh, vh)

    o1, lse1, o2 = torch.compile(both, fullgraph=True, backend="aot_eager")(q, k, v, qh, kh, vh)
    o1_ref, lse1_ref = bsr.run(q, k, v, sq, sk, sv, return_lse=True)
    assert o1.dtype == torch.float32
    testing.assert_close(o1, o1_ref, tol=0.0)
    testing.assert_lse_close(lse1, lse1_ref, atol=0.0, rtol=0.0)
    testing.assert_close(o2, var.run(qh, kh, vh), torch.float16, tol=0.0)


def test_mla_wrapper_run_compiles():
    """The MLA wrapper's run() under fullgraph compile: one op (tritoninfer::mla_run), the eager result."""
    from tritoninfer.mla import BatchMLAPagedAttentionWrapper

    torch._dynamo.reset()
    heads, ps = 4, 4
    q_nope = torch.randn(3, heads, 32).half().to(DEVICE)
    q_pe = torch.randn(3, heads, 16).half().to(DEVICE)
    cache = torch.randn(6, ps, 48).half().to(DEVICE)
    ckv, kpe = cache[..., :32], cache[..., 32:]
    qo_indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    kv_indptr = torch.tensor([0, 3, 5], dtype=torch.int32, device=DEVICE)
    kv_indices = torch.tensor([5, 0, 2, 1, 4], dtype=torch.int32, device=DEVICE)
    kv_len = torch.tensor([10, 6], dtype=torch.int32, device=DEVICE)
    w = BatchMLAPagedAttentionWrapper(testing.make_workspace(8 << 20, DEVICE))
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, 32, 16, ps, True, 0.2, torch.float16, torch.float16)
    assert hasattr(torch.ops.tritoninfer, "mla_run")
    o, lse = torch.compile(lambda a, b, c, d: w.run(a, b, c, d, return_lse=True), fullgraph=True,
                           backend="aot_eager")(q_nope, q_pe, ckv, kpe)
    o_ref, lse_ref = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    testing.assert_close(o, o_ref, torch.float16, tol=0.0)
    testing.assert_lse_close(lse, lse_ref, atol=0.0, rtol=0.0)
