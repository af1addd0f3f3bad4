"""One planned step: everything ``plan()`` decides, in one immutable object that ``run()`` reads.

Every attention entry point goes through the same three pieces:

- :func:`plan_work` and :func:`upload_plan`: the plan skeleton shared by decode and prefill (the
  split-KV decision, the work list, CUDA-graph capacity, one upload);
- :class:`PlannedStep`: what a plan fixes (settings, shapes, dtypes, tiles, the device plan, the page
  table, the mask, the kernel route), stored as one wrapper attribute (``_step``) and replaced whole
  by the next plan;
- :func:`run_step`: the run path, which asks the step's route for the call's tensors and launches
  the Gluon kernel or the attention core.

The single-request functions (``single_decode_with_kv_cache``, ``single_prefill_with_kv_cache``)
plan a one-request step with :func:`plan_single` on a per-device scratch workspace and run it the
same way.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from . import _device, _errors, _hopper, _ops, _plan
from ._attention import (
    DevicePlan,
    KVSource,
    PlanUploader,
    ScoreParams,
    launch_attention,
    packed_starts,
    pad_work,
    scratch_workspace,
)
from ._kvcache import HostPageTable
from ._launch import DriverCall
from ._options import check_tensor
from ._plan import WORK_FIELDS, Tiles, WorkPlan, cdiv, kv_split_chunk
from ._route import DECODE, PREFILL, Route, core

NO_ROUTE = core("decode (the attention core only)")

# pinned upload buffers of the single-request functions, used in turn: a call waits only for the
# copy queued this many calls earlier (the GPU is rarely that many layers behind the host)
SINGLE_UPLOAD_SLOTS = 16
# single-request steps kept for the next call with the same shapes (plan_single)
SINGLE_STEPS_KEPT = 32
_SINGLE_STEPS: "collections.OrderedDict[tuple, PlannedStep]" = collections.OrderedDict()


@dataclasses.dataclass(frozen=True)
class Settings:
    """The attention settings as ``plan()`` got them: FlashInfer keeps these as wrapper attributes,
    which engines read (``_compat.py`` serves them from here)."""

    pos_encoding_mode: Any = "NONE"
    window_left: int = -1
    logits_soft_cap: Optional[float] = None
    sm_scale: Optional[float] = None
    rope_scale: Optional[float] = None
    rope_theta: Optional[float] = None
    causal: bool = False


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """What one ``plan()`` fixed; ``run()`` reads this and nothing else of the plan."""

    settings: Settings
    params: ScoreParams  # the parsed scores the kernels compute
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int  # 0: ragged K/V
    batch: int
    total_rows: int  # query rows the plan covers (qo_indptr[-1]; decode: the batch)
    total_kv: int  # ragged K/V rows (kv_indptr[-1]); paged: 0
    kv_lens: np.ndarray  # int64 [batch], on the host
    tiles: Tiles
    device_plan: DevicePlan
    kv_indptr: torch.Tensor
    kv_indices: Optional[torch.Tensor] = None
    page_table: Optional[HostPageTable] = None  # host facts of a paged plan (ids checked at run)
    packed_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    route: Route = NO_ROUTE
    route_work: Optional[torch.Tensor] = None  # the Gluon kernel's uploaded work list, int32 [2, tiles]

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @functools.cached_property
    def min_kv_len(self) -> int:
        """(on demand: only decode's multi-token runs read it, and plan() runs every step)"""
        return int(self.kv_lens.min()) if self.kv_lens.size else 0

    def with_scores(self, settings: Settings, params: ScoreParams) -> "PlannedStep":
        """This step with other scores (the deprecated ``forward()``): same work list, the route
        re-checked for the new scores."""
        return dataclasses.replace(self, settings=settings, params=params, route=PREFILL.keep_for(self.route, params))


class GraphBuffers:
    """CUDA-graph mode: what a wrapper's first plan fixes for its life, because captured graphs hold a
    grid sized by it and pointers into it: the work-list capacity, the splits a request may get, the
    query rows, the tiles, and the device buffer every later plan is uploaded into."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buf: Optional[torch.Tensor] = None
        self.capacity = 0
        self.max_splits = 1
        self.max_rows = 0
        self.tiles: Optional[Tiles] = None

    @property
    def sized(self) -> bool:
        return self.tiles is not None

    def size(self, *, rows: int, q_tiles: int, batch: int, tiles: Tiles, num_sms: int, workspace_bytes: int,
             num_qo_heads: int, head_dim_vo: int) -> None:
        """Sizes the buffers from the first plan: ``rows`` query rows in at most ``q_tiles`` query tiles.
        Splits per request fill the GPU's resident slots, within what the workspace's partial states
        allow for ``rows`` rows."""
        max_splits = max(1, cdiv(tiles.programs_per_sm * num_sms, max(1, batch)))
        per_split = max(1, rows) * _plan.state_bytes(1, num_qo_heads, head_dim_vo)
        self.max_splits = max(1, min(max_splits, workspace_bytes // per_split))
        self.capacity = q_tiles * self.max_splits
        self.max_rows = rows
        self.tiles = tiles


def init_planned_wrapper(wrapper, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool) -> None:
    """The state every wrapper planned by ``plan_work``/``upload_plan`` into one ``_step`` keeps: its
    workspace and device, CUDA-graph mode, its plan uploader, the fault watch and its handle for
    ``run()`` under torch.compile (``_ops.wrapper_run``). No step yet."""
    check_tensor(float_workspace_buffer, "float_workspace_buffer")
    wrapper._float_workspace_buffer = float_workspace_buffer
    wrapper.device = device = float_workspace_buffer.device
    wrapper._use_cuda_graph = bool(use_cuda_graph)
    wrapper._graph = GraphBuffers(device) if use_cuda_graph else None
    wrapper._uploader = PlanUploader(device, reuse=True)
    wrapper._num_sms = _device.num_sms(device)
    wrapper._step = None  # what the last plan() fixed; all run() reads
    wrapper._replay = None  # the last eager run(), for the next one of the same kind (_replay.py)
    wrapper._faults = _errors.FaultWatch(device)
    wrapper._handle = _ops.register_wrapper(wrapper)


def plan_work(*, qo_lens: Optional[np.ndarray], kv_lens: np.ndarray, tiles: Tiles, num_qo_heads: int, num_kv_heads: int,
              head_dim_vo: int, page_size: int, fixed_split_size: Optional[int], disable_split_kv: bool,
              workspace_bytes: int, num_sms: int, graph: Optional[GraphBuffers],
              heaviest_first: Optional[bool] = None, merge_positions: int = 0) -> WorkPlan:
    """The work list of a plan (``qo_lens`` None: one query token per request, decode): each request's
    query tiles times its KV splits (the split chosen by
    ``kv_split_chunk``; in CUDA-graph mode at most ``graph.max_splits`` per request). With
    ``heaviest_first`` (the causal flag; None: keep the request order) the items that read the most
    KV come first (``_plan.heaviest_first``). ``merge_positions``: ``kv_split_chunk``'s merge cost."""
    q_tiles = None if qo_lens is None else -(-qo_lens.astype(np.int64) // tiles.tile_tokens)
    chunk = kv_split_chunk(kv_lens, q_tiles, num_kv_heads, num_sms, tiles.block_n, max(page_size, 1),
                           fixed_split_size, disable_split_kv, tiles.programs_per_sm, merge_positions)
    max_splits = graph.max_splits if graph is not None else None
    if graph is not None and fixed_split_size is not None and chunk is not None \
            and int((-(-kv_lens // chunk)).max()) > max_splits:
        raise ValueError(
            f"fixed_split_size={fixed_split_size} needs more splits per request than the CUDA-graph "
            f"buffers allow ({max_splits}); use a larger fixed_split_size"
        )
    work = _plan.fit_work(qo_lens, kv_lens, tiles.tile_tokens, chunk, workspace_bytes, num_qo_heads, head_dim_vo,
                          fixed_split_size is not None, max_splits=max_splits, align=tiles.block_n)
    if heaviest_first is not None:
        work = _plan.heaviest_first(work, qo_lens, kv_lens, tiles.tile_tokens, heaviest_first)
    return work


def upload_plan(uploader: PlanUploader, graph: Optional[GraphBuffers], work: WorkPlan, kv_lens: np.ndarray,
                qo: Optional[np.ndarray], extra: List[np.ndarray], non_blocking: bool) -> Tuple[DevicePlan, list]:
    """Copies a plan to the device in one transfer: the work list, KV lengths, partial-state offsets,
    the query indptr ``qo`` (None: a fixed number of query tokens per request, decode) and ``extra``
    host arrays, whose device views are returned. In CUDA-graph mode into ``graph``'s buffer, the work
    list padded to its capacity (a grid captured once stays valid)."""
    reads_kv = bool(kv_lens.any())
    head = [kv_lens, work.state_offset] + ([qo] if qo is not None else [])
    if graph is None:
        views = uploader.upload([work.work] + head + extra, non_blocking)
        capacity, state_capacity, always_merge = work.work.shape[0], work.num_states, False
    else:
        arrays = [pad_work(work, graph.capacity)] + head + extra
        if graph.buf is None:
            total = packed_starts([int(a.size) for a in arrays])[-1]
            graph.buf = torch.empty(total, dtype=torch.int32, device=graph.device)
        views = uploader.upload(arrays, non_blocking, out=graph.buf)
        capacity, state_capacity, always_merge = graph.capacity, graph.max_rows * graph.max_splits, True
    n = 3 + (qo is not None)
    qo_d = views[3] if qo is not None else None
    facts = (capacity, work.num_states, state_capacity, work.has_splits, always_merge, reads_kv)
    plan = uploader.keep_plan(views, facts, lambda: DevicePlan(
        views[0].view(-1, WORK_FIELDS), views[1], views[2], qo_d, capacity, work.num_states, state_capacity,
        work.has_splits, always_merge, uploader.counters, reads_kv, attention_launches=uploader.attention_launches))
    return plan, views[n:]


def run_step(step: PlannedStep, *, q: torch.Tensor, kv: KVSource, out: torch.Tensor, lse: Optional[torch.Tensor],
             workspace: Optional[torch.Tensor], route_kv=None, params: Optional[ScoreParams] = None,
             tiles: Optional[Tiles] = None, q_len_per_req: int = 0, state_mult: int = 1, q_scale=None, k_scale=None,
             v_scale=None, sinks=None, head_scales=None) -> Optional[DriverCall]:
    """Runs a step's attention into ``out`` (and ``lse``): a Gluon kernel (the prefill, or the fp8 decode)
    when the step's route takes it and ``route_kv`` (a ``PagedKV`` or a ``(k, v)`` pair) fits it, else the
    attention core. ``params`` and ``tiles`` default to the step's (decode's speculative runs pass causal
    ones). Returns the driver launch taken (``_launch.DriverCall``), None where the launch took Triton's path."""
    if not step.route.is_core:
        # the Gluon kernels take the scales as two factors: q_scale * k_scale on the scores, v_scale on the output
        k_mult = (1.0 if q_scale is None else float(q_scale)) * (1.0 if k_scale is None else float(k_scale))
        v_mult = 1.0 if v_scale is None else float(v_scale)
        if step.route.kernel == "decode_hopper":
            descriptors = DECODE.at_run(step.route, q, route_kv, sinks=sinks, k_mult=k_mult,
                                        q_len_per_req=q_len_per_req)
            if descriptors is not None:
                check_page_ids(step, kv)
                return _hopper.decode_launch(q, descriptors, out, lse, step.device_plan, kv.kv_indptr, kv.kv_indices,
                                             step.num_kv_heads, step.params.sm_scale, workspace, k_mult, v_mult)
        else:
            scaled = q_scale is not None or k_scale is not None or v_scale is not None
            descriptors = PREFILL.at_run(step.route, q, route_kv, sinks=sinks, head_scales=head_scales, scaled=scaled,
                                         k_mult=k_mult)
            if descriptors is not None:
                paged = kv.page_size > 0
                if paged:
                    check_page_ids(step, kv)
                return _hopper.launch(q, descriptors, out, lse, step.device_plan.qo_indptr, kv.kv_indptr,
                                      step.device_plan.kv_len, step.route_work, step.num_kv_heads, step.params.sm_scale,
                                      step.params.causal, step.device_plan.attention_launches,
                                      kv_indices=kv.kv_indices if paged else None, k_mult=k_mult, v_mult=v_mult)
    return launch_attention(
        q=q, out=out, lse=lse, kv=kv, plan=step.device_plan, tiles=tiles or step.tiles, num_kv_heads=step.num_kv_heads,
        head_dim_qk=step.head_dim_qk, head_dim_vo=step.head_dim_vo, params=params or step.params,
        q_len_per_req=q_len_per_req, state_mult=state_mult, workspace=workspace, q_scale=q_scale, k_scale=k_scale,
        v_scale=v_scale, sinks=sinks, packed_mask=step.packed_mask, mask_indptr=step.mask_indptr,
        head_scales=head_scales,
    )


def check_page_ids(step: PlannedStep, kv: KVSource) -> None:
    """For the Gluon kernel's paged mode, once per step and cache size: its TMA reads never leave the
    cache, so a separate kernel reports page ids outside it (``_hopper.check_page_ids``). Ids the plan had
    on the host were checked against the cache by ``run()`` (``HostPageTable.check_cache``): no launch."""
    if step.device_plan.pages_checked != kv.num_pages:
        if step.page_table is None or step.page_table.page_ids is None:
            _hopper.check_page_ids(kv.kv_indptr, kv.kv_indices, step.batch, kv.num_pages)
        step.device_plan.pages_checked = kv.num_pages


def plan_single(device: torch.device, *, settings: Settings, params: ScoreParams, q_dtype: torch.dtype,
                kv_dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int,
                qo_len: int, kv_len: int, tiles: Tiles, q_len_per_req: int,
                packed_mask: Optional[torch.Tensor] = None, route: Route = NO_ROUTE,
                route_of: Optional[Callable[[], Route]] = None, layout=None) -> PlannedStep:
    """The step of one request over contiguous K/V, for the single-request functions: planned on the
    device's scratch workspace and uploaded by the device's own uploader (they have no wrapper).
    ``route_of``: the route, asked only for a step not kept (its facts beside ``layout``, which also holds
    the route's switches, are in the key).

    A model calls these once per layer with the same shapes, so a step without a custom mask is kept
    (``_SINGLE_STEPS``, least recently used out) and the next layer's call reuses it, with the launches
    its plan has bound: its device arrays are never written after the upload. The Gluon route's work
    list depends only on the lengths and the mask, which the key holds. Not while a CUDA graph is
    being captured (a graph must own its plan's memory, which a kept step's eviction would free)."""
    key = None
    if packed_mask is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        key = (device, settings, params, q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
               qo_len, kv_len, tiles, q_len_per_req, route.kernel if route_of is None else layout)
        hit = _SINGLE_STEPS.get(key)
        if hit is not None:
            _SINGLE_STEPS.move_to_end(key)
            return hit
    if route_of is not None:
        route = route_of()
    step = _plan_single(device, settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype,
                        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
                        head_dim_vo=head_dim_vo, qo_len=qo_len, kv_len=kv_len, tiles=tiles,
                        q_len_per_req=q_len_per_req, packed_mask=packed_mask, route=route)
    if key is not None:
        _SINGLE_STEPS[key] = step
        if len(_SINGLE_STEPS) > SINGLE_STEPS_KEPT:
            _SINGLE_STEPS.popitem(last=False)
    return step


def _plan_single(device: torch.device, *, settings: Settings, params: ScoreParams, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int,
                 qo_len: int, kv_len: int, tiles: Tiles, q_len_per_req: int,
                 packed_mask: Optional[torch.Tensor], route: Route) -> PlannedStep:
    qo_lens = np.array([qo_len], np.int64)
    kv_lens = np.array([kv_len], np.int64)
    work = plan_work(qo_lens=qo_lens, kv_lens=kv_lens, tiles=tiles, num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, head_dim_vo=head_dim_vo, page_size=0, fixed_split_size=None,
                     disable_split_kv=False, workspace_bytes=scratch_workspace(device).numel(),
                     num_sms=_device.num_sms(device), graph=None,
                     heaviest_first=None if q_len_per_req else params.causal)
    qo = None if q_len_per_req else np.array([0, qo_len], np.int64)
    extra = [np.array([0, kv_len], np.int64)]
    if packed_mask is not None:
        extra.append(np.zeros(1, np.int64))
    if not route.is_core:
        extra.append(_hopper.padded_tiles(route.work))
    # a ring of pinned buffers: these functions plan at every call (once per layer), and waiting for
    # the previous call's copy would wait for the GPU to finish the previous layer
    uploader = _device.per_device("single_uploader", device,
                                  lambda: PlanUploader(device, slots=SINGLE_UPLOAD_SLOTS, reserve_capture=True))
    plan, views = upload_plan(uploader, None, work, kv_lens, qo, extra, non_blocking=True)
    return PlannedStep(
        settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=0, batch=1,
        total_rows=qo_len, total_kv=kv_len, kv_lens=kv_lens, tiles=tiles, device_plan=plan, kv_indptr=views[0],
        packed_mask=packed_mask, mask_indptr=views[1] if packed_mask is not None else None, route=route,
        route_work=_hopper.tiles_view(views[-1], route.work) if not route.is_core else None,
    )
