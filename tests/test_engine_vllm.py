"""Replay of how vLLM's v1 FlashInfer attention backend drives FlashInfer, call for call, on tritoninfer.

Written from reading ``vllm/v1/attention/backends/flashinfer.py`` (vllm-project/vllm, the late-2025
version built against FlashInfer 0.4/0.5: ``FlashInferMetadataBuilder``, ``FlashInferImpl`` and
its module-level ``fast_plan_decode``) and ``vllm/utils/flashinfer.py``. The mini builder below is
not vLLM's code: it makes the same FlashInfer calls with the same arguments on the same kind of
buffers:

- a per-layer cache ``[num_blocks, 2, block_size, H_kv, D]`` whose memory is NHD or HND (vLLM's
  ``get_kv_cache_stride_order``), passed to FlashInfer as ``kv_cache.permute(*stride_order)``;
  fp8 caches are uint8 storage viewed as fp8;
- persistent device buffers ``paged_kv_indptr``/``paged_kv_indices``/``paged_kv_last_page_len``
  and their pinned CPU twins; the decode wrapper always ``use_tensor_cores=True``; one zeroed
  float workspace shared by the prefill, decode (one per CUDA-graph batch size) and cascade
  wrappers;
- the prefill wrapper planned with CPU ``qo_indptr`` / ``paged_kv_indptr`` (the latter *not*
  rebased when decodes come first), ``causal=True`` and ``fixed_split_size``/``disable_split_kv``
  (``-1``/``False``, or ``4096``/``True`` in batch-invariant mode);
- decode planned by vLLM's ``fast_plan_decode``: the first call (and every call without CUDA
  graphs) is ``wrapper.plan(...)`` with *positional* arguments; later calls on a CUDA-graph wrapper
  copy indptr/last_page_len into ``_paged_kv_indptr_buf``/``_paged_kv_last_page_len_buf`` and call
  ``wrapper._cached_module.plan(...)`` with FlashInfer's 18 positional module arguments, then write
  ``_pos_encoding_mode``, ``_window_left``, ``_logits_soft_cap``, ``_sm_scale``, ``_rope_scale``,
  ``_rope_theta``;
- ``FlashInferImpl.forward`` asserts ``_causal``, ``_window_left``, ``_logits_soft_cap ==
  (logits_soft_cap or 0.0)`` and ``_sm_scale`` on the wrappers, then ``run(q, kv, k_scale=,
  v_scale=, out=output[...])``.

Outputs are checked against :mod:`tritoninfer.reference` on the same inputs. Full CUDA graphs: on
the CPU the same calls without capture (a replay calls the captured function again), on the GPU
(``gpu`` marker) real ``torch.cuda.CUDAGraph`` capture and replay.
"""

from __future__ import annotations

import dataclasses
import types
from typing import List, Optional

import numpy as np
import pytest
import torch

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer._compat import uninstall_flashinfer

from conftest import DEVICE

FP8_STR = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

@pytest.fixture
def fi():
    # force=True: on the GPU runner another test may already have imported the real flashinfer
    tritoninfer.install_as_flashinfer(force=True)
    try:
        # vllm/v1/attention/backends/flashinfer.py, at import time
        from flashinfer import (
            BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
            MultiLevelCascadeAttentionWrapper,
        )
        from flashinfer.decode import _get_range_buf, trtllm_batch_decode_with_kv_cache
        from flashinfer.prefill import trtllm_batch_context_with_kv_cache
        from flashinfer.utils import FP4Tensor

        yield types.SimpleNamespace(
            BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
            MultiLevelCascadeAttentionWrapper=MultiLevelCascadeAttentionWrapper,
            _get_range_buf=_get_range_buf,
            trtllm_batch_decode_with_kv_cache=trtllm_batch_decode_with_kv_cache,
            trtllm_batch_context_with_kv_cache=trtllm_batch_context_with_kv_cache,
            FP4Tensor=FP4Tensor,
        )
    finally:
        uninstall_flashinfer()


# --------------------------------------------------------------------------------------------------
# configuration, KV cache, requests
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class VConfig:
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float16  # model dtype
    cache_dtype: str = "auto"  # "auto" or "fp8"/"fp8_e4m3"/"fp8_e5m2"
    block_size: int = 16
    max_num_reqs: int = 8
    max_model_len: int = 96
    layout: str = "NHD"  # vLLM's get_kv_cache_layout()
    batch_invariant: bool = False  # vllm_is_batch_invariant()
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    k_scale: float = 1.0  # layer._k_scale_float
    v_scale: float = 1.0
    full_cuda_graph: bool = False  # cudagraph_mode.decode_mode() == FULL
    cudagraph_capture_sizes: tuple = (1, 2, 4)
    num_layers: int = 2
    device: str = DEVICE

    @property
    def stride_order(self):
        return (0, 1, 2, 3, 4) if self.layout == "NHD" else (0, 1, 3, 2, 4)

    @property
    def kv_torch_dtype(self):
        return FP8_STR.get(self.cache_dtype, self.dtype)


class Model:
    """KV caches per layer, a block pool, request block tables, and the layers' parameters."""

    def __init__(self, cfg: VConfig, seed=0):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size)
        self.num_blocks = cfg.max_num_reqs * self.max_blocks + 1
        shape = (self.num_blocks, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        phys_shape = tuple(shape[i] for i in cfg.stride_order)
        store = torch.uint8 if cfg.cache_dtype.startswith("fp8") else cfg.dtype
        inv = tuple(int(i) for i in np.argsort(cfg.stride_order))
        # vLLM allocates the memory in stride order and hands the layers the logical view
        self.kv_caches = [torch.zeros(phys_shape, dtype=store, device=cfg.device).permute(*inv)
                          for _ in range(cfg.num_layers)]
        perm = (torch.randperm(self.num_blocks - 1, generator=self.gen) + 1).view(cfg.max_num_reqs, self.max_blocks)
        self.req_blocks = perm.to(torch.int32)  # block 0 is never handed out (vLLM's null block)
        self.scale = cfg.head_dim ** -0.5

    def rand(self, *shape):
        return testing.randn(shape, self.cfg.dtype, self.cfg.device, generator=self.gen)

    def slots(self, req: int, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        bs = self.cfg.block_size
        return (self.req_blocks[req][pos // bs].long() * bs + pos % bs).to(self.cfg.device)

    def reshape_and_cache_flash(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        """What vLLM's cache op writes (fp8: key / k_scale cast to fp8, stored as bytes)."""
        bs = self.cfg.block_size
        blocks, offs = slot_mapping // bs, slot_mapping % bs
        if self.cfg.cache_dtype.startswith("fp8"):
            fp8 = self.cfg.kv_torch_dtype
            key = (key.float() / k_scale).to(fp8).view(torch.uint8)
            value = (value.float() / v_scale).to(fp8).view(torch.uint8)
        key_cache[blocks, offs] = key
        value_cache[blocks, offs] = value

    def fill_history(self, reqs: List[int], lens: List[int]):
        for r, n in zip(reqs, lens):
            slots = self.slots(r, 0, n)
            for kv in self.kv_caches:
                k = self.rand(n, self.cfg.num_kv_heads, self.cfg.head_dim)
                v = self.rand(n, self.cfg.num_kv_heads, self.cfg.head_dim)
                self.reshape_and_cache_flash(k, v, kv[:, 0], kv[:, 1], slots, self.cfg.k_scale, self.cfg.v_scale)

    def flashinfer_cache(self, layer: int):
        kv = self.kv_caches[layer]
        if self.cfg.cache_dtype.startswith("fp8"):
            kv = kv.view(self.cfg.kv_torch_dtype)
        return kv.permute(*self.cfg.stride_order)


@dataclasses.dataclass
class CommonAttentionMetadata:
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


def common_metadata(model: Model, reqs: List[int], query_lens: List[int], seq_lens: List[int], pad_to=None):
    """Batch of requests (decodes first): query tokens are the last query_len positions of each."""
    cfg = model.cfg
    n = len(reqs)
    rows = pad_to or n
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    sl = torch.zeros(rows, dtype=torch.int32)
    sl[:n] = torch.tensor(seq_lens, dtype=torch.int32)
    bt = torch.zeros(rows, model.max_blocks, dtype=torch.int32)
    bt[:n] = model.req_blocks[reqs]
    slots = torch.cat([model.slots(r, s - q, s) for r, q, s in zip(reqs, query_lens, seq_lens)])
    return CommonAttentionMetadata(qsl, sl.to(cfg.device), sl[:n].clone() if pad_to is None else sl, n,
                                   int(qsl[-1]), max(query_lens), max(seq_lens), bt.to(cfg.device), slots)


def split_decodes_and_prefills(cm: CommonAttentionMetadata, decode_threshold=1):
    q = cm.query_start_loc_cpu
    lens = (q[1:] - q[:-1]).tolist()
    num_decodes = next((i for i, x in enumerate(lens) if x > decode_threshold), len(lens))
    num_decode_tokens = int(q[num_decodes])
    return num_decodes, cm.num_reqs - num_decodes, num_decode_tokens, cm.num_actual_tokens - num_decode_tokens


# --------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------


def fast_plan_decode(self, indptr_cpu, indices, last_page_len_cpu, seq_lens_cpu, num_qo_heads, num_kv_heads,
                     head_dim, page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
                     q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                     rope_theta=None, non_blocking=True, fixed_split_size=-1, disable_split_kv=False, *, fi):
    """vLLM's fast_plan_decode: the same FlashInfer calls, in the same order."""
    if not self.is_cuda_graph_enabled or getattr(self, "vllm_first_call", True):
        self.plan(indptr_cpu, indices, last_page_len_cpu, num_qo_heads, num_kv_heads, head_dim, page_size,
                  pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale,
                  rope_scale, rope_theta, non_blocking, None, None, fixed_split_size, disable_split_kv)
        self.vllm_first_call = False
        return
    assert self.is_cuda_graph_enabled
    batch_size = len(last_page_len_cpu)
    if logits_soft_cap is None:
        logits_soft_cap = 0.0
    if batch_size != self._fixed_batch_size:
        raise ValueError("batch size mismatch")
    if len(indices) > len(self._paged_kv_indices_buf):
        raise ValueError("indices too large")
    self._paged_kv_indptr_buf.copy_(indptr_cpu, non_blocking=True)
    self._paged_kv_last_page_len_buf.copy_(last_page_len_cpu, non_blocking=True)
    qo_indptr_host = fi._get_range_buf(batch_size + 1, "cpu")
    self._plan_info = self._cached_module.plan(
        self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer,
        qo_indptr_host, indptr_cpu, seq_lens_cpu, batch_size, batch_size, num_qo_heads, num_kv_heads, page_size,
        self.is_cuda_graph_enabled, head_dim, head_dim, False, window_left, fixed_split_size, disable_split_kv,
    )
    self._pos_encoding_mode = pos_encoding_mode
    self._window_left = window_left
    self._logits_soft_cap = logits_soft_cap
    self._sm_scale = sm_scale
    self._rope_scale = rope_scale
    self._rope_theta = rope_theta


@dataclasses.dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    q_data_type: torch.dtype
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    use_cascade: bool
    prefill_wrapper: object = None
    decode_wrapper: object = None
    cascade_wrapper: object = None


class FlashInferMetadataBuilder:
    def __init__(self, fi, model: Model, workspace_size=16 << 20):
        cfg = model.cfg
        self.fi, self.model, self.cfg = fi, model, cfg
        self.workspace_size = workspace_size
        self._workspace_buffer = self._prefill_wrapper = self._decode_wrapper = self._cascade_wrapper = None
        if cfg.batch_invariant:
            self.decode_fixed_split_size, self.prefill_fixed_split_size, self.disable_split_kv = 2048, 4096, True
        else:
            self.decode_fixed_split_size, self.prefill_fixed_split_size, self.disable_split_kv = -1, -1, False
        max_num_pages = cfg.max_num_reqs * model.max_blocks
        self.enable_cuda_graph = cfg.full_cuda_graph
        if self.enable_cuda_graph:
            self._decode_wrappers_cudagraph = {}
            self._decode_cudagraph_max_bs = min(cfg.max_num_reqs, max(cfg.cudagraph_capture_sizes))
        self.num_qo_heads, self.num_kv_heads, self.head_dim = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        self.page_size = cfg.block_size
        self.cache_dtype = cfg.cache_dtype
        self.kv_cache_dtype = cfg.kv_torch_dtype
        self.q_data_type = cfg.dtype  # can_use_trtllm_attention() is False off SM100
        # global hyperparameters (every layer the same)
        self.sm_scale = model.scale
        self.window_left = cfg.sliding_window - 1 if cfg.sliding_window is not None else -1
        self.logits_soft_cap = cfg.logits_soft_cap
        dev = cfg.device
        self.paged_kv_indptr = torch.zeros(cfg.max_num_reqs + 1, dtype=torch.int32, device=dev)
        self.paged_kv_indices = torch.zeros(max_num_pages, dtype=torch.int32, device=dev)
        self.paged_kv_last_page_len = torch.zeros(cfg.max_num_reqs, dtype=torch.int32, device=dev)
        pin = torch.cuda.is_available() and dev != "cpu"
        self.paged_kv_indptr_cpu = torch.zeros(cfg.max_num_reqs + 1, dtype=torch.int32, pin_memory=pin)
        self.paged_kv_indptr_np = self.paged_kv_indptr_cpu.numpy()
        self.paged_kv_indptr_buffer = torch.zeros_like(self.paged_kv_indptr_cpu, pin_memory=pin)
        self.paged_kv_last_page_len_cpu = torch.zeros(cfg.max_num_reqs, dtype=torch.int32, pin_memory=pin)
        self.paged_kv_last_page_len_np = self.paged_kv_last_page_len_cpu.numpy()

    def _get_workspace_buffer(self):
        if self._workspace_buffer is None:
            self._workspace_buffer = torch.zeros(self.workspace_size, dtype=torch.uint8, device=self.cfg.device)
        return self._workspace_buffer

    def _get_prefill_wrapper(self):
        if self._prefill_wrapper is None:
            self._prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(self._get_workspace_buffer(),
                                                                                self.cfg.layout)
        return self._prefill_wrapper

    def _get_decode_wrapper(self, batch_size, use_cudagraph=False):
        wrapper = self._decode_wrappers_cudagraph.get(batch_size) if use_cudagraph else self._decode_wrapper
        if wrapper is None:
            if use_cudagraph:
                indptr = self.paged_kv_indptr[: batch_size + 1]
                indices = self.paged_kv_indices
                last = self.paged_kv_last_page_len[:batch_size]
            else:
                indptr = indices = last = None
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self._get_workspace_buffer(), self.cfg.layout, use_cuda_graph=use_cudagraph,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last,
                use_tensor_cores=True)
            if use_cudagraph:
                self._decode_wrappers_cudagraph[batch_size] = wrapper
            else:
                self._decode_wrapper = wrapper
        return wrapper

    def _get_cascade_wrapper(self):
        if self._cascade_wrapper is None:
            self._cascade_wrapper = self.fi.MultiLevelCascadeAttentionWrapper(2, self._get_workspace_buffer(),
                                                                              self.cfg.layout)
        return self._cascade_wrapper

    def pad_for_cudagraph(self, n):
        return min(s for s in self.cfg.cudagraph_capture_sizes if s >= n)

    def build(self, common_prefix_len: int, cm: CommonAttentionMetadata) -> FlashInferMetadata:
        num_reqs = cm.num_reqs
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(cm)
        page_size = self.page_size
        seq_lens_cpu = cm.seq_lens_cpu
        seq_lens_np = seq_lens_cpu.numpy()[:num_reqs]
        block_table_tensor = cm.block_table_tensor
        num_blocks_np = (seq_lens_np + (page_size - 1)) // page_size
        use_cascade = common_prefix_len > 0
        if use_cascade:
            num_common_kv_blocks = common_prefix_len // page_size
            shared_qo_indptr_cpu = torch.tensor([0, cm.num_actual_tokens], dtype=torch.int32)
            shared_kv_page_indptr_cpu = torch.tensor([0, num_common_kv_blocks], dtype=torch.int32)
            shared_kv_page_indices_cpu = block_table_tensor[0, :num_common_kv_blocks]
            shared_kv_last_page_len_cpu = torch.tensor([page_size], dtype=torch.int32)
            block_table_tensor = block_table_tensor[:, num_common_kv_blocks:]
            num_blocks_np = num_blocks_np - num_common_kv_blocks
        np.cumsum(num_blocks_np, dtype=np.int32, out=self.paged_kv_indptr_np[1: num_reqs + 1])
        self.paged_kv_indptr_buffer[: num_reqs + 1] = self.paged_kv_indptr_cpu[: num_reqs + 1]
        paged_kv_indptr = self.paged_kv_indptr[: num_reqs + 1]
        paged_kv_indptr.copy_(self.paged_kv_indptr_buffer[: num_reqs + 1], non_blocking=True)
        num_actual_pages = int(self.paged_kv_indptr_np[num_reqs])
        paged_kv_indices = self.paged_kv_indices[:num_actual_pages]
        ind = self.paged_kv_indptr_np
        for i in range(num_reqs):  # vLLM's _copy_page_indices_kernel
            paged_kv_indices[ind[i]:ind[i + 1]] = block_table_tensor[i, : ind[i + 1] - ind[i]]
        last = seq_lens_np % page_size
        self.paged_kv_last_page_len_np[:num_reqs] = np.where(last == 0, page_size, last)

        md = FlashInferMetadata(cm.num_actual_tokens, self.q_data_type, cm.slot_mapping, num_decodes,
                                num_decode_tokens, num_prefills, num_prefill_tokens, use_cascade)
        qo_indptr_cpu = cm.query_start_loc_cpu
        paged_kv_indptr_cpu = self.paged_kv_indptr_cpu[: 1 + num_reqs]
        paged_kv_last_page_len_cpu = self.paged_kv_last_page_len_cpu[:num_reqs]
        common = dict(sm_scale=self.sm_scale, window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
                      q_data_type=self.q_data_type, kv_data_type=self.kv_cache_dtype)
        if use_cascade:
            md.cascade_wrapper = self._get_cascade_wrapper()
            md.cascade_wrapper.plan(
                [shared_qo_indptr_cpu, qo_indptr_cpu], [shared_kv_page_indptr_cpu, paged_kv_indptr_cpu],
                [shared_kv_page_indices_cpu, paged_kv_indices],
                [shared_kv_last_page_len_cpu, paged_kv_last_page_len_cpu], self.num_qo_heads, self.num_kv_heads,
                self.head_dim, self.page_size, causal=True, **common)
            return md
        if num_prefills > 0:
            prefill_start = num_decodes
            md.prefill_wrapper = self._get_prefill_wrapper()
            qo_indptr_cpu = qo_indptr_cpu[prefill_start:] - qo_indptr_cpu[prefill_start]
            paged_kv_indptr_cpu = paged_kv_indptr_cpu[prefill_start:]
            md.prefill_wrapper.plan(
                qo_indptr_cpu, paged_kv_indptr_cpu, paged_kv_indices, paged_kv_last_page_len_cpu[prefill_start:],
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, causal=True, **common,
                fixed_split_size=self.prefill_fixed_split_size, disable_split_kv=self.disable_split_kv)
        if num_decodes > 0:
            pure_decode = num_prefills == 0
            use_cudagraph = (self.enable_cuda_graph and pure_decode
                             and num_decode_tokens <= self._decode_cudagraph_max_bs)
            if use_cudagraph:
                num_input_tokens = self.pad_for_cudagraph(num_decode_tokens)
                self.paged_kv_indptr_cpu[1 + num_decodes: 1 + num_input_tokens].fill_(paged_kv_indptr_cpu[-1])
                self.paged_kv_last_page_len_cpu[num_decodes:num_input_tokens].fill_(1)
            else:
                num_input_tokens = num_decode_tokens
            md.decode_wrapper = self._get_decode_wrapper(num_input_tokens, use_cudagraph)
            fast_plan_decode(
                md.decode_wrapper, self.paged_kv_indptr_cpu[: num_input_tokens + 1], paged_kv_indices,
                self.paged_kv_last_page_len_cpu[:num_input_tokens], seq_lens_cpu[:num_input_tokens],
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, pos_encoding_mode="NONE",
                **common, fixed_split_size=self.decode_fixed_split_size, disable_split_kv=self.disable_split_kv,
                fi=self.fi)
        return md


class FlashInferImpl:
    def __init__(self, model: Model):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.scale = float(model.scale)
        self.window_left = cfg.sliding_window - 1 if cfg.sliding_window is not None else -1
        self.logits_soft_cap = cfg.logits_soft_cap
        self.kv_cache_dtype = cfg.cache_dtype

    def forward(self, layer_id, query, key, value, attn_metadata: FlashInferMetadata, output):
        cfg = self.cfg
        kv_cache = self.model.kv_caches[layer_id]
        if key is not None:  # the replays write the KV before the captured call
            self.model.reshape_and_cache_flash(key, value, kv_cache[:, 0], kv_cache[:, 1], attn_metadata.slot_mapping,
                                               cfg.k_scale, cfg.v_scale)
        if self.kv_cache_dtype.startswith("fp8"):
            kv_cache = kv_cache.view(FP8_STR[self.kv_cache_dtype])
        num_actual_tokens = attn_metadata.num_actual_tokens
        query = query[:num_actual_tokens]
        output_padded = output
        output = output[:num_actual_tokens]
        if attn_metadata.use_cascade:
            output.copy_(attn_metadata.cascade_wrapper.run(query, kv_cache))
            return output
        num_decode_tokens = attn_metadata.num_decode_tokens
        kv_cache_permute = kv_cache.permute(*cfg.stride_order)
        if attn_metadata.num_prefill_tokens > 0:
            prefill_wrapper = attn_metadata.prefill_wrapper
            prefill_query = query[num_decode_tokens:]
            assert prefill_wrapper._causal
            assert prefill_wrapper._window_left == self.window_left
            assert prefill_wrapper._logits_soft_cap == (self.logits_soft_cap or 0.0)
            assert prefill_wrapper._sm_scale == self.scale
            prefill_wrapper.run(prefill_query, kv_cache_permute, k_scale=cfg.k_scale, v_scale=cfg.v_scale,
                                out=output[num_decode_tokens:])
        if num_decode_tokens > 0:
            decode_wrapper = attn_metadata.decode_wrapper
            decode_query = query[:num_decode_tokens]
            assert decode_wrapper._window_left == self.window_left
            assert decode_wrapper._logits_soft_cap == (self.logits_soft_cap or 0.0)
            assert decode_wrapper._sm_scale == self.scale
            decode_wrapper.run(decode_query, kv_cache_permute, k_scale=cfg.k_scale, v_scale=cfg.v_scale,
                               out=output[:num_decode_tokens])
        return output_padded


# --------------------------------------------------------------------------------------------------
# reference and checks
# --------------------------------------------------------------------------------------------------


def reference_attention(model: Model, layer: int, q, reqs, query_lens, seq_lens):
    cfg = model.cfg
    indptr, indices, last = [0], [], []
    for r, n in zip(reqs, seq_lens):
        nb = -(-n // cfg.block_size)
        indices += model.req_blocks[r, :nb].tolist()
        indptr.append(indptr[-1] + nb)
        last.append((n - 1) % cfg.block_size + 1)
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=cfg.device)  # noqa: E731
    qo = torch.tensor([0] + np.cumsum(query_lens).tolist(), dtype=torch.int32)
    return reference.batch_prefill_with_paged_kv_cache(
        q, qo, model.flashinfer_cache(layer), t(indptr), t(indices), t(last), cfg.layout, causal=True,
        sm_scale=model.scale, window_left=(cfg.sliding_window - 1 if cfg.sliding_window else -1),
        logits_soft_cap=cfg.logits_soft_cap, k_scale=cfg.k_scale, v_scale=cfg.v_scale)[0]


def run_step(fi, model, builder, impl, reqs, query_lens, seq_lens, common_prefix_len=0):
    """One engine step on every layer: build metadata, write KV, attention; checked per layer."""
    cfg = model.cfg
    model.fill_history(reqs, [s - q for s, q in zip(seq_lens, query_lens)])
    cm = common_metadata(model, reqs, query_lens, seq_lens)
    md = builder.build(common_prefix_len, cm)
    n = cm.num_actual_tokens
    for layer in range(cfg.num_layers):
        q = model.rand(n + 3, cfg.num_qo_heads, cfg.head_dim)  # padded like vLLM's input buffers
        k = model.rand(n, cfg.num_kv_heads, cfg.head_dim)
        v = model.rand(n, cfg.num_kv_heads, cfg.head_dim)
        output = torch.full((n + 3, cfg.num_qo_heads, cfg.head_dim), float("nan"), dtype=cfg.dtype, device=cfg.device)
        impl.forward(layer, q, k, v, md, output)
        ref = reference_attention(model, layer, q[:n], reqs, query_lens, seq_lens)
        testing.assert_close(output[:n], ref, cfg.dtype, name=f"layer {layer}")
    return md


def _case(mode, **kw):
    cfg = VConfig(batch_invariant=(mode == "batch-invariant"), **kw)
    marks = []
    return cfg, marks


def _params(cases):
    out = []
    for name, (mode, kw) in cases.items():
        cfg, marks = _case(mode, **kw)
        out.append(pytest.param(cfg, id=name, marks=marks))
    return out


# --------------------------------------------------------------------------------------------------
# eager steps
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", _params({
    "batch-invariant-NHD": ("batch-invariant", dict()),
    "batch-invariant-HND-fp8": ("batch-invariant", dict(layout="HND", cache_dtype="fp8", dtype=torch.bfloat16,
                                                        k_scale=0.5, v_scale=0.25, block_size=4)),
    "default-NHD": ("default", dict()),
}))
def test_vllm_decode_eager(fi, cfg):
    """A pure-decode step without CUDA graphs: fast_plan_decode -> wrapper.plan(positional), run with out=."""
    model = Model(cfg)
    builder, impl = FlashInferMetadataBuilder(fi, model), FlashInferImpl(model)
    md = run_step(fi, model, builder, impl, [2, 0, 5, 1], [1, 1, 1, 1], [9, 1, 33, 16])
    assert md.decode_wrapper.use_tensor_cores and not md.decode_wrapper.is_cuda_graph_enabled
    # a second step re-plans the same wrapper
    run_step(fi, model, builder, impl, [3, 4], [1, 1], [50, 17])


@pytest.mark.parametrize("cfg", _params({
    "batch-invariant-HND-page4": ("batch-invariant", dict(layout="HND", block_size=4)),
    "batch-invariant-NHD-swa-softcap": ("batch-invariant", dict(sliding_window=8, logits_soft_cap=20.0,
                                                                dtype=torch.bfloat16)),
    "default-NHD": ("default", dict()),
}))
def test_vllm_prefill_eager(fi, cfg):
    """A pure-prefill step (chunked prefill: some requests already have context): the prefill
    wrapper is planned with CPU indptrs, causal=True, and run with out=output[num_decode_tokens:]."""
    model = Model(cfg)
    builder, impl = FlashInferMetadataBuilder(fi, model), FlashInferImpl(model)
    run_step(fi, model, builder, impl, [1, 6, 3], [5, 12, 2], [12, 12, 40])


def test_vllm_mixed_decode_prefill_batch(fi):
    """Decodes first, then prefills, in one step: the prefill plan gets paged_kv_indptr_cpu[num_decodes:]."""
    cfg = VConfig(batch_invariant=True, block_size=4)
    model = Model(cfg)
    builder, impl = FlashInferMetadataBuilder(fi, model), FlashInferImpl(model)
    run_step(fi, model, builder, impl, [4, 0, 2, 7], [1, 1, 6, 3], [13, 5, 6, 20])


# --------------------------------------------------------------------------------------------------
# full CUDA graphs for decode
# --------------------------------------------------------------------------------------------------


class Graph:
    """A captured function: a real torch.cuda.CUDAGraph on the GPU; on the CPU the function itself."""

    def __init__(self, fn, real: bool):
        self.real = real
        if real:
            fn()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()
            torch.cuda.synchronize()
        else:
            self.fn, self.out = fn, fn()

    def replay(self):
        if self.real:
            self.graph.replay()
            torch.cuda.synchronize()
            return self.out
        return self.fn()


def run_full_cuda_graph(fi, cfg: VConfig, steps, real_graph: bool):
    """vLLM with cudagraph_mode FULL for decode: a dummy batch per capture size (largest first:
    seq_lens 1, null block), the first fast_plan_decode call plans normally; each replay builds
    metadata for the real batch padded to a capture size (indptr flat and last_page_len 1 in the
    padding), fast_plan_decode goes through _cached_module.plan, and the graph replays."""
    model = Model(cfg)
    builder, impl = FlashInferMetadataBuilder(fi, model), FlashInferImpl(model)
    max_bs = max(cfg.cudagraph_capture_sizes)
    q_static = torch.zeros(max_bs, cfg.num_qo_heads, cfg.head_dim, dtype=cfg.dtype, device=cfg.device)
    out_static = [torch.zeros_like(q_static) for _ in range(cfg.num_layers)]  # each layer's output buffer
    graphs = {}
    for bs in sorted(cfg.cudagraph_capture_sizes, reverse=True):
        cm = common_metadata(model, [0] * bs, [1] * bs, [1] * bs)
        cm.block_table_tensor.zero_()
        md = builder.build(0, cm)
        wrapper = builder._decode_wrappers_cudagraph[bs]
        assert md.decode_wrapper is wrapper and wrapper.is_cuda_graph_enabled and wrapper.vllm_first_call is False

        def forward(md=md, bs=bs):
            return [impl.forward(layer, q_static[:bs], None, None, md, out_static[layer][:bs])
                    for layer in range(cfg.num_layers)]

        graphs[bs] = Graph(forward, real_graph)
    used = set()
    for step, (reqs, seq_lens) in enumerate(steps):
        n = len(reqs)
        bs = builder.pad_for_cudagraph(n)
        model.fill_history(reqs, seq_lens)
        cm = common_metadata(model, reqs, [1] * n, seq_lens, pad_to=bs)
        wrapper = builder._decode_wrappers_cudagraph[bs]
        step_before = wrapper._step
        md = builder.build(0, cm)
        # _cached_module.plan ran (a new step; its device plan may be the last one's, rewritten)
        assert md.decode_wrapper is wrapper and wrapper._step is not step_before
        assert wrapper._plan_info is wrapper._step.device_plan
        q = model.rand(n, cfg.num_qo_heads, cfg.head_dim)
        q_static.zero_()
        q_static[:n] = q
        outs = graphs[bs].replay()
        used.add(bs)
        for layer, out in enumerate(outs):
            ref = reference_attention(model, layer, q, reqs, [1] * n, seq_lens)
            testing.assert_close(out[:n], ref, cfg.dtype, name=f"step {step} (bs {n} padded to {bs}) layer {layer}")
    return used


CPU_GRAPH_STEPS = [([3, 1, 6], [17, 40, 2]), ([5], [70]), ([0, 2], [33, 1]), ([7, 4, 3, 2], [8, 66, 19, 31])]


@pytest.mark.parametrize("cfg", _params({
    "batch-invariant-NHD": ("batch-invariant", dict(full_cuda_graph=True)),
    "batch-invariant-HND-page4-softcap": ("batch-invariant", dict(full_cuda_graph=True, layout="HND", block_size=4,
                                                                 logits_soft_cap=15.0)),
    "default-NHD": ("default", dict(full_cuda_graph=True)),
}))
def test_vllm_decode_full_cuda_graph(fi, cfg):
    used = run_full_cuda_graph(fi, cfg, CPU_GRAPH_STEPS, real_graph=False)
    assert used == {1, 2, 4}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _params({
    "batch-invariant-bf16": ("batch-invariant", dict()),
    "batch-invariant-fp8-HND": ("batch-invariant", dict(cache_dtype="fp8", layout="HND", k_scale=0.5, v_scale=0.5)),
    "default-bf16": ("default", dict()),
}))
def test_gpu_vllm_decode_full_cuda_graph(fi, cfg):
    cfg = dataclasses.replace(cfg, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                              max_num_reqs=32, max_model_len=8192, full_cuda_graph=True,
                              cudagraph_capture_sizes=(1, 2, 4, 8, 16, 24, 32), device="cuda")
    g = torch.Generator().manual_seed(3)
    steps = []
    for n, max_len in ((3, 8000), (32, 500), (1, 8192), (17, 3000), (5, 16)):
        reqs = torch.randperm(cfg.max_num_reqs, generator=g)[:n].tolist()
        steps.append((reqs, torch.randint(1, max_len + 1, (n,), generator=g).tolist()))
    run_full_cuda_graph(fi, cfg, steps, real_graph=True)


# --------------------------------------------------------------------------------------------------
# cascade (vLLM keeps the path, but use_cascade_attention() currently returns False)
# --------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(tritoninfer.cascade, "MultiLevelCascadeAttentionWrapper"),
                    reason="tritoninfer.cascade has no MultiLevelCascadeAttentionWrapper yet")
def test_vllm_cascade_shared_prefix(fi):
    """Two-level cascade: the shared prefix blocks of request 0 as level 0, the rest per request."""
    cfg = VConfig(batch_invariant=True, block_size=4)
    model = Model(cfg)
    reqs = [1, 2, 5]
    model.req_blocks[reqs, :3] = model.req_blocks[1, :3]  # 3 shared blocks = 12 tokens
    builder, impl = FlashInferMetadataBuilder(fi, model), FlashInferImpl(model)
    run_step(fi, model, builder, impl, reqs, [2, 5, 1], [14, 20, 13], common_prefix_len=12)


# --------------------------------------------------------------------------------------------------
# what fails loudly
# --------------------------------------------------------------------------------------------------


def test_vllm_trtllm_paths_raise_not_implemented(fi):
    """The SM100 trtllm-gen paths vLLM can select are importable but raise when reached."""
    with pytest.raises(NotImplementedError, match="trtllm"):
        fi.trtllm_batch_decode_with_kv_cache(query=None, kv_cache=None, workspace_buffer=None)
    with pytest.raises(NotImplementedError, match="trtllm"):
        fi.trtllm_batch_context_with_kv_cache(query=None)
    with pytest.raises(NotImplementedError, match="FP4"):
        fi.FP4Tensor(data=None, scale=None)


def test_vllm_flashinfer_probes():
    """vllm/utils/flashinfer.py's probes: the package is found (find_spec needs a __spec__), the
    comm / fused_moe / cute_dsl submodules it probes are absent, so vLLM does not select them."""
    import importlib.util

    tritoninfer.install_as_flashinfer(force=True)
    try:
        assert importlib.util.find_spec("flashinfer") is not None
        for name in ("flashinfer.comm", "flashinfer.fused_moe", "flashinfer.cute_dsl"):
            assert importlib.util.find_spec(name) is None
        import flashinfer

        assert flashinfer.__version__ >= "0.2.3"  # vLLM's sampler version gate reads it
        # _lazy_import_wrapper("flashinfer", "fp4_quantize"): present, raises when called
        with pytest.raises(NotImplementedError):
            getattr(flashinfer, "fp4_quantize")(None)
        # autotune is a no-op scope (vLLM wraps warm-up in it)
        from flashinfer.autotuner import autotune

        with autotune():
            pass
    finally:
        uninstall_flashinfer()
