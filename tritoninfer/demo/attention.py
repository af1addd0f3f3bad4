"""The attention of the serving loop, per architecture: which cache, which wrappers, how a step is
planned and how a layer appends its KV and attends. The engine's scheduling, padding, CUDA graphs,
overlap and sampling are the same for both.

- :class:`GQAAttention` (Llama, Qwen2, Mistral): a paged K/V cache, ``BatchPrefillWithPagedKVCacheWrapper``
  (causal) for prefill, ``BatchDecodeWithPagedKVCacheWrapper`` for decode, ``append_paged_kv_cache``.
- :class:`MLAAttention` (DeepSeek): a paged latent cache and ``BatchMLAPagedAttentionWrapper`` for both:
  prefill is causal with each prompt's tokens as the request's query rows (``qo_indptr``), decode
  one row per request; ``append_paged_mla_kv_cache`` writes the latents.

Plans take host arrays: ``kv_indptr`` (pages), ``last_page_len`` and, for prefill, ``qo_indptr``;
``kv_indices`` may be a device tensor (the CUDA-graph runner's own fixed buffer).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper
from tritoninfer.mla import BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache
from tritoninfer.page import append_paged_kv_cache
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper

from .kv_cache import PagedKVCache, PagedMLACache

__all__ = ["GQAAttention", "MLAAttention", "attention_for"]


def attention_for(model, use_tensor_cores: bool = False):
    """The backend of ``model`` (its ``arch``: "deepseek" is MLA, anything else GQA)."""
    if getattr(model, "arch", "llama") == "deepseek":
        return MLAAttention(model)
    return GQAAttention(model, use_tensor_cores)


class _Timed:
    """Calls ``fn`` between ``timer.start()`` and ``timer.stop()`` (no timer: just calls it)."""

    @staticmethod
    def call(timer, fn, *args, **kwargs):
        if timer is None:
            return fn(*args, **kwargs)
        timer.start()
        out = fn(*args, **kwargs)
        timer.stop()
        return out


class GQAAttention:
    def __init__(self, model, use_tensor_cores: bool = False) -> None:
        self.model, self.mc, self.use_tensor_cores = model, model.cfg, use_tensor_cores

    def make_cache(self, num_pages: int, page_size: int, kv_dtype: torch.dtype, device) -> PagedKVCache:
        mc = self.mc
        return PagedKVCache(mc.num_layers, num_pages, page_size, mc.num_kv_heads, mc.head_dim, kv_dtype, device)

    def prefill_wrapper(self, workspace):
        return BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def decode_wrapper(self, workspace):
        return BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=self.use_tensor_cores)

    def graph_wrapper(self, workspace, bucket: int, indptr, indices, last_page_len):
        return BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len)

    def plan_prefill(self, wrapper, cache, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices,
                     last_page_len: np.ndarray) -> None:
        mc = self.mc
        wrapper.plan(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), kv_indices,
                     torch.from_numpy(last_page_len), mc.num_heads, mc.num_kv_heads, mc.head_dim, cache.page_size,
                     causal=True, window_left=mc.window_left, q_data_type=self.model.attn_dtype,
                     kv_data_type=cache.dtype)

    def plan_decode(self, wrapper, cache, kv_indptr: np.ndarray, kv_indices, last_page_len: np.ndarray) -> None:
        mc = self.mc
        wrapper.plan(torch.from_numpy(kv_indptr), kv_indices, torch.from_numpy(last_page_len), mc.num_heads,
                     mc.num_kv_heads, mc.head_dim, cache.page_size, window_left=mc.window_left,
                     q_data_type=self.model.attn_dtype, kv_data_type=cache.dtype)

    def layer_fn(self, wrapper, cache, batch_indices, positions, kv_indices, kv_indptr, last_page_len,
                 timer=None, calibrate: bool = False) -> Callable:
        """The model's ``attention(layer, q, k, v)``: append K/V (quantised for fp8), then attend."""
        def attention(layer, q, k, v):
            if calibrate:
                cache.calibrate(layer, k, v)
            kq, vq = cache.quantize(layer, k, v)
            append_paged_kv_cache(kq, vq, batch_indices, positions, cache.layer(layer), kv_indices, kv_indptr,
                                  last_page_len)
            ks, vs = cache.scales(layer)
            return _Timed.call(timer, wrapper.run, q, cache.layer(layer), k_scale=ks, v_scale=vs)

        return attention

    def timing_body(self, wrapper, cache, bucket: int, device) -> Callable[[], None]:
        """The layers' ``run()`` calls alone on dummy queries (the cache is only read)."""
        mc = self.mc
        q = torch.randn(bucket, mc.num_heads, mc.head_dim, device=device).to(self.model.attn_dtype)
        o = torch.empty_like(q)

        def body():
            for layer in range(mc.num_layers):
                ks, vs = cache.scales(layer)
                wrapper.run(q, cache.layer(layer), k_scale=ks, v_scale=vs, out=o)

        return body


class MLAAttention:
    def __init__(self, model) -> None:
        self.model, self.mc = model, model.cfg

    def make_cache(self, num_pages: int, page_size: int, kv_dtype: torch.dtype, device) -> PagedMLACache:
        mc = self.mc
        return PagedMLACache(mc.num_layers, num_pages, page_size, mc.kv_lora_rank, mc.qk_rope_head_dim, kv_dtype,
                             device)

    def prefill_wrapper(self, workspace):
        return BatchMLAPagedAttentionWrapper(workspace)

    decode_wrapper = prefill_wrapper

    def graph_wrapper(self, workspace, bucket: int, indptr, indices, last_page_len):
        # qo_indptr is [0, 1, ..., bucket] for every decode step; kv_len_arr is written by each plan
        device = indptr.device
        return BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, qo_indptr=torch.arange(bucket + 1, dtype=torch.int32, device=device),
            kv_indptr=indptr, kv_indices=indices, kv_len_arr=torch.zeros(bucket, dtype=torch.int32, device=device))

    def _plan(self, wrapper, cache, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices,
              last_page_len: np.ndarray, causal: bool) -> None:
        mc, ps = self.mc, cache.page_size
        pages = np.diff(kv_indptr)
        kv_len = np.where(pages > 0, (pages - 1) * ps + last_page_len, 0).astype(np.int32)
        wrapper.plan(torch.from_numpy(qo_indptr), torch.from_numpy(kv_indptr), kv_indices, torch.from_numpy(kv_len),
                     mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim, ps, causal, mc.sm_scale,
                     self.model.attn_dtype, cache.dtype)

    def plan_prefill(self, wrapper, cache, qo_indptr, kv_indptr, kv_indices, last_page_len) -> None:
        self._plan(wrapper, cache, qo_indptr, kv_indptr, kv_indices, last_page_len, causal=True)

    def plan_decode(self, wrapper, cache, kv_indptr, kv_indices, last_page_len) -> None:
        qo = np.arange(len(last_page_len) + 1, dtype=np.int32)
        self._plan(wrapper, cache, qo, kv_indptr, kv_indices, last_page_len, causal=False)

    def layer_fn(self, wrapper, cache, batch_indices, positions, kv_indices, kv_indptr, last_page_len,
                 timer=None, calibrate: bool = False) -> Callable:
        """The model's ``attention(layer, q_nope_absorbed, q_pe, ckv, kpe)``: append the latents, then
        MLA over the layer's latent cache (``P·ckv`` per head)."""
        def attention(layer, q_nope, q_pe, ckv, kpe):
            append_paged_mla_kv_cache(ckv.to(cache.dtype), kpe.to(cache.dtype), batch_indices, positions,
                                      cache.ckv(layer), cache.kpe(layer), kv_indices, kv_indptr, last_page_len)
            return _Timed.call(timer, wrapper.run, q_nope, q_pe, cache.ckv(layer), cache.kpe(layer))

        return attention

    def timing_body(self, wrapper, cache, bucket: int, device) -> Callable[[], None]:
        mc, dt = self.mc, self.model.attn_dtype
        q_nope = torch.randn(bucket, mc.num_heads, mc.kv_lora_rank, device=device).to(dt)
        q_pe = torch.randn(bucket, mc.num_heads, mc.qk_rope_head_dim, device=device).to(dt)
        o = torch.empty_like(q_nope)

        def body():
            for layer in range(mc.num_layers):
                wrapper.run(q_nope, q_pe, cache.ckv(layer), cache.kpe(layer), out=o)

        return body
