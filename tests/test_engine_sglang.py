"""Replay of how SGLang's FlashInfer attention backend drives FlashInfer, call for call, on tritoninfer.

Written from reading ``python/sglang/srt/layers/attention/flashinfer_backend.py`` (sgl-project/sglang,
the version with ``init_forward_metadata_capture_cuda_graph`` / ``..._replay_cuda_graph``, late 2025,
and the 2026 refactor that only adds ``backend="fa2"`` to the wrapper constructors):
``FlashInferAttnBackend``, ``FlashInferIndicesUpdaterDecode``/``Prefill`` and
``FlashInferMultiStepDraftBackend``. The mini backend below is not SGLang's code: it makes the same
FlashInfer calls with the same arguments (positional and keyword as SGLang passes them), on the
same kind of buffers:

- page size 1 and a KV pool per layer as a tuple of 3-D ``[slots, H_kv, D]`` tensors (fp8 pools
  are uint8 storage viewed as fp8, as SGLang's ``MHATokenToKVPool`` does);
- one float workspace shared by every wrapper; ``kv_indptr``/``qo_indptr``/``kv_last_page_len``
  buffers shared by all wrappers, CUDA-graph wrappers taking prefix views of them;
- decode ``begin_forward(..., data_type=kv_dtype, q_data_type=q_dtype, non_blocking=True,
  fixed_split_size=..., disable_split_kv=...)`` then per layer ``forward(q, kv, sm_scale=,
  logits_soft_cap=, k_scale=, v_scale=)``; after capture ``begin_forward`` is replaced by
  ``functools.partial(fast_decode_plan, wrapper)`` and gets ``global_override_indptr_cpu``;
- extend: ragged attention over the new tokens (``forward_return_lse``, causal) plus paged
  attention over the cached prefix (``forward_return_lse``, non causal) merged with
  ``flashinfer.cascade.merge_state``;
- target verify with a tree ``custom_mask`` through CUDA-graph prefill wrappers (``custom_mask_buf``,
  ``mask_indptr_buf``);
- the EAGLE multi-step draft backend: several decode wrappers planned from one ``.cpu()`` copy of
  all steps' indptr, through ``fast_decode_plan(..., global_override_indptr_cpu=row)``.

Every output is checked against :mod:`tritoninfer.reference` on the same inputs. On the CPU the
CUDA-graph tests make the same calls without capturing (a "replay" calls the captured function
again); the ``gpu`` tests capture and replay real ``torch.cuda.CUDAGraph`` s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import List, Optional

import pytest
import torch

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer._compat import uninstall_flashinfer

from conftest import DEVICE

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------------------------------
# the flashinfer names SGLang imports, through install_as_flashinfer()
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fi():
    # force=True: on the GPU runner another test may already have imported the real flashinfer
    tritoninfer.install_as_flashinfer(force=True)
    try:
        # flashinfer_backend.py, at import time
        from flashinfer import (
            BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
            BatchPrefillWithRaggedKVCacheWrapper,
            fast_decode_plan,
        )
        from flashinfer.cascade import merge_state

        yield types.SimpleNamespace(
            BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
            BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
            fast_decode_plan=fast_decode_plan,
            merge_state=merge_state,
        )
    finally:
        uninstall_flashinfer()


def should_use_tensor_core(kv_cache_dtype, num_attention_heads, num_kv_heads):
    """SGLang's heuristic, including its probe of a FlashInfer <= 0.1.6 private helper, which must
    be absent (ImportError) so that the heuristic is used."""
    try:
        from flashinfer.decode import _grouped_size_compiled_for_decode_kernels  # noqa: F401

        raise AssertionError("flashinfer.decode must not provide _grouped_size_compiled_for_decode_kernels")
    except (ImportError, AttributeError):
        pass
    group = num_attention_heads // num_kv_heads
    if kv_cache_dtype in FP8:
        return True
    return group >= 4


# --------------------------------------------------------------------------------------------------
# a model runner: config, request -> token slots, a KV pool per layer
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float16  # model (q) dtype
    kv_cache_dtype: torch.dtype = torch.float16
    num_layers: int = 2
    sliding_window_size: Optional[int] = None  # SGLang's sliding_window_size (window - 1)
    max_reqs: int = 8
    max_context_len: int = 96
    k_scale: Optional[float] = None  # fp8 calibration scales (layer.k_scale_float)
    v_scale: Optional[float] = None
    device: str = DEVICE


@dataclasses.dataclass
class Layer:
    layer_id: int
    scaling: float
    logit_cap: float = 0.0
    sliding_window_size: int = -1
    k_scale_float: Optional[float] = None
    v_scale_float: Optional[float] = None


class ModelRunner:
    """req_to_token (request, position) -> KV slot, slots shuffled; a (k, v) pool per layer."""

    def __init__(self, cfg: Config, seed: int = 0):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.num_slots = cfg.max_reqs * cfg.max_context_len + 1
        perm = torch.randperm(self.num_slots - 1, generator=self.gen) + 1  # slot 0: SGLang's padding slot
        self.req_to_token = perm.view(cfg.max_reqs, cfg.max_context_len).to(torch.int32).to(cfg.device)
        store = torch.uint8 if cfg.kv_cache_dtype in FP8 else cfg.kv_cache_dtype
        shape = (self.num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.k_store = [torch.zeros(shape, dtype=store, device=cfg.device) for _ in range(cfg.num_layers)]
        self.v_store = [torch.zeros(shape, dtype=store, device=cfg.device) for _ in range(cfg.num_layers)]
        scaling = cfg.head_dim ** -0.5
        self.layers = [
            Layer(i, scaling, sliding_window_size=(cfg.sliding_window_size if (cfg.sliding_window_size is not None
                                                                              and i % 2 == 0) else -1),
                  k_scale_float=cfg.k_scale, v_scale_float=cfg.v_scale)
            for i in range(cfg.num_layers)
        ]

    def get_kv_buffer(self, layer_id):
        k, v = self.k_store[layer_id], self.v_store[layer_id]
        if self.cfg.kv_cache_dtype in FP8:
            return k.view(self.cfg.kv_cache_dtype), v.view(self.cfg.kv_cache_dtype)
        return k, v

    def set_kv_buffer(self, layer: Layer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        kd = self.cfg.kv_cache_dtype
        if kd in FP8:
            ks = 1.0 if layer.k_scale_float is None else layer.k_scale_float
            vs = 1.0 if layer.v_scale_float is None else layer.v_scale_float
            k = (k.float() / ks).to(kd).view(torch.uint8)
            v = (v.float() / vs).to(kd).view(torch.uint8)
        else:
            k, v = k.to(kd), v.to(kd)
        self.k_store[layer.layer_id][loc.long()] = k
        self.v_store[layer.layer_id][loc.long()] = v

    def rand(self, *shape, dtype=None):
        return testing.randn(shape, dtype or self.cfg.dtype, self.cfg.device, generator=self.gen)

    def fill_history(self, req_pool_indices: List[int], lens: List[int]):
        """KV for positions [0, len) of each request, in every layer."""
        for r, n in zip(req_pool_indices, lens):
            loc = self.req_to_token[r, :n]
            for layer in self.layers:
                self.set_kv_buffer(layer, loc, self.rand(n, self.cfg.num_kv_heads, self.cfg.head_dim),
                                   self.rand(n, self.cfg.num_kv_heads, self.cfg.head_dim))


def create_flashinfer_kv_indices(req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr, kv_start_idx,
                                 kv_indices):
    """What SGLang's ``create_flashinfer_kv_indices_triton`` kernel writes."""
    ind = kv_indptr.tolist()
    for i, (r, n) in enumerate(zip(req_pool_indices.tolist(), paged_kernel_lens.tolist())):
        start = 0 if kv_start_idx is None else int(kv_start_idx[i])
        kv_indices[ind[i]:ind[i] + n] = req_to_token[r, start:start + n]


class Globals:
    """flashinfer_backend.py's module globals."""

    global_workspace_buffer = None
    global_override_indptr_cpu = None


# --------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------


class FlashInferAttnBackend:
    def __init__(self, fi, runner: ModelRunner, g: Globals, skip_prefill=False, kv_indptr_buf=None,
                 kv_last_page_len_buf=None, new_api=False, workspace_size=16 << 20):
        cfg = runner.cfg
        self.fi, self.runner, self.g, self.cfg = fi, runner, g, cfg
        self.decode_use_tensor_cores = should_use_tensor_core(cfg.kv_cache_dtype, cfg.num_qo_heads, cfg.num_kv_heads)
        self.max_context_len = cfg.max_context_len
        self.skip_prefill = skip_prefill
        self.num_wrappers = 2 if cfg.sliding_window_size is not None else 1
        # 2026 refactor: backend="fa2" on the paged/decode wrappers
        self.backend_kw = dict(backend="fa2") if new_api else {}
        if g.global_workspace_buffer is None:
            g.global_workspace_buffer = torch.empty(workspace_size, dtype=torch.uint8, device=cfg.device)
        self.workspace_buffer = g.global_workspace_buffer
        max_bs = cfg.max_reqs
        dev = cfg.device
        if kv_indptr_buf is None:
            self.kv_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32, device=dev) for _ in range(self.num_wrappers)]
        else:
            self.kv_indptr = [kv_indptr_buf]
        if kv_last_page_len_buf is None:
            self.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32, device=dev)
        else:
            self.kv_last_page_len = kv_last_page_len_buf
        if not skip_prefill:
            self.qo_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32, device=dev) for _ in range(self.num_wrappers)]
        fmha_backend = "auto"
        self.prefill_wrapper_ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace_buffer, "NHD",
                                                                             backend=fmha_backend)
        self.prefill_wrappers_paged, self.prefill_wrappers_verify, self.decode_wrappers = [], [], []
        for _ in range(self.num_wrappers):
            if not skip_prefill:
                self.prefill_wrappers_paged.append(
                    fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD", backend="fa2"))
                self.prefill_wrappers_verify.append(
                    fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace_buffer, "NHD", **self.backend_kw))
            self.decode_wrappers.append(
                fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace_buffer, "NHD", **self.backend_kw,
                                                      use_tensor_cores=self.decode_use_tensor_cores))
        self.decode_cuda_graph_metadata = {}
        self.prefill_cuda_graph_metadata = {}
        self.forward_metadata = None
        self.fast_plan_calls = 0  # not SGLang's: lets the tests check which plan path ran

    # -- metadata ------------------------------------------------------------------------------

    def init_forward_metadata_decode(self, req_pool_indices, seq_lens, seq_lens_cpu, spec_info=None):
        self.update_decode(req_pool_indices, seq_lens, seq_lens_cpu, int(seq_lens_cpu.sum()), self.decode_wrappers,
                           spec_info, fixed_split_size=None, disable_split_kv=False)
        self.forward_metadata = ("decode", self.decode_wrappers)

    def init_forward_metadata_extend(self, req_pool_indices, seq_lens, prefix_lens, use_ragged=True):
        prefix_lens_cpu = prefix_lens.cpu()
        extend_no_prefix = not any(prefix_lens_cpu.tolist())
        self.update_prefill(req_pool_indices, seq_lens, int(seq_lens.sum()), prefix_lens,
                            self.prefill_wrappers_paged, use_ragged, spec_info=None)
        self.forward_metadata = ("extend", self.prefill_wrappers_paged, use_ragged, extend_no_prefix)

    def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None):
        dev = self.cfg.device
        if kv_indices_buf is None:
            cuda_graph_kv_indices = torch.zeros((max_num_tokens * self.max_context_len,), dtype=torch.int32, device=dev)
        else:
            cuda_graph_kv_indices = kv_indices_buf
        self.cuda_graph_kv_indices = [cuda_graph_kv_indices] + [
            cuda_graph_kv_indices.clone() for _ in range(self.num_wrappers - 1)]
        if not self.skip_prefill:
            self.cuda_graph_custom_mask = torch.zeros((max_num_tokens * self.max_context_len), dtype=torch.uint8,
                                                      device=dev)
            self.cuda_graph_qk_indptr = [x.clone() for x in self.kv_indptr]
            self.cuda_graph_qo_indptr = [x.clone() for x in self.kv_indptr]

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, mode,
                                                 spec_info=None):
        fi = self.fi
        if mode == "decode":
            decode_wrappers = [
                fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace_buffer, "NHD", **self.backend_kw, use_cuda_graph=True,
                    use_tensor_cores=self.decode_use_tensor_cores,
                    paged_kv_indptr_buffer=self.kv_indptr[i][: num_tokens + 1],
                    paged_kv_indices_buffer=self.cuda_graph_kv_indices[i],
                    paged_kv_last_page_len_buffer=self.kv_last_page_len[:num_tokens],
                )
                for i in range(self.num_wrappers)
            ]
            seq_lens_sum = seq_lens.sum().item()
            self.update_decode(req_pool_indices, seq_lens, seq_lens.cpu(), seq_lens_sum, decode_wrappers, spec_info,
                               fixed_split_size=None, disable_split_kv=False)
            self.decode_cuda_graph_metadata[bs] = decode_wrappers
            self.forward_metadata = ("decode", decode_wrappers)
            for w in decode_wrappers:
                w.begin_forward = functools.partial(fi.fast_decode_plan, w)
        elif mode == "target_verify":
            prefill_wrappers = [
                fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace_buffer, "NHD", use_cuda_graph=True,
                    qo_indptr_buf=self.cuda_graph_qo_indptr[i][: bs + 1],
                    paged_kv_indptr_buf=self.kv_indptr[i][: bs + 1],
                    paged_kv_indices_buf=self.cuda_graph_kv_indices[i],
                    paged_kv_last_page_len_buf=self.kv_last_page_len[:bs],
                    custom_mask_buf=self.cuda_graph_custom_mask,
                    mask_indptr_buf=self.cuda_graph_qk_indptr[i][: bs + 1],
                )
                for i in range(self.num_wrappers)
            ]
            self.update_prefill(req_pool_indices, seq_lens, seq_lens.sum().item(), None, prefill_wrappers, False,
                                spec_info)
            self.prefill_cuda_graph_metadata[bs] = prefill_wrappers
            self.forward_metadata = ("extend", prefill_wrappers, False, False)
        else:
            raise ValueError(mode)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, mode,
                                                spec_info=None, seq_lens_cpu=None):
        if mode == "decode":
            self.update_decode(req_pool_indices[:bs], seq_lens[:bs],
                               seq_lens_cpu[:bs] if seq_lens_cpu is not None else None, seq_lens_sum,
                               self.decode_cuda_graph_metadata[bs], spec_info, fixed_split_size=None,
                               disable_split_kv=False)
            self.forward_metadata = ("decode", self.decode_cuda_graph_metadata[bs])
        elif mode == "target_verify":
            self.update_prefill(req_pool_indices[:bs], seq_lens[:bs], seq_lens_sum, None,
                                self.prefill_cuda_graph_metadata[bs], False, spec_info)
            self.forward_metadata = ("extend", self.prefill_cuda_graph_metadata[bs], False, False)
        else:
            raise ValueError(mode)

    # -- FlashInferIndicesUpdaterDecode ----------------------------------------------------------

    def update_decode(self, req_pool_indices, seq_lens, seq_lens_cpu, seq_lens_sum, decode_wrappers, spec_info,
                      fixed_split_size=None, disable_split_kv=None):
        if self.num_wrappers == 1:
            self.call_begin_forward_decode(decode_wrappers[0], req_pool_indices, seq_lens, seq_lens_sum,
                                           self.kv_indptr[0], None, spec_info, seq_lens_cpu,
                                           fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)
            return
        window = self.cfg.sliding_window_size
        for wrapper_id in range(2):
            if wrapper_id == 0:  # sliding window attention: the last window+1 tokens
                lens_tmp = torch.clamp(seq_lens, max=window + 1)
                lens_cpu_tmp = torch.clamp(seq_lens_cpu, max=window + 1) if seq_lens_cpu is not None else None
                lens_sum_tmp = (lens_cpu_tmp if lens_cpu_tmp is not None else lens_tmp).sum().item()
                kv_start_idx = seq_lens - lens_tmp
            else:
                lens_tmp, lens_sum_tmp, lens_cpu_tmp, kv_start_idx = seq_lens, seq_lens_sum, seq_lens_cpu, None
            self.call_begin_forward_decode(decode_wrappers[wrapper_id], req_pool_indices, lens_tmp, lens_sum_tmp,
                                           self.kv_indptr[wrapper_id], kv_start_idx, spec_info,
                                           seq_lens_cpu=lens_cpu_tmp, fixed_split_size=fixed_split_size,
                                           disable_split_kv=disable_split_kv)

    def call_begin_forward_decode(self, wrapper, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum,
                                  kv_indptr, kv_start_idx, spec_info, seq_lens_cpu, fixed_split_size=None,
                                  disable_split_kv=None):
        cfg = self.cfg
        if spec_info is None or getattr(spec_info, "kv_indptr", None) is None:
            bs = len(req_pool_indices)
            kv_indptr[1: bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
            kv_indptr = kv_indptr[: bs + 1]
            if wrapper.is_cuda_graph_enabled:
                kv_indices = wrapper._paged_kv_indices_buf  # SGLang writes the graph's buffer directly
            else:
                kv_indices = torch.empty(paged_kernel_lens_sum, dtype=torch.int32, device=cfg.device)
            create_flashinfer_kv_indices(self.runner.req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr,
                                         kv_start_idx, kv_indices)
        else:
            kv_indptr, kv_indices = spec_info.kv_indptr, spec_info.kv_indices
            bs = kv_indptr.shape[0] - 1
        g = self.g
        locally_override = False
        if seq_lens_cpu is not None and g.global_override_indptr_cpu is None:
            locally_override = True
            g.global_override_indptr_cpu = torch.empty_like(kv_indptr, device="cpu")
            g.global_override_indptr_cpu[0] = 0
            g.global_override_indptr_cpu[1: bs + 1] = torch.cumsum(seq_lens_cpu, dim=0)
        uses_fast = hasattr(wrapper.begin_forward, "func") and wrapper.begin_forward.func == self.fi.fast_decode_plan
        common = dict(data_type=cfg.kv_cache_dtype, q_data_type=cfg.dtype, non_blocking=True,
                      fixed_split_size=fixed_split_size,
                      disable_split_kv=(disable_split_kv if disable_split_kv is not None else False))
        if uses_fast:
            self.fast_plan_calls += 1
            wrapper.begin_forward(kv_indptr, kv_indices, self.kv_last_page_len[:bs], cfg.num_qo_heads,
                                  cfg.num_kv_heads, cfg.head_dim, 1, **common,
                                  global_override_indptr_cpu=g.global_override_indptr_cpu)
        else:
            wrapper.begin_forward(kv_indptr, kv_indices, self.kv_last_page_len[:bs], cfg.num_qo_heads,
                                  cfg.num_kv_heads, cfg.head_dim, 1, **common)
        if locally_override:
            g.global_override_indptr_cpu = None

    # -- FlashInferIndicesUpdaterPrefill (single wrapper) ----------------------------------------

    def update_prefill(self, req_pool_indices, seq_lens, seq_lens_sum, prefix_lens, prefill_wrappers, use_ragged,
                       spec_info, fixed_split_size=None):
        if use_ragged:
            paged_kernel_lens = prefix_lens
            paged_kernel_lens_sum = paged_kernel_lens.sum().item()
        else:
            paged_kernel_lens, paged_kernel_lens_sum = seq_lens, seq_lens_sum
        self.call_begin_forward_prefill(self.prefill_wrapper_ragged, prefill_wrappers[0], req_pool_indices,
                                        paged_kernel_lens, paged_kernel_lens_sum, seq_lens, prefix_lens, None,
                                        self.kv_indptr[0], self.qo_indptr[0], use_ragged, spec_info,
                                        fixed_split_size=fixed_split_size)

    def call_begin_forward_prefill(self, wrapper_ragged, wrapper_paged, req_pool_indices, paged_kernel_lens,
                                   paged_kernel_lens_sum, seq_lens, prefix_lens, kv_start_idx, kv_indptr, qo_indptr,
                                   use_ragged, spec_info, fixed_split_size=None):
        cfg = self.cfg
        bs = len(seq_lens)
        if spec_info is None:
            kv_indptr[1: bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)
            kv_indptr = kv_indptr[: bs + 1]
            kv_indices = torch.empty(paged_kernel_lens_sum + 256, dtype=torch.int32, device=req_pool_indices.device)
            create_flashinfer_kv_indices(self.runner.req_to_token, req_pool_indices, paged_kernel_lens, kv_indptr,
                                         kv_start_idx, kv_indices)
            qo_indptr[1: bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)
            qo_indptr = qo_indptr[: bs + 1]
            custom_mask = None
        else:
            kv_indices, kv_indptr, qo_indptr, custom_mask = spec_info.generate_attn_arg_prefill(
                req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, self.runner.req_to_token)
        if use_ragged:
            wrapper_ragged.begin_forward(qo_indptr, qo_indptr, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                                         q_data_type=cfg.dtype)
        wrapper_paged.begin_forward(
            qo_indptr, kv_indptr, kv_indices, self.kv_last_page_len[:bs], cfg.num_qo_heads, cfg.num_kv_heads,
            cfg.head_dim, 1, q_data_type=cfg.dtype, kv_data_type=cfg.kv_cache_dtype, custom_mask=custom_mask,
            non_blocking=True, fixed_split_size=fixed_split_size, prefix_len_ptr=None, token_pos_in_items_ptr=None,
            token_pos_in_items_len=0, max_item_len_ptr=None,
        )

    # -- forward ------------------------------------------------------------------------------------

    def _wrapper_idx(self, layer: Layer) -> int:
        if self.num_wrappers == 1:
            return 0
        return int(layer.sliding_window_size == -1)

    def forward_decode(self, q, k, v, layer: Layer, cache_loc):
        cfg = self.cfg
        decode_wrapper = self.forward_metadata[1][self._wrapper_idx(layer)]
        if k is not None:
            self.runner.set_kv_buffer(layer, cache_loc, k, v)
        o = decode_wrapper.forward(
            q.contiguous().view(-1, cfg.num_qo_heads, cfg.head_dim), self.runner.get_kv_buffer(layer.layer_id),
            sm_scale=layer.scaling, logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float,
            v_scale=layer.v_scale_float,
        )
        return o.view(-1, cfg.num_qo_heads * cfg.head_dim)

    def forward_extend(self, q, k, v, layer: Layer, cache_loc):
        cfg = self.cfg
        _, prefill_wrappers, use_ragged, extend_no_prefix = self.forward_metadata
        prefill_wrapper_paged = prefill_wrappers[self._wrapper_idx(layer)]
        q = q.contiguous()
        H, Hk, D = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
        kv = self.runner.get_kv_buffer(layer.layer_id)
        if not use_ragged:
            if k is not None:
                self.runner.set_kv_buffer(layer, cache_loc, k, v)
            o = prefill_wrapper_paged.forward(
                q.view(-1, H, D), kv, causal=True, sm_scale=layer.scaling, window_left=layer.sliding_window_size,
                logits_soft_cap=layer.logit_cap, k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)
        else:
            if extend_no_prefix:
                o = self.prefill_wrapper_ragged.forward(
                    q.view(-1, H, D), k.view(-1, Hk, D), v.view(-1, Hk, D), causal=True, sm_scale=layer.scaling,
                    logits_soft_cap=layer.logit_cap)
            else:
                o1, s1 = self.prefill_wrapper_ragged.forward_return_lse(
                    q.view(-1, H, D), k.view(-1, Hk, D), v.view(-1, Hk, D), causal=True, sm_scale=layer.scaling,
                    window_left=layer.sliding_window_size, logits_soft_cap=layer.logit_cap)
                o2, s2 = prefill_wrapper_paged.forward_return_lse(
                    q.view(-1, H, D), kv, causal=False, sm_scale=layer.scaling,
                    window_left=layer.sliding_window_size, logits_soft_cap=layer.logit_cap)
                o, _ = self.fi.merge_state(o1, s1, o2, s2)
            self.runner.set_kv_buffer(layer, cache_loc, k, v)
        return o.view(-1, H * D)


# --------------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------------


def page_table(runner: ModelRunner, req_pool_indices, lens, starts=None):
    """Page size 1 table of positions [start, start+len) of each request."""
    indptr, indices = [0], []
    for i, (r, n) in enumerate(zip(req_pool_indices, lens)):
        s = 0 if starts is None else starts[i]
        indices += runner.req_to_token[r, s:s + n].tolist()
        indptr.append(indptr[-1] + n)
    dev = runner.cfg.device
    i32 = dict(dtype=torch.int32, device=dev)
    return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.ones(len(lens), **i32)


def decode_reference(runner, layer, q, req_pool_indices, lens, window_left=-1):
    cfg = runner.cfg
    indptr, indices, last = page_table(runner, req_pool_indices, lens)
    q = q.view(-1, cfg.num_qo_heads, cfg.head_dim)
    return reference.batch_decode_with_paged_kv_cache(
        q, runner.get_kv_buffer(layer.layer_id), indptr, indices, last, "NHD", sm_scale=layer.scaling,
        window_left=window_left, k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)[0]


def prefill_reference(runner, layer, q, qo_lens, req_pool_indices, kv_lens, custom_mask=None):
    cfg = runner.cfg
    indptr, indices, last = page_table(runner, req_pool_indices, kv_lens)
    qo_indptr = torch.tensor([0] + list(_cumsum(qo_lens)), dtype=torch.int32)
    return reference.batch_prefill_with_paged_kv_cache(
        q.view(-1, cfg.num_qo_heads, cfg.head_dim), qo_indptr, runner.get_kv_buffer(layer.layer_id), indptr, indices,
        last, "NHD", causal=custom_mask is None, custom_mask=custom_mask, sm_scale=layer.scaling,
        k_scale=layer.k_scale_float, v_scale=layer.v_scale_float)[0]


def _cumsum(xs):
    t = 0
    for x in xs:
        t += x
        yield t


def check(out, ref, cfg: Config, name="out"):
    testing.assert_close(out.view(ref.shape), ref, cfg.dtype, name=name)


def i32(xs, device):
    return torch.tensor(xs, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------------
# eager decode and extend
# --------------------------------------------------------------------------------------------------

DECODE_CASES = {
    # name: (config kwargs, new_api)
    "gqa2-cudacore": (dict(num_qo_heads=4, num_kv_heads=2), False),
    "gqa4-tensorcore-fa2": (dict(num_qo_heads=8, num_kv_heads=2), True),
    "fp8-e4m3-scaled": (dict(dtype=torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0),
                        False),
    "sliding-window": (dict(sliding_window_size=6), True),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_sglang_decode_eager(fi, name):
    """init_forward_metadata (decode) + forward_decode on every layer, with the new token's KV
    written first; the sliding-window case uses SGLang's two decode wrappers."""
    kwargs, new_api = DECODE_CASES[name]
    cfg = Config(**kwargs)
    runner = ModelRunner(cfg)
    backend = FlashInferAttnBackend(fi, runner, Globals(), new_api=new_api)
    assert backend.decode_wrappers[0].use_tensor_cores == backend.decode_use_tensor_cores
    reqs, lens = [3, 0, 5], [9, 1, 20]  # lens include the token being decoded
    runner.fill_history(reqs, [n - 1 for n in lens])
    rp, sl = i32(reqs, cfg.device), i32(lens, cfg.device)
    backend.init_forward_metadata_decode(rp, sl, sl.cpu())
    loc = torch.stack([runner.req_to_token[r, n - 1] for r, n in zip(reqs, lens)])
    for layer in runner.layers:
        q = runner.rand(len(reqs), cfg.num_qo_heads * cfg.head_dim)
        k = runner.rand(len(reqs), cfg.num_kv_heads, cfg.head_dim)
        v = runner.rand(len(reqs), cfg.num_kv_heads, cfg.head_dim)
        out = backend.forward_decode(q, k, v, layer, loc)
        w = layer.sliding_window_size  # the SWA wrapper sees only the last w+1 tokens
        check(out, decode_reference(runner, layer, q, reqs, lens, window_left=w), cfg, f"layer {layer.layer_id}")


@pytest.mark.parametrize("mode", ["ragged+paged-prefix", "ragged-no-prefix", "paged-only"])
def test_sglang_extend_chunked_prefill(fi, mode):
    """Extend (chunked prefill): ragged attention over the new tokens plus paged attention over the
    cached prefix, merged with merge_state; a request without prefix in the batch gets LSE -inf from
    the paged part. "paged-only" is SGLang's use_ragged=False path (deterministic/multimodal)."""
    cfg = Config(num_qo_heads=4, num_kv_heads=1, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16)
    runner = ModelRunner(cfg)
    backend = FlashInferAttnBackend(fi, runner, Globals())
    reqs = [1, 4, 2]
    prefix = [0, 0, 0] if mode == "ragged-no-prefix" else [7, 0, 19]
    extend = [5, 9, 3]
    seq = [p + e for p, e in zip(prefix, extend)]
    runner.fill_history(reqs, prefix)
    rp = i32(reqs, cfg.device)
    backend.init_forward_metadata_extend(rp, i32(seq, cfg.device), i32(prefix, cfg.device),
                                         use_ragged=(mode != "paged-only"))
    assert backend.forward_metadata[3] == (mode == "ragged-no-prefix")
    loc = torch.cat([runner.req_to_token[r, p:s] for r, p, s in zip(reqs, prefix, seq)])
    n = sum(extend)
    for layer in runner.layers:
        q = runner.rand(n, cfg.num_qo_heads * cfg.head_dim)
        k = runner.rand(n, cfg.num_kv_heads, cfg.head_dim)
        v = runner.rand(n, cfg.num_kv_heads, cfg.head_dim)
        out = backend.forward_extend(q, k, v, layer, loc)
        # after forward_extend the new tokens' KV are in the pool: causal attention over everything
        check(out, prefill_reference(runner, layer, q, extend, reqs, seq), cfg, f"layer {layer.layer_id}")


def test_sglang_ragged_wrapper_cutlass_backend_on_sm100(fi):
    """SGLang passes backend="cutlass" on SM100; it selects tritoninfer's kernels like every backend name."""
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE)
    assert fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="cutlass")._backend == "cutlass"


# --------------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------------


class Graph:
    """A captured function: on the GPU a real torch.cuda.CUDAGraph, on the CPU the function itself
    (the same calls, no capture). ``replay()`` returns the captured output."""

    def __init__(self, fn, real: bool):
        self.real = real
        if real:
            fn()  # warm up (compiles the Triton kernels), as SGLang runs the forward before capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = fn()
            torch.cuda.synchronize()
        else:
            self.fn = fn
            self.out = fn()

    def replay(self):
        if self.real:
            self.graph.replay()
            torch.cuda.synchronize()
            return self.out
        return self.fn()


def run_decode_cuda_graph(fi, cfg: Config, capture_bs, steps, real_graph: bool):
    """SGLang's CudaGraphRunner for decode: capture every batch size (largest first, seq_lens filled
    with get_cuda_graph_seq_len_fill_value() = 1, req_pool_indices 0), then for each step pad the
    batch to a captured size, re-plan with fast_decode_plan and replay."""
    runner = ModelRunner(cfg)
    backend = FlashInferAttnBackend(fi, runner, Globals())
    max_bs = max(capture_bs)
    backend.init_cuda_graph_state(max_bs, max_bs)
    dev = cfg.device
    # static inputs of the graphs
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
    req_pool_indices = torch.zeros(max_bs, dtype=torch.int32, device=dev)
    q_static = torch.zeros(max_bs, cfg.num_qo_heads * cfg.head_dim, dtype=cfg.dtype, device=dev)
    kv_pool = [runner.get_kv_buffer(layer.layer_id) for layer in runner.layers]
    graphs = {}
    for bs in sorted(capture_bs, reverse=True):
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, req_pool_indices[:bs], seq_lens[:bs], "decode")
        wrappers = backend.decode_cuda_graph_metadata[bs]
        assert all(isinstance(w.begin_forward, functools.partial) for w in wrappers)

        def forward(bs=bs):
            backend.forward_metadata = ("decode", backend.decode_cuda_graph_metadata[bs])
            return [backend.forward_decode(q_static[:bs], None, None, layer, None) for layer in runner.layers]

        graphs[bs] = Graph(forward, real_graph)
    assert all(kv[0].data_ptr() == runner.get_kv_buffer(i)[0].data_ptr() for i, kv in enumerate(kv_pool))

    used = set()
    for step, (reqs, lens) in enumerate(steps):
        raw_bs = len(reqs)
        bs = min(b for b in capture_bs if b >= raw_bs)
        runner.fill_history(reqs, lens)
        seq_lens.fill_(1)
        req_pool_indices.zero_()
        seq_lens[:raw_bs] = i32(lens, dev)
        req_pool_indices[:raw_bs] = i32(reqs, dev)
        seq_lens_cpu = seq_lens.cpu()
        seq_lens_sum = sum(lens) + (bs - raw_bs)
        calls = backend.fast_plan_calls
        backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum, "decode",
                                                        seq_lens_cpu=seq_lens_cpu)
        assert backend.fast_plan_calls == calls + backend.num_wrappers  # re-planned through fast_decode_plan
        q = runner.rand(raw_bs, cfg.num_qo_heads * cfg.head_dim)
        q_static.zero_()
        q_static[:raw_bs] = q
        outs = graphs[bs].replay()
        used.add(bs)
        for layer, out in zip(runner.layers, outs):
            window = layer.sliding_window_size
            ref = decode_reference(runner, layer, q, reqs, lens, window_left=window)
            check(out[:raw_bs], ref, cfg, f"step {step} (bs {raw_bs} padded to {bs}) layer {layer.layer_id}")
    return used


CPU_DECODE_STEPS = [
    ([2, 6, 1], [17, 3, 40]),  # padded to 4
    ([7], [55]),
    ([0, 3], [1, 70]),
    ([5, 4, 3, 2], [8, 66, 2, 31]),
]


@pytest.mark.parametrize("cfg_kw", [dict(), dict(num_qo_heads=8, num_kv_heads=1, sliding_window_size=9)],
                         ids=["gqa2", "gqa8-swa"])
def test_sglang_decode_cuda_graph_capture_replay(fi, cfg_kw):
    """Capture for batch sizes 4, 2, 1, then replay different batches after re-planning through
    fast_decode_plan with SGLang's CPU indptr (global_override_indptr_cpu)."""
    cfg = Config(**cfg_kw)
    used = run_decode_cuda_graph(fi, cfg, [1, 2, 4], CPU_DECODE_STEPS, real_graph=False)
    assert used == {1, 2, 4}


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_sglang_decode_cuda_graph_capture_replay(fi, kv_dtype):
    cfg = Config(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype,
                 max_reqs=32, max_context_len=4096, device="cuda",
                 k_scale=0.5 if kv_dtype in FP8 else None, v_scale=0.5 if kv_dtype in FP8 else None)
    g = torch.Generator().manual_seed(1)
    steps = []
    for raw_bs, max_len in ((3, 4000), (8, 300), (1, 4096), (16, 2000), (5, 17)):
        reqs = torch.randperm(cfg.max_reqs, generator=g)[:raw_bs].tolist()
        lens = torch.randint(1, max_len + 1, (raw_bs,), generator=g).tolist()
        steps.append((reqs, lens))
    used = run_decode_cuda_graph(fi, cfg, [1, 2, 4, 8, 16], steps, real_graph=True)
    assert {1, 4, 8, 16} <= used


# --------------------------------------------------------------------------------------------------
# target verify (EAGLE tree) with a custom mask, through CUDA-graph prefill wrappers
# --------------------------------------------------------------------------------------------------


class EagleVerifyInput:
    """spec_info of SGLang's target-verify step: draft_token_num tokens per request, tree mask."""

    def __init__(self, runner: ModelRunner, draft_token_num: int, seq_lens: List[int], seed: int):
        self.draft_token_num = draft_token_num
        g = torch.Generator().manual_seed(seed)
        masks = []
        for n in seq_lens:
            tree = torch.tril(torch.ones(draft_token_num, draft_token_num, dtype=torch.bool))
            # a tree, not a chain: drop some ancestor links (never the diagonal)
            drop = torch.rand(draft_token_num, draft_token_num, generator=g) < 0.3
            tree &= ~(drop & ~torch.eye(draft_token_num, dtype=torch.bool))
            masks.append(torch.cat([torch.ones(draft_token_num, n, dtype=torch.bool), tree], 1).reshape(-1))
        self.custom_mask = torch.cat(masks).to(runner.cfg.device)
        self.kv_indptr = None

    def generate_attn_arg_prefill(self, req_pool_indices, paged_kernel_lens, paged_kernel_lens_sum, req_to_token):
        bs = len(req_pool_indices)
        dev = req_pool_indices.device
        qo_indptr = torch.arange(0, (1 + bs) * self.draft_token_num, step=self.draft_token_num, dtype=torch.int32,
                                 device=dev)
        cum_kv_seq_len = torch.zeros((bs + 1,), dtype=torch.int32, device=dev)
        paged_kernel_lens = paged_kernel_lens + self.draft_token_num
        cum_kv_seq_len[1:] = torch.cumsum(paged_kernel_lens, dim=0)
        kv_indices = torch.empty(paged_kernel_lens_sum + self.draft_token_num * bs, dtype=torch.int32, device=dev)
        create_flashinfer_kv_indices(req_to_token, req_pool_indices, paged_kernel_lens, cum_kv_seq_len, None,
                                     kv_indices)
        return kv_indices, cum_kv_seq_len, qo_indptr, self.custom_mask


def test_sglang_target_verify_custom_mask_cuda_graph(fi):
    """Target verify: CUDA-graph paged prefill wrapper with custom_mask_buf/mask_indptr_buf, planned
    with a tree custom mask at capture, re-planned with other prefix lengths and masks before each
    replay (the tree mask overrides causal=True in forward)."""
    cfg = Config(num_qo_heads=4, num_kv_heads=2, dtype=torch.float16)
    runner = ModelRunner(cfg)
    backend = FlashInferAttnBackend(fi, runner, Globals())
    bs, draft = 2, 3
    backend.init_cuda_graph_state(4, 4 * draft)
    dev = cfg.device
    req_pool_indices = torch.zeros(bs, dtype=torch.int32, device=dev)
    seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
    q_static = torch.zeros(bs * draft, cfg.num_qo_heads * cfg.head_dim, dtype=cfg.dtype, device=dev)
    layer = runner.layers[0]
    runner.fill_history([0], [1 + draft])
    spec = EagleVerifyInput(runner, draft, [1, 1], seed=0)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * draft, req_pool_indices, seq_lens, "target_verify",
                                                     spec_info=spec)
    graph = Graph(lambda: backend.forward_extend(q_static, None, None, layer, None), real=False)
    for step, (reqs, lens) in enumerate((([3, 1], [11, 4]), ([6, 2], [30, 0]))):
        runner.fill_history(reqs, [n + draft for n in lens])  # prefix + the draft tokens' KV
        req_pool_indices.copy_(i32(reqs, dev))
        seq_lens.copy_(i32(lens, dev))
        spec = EagleVerifyInput(runner, draft, lens, seed=step + 1)
        backend.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, sum(lens), "target_verify",
                                                        spec_info=spec, seq_lens_cpu=seq_lens.cpu())
        q = runner.rand(bs * draft, cfg.num_qo_heads * cfg.head_dim)
        q_static.copy_(q)
        out = graph.replay()
        ref = prefill_reference(runner, layer, q, [draft] * bs, reqs, [n + draft for n in lens],
                                custom_mask=spec.custom_mask)
        check(out, ref, cfg, f"step {step}")


# --------------------------------------------------------------------------------------------------
# EAGLE multi-step draft decode: fast_decode_plan with one CPU copy of every step's indptr
# --------------------------------------------------------------------------------------------------


class FlashInferMultiStepDraftBackend:
    def __init__(self, fi, runner: ModelRunner, topk: int, speculative_num_steps: int):
        cfg = runner.cfg
        self.runner, self.topk, self.speculative_num_steps = runner, topk, speculative_num_steps
        self.g = Globals()
        max_bs = cfg.max_reqs * topk
        self.kv_indptr = torch.zeros((speculative_num_steps, max_bs + 1), dtype=torch.int32, device=cfg.device)
        self.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32, device=cfg.device)
        self.attn_backends = [
            FlashInferAttnBackend(fi, runner, self.g, skip_prefill=True, kv_indptr_buf=self.kv_indptr[i],
                                  kv_last_page_len_buf=self.kv_last_page_len)
            for i in range(speculative_num_steps - 1)
        ]
        self.max_context_len = self.attn_backends[0].max_context_len

    def generate_draft_decode_kv_indices(self, req_pool_indices, seq_lens, kv_indices_buffer, bs):
        """Step i attends to each request's prefix plus its first i+1 draft tokens (topk 1)."""
        for i in range(self.speculative_num_steps):
            lens = seq_lens + i + 1
            self.kv_indptr[i, 1: bs + 1] = torch.cumsum(lens, 0)
            create_flashinfer_kv_indices(self.runner.req_to_token, req_pool_indices, lens, self.kv_indptr[i, : bs + 1],
                                         None, kv_indices_buffer[i])

    def common_template(self, req_pool_indices, seq_lens, spec_info, kv_indices_buffer, call_fn):
        num_seqs = len(seq_lens)
        bs = self.topk * num_seqs
        self.generate_draft_decode_kv_indices(req_pool_indices, seq_lens, kv_indices_buffer, bs)
        # one device-to-host copy for all steps
        indptr_cpu_whole = self.kv_indptr[:, : bs + 1].cpu()
        for i in range(self.speculative_num_steps - 1):
            spec_info.kv_indptr = self.kv_indptr[i, : bs + 1]
            spec_info.kv_indices = kv_indices_buffer[i][: int(indptr_cpu_whole[i, bs])]
            self.g.global_override_indptr_cpu = indptr_cpu_whole[i]
            call_fn(i, spec_info)
        self.g.global_override_indptr_cpu = None

    def init_forward_metadata(self, req_pool_indices, seq_lens, spec_info):
        kv_indices = torch.empty((self.speculative_num_steps, len(seq_lens) * self.topk * self.max_context_len),
                                 dtype=torch.int32, device=self.runner.cfg.device)

        def call_fn(i, spec_info):
            spec_info.kv_indptr = spec_info.kv_indptr.clone()
            spec_info.kv_indices = spec_info.kv_indices.clone()
            self.attn_backends[i].init_forward_metadata_decode(req_pool_indices, seq_lens, seq_lens.cpu(), spec_info)

        self.common_template(req_pool_indices, seq_lens, spec_info, kv_indices, call_fn)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.cuda_graph_kv_indices = torch.zeros((self.speculative_num_steps, max_bs * self.topk * self.max_context_len),
                                                 dtype=torch.int32, device=self.runner.cfg.device)
        for i in range(self.speculative_num_steps - 1):
            self.attn_backends[i].init_cuda_graph_state(max_bs, max_num_tokens,
                                                        kv_indices_buf=self.cuda_graph_kv_indices[i])

    def init_forward_metadata_capture_cuda_graph(self, req_pool_indices, seq_lens, spec_info):
        bs = len(seq_lens)

        def call_fn(i, spec_info):
            self.attn_backends[i].init_forward_metadata_capture_cuda_graph(bs, bs * self.topk, req_pool_indices,
                                                                           seq_lens, "decode", spec_info=spec_info)

        self.common_template(req_pool_indices, seq_lens, spec_info, self.cuda_graph_kv_indices, call_fn)

    def init_forward_metadata_replay_cuda_graph(self, req_pool_indices, seq_lens, spec_info):
        bs = len(seq_lens)

        def call_fn(i, spec_info):
            self.attn_backends[i].init_forward_metadata_replay_cuda_graph(
                bs, req_pool_indices, seq_lens, -1, "decode", spec_info=spec_info, seq_lens_cpu=seq_lens.cpu())

        self.common_template(req_pool_indices, seq_lens, spec_info, self.cuda_graph_kv_indices, call_fn)


def run_multi_step_draft(fi, cfg: Config, batches, real_graph: bool):
    runner = ModelRunner(cfg)
    steps = 3
    draft = FlashInferMultiStepDraftBackend(fi, runner, topk=1, speculative_num_steps=steps)
    ws = {b.workspace_buffer.data_ptr() for b in draft.attn_backends}
    assert len(ws) == 1  # one float workspace shared by every draft step's wrapper
    layer = runner.layers[0]
    dev = cfg.device
    spec = types.SimpleNamespace(kv_indptr=None, kv_indices=None)

    # eager: plan every step, then run every step
    reqs, lens = batches[0]
    runner.fill_history(reqs, [n + steps for n in lens])
    rp, sl = i32(reqs, dev), i32(lens, dev)
    draft.init_forward_metadata(rp, sl, spec)
    for i, backend in enumerate(draft.attn_backends):
        q = runner.rand(len(reqs), cfg.num_qo_heads * cfg.head_dim)
        out = backend.forward_decode(q, None, None, layer, None)
        check(out, decode_reference(runner, layer, q, reqs, [n + i + 1 for n in lens]), cfg, f"eager step {i}")

    # CUDA graphs for one batch size, replayed with the others' lengths
    bs = len(batches[1][0])
    draft.init_cuda_graph_state(bs, bs)
    rp_static = torch.zeros(bs, dtype=torch.int32, device=dev)
    sl_static = torch.ones(bs, dtype=torch.int32, device=dev)
    q_static = torch.zeros(bs, cfg.num_qo_heads * cfg.head_dim, dtype=cfg.dtype, device=dev)
    runner.fill_history([0], [1 + steps])
    draft.init_forward_metadata_capture_cuda_graph(rp_static, sl_static, spec)
    graphs = []
    for i, backend in enumerate(draft.attn_backends):
        def forward(backend=backend):
            backend.forward_metadata = ("decode", backend.decode_cuda_graph_metadata[bs])
            return backend.forward_decode(q_static, None, None, layer, None)

        graphs.append(Graph(forward, real_graph))
    for b, (reqs, lens) in enumerate(batches[1:]):
        runner.fill_history(reqs, [n + steps for n in lens])
        rp_static.copy_(i32(reqs, dev))
        sl_static.copy_(i32(lens, dev))
        calls = [backend.fast_plan_calls for backend in draft.attn_backends]
        draft.init_forward_metadata_replay_cuda_graph(rp_static, sl_static, spec)  # plans every step first
        assert [backend.fast_plan_calls for backend in draft.attn_backends] == [c + 1 for c in calls]
        for i, graph in enumerate(graphs):
            q = runner.rand(bs, cfg.num_qo_heads * cfg.head_dim)
            q_static.copy_(q)
            out = graph.replay()
            ref = decode_reference(runner, layer, q, reqs, [n + i + 1 for n in lens])
            check(out, ref, cfg, f"batch {b} step {i}")
    return draft


@pytest.mark.interpreter_plan  # lengths of 3-64 split KV only on the interpreter's tiles and 4 SMs (GPU test below)
def test_sglang_multi_step_draft_fast_decode_plan(fi):
    """FlashInferMultiStepDraftBackend: the draft steps' wrappers share one workspace and index
    buffers, are all planned (fast_decode_plan + global_override_indptr_cpu rows of one .cpu()
    copy) before any runs; long enough requests that decode splits KV (workspace in use)."""
    cfg = Config(num_qo_heads=4, num_kv_heads=1)
    draft = run_multi_step_draft(fi, cfg, [([1, 3], [40, 6]), ([2, 5], [3, 64]), ([7, 0], [50, 45])],
                                 real_graph=False)
    # the last replays split KV, so the shared float workspace was in use
    assert any(b.decode_cuda_graph_metadata[2][0]._plan_info.has_splits for b in draft.attn_backends)


@pytest.mark.gpu
def test_gpu_sglang_multi_step_draft_fast_decode_plan(fi):
    cfg = Config(num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
                 max_reqs=16, max_context_len=4096, device="cuda")
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(3):
        reqs = torch.randperm(cfg.max_reqs, generator=g)[:8].tolist()
        batches.append((reqs, torch.randint(1, 4000, (8,), generator=g).tolist()))
    run_multi_step_draft(fi, cfg, batches, real_graph=True)


def test_sglang_paths_keep_sm_scale(fi):
    """SGLang's forward() passes sm_scale every layer; a non-default scale reaches the kernel
    through fast_decode_plan re-plans (the deprecated forward() overrides the planned settings)."""
    cfg = Config()
    runner = ModelRunner(cfg)
    for layer in runner.layers:
        layer.scaling = 0.3 / math.sqrt(cfg.head_dim)
    backend = FlashInferAttnBackend(fi, runner, Globals())
    reqs, lens = [0, 1], [5, 12]
    runner.fill_history(reqs, lens)
    sl = i32(lens, cfg.device)
    backend.init_forward_metadata_decode(i32(reqs, cfg.device), sl, sl.cpu())
    w = backend.decode_wrappers[0]
    w.begin_forward = functools.partial(fi.fast_decode_plan, w)
    backend.init_forward_metadata_decode(i32(reqs, cfg.device), sl, sl.cpu())
    q = runner.rand(2, cfg.num_qo_heads * cfg.head_dim)
    out = backend.forward_decode(q, None, None, runner.layers[0], None)
    check(out, decode_reference(runner, runner.layers[0], q, reqs, lens), cfg)
