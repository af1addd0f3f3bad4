"""Launchers of the shared attention core, used by the decode, prefill and cascade wrappers.

A launcher is a function of tensors and plain values that launches the attention kernel and,
when the plan splits KV, the merge of the partial states. It never reads device memory on the
host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
import triton.language as tl

from . import _device
from ._errors import fault_record
from ._launch import CachedLauncher, DriverCall
from ._options import (
    PosEncodingMode,
    cached_by_value,
    check_soft_cap,
    check_window_left,
    parse_pos_encoding_mode,
    resolve_rope,
    resolve_sm_scale,
)
from ._plan import WORK_FIELDS, Tiles, WorkPlan, alibi_slopes
from .kernels.attention import attention_fwd_kernel

_ATTENTION = CachedLauncher(attention_fwd_kernel)

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@dataclasses.dataclass(frozen=True)
class ScoreParams:
    """Everything besides the tensors that defines the attention function."""

    sm_scale: float
    logits_soft_cap: float = 0.0  # 0: off
    window_left: int = -1
    causal: bool = False
    rope: bool = False
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    alibi: bool = False
    # multi-item scoring (the prefill wrappers' prefix_len_ptr & co.): causal, plus each item's rows see
    # only the prefix and their own item; its per-request arrays take the custom mask's place
    multi_item: bool = False


def score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                  head_dim, causal=False) -> ScoreParams:
    """Parses the plan arguments that define the attention function (cached: plan() runs every step)."""
    return _score_params_cached(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                head_dim, causal)


def _parse_score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                        head_dim, causal=False) -> ScoreParams:
    """Parses the plan arguments that define the attention function."""
    mode = parse_pos_encoding_mode(pos_encoding_mode)
    rope_scale, rope_theta = resolve_rope(rope_scale, rope_theta)
    return ScoreParams(
        sm_scale=resolve_sm_scale(sm_scale, head_dim),
        logits_soft_cap=check_soft_cap(logits_soft_cap),
        window_left=check_window_left(window_left),
        causal=causal,
        rope=mode == PosEncodingMode.ROPE_LLAMA,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        alibi=mode == PosEncodingMode.ALIBI,
    )


_score_params_cached = cached_by_value(_parse_score_params)
_PARAMS: dict = {}


def canonical_params(params: ScoreParams) -> ScoreParams:
    """One object per distinct scores, for params made by ``dataclasses.replace`` at a plan: bound
    launches are kept by the identity of their params (as of their tiles, ``_plan.canonical``)."""
    return _PARAMS.setdefault(params, params)


@dataclasses.dataclass
class KVSource:
    """K/V as the kernel reads them: element strides over (page or token, slot, head)."""

    k: torch.Tensor
    v: torch.Tensor
    k_strides: tuple
    v_strides: tuple
    page_size: int  # 0: ragged (no page table); kv_indptr then holds token offsets
    kv_indptr: torch.Tensor
    kv_indices: Optional[torch.Tensor] = None
    num_pages: int = 0  # pages of the cache (paged): the kernel reads no page id outside [0, num_pages)


@dataclasses.dataclass
class DevicePlan:
    """A work list on the device. ``capacity`` fixes the launch grid (CUDA-graph safe)."""

    work: torch.Tensor  # int32 [capacity, WORK_FIELDS]
    kv_len: torch.Tensor  # int32 [batch]
    state_offset: torch.Tensor  # int32 [batch]
    qo_indptr: Optional[torch.Tensor]  # int32 [batch + 1]; None when q_len_per_req is fixed
    capacity: int
    num_states: int  # partial states with state_mult 1
    state_capacity: int  # states the workspace layout reserves (with state_mult 1); fixed in CUDA-graph mode
    has_splits: bool
    always_merge: bool  # CUDA-graph mode: a later plan may split, so split states are always laid out
    counters: Optional["SplitCounters"] = None  # the uploader's (the fused split merge's arrival counters)
    reads_kv: bool = True  # some request has KV (a paged plan then needs a cache with pages)
    # the cache size whose page ids a run checked for the Gluon kernel (_step.check_page_ids), -1: none
    pages_checked: int = dataclasses.field(default=-1, compare=False)
    # the bound launches of launch_attention (AttentionLaunch) and of the Gluon kernels (_hopper.py), by run
    # variant: the uploader's, shared by the plans of one wrapper (a new plan rebinds them)
    attention_launches: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


class SplitCounters:
    """The attention kernel's arrival counters for its fused split merge (``kernels/attention.py``):
    int32, zero between launches (the last split of a group resets its counter). One buffer per
    plan uploader, so per wrapper: a wrapper's runs are ordered on its stream. Grown by a new
    zeroed buffer when a plan needs more; old buffers are kept, since a captured graph may point
    into them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list = []

    def get(self, n: int) -> torch.Tensor:
        if not self.buffers or self.buffers[-1].numel() < n:
            size = max(n, 2 * self.buffers[-1].numel() if self.buffers else 4096)
            self.buffers.append(torch.zeros(size, dtype=torch.int32, device=self.device))
        return self.buffers[-1]


_STREAMS: dict = {}


def _current_stream(device: torch.device) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)``, found by the raw stream handle: building the Stream object
    costs ~5 µs on the H200 host, the handle 0.2 (``benchmarks/host_primitives.py``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream(index)
    stream = _STREAMS.get((index, raw))
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[(index, raw)] = torch.cuda.current_stream(index)
    return stream


# int32 entries of a pinned arena for plans uploaded during a CUDA-graph capture (256 KB: a
# single-request plan is tens to hundreds of entries)
CAPTURE_ARENA_INTS = 1 << 16


class PlanUploader:
    """Copies a plan's int32 host arrays to the device in one transfer.

    With a GPU the arrays go through one of ``slots`` pinned host buffers, used in turn; before
    overwriting one, a plan waits for the copy out of it that the plan ``slots`` uploads earlier
    queued, so ``non_blocking`` copies are safe. A wrapper plans once per step (one slot: that
    copy finished long ago); the single-request functions plan at every call, once per layer, and
    one slot would make each call wait for the GPU to finish the previous layer: a host sync per
    layer (measured: batch-1 prefill under transformers 2.5x slower than SDPA).

    While a CUDA graph is being captured (a single-request function inside a captured step), the
    graph's copy reads its host buffer at every replay, so the arrays go to a region of a pinned
    arena that is never written again (``_captured``), with no event: later plans cannot change what
    a replay uploads.
    """

    def __init__(self, device: torch.device, slots: int = 1, reserve_capture: bool = False,
                 reuse: bool = False) -> None:
        """``reserve_capture``: the first capture arena now (a pinned allocation inside a capture is
        best avoided; the single-request functions are the ones called inside captured steps).
        ``reuse``: every plan goes to one device buffer (a wrapper's: its next plan replaces the last,
        as FlashInfer's plan rewrites its int workspace), so plans of the same sizes get the same
        views and the same ``DevicePlan`` (``keep_plan``), whose bound launches need no rebinding.
        The copy is ordered after the work queued on the stream before it, as FlashInfer's is."""
        self.device = torch.device(device)
        self._reuse = reuse
        self._dev: Optional[torch.Tensor] = None  # the reused device buffer
        self._views: Optional[list] = None  # the views last cut from a persistent buffer,
        self._views_of: tuple = (None, ())  # ... of this (buffer, sizes)
        self._plan: Optional["DevicePlan"] = None  # the last plan kept, with its views and facts
        self._plan_of: tuple = (None, None)
        self._host: List[Optional[torch.Tensor]] = [None] * slots
        self._host_np: list = [None] * slots  # numpy views of the pinned buffers
        self._copy_of: tuple = ()  # the (host, device, entries) of the last copy
        self._copy_views: tuple = ()  # ... and its (device, host) slices
        self._done: List[Optional[torch.cuda.Event]] = [None] * slots
        self._next = 0
        self.counters = SplitCounters(self.device)
        # the attention core's bound launches, shared by the plans uploaded here (DevicePlan)
        self.attention_launches: dict = {}
        self._arenas: List[torch.Tensor] = []  # pinned int32, kept: captured graphs read them
        self._arena_used = 0
        if reserve_capture and self.device.type == "cuda":
            self._arenas.append(torch.empty(CAPTURE_ARENA_INTS, dtype=torch.int32, pin_memory=True))

    def _captured(self, n: int) -> torch.Tensor:
        """``n`` int32 of pinned host memory that nothing writes after this call."""
        if not self._arenas or self._arena_used + n > self._arenas[-1].numel():
            self._arenas.append(torch.empty(max(n, CAPTURE_ARENA_INTS), dtype=torch.int32, pin_memory=True))
            self._arena_used = 0
        region = self._arenas[-1][self._arena_used:self._arena_used + n]
        self._arena_used += n
        return region

    def upload(self, arrays: list, non_blocking: bool = True, out: Optional[torch.Tensor] = None) -> list:
        """Returns device views of ``arrays`` (in ``out`` when given: a fixed int32 buffer of at least
        ``packed_size`` entries), each starting on a 16-byte boundary."""
        sizes = [int(a.size) for a in arrays]
        starts = packed_starts(sizes)
        total = starts[-1]
        if out is not None and out.numel() < total:
            raise ValueError(f"plan buffer too small: {out.numel()} < {total}")
        if self.device.type != "cuda":
            dev = out if out is not None else self._buffer(total) if self._reuse else \
                torch.empty(total, dtype=torch.int32)
            dev_np = dev.numpy()
            for a, n, pos in zip(arrays, sizes, starts):
                dev_np[pos:pos + n] = a.reshape(-1)
        else:
            capturing = torch.cuda.is_current_stream_capturing()
            if capturing:
                host, done = self._captured(max(total, 1)), None
            else:
                slot = self._next
                self._next = (slot + 1) % len(self._host)
                done = self._done[slot]
                if done is not None:
                    done.synchronize()
                host = self._host[slot]
                if host is None or host.numel() < total:
                    host = self._host[slot] = torch.empty(max(total, 1024), dtype=torch.int32,
                                                          pin_memory=_device.can_pin_memory())
                    self._host_np[slot] = host.numpy()
                if done is None:
                    done = self._done[slot] = torch.cuda.Event()
            host_np = host.numpy() if capturing else self._host_np[slot]
            for a, n, pos in zip(arrays, sizes, starts):
                host_np[pos:pos + n] = a.reshape(-1)
            # a graph captured around this copy keeps writing its buffer at every replay: a fresh one
            dev = out if out is not None else self._buffer(total) if self._reuse and not capturing else \
                torch.empty(total, dtype=torch.int32, device=self.device)
            # (a wrapper's plans are mostly of one size: the slices of the last copy are kept, ~1 µs each)
            last = self._copy_of
            if capturing:
                dst, src = dev[:total], host[:total]
            elif last and last[0] is host and last[1] is dev and last[2] == total:
                dst, src = self._copy_views
            else:
                dst, src = self._copy_views = dev[:total], host[:total]
                self._copy_of = (host, dev, total)
            dst.copy_(src, non_blocking=non_blocking or capturing)
            if done is not None:
                done.record(_current_stream(self.device))
        if dev is self._views_of[0] and sizes == self._views_of[1]:
            return self._views
        views = [dev[pos:pos + n] for n, pos in zip(sizes, starts)]
        if dev is out or dev is self._dev:  # persistent: the next plan of these sizes gets these views
            self._views, self._views_of = views, (dev, sizes)
        return views

    def _buffer(self, total: int) -> torch.Tensor:
        """The reused device buffer, grown to ``total`` entries (a new one: graphs may hold the old)."""
        if self._dev is None or self._dev.numel() < total:
            self._dev = torch.empty(max(total, 1024), dtype=torch.int32, device=self.device)
        return self._dev

    def keep_plan(self, views: list, facts: tuple, make: Callable[[], "DevicePlan"]) -> "DevicePlan":
        """The plan of ``views`` (as ``upload`` returned them) and ``facts`` (its scalars): the last one
        when both are the same (its page-id check reset), else ``make()``, kept for the next."""
        plan = self._plan
        if plan is not None and views is self._plan_of[0] and facts == self._plan_of[1]:
            plan.pages_checked = -1
            return plan
        plan = make()
        self._plan, self._plan_of = plan, (views, facts)
        return plan


def packed_starts(sizes: List[int]) -> List[int]:
    """Where ``PlanUploader.upload`` puts arrays of ``sizes`` int32 entries, and (last) the entries it
    needs: every array starts on a 16-byte boundary. Triton specialises pointers on that alignment,
    so aligned plan views keep one compiled kernel (and one shared launch, ``_launch.py``) for every
    plan, whatever its sizes."""
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos = (pos + n + 3) & ~3
    starts.append(pos)
    return starts


def pad_work(plan: WorkPlan, capacity: int) -> np.ndarray:
    """A work list padded to a fixed capacity (CUDA-graph mode); unused slots get request -1."""
    n = plan.work.shape[0]
    if n > capacity:
        raise ValueError(
            f"the plan needs {n} work items but the CUDA-graph buffers hold {capacity}; "
            "create the wrapper with a larger batch or plan with disable_split_kv=True"
        )
    padded = np.full((capacity, WORK_FIELDS), -1, np.int32)
    padded[:n] = plan.work
    return padded


SCRATCH_BYTES = 32 << 20


def scratch_workspace(device: torch.device) -> torch.Tensor:
    """A per-device float workspace for the single-request functions, which have no wrapper to
    hold one (FlashInfer keeps a 32 MiB buffer for the same purpose)."""
    return _device.per_device("scratch_workspace", device,
                              lambda: torch.empty(SCRATCH_BYTES, dtype=torch.uint8, device=device))


def alibi_tensor(num_heads: int, device: torch.device) -> torch.Tensor:
    return _device.per_device("alibi_slopes", device, lambda: torch.from_numpy(alibi_slopes(num_heads)).to(device),
                              num_heads)


# fp8 K/V become fp16 for the dots (one cvt.f16x2.e4m3x2 per two elements; bf16 has no direct
# conversion): q is converted to fp16 too, exact for |q| < 65504.
FP8_DOT_FP16 = True


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """Operand dtype of the kernel's ``tl.dot``: the query dtype (fp16 with fp8 KV when
    ``FP8_DOT_FP16``), fp32 under the interpreter."""
    if _device.is_interpreter():
        return tl.float32
    if FP8_DOT_FP16 and kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tl.float16
    return _TL_DTYPES[q_dtype]


@dataclasses.dataclass(frozen=True)
class AttentionVariant:
    """One compiled variant of ``attention_fwd_kernel``: its compile-time arguments, nothing else.
    Built only by :func:`attention_variant`, which rejects combinations the kernel cannot run (the
    kernel asserts the same statically); :meth:`kwargs` is the only source of the launch's keywords."""

    group: int
    tile_tokens: int
    head_dim_qk: int
    head_dim_vo: int
    block_m: int
    block_n: int
    is_paged: bool
    page_size: int
    is_causal: bool
    has_window: bool
    has_soft_cap: bool
    has_alibi: bool
    has_rope: bool
    has_custom_mask: bool
    multi_item: bool
    has_sinks: bool
    has_head_scales: bool
    write_lse: bool
    dot_dtype: object  # tl.dtype of the dots' operands
    prefetch_pages: bool
    kv_as_m: bool
    mask_free_tiles: bool
    fold_scale: bool
    lanes: int
    num_stages: int
    num_warps: int

    def kwargs(self) -> dict:
        block_dqk = max(16, 1 << (self.head_dim_qk - 1).bit_length())
        block_dv = max(16, 1 << (self.head_dim_vo - 1).bit_length())
        # the fused split merge (kernels/attention.py): the rows an item has (tokens x group, as a
        # power of two, at most the block), all value columns at once where that stays within
        # 4096 elements per load, and up to 8192 elements of states in flight per round
        merge_m = min(self.block_m, 1 << max(0, (self.tile_tokens * self.group - 1).bit_length()))
        merge_dv = block_dv if merge_m * block_dv <= 4096 else max(16, 4096 // merge_m)
        return dict(
            GROUP=self.group, HEAD_DIM_QK=self.head_dim_qk, HEAD_DIM_VO=self.head_dim_vo,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_DQK=block_dqk, BLOCK_DV=block_dv,
            IS_PAGED=self.is_paged, PAGE_SIZE=self.page_size, IS_CAUSAL=self.is_causal,
            HAS_WINDOW=self.has_window, HAS_SOFT_CAP=self.has_soft_cap, HAS_ALIBI=self.has_alibi,
            HAS_ROPE=self.has_rope, HAS_CUSTOM_MASK=self.has_custom_mask, MULTI_ITEM=self.multi_item,
            HAS_SINKS=self.has_sinks,
            HAS_HEAD_SCALES=self.has_head_scales, WRITE_LSE=self.write_lse, DOT_DTYPE=self.dot_dtype,
            PREFETCH_PAGES=self.prefetch_pages, KV_AS_M=self.kv_as_m, MASK_FREE_TILES=self.mask_free_tiles,
            FOLD_SCALE=self.fold_scale, LANES=self.lanes, LANE_TOKENS=self.block_n // max(self.lanes, 1),
            NUM_STAGES=self.num_stages, num_warps=self.num_warps, num_stages=self.num_stages,
            MERGE_M=merge_m, MERGE_DV_CHUNK=merge_dv,
            MERGE_SPLIT_BLOCK=1 << max(0, min(5, (8192 // (merge_m * merge_dv)).bit_length() - 1)),
        )

    def unfolded(self) -> "AttentionVariant":
        """The same variant with the softmax scale applied before the max (any sign of scale)."""
        return dataclasses.replace(self, fold_scale=False)


def attention_variant(params: ScoreParams, tiles: Tiles, *, group: int, head_dim_qk: int, head_dim_vo: int,
                      page_size: int, has_custom_mask: bool, has_sinks: bool, has_head_scales: bool,
                      write_lse: bool, dot) -> AttentionVariant:
    """The kernel variant for these scores, tiles and features. The softmax scale is folded into exp2's
    argument only where the scores need no other transform (no soft cap, ALiBi or per-head scales).
    Raises ``ValueError`` for a combination the kernel cannot run: the dot-free single-row path
    (``tiles.lanes``) has no RoPE, ALiBi, custom mask, per-head scales or multi-item scoring and needs a
    group of one; multi-item scoring takes the custom mask's arguments, so the two exclude each other."""
    soft_cap = params.logits_soft_cap > 0
    if tiles.lanes:
        missing = [name for name, on in (("RoPE", params.rope), ("ALiBi", params.alibi),
                                          ("a custom mask", has_custom_mask), ("per-head scales", has_head_scales),
                                          ("GQA groups", group != 1), ("KV as the dots' M", tiles.kv_as_m),
                                          ("multi-item scoring", params.multi_item)) if on]
        if missing:
            raise ValueError(f"attention variant: the dot-free single-row tiles cannot run {', '.join(missing)}")
    if params.multi_item and has_custom_mask:
        raise ValueError("attention variant: multi-item scoring and a custom mask exclude each other")
    return AttentionVariant(
        group=group, tile_tokens=tiles.tile_tokens, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, block_m=tiles.block_m,
        block_n=tiles.block_n, is_paged=page_size > 0, page_size=max(page_size, 1),
        is_causal=params.causal or params.multi_item, has_window=params.window_left >= 0, has_soft_cap=soft_cap,
        has_alibi=params.alibi, has_rope=params.rope, has_custom_mask=has_custom_mask,
        multi_item=params.multi_item, has_sinks=has_sinks, has_head_scales=has_head_scales, write_lse=write_lse,
        dot_dtype=dot, prefetch_pages=tiles.prefetch_pages, kv_as_m=tiles.kv_as_m,
        mask_free_tiles=tiles.mask_free_tiles,
        fold_scale=tiles.fold_scale and not (soft_cap or params.alibi or has_head_scales),
        lanes=tiles.lanes, num_stages=tiles.num_stages, num_warps=tiles.num_warps,
    )


def launch_attention(
    *,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: Optional[torch.Tensor],
    kv: KVSource,
    plan: DevicePlan,
    tiles: Tiles,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    params: ScoreParams,
    q_len_per_req: int,
    state_mult: int,
    workspace: Optional[torch.Tensor],
    q_scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    packed_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    head_scales: Optional[tuple] = None,
) -> Optional[DriverCall]:
    """Attention of ``q`` [tokens, H_qo, D_qk] over ``kv`` into ``out`` [tokens, H_qo, D_vo] (and
    ``lse`` [tokens, H_qo] float32, base 2), following ``plan``. Returns the driver launch taken
    (``_launch.DriverCall``), or None where the launch took Triton's path.

    ``q_scale``/``k_scale`` fold into the softmax scale, ``v_scale`` multiplies the output;
    ``sinks`` [H_qo] float32 are per-head logits added to the softmax denominator;
    ``head_scales`` = (scale_q [H_qo], scale_k [H_kv], scale_v [H_kv]) float32 per-head scales.
    ``packed_mask`` (uint8, little-endian bits) with ``mask_indptr`` (int32 byte offsets per
    request) is a custom mask; with ``params.multi_item`` they are multi-item scoring's instead:
    ``packed_mask`` the token positions within items (int32), ``mask_indptr`` int32 ``[batch, 2]``
    per request (offset of sequence position 0 in them, prefix length).

    The launch with everything but the per-call tensors and scales bound (``AttentionLaunch``) is
    kept in ``plan.attention_launches``, which the plans of one uploader (one wrapper) share: a
    wrapper's later ``run()`` calls skip rebuilding it, and the first ``run()`` after a new plan only
    rebinds the plan's tensors (``AttentionLaunch.bind_plan``). The key holds the identities of
    canonical objects the launch keeps alive (so an identity is never reused); the plan's own
    tensors are compared by identity at each call.
    """
    key = (id(params), id(tiles), id(workspace), kv.page_size, q_len_per_req, state_mult, num_kv_heads, head_dim_qk,
           head_dim_vo, q.shape[1], q.dtype, kv.k.dtype, lse is None, sinks is None, head_scales is None,
           packed_mask is None)
    launches = plan.attention_launches
    bound = launches.get(key)
    if bound is None:
        if len(launches) >= 16:
            launches.clear()
        bound = launches[key] = AttentionLaunch(
            plan=plan, kv=kv, tiles=tiles, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, params=params, q_len_per_req=q_len_per_req,
            state_mult=state_mult, workspace=workspace, dot=dot_dtype(q.dtype, kv.k.dtype), has_lse=lse is not None,
            has_sinks=sinks is not None, has_head_scales=head_scales is not None, packed_mask=packed_mask,
            mask_indptr=mask_indptr,
        )
    elif (bound.plan is not plan or bound.kv_indptr is not kv.kv_indptr or bound.kv_indices is not kv.kv_indices
          or bound.packed_mask is not packed_mask or bound.mask_indptr is not mask_indptr):
        bound.bind_plan(plan, kv, packed_mask, mask_indptr)
    return bound(q, out, lse, kv, q_scale, k_scale, v_scale, sinks, head_scales)


class AttentionLaunch:
    """The attention kernel's launch (split states merged inside it) with what one plan fixes bound: the
    grid, the tiles, the plan's tensors, the workspace and the flags. A call passes the tensors
    and scales that may change from call to call; ``bind_plan`` moves the launch to another plan of
    the same shapes and settings (a wrapper's next step)."""

    def __init__(self, *, plan: DevicePlan, kv: KVSource, tiles: Tiles, num_qo_heads: int, num_kv_heads: int,
                 head_dim_qk: int, head_dim_vo: int, params: ScoreParams, q_len_per_req: int, state_mult: int,
                 workspace: Optional[torch.Tensor], dot, has_lse: bool, has_sinks: bool, has_head_scales: bool,
                 packed_mask: Optional[torch.Tensor], mask_indptr: Optional[torch.Tensor]) -> None:
        self.device = device = plan.kv_len.device
        # for pointers a disabled feature never reads: an allocation of its own, so 16-byte aligned
        # (a plan view may not be, which would keep every call off the driver launch path)
        self.dummy = dummy = _device.per_device("unread", device,
                                                lambda: torch.zeros(16, dtype=torch.int32, device=device))
        # the partial states' stand-in for a plan without splits: float32 as the states are, so that a later
        # plan with splits specialises the kernel the same way (an int32 stand-in compiled it again mid-serving)
        self.unread_states = _device.per_device("unread_states", device,
                                                lambda: torch.zeros(16, dtype=torch.float32, device=device))
        self.sm_scale = params.sm_scale
        self.num_qo_heads, self.num_kv_heads, self.head_dim_vo = num_qo_heads, num_kv_heads, head_dim_vo
        self.tiles, self.state_mult, self.workspace = tiles, state_mult, workspace
        # objects whose identities are in launch_attention's key: alive as long as this launch is
        self.keep = (params, tiles, workspace)
        self.variant = variant = attention_variant(
            params, tiles, group=num_qo_heads // num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=kv.page_size, has_custom_mask=packed_mask is not None and not params.multi_item,
            has_sinks=has_sinks, has_head_scales=has_head_scales, write_lse=has_lse, dot=dot)
        # lse, its row stride, sinks and the three head scales follow the per-call arguments: those
        # up to the last feature this launch has are passed per call, the rest bound here unread
        present = [has_lse, has_lse, has_sinks] + [has_head_scales] * 3
        self.optional = max((i + 1 for i, on in enumerate(present) if on), default=0)
        self._leading = (dummy, 0, dummy, dummy, dummy, dummy)[self.optional:]
        self._settings = (
            alibi_tensor(num_qo_heads, device) if params.alibi else dummy, fault_record(device))
        self._scalars = (q_len_per_req, tiles.tile_tokens, state_mult, num_qo_heads, params.logits_soft_cap,
                         1.0 / params.rope_scale, math.log2(params.rope_theta), params.window_left)
        grid, tail = self.plan_grid, self.plan_tail = self._plan_tail(plan, kv, packed_mask, mask_indptr)
        self.attention = _ATTENTION.bind(grid, tail, variant.kwargs())
        # the folded softmax needs a positive scale; a call with another one (sm_scale, q_scale or
        # k_scale <= 0) takes the same launch unfolded
        self.unfolded = self.attention
        if variant.fold_scale:
            self.unfolded = _ATTENTION.bind(grid, tail, variant.unfolded().kwargs())

    def bind_plan(self, plan: DevicePlan, kv: KVSource, packed_mask: Optional[torch.Tensor],
                  mask_indptr: Optional[torch.Tensor], rebind: bool = True) -> None:
        """The same launch over another plan's tensors (its work list, page table, mask and partial
        states): the compiled kernels and parameter buffers stay, only the plan's values are
        rewritten (``BoundLaunch.rebind``). ``rebind`` False: only ``plan_grid`` / ``plan_tail`` are
        computed (a pair launch reads them and never launches this one's kernels)."""
        grid, tail = self.plan_grid, self.plan_tail = self._plan_tail(plan, kv, packed_mask, mask_indptr)
        if not rebind:
            return
        self.attention.rebind(grid, tail)
        if self.unfolded is not self.attention:
            self.unfolded.rebind(grid, tail)

    def _plan_tail(self, plan: DevicePlan, kv: KVSource, packed_mask: Optional[torch.Tensor],
                   mask_indptr: Optional[torch.Tensor]) -> Tuple[tuple, tuple]:
        """The grid and the bound arguments for ``plan``; records the plan's tensors (by identity)."""
        dummy, num_qo_heads, head_dim_vo, workspace = self.dummy, self.num_qo_heads, self.head_dim_vo, self.workspace
        # the layout depends only on state_capacity, so a captured graph keeps valid pointers
        states = plan.state_capacity * self.state_mult
        if plan.has_splits or plan.always_merge:
            need = states * num_qo_heads * (head_dim_vo + 1)
            if workspace is None or workspace.numel() // 4 < need:
                have = 0 if workspace is None else workspace.numel()
                raise ValueError(
                    f"float_workspace_buffer: the plan needs {need * 4} bytes for split-KV states, the buffer has {have}"
                )
            ws = workspace[: (workspace.numel() // 4) * 4].view(torch.float32)
            part_o = ws[: states * num_qo_heads * head_dim_vo]
            part_lse = ws[states * num_qo_heads * head_dim_vo: need]
            # one counter per (group of split items, KV head, row program); groups <= work items
            counters = plan.counters.get(plan.capacity * self.num_kv_heads * self.tiles.row_tiles)
        else:
            # never touched: every item writes its final output
            part_o = part_lse = self.unread_states
            counters = dummy
        self.plan, self.kv_indptr, self.kv_indices = plan, kv.kv_indptr, kv.kv_indices
        self.packed_mask, self.mask_indptr = packed_mask, mask_indptr
        self.needs_pages = kv.page_size > 0 and plan.reads_kv
        tail = self._leading + (
            part_o, part_lse, counters, plan.work, plan.qo_indptr if plan.qo_indptr is not None else dummy,
            kv.kv_indptr, kv.kv_indices if kv.kv_indices is not None else dummy, plan.kv_len, plan.state_offset,
            packed_mask if packed_mask is not None else dummy, mask_indptr if mask_indptr is not None else dummy,
            *self._settings, kv.kv_indices.numel() if kv.kv_indices is not None else 0, *self._scalars)
        return (plan.capacity, self.num_kv_heads, self.tiles.row_tiles), tail

    def __call__(self, q: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], kv: KVSource,
                 q_scale: Optional[float], k_scale: Optional[float], v_scale: Optional[float],
                 sinks: Optional[torch.Tensor], head_scales: Optional[tuple]) -> Optional[DriverCall]:
        """Launches; returns the driver launch taken (``BoundLaunch.__call__``), or None."""
        folded, head = self.head_args(q, out, lse, kv, q_scale, k_scale, v_scale, sinks, head_scales)
        launch = self.attention if folded else self.unfolded
        if not self.optional:
            return launch(*head)
        return launch(*head, *self.optional_args(lse, sinks, head_scales)[:self.optional])

    def head_args(self, q: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], kv: KVSource,
                  q_scale: Optional[float], k_scale: Optional[float], v_scale: Optional[float],
                  sinks: Optional[torch.Tensor] = None, head_scales: Optional[tuple] = None) -> Tuple[bool, tuple]:
        """The 17 per-call arguments every launch passes, and whether the folded-scale variant may run
        (a positive scale). Raises ``ValueError`` for a tensor on another device."""
        dev = self.device
        # the bound launch passes addresses, so a tensor on another device must be caught here
        if q.device != dev or out.device != dev or kv.k.device != dev or kv.v.device != dev or (
                lse is not None and lse.device != dev) or (sinks is not None and sinks.device != dev) or (
                head_scales is not None and any(t.device != dev for t in head_scales)):
            raise ValueError(f"attention: every tensor must be on the plan's device {dev}")
        if self.needs_pages and kv.num_pages == 0:
            raise ValueError("paged_kv_cache: the cache has no pages, but the plan reads KV from it")
        sm_scale = self.sm_scale * (1.0 if q_scale is None else float(q_scale)) * (1.0 if k_scale is None else float(k_scale))
        v_scale = 1.0 if v_scale is None else float(v_scale)
        qs, os_ = q.stride(), out.stride()  # (one call each: stride(i) costs ~2x stride() from Python)
        return sm_scale > 0, (q, qs[0], qs[1], out, os_[0], os_[1], kv.k, *kv.k_strides,
                              kv.v, *kv.v_strides, kv.num_pages, sm_scale * 1.4426950408889634, v_scale)

    def optional_args(self, lse: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                      head_scales: Optional[tuple]) -> tuple:
        """The 6 optional per-call arguments (lse, its row stride, sinks, three head scales), the
        absent ones as the placeholder the launch binds."""
        dummy = self.dummy
        return ((lse, lse.stride(0)) if lse is not None else (dummy, 0)) + (
            sinks if sinks is not None else dummy,) + (head_scales if head_scales is not None else (dummy,) * 3)
