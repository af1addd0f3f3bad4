"""POD-Attention (FlashInfer 0.5.3's ``flashinfer.pod``): a prefill and a decode batch in one launch.

``PODWithPagedKVCacheWrapper`` runs one prefill request over contiguous K/V beside a planned decode
batch over a paged cache; ``BatchPODWithPagedKVCacheWrapper`` runs a planned prefill batch and a
planned decode batch, each over a paged cache. Each half is planned as the prefill wrappers plan (its
own work list, tiles, partial states and split counters) and both run in one grid of the attention
core (``_pair.PairLaunch``, ``kernels/attention.py``'s ``attention_pair_kernel``): the prefill items
first, so the decode items fill the GPU beside them. Where the prefill route takes the prefill half
(``_route.PrefillRoute.for_pod``: the Gluon kernel for Hopper, asked as for a single prefill of that
shape; for ``BatchPODWithPagedKVCacheWrapper`` as for a causal paged prefill, ``causal_p`` coming with
``run()``), it runs there and the decode half as a launch of its own: on the H200, 64 x 4K decode + a
causal 4K chunk took 524 us against the pair launch's 768.

The halves take their settings as FlashInfer's POD does. ``PODWithPagedKVCacheWrapper``: the
prefill from ``run()``'s ``*_p`` arguments, the decode from ``plan()`` (non-causal, no custom mask);
FlashInfer ignores ``run()``'s ``*_d`` arguments, tritoninfer raises where one asks for something
other than the plan. ``BatchPODWithPagedKVCacheWrapper``: both halves from ``plan()``, the prefill's
mask from ``run()`` (``causal_p``, custom mask). ``q_scale``/``k_scale`` scale the decode half's
logits and ``v_scale`` its output only. Neither half has a logits soft cap (as in FlashInfer).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch

from . import _device, _errors, _hopper, _ops, _plan
from ._attention import AttentionLaunch, KVSource, PlanUploader, ScoreParams, canonical_params, dot_dtype, score_params
from ._kvcache import CacheViews, PagedKVCache, host_page_table, init_graph_page_table
from ._options import (
    TensorLayout,
    check_head_dim,
    check_heads,
    check_indptr_host,
    check_out,
    check_positive_int,
    check_query,
    check_tensor,
    host_index,
    parse_layout,
    parse_pos_encoding_mode,
    plan_dtypes,
)
from ._pair import PairLaunch
from ._route import PREFILL, PlanFacts, Route
from ._step import NO_ROUTE, GraphBuffers, PlannedStep, Settings, plan_work, run_step, upload_plan
from .decode import plan_paged_decode
from .prefill import _mask_layout, _pack_mask, _ragged_kv

__all__ = ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"]


def _reject_qk_reduction(use_fp16_qk_reduction: bool) -> None:
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True: tritoninfer always accumulates q.k in fp32")


def _plan_half(uploader: PlanUploader, device: torch.device, workspace_bytes: int, *, settings: Settings,
               params: ScoreParams, q_dtype, kv_dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int, qo_lens: np.ndarray, kv_lens: np.ndarray, kv_host: list, non_blocking: bool,
               heaviest_first: bool, route: Route = NO_ROUTE) -> Tuple[dict, list, Optional[torch.Tensor]]:
    """One prefill-like half's plan, as the prefill wrappers plan: tiles from the packed query rows
    (decode-like tiles for few rows), its work list, one upload with ``kv_host`` (the K/V page
    table's or ragged indptr's host arrays), the byte offsets of each request's custom-mask segment
    (a mask may come with ``run()``) and the Gluon kernel's work list when ``route`` takes it. Returns
    the ``PlannedStep`` fields but its K/V tensors, the views of ``kv_host`` and the mask offsets' view."""
    group = num_qo_heads // num_kv_heads
    batch = int(kv_lens.size)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    total_rows = int(qo[-1])
    tiles = _plan.prefill_tiles(group, head_dim, total_rows * group / max(batch, 1), kv_dtype.itemsize)
    work = plan_work(qo_lens=qo_lens, kv_lens=kv_lens, tiles=tiles, num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, head_dim_vo=head_dim, page_size=page_size, fixed_split_size=None,
                     disable_split_kv=False, workspace_bytes=workspace_bytes, num_sms=_device.num_sms(device),
                     graph=None, heaviest_first=heaviest_first)
    _, byte_indptr = _mask_layout(qo_lens, kv_lens)
    extra = kv_host + [byte_indptr] + ([] if route.is_core else [_hopper.padded_tiles(route.work)])
    plan, views = upload_plan(uploader, None, work, kv_lens, qo, extra, non_blocking)
    fields = dict(settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype, num_qo_heads=num_qo_heads,
                  num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim, page_size=page_size,
                  batch=batch, total_rows=total_rows, kv_lens=kv_lens, tiles=tiles,
                  device_plan=plan, route=route, route_work=None if route.is_core else _hopper.tiles_view(views[-1], route.work))
    n = len(kv_host)
    return fields, views[:n], views[n]


def _custom_mask(custom_mask, packed_custom_mask, qo_lens: np.ndarray, kv_lens: np.ndarray, device,
                 suffix: str) -> Optional[torch.Tensor]:
    """The prefill half's packed mask (FlashInfer's flat bool mask, or its little-endian packing, one
    segment per request padded to whole bytes), or None."""
    if packed_custom_mask is None and custom_mask is None:
        return None
    bit_indptr, byte_indptr = _mask_layout(qo_lens, kv_lens)
    if packed_custom_mask is not None:
        check_tensor(packed_custom_mask, "packed_custom_mask" + suffix, ndim=1, dtype=torch.uint8)
        if packed_custom_mask.numel() != int(byte_indptr[-1]):
            raise ValueError(f"packed_custom_mask{suffix}: expected {int(byte_indptr[-1])} bytes (each request's "
                             f"qo_len*kv_len bits padded to whole bytes), got {packed_custom_mask.numel()}")
        return packed_custom_mask.to(device)
    check_tensor(custom_mask, "custom_mask" + suffix)
    if custom_mask.numel() != int(bit_indptr[-1]):
        raise ValueError(f"custom_mask{suffix}: expected {int(bit_indptr[-1])} elements (sum of qo_len*kv_len), "
                         f"got {custom_mask.numel()}")
    return _pack_mask(custom_mask.reshape(-1), bit_indptr).to(device)


class _PODBase:
    """What both POD wrappers share: the workspace halves, one plan uploader per half (each half's
    split counters are its own), the fused launch and its cache."""

    def _init_base(self, float_workspace_buffer: torch.Tensor, kv_layout: str) -> None:
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self.device = float_workspace_buffer.device
        self._kv_layout = parse_layout(kv_layout)
        self._set_workspace(float_workspace_buffer)
        self._uploader_p = PlanUploader(self.device)
        self._uploader_d = PlanUploader(self.device)
        self._num_sms = _device.num_sms(self.device)
        self._faults = _errors.FaultWatch(self.device)
        self._launches: dict = {}
        self._step_d: Optional[PlannedStep] = None

    def _plan_settings(self, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, kv_data_type, data_type,
                       pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta):
        """Both POD plans' checks of their shared arguments: ``(group, q_dtype, kv_dtype, params,
        settings)``, the scores without a soft cap (POD has none) and non-causal."""
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        check_positive_int(page_size, "page_size")
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim, "head_dim")
        q_dtype, kv_dtype = plan_dtypes(q_data_type, kv_data_type, data_type)
        params = score_params(pos_encoding_mode, window_left, None, sm_scale, rope_scale, rope_theta, head_dim)
        settings = Settings(pos_encoding_mode, window_left, None, sm_scale, rope_scale, rope_theta, False)
        return group, q_dtype, kv_dtype, params, settings

    def _set_workspace(self, float_workspace_buffer: torch.Tensor) -> None:
        # each half's split-KV partial states in its own half of the buffer (FlashInfer's BatchPOD
        # splits it the same way)
        flat = float_workspace_buffer.view(-1).view(torch.uint8)
        half = flat.numel() // 2 // 16 * 16
        self._float_workspace_buffer = float_workspace_buffer
        self._ws_p, self._ws_d = flat[:half], flat[half:2 * half]

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace (``int_workspace_buffer`` is accepted for compatibility:
        tritoninfer keeps its plans in buffers the wrapper owns). Takes effect at the next plan."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._set_workspace(float_workspace_buffer)

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""

    def _launch(self, step_p: PlannedStep, kv_p: KVSource, q_p, out_p, lse_p, mask_p, mask_indptr_p,
                step_d: PlannedStep, kv_d: KVSource, q_d, out_d, lse_d, q_scale, k_scale, v_scale) -> None:
        """Both halves in one launch. The pair launch is kept per shapes, settings and call kinds (the key
        holds identities of canonical objects the launch keeps alive: scores, tiles, workspaces) across
        plans: a run over other plans or masks than the ones it holds rebinds it (``PairLaunch.bind_plans``;
        building it anew at every step's first run cost ~200 µs of the dev CPU's Python, session 20)."""
        key = (id(step_p.params), id(step_d.params), id(step_p.tiles), id(step_d.tiles), id(self._ws_p),
               id(self._ws_d), mask_p is None, step_p.num_qo_heads, step_p.num_kv_heads, step_p.head_dim_qk,
               step_p.head_dim_vo, kv_p.page_size, kv_d.page_size, q_p.dtype, kv_p.k.dtype, q_d.dtype, kv_d.k.dtype,
               lse_p is None, lse_d is None)
        bound_to = (step_p, step_d, mask_p, mask_indptr_p, kv_p.kv_indptr, kv_d.kv_indptr, kv_p.kv_indices,
                    kv_d.kv_indices)
        pair = self._launches.get(key)
        if pair is None:
            params_p = step_p.params if mask_p is None else dataclasses.replace(step_p.params, causal=False)
            halves = []
            for step, kv, q, lse, params, ws, mask, mask_indptr in (
                    (step_p, kv_p, q_p, lse_p, params_p, self._ws_p, mask_p, mask_indptr_p),
                    (step_d, kv_d, q_d, lse_d, step_d.params, self._ws_d, None, None)):
                halves.append(AttentionLaunch(
                    plan=step.device_plan, kv=kv, tiles=step.tiles, num_qo_heads=step.num_qo_heads,
                    num_kv_heads=step.num_kv_heads, head_dim_qk=step.head_dim_qk, head_dim_vo=step.head_dim_vo,
                    params=params, q_len_per_req=0, state_mult=1, workspace=ws, dot=dot_dtype(q.dtype, kv.k.dtype),
                    has_lse=lse is not None, has_sinks=False, has_head_scales=False, packed_mask=mask,
                    mask_indptr=mask_indptr))
            if len(self._launches) >= 32 and not self.is_cuda_graph_enabled:
                self._launches.clear()
            pair = self._launches[key] = PairLaunch(*halves)
            pair.bound_to = bound_to
            pair.keep = (step_p.params, step_d.params)  # (identities in the key)
        elif any(a is not b for a, b in zip(pair.bound_to, bound_to)):
            pair.bind_plans((step_p.device_plan, kv_p, mask_p, mask_indptr_p), (step_d.device_plan, kv_d, None, None),
                            bound_to)
        pair((q_p, out_p, lse_p, kv_p, None, None, None), (q_d, out_d, lse_d, kv_d, q_scale, k_scale, v_scale))

    def _decode_source(self, kv, step: PlannedStep, kv_indptr, kv_indices) -> KVSource:
        if (kv.page_size, kv.num_heads) != (step.page_size, step.num_kv_heads):
            raise ValueError(f"paged_kv_cache: page_size/num_kv_heads are {kv.page_size}/{kv.num_heads}, "
                             f"plan() used {step.page_size}/{step.num_kv_heads}")
        if kv.dtype != step.kv_dtype:
            raise ValueError(f"paged_kv_cache: dtype {kv.dtype} does not match the planned kv_data_type {step.kv_dtype}")
        if kv.head_dim_qk != step.head_dim_qk or kv.head_dim_vo != step.head_dim_vo:
            raise ValueError(f"paged_kv_cache: head_dim {kv.head_dim_qk} does not match the planned {step.head_dim_qk}")
        step.page_table.check_cache(kv.k.shape[0])
        return KVSource(kv.k, kv.v, kv.k_strides, kv.v_strides, kv.page_size, kv_indptr, kv_indices, kv.k.shape[0])


class PODWithPagedKVCacheWrapper(_PODBase):
    """One prefill request (contiguous K/V) and a planned decode batch (paged KV) in one launch.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> pod = tritoninfer.PODWithPagedKVCacheWrapper(ws, "NHD")
    >>> pod.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    >>> o_p, o_d = pod.run(q_p, k_p, v_p, q_d, kv_cache, causal_p=True)
    >>> # q_p [qo_len, 32, 128], k_p/v_p [kv_len, 8, 128]; q_d [batch, 32, 128] -> o_d [batch, 32, 128]

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Split-KV partial states of both halves (each gets half of it).
    kv_layout : str
        ``"NHD"`` or ``"HND"``: the decode cache's layout.
    use_cuda_graph : bool
        The decode batch size and page-table buffers are fixed (as the decode wrapper's). The
        prefill half is planned at the first ``run()`` with each prefill shape and options; a captured
        graph replays one prefill shape (FlashInfer's prefill grid, too, follows ``q_p``'s length).
    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
        int32 ``[batch+1]``, ``[max_pages]``, ``[batch]``; required with ``use_cuda_graph``.
    jit_args : Optional[List[Any]]
        FlashInfer's custom CUDA variants: anything but ``None`` raises ``NotImplementedError``.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
        jit_args: Optional[List[Any]] = None,
    ) -> None:
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom CUDA attention variants cannot run on tritoninfer's Triton kernels")
        self._init_base(float_workspace_buffer, kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        init_graph_page_table(self, use_cuda_graph, paged_kv_indptr_buffer, paged_kv_indices_buffer,
                              paged_kv_last_page_len_buffer)
        self._graph = GraphBuffers(self.device) if use_cuda_graph else None
        self._caches = CacheViews(self._kv_layout)
        self._prefill_steps: dict = {}  # the prefill half's plans, by shape and options
        self._handle = _ops.register_wrapper(self)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

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
        q_data_type: Optional[Union[str, torch.dtype]] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        data_type: Optional[Union[str, torch.dtype]] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
    ) -> None:
        """Plan the decode batch (one query token per request).

        Parameters
        ----------
        indptr, indices, last_page_len : torch.Tensor
            int32 page table ``[batch+1]``, ``[indptr[-1]]``, ``[batch]`` of the decode requests.
        num_qo_heads, num_kv_heads, head_dim, page_size : int
            Shared by both halves (the prefill's ``q_p``/``k_p`` must match them).
        pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta
            The decode half's scores (``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"``; ``-1``: no window).
        q_data_type, kv_data_type, data_type
            Both halves' dtypes (``data_type`` is deprecated and fills whichever is None).
        non_blocking : bool
            Asynchronous host-to-device copies of the plan.
        """
        group, q_dtype, kv_dtype, params, settings = self._plan_settings(
            num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, kv_data_type, data_type,
            pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta)
        table = host_page_table(host_index(indptr, "indptr"), host_index(last_page_len, "last_page_len"), indices,
                                page_size)
        batch = table.kv_lens.size
        graph = self._graph
        # the decode plan of BatchDecodeWithPagedKVCacheWrapper with the prefill path's tiles and query
        # indptr: the pair kernel runs both halves as prefill items (no dot-free lanes)
        tiles = graph.tiles if graph is not None and graph.sized else \
            _plan.prefill_tiles(group, head_dim, batch * group / max(batch, 1), kv_dtype.itemsize)
        self._step_d = plan_paged_decode(
            self, self._uploader_d, self._ws_d.numel(), table, table.kv_lens, indices, tiles=tiles,
            settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype, num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
            qo=np.arange(batch + 1, dtype=np.int64), heaviest_first=False, non_blocking=non_blocking)

    begin_forward = plan

    def _prefill_step(self, qo_len: int, kv_len: int, params: ScoreParams, settings: Settings, kv_dtype,
                      layout: TensorLayout, has_mask: bool) -> PlannedStep:
        """The prefill half's plan for this shape and these scores, made at its first ``run()`` (one
        upload) and kept for the next runs (every layer of a step has the same prefill). Its route is
        asked as a single prefill's (``_route.PrefillRoute.for_pod``)."""
        step_d = self._step_d
        key = (qo_len, kv_len, params, kv_dtype, step_d.q_dtype, layout, has_mask)
        step = self._prefill_steps.get(key)
        if step is None:
            if len(self._prefill_steps) >= 64 and not self._use_cuda_graph:
                self._prefill_steps.clear()
            qo_lens, kv_lens = np.array([qo_len], np.int64), np.array([kv_len], np.int64)
            route = PREFILL.for_pod(PlanFacts(
                device=self.device, q_dtype=step_d.q_dtype, kv_dtype=kv_dtype, head_dim_qk=step_d.head_dim_qk,
                head_dim_vo=step_d.head_dim_vo, layout=layout, use_cuda_graph=self._use_cuda_graph,
                has_mask=has_mask, params=params, qo_lens=qo_lens, kv_lens=kv_lens, page_size=0))
            fields, views, mask_indptr = _plan_half(
                self._uploader_p, self.device, self._ws_p.numel(), settings=settings, params=params,
                q_dtype=step_d.q_dtype, kv_dtype=kv_dtype, num_qo_heads=step_d.num_qo_heads,
                num_kv_heads=step_d.num_kv_heads, head_dim=step_d.head_dim_qk, page_size=0,
                qo_lens=qo_lens, kv_lens=kv_lens, kv_host=[np.array([0, kv_len], np.int64)],
                non_blocking=True, heaviest_first=params.causal, route=route)
            fields["mask_indptr"] = mask_indptr
            step = self._prefill_steps[key] = PlannedStep(**fields, total_kv=kv_len, kv_indptr=views[0])
        return step

    def run(
        self,
        q_p: torch.Tensor,
        k_p: torch.Tensor,
        v_p: torch.Tensor,
        q_d: torch.Tensor,
        paged_kv_cache_d: PagedKVCache,
        custom_mask_p: Optional[torch.Tensor] = None,
        packed_custom_mask_p: Optional[torch.Tensor] = None,
        causal_p: bool = False,
        kv_layout_p: str = "NHD",
        pos_encoding_mode_p: str = "NONE",
        sm_scale_p: Optional[float] = None,
        window_left_p: int = -1,
        rope_scale_p: Optional[float] = None,
        rope_theta_p: Optional[float] = None,
        return_lse_p: bool = False,
        custom_mask_d: Optional[torch.Tensor] = None,
        packed_custom_mask_d: Optional[torch.Tensor] = None,
        causal_d: bool = False,
        kv_layout_d: str = "NHD",
        pos_encoding_mode_d: str = "NONE",
        sm_scale_d: Optional[float] = None,
        window_left_d: int = -1,
        rope_scale_d: Optional[float] = None,
        rope_theta_d: Optional[float] = None,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        return_lse_d: bool = False,
        use_fp16_qk_reduction: bool = False,
        enable_pdl: Optional[bool] = None,
        *args,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Prefill of one request and the planned decode batch, in one launch.

        Parameters
        ----------
        q_p : torch.Tensor
            ``[qo_len, num_qo_heads, head_dim]`` in the planned ``q_data_type``.
        k_p, v_p : torch.Tensor
            ``[kv_len, num_kv_heads, head_dim]`` (``kv_layout_p="NHD"``) or ``[num_kv_heads, kv_len,
            head_dim]`` (``"HND"``) in the planned ``kv_data_type``.
        q_d : torch.Tensor
            ``[batch, num_qo_heads, head_dim]``.
        paged_kv_cache_d
            The decode cache, any of FlashInfer's forms, in the wrapper's ``kv_layout``.
        custom_mask_p, packed_custom_mask_p : Optional[torch.Tensor]
            The prefill's bool ``[qo_len * kv_len]`` mask (True keeps) or its little-endian packing;
            replaces ``causal_p``.
        causal_p, pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p, rope_theta_p
            The prefill's scores (causal masks are bottom-right aligned).
        return_lse_p, return_lse_d : bool
            Return that half as ``(out, lse)`` (float32 base-2 LSE ``[rows, num_qo_heads]``).
            FlashInfer 0.5.3 computes these LSEs but returns only ``(out_p, out_d)``.
        custom_mask_d, packed_custom_mask_d, causal_d, kv_layout_d, pos_encoding_mode_d, sm_scale_d,
        window_left_d, rope_scale_d, rope_theta_d
            FlashInfer ignores these (the decode half runs with ``plan()``'s settings, non-causal):
            a mask, or a value other than the default or the planned one, raises ``ValueError``.
            ``causal_d`` has no effect on one query token per request.
        q_scale, k_scale, v_scale : Optional[float]
            The decode half's fp8 scales: ``q_scale * k_scale`` multiplies its ``sm_scale``,
            ``v_scale`` its output.
        use_fp16_qk_reduction : bool
            Only False (``NotImplementedError``).
        enable_pdl : Optional[bool]
            Accepted; no effect.

        Returns
        -------
        ``(out_p, out_d)``: ``[qo_len, num_qo_heads, head_dim]`` and ``[batch, num_qo_heads, head_dim]``
        in q's dtype (each a pair with its LSE when asked).
        """
        if args:
            raise TypeError("run(): unexpected extra positional arguments (FlashInfer's POD takes none)")
        _reject_qk_reduction(use_fp16_qk_reduction)
        step_d = self._step_d
        if step_d is None:
            raise ValueError("run() was called before plan()")
        if custom_mask_d is not None or packed_custom_mask_d is not None:
            raise ValueError("custom_mask_d/packed_custom_mask_d: POD's decode half takes no custom mask "
                             "(FlashInfer ignores it)")
        if parse_layout(kv_layout_d, "kv_layout_d") not in (TensorLayout.NHD, self._kv_layout):
            raise ValueError(f"kv_layout_d: the decode cache's layout is the wrapper's ({self._kv_layout.name}), "
                             f"got {kv_layout_d!r}")
        planned = step_d.settings
        for name, value, default, plan_value in (
                ("pos_encoding_mode_d", pos_encoding_mode_d, "NONE", planned.pos_encoding_mode),
                ("sm_scale_d", sm_scale_d, None, planned.sm_scale),
                ("window_left_d", window_left_d, -1, planned.window_left),
                ("rope_scale_d", rope_scale_d, None, planned.rope_scale),
                ("rope_theta_d", rope_theta_d, None, planned.rope_theta)):
            if name == "pos_encoding_mode_d":
                same = parse_pos_encoding_mode(value, name) in (parse_pos_encoding_mode(default),
                                                                parse_pos_encoding_mode(plan_value))
            else:
                same = value == default or value == plan_value
            if not same:
                raise ValueError(f"{name}: POD's decode half runs with plan()'s value ({plan_value!r}); got {value!r}")
        if _ops.compiling():
            return _traced_pod(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p, packed_custom_mask_p,
                               causal_p, kv_layout_p, str(pos_encoding_mode_p), sm_scale_p, window_left_p,
                               rope_scale_p, rope_theta_p, return_lse_p, q_scale, k_scale, v_scale, return_lse_d)
        return self._run(q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p, packed_custom_mask_p, causal_p,
                         kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p, rope_theta_p,
                         return_lse_p, q_scale, k_scale, v_scale, return_lse_d)

    def _run(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, custom_mask_p, packed_custom_mask_p, causal_p, kv_layout_p,
             pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p, rope_theta_p, return_lse_p, q_scale,
             k_scale, v_scale, return_lse_d, out_p=None, lse_p=None, out_d=None, lse_d=None):
        """``run()``'s work, into ``out_*``/``lse_*`` when given (the torch.compile op passes them)."""
        step_d = self._step_d
        if step_d is None:
            raise ValueError("run() was called before plan()")
        heads, dim = step_d.num_qo_heads, step_d.head_dim_qk
        # prefill: one request over contiguous K/V
        check_tensor(q_p, "q_p", ndim=3)
        layout_p = parse_layout(kv_layout_p, "kv_layout_p")
        if k_p.dtype != step_d.kv_dtype:
            raise ValueError(f"k_p: dtype {k_p.dtype} does not match the planned kv_data_type {step_d.kv_dtype} "
                             "(one kernel runs both halves)")
        qo_len = q_p.shape[0]
        check_query(q_p, step_d.q_dtype, (qo_len, heads, dim), "(qo_len, num_qo_heads, head_dim)", "q_p")
        kv_p, heads_kv, dqk, dvo, kv_len = _ragged_kv(k_p, v_p, layout_p, None, "k_p", "v_p")
        if (heads_kv, dqk, dvo) != (step_d.num_kv_heads, dim, dim):
            raise ValueError(f"k_p/v_p: {heads_kv} heads of dim {dqk}/{dvo}, plan() has "
                             f"{step_d.num_kv_heads} KV heads of dim {dim}")
        mask_p = _custom_mask(custom_mask_p, packed_custom_mask_p, np.array([qo_len]), np.array([kv_len]),
                              self.device, "_p")
        params_p = score_params(pos_encoding_mode_p, window_left_p, None, sm_scale_p, rope_scale_p, rope_theta_p,
                                dim, causal=bool(causal_p) and mask_p is None)
        settings_p = Settings(pos_encoding_mode_p, window_left_p, None, sm_scale_p, rope_scale_p, rope_theta_p,
                              bool(causal_p))
        step_p = self._prefill_step(qo_len, kv_len, params_p, settings_p, k_p.dtype, layout_p, mask_p is not None)
        kv_p.kv_indptr = step_p.kv_indptr
        # decode: the planned batch over the paged cache
        kv_d, source_d = self._caches.source(paged_kv_cache_d, step_d, lambda kv: self._decode_source(
            kv, step_d, step_d.kv_indptr, step_d.kv_indices))
        check_query(q_d, step_d.q_dtype, (step_d.batch, heads, dim), "(batch_size, num_qo_heads, head_dim)", "q_d")
        if q_p.device != self.device or q_d.device != self.device:
            raise ValueError(f"q_p/q_d: expected tensors on the workspace's device {self.device}")
        out_p = check_out(out_p, (qo_len, heads, dim), q_p.dtype, q_p.device, "out_p")
        out_d = check_out(out_d, (step_d.batch, heads, dim), q_d.dtype, q_d.device, "out_d")
        if return_lse_p or lse_p is not None:
            lse_p = check_out(lse_p, (qo_len, heads), torch.float32, q_p.device, "lse_p")
        if return_lse_d or lse_d is not None:
            lse_d = check_out(lse_d, (step_d.batch, heads), torch.float32, q_d.device, "lse_d")
        if step_p.route.is_core:
            self._launch(step_p, kv_p, q_p, out_p, lse_p, mask_p, step_p.mask_indptr if mask_p is not None else None,
                         step_d, source_d, q_d, out_d, lse_d, q_scale, k_scale, v_scale)
        else:
            # the Gluon prefill, then the decode half on the core (_route.POD_PREFILL_ON_HOPPER)
            run_step(step_p, q=q_p, kv=kv_p, out=out_p, lse=lse_p, workspace=self._ws_p, route_kv=(k_p, v_p))
            run_step(step_d, q=q_d, kv=source_d, out=out_d, lse=lse_d, workspace=self._ws_d, q_scale=q_scale,
                     k_scale=k_scale, v_scale=v_scale)
        return ((out_p, lse_p) if return_lse_p else out_p), ((out_d, lse_d) if return_lse_d else out_d)


class BatchPODWithPagedKVCacheWrapper(_PODBase):
    """A planned prefill batch and a planned decode batch, each over a paged cache, in one launch.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> pod = tritoninfer.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
    >>> pod.plan(qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p,
    ...          qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d, 32, 8, 128, 16,
    ...          q_data_type=torch.bfloat16)
    >>> o_p, o_d = pod.run(q_p, kv_cache, q_d, kv_cache, causal_p=True)

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Split-KV partial states of both halves (each gets half of it, as in FlashInfer).
    kv_layout : str
        ``"NHD"`` or ``"HND"``, both caches.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._init_base(float_workspace_buffer, kv_layout)
        self._caches_p = CacheViews(self._kv_layout)
        self._caches_d = CacheViews(self._kv_layout)
        self._step_p: Optional[PlannedStep] = None
        self._handle = _ops.register_wrapper(self)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(
        self,
        qo_indptr_p: torch.Tensor,
        kv_indptr_p: torch.Tensor,
        kv_indices_p: torch.Tensor,
        last_page_len_p: torch.Tensor,
        qo_indptr_d: torch.Tensor,
        kv_indptr_d: torch.Tensor,
        kv_indices_d: torch.Tensor,
        last_page_len_d: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        q_data_type: Optional[Union[str, torch.dtype]] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        data_type: Optional[Union[str, torch.dtype]] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
    ) -> None:
        """Plan both batches.

        Parameters
        ----------
        qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p : torch.Tensor
            The prefill batch: int32 ``[batch_p+1]`` query indptr and its page table.
        qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d : torch.Tensor
            The decode batch, the same way (its requests may have several query tokens; the decode
            half is non-causal, as in FlashInfer).
        num_qo_heads, num_kv_heads, head_dim, page_size : int
        pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta
            Both halves' scores.
        q_data_type, kv_data_type, data_type, non_blocking
            As for ``PODWithPagedKVCacheWrapper.plan``.
        """
        _, q_dtype, kv_dtype, params, settings = self._plan_settings(
            num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type, kv_data_type, data_type,
            pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta)
        steps = []
        for sfx, qo_indptr, kv_indptr, kv_indices, last_page_len, uploader, ws in (
                ("_p", qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p, self._uploader_p, self._ws_p),
                ("_d", qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d, self._uploader_d, self._ws_d)):
            qo_host = host_index(qo_indptr, "qo_indptr" + sfx)
            check_indptr_host(qo_host, "qo_indptr" + sfx)
            try:
                table = host_page_table(host_index(kv_indptr, "kv_indptr" + sfx),
                                        host_index(last_page_len, "last_page_len" + sfx), kv_indices, page_size,
                                        prefix="kv_")
            except ValueError as e:
                raise ValueError(f"{e} (the {'prefill' if sfx == '_p' else 'decode'} batch: argument suffix {sfx})") \
                    from None
            if qo_host.numel() - 1 != table.kv_lens.size:
                raise ValueError(f"qo_indptr{sfx} and kv_indptr{sfx} disagree on the batch size "
                                 f"({qo_host.numel() - 1} vs {table.kv_lens.size})")
            qo = qo_host.numpy().astype(np.int64)
            route = NO_ROUTE
            if sfx == "_p":
                qo_lens_p = qo[1:] - qo[:-1]
                # causal_p comes with run(): the route asked as for a causal prefill (the stricter length
                # threshold; its work list's heaviest-first order is also a valid order without the mask)
                route = PREFILL.for_pod(PlanFacts(
                    device=self.device, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim_qk=head_dim,
                    head_dim_vo=head_dim, layout=self._kv_layout, use_cuda_graph=False, has_mask=False,
                    params=dataclasses.replace(params, causal=True), qo_lens=qo_lens_p, kv_lens=table.kv_lens,
                    page_size=page_size))
            fields, views, mask_indptr = _plan_half(
                uploader, self.device, ws.numel(), settings=settings, params=params, q_dtype=q_dtype,
                kv_dtype=kv_dtype, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                page_size=page_size, qo_lens=qo[1:] - qo[:-1], kv_lens=table.kv_lens, kv_host=[table.indptr],
                non_blocking=non_blocking, heaviest_first=False, route=route)
            fields["mask_indptr"] = mask_indptr
            steps.append(PlannedStep(**fields, total_kv=0, kv_indptr=views[0],
                                     kv_indices=kv_indices.to(self.device, non_blocking=non_blocking).to(torch.int32),
                                     page_table=table))
        self._step_p, self._step_d = steps
        self._qo_lens_p = qo_lens_p
        # causal_p comes with run(): the step's causal twin, kept so the launch cache sees one object
        self._step_p_causal = dataclasses.replace(
            steps[0], params=canonical_params(dataclasses.replace(params, causal=True)),
            settings=dataclasses.replace(settings, causal=True))

    begin_forward = plan

    def run(
        self,
        q_p: torch.Tensor,
        paged_kv_cache_p: PagedKVCache,
        q_d: torch.Tensor,
        paged_kv_cache_d: PagedKVCache,
        custom_mask_p: Optional[torch.Tensor] = None,
        packed_custom_mask_p: Optional[torch.Tensor] = None,
        causal_p: bool = False,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        return_lse: bool = False,
        use_fp16_qk_reduction: bool = False,
        enable_pdl: Optional[bool] = None,
    ) -> Union[Tuple[torch.Tensor, torch.Tensor], Tuple[Tuple[torch.Tensor, torch.Tensor],
                                                         Tuple[torch.Tensor, torch.Tensor]]]:
        """Both planned batches in one launch.

        Parameters
        ----------
        q_p, q_d : torch.Tensor
            ``[qo_indptr_p[-1], num_qo_heads, head_dim]`` and ``[qo_indptr_d[-1], ...]``.
        paged_kv_cache_p, paged_kv_cache_d
            Each half's cache (often the same tensor), any of FlashInfer's forms.
        custom_mask_p, packed_custom_mask_p : Optional[torch.Tensor]
            The prefill batch's mask: bool ``[sum qo_len_i * kv_len_i]`` or its little-endian packing,
            one segment per request (packed: each padded to whole bytes); replaces ``causal_p``.
        causal_p : bool
            Bottom-right aligned causal prefill.
        q_scale, k_scale, v_scale : Optional[float]
            The decode half's fp8 scales (as FlashInfer applies them).
        return_lse : bool
            Return ``((out_p, out_d), (lse_p, lse_d))`` (float32, base 2).
        use_fp16_qk_reduction, enable_pdl
            As for ``PODWithPagedKVCacheWrapper.run``.
        """
        _reject_qk_reduction(use_fp16_qk_reduction)
        if self._step_d is None:
            raise ValueError("run() was called before plan()")
        if _ops.compiling():
            return _traced_batch_pod(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p,
                                     packed_custom_mask_p, causal_p, q_scale, k_scale, v_scale, return_lse)
        return self._run(q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p, packed_custom_mask_p, causal_p,
                         q_scale, k_scale, v_scale, return_lse)

    def _run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p, packed_custom_mask_p, causal_p,
             q_scale, k_scale, v_scale, return_lse, out_p=None, lse_p=None, out_d=None, lse_d=None):
        """``run()``'s work, into ``out_*``/``lse_*`` when given (the torch.compile op passes them)."""
        step_p, step_d = self._step_p, self._step_d
        if step_d is None:
            raise ValueError("run() was called before plan()")
        heads, dim = step_d.num_qo_heads, step_d.head_dim_qk
        kv_p, source_p = self._caches_p.source(paged_kv_cache_p, step_p, lambda kv: self._decode_source(
            kv, step_p, step_p.kv_indptr, step_p.kv_indices))
        kv_d, source_d = self._caches_d.source(paged_kv_cache_d, step_d, lambda kv: self._decode_source(
            kv, step_d, step_d.kv_indptr, step_d.kv_indices))
        check_query(q_p, step_p.q_dtype, (step_p.total_rows, heads, dim), "(qo_indptr_p[-1], num_qo_heads, head_dim)",
                    "q_p")
        check_query(q_d, step_d.q_dtype, (step_d.total_rows, heads, dim), "(qo_indptr_d[-1], num_qo_heads, head_dim)",
                    "q_d")
        if q_p.device != self.device or q_d.device != self.device:
            raise ValueError(f"q_p/q_d: expected tensors on the workspace's device {self.device}")
        mask_p = _custom_mask(custom_mask_p, packed_custom_mask_p, self._qo_lens_p, step_p.page_table.kv_lens,
                              self.device, "_p")
        if mask_p is None and causal_p:
            # the same work list: the kernel bounds each tile's KV range by the diagonal
            step_p = self._step_p_causal
        out_p = check_out(out_p, (step_p.total_rows, heads, dim), q_p.dtype, q_p.device, "out_p")
        out_d = check_out(out_d, (step_d.total_rows, heads, dim), q_d.dtype, q_d.device, "out_d")
        if return_lse or lse_p is not None or lse_d is not None:
            lse_p = check_out(lse_p, (step_p.total_rows, heads), torch.float32, q_p.device, "lse_p")
            lse_d = check_out(lse_d, (step_d.total_rows, heads), torch.float32, q_d.device, "lse_d")
        if mask_p is None and not step_p.route.is_core:
            # the Gluon prefill over the paged cache, then the decode half on the core
            run_step(step_p, q=q_p, kv=source_p, out=out_p, lse=lse_p, workspace=self._ws_p, route_kv=kv_p)
            run_step(step_d, q=q_d, kv=source_d, out=out_d, lse=lse_d, workspace=self._ws_d, q_scale=q_scale,
                     k_scale=k_scale, v_scale=v_scale)
        else:
            self._launch(step_p, source_p, q_p, out_p, lse_p, mask_p,
                         step_p.mask_indptr if mask_p is not None else None, step_d, source_d, q_d, out_d, lse_d,
                         q_scale, k_scale, v_scale)
        return ((out_p, out_d), (lse_p, lse_d)) if return_lse else (out_p, out_d)


# torch.compile (``_ops.py``): while Dynamo traces, run() allocates the outputs in the traced code and
# calls one of these ops, which finds the wrapper by its handle and runs its current plans eagerly.

def _wrapper(handle: int):
    wrapper = _ops._WRAPPERS.get(handle)
    if wrapper is None:
        raise ValueError(f"tritoninfer POD op: the wrapper of handle {handle} no longer exists")
    return wrapper


def _split_cache(cache) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    return (cache[0], cache[1]) if isinstance(cache, (tuple, list)) else (cache, None)


@_ops.custom_op("pod_run", mutates_args=("out_p", "lse_p", "out_d", "lse_d"))
def _pod_op(handle: int, q_p: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, q_d: torch.Tensor,
            k_d: torch.Tensor, v_d: Optional[torch.Tensor], out_p: torch.Tensor, lse_p: Optional[torch.Tensor],
            out_d: torch.Tensor, lse_d: Optional[torch.Tensor], custom_mask_p: Optional[torch.Tensor],
            packed_custom_mask_p: Optional[torch.Tensor], causal_p: bool, kv_layout_p: str, pos_encoding_mode_p: str,
            sm_scale_p: Optional[float], window_left_p: int, rope_scale_p: Optional[float],
            rope_theta_p: Optional[float], q_scale: Optional[float], k_scale: Optional[float],
            v_scale: Optional[float]) -> None:
    """``PODWithPagedKVCacheWrapper.run`` into the given outputs."""
    _wrapper(handle)._run(q_p, k_p, v_p, q_d, k_d if v_d is None else (k_d, v_d), custom_mask_p,
                          packed_custom_mask_p, causal_p, kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p,
                          rope_scale_p, rope_theta_p, lse_p is not None, q_scale, k_scale, v_scale, lse_d is not None,
                          out_p=out_p, lse_p=lse_p, out_d=out_d, lse_d=lse_d)


def _traced_pod(wrapper, q_p, k_p, v_p, q_d, cache_d, custom_mask_p, packed_custom_mask_p, causal_p, kv_layout_p,
                pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p, rope_theta_p, return_lse_p, q_scale,
                k_scale, v_scale, return_lse_d):
    out_p, out_d = torch.empty_like(q_p), torch.empty_like(q_d)
    lse_p = torch.empty(q_p.shape[:2], dtype=torch.float32, device=q_p.device) if return_lse_p else None
    lse_d = torch.empty(q_d.shape[:2], dtype=torch.float32, device=q_d.device) if return_lse_d else None
    k_d, v_d = _split_cache(cache_d)
    _pod_op(wrapper._handle, q_p, k_p, v_p, q_d, k_d, v_d, out_p, lse_p, out_d, lse_d, custom_mask_p,
            packed_custom_mask_p, bool(causal_p), str(kv_layout_p), pos_encoding_mode_p, sm_scale_p, int(window_left_p),
            rope_scale_p, rope_theta_p, q_scale, k_scale, v_scale)
    return ((out_p, lse_p) if return_lse_p else out_p), ((out_d, lse_d) if return_lse_d else out_d)


@_ops.custom_op("batch_pod_run", mutates_args=("out_p", "lse_p", "out_d", "lse_d"))
def _batch_pod_op(handle: int, q_p: torch.Tensor, k_p: torch.Tensor, v_p: Optional[torch.Tensor],
                  q_d: torch.Tensor, k_d: torch.Tensor, v_d: Optional[torch.Tensor], out_p: torch.Tensor,
                  lse_p: Optional[torch.Tensor], out_d: torch.Tensor, lse_d: Optional[torch.Tensor],
                  custom_mask_p: Optional[torch.Tensor], packed_custom_mask_p: Optional[torch.Tensor], causal_p: bool,
                  q_scale: Optional[float], k_scale: Optional[float], v_scale: Optional[float]) -> None:
    """``BatchPODWithPagedKVCacheWrapper.run`` into the given outputs."""
    _wrapper(handle)._run(q_p, k_p if v_p is None else (k_p, v_p), q_d, k_d if v_d is None else (k_d, v_d),
                          custom_mask_p, packed_custom_mask_p, causal_p, q_scale, k_scale, v_scale, lse_p is not None,
                          out_p=out_p, lse_p=lse_p, out_d=out_d, lse_d=lse_d)


def _traced_batch_pod(wrapper, q_p, cache_p, q_d, cache_d, custom_mask_p, packed_custom_mask_p, causal_p, q_scale,
                      k_scale, v_scale, return_lse):
    out_p, out_d = torch.empty_like(q_p), torch.empty_like(q_d)
    lse_p = torch.empty(q_p.shape[:2], dtype=torch.float32, device=q_p.device) if return_lse else None
    lse_d = torch.empty(q_d.shape[:2], dtype=torch.float32, device=q_d.device) if return_lse else None
    k_p, v_p = _split_cache(cache_p)
    k_d, v_d = _split_cache(cache_d)
    _batch_pod_op(wrapper._handle, q_p, k_p, v_p, q_d, k_d, v_d, out_p, lse_p, out_d, lse_d, custom_mask_p,
                  packed_custom_mask_p, bool(causal_p), q_scale, k_scale, v_scale)
    return ((out_p, out_d), (lse_p, lse_d)) if return_lse else (out_p, out_d)
