"""Decode attention: ``single_decode_with_kv_cache``, ``BatchDecodeWithPagedKVCacheWrapper``,
``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` and ``fast_decode_plan`` (FlashInfer 0.5.3's API).

Both ``use_tensor_cores`` settings run tritoninfer's one attention kernel (the GQA group is the M
dimension of ``tl.dot``, as in FlashInfer's tensor-core path), so they give the same numbers; the
property is kept because engines read it and because FlashInfer ties ``fixed_split_size`` and
``q_len_per_req > 1`` to it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from . import _device, _ops, _route
from ._attention import KVSource, PlanUploader, score_params, scratch_workspace
from ._replay import RunReplay, capturing, replayed, scalar_options
from ._kvcache import (
    CacheViews,
    HostPageTable,
    PagedKVCache,
    check_graph_plan,
    copy_graph_page_table,
    host_page_table,
    init_graph_page_table,
    page_table_from_block_tables,
)
from ._options import (
    KV_DTYPES,
    cached_by_value,
    Q_DTYPES,
    TensorLayout,
    check_head_dim,
    check_heads,
    check_out,
    check_query,
    check_sinks,
    host_index,
    check_positive_int,
    check_tensor,
    parse_layout,
    plan_dtypes,
)
from . import _plan
from ._route import Route
from ._step import NO_ROUTE, PlannedStep, Settings, init_planned_wrapper, plan_single, plan_work, run_step, upload_plan

__all__ = [
    "single_decode_with_kv_cache",
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
]

# FlashInfer backend names; every one selects tritoninfer's Triton kernels.
DECODE_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "triton")


@functools.lru_cache(maxsize=64)
def _causal(params):
    """The causal variant of a plan's score parameters, one object per plan's parameters (the
    bound launches on a plan are keyed by the identity of their parameters)."""
    return dataclasses.replace(params, causal=True)


# the last single_decode_with_kv_cache call's replay (one slot: every call that takes the full path
# replaces it, so it never names a launch that another step has been bound to since; the call's facts
# and options fix its step, so the function's name stands for it)
_SINGLE_REPLAY: list = [None]
_SINGLE_DECODE = "single_decode_with_kv_cache"


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Decode attention of one query token over one request's contiguous KV.

    Parameters
    ----------
    q : torch.Tensor
        ``[num_qo_heads, head_dim]``, fp16 or bf16.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND);
        fp16, bf16, float8_e4m3fn or float8_e5m2 (K and V share a dtype).
    kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta
        As ``BatchDecodeWithPagedKVCacheWrapper.plan``.
    use_tensor_cores : bool
        Accepted for compatibility; both settings run the same Triton kernel.
    q_scale, k_scale, v_scale : Optional[float]
        fp8 calibration scales: ``q_scale * k_scale`` multiplies ``sm_scale``, ``v_scale`` the output.
    return_lse : bool
        Also return the base-2 log-sum-exp of the logits, float32 ``[num_qo_heads]``.

    Returns
    -------
    ``o`` ``[num_qo_heads, head_dim]`` in q's dtype, and ``lse`` when ``return_lse``. An empty KV
    gives output 0 and LSE -inf.
    """
    if _ops.compiling():
        out = torch.empty((q.shape[0], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[0],), dtype=torch.float32, device=q.device) if return_lse else None
        _single_decode_op(q, k, v, out, lse, kv_layout, str(pos_encoding_mode), q_scale, k_scale, v_scale, window_left,
                          logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return (out, lse) if return_lse else out
    # a model's layers call this with tensors that differ only in their addresses: the last call's launch
    # if this one matches it (_replay.py), never while a CUDA graph is captured (plan_single's rule)
    options = (kv_layout, pos_encoding_mode, q_scale, k_scale, v_scale, window_left, logits_soft_cap, sm_scale,
               rope_scale, rope_theta)
    replayable = scalar_options(q_scale, k_scale, v_scale, window_left, logits_soft_cap, sm_scale, rope_scale,
                                rope_theta) and not capturing(q)
    if replayable and _SINGLE_REPLAY[0] is not None:
        done = _SINGLE_REPLAY[0].run(_SINGLE_DECODE, (q, k, v), options, None, None, return_lse)
        if done is not None:
            return (done[0][0], done[1][0]) if return_lse else done[0][0]
    check_tensor(q, "q", ndim=2, dtype=Q_DTYPES)
    check_tensor(k, "k", ndim=3, dtype=KV_DTYPES)
    check_tensor(v, "v", ndim=3, dtype=KV_DTYPES)
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share a dtype, got {k.dtype} and {v.dtype}")
    layout = parse_layout(kv_layout)
    if layout == TensorLayout.NHD:
        kv_len, num_kv_heads, head_dim = k.shape
        tok_dim, head_axis = 0, 1
    else:
        num_kv_heads, kv_len, head_dim = k.shape
        tok_dim, head_axis = 1, 0
    num_qo_heads = q.shape[0]
    check_heads(num_qo_heads, num_kv_heads)
    check_head_dim(head_dim)
    if q.shape[1] != head_dim:
        raise ValueError(f"q: head_dim {q.shape[1]} does not match k's head_dim {head_dim}")
    if v.shape[tok_dim] != kv_len or v.shape[head_axis] != num_kv_heads:
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)}")
    head_dim_vo = v.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim)

    device = q.device
    _device.check_launchable(device, "single_decode_with_kv_cache")
    tiles = _decode_tiles(num_qo_heads // num_kv_heads, 1, head_dim, k.element_size(), _lanes_ok(params))
    settings = Settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
    step = plan_single(device, settings=settings, params=params, q_dtype=q.dtype, kv_dtype=k.dtype,
                       num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                       head_dim_vo=head_dim_vo, qo_len=1, kv_len=kv_len, tiles=tiles, q_len_per_req=1)
    kv = KVSource(k, v, (k.stride(tok_dim), 0, k.stride(head_axis)), (v.stride(tok_dim), 0, v.stride(head_axis)),
                  0, step.kv_indptr)
    out = torch.empty((1, num_qo_heads, head_dim_vo), dtype=q.dtype, device=device)
    lse = torch.empty((1, num_qo_heads), dtype=torch.float32, device=device) if return_lse else None
    call = run_step(step, q=q.unsqueeze(0), kv=kv, out=out, lse=lse, workspace=scratch_workspace(device),
                    q_len_per_req=1, state_mult=1, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    if replayable:
        # (the facts and options fix the step, so the replay is keyed by this function, the step kept alive)
        _SINGLE_REPLAY[0] = RunReplay.record(_SINGLE_DECODE, (q, k, v), options, None, None, out, lse, return_lse,
                                             False, (call,), keep=step)
    if return_lse:
        return out[0], lse[0]
    return out[0]


@_ops.custom_op("single_decode", mutates_args=("out", "lse"))
def _single_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
                      kv_layout: str, pos_encoding_mode: str, q_scale: Optional[float], k_scale: Optional[float],
                      v_scale: Optional[float], window_left: int, logits_soft_cap: Optional[float],
                      sm_scale: Optional[float], rope_scale: Optional[float], rope_theta: Optional[float]) -> None:
    """``single_decode_with_kv_cache`` into ``out`` (and ``lse``), for torch.compile (``_ops.py``)."""
    result = _single_decode_eager(
        q, k, v, kv_layout, pos_encoding_mode, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
        rope_theta=rope_theta, return_lse=lse is not None)
    if lse is not None:
        out.copy_(result[0])
        lse.copy_(result[1])
    else:
        out.copy_(result)


# the eager function itself, for its custom op: the public name may be replaced by its compiled self
_single_decode_eager = single_decode_with_kv_cache


def plan_paged_decode(wrapper, uploader: PlanUploader, workspace_bytes: int, table: HostPageTable,
                      kv_lens: np.ndarray, indices: torch.Tensor, *, tiles, settings: Settings, params, q_dtype,
                      kv_dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      fixed_split_size: Optional[int] = None, disable_split_kv: bool = False,
                      qo: Optional[np.ndarray] = None, heaviest_first: Optional[bool] = None, non_blocking: bool = True,
                      copy_page_table: bool = True, route: Route = NO_ROUTE) -> PlannedStep:
    """The step of a paged decode batch (one query token per request) from its checked host page
    table: the work list, one upload and, in CUDA-graph mode (``wrapper._graph``), the checks against
    and copies into the wrapper's fixed page-table buffers. The decode wrapper's ``plan()`` and POD's
    decode half both plan here; they differ in ``tiles``, ``qo`` (the query indptr to upload; None:
    one token per request, read by position) and ``heaviest_first`` (``plan_work``); ``route``: the kernel
    the decode wrapper's runs take (``_route.DECODE``; POD runs its decode half itself)."""
    batch = int(kv_lens.size)
    graph = wrapper._graph
    num_sms = wrapper._num_sms
    if graph is not None:
        check_graph_plan(batch, wrapper._fixed_batch_size, table.num_pages_used, wrapper._paged_kv_indices_buf)
        if not graph.sized:
            # depends on the batch only, so the buffers (and captured graphs) survive any re-plan
            graph.size(rows=batch, q_tiles=batch, batch=batch, tiles=tiles, num_sms=num_sms, workspace_bytes=workspace_bytes,
                       num_qo_heads=num_qo_heads, head_dim_vo=head_dim)
    work = plan_work(qo_lens=None, kv_lens=kv_lens, tiles=tiles, num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, head_dim_vo=head_dim, page_size=page_size,
                     fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                     workspace_bytes=workspace_bytes, num_sms=num_sms, graph=graph,
                     heaviest_first=heaviest_first)
    # the kernels read the plan's own indptr (checked on the host); in CUDA-graph mode the fixed buffers
    extra = [table.indptr, table.last_page_len] if graph is not None else [table.indptr]
    plan, (indptr_d, *rest) = upload_plan(uploader, graph, work, kv_lens, qo, extra, non_blocking)
    if graph is not None:
        if copy_page_table:
            copy_graph_page_table(wrapper, indptr_d, indices, rest[0], table.num_pages_used, non_blocking)
        kv_indptr_d, kv_indices_d = wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf
    else:
        kv_indptr_d = indptr_d
        kv_indices_d = indices if indices.dtype is torch.int32 and indices.device == wrapper.device else \
            indices.to(wrapper.device, torch.int32, non_blocking=non_blocking)
    return PlannedStep(
        settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim, page_size=page_size, batch=batch,
        total_rows=batch, total_kv=0, kv_lens=kv_lens, tiles=tiles, device_plan=plan,
        kv_indptr=kv_indptr_d, kv_indices=kv_indices_d, page_table=table, route=route)


class BatchDecodeWithPagedKVCacheWrapper:
    """Batch decode attention over a paged KV cache, planned once per step and run per layer.

    ``plan()`` does the host work (host copies of the page table, split-KV decision, work list)
    and keeps the result in device buffers this wrapper owns, so several wrappers can share one
    ``float_workspace_buffer`` and all be planned before any runs. ``run()`` checks its inputs
    against the plan and launches; it never synchronises with the host and can be captured in a
    CUDA graph.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    >>> wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
    ...              q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    >>> o = wrapper.run(q, kv_cache)  # q [batch, 32, 128] -> o [batch, 32, 128]

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states (FlashInfer recommends 128 MB). Its size is
        checked against each plan.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Fixed batch size and buffers: the launch grid does not depend on planned lengths, so a
        graph captured after one ``plan()`` stays correct after later plans.
    use_tensor_cores : bool
        Kept for compatibility (see the module docstring).
    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
        int32 buffers ``[batch+1]``, ``[max_pages]``, ``[batch]``; required with ``use_cuda_graph``.
    backend : str
        One of ``"auto"``, ``"fa2"``, ``"fa3"``, ``"trtllm-gen"``, ``"triton"``: every value runs
        tritoninfer's Triton kernels. Other values raise ``ValueError``.
    jit_args : Optional[List[Any]]
        FlashInfer's custom CUDA variants; tritoninfer cannot compile CUDA source, so anything but
        ``None`` raises ``NotImplementedError``.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Optional[List[Any]] = None,
    ) -> None:
        init_planned_wrapper(self, float_workspace_buffer, use_cuda_graph)
        self._kv_layout = parse_layout(kv_layout)
        self._caches = CacheViews(self._kv_layout)
        if backend not in DECODE_BACKENDS:
            raise ValueError(f"backend: expected one of {DECODE_BACKENDS}, got {backend!r}")
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom CUDA attention variants cannot run on tritoninfer's Triton kernels")
        self._backend = backend
        self._use_tensor_cores = bool(use_tensor_cores)
        init_graph_page_table(self, use_cuda_graph, paged_kv_indptr_buffer, paged_kv_indices_buffer,
                              paged_kv_last_page_len_buffer)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace. ``int_workspace_buffer`` is accepted for compatibility:
        tritoninfer keeps its plan in buffers the wrapper owns and needs no int workspace."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._float_workspace_buffer = float_workspace_buffer

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        q_data_type: Optional[Union[str, torch.dtype]] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        data_type: Optional[Union[str, torch.dtype]] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        block_tables: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan batch decode for one step (all layers).

        Parameters
        ----------
        indptr : torch.Tensor
            ``[batch_size + 1]`` int32: pages of request i are ``indices[indptr[i]:indptr[i+1]]``.
            A CPU tensor costs no device sync.
        indices : torch.Tensor
            ``[indptr[-1]]`` int32 page ids.
        last_page_len : torch.Tensor
            ``[batch_size]`` int32, entries used in each request's last page (1..page_size; 0 for
            a request with no pages).
        num_qo_heads, num_kv_heads, head_dim, page_size : int
            Head counts (``num_qo_heads % num_kv_heads == 0``), head_dim (a multiple of 8 up to
            256) and tokens per page.
        pos_encoding_mode : str
            ``"NONE"``, ``"ROPE_LLAMA"`` (rotate-half RoPE applied on the fly to q and K; the cache
            holds un-rotated K) or ``"ALIBI"``.
        window_left : int
            Sliding window: attend to the last ``window_left + 1`` keys; -1 disables it.
        logits_soft_cap : Optional[float]
            ``cap * tanh(logits * sm_scale / cap)``; None or 0 disables it.
        q_data_type, kv_data_type, data_type
            dtypes (``torch.dtype`` or name). ``kv_data_type`` defaults to ``q_data_type``;
            the deprecated ``data_type`` fills whichever of the two is None.
        sm_scale, rope_scale, rope_theta : Optional[float]
            Defaults ``1/sqrt(head_dim)``, 1 and 1e4.
        non_blocking : bool
            Host-to-device copies of the plan are asynchronous (pinned memory) when True.
        block_tables, seq_lens : Optional[torch.Tensor]
            The alternative page-table form: ``block_tables`` int32 ``[batch, max_pages]`` and
            ``seq_lens`` int32 ``[batch]`` KV lengths. When ``block_tables`` is given it replaces
            ``indptr``/``indices``/``last_page_len``. ``seq_lens`` alone overrides the KV
            lengths computed from ``last_page_len``.
        fixed_split_size : Optional[int]
            Split each request's KV into chunks of this many pages, independently of the rest of
            the batch (batch-invariant results). Tensor-core path only, as in FlashInfer.
        disable_split_kv : bool
            Never split KV: each request's output comes from one program (batch-invariant).
        """
        if fixed_split_size is not None and not self.use_tensor_cores:
            raise ValueError("fixed_split_size is only supported by tensor core decode for now.")
        if block_tables is not None:
            indptr_host, indices, last_page_len_host = page_table_from_block_tables(block_tables, seq_lens, page_size)
            indptr, last_page_len, seq_lens = indptr_host, last_page_len_host, None
        else:
            indptr_host = host_index(indptr, "indptr")
            last_page_len_host = host_index(last_page_len, "last_page_len")
        self._plan_impl(
            indptr_host, indptr, indices, last_page_len_host, last_page_len, num_qo_heads, num_kv_heads, head_dim,
            page_size, pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
            sm_scale, rope_scale, rope_theta, non_blocking, seq_lens, fixed_split_size, disable_split_kv,
            copy_page_table=True,
        )

    begin_forward = plan

    def _plan_impl(
        self, indptr_host, indptr, indices, last_page_len_host, last_page_len, num_qo_heads, num_kv_heads,
        head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type,
        data_type, sm_scale, rope_scale, rope_theta, non_blocking, seq_lens, fixed_split_size,
        disable_split_kv, copy_page_table,
    ) -> None:
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        config = _decode_config(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                                logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta)
        table = host_page_table(indptr_host, last_page_len_host, indices, page_size)
        if seq_lens is not None:
            pages = table.indptr[1:] - table.indptr[:-1]
            kv_lens = host_index(seq_lens, "seq_lens").numpy().astype(np.int64)
            if kv_lens.size != pages.size or (kv_lens > pages * page_size).any():
                raise ValueError("seq_lens: expected one length per request, each within its pages")
        else:
            kv_lens = table.kv_lens
        self._step = plan_paged_decode(
            self, self._uploader, self._float_workspace_buffer.numel(), table, kv_lens, indices,
            tiles=config.tiles, settings=config.settings, params=config.params, q_dtype=config.q_dtype,
            kv_dtype=config.kv_dtype, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv, non_blocking=non_blocking, copy_page_table=copy_page_table,
            route=_decode_route(_route.DECODE_HOPPER_FP8, self.device, config.q_dtype, config.kv_dtype, num_qo_heads,
                                num_kv_heads, head_dim, page_size, config.params, config.tiles.block_n,
                                self._graph is not None, fixed_split_size))

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
        q_len_per_req: Optional[int] = 1,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Decode attention for the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[batch_size * q_len_per_req, num_qo_heads, head_dim]`` in ``q_data_type``.
        paged_kv_cache
            5-D ``[P, 2, page_size, H_kv, D]`` (NHD) / ``[P, 2, H_kv, page_size, D]`` (HND), a
            ``(k, v)`` tuple of 4-D tensors, or for page size 1 a tuple of 3-D ``[tokens, H_kv, D]``
            tensors; in ``kv_data_type``. Strided views are fine (the last dim must be contiguous).
        *args
            FlashInfer passes these to custom JIT kernels; tritoninfer has none, so any raises.
        q_scale, k_scale, v_scale : Optional[float]
            ``q_scale * k_scale`` multiplies ``sm_scale``; ``v_scale`` multiplies the output.
        out, lse : Optional[torch.Tensor]
            Preallocated ``[batch_size * q_len_per_req, num_qo_heads, head_dim]`` (q's dtype) and
            float32 ``[batch_size * q_len_per_req, num_qo_heads]``.
        return_lse : bool
            Also return the base-2 LSE (excluding sinks).
        enable_pdl : Optional[bool]
            Programmatic dependent launch is a CUDA launch attribute Triton does not expose; the
            value is accepted and has no effect on results.
        window_left : Optional[int]
            Must equal the planned value (as FlashInfer asserts).
        sinks : Optional[torch.Tensor]
            float32 ``[num_qo_heads]`` attention-sink logits (natural-log units, like the scaled
            logits), added to the softmax denominator only.
        q_len_per_req : int
            Query tokens per request (speculative decoding); >1 is causal among the request's own
            tokens and needs ``use_tensor_cores=True`` and kv_len >= q_len_per_req, as in FlashInfer.

        Returns
        -------
        ``o`` (and ``lse`` when ``return_lse``). Empty requests give 0 and LSE -inf.
        """
        if args:
            raise TypeError(
                "run(): options after paged_kv_cache must be passed by keyword; positional extras are "
                "FlashInfer's custom-JIT arguments, which tritoninfer does not have"
            )
        if _ops.compiling():
            return _ops.traced_run(self, q, paged_kv_cache, out, lse, return_lse, sinks=sinks, q_scale=q_scale,
                                   k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                                   q_len_per_req=1 if q_len_per_req is None else q_len_per_req)
        return self._run(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks,
                         q_len_per_req)

    def _run(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks,
             q_len_per_req):
        """``run()``'s work (``_ops.wrapper_run`` calls this, never the ``run`` attribute, which a caller
        may have wrapped in ``torch.compile``)."""
        step = self._step
        # the common call (no sinks or window, one query token, scales as numbers): the last such call's
        # launch if it matches (_replay.py)
        options = (q_scale, k_scale, v_scale)
        plain = (sinks is None and window_left is None and (q_len_per_req == 1 or q_len_per_req is None)
                 and scalar_options(*options))
        if plain:
            inputs = (q, *paged_kv_cache) if type(paged_kv_cache) is tuple else (q, paged_kv_cache)
            done = replayed(self, inputs, options, out, lse, return_lse)
            if done is not None:
                return done
        if step is None:
            raise ValueError("run() was called before plan()")
        if window_left is not None and window_left != step.settings.window_left:
            raise ValueError(f"window_left: run() got {window_left} but plan() used {step.settings.window_left}")
        L = 1 if q_len_per_req is None else int(q_len_per_req)
        if L < 1:
            raise ValueError(f"q_len_per_req: expected a positive int, got {q_len_per_req!r}")
        if L > 1:
            if not self._use_tensor_cores:
                raise ValueError("q_len_per_req > 1 requires use_tensor_cores=True")
            if step.min_kv_len < L:
                raise ValueError(f"q_len_per_req={L} requires kv_len >= q_len_per_req for every request")
        check_query(q, step.q_dtype, (step.batch * L, step.num_qo_heads, step.head_dim_qk),
                    "(batch_size * q_len_per_req, num_qo_heads, head_dim)")
        kv, source = self._caches.source(paged_kv_cache, step, self._kv_source)
        if kv.device != q.device:
            raise ValueError("paged_kv_cache and q must be on the same device")
        out_arg, lse_arg = out, lse
        out = check_out(out, (q.shape[0], step.num_qo_heads, kv.head_dim_vo), q.dtype, q.device, "out")
        if lse is not None or return_lse:
            # a caller's lse buffer is written whether or not it is returned, as in FlashInfer
            lse = check_out(lse, (q.shape[0], step.num_qo_heads), torch.float32, q.device, "lse")
        sinks = check_sinks(sinks, step.num_qo_heads, q.device)
        params = step.params if L == 1 else _causal(step.params)
        call = run_step(
            step, q=q, out=out, lse=lse, workspace=self._float_workspace_buffer, kv=source, params=params, tiles=step.tiles if L == 1 else _decode_tiles(
                step.group, L, step.head_dim_qk, step.kv_dtype.itemsize, _lanes_ok(params)),
            q_len_per_req=L, state_mult=L, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks, route_kv=kv,
        )
        if plain:
            self._replay = RunReplay.record(step, inputs, options, out_arg, lse_arg, out, lse, return_lse, False, (call,),
                                            self._replay)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def _kv_source(self, kv) -> KVSource:
        """The checks of a cache against the plan, and the kernel's view of it (once per cache and
        plan: ``CacheViews``)."""
        step = self._step
        if kv.dtype != step.kv_dtype:
            raise ValueError(
                f"The dtype of paged_kv_cache {kv.dtype} does not match the kv_data_type "
                f"{step.kv_dtype} specified in plan function."
            )
        if (kv.page_size, kv.num_heads, kv.head_dim_qk) != (step.page_size, step.num_kv_heads, step.head_dim_qk):
            raise ValueError(
                f"paged_kv_cache: page_size/num_kv_heads/head_dim are {kv.page_size}/{kv.num_heads}/{kv.head_dim_qk}, "
                f"plan() used {step.page_size}/{step.num_kv_heads}/{step.head_dim_qk}"
            )
        step.page_table.check_cache(kv.k.shape[0])
        return KVSource(kv.k, kv.v, kv.k_strides, kv.v_strides, kv.page_size, step.kv_indptr, step.kv_indices,
                        kv.k.shape[0])

    def _run_into(self, q, paged_kv_cache, out, lse, *, sinks, q_scale, k_scale, v_scale, window_left,
                  q_len_per_req) -> None:
        """``run()`` into ``out``/``lse``, eagerly: the implementation of ``_ops.wrapper_run``."""
        self._run(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, False, window_left, sinks, q_len_per_req)

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        pos_encoding_mode: str = "NONE",
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (FlashInfer 0.5.3 semantics): overwrites the planned pos-encoding, window,
        soft cap, sm_scale and rope settings with these arguments, defaults included, then runs."""
        self._override(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor,
        pos_encoding_mode: str = "NONE",
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: as ``forward``, returning ``(o, lse)``."""
        self._override(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)

    def _override(self, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta) -> None:
        if self._step is None:
            raise ValueError("forward() was called before plan()")
        params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                              self._step.head_dim_qk)
        tiles = _decode_tiles(self._step.group, 1, self._step.head_dim_qk, self._step.kv_dtype.itemsize,
                              _lanes_ok(params))
        settings = Settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        step = self._step
        if params is step.params and tiles is step.tiles and settings == step.settings:
            return  # (SGLang calls forward() with the same scores every layer: the step, and its replay, stay)
        self._step = dataclasses.replace(step.with_scores(settings, params), tiles=tiles)

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """``BatchDecodeWithPagedKVCacheWrapper`` with ``use_cuda_graph=True`` and its fixed buffers."""

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        indptr_buffer: torch.Tensor,
        indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ) -> None:
        super().__init__(
            workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )

    # FlashInfer lists run_return_lse with return_lse=True as an explicit keyword default here
    def run_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        *args,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = True,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
        q_len_per_req: Optional[int] = 1,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """``run`` returning ``(o, lse)`` by default."""
        return self.run(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
                        lse=lse, return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left,
                        sinks=sinks, q_len_per_req=q_len_per_req)


def fast_decode_plan(
    self,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    q_data_type: Optional[Union[str, torch.dtype]] = None,
    kv_data_type: Optional[Union[str, torch.dtype]] = None,
    data_type: Optional[Union[str, torch.dtype]] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    non_blocking: bool = True,
    fixed_split_size: Optional[int] = None,
    disable_split_kv: bool = False,
    global_override_indptr_cpu: Optional[torch.Tensor] = None,
) -> None:
    """``plan()`` for engines that keep the page table in the CUDA-graph buffers themselves
    (SGLang monkey-patches it onto decode wrappers).

    Differences from ``plan()``, as in FlashInfer: the fixed buffers are not copied into (the
    caller has written them; a tensor other than the buffer is still copied), ``global_override_indptr_cpu``
    supplies the host indptr so no device-to-host copy is needed, and with ``page_size == 1`` the
    last page lengths are known to be 1 and are not read back either.
    """
    batch = len(last_page_len)
    indptr_host = global_override_indptr_cpu if global_override_indptr_cpu is not None else host_index(indptr, "indptr")
    if page_size == 1:
        last_page_len_host = (torch.diff(indptr_host.to(torch.int64)) > 0).to(torch.int32)
    else:
        last_page_len_host = host_index(last_page_len, "last_page_len")
    if indptr_host.numel() != batch + 1:
        raise ValueError(f"indptr: expected {batch + 1} elements, got {indptr_host.numel()}")
    copy = not self._use_cuda_graph or not (
        indptr.data_ptr() == self._paged_kv_indptr_buf.data_ptr()
        and indices.data_ptr() == self._paged_kv_indices_buf.data_ptr()
    )
    self._plan_impl(
        indptr_host, indptr, indices, last_page_len_host, last_page_len, num_qo_heads, num_kv_heads, head_dim,
        page_size, pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
        sm_scale, rope_scale, rope_theta, non_blocking, None, fixed_split_size, disable_split_kv,
        copy_page_table=copy,
    )


class _DecodeConfig(NamedTuple):
    """What a decode plan's arguments other than the page table fix (checked once per combination:
    plan() runs every step)."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    params: Any
    settings: Settings
    tiles: Any


def _parse_decode_config(num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left,
                         logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale,
                         rope_theta) -> _DecodeConfig:
    q_dtype, kv_dtype = plan_dtypes(q_data_type, kv_data_type, data_type, q_default="float16")
    group = check_heads(num_qo_heads, num_kv_heads)
    check_head_dim(head_dim)
    check_positive_int(page_size, "page_size")
    params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim)
    return _DecodeConfig(q_dtype, kv_dtype, params,
                         Settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta),
                         _decode_tiles(group, 1, head_dim, kv_dtype.itemsize, _lanes_ok(params)))


# the checked configuration of a decode plan, once per combination of arguments (plan() runs every step);
# raises ``ValueError`` naming a bad argument
_decode_config = cached_by_value(_parse_decode_config)


@functools.lru_cache(maxsize=256)
def _decode_route(enabled: bool, device, q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, page_size, params,
                  split_align, use_cuda_graph, fixed_split_size) -> Route:
    """``_route.DECODE``'s choice for a decode plan (once per combination: plan() runs every step;
    ``enabled`` is ``_route.DECODE_HOPPER_FP8``, in the key so that setting it takes effect)."""
    return _route.DECODE.at_plan(device, q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, page_size, params,
                                 use_cuda_graph, fixed_split_size, split_align)


@functools.lru_cache(maxsize=None)
def _decode_tiles(group: int, q_len_per_req: int, head_dim: int, kv_elem_bytes: int, lanes_ok: bool):
    return _plan.decode_tiles(group, q_len_per_req, head_dim, kv_elem_bytes, lanes_ok)


def _lanes_ok(params) -> bool:
    """Whether the dot-free single-row path computes these scores (it has no RoPE or ALiBi)."""
    return not (params.rope or params.alibi)
