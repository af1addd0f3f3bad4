"""Attention-state merging and cascade attention (FlashInfer 0.5.3's ``flashinfer.cascade``).

- ``merge_state``, ``merge_state_in_place``, ``merge_states``: a state is an attention output ``v``
  with the base-2 log-sum-exp ``s`` of its logits; merging two states over disjoint KV gives the
  state of attention over their union. A state with LSE -inf (attention over nothing) contributes
  nothing, and merging two such states gives output 0 and LSE -inf. (FlashInfer 0.5.3 returns NaN
  there; tritoninfer deliberately does not.)
- ``MultiLevelCascadeAttentionWrapper``: attention over KV split into levels (e.g. a prefix shared
  by many requests, then each request's own suffix). Each level is one batch prefill over its own
  page table, so a shared prefix is read once for all the queries that share it, instead of once
  per request; the levels' states are merged.
- ``BatchDecodeWithSharedPrefixPagedKVCacheWrapper``, ``BatchPrefillWithSharedPrefixPagedKVCacheWrapper``:
  FlashInfer's legacy two-level form, with the shared prefix as contiguous K/V tensors.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from . import _ops
from ._launch import CachedLauncher
from ._kvcache import PagedKVCache, unpack_paged_kv_cache
from ._options import (
    KV_DTYPES,
    Q_DTYPES,
    TensorLayout,
    canonicalize_dtype,
    check_dtype_in,
    check_tensor,
    host_index,
    parse_layout,
)
from ._plan import cdiv, next_pow2
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .kernels.merge import merge_state_kernel, merge_states_kernel
from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_MERGE_STATE = CachedLauncher(merge_state_kernel)
_MERGE_STATES = CachedLauncher(merge_states_kernel)

__all__ = [
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "MultiLevelCascadeAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
]

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_pair(v: torch.Tensor, s: torch.Tensor, vname: str, sname: str) -> None:
    check_tensor(v, vname, ndim=3, dtype=_V_DTYPES)
    check_tensor(s, sname, ndim=2, dtype=torch.float32)
    if tuple(s.shape) != tuple(v.shape[:2]) or s.device != v.device:
        raise ValueError(f"{sname}: expected shape {tuple(v.shape[:2])} on {v.device} to match {vname}, got {tuple(s.shape)} on {s.device}")
    if v.stride(-1) != 1:
        raise ValueError(f"{vname}: the last dimension must be contiguous")


def _blocks(num_heads: int, head_dim: int) -> Tuple[int, int]:
    block_d = max(16, next_pow2(head_dim))
    block_h = max(1, min(next_pow2(num_heads), 4096 // block_d))
    return block_h, block_d


def _launch_merge_two(v_a, s_a, v_b, s_b, v_out, s_out, mask: Optional[torch.Tensor]) -> None:
    n, num_heads, head_dim = v_a.shape
    if n == 0:
        return
    block_h, block_d = _blocks(num_heads, head_dim)
    grid = (n, cdiv(num_heads, block_h))
    _MERGE_STATE[grid](
        v_a, v_a.stride(0), v_a.stride(1), s_a, s_a.stride(0), s_a.stride(1),
        v_b, v_b.stride(0), v_b.stride(1), s_b, s_b.stride(0), s_b.stride(1),
        v_out, v_out.stride(0), v_out.stride(1), s_out, s_out.stride(0), s_out.stride(1),
        mask if mask is not None else s_out, num_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HAS_MASK=mask is not None,
    )


@_ops.custom_op("merge_state", mutates_args=("v_out", "s_out"))
def _merge_state_op(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, v_out: torch.Tensor,
                    s_out: torch.Tensor) -> None:
    _merge_state_checks(v_a, s_a, v_b, s_b)
    _launch_merge_two(v_a, s_a, v_b, s_b, v_out, s_out, None)


@_ops.custom_op("merge_state_in_place", mutates_args=("v", "s"))
def _merge_state_in_place_op(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                             mask: Optional[torch.Tensor]) -> None:
    # the checks and the launch, not the public name, which a caller may have replaced by its compiled self
    _merge_state_in_place_checks(v, s, v_other, s_other, mask)
    _launch_merge_two(v, s, v_other, s_other, v, s, mask)


@_ops.custom_op("merge_states", mutates_args=("out", "lse"))
def _merge_states_op(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    _merge_states_checks(v, s)
    _merge_states_into(v, s, out, lse)


def _merge_state_checks(v_a, s_a, v_b, s_b) -> None:
    _check_pair(v_a, s_a, "v_a", "s_a")
    _check_pair(v_b, s_b, "v_b", "s_b")
    if v_a.shape != v_b.shape or v_a.dtype != v_b.dtype:
        raise ValueError(f"v_b: expected shape {tuple(v_a.shape)} and dtype {v_a.dtype} like v_a, got {tuple(v_b.shape)}, {v_b.dtype}")


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states.

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, fp16, bf16 or fp32 (same dtype).
    s_a, s_b : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSEs.

    Returns
    -------
    ``(v, s)``: merged output in ``v_a``'s dtype and float32 LSE.
    """
    compiling = _ops.compiling()
    if not compiling:
        _merge_state_checks(v_a, s_a, v_b, s_b)
    v = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    if compiling:
        _merge_state_op(v_a, s_a, v_b, s_b, v, s)
    else:
        _launch_merge_two(v_a, s_a, v_b, s_b, v, s, None)
    return v, s


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v, v_other : torch.Tensor
        ``[seq_len, num_heads, head_dim]``.
    s, s_other : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSEs.
    mask : Optional[torch.Tensor]
        bool ``[seq_len]`` on the same device: rows where it is False are left unchanged (lets a
        CUDA graph skip rows without changing shapes).
    """
    if _ops.compiling():
        _merge_state_in_place_op(v, s, v_other, s_other, mask)
        return
    _merge_state_in_place_checks(v, s, v_other, s_other, mask)
    _launch_merge_two(v, s, v_other, s_other, v, s, mask)


def _merge_state_in_place_checks(v, s, v_other, s_other, mask) -> None:
    _check_pair(v, s, "v", "s")
    _check_pair(v_other, s_other, "v_other", "s_other")
    if v.shape != v_other.shape:
        raise ValueError(f"v_other: expected shape {tuple(v.shape)} like v, got {tuple(v_other.shape)}")
    if mask is not None:
        check_tensor(mask, "mask", ndim=1, dtype=torch.bool, device=v.device)
        if mask.numel() != v.shape[0]:
            raise ValueError(f"mask: expected {v.shape[0]} elements, got {mask.numel()}")


def merge_states(v: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``, fp16, bf16 or fp32.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]`` float32 base-2 LSEs.

    Returns
    -------
    ``(v, s)``: ``[seq_len, num_heads, head_dim]`` in ``v``'s dtype and float32 ``[seq_len, num_heads]``.
    """
    compiling = _ops.compiling()
    if not compiling:
        _merge_states_checks(v, s)
    out = torch.empty((v.shape[0], v.shape[2], v.shape[3]), dtype=v.dtype, device=v.device)
    lse = torch.empty((v.shape[0], v.shape[2]), dtype=torch.float32, device=v.device)
    if compiling:
        _merge_states_op(v, s, out, lse)
    else:
        _merge_states_into(v, s, out, lse)
    return out, lse


def _merge_states_checks(v: torch.Tensor, s: torch.Tensor) -> None:
    check_tensor(v, "v", ndim=4, dtype=_V_DTYPES)
    check_tensor(s, "s", ndim=3, dtype=torch.float32)
    if tuple(s.shape) != tuple(v.shape[:3]) or s.device != v.device:
        raise ValueError(f"s: expected shape {tuple(v.shape[:3])} on {v.device}, got {tuple(s.shape)} on {s.device}")
    if v.stride(-1) != 1:
        raise ValueError("v: the last dimension must be contiguous")


def _merge_states_into(v: torch.Tensor, s: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    n, num_states, num_heads, head_dim = v.shape
    if n == 0:
        return
    block_h, block_d = _blocks(num_heads, head_dim)
    _MERGE_STATES[(n, cdiv(num_heads, block_h))](
        v, v.stride(0), v.stride(1), v.stride(2),
        s, s.stride(0), s.stride(1), s.stride(2),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1),
        lse, num_heads, num_states,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HAS_MASK=False,
    )


# --------------------------------------------------------------------------------------------------
# cascade attention wrappers
# --------------------------------------------------------------------------------------------------


def _level_list(arr, name: str, num_levels: int) -> list:
    """A per-level argument: a list (or tuple) of exactly ``num_levels`` entries."""
    if arr is None:
        raise ValueError(f"{name}: expected a list of {num_levels} tensors (one per level), got None")
    if isinstance(arr, torch.Tensor) or not isinstance(arr, (list, tuple)):
        raise TypeError(f"{name}: expected a list of {num_levels} tensors (one per level), got {type(arr).__name__}")
    if len(arr) != num_levels:
        raise ValueError(f"{name}: expected {num_levels} entries (one per level; num_levels={num_levels}), got {len(arr)}")
    return list(arr)


class MultiLevelCascadeAttentionWrapper:
    """Cascade attention: each query attends to the KV of several levels, merged.

    Level ``i`` has its own page table into the one paged KV cache and its own ``qo_indptr``, which
    groups the query rows into that level's "requests": typically level 0 is one request holding
    every query that shares a prefix (so the prefix's pages are read once for all of them, as one
    prefill of many query rows), and the last level is one request per sequence with its own
    suffix. Every level covers every query row (``qo_indptr_arr[i][-1]`` is the same for all
    levels). The result equals attention over the concatenation of the KV a row sees in each
    level, in level order.

    One ``BatchPrefillWithPagedKVCacheWrapper`` per level, all sharing ``float_workspace_buffer``:
    levels run one after another on the same stream and each run merges its split-KV partial
    states before the next one starts, so they never use the workspace at the same time.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    >>> wrapper.plan([torch.tensor([0, batch]), torch.arange(batch + 1)],       # qo_indptr per level
    ...              [shared_indptr, unique_indptr], [shared_indices, unique_indices],
    ...              [shared_last_page_len, unique_last_page_len], 32, 8, 128, 16,
    ...              q_data_type=torch.bfloat16)
    >>> o = wrapper.run(q, kv_cache)  # q [batch, 32, 128] -> o [batch, 32, 128]

    Parameters
    ----------
    num_levels : int
        Number of levels (>= 1).
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states, shared by the levels (128 MB is plenty).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Each level's wrapper runs in CUDA-graph mode with the fixed buffers below (a fixed number
        of requests per level; a graph captured once stays correct after re-planning).
    qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr, paged_kv_last_page_len_buf_arr
        Lists of ``num_levels`` int32 device buffers (``[batch_i+1]``, ``[batch_i+1]``,
        ``[max_pages_i]``, ``[batch_i]`` for level i); required with ``use_cuda_graph`` and, as in
        FlashInfer, ignored without it.
    """

    def __init__(
        self,
        num_levels,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_indptr_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_indices_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_last_page_len_buf_arr: Optional[List[torch.Tensor]] = None,
    ) -> None:
        if not isinstance(num_levels, int) or isinstance(num_levels, bool) or num_levels < 1:
            raise ValueError(f"num_levels: expected a positive int, got {num_levels!r}")
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        parse_layout(kv_layout)
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        device = float_workspace_buffer.device
        if self._use_cuda_graph:
            names = ("qo_indptr_buf_arr", "paged_kv_indptr_buf_arr", "paged_kv_indices_buf_arr",
                     "paged_kv_last_page_len_buf_arr")
            arrs = (qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr, paged_kv_last_page_len_buf_arr)
            bufs = []
            for name, arr in zip(names, arrs):
                level_bufs = _level_list(arr, name, num_levels)
                for i, buf in enumerate(level_bufs):
                    check_tensor(buf, f"{name}[{i}]", ndim=1, dtype=torch.int32, device=device)
                bufs.append(level_bufs)
            self._wrappers = []
            for i in range(num_levels):
                try:
                    self._wrappers.append(BatchPrefillWithPagedKVCacheWrapper(
                        float_workspace_buffer, kv_layout, use_cuda_graph=True, qo_indptr_buf=bufs[0][i],
                        paged_kv_indptr_buf=bufs[1][i], paged_kv_indices_buf=bufs[2][i],
                        paged_kv_last_page_len_buf=bufs[3][i]))
                except ValueError as exc:
                    raise ValueError(f"level {i}: {exc}") from None
            # query rows of the current plan, on the device: a captured graph reads it at replay
            self._rows_buf = torch.zeros(1, dtype=torch.int32, device=device)
        else:
            self._wrappers = [BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
                              for _ in range(num_levels)]
            self._rows_buf = None
        self._planned = False

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(
        self, float_workspace_buffer: torch.Tensor, int_workspace_buffers: Optional[List[torch.Tensor]]
    ) -> None:
        """Replace the float workspace of every level. ``int_workspace_buffers`` (a list of
        ``num_levels`` tensors, or None) is accepted for compatibility: tritoninfer keeps its plans
        in buffers the wrappers own and needs no int workspace."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        ints = [None] * self._num_levels if int_workspace_buffers is None else \
            _level_list(int_workspace_buffers, "int_workspace_buffers", self._num_levels)
        for wrapper, int_ws in zip(self._wrappers, ints):
            wrapper.reset_workspace_buffer(float_workspace_buffer, int_ws)

    def plan(
        self,
        qo_indptr_arr: List[torch.Tensor],
        paged_kv_indptr_arr: List[torch.Tensor],
        paged_kv_indices_arr: List[torch.Tensor],
        paged_kv_last_page_len: List[torch.Tensor],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: str = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
    ):
        """Plan every level for one step (all layers).

        Parameters
        ----------
        qo_indptr_arr : List[torch.Tensor]
            ``num_levels`` int32 tensors ``[batch_i + 1]``: level i's request j owns query rows
            ``qo_indptr_arr[i][j]:qo_indptr_arr[i][j+1]``. All end at the same total row count.
        paged_kv_indptr_arr, paged_kv_indices_arr : List[torch.Tensor]
            ``num_levels`` int32 page tables ``[batch_i + 1]`` and ``[paged_kv_indptr_arr[i][-1]]``
            into the one paged KV cache.
        paged_kv_last_page_len : List[torch.Tensor]
            ``num_levels`` int32 tensors ``[batch_i]`` (1..page_size; a request without pages has
            KV length 0 in that level). Levels are separate page tables, so a level's last page
            may be partial.
        num_qo_heads, num_kv_heads, head_dim, page_size : int
        causal : bool
            Applied to the **last level only** (as FlashInfer): bottom-right aligned within that
            level's KV. Rows see all of the earlier levels' KV, so with each request's query
            tokens at the end of its last-level KV this is causal attention over the concatenation.
        pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta
            As for ``BatchPrefillWithPagedKVCacheWrapper.plan``, applied to every level
            separately (as FlashInfer): RoPE and ALiBi positions and the sliding window count from
            the start of each level's own KV, so only ``"NONE"`` and ``window_left=-1`` give
            attention over the concatenated KV.
        use_fp16_qk_reduction : bool
            Only False (``NotImplementedError`` otherwise).
        q_data_type, kv_data_type
            fp16/bf16 queries (default fp16, as FlashInfer: bf16 callers must pass it);
            fp16/bf16/e4m3/e5m2 KV (defaults to ``q_data_type``).
        """
        n = self._num_levels
        qo_arr = _level_list(qo_indptr_arr, "qo_indptr_arr", n)
        indptr_arr = _level_list(paged_kv_indptr_arr, "paged_kv_indptr_arr", n)
        indices_arr = _level_list(paged_kv_indices_arr, "paged_kv_indices_arr", n)
        last_arr = _level_list(paged_kv_last_page_len, "paged_kv_last_page_len", n)
        # host copies once here; the levels' plans take them as they are (no second device copy)
        qo_host = [host_index(t, f"qo_indptr_arr[{i}]") for i, t in enumerate(qo_arr)]
        for i, h in enumerate(qo_host):
            if h.numel() < 1:
                raise ValueError(f"qo_indptr_arr[{i}]: expected at least one element (batch_size + 1)")
        totals = [int(h[-1]) for h in qo_host]
        for i, total in enumerate(totals):
            if total != totals[-1]:
                raise ValueError(
                    f"qo_indptr_arr[{i}]: every level covers every query row, so its last element must "
                    f"equal the last level's {totals[-1]}; got {total}"
                )
        self._planned = False
        for i, wrapper in enumerate(self._wrappers):
            try:
                wrapper.plan(
                    qo_host[i], indptr_arr[i], indices_arr[i], last_arr[i], num_qo_heads, num_kv_heads, head_dim,
                    page_size, causal=bool(causal) if i == n - 1 else False, pos_encoding_mode=pos_encoding_mode,
                    use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, window_left=window_left,
                    logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                    q_data_type=q_data_type, kv_data_type=kv_data_type,
                )
            except ValueError as exc:
                raise ValueError(f"level {i}: {exc}") from None
        if self._rows_buf is not None:
            self._rows_buf.fill_(totals[-1])
        self._num_qo_heads, self._head_dim = num_qo_heads, head_dim
        self._planned = True

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache: PagedKVCache) -> torch.Tensor:
        """Cascade attention for the planned step.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim]`` in ``q_data_type`` (in CUDA-graph mode, at
            least that many rows; rows beyond the plan give 0).
        paged_kv_cache
            The one paged cache all levels index: any of FlashInfer's forms (see
            ``BatchDecodeWithPagedKVCacheWrapper.run``), in ``kv_data_type``.

        Returns
        -------
        ``o`` ``[q.shape[0], num_qo_heads, head_dim]`` in q's dtype. A row that sees no key in any
        level gives 0.
        """
        if not self._planned:
            raise ValueError("run() was called before plan() (or after a plan() that raised)")
        out = None
        mask = None
        if self._use_cuda_graph:
            check_tensor(q, "q", ndim=3)
            if tuple(q.shape[1:]) != (self._num_qo_heads, self._head_dim):
                raise ValueError(
                    f"q: expected shape (rows, {self._num_qo_heads}, {self._head_dim}) (rows, num_qo_heads, "
                    f"head_dim), got {tuple(q.shape)}"
                )
            # rows beyond the current plan are never written by the levels' kernels: zero them in
            # the graph, and keep the merges off them (the plan's row count is read on the device)
            out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            mask = torch.arange(q.shape[0], device=q.device) < self._rows_buf
        # the last level first, then merge the others into it, as FlashInfer does
        level = self._num_levels - 1
        try:
            out, lse = self._wrappers[-1].run(q, paged_kv_cache, out=out, return_lse=True)
            if self._num_levels > 1:
                out_i = torch.empty_like(out)
                lse_i = torch.empty_like(lse)
                for level, wrapper in enumerate(self._wrappers[:-1]):
                    wrapper.run(q, paged_kv_cache, out=out_i, lse=lse_i, return_lse=True)
                    merge_state_in_place(out, lse, out_i, lse_i, mask)
        except ValueError as exc:
            raise ValueError(f"level {level}: {exc}") from None
        return out

    forward = run


class _SharedPrefixAttention:
    """Every query row against one contiguous shared K/V: a single ragged-prefill request whose
    queries are all the rows, non-causal, so each shared K/V tile is loaded once per tile of
    query rows (not once per row). Planned once per (rows, shared length, dtypes, heads)."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str) -> None:
        self._wrapper = BatchPrefillWithRaggedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._layout = parse_layout(kv_layout)
        self._key = None

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        self._wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def check(self, k_shared, v_shared, num_kv_heads: int, head_dim: int) -> int:
        """Shape and dtype checks naming ``k_shared``/``v_shared``; returns the shared length."""
        check_tensor(k_shared, "k_shared", ndim=3, dtype=KV_DTYPES)
        check_tensor(v_shared, "v_shared", ndim=3, dtype=KV_DTYPES)
        nhd = self._layout == TensorLayout.NHD
        tok = 0 if nhd else 1
        shared_len = k_shared.shape[tok]
        form = "[shared_len, num_kv_heads, head_dim] (NHD)" if nhd else "[num_kv_heads, shared_len, head_dim] (HND)"
        expected = (shared_len, num_kv_heads, head_dim) if nhd else (num_kv_heads, shared_len, head_dim)
        for name, t in (("k_shared", k_shared), ("v_shared", v_shared)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name}: expected shape {expected}, {form}, got {tuple(t.shape)}")
        if v_shared.dtype != k_shared.dtype:
            raise ValueError(f"v_shared: dtype {v_shared.dtype} differs from k_shared's {k_shared.dtype}")
        return shared_len

    def run(self, q, k_shared, v_shared, num_qo_heads, num_kv_heads, head_dim, shared_len, *,
            use_fp16_qk_reduction=False, sm_scale=None, rope_scale=None, rope_theta=None):
        key = (q.shape[0], shared_len, q.dtype, k_shared.dtype, num_qo_heads, num_kv_heads, head_dim)
        if key != self._key:
            self._key = None
            self._wrapper.plan(
                torch.tensor([0, q.shape[0]], dtype=torch.int32), torch.tensor([0, shared_len], dtype=torch.int32),
                num_qo_heads, num_kv_heads, head_dim, causal=False, q_data_type=q.dtype, kv_data_type=k_shared.dtype,
            )
            self._key = key
        return self._wrapper.forward_return_lse(
            q, k_shared, v_shared, causal=False, pos_encoding_mode="NONE",
            use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale, rope_scale=rope_scale,
            rope_theta=rope_theta,
        )


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper:
    """Legacy two-level decode: a shared prefix held as contiguous K/V tensors, plus each request's
    own paged suffix (FlashInfer recommends ``MultiLevelCascadeAttentionWrapper`` instead).

    ``forward`` attends every query to the shared prefix as one prefill request whose queries are
    all the batch rows (non-causal: the prefix is read once for the whole batch), decodes each
    request over its unique pages, and merges the two states.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 split-KV workspace, shared by the two parts (they run one after the other).
    kv_layout : str
        ``"NHD"`` or ``"HND"``: of the shared K/V and of the unique paged cache.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._decode = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._shared = _SharedPrefixAttention(float_workspace_buffer, kv_layout)
        self._kv_layout = parse_layout(kv_layout)
        self._plan_args = None

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer) -> None:
        """Replace the float workspace (``int_workspace_buffer`` is accepted and not needed)."""
        self._decode.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._shared.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self,
        unique_kv_indptr: torch.Tensor,
        unique_kv_indices: torch.Tensor,
        unique_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        data_type: str = "float16",
    ) -> None:
        """Plan the unique (per-request) part.

        Parameters
        ----------
        unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len : torch.Tensor
            int32 page table of each request's own suffix: ``[batch+1]``, ``[unique_kv_indptr[-1]]``,
            ``[batch]``.
        num_qo_heads, num_kv_heads, head_dim, page_size : int
        data_type : str or torch.dtype
            dtype of the unique paged KV cache (FlashInfer's meaning: it plans with
            ``data_type=data_type``, which sets the KV dtype while the query dtype stays its
            float16 default, so bf16 queries raise there). tritoninfer takes the query dtype from
            ``q``: planned as ``data_type`` when that is fp16/bf16 (else fp16), and re-planned once
            by ``forward`` if ``q`` has the other 16-bit dtype.
        """
        kv_dtype = check_dtype_in(canonicalize_dtype(data_type, "data_type"), KV_DTYPES, "data_type")
        q_dtype = kv_dtype if kv_dtype in Q_DTYPES else torch.float16
        indptr_host = host_index(unique_kv_indptr, "unique_kv_indptr")
        last_host = host_index(unique_kv_last_page_len, "unique_kv_last_page_len")
        args = (indptr_host, unique_kv_indices, last_host, num_qo_heads, num_kv_heads, head_dim, page_size)
        self._plan_args = None
        self._plan(args, q_dtype, kv_dtype)

    def _plan(self, args, q_dtype, kv_dtype) -> None:
        try:
            self._decode.plan(*args, pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=kv_dtype)
        except ValueError as exc:
            raise ValueError(f"begin_forward(): {exc}") from None
        self._plan_args, self._q_dtype, self._kv_dtype = args, q_dtype, kv_dtype
        self._batch_size = args[0].numel() - 1

    def forward(
        self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, unique_kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """Decode attention over the shared prefix followed by each request's unique pages.

        Parameters
        ----------
        q : torch.Tensor
            ``[batch, num_qo_heads, head_dim]``, fp16 or bf16.
        k_shared, v_shared : torch.Tensor
            ``[shared_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, shared_len, head_dim]``
            (HND), fp16/bf16/fp8 (strided views with a contiguous last dim are fine).
        unique_kv_cache
            The unique paged cache, any of FlashInfer's forms, in ``data_type``.

        Returns
        -------
        ``o`` ``[batch, num_qo_heads, head_dim]`` in q's dtype. Softmax scale ``1/sqrt(head_dim)``,
        no positional encoding (as FlashInfer).
        """
        if self._plan_args is None:
            raise ValueError("forward() was called before begin_forward()")
        _, _, _, num_qo_heads, num_kv_heads, head_dim, _ = self._plan_args
        check_tensor(q, "q", ndim=3, dtype=Q_DTYPES)
        expected = (self._batch_size, num_qo_heads, head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q: expected shape {expected} (batch_size, num_qo_heads, head_dim), got {tuple(q.shape)}")
        kv = unpack_paged_kv_cache(unique_kv_cache, self._kv_layout)
        if kv.dtype != self._kv_dtype:
            raise ValueError(
                f"unique_kv_cache: dtype {kv.dtype} does not match the data_type {self._kv_dtype} given to begin_forward()"
            )
        shared_len = self._shared.check(k_shared, v_shared, num_kv_heads, head_dim)
        if q.dtype != self._q_dtype:
            self._plan(self._plan_args, q.dtype, self._kv_dtype)
        o, lse = self._shared.run(q, k_shared, v_shared, num_qo_heads, num_kv_heads, head_dim, shared_len)
        o_unique, lse_unique = self._decode.forward_return_lse(q, unique_kv_cache, pos_encoding_mode="NONE")
        merge_state_in_place(o, lse, o_unique, lse_unique)
        return o

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper:
    """Legacy two-level prefill/append: a shared prefix held as contiguous K/V tensors, plus each
    request's own paged KV (FlashInfer recommends ``MultiLevelCascadeAttentionWrapper`` instead).

    ``forward`` attends every query row to the whole shared prefix (one prefill request holding
    all rows, non-causal), runs batch prefill over the unique pages (causal if asked), and merges.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 split-KV workspace, shared by the two parts.
    kv_layout : str
        ``"NHD"`` or ``"HND"``: of the shared K/V and of the unique paged cache.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._shared = _SharedPrefixAttention(float_workspace_buffer, kv_layout)
        self._kv_layout = parse_layout(kv_layout)
        self._plan_args = None

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace (``int_workspace_buffer`` is accepted and not needed)."""
        self._prefill.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._shared.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
    ) -> None:
        """Plan the unique (per-request) part.

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch+1]``: request i's query rows.
        paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len : torch.Tensor
            int32 page table of each request's unique KV: ``[batch+1]``, ``[paged_kv_indptr[-1]]``,
            ``[batch]``.
        num_qo_heads, num_kv_heads, head_dim, page_size : int

        There is no dtype argument: FlashInfer plans fp16 queries and KV here, so other dtypes
        raise there. tritoninfer plans fp16 and re-plans once in ``forward`` when ``q`` or the
        unique cache has another dtype.
        """
        args = (host_index(qo_indptr, "qo_indptr"), host_index(paged_kv_indptr, "paged_kv_indptr"), paged_kv_indices,
                host_index(paged_kv_last_page_len, "paged_kv_last_page_len"), num_qo_heads, num_kv_heads, head_dim,
                page_size)
        self._plan_args = None
        self._plan(args, torch.float16, torch.float16)

    def _plan(self, args, q_dtype, kv_dtype) -> None:
        self._prefill.plan(*args, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._plan_args, self._q_dtype, self._kv_dtype = args, q_dtype, kv_dtype
        qo_host = args[0]
        self._total_rows = int(qo_host[-1]) if qo_host.numel() else 0

    def forward(
        self,
        q: torch.Tensor,
        k_shared: torch.Tensor,
        v_shared: torch.Tensor,
        unique_kv_cache: PagedKVCache,
        causal: bool = False,
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Prefill/append attention over the shared prefix followed by each request's unique KV.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim]``, fp16 or bf16.
        k_shared, v_shared : torch.Tensor
            ``[shared_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, shared_len, head_dim]``
            (HND).
        unique_kv_cache
            The unique paged cache, any of FlashInfer's forms.
        causal : bool
            Applied to the unique part only (bottom-right aligned within each request's unique
            KV); every row sees the whole shared prefix. With each request's query tokens at the
            end of its unique KV this is causal attention over prefix + unique KV.
        use_fp16_qk_reduction : bool
            Only False (``NotImplementedError`` otherwise).
        sm_scale, rope_scale, rope_theta : Optional[float]
            For both parts (no positional encoding is applied, as in FlashInfer, so the rope
            values have no effect).

        Returns
        -------
        ``o`` ``[qo_indptr[-1], num_qo_heads, head_dim]`` in q's dtype.
        """
        if self._plan_args is None:
            raise ValueError("forward() was called before begin_forward()")
        num_qo_heads, num_kv_heads, head_dim = self._plan_args[4:7]
        check_tensor(q, "q", ndim=3, dtype=Q_DTYPES)
        expected = (self._total_rows, num_qo_heads, head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q: expected shape {expected} (qo_indptr[-1], num_qo_heads, head_dim), got {tuple(q.shape)}")
        kv = unpack_paged_kv_cache(unique_kv_cache, self._kv_layout)
        check_dtype_in(kv.dtype, KV_DTYPES, "unique_kv_cache")
        shared_len = self._shared.check(k_shared, v_shared, num_kv_heads, head_dim)
        if (q.dtype, kv.dtype) != (self._q_dtype, self._kv_dtype):
            self._plan(self._plan_args, q.dtype, kv.dtype)
        o, lse = self._shared.run(q, k_shared, v_shared, num_qo_heads, num_kv_heads, head_dim, shared_len,
                                  use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
                                  rope_scale=rope_scale, rope_theta=rope_theta)
        o_unique, lse_unique = self._prefill.forward_return_lse(
            q, unique_kv_cache, causal=causal, pos_encoding_mode="NONE", use_fp16_qk_reduction=use_fp16_qk_reduction,
            sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        )
        merge_state_in_place(o, lse, o_unique, lse_unique)
        return o

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""
