"""``flashinfer.attention`` (``BatchAttention``, ``BatchAttentionWithAttentionSinkWrapper``) and FlashInfer's
AttentionSink JIT variant on the prefill wrappers, against the reference."""

import math

import pytest
import torch
from conftest import DEVICE

from tritoninfer import reference, testing
from tritoninfer.attention import BatchAttention, BatchAttentionWithAttentionSinkWrapper
from tritoninfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

# the statements that define FlashInfer's fa2 AttentionSink variant (what _variants.py recognises),
# laid out as a variant declaration
SINK_DECL = """
struct AttentionSink : AttentionVariantBase {
  float sm_scale_log2 = 0;
  // closure
  sm_scale_log2 = params.sm_scale * math::log2e;
  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    return (kv_idx + qo_len + window_left >= kv_len + qo_idx);
  })
  REGISTER_M_D_UPDATE(params, kv_tile_idx, qo_head_idx, m, d, scale, {
    float log_sink = params.sink[qo_head_idx] * math::log2e;
    float d_new = math::ptx_exp2(log_sink - m_new) + d * scale;
  })
  REGISTER_OUTPUT_TRANSFORM(params, output, batch_idx, qo_idx, qo_head_idx, m, d, scale, {
    return output * scale * d_rcp;
  });
};
"""


def sink_jit_args(dtype, window_left, decl=SINK_DECL, name="AttentionSink"):
    short = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    return [f"batch_prefill_attention_sink_{short}_swa_{window_left >= 0}_fa2", dtype, dtype, dtype, torch.int32, 16, 16,
            ["sink"], ["float"], ["sm_scale"], ["double"], name, decl]


def _lse_with_sink(lse, sink):
    return torch.logaddexp2(lse, sink.float().cpu()[None, :] / math.log(2.0))


@pytest.mark.parametrize("causal,soft_cap,layout,v_scale", [(True, None, "NHD", None), (False, 3.0, "HND", 2.0)])
def test_batch_attention_matches_reference(causal, soft_cap, layout, v_scale):
    """A mixed batch: decode rows, a speculative request, a chunked prefill, an empty request."""
    g = torch.Generator().manual_seed(0)
    qo_lens, kv_lens = (1, 3, 7, 1, 0), (9, 20, 7, 1, 4)
    kv = testing.make_paged_kv(kv_lens, 4, 2, 16, layout=layout, device=DEVICE, generator=g)
    q_base, qo_indptr = testing.random_qo(qo_lens, 4, 32, torch.float16, DEVICE, g)
    q = q_base[..., :16]  # a strided query (FlashInfer's test takes half of a wider tensor)
    attn = BatchAttention(layout, device=DEVICE)
    attn.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, torch.tensor(kv_lens, dtype=torch.int32), 4, 2, 16, 16, 4,
              causal=causal, logits_soft_cap=soft_cap, q_data_type=torch.float16, kv_data_type=torch.float16)
    o, lse = attn.run(q, kv.cache, v_scale=v_scale, logits_soft_cap=soft_cap or 0.0)
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, layout, causal=causal,
        logits_soft_cap=soft_cap, v_scale=v_scale)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse, dtype=torch.float16)


def test_batch_attention_bad_inputs():
    attn = BatchAttention("NHD", device=DEVICE)
    with pytest.raises(ValueError, match="before plan"):
        attn.run(torch.zeros(1, 2, 16), torch.zeros(1, 2, 4, 1, 16))
    kv = testing.make_paged_kv((5,), 4, 1, 16, device=DEVICE)
    qo_indptr = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_len_arr"):
        attn.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, torch.tensor([9], dtype=torch.int32), 2, 1, 16, 16, 4)
    with pytest.raises(NotImplementedError, match="use_profiler"):
        attn.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, torch.tensor([5], dtype=torch.int32), 2, 1, 16, 16, 4,
                  use_profiler=True)
    attn.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, torch.tensor([5], dtype=torch.int32), 2, 1, 16, 16, 4,
              q_data_type=torch.float16, kv_data_type=torch.float16)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        attn.run(torch.zeros(1, 2, 16, dtype=torch.float16, device=DEVICE), kv.cache, logits_soft_cap=5.0)


@pytest.mark.parametrize("window_left,causal,dtype", [(-1, True, torch.float16), (3, False, torch.bfloat16),
                                                      (2, True, torch.float16)])
def test_attention_sink_variant_ragged_and_paged(window_left, causal, dtype):
    """FlashInfer's test_attention_sink flow: a ragged wrapper built with the AttentionSink jit_args and
    the sink wrapper over a page-size-1 cache, both run as ``run(q, kv..., sink, sm_scale)``."""
    g = torch.Generator().manual_seed(1)
    qo_lens, kv_lens = (3, 1, 5), (6, 4, 5)
    q, qo_indptr = testing.random_qo(qo_lens, 4, 16, dtype, DEVICE, g)
    k, kv_indptr = testing.make_ragged(kv_lens, 2, 16, dtype, DEVICE, g)
    v, _ = testing.make_ragged(kv_lens, 2, 16, dtype, DEVICE, g)
    sink = (torch.rand(4, generator=g) * 5).to(DEVICE)
    sm_scale = 0.3
    ws = testing.make_workspace(4 << 20, DEVICE)
    ragged = BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2", jit_args=sink_jit_args(dtype, window_left),
                                                  jit_kwargs={"use_sliding_window": window_left >= 0})
    ragged.plan(qo_indptr, kv_indptr, 4, 2, 16, causal=causal, window_left=window_left, q_data_type=dtype,
                kv_data_type=dtype)
    o, lse = ragged.run(q, k, v, sink, sm_scale, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, causal=causal,
                                                                  window_left=window_left, sm_scale=sm_scale,
                                                                  sinks=sink)
    testing.assert_close(o, ref_o, dtype)
    testing.assert_lse_close(lse, _lse_with_sink(ref_lse, sink), dtype=dtype)

    paged = BatchAttentionWithAttentionSinkWrapper(ws, "NHD", backend="fa2", q_data_type=dtype, kv_data_type=dtype,
                                                   head_dim_qk=16, head_dim_vo=16, window_left=window_left)
    pages = torch.randperm(2 * k.shape[0], generator=g)[:k.shape[0]].int()
    k_pool = testing.randn((2 * k.shape[0], 1, 2, 16), dtype, DEVICE, g)
    v_pool = testing.randn((2 * k.shape[0], 1, 2, 16), dtype, DEVICE, g)
    k_pool[pages.long()] = k[:, None]
    v_pool[pages.long()] = v[:, None]
    paged.plan(qo_indptr, kv_indptr, pages, torch.ones(3, dtype=torch.int32), 4, 2, 16, 1, causal=causal,
               window_left=window_left, q_data_type=dtype, kv_data_type=dtype)
    testing.assert_close(paged.run(q, (k_pool, v_pool), sink, sm_scale), ref_o, dtype)
    paged.plan(qo_indptr, kv_indptr, torch.arange(k.shape[0], dtype=torch.int32), torch.ones(3, dtype=torch.int32),
               4, 2, 16, 1, causal=causal, window_left=window_left, q_data_type=dtype, kv_data_type=dtype)
    testing.assert_close(paged.run(q, (k, v), sink, sm_scale), ref_o, dtype)  # the 3-D page-size-1 form


def test_other_jit_variants_raise():
    ws = testing.make_workspace(1 << 20, DEVICE)
    for args in (sink_jit_args(torch.float16, -1, decl="struct AttentionSink : AttentionVariantBase {};"),
                 sink_jit_args(torch.float16, -1, name="MyVariant"), ["custom_variant_uri"]):
        with pytest.raises(NotImplementedError, match="jit_args"):
            BatchPrefillWithRaggedKVCacheWrapper(ws, jit_args=args)
    ragged = BatchPrefillWithRaggedKVCacheWrapper(ws, jit_args=sink_jit_args(torch.float16, -1))
    ragged.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 2, 1, 16,
                q_data_type=torch.float16, window_left=4)
    q, k = torch.zeros(2, 2, 16, dtype=torch.float16, device=DEVICE), torch.zeros(3, 1, 16, dtype=torch.float16,
                                                                                  device=DEVICE)
    sink = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match="window_left"):  # the variant was declared without a window
        ragged.run(q, k, k, sink, 0.25)
    with pytest.raises(TypeError, match="sm_scale"):
        ragged.run(q, k, k, sink, torch.tensor(0.25))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_attention_gpu_realistic(dtype):
    g = torch.Generator().manual_seed(2)
    qo_lens = [1] * 100 + [17] * 8 + [512]
    kv_lens = [1024] * 100 + [8192] * 8 + [1024]
    kv = testing.make_paged_kv(kv_lens, 16, 8, 128, dtype=dtype, device="cuda", generator=g)
    q, qo_indptr = testing.random_qo(qo_lens, 32, 128, dtype, "cuda", g)
    attn = BatchAttention("NHD")
    attn.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, torch.tensor(kv_lens, dtype=torch.int32), 32, 8, 128, 128, 16,
              causal=True, q_data_type=dtype, kv_data_type=dtype)
    o, lse = attn.run(q, kv.cache)
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                 kv.kv_last_page_len, causal=True)
    testing.assert_close(o, ref_o, dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=dtype)


@pytest.mark.gpu
def test_attention_sink_gpu_realistic():
    dtype, window_left = torch.bfloat16, 127
    g = torch.Generator().manual_seed(3)
    kv = testing.make_paged_kv([600] * 16 + [4000], 16, 8, 64, dtype=dtype, device="cuda", generator=g)
    q, qo_indptr = testing.random_qo([1] * 16 + [256], 64, 64, dtype, "cuda", g)
    sink = (torch.rand(64, generator=g) * 5).cuda()
    w = BatchAttentionWithAttentionSinkWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                               q_data_type=dtype, kv_data_type=dtype, head_dim_qk=64, head_dim_vo=64,
                                               window_left=window_left)
    w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 64, 8, 64, 16, causal=True,
           window_left=window_left, q_data_type=dtype, kv_data_type=dtype)
    o = w.run(q, kv.cache, sink, 0.125)
    ref_o, _ = reference.batch_prefill_with_paged_kv_cache(q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                           kv.kv_last_page_len, causal=True, window_left=window_left,
                                                           sm_scale=0.125, sinks=sink)
    testing.assert_close(o, ref_o, dtype)


def test_sink_variant_declared_through_the_flashinfer_jit_names():
    """Under ``install_as_flashinfer()``, jit_args built as FlashInfer's test_attention_sink builds them
    (``flashinfer.jit.utils.filename_safe_dtype_map``, ``flashinfer.jit.attention.variants.
    attention_sink_decl``) run as the sinks path; the CUDA module builders refuse."""
    import tritoninfer
    from tritoninfer._compat import uninstall_flashinfer

    tritoninfer.install_as_flashinfer(force=True)
    try:
        import flashinfer
        from flashinfer.jit.attention import gen_batch_prefill_attention_sink_module
        from flashinfer.jit.attention.variants import attention_sink_decl
        from flashinfer.jit.utils import filename_safe_dtype_map

        with pytest.raises(NotImplementedError, match="CUDA JIT"):
            gen_batch_prefill_attention_sink_module()
        g = torch.Generator().manual_seed(2)
        dtype, window_left = torch.bfloat16, 2
        q, qo_indptr = testing.random_qo((2, 3), 4, 16, dtype, DEVICE, g)
        k, kv_indptr = testing.make_ragged((2, 5), 2, 16, dtype, DEVICE, g)
        v, _ = testing.make_ragged((2, 5), 2, 16, dtype, DEVICE, g)
        sink = (torch.rand(4, generator=g) * 3).to(DEVICE)
        for backend in ("fa2", "fa3"):
            jit_args = (f"batch_prefill_attention_sink_{filename_safe_dtype_map[dtype]}_swa_True_{backend}", dtype,
                        dtype, dtype, torch.int32, 16, 16, ["sink"], ["float"], ["sm_scale"], ["double"],
                        "AttentionSink", attention_sink_decl[backend])
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                testing.make_workspace(1 << 20, DEVICE), "NHD", backend=backend, jit_args=jit_args,
                jit_kwargs={"use_sliding_window": True})
            wrapper.plan(qo_indptr, kv_indptr, 4, 2, 16, causal=True, window_left=window_left, q_data_type=dtype,
                         kv_data_type=dtype)
            out = wrapper.run(q, k, v, sink, 0.25)
            ref = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, causal=True,
                                                               window_left=window_left, sm_scale=0.25, sinks=sink)[0]
            testing.assert_close(out, ref, dtype)
    finally:
        uninstall_flashinfer()
