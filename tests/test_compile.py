"""``torch.compile(fullgraph=True)`` over tritoninfer's ops (``tritoninfer/_ops.py``): a small decoder
layer compiles without graph breaks and gives the eager result; a re-plan needs no recompilation.
On the CPU with the ``aot_eager`` backend (the custom ops then run their kernels through the
interpreter); on the GPU with the default backend too."""

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
    for name in ("rmsnorm", "fused_add_rmsnorm", "act_and_mul", "rope", "rope_inplace", "wrapper_run"):
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
