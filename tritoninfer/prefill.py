"""Prefill / append attention: ``single_prefill_with_kv_cache``, ``BatchPrefillWithPagedKVCacheWrapper``
and ``BatchPrefillWithRaggedKVCacheWrapper`` (FlashInfer 0.5.3's API), on the attention core that
decode uses.

Query tokens of a request are cut into tiles of ``block_m // group`` tokens; each tile's rows are
(token, query head of the GQA group) pairs, so every KV byte is read once per group.

On Hopper, ragged and paged (pages of 8-128 tokens, NHD) plans of plain bf16 attention at head_dim 128
with long requests (``_hopper_capable``) run a persistent warp-specialised Gluon kernel instead
(``kernels/prefill_hopper.py``, FlashAttention-3's schedule: 1.25-1.8x the attention core at 4K-16K
tokens); everything else runs the attention core.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from . import _device, _errors
from ._errors import fault_record
from ._launch import CachedLauncher
from .kernels.faults import check_page_ids_kernel
from ._attention import DevicePlan, KVSource, PlanUploader, launch_attention, pad_work, score_params, scratch_workspace
from ._kvcache import PagedKV, PagedKVCache, host_page_table, page_table_from_block_tables, unpack_paged_kv_cache
from ._options import (
    KV_DTYPES,
    Q_DTYPES,
    TensorLayout,
    canonicalize_dtype,
    check_dtype_in,
    check_head_dim,
    check_heads,
    check_indptr_host,
    check_out,
    check_positive_int,
    check_same_dtype_as_plan,
    check_sinks,
    check_tensor,
    copy_into,
    host_index,
    parse_layout,
)
from . import _plan
from ._plan import WORK_FIELDS, kv_split_chunk, prefill_tiles

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]

# FlashInfer backend names; every one selects tritoninfer's Triton kernels.
PREFILL_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cudnn", "cutlass", "triton")
O_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_backend(backend: str) -> None:
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend: expected one of {PREFILL_BACKENDS}, got {backend!r}")


def _reject_unsupported(use_fp16_qk_reduction: bool, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                        token_pos_in_items_len: int = 0, max_item_len_ptr=None) -> None:
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True: tritoninfer always accumulates q.k in fp32")
    if any(x is not None for x in (prefix_len_ptr, token_pos_in_items_ptr, max_item_len_ptr)) or token_pos_in_items_len:
        raise NotImplementedError("multi-item scoring (prefix_len_ptr, token_pos_in_items_*, max_item_len_ptr)")


def _mask_layout(qo_lens: np.ndarray, kv_lens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Bit offsets of each request's [qo, kv] mask in the flat bool mask, and byte offsets of its
    segment in the packed mask (each request's segment is padded to whole bytes)."""
    bits = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    bit_indptr = np.concatenate([[0], np.cumsum(bits)])
    byte_indptr = np.concatenate([[0], np.cumsum((bits + 7) // 8)])
    return bit_indptr, byte_indptr


def _pack_mask(custom_mask: torch.Tensor, bit_indptr: np.ndarray) -> torch.Tensor:
    from .quantization import segment_packbits

    indptr = torch.from_numpy(bit_indptr.astype(np.int64)).to(custom_mask.device)
    packed, _ = segment_packbits(custom_mask.contiguous().view(-1), indptr, bitorder="little")
    return packed


_CHECK_PAGE_IDS = CachedLauncher(check_page_ids_kernel)

# The Gluon prefill for Hopper (kernels/prefill_hopper.py): on by default where it applies
# (_hopper_capable); TRITONINFER_HOPPER_PREFILL=0 keeps every prefill on the attention core.
HOPPER_PREFILL = os.environ.get("TRITONINFER_HOPPER_PREFILL", "1") != "0"
HOPPER_TILE = 128  # query tokens per work item: two consumer warpgroups of 64
HOPPER_STAGES = 3  # K/V ring depth: 3 x 64 KB at head_dim 128, with Q 224 KB of the H200's 227
HOPPER_CONSUMER_REGS = 240  # per consumer thread; the producer warpgroup keeps 24
HOPPER_PERSISTENT = True  # one program per SM running work items in turn (False: one item per program)


def hopper_maxnreg(consumer_regs: int) -> int:
    """The kernel-wide register limit that leaves ``consumer_regs`` to each consumer thread:
    registers are handed out per warpgroup, two consumers and the producer's, 12 warps in all."""
    return (2 * 4 * consumer_regs + 4 * 24) // 12 // 8 * 8


# mean query tokens per request from which a plan takes the Gluon kernel, by (paged, causal): the
# shortest measured faster than the core on the same KV (benchmarks/NOTES.md, session 6; the paged core
# is slower than the ragged one, so paged plans switch earlier)
HOPPER_MIN_LEN = {(False, False): 1024, (False, True): 4096, (True, False): 512, (True, True): 1024}
# smallest page the paged mode takes: a TMA box per page lands in an 8-row slice of the 128-byte
# swizzled K/V stage; Triton 3.6 cannot slice one below its 8-row swizzle pattern
HOPPER_MIN_PAGE = 8


@functools.lru_cache(maxsize=None)
def _gluon_hopper_available() -> bool:
    """Gluon's Hopper API as the kernel uses it: Triton 3.6 (the version it was written and measured
    with; Gluon is experimental and its API moves between releases)."""
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) != (3, 6):
        return False
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _hopper_capable(device: torch.device, q_dtype, kv_dtype, head_dim_qk, head_dim_vo, layout, use_cuda_graph,
                    has_mask, causal: bool, mean_qo_len: float, paged: bool = False) -> bool:
    """Whether a plan may take the Gluon Hopper kernel (the wrapper then checks its KV geometry, the
    plan the scores, the run its tensors). Only where it was measured faster than the core and
    tested on the H200 (benchmarks/NOTES.md, sessions 5 and 6): bf16, head_dim 128 (at 64 it is
    7-12 % slower), requests of ``HOPPER_MIN_LEN[paged, causal]`` query tokens or more on average."""
    return (HOPPER_PREFILL and not use_cuda_graph and not has_mask and layout == TensorLayout.NHD
            and q_dtype == torch.bfloat16 and kv_dtype == q_dtype and head_dim_qk == head_dim_vo == 128
            and mean_qo_len >= HOPPER_MIN_LEN[paged, causal]
            and device.type == "cuda" and _device.has_gpu() and _device.capability(device) == (9, 0)
            and _gluon_hopper_available())


def _hopper_tiles(qo_lens: np.ndarray, kv_lens: np.ndarray, causal: bool) -> np.ndarray:
    """int32 [2, tiles]: request and first query token of every 128-token query tile, the tiles that
    read the most KV first: the attention core's work list (no splits), heaviest first."""
    plan = _plan.heaviest_first(_plan.build_work(qo_lens, kv_lens, HOPPER_TILE, None), qo_lens, kv_lens,
                                HOPPER_TILE, causal)
    return np.ascontiguousarray(plan.work[:, :2].T)


def _tma_ready(t: torch.Tensor) -> bool:
    """A [tokens, H, D] tensor that a 2-D TMA box can read as [tokens, H * D]."""
    elem = t.element_size()
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and (t.stride(0) * elem) % 16 == 0
            and t.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], {torch.float16: gl.float16,
                                                                   torch.bfloat16: gl.bfloat16}[dtype])


def _ragged_descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of contiguous NHD K/V for the Gluon kernel (128-token boxes of one head), or
    None where a 2-D TMA view does not fit them (the run then takes the core)."""
    if not (_tma_ready(k) and _tma_ready(v)):
        return None
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, h, d = k.shape
    layout = _smem_layout(HOPPER_TILE, d, k.dtype)
    return tuple(TensorDescriptor(t, [n, h * d], [t.stride(0), 1], [HOPPER_TILE, d], layout) for t in (k, v)), 0


def _paged_descriptors(kv: PagedKV):
    """TMA descriptors of an NHD paged cache for the Gluon kernel's paged mode: K and V as 2-D views
    [rows, H * D] with a box of one page of one head, page p starting at row p * rows_per_page (in a
    5-D cache K and V pages alternate: rows_per_page = 2 * page). None where the cache does not fit
    that view (heads or slots not packed, page strides that are not whole rows or differ)."""
    page, h, d = kv.page_size, kv.num_heads, kv.head_dim_qk
    row = h * d
    page_stride, slot, head = kv.k_strides
    if (kv.k_strides != kv.v_strides or (page > 1 and slot != row) or head != d or page_stride % row
            or (page_stride * kv.k.element_size()) % 16 or kv.k.data_ptr() % 16 or kv.v.data_ptr() % 16):
        return None
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows_per_page = page_stride // row
    rows = (kv.k.shape[0] - 1) * rows_per_page + page
    layout = _smem_layout(page, d, kv.k.dtype)
    return tuple(TensorDescriptor(t, [rows, row], [row, 1], [page, d], layout) for t in (kv.k, kv.v)), rows_per_page


def _launch_hopper(q, kv_descriptors, out, lse, qo_indptr, kv_indptr, kv_len, tiles: torch.Tensor,
                   num_kv_heads: int, sm_scale: float, causal: bool, kv_indices=None) -> None:
    """The Gluon kernel over ``kv_descriptors`` (from ``_ragged_descriptors`` with token offsets
    ``kv_indptr``, or ``_paged_descriptors`` with the page table ``kv_indptr`` / ``kv_indices``);
    ``kv_len`` int32 [batch]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernels.prefill_hopper import prefill_hopper_kernel

    (k_desc, v_desc), rows_per_page = kv_descriptors
    tokens, hq, d = q.shape
    q_desc = TensorDescriptor(q, [tokens, hq * d], [q.stride(0), 1], [64, d], _smem_layout(64, d, q.dtype))
    if lse is None:  # the kernel always writes one (see kernels/prefill_hopper.py)
        lse = torch.empty((tokens, hq), dtype=torch.float32, device=q.device)
    paged = kv_indices is not None
    num_items = tiles.shape[1] * hq
    grid = min(num_items, _device.num_sms(q.device)) if HOPPER_PERSISTENT else num_items
    prefill_hopper_kernel[(grid,)](
        q_desc, k_desc, v_desc, out, out.stride(0), out.stride(1), lse, lse.stride(0),
        qo_indptr, kv_indptr, kv_len, tiles[0], tiles[1], hq, num_items, sm_scale * math.log2(math.e),
        kv_indices if paged else kv_indptr, rows_per_page,
        GROUP=hq // num_kv_heads, STAGES=HOPPER_STAGES, IS_CAUSAL=causal, CONSUMER_REGS=HOPPER_CONSUMER_REGS,
        PAGE_SIZE=k_desc.block_shape[0] if paged else 0, num_warps=4,
        maxnreg=hopper_maxnreg(HOPPER_CONSUMER_REGS),
    )


class _BatchPrefillBase:
    """Plan and run shared by the paged and the ragged prefill wrappers."""

    _paged: bool

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                     mask_indptr_buf, backend, jit_args, jit_kwargs) -> None:
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        _check_backend(backend)
        if jit_args is not None or jit_kwargs is not None:
            raise NotImplementedError("jit_args/jit_kwargs: custom CUDA attention variants cannot run on tritoninfer's Triton kernels")
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = parse_layout(kv_layout)
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in cuda graph mode")
            check_tensor(qo_indptr_buf, "qo_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        else:
            self._fixed_batch_size = 0
        for name, buf in (("custom_mask_buf", custom_mask_buf), ("mask_indptr_buf", mask_indptr_buf)):
            if buf is not None and not use_cuda_graph:
                raise ValueError(f"{name}: only used with use_cuda_graph=True")
        if custom_mask_buf is not None:
            check_tensor(custom_mask_buf, "custom_mask_buf", ndim=1, dtype=torch.uint8, device=self.device)
        if mask_indptr_buf is not None:
            check_tensor(mask_indptr_buf, "mask_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
        self._qo_indptr_buf = qo_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._uploader = PlanUploader(self.device)
        self._plan_buf: Optional[torch.Tensor] = None
        self._plan_capacity = 0
        self._max_total_rows = 0
        self._plan: Optional[DevicePlan] = None
        # ragged plans on Hopper: the Gluon kernel's query tiles (int32 [2, tiles]), else None
        self._hopper_tiles: Optional[torch.Tensor] = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace. ``int_workspace_buffer`` is accepted for compatibility:
        tritoninfer keeps its plan in buffers the wrapper owns and needs no int workspace."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._float_workspace_buffer = float_workspace_buffer

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""

    def _plan_common(
        self, *, qo_indptr_host: torch.Tensor, qo_indptr: torch.Tensor, kv_lens: np.ndarray, kv_extra: list,
        num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size, custom_mask, packed_custom_mask, causal,
        pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type,
        kv_data_type, non_blocking, fixed_split_size, disable_split_kv,
    ) -> list:
        """Everything but the KV page table. ``kv_extra`` are host arrays to upload with the plan;
        their device views are returned."""
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim_qk, "head_dim_qk")
        head_dim_vo = head_dim_qk if head_dim_vo is None else check_head_dim(head_dim_vo, "head_dim_vo")
        q_dtype = check_dtype_in(canonicalize_dtype(q_data_type, "q_data_type"), Q_DTYPES, "q_data_type")
        kv_dtype = q_dtype if kv_data_type is None else canonicalize_dtype(kv_data_type, "kv_data_type")
        check_dtype_in(kv_dtype, KV_DTYPES, "kv_data_type")
        has_mask = custom_mask is not None or packed_custom_mask is not None
        if self._use_cuda_graph and self._custom_mask_buf is not None and not has_mask:
            raise ValueError(
                "custom_mask: this wrapper was created with custom_mask_buf, so (as in FlashInfer) every run "
                "applies the mask buffer; pass this plan's custom_mask or packed_custom_mask"
            )
        # a custom mask replaces the causal mask (FlashInfer 0.5.3's MaskMode.CUSTOM)
        params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                              head_dim_qk, causal=bool(causal) and not has_mask)
        check_indptr_host(qo_indptr_host, "qo_indptr")
        batch = qo_indptr_host.numel() - 1
        if kv_lens.size != batch:
            raise ValueError(f"qo_indptr and the KV page table disagree on the batch size ({batch} vs {kv_lens.size})")
        qo = qo_indptr_host.numpy().astype(np.int64)
        qo_lens = qo[1:] - qo[:-1]
        total_rows = int(qo[-1])

        # custom mask: FlashInfer's flat bool [sum qo_i*kv_i] or its little-endian packing
        packed = None
        byte_indptr = None
        if custom_mask is not None or packed_custom_mask is not None:
            bit_indptr, byte_indptr = _mask_layout(qo_lens, kv_lens)
            if packed_custom_mask is not None:
                check_tensor(packed_custom_mask, "packed_custom_mask", ndim=1, dtype=torch.uint8)
                if packed_custom_mask.numel() != int(byte_indptr[-1]):
                    raise ValueError(
                        f"packed_custom_mask: expected {int(byte_indptr[-1])} bytes (each request's "
                        f"qo_len*kv_len bits padded to whole bytes), got {packed_custom_mask.numel()}"
                    )
                packed = packed_custom_mask
            else:
                check_tensor(custom_mask, "custom_mask")
                if custom_mask.numel() != int(bit_indptr[-1]):
                    raise ValueError(
                        f"custom_mask: expected {int(bit_indptr[-1])} elements (sum of qo_len*kv_len), got {custom_mask.numel()}"
                    )
                packed = _pack_mask(custom_mask, bit_indptr)
            packed = packed.to(self.device)

        tiles = prefill_tiles(group, max(head_dim_qk, head_dim_vo), total_rows * group / max(batch, 1),
                              kv_dtype.itemsize)
        if self._use_cuda_graph and self._plan_buf is not None:
            # captured graphs hold the first plan's kernel, tile size and buffer layout: keep them
            tiles = self._tiles
        q_tiles = -(-qo_lens // tiles.tile_tokens)
        num_sms = _device.num_sms(self.device)
        chunk = kv_split_chunk(kv_lens, q_tiles, num_kv_heads, num_sms, tiles.block_n, max(page_size, 1),
                               fixed_split_size, disable_split_kv, tiles.programs_per_sm)

        mask_arrays = [byte_indptr] if byte_indptr is not None else []
        if self._use_cuda_graph:
            if batch != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                    f"mismatches the batch size set during initialization {self._fixed_batch_size}"
                )
            if self._plan_buf is None:
                # sized once, from the first plan's total rows (as FlashInfer does); captured graphs
                # keep pointers into it
                self._max_total_rows = total_rows
                max_splits = max(1, -(-tiles.programs_per_sm * num_sms // max(1, batch)))
                # the state layout is fixed by the first plan: keep it within the workspace
                per_split = max(1, total_rows) * _plan.state_bytes(1, num_qo_heads, head_dim_vo)
                max_splits = max(1, min(max_splits, self._float_workspace_buffer.numel() // per_split))
                self._max_splits = max_splits
                self._plan_capacity = (-(-total_rows // tiles.tile_tokens) + batch) * max_splits
                extra = sum(a.size for a in kv_extra)
                self._plan_buf = torch.empty(self._plan_capacity * WORK_FIELDS + 2 * batch + extra + batch + 1,
                                             dtype=torch.int32, device=self.device)
            if total_rows > self._max_total_rows:
                raise ValueError(
                    f"qo_indptr: {total_rows} query rows exceed the {self._max_total_rows} of the first plan "
                    "in cuda graph mode"
                )
            work = _plan.fit_work(qo_lens, kv_lens, tiles.tile_tokens, chunk, self._float_workspace_buffer.numel(),
                                  num_qo_heads, head_dim_vo, fixed_split_size is not None, max_splits=self._max_splits)
            work = _plan.heaviest_first(work, qo_lens, kv_lens, tiles.tile_tokens, params.causal)
            capacity = self._plan_capacity
            views = self._uploader.upload([pad_work(work, capacity), kv_lens, work.state_offset, qo] + kv_extra,
                                          non_blocking, out=self._plan_buf)
            work_d, kv_len_d, state_offset_d, qo_d = views[:4]
            copy_into(self._qo_indptr_buf, qo_d, non_blocking)
            qo_indptr_d = self._qo_indptr_buf
            if packed is not None:
                if self._custom_mask_buf is None or self._mask_indptr_buf is None:
                    raise ValueError("custom masks in cuda graph mode need custom_mask_buf and mask_indptr_buf")
                if packed.numel() > self._custom_mask_buf.numel():
                    raise ValueError(f"custom_mask_buf: holds {self._custom_mask_buf.numel()} bytes, the mask needs {packed.numel()}")
                copy_into(self._custom_mask_buf[:packed.numel()], packed, non_blocking)
                copy_into(self._mask_indptr_buf[:batch + 1], torch.from_numpy(byte_indptr.astype(np.int32)), non_blocking)
                packed, mask_indptr_d = self._custom_mask_buf, self._mask_indptr_buf
            plan = DevicePlan(work_d.view(capacity, WORK_FIELDS), kv_len_d, state_offset_d, qo_indptr_d, capacity,
                              work.num_states, self._max_total_rows * self._max_splits, work.has_splits, True,
                              bool(kv_lens.any()))
            kv_views = views[4:]
        else:
            work = _plan.fit_work(qo_lens, kv_lens, tiles.tile_tokens, chunk, self._float_workspace_buffer.numel(),
                                  num_qo_heads, head_dim_vo, fixed_split_size is not None)
            work = _plan.heaviest_first(work, qo_lens, kv_lens, tiles.tile_tokens, params.causal)
            views = self._uploader.upload([work.work, kv_lens, work.state_offset, qo] + mask_arrays + kv_extra,
                                          non_blocking)
            work_d, kv_len_d, state_offset_d, qo_indptr_d = views[:4]
            mask_indptr_d = views[4] if mask_arrays else None
            plan = DevicePlan(work_d.view(-1, WORK_FIELDS), kv_len_d, state_offset_d, qo_indptr_d, work.work.shape[0],
                              work.num_states, work.num_states, work.has_splits, False, bool(kv_lens.any()))
            kv_views = views[4 + len(mask_arrays):]

        self._plan = plan
        self._tiles = tiles
        self._packed_mask = packed
        self._mask_indptr = mask_indptr_d if packed is not None else None
        self._total_rows = total_rows
        self._num_qo_heads, self._num_kv_heads = num_qo_heads, num_kv_heads
        self._head_dim_qk, self._head_dim_vo = head_dim_qk, head_dim_vo
        self._cached_q_data_type, self._cached_kv_data_type = q_dtype, kv_dtype
        self._params = params
        self._causal = bool(causal)
        self._pos_encoding_mode, self._window_left = pos_encoding_mode, window_left
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else logits_soft_cap  # as FlashInfer stores it
        self._sm_scale, self._rope_scale, self._rope_theta = sm_scale, rope_scale, rope_theta
        return kv_views

    def _hopper_work(self, qo: np.ndarray, kv_lens: np.ndarray, q_data_type, kv_data_type, head_dim_qk, head_dim_vo,
                     has_mask: bool, causal, paged: bool) -> Optional[np.ndarray]:
        """The Gluon kernel's work list (``_hopper_tiles``) if ``_hopper_capable`` lets this plan take
        it, else None. ``qo``: int64 qo_indptr on the host; a batch that disagrees with ``kv_lens``
        gets None (``_plan_common`` reports it)."""
        if qo.size != kv_lens.size + 1:
            return None
        q_dtype = canonicalize_dtype(q_data_type, "q_data_type")
        kv_dtype = q_dtype if kv_data_type is None else canonicalize_dtype(kv_data_type, "kv_data_type")
        if not _hopper_capable(self.device, q_dtype, kv_dtype, head_dim_qk,
                               head_dim_qk if head_dim_vo is None else head_dim_vo, self._kv_layout,
                               self._use_cuda_graph, has_mask, bool(causal), qo[-1] / max(qo.size - 1, 1), paged=paged):
            return None
        return _hopper_tiles(qo[1:] - qo[:-1], kv_lens, bool(causal))

    def _keep_hopper_tiles(self, tiles: Optional[torch.Tensor]) -> None:
        """Keeps the Gluon kernel's uploaded work list (int32 [2 * tiles]) if the planned scores are
        ones it computes: no RoPE, ALiBi, soft cap or window, and a positive scale (folded into exp2)."""
        p = self._params
        plain = not (p.rope or p.alibi or p.logits_soft_cap > 0 or p.window_left >= 0) and p.sm_scale > 0
        self._hopper_tiles = tiles.view(2, -1) if tiles is not None and plain else None

    def _override(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                  rope_scale, rope_theta) -> None:
        """The deprecated forward(): its arguments, defaults included, replace the planned settings."""
        if self._plan is None:
            raise ValueError("forward() was called before plan()")
        _reject_unsupported(use_fp16_qk_reduction)
        self._params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                                    rope_theta, self._head_dim_qk, causal=bool(causal) and self._packed_mask is None)
        self._hopper_tiles = None  # chosen for the planned settings: the replaced ones take the core
        self._causal = bool(causal)
        self._pos_encoding_mode, self._window_left, self._logits_soft_cap = pos_encoding_mode, window_left, logits_soft_cap
        self._sm_scale, self._rope_scale, self._rope_theta = sm_scale, rope_scale, rope_theta

    def _run_common(self, q, kv: KVSource, kv_dtype, head_dim_qk, head_dim_vo, out, lse, return_lse, *,
                    q_scale=None, k_scale=None, v_scale=None, sinks=None, window_left=None, head_scales=None,
                    out_dtype=None, hopper_kv=None):
        """``hopper_kv``: the Gluon kernel's K/V descriptors (``_ragged_descriptors`` or
        ``_paged_descriptors``), given only when the plan chose it and the K/V fit."""
        if self._plan is None:
            raise ValueError("run() was called before plan()")
        if window_left is not None and window_left != self._window_left:
            raise ValueError(f"window_left: run() got {window_left} but plan() used {self._window_left}")
        check_tensor(q, "q", ndim=3)
        check_same_dtype_as_plan(q, self._cached_q_data_type, "q", "q_data_type")
        if kv_dtype != self._cached_kv_data_type:
            raise ValueError(
                f"The dtype of k/v {kv_dtype} does not match the kv_data_type {self._cached_kv_data_type} specified in plan function."
            )
        rows_ok = q.shape[0] >= self._total_rows if self._use_cuda_graph else q.shape[0] == self._total_rows
        if not rows_ok or q.shape[1] != self._num_qo_heads or q.shape[2] != self._head_dim_qk:
            raise ValueError(
                f"q: expected shape ({self._total_rows}, {self._num_qo_heads}, {self._head_dim_qk}) "
                f"(qo_indptr[-1], num_qo_heads, head_dim_qk), got {tuple(q.shape)}"
            )
        if q.stride(-1) != 1:
            raise ValueError("q: the last dimension must be contiguous")
        if (head_dim_qk, head_dim_vo) != (self._head_dim_qk, self._head_dim_vo):
            raise ValueError(
                f"k/v head dims {head_dim_qk}/{head_dim_vo} do not match the planned {self._head_dim_qk}/{self._head_dim_vo}"
            )
        if kv.k.device != q.device:
            raise ValueError("k/v and q must be on the same device")
        shape = (q.shape[0], self._num_qo_heads, self._head_dim_vo)
        out_dtype = q.dtype if out_dtype is None else out_dtype
        if out is None and (self._use_cuda_graph or q.shape[0] > self._total_rows):
            # rows beyond the plan are 0; in cuda graph mode a later plan may have fewer rows than
            # the captured one, so the captured zero-fill covers them on every replay
            out = torch.zeros(shape, dtype=out_dtype, device=q.device)
        out = check_out(out, shape, out_dtype, q.device, "out")
        if lse is not None or return_lse:
            # a caller's lse buffer is written whether or not it is returned, as in FlashInfer
            lse = check_out(lse, shape[:2], torch.float32, q.device, "lse")
        sinks = check_sinks(sinks, self._num_qo_heads, q.device)
        if hopper_kv is not None and sinks is None and head_scales is None and _tma_ready(q):
            if kv.page_size > 0 and self._pages_checked != kv.num_pages:
                # TMA keeps the kernel's reads inside the cache; this reports the ids it would miss
                _CHECK_PAGE_IDS[(self._plan.kv_len.numel(),)](kv.kv_indptr, kv.kv_indices, fault_record(q.device),
                                                             kv.num_pages, BLOCK=256)
                self._pages_checked = kv.num_pages
            _launch_hopper(q, hopper_kv, out, lse, self._plan.qo_indptr, kv.kv_indptr, self._plan.kv_len,
                           self._hopper_tiles, self._num_kv_heads, self._params.sm_scale, self._params.causal,
                           kv_indices=kv.kv_indices if kv.page_size > 0 else None)
            return (out, lse) if return_lse else out
        launch_attention(
            q=q, out=out, lse=lse, kv=kv, plan=self._plan, tiles=self._tiles, num_kv_heads=self._num_kv_heads,
            head_dim_qk=self._head_dim_qk, head_dim_vo=self._head_dim_vo, params=self._params, q_len_per_req=0,
            state_mult=1, workspace=self._float_workspace_buffer, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
            sinks=sinks, packed_mask=self._packed_mask, mask_indptr=self._mask_indptr, head_scales=head_scales,
        )
        return (out, lse) if return_lse else out


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill / append attention of ragged queries over a paged KV cache.

    ``plan()`` does the host work once per step (host copies of the page table, query tiles,
    split-KV decision, packed custom masks) and keeps it in device buffers the wrapper owns;
    ``run()`` launches without synchronising and can be captured in a CUDA graph.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
    ...              causal=True, q_data_type=torch.bfloat16)
    >>> o = wrapper.run(q, kv_cache)  # q [qo_indptr[-1], 32, 128] -> o [qo_indptr[-1], 32, 128]

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states; its size is checked against each plan.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Fixed batch size and buffers; the launch grid is fixed by the first plan, so a captured
        graph replays correctly after re-planning (query rows may not exceed the first plan's).
    qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf : torch.Tensor
        int32 fixed buffers ``[batch+1]``, ``[batch+1]``, ``[max_pages]``, ``[batch]``; required
        with ``use_cuda_graph``.
    custom_mask_buf, mask_indptr_buf : torch.Tensor
        uint8 ``[max_mask_bytes]`` and int32 ``[batch+1]`` fixed buffers for custom (tree) masks in
        cuda graph mode.
    backend : str
        ``"auto"``, ``"fa2"``, ``"fa3"``, ``"trtllm-gen"``, ``"cudnn"`` or ``"triton"``: every value
        runs tritoninfer's Triton kernels; other values raise.
    jit_args, jit_kwargs
        FlashInfer's custom CUDA variants: anything but ``None`` raises ``NotImplementedError``.
    """

    _paged = True

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Optional[List[Any]] = None,
        jit_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                          mask_indptr_buf, backend, jit_args, jit_kwargs)
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buf", paged_kv_indptr_buf), ("paged_kv_indices_buf", paged_kv_indices_buf),
                              ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cuda graph mode")
                check_tensor(buf, name, ndim=1, dtype=torch.int32, device=self.device)
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1 or len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError("paged_kv_indptr_buf/paged_kv_last_page_len_buf: sizes must match qo_indptr_buf's batch")
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        prefix_len_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_q: Optional[torch.Tensor] = None,
        block_tables: Optional[torch.Tensor] = None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan batch prefill for one step (all layers).

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch+1]``: request i's query rows are ``q[qo_indptr[i]:qo_indptr[i+1]]``.
        paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len : torch.Tensor
            int32 page table ``[batch+1]``, ``[paged_kv_indptr[-1]]``, ``[batch]`` (last_page_len
            in 1..page_size; a request with no pages has KV length 0).
        num_qo_heads, num_kv_heads, head_dim_qk, page_size : int
        head_dim_vo : Optional[int]
            V/output head dim (defaults to ``head_dim_qk``), e.g. 192/128.
        custom_mask : Optional[torch.Tensor]
            bool, flattened ``[sum(qo_len[i] * kv_len[i])]``, row-major ``[qo, kv]`` per request;
            True keeps a key. Overrides ``causal``.
        packed_custom_mask : Optional[torch.Tensor]
            uint8: ``custom_mask`` packed little-endian per request, each request's segment padded
            to whole bytes (``segment_packbits(custom_mask, bit_indptr, bitorder="little")``).
        causal : bool
            Bottom-right aligned causal mask (query i sees keys ``j <= i + kv_len - qo_len``).
        pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta
            As in decode; without ``causal``, ``window_left`` limits the left side only.
        use_fp16_qk_reduction : bool
            Only False is supported (raises ``NotImplementedError``).
        q_data_type, kv_data_type
            fp16/bf16 queries; fp16/bf16/e4m3/e5m2 KV (``kv_data_type`` defaults to ``q_data_type``).
        non_blocking : bool
            Asynchronous host-to-device copies of the plan.
        prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr
            Multi-item scoring: not implemented (raise ``NotImplementedError`` when set).
        seq_lens, block_tables
            The alternative page-table form (``block_tables`` int32 ``[batch, max_pages]`` with KV
            lengths ``seq_lens``); replaces the ``paged_kv_*`` arguments when given.
        seq_lens_q : Optional[torch.Tensor]
            Query lengths; used to build ``qo_indptr`` when that is None.
        max_token_per_sequence, max_sequence_kv : Optional[int]
            cuDNN planning hints; tritoninfer plans from the true lengths and only checks that the
            hints are not below them.
        fixed_split_size : Optional[int]
            Split KV into chunks of this many pages, independently of the batch (batch-invariant).
        disable_split_kv : bool
            Never split KV (batch-invariant).
        """
        _device.check_launchable(self.device, "plan()")
        _errors.raise_pending(self.device)
        _reject_unsupported(use_fp16_qk_reduction, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                            max_item_len_ptr)
        check_positive_int(page_size, "page_size")
        if qo_indptr is None:
            if seq_lens_q is None:
                raise ValueError("qo_indptr: required (or pass seq_lens_q)")
            lens_q = host_index(seq_lens_q, "seq_lens_q").to(torch.int64)
            qo_indptr = torch.zeros(lens_q.numel() + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(lens_q, 0)
        qo_indptr_host = host_index(qo_indptr, "qo_indptr")
        if block_tables is not None:
            indptr_host, paged_kv_indices, last_host = page_table_from_block_tables(block_tables, seq_lens, page_size)
        else:
            indptr_host = host_index(paged_kv_indptr, "paged_kv_indptr")
            last_host = host_index(paged_kv_last_page_len, "paged_kv_last_page_len")
        table = host_page_table(indptr_host, last_host, paged_kv_indices, page_size, prefix="paged_kv_")
        ind, lpl, kv_lens, num_pages_used = table.indptr, table.last_page_len, table.kv_lens, table.num_pages_used
        qo = qo_indptr_host.numpy().astype(np.int64)
        for hint, value, name in ((max_token_per_sequence, (qo[1:] - qo[:-1]).max(initial=0), "max_token_per_sequence"),
                                  (max_sequence_kv, kv_lens.max(initial=0), "max_sequence_kv")):
            if hint is not None and hint < value:
                raise ValueError(f"{name}: {hint} is below the true maximum {int(value)}")

        if self._use_cuda_graph and num_pages_used > len(self._paged_kv_indices_buf):
            raise ValueError(f"paged_kv_indices: {num_pages_used} pages exceed paged_kv_indices_buf ({len(self._paged_kv_indices_buf)})")
        # the plan's own indptr (checked above) is what the kernels read, never the caller's tensor
        kv_extra = [ind, lpl] if self._use_cuda_graph else [ind]
        work = None
        if HOPPER_TILE % page_size == 0 and page_size >= HOPPER_MIN_PAGE:  # pages tile the KV tile
            work = self._hopper_work(qo, kv_lens, q_data_type, kv_data_type, head_dim_qk, head_dim_vo,
                                     custom_mask is not None or packed_custom_mask is not None, causal, paged=True)
        hopper = work is not None
        if hopper:
            kv_extra.append(work)
        views = self._plan_common(
            qo_indptr_host=qo_indptr_host, qo_indptr=qo_indptr, kv_lens=kv_lens, kv_extra=kv_extra,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=page_size, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
        )
        if self._use_cuda_graph:
            copy_into(self._paged_kv_indptr_buf, views[0], non_blocking)
            copy_into(self._paged_kv_last_page_len_buf, views[1], non_blocking)
            copy_into(self._paged_kv_indices_buf[:num_pages_used], paged_kv_indices[:num_pages_used], non_blocking)
            self._kv_indptr, self._kv_indices = self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        else:
            self._kv_indptr = views[0]
            indices = paged_kv_indices.to(self.device, non_blocking=non_blocking)
            self._kv_indices = indices.to(torch.int32)
        self._page_size = page_size
        self._page_table = table
        self._pages_checked = -1  # cache size whose page ids a run checked for the Gluon kernel
        self._keep_hopper_tiles(views[-1] if hopper else None)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        *args,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Prefill attention for the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` in ``q_data_type``.
        paged_kv_cache
            Any of FlashInfer's cache forms (see ``BatchDecodeWithPagedKVCacheWrapper.run``).
        *args
            FlashInfer's custom-JIT extras; tritoninfer has none, so any raises ``TypeError``.
        q_scale, k_scale, v_scale : Optional[float]
            fp8 scales: ``q_scale * k_scale`` multiplies ``sm_scale``, ``v_scale`` the output.
        out, lse : Optional[torch.Tensor]
            Preallocated ``[qo_indptr[-1], num_qo_heads, head_dim_vo]`` (q's dtype) and float32
            ``[qo_indptr[-1], num_qo_heads]``.
        return_lse : bool
            Also return the base-2 LSE (excluding sinks). Rows that see no key: 0 / -inf.
        enable_pdl : Optional[bool]
            A CUDA launch attribute Triton does not expose; accepted, no effect on results.
        window_left : Optional[int]
            Must equal the planned value.
        sinks : Optional[torch.Tensor]
            float32 ``[num_qo_heads]`` attention-sink logits added to the softmax denominator only.
        """
        if args:
            raise TypeError("run(): options after paged_kv_cache must be passed by keyword")
        if self._plan is None:
            raise ValueError("run() was called before plan()")
        kv = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        if (kv.page_size, kv.num_heads) != (self._page_size, self._num_kv_heads):
            raise ValueError(
                f"paged_kv_cache: page_size/num_kv_heads are {kv.page_size}/{kv.num_heads}, "
                f"plan() used {self._page_size}/{self._num_kv_heads}"
            )
        self._page_table.check_cache(kv.k.shape[0])
        source = KVSource(kv.k, kv.v, kv.k_strides, kv.v_strides, kv.page_size, self._kv_indptr, self._kv_indices,
                              kv.k.shape[0])
        # the Gluon kernel has no fp8 scales: a run that passes them takes the core
        plain = q_scale is None and k_scale is None and v_scale is None
        hopper_kv = _paged_descriptors(kv) if self._hopper_tiles is not None and plain else None
        return self._run_common(q, source, kv.dtype, kv.head_dim_qk, kv.head_dim_vo, out, lse, return_lse,
                                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks, window_left=window_left,
                                hopper_kv=hopper_kv)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments, defaults included, replace the planned
        settings; then runs."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: as ``forward``, returning ``(o, lse)``."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


def _ragged_kv(k: torch.Tensor, v: torch.Tensor, layout: TensorLayout, kv_indptr: torch.Tensor, name_k="k", name_v="v"):
    """Ragged K/V ``[nnz, H, D]`` (NHD) or ``[H, nnz, D]`` (HND) -> KVSource and (H, D_qk, D_vo)."""
    check_tensor(k, name_k, ndim=3, dtype=KV_DTYPES)
    check_tensor(v, name_v, ndim=3, dtype=KV_DTYPES)
    if k.dtype != v.dtype:
        raise ValueError(f"{name_k} and {name_v} must share a dtype, got {k.dtype} and {v.dtype}")
    tok, head = (0, 1) if layout == TensorLayout.NHD else (1, 0)
    if k.shape[tok] != v.shape[tok] or k.shape[head] != v.shape[head]:
        raise ValueError(f"{name_v}: shape {tuple(v.shape)} does not match {name_k}'s {tuple(k.shape)}")
    for name, t in ((name_k, k), (name_v, v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    source = KVSource(k, v, (k.stride(tok), 0, k.stride(head)), (v.stride(tok), 0, v.stride(head)), 0, kv_indptr)
    return source, k.shape[head], k.shape[2], v.shape[2], k.shape[tok]


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill attention of ragged queries over ragged (contiguous per request) K/V.

    Same plan/run contract as ``BatchPrefillWithPagedKVCacheWrapper``; K/V are
    ``[kv_indptr[-1], num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_indptr[-1], head_dim]`` (HND).

    Parameters
    ----------
    float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf, mask_indptr_buf,
    backend, jit_args, jit_kwargs
        As for the paged wrapper.
    kv_indptr_buf : torch.Tensor
        int32 ``[batch+1]`` fixed buffer for ``kv_indptr`` (cuda graph mode).
    """

    _paged = False

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Optional[List[Any]] = None,
        jit_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                          mask_indptr_buf, backend, jit_args, jit_kwargs)
        if use_cuda_graph:
            if not torch.is_tensor(kv_indptr_buf):
                raise ValueError("kv_indptr_buf should be a torch.Tensor in cuda graph mode")
            check_tensor(kv_indptr_buf, "kv_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
            if len(kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("kv_indptr_buf: size must match qo_indptr_buf's")
        self._kv_indptr_buf = kv_indptr_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        prefix_len_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan ragged prefill for one step. Arguments as the paged wrapper's ``plan``, with
        ``kv_indptr`` (int32 ``[batch+1]``) giving each request's K/V rows. (Note FlashInfer's
        order here: ``window_left, logits_soft_cap, sm_scale``.)"""
        _device.check_launchable(self.device, "plan()")
        _errors.raise_pending(self.device)
        _reject_unsupported(use_fp16_qk_reduction, prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                            max_item_len_ptr)
        qo_indptr_host = host_index(qo_indptr, "qo_indptr")
        kv_indptr_host = host_index(kv_indptr, "kv_indptr")
        check_indptr_host(kv_indptr_host, "kv_indptr")
        kv = kv_indptr_host.numpy().astype(np.int64)
        check_indptr_host(qo_indptr_host, "qo_indptr")
        qo = qo_indptr_host.numpy().astype(np.int64)
        work = None
        if kv[-1] >= HOPPER_TILE:  # K/V fill one TMA box
            work = self._hopper_work(qo, kv[1:] - kv[:-1], q_data_type, kv_data_type, head_dim_qk, head_dim_vo,
                                     custom_mask is not None or packed_custom_mask is not None, causal, paged=False)
        hopper = work is not None
        kv_extra = [kv]
        if hopper:
            kv_extra.append(work)
        views = self._plan_common(
            qo_indptr_host=qo_indptr_host, qo_indptr=qo_indptr, kv_lens=kv[1:] - kv[:-1], kv_extra=kv_extra,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=0, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
        )
        if self._use_cuda_graph:
            copy_into(self._kv_indptr_buf, views[0], non_blocking)
            self._kv_indptr = self._kv_indptr_buf
        else:
            self._kv_indptr = views[0]
        self._total_kv = int(kv[-1])
        self._keep_hopper_tiles(views[1] if hopper else None)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Prefill attention for the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim_qk]``.
        k, v : torch.Tensor
            ``[kv_indptr[-1], num_kv_heads, head_dim_qk / head_dim_vo]`` (NHD) or
            ``[num_kv_heads, kv_indptr[-1], head_dim]`` (HND), in ``kv_data_type``.
        out, lse, return_lse, enable_pdl
            As for the paged wrapper.
        """
        if args:
            raise TypeError("run(): options after v must be passed by keyword")
        if self._plan is None:
            raise ValueError("run() was called before plan()")
        source, heads, dqk, dvo, nnz = _ragged_kv(k, v, self._kv_layout, self._kv_indptr)
        if heads != self._num_kv_heads or (nnz < self._total_kv if self._use_cuda_graph else nnz != self._total_kv):
            raise ValueError(f"k: expected {self._total_kv} rows (kv_indptr[-1]) of {self._num_kv_heads} heads, got {tuple(k.shape)}")
        hopper_kv = _ragged_descriptors(k, v) if self._hopper_tiles is not None else None
        return self._run_common(q, source, k.dtype, dqk, dvo, out, lse, return_lse, hopper_kv=hopper_kv)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments replace the planned settings; then runs."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, k, v)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: as ``forward``, returning ``(o, lse)``."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, k, v, return_lse=True)


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: Optional[torch.Tensor] = None,
    scale_k: Optional[torch.Tensor] = None,
    scale_v: Optional[torch.Tensor] = None,
    o_dtype: Optional[torch.dtype] = None,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Prefill attention of one request's queries over its contiguous K/V.

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim_qk]``, fp16 or bf16.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim_qk / head_dim_vo]`` (NHD) or ``[num_kv_heads, kv_len, ...]``
        (HND); fp16, bf16, e4m3 or e5m2.
    scale_q, scale_k, scale_v : Optional[torch.Tensor]
        float32 per-head scales ``[num_qo_heads]``, ``[num_kv_heads]``, ``[num_kv_heads]``: logits
        are multiplied by ``scale_q[h] * scale_k[kv_head(h)]`` and the output by ``scale_v``.
        (FlashInfer reads them only for fp8 queries; tritoninfer applies them whenever given.)
    o_dtype : Optional[torch.dtype]
        Output dtype (fp16, bf16 or fp32); defaults to q's.
    custom_mask, packed_custom_mask : Optional[torch.Tensor]
        bool ``[qo_len, kv_len]`` (True keeps), or its little-endian bit packing (uint8).
        Overrides ``causal``.
    causal : bool
        Bottom-right aligned. Rows that see no key (``qo_len > kv_len``) give 0 / LSE -inf
        (FlashInfer raises there).
    kv_layout, pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta
        As for the batch wrappers.
    use_fp16_qk_reduction : bool
        Only False (``NotImplementedError`` otherwise).
    backend : str
        FlashInfer backend names all select tritoninfer's kernels.
    return_lse : bool
        Also return the float32 base-2 LSE ``[qo_len, num_qo_heads]``.
    """
    _check_backend(backend)
    _reject_unsupported(use_fp16_qk_reduction)
    check_tensor(q, "q", ndim=3, dtype=Q_DTYPES)
    check_tensor(k, "k", ndim=3)
    layout = parse_layout(kv_layout)
    device = q.device
    qo_len = q.shape[0]
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if layout == TensorLayout.NHD else (k.shape[1], k.shape[0])
    o_dtype = q.dtype if o_dtype is None else check_dtype_in(canonicalize_dtype(o_dtype, "o_dtype"), O_DTYPES, "o_dtype")
    if custom_mask is not None:
        check_tensor(custom_mask, "custom_mask", ndim=2)
        if tuple(custom_mask.shape) != (qo_len, kv_len):
            raise ValueError(f"custom_mask: expected shape ({qo_len}, {kv_len}), got {tuple(custom_mask.shape)}")
        custom_mask = custom_mask.reshape(-1)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(scratch_workspace(device), kv_layout)
    wrapper.plan(torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                 q.shape[1], num_kv_heads, q.shape[2], head_dim_vo=v.shape[2], custom_mask=custom_mask,
                 packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
                 window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                 rope_theta=rope_theta, q_data_type=q.dtype, kv_data_type=k.dtype)
    head_scales = None
    if scale_q is not None or scale_k is not None or scale_v is not None:
        head_scales = tuple(_head_scale(s, n, name, device) for s, n, name in
                            ((scale_q, q.shape[1], "scale_q"), (scale_k, num_kv_heads, "scale_k"),
                             (scale_v, num_kv_heads, "scale_v")))
    source, _, dqk, dvo, _ = _ragged_kv(k, v, layout, wrapper._kv_indptr)
    hopper_kv = _ragged_descriptors(k, v) if wrapper._hopper_tiles is not None and head_scales is None else None
    return wrapper._run_common(q, source, k.dtype, dqk, dvo, None, None, return_lse, head_scales=head_scales,
                               out_dtype=o_dtype, hopper_kv=hopper_kv)


def _head_scale(s: Optional[torch.Tensor], n: int, name: str, device) -> torch.Tensor:
    if s is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    check_tensor(s, name, dtype=torch.float32)
    if s.numel() != n or s.device != device:
        raise ValueError(f"{name}: expected a float32 tensor of {n} per-head scales on {device}, got {tuple(s.shape)}")
    return s.reshape(-1).contiguous()


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
