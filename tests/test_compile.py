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
