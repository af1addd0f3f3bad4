"""Multi-head latent attention (MLA): FlashInfer 0.5.3's ``flashinfer.mla.BatchMLAPagedAttentionWrapper``,
``flashinfer.page.append_paged_mla_kv_cache`` and the deprecated
``flashinfer.decode.BatchDecodeMlaWithPagedKVCacheWrapper``.

Absorbed MLA (DeepSeek V2/V3/R1, Kimi K2): every query head attends to one shared latent cache,
``ckv`` ``[num_pages, page_size, head_dim_ckv]`` (512 for DeepSeek) and ``kpe``
``[num_pages, page_size, head_dim_kpe]`` (64). For a query row ``[q_nope; q_pe]``:
``s = (q_nope·ckv + q_pe·kpe) * sm_scale``, ``out = softmax(s)·ckv`` (``tritoninfer.reference.mla``).

The kernel (``kernels/mla.py``) lets one program take a block of (query token, head) rows of a
request and load each KV tile once for all of them, so the latent cache is read once per request
and row block, not once per head. ``plan()`` does the host work (page-table checks, the split-KV
decision and work list of ``_step.plan_work``, one upload); ``run()`` checks its tensors against the
plan and launches the kernel, then, when the plan splits a request's KV, the kernel's merge pass
(each split's program merges a share of the value columns of its group's partial states:
``_MERGE_PASS``). ``run()`` never synchronises with the host.

Beyond FlashInfer 0.5.3 (whose MLA refuses fp8): an fp8 latent cache, ``kv_data_type`` e4m3 (or
e5m2), with per-tensor dequantisation scales given to ``run(ckv_scale=, kpe_scale=)``, the names and
semantics of later FlashInfer releases (``real = stored * scale``; SGLang's ``flashinfer_mla``
backend plans ``q_data_type=bfloat16, kv_data_type=float8_e4m3fn`` and runs with
``ckv_scale=kpe_scale=k_scale``). It halves the bytes the memory-bound (few-head) shapes read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, Optional, Tuple, Union, overload

import numpy as np
import torch
from . import _device, _hopper, _ops
from ._attention import DevicePlan, dot_dtype
from ._errors import fault_record
from ._launch import CachedLauncher, DriverCall, TmaBox
from ._kvcache import check_graph_plan, copy_graph_page_table, init_graph_page_table
from ._options import (
    FP8_DTYPES,
    check_dtype_in,
    check_graph_buffers,
    check_indptr_host,
    check_out,
    check_positive_int,
    check_tensor,
    canonicalize_dtype,
    copy_into,
    host_index,
)
from ._plan import Tiles, canonical, cdiv, next_pow2
from ._replay import RunReplay, replayed, scalar_options
from ._route import MLA as MLA_ROUTE
from ._route import Route, core
from ._step import init_planned_wrapper, plan_work, upload_plan
from .kernels.mla import mla_fwd_kernel
from .page import append_paged_kv_cache

__all__ = ["BatchMLAPagedAttentionWrapper", "BatchDecodeMlaWithPagedKVCacheWrapper", "append_paged_mla_kv_cache"]

_MLA = CachedLauncher(mla_fwd_kernel)

# FlashInfer's backend names for this wrapper; every one but "cutlass" runs tritoninfer's kernel
MLA_BACKENDS = ("auto", "fa2", "fa3", "cutlass")
MLA_DTYPES = (torch.float16, torch.bfloat16)
# an fp8 cache (beyond FlashInfer 0.5.3); fp8 queries only with one (their output is bfloat16)
MLA_KV_DTYPES = MLA_DTYPES + FP8_DTYPES
MLA_Q_DTYPES = MLA_DTYPES + FP8_DTYPES
_LN2 = math.log(2.0)


# The GPU tiles below as constants, so that a run can try others (``tritoninfer bench mla --set
# mla._STAGES_16=7``; the sm_90 compile test guards the defaults): KV positions a loop step, pipeline
# stages and warps of the 16-row blocks (KV as the dots' M) and of the larger ones. Stages are what
# Triton's pipeliner is given, not the buffers it makes: the latent tile's load waits on its page ids'
# load, and that chain takes stages. At 16 rows (TTGIR for sm_90) 3-4 stages give the tile one shared
# buffer (its next load is issued after the current tile's last dot: no overlap), 5-6 give two, 7
# three (131 KB, 160 registers); at 32 rows 2-4 give one, 5-6 two (113 KB); at 64 rows 2-4 give two,
# 5 three (185 KB). An fp8 tile is converted in registers, not pipelined through shared memory. Yet on
# the H200 three buffers at 16 rows ran slower than one (16 heads, 64 x 8K: 437 against 346 us,
# benchmarks/NOTES.md session 13): the single-buffered choice stays.
_KV_TILE_16, _STAGES_16, _WARPS_16, _KV_AS_M_16, _MASK_FREE_16 = 32, 3, 8, True, True
_KV_TILE, _STAGES, _STAGES_32, _WARPS = 32, 2, 2, 8


def mla_tiles(num_heads: int, avg_q_len: float, kv_fp8: bool = False) -> Tiles:
    """Tiles of the MLA kernel: ``block_m`` rows per program (query tokens x heads of one request,
    at most 64: a 64 x 512 fp32 accumulator alone takes 128 registers per thread over 8 warps),
    ``tile_tokens`` query tokens per work item and ``row_tiles`` programs per item.

    Keyed on the head count and the batch's mean query tokens per request (as ``prefill_tiles`` on
    its packed rows), never on KV lengths. 64 heads or more fill the block with one token's heads;
    fewer heads take several query tokens per item (speculative verify, prefill), so the KV tile is
    still read once for up to 64 rows. Chosen by ptxas's report for sm_90 at DeepSeek's dims (not
    timed on a GPU yet; ``tests/test_sm90_compile.py`` asserts no spills):

    - 16 rows: KV as the dots' M (wgmma reads the latent tile from shared memory), 32-position
      tiles, 3 stages (one buffer of the tile, above): 125 registers;
    - 32 rows: 181 registers at 2 stages (mma.sync: wgmma needs 64 rows per warpgroup);
    - 64 rows: 32-position tiles, 2 stages, one masked loop (``mask_free_tiles=False``): 255
      registers, no spills, 148 KB of shared memory. Two loop bodies (mask-free, then masked)
      spill 124-220 bytes; 64-position tiles spill 8-32 bytes outside the loop and need 221 KB;
      16 warps cap a thread at 128 registers and spill in the loop. The score dot of a chained
      pair keeps all 8 warps on M (Triton), so both warpgroups compute the same 64 x 32 scores:
      1.5x the useful tensor work at 128 heads.

    An fp8 cache (``kv_fp8``) is converted to fp16 in registers on its way to the dots, which at 64
    rows spills 256-320 bytes (16- or 32-position tiles, 1 or 2 stages; 16 warps spill more): its
    blocks stop at 32 rows, one masked loop (186-188 registers; with the mask-free loop too, 255
    and 8 bytes of spills). 128 heads then take 4 row programs per KV tile (their reads of it meet
    in L2); 16 rows keep their tiles (200 registers).

    One program per SM for the split policy (the tiles take most of an SM's registers).
    """
    max_rows = 32 if kv_fp8 else 64
    if num_heads >= max_rows:
        tokens = 1
    else:
        tokens = max(1, min(next_pow2(max(1, math.ceil(avg_q_len))), max_rows // num_heads))
    rows = num_heads * tokens
    if _device.is_interpreter():
        # 16 x 16 blocks: each tl op costs time there, not registers
        tokens = max(1, min(tokens, 16 // num_heads)) if num_heads < 16 else 1
        return canonical(Tiles(16, 16, 1, 1, tokens, cdiv(num_heads * tokens, 16), prefetch_pages=False,
                               programs_per_sm=1, mask_free_tiles=True))
    block_m = min(max_rows, max(16, next_pow2(rows)))
    if block_m == 16:
        return canonical(Tiles(16, _KV_TILE_16, _WARPS_16, _STAGES_16, tokens, cdiv(rows, 16), prefetch_pages=False,
                               kv_as_m=_KV_AS_M_16, programs_per_sm=1, mask_free_tiles=_MASK_FREE_16))
    stages = _STAGES_32 if block_m == 32 and not kv_fp8 else _STAGES
    return canonical(Tiles(block_m, _KV_TILE, _WARPS, stages, tokens, cdiv(rows, block_m), prefetch_pages=False,
                           programs_per_sm=1, mask_free_tiles=block_m < 64 and not kv_fp8))


# The Gluon kernel (kernels/mla_hopper.py, _route.MlaRoute): 32-position tiles (64 spill 32 bytes a
# consumer thread, sm_90 compiled on the CPU), 4 stages (three tiles in flight while one is consumed:
# 221-231 KB of shared memory of the SM's 227), the producer's registers a thread (24 leave the
# consumers 232-240: hopper_consumer_regs)
_HOPPER_BLOCK_N, _HOPPER_STAGES, _HOPPER_PRODUCER_REGS, _HOPPER_GATHER_REGS = 32, 4, 24, 40
# How the two consumer warpgroups split a tile's work (kernels/mla_hopper.py's MODE): "share-p", the
# first computes the scores, hands P to the second through shared memory and overlaps its softmax with
# its own P V; "both", both compute the scores (1.5x the tensor work at 128 heads). (A third, tiles in
# pairs with each consumer scoring one, FlashMLA's split, ran 6-10 % slower than "share-p" on the H200
# in session 17 and was removed: benchmarks/NOTES.md.)
_HOPPER_MODE = "share-p"
_HOPPER_MODES = {"both": 0, "share-p": 1}


def hopper_mode() -> int:
    """``_HOPPER_MODE`` as the kernel's ``MODE``."""
    if _HOPPER_MODE not in _HOPPER_MODES:
        raise ValueError(f"mla._HOPPER_MODE: {_HOPPER_MODE!r} is not one of {', '.join(_HOPPER_MODES)}")
    return _HOPPER_MODES[_HOPPER_MODE]


def hopper_regs(mode: int, gather: bool) -> dict:
    """The Gluon kernel's register split (``CONSUMER_REGS``, ``PRODUCER_REGS``, the launch's ``maxnreg``),
    sm_90 compiled on the CPU at 4 stages: shared P fits 232 a consumer thread (measured faster than
    240 in session 17), both consumers scoring spill 8-16 bytes there and none at 240; the TMA producer
    warp needs 24, the gathering producer warpgroup 40 (32 spill 16 bytes), which leaves the consumers
    232: both consumers scoring with gathered pages spill 16 bytes (a mode for A/B runs only)."""
    consumer = 232 if mode == 1 else 240
    producer = _HOPPER_GATHER_REGS if gather else _HOPPER_PRODUCER_REGS
    consumer = min(consumer, (65536 // 128 - producer) // 2 // 8 * 8)
    return dict(CONSUMER_REGS=consumer, PRODUCER_REGS=producer, maxnreg=_hopper.maxnreg(consumer, producer))


def hopper_tiles(num_heads: int, avg_q_len: float) -> Tiles:
    """The work list's tiles on the Gluon route: 64-row blocks (one warpgroup's wgmma M, fewer heads
    taking several query tokens, as ``mla_tiles``) and ``_HOPPER_BLOCK_N``-position splits. They are
    also ``mla_tiles``' 64-row tiles, so ``kernels/mla.py`` runs the same plan (a call whose tensors TMA
    cannot read, and the merge pass)."""
    tokens = 1 if num_heads >= 64 else max(1, min(next_pow2(max(1, math.ceil(avg_q_len))), 64 // num_heads))
    return canonical(Tiles(64, _HOPPER_BLOCK_N, _WARPS, _STAGES, tokens, cdiv(num_heads * tokens, 64),
                           prefetch_pages=False, programs_per_sm=1, mask_free_tiles=False))


def merge_positions(block_m: int, head_dim_ckv: int, head_dim_kpe: int, kv_dtype: torch.dtype) -> int:
    """What merging one split's partial state costs, in latent-cache positions of one program's work
    (``_plan.kv_split_chunk``): the [block_m, head_dim_ckv] float32 state's bytes over what one
    position costs a program, the larger of its ckv + kpe bytes and ``_POSITION_BYTES_PER_ROW``
    times its rows (the dots): 26 at DeepSeek's dims, whatever the rows. With the merge pass
    (``_MERGE_PASS``) the value columns of a merge are shared by up to one split program a
    ``_MERGE_COLUMNS``-column chunk (16 at 512), so a split costs that much less (2): one 8K request at
    128 heads keeps the 64 splits that fill the SMs; with the fused merge (one program merges its
    group alone) it takes 16."""
    state = block_m * head_dim_ckv * 4
    row = (head_dim_ckv + head_dim_kpe) * kv_dtype.itemsize
    one = cdiv(state, max(row, _POSITION_BYTES_PER_ROW * block_m))
    return cdiv(one, max(1, max(16, next_pow2(head_dim_ckv)) // _MERGE_COLUMNS)) if _MERGE_PASS else one


# The split-KV merge: a launch of its own after the attention (True), each split program merging a
# share of the value columns, or the fused one (False: the last split to arrive merges its group).
_MERGE_PASS = True
# the merge pass's columns a chunk (launch_constexprs)
_MERGE_COLUMNS = 32


# A position's cost to a 64-row program, as bytes read at the merge's rate: measured on the H200
# (session 11, bench mla): 64 x 8K at 128 heads (no splits) runs 0.112 µs a position; 1 x 8K in 64
# splits spends ~2.9 µs a merged [64, 512] state (128 KB): a position costs what ~5 KB of merge
# reads cost, 79 bytes a row.
_POSITION_BYTES_PER_ROW = 79


@dataclasses.dataclass(frozen=True)
class MLAStep:
    """What one ``plan()`` of an MLA wrapper fixed; ``run()`` reads this and nothing else of the plan."""

    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    page_size: int
    causal: bool
    sm_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    batch: int
    total_rows: int  # qo_indptr[batch]: the query rows the plan writes
    tiles: Tiles
    device_plan: DevicePlan
    kv_indptr: torch.Tensor  # the plan's own device copy (checked on the host)
    kv_indices: torch.Tensor  # the caller's page ids on the device (the fixed buffer in CUDA-graph mode)
    max_page_id: Optional[int]  # the largest page id, when the ids were on the host (checked at run)
    # the kernel: kernels/mla_hopper.py (hopper) or kernels/mla.py (core)
    route: Route = core("kernels/mla.py")


class MLALaunch:
    """The MLA kernel's launch for one configuration (heads, latent dims, tiles, page size, mask, dtypes,
    merge mode, route), with what a plan fixes bound (grid, plan tensors, workspace views), and its
    merge pass when the plan has splits; a call passes the query, cache, output and LSE tensors to
    both. A wrapper keeps its launches across plans (``DevicePlan.attention_launches``, keyed by
    ``launch_key``): ``bind_plan`` moves one to a new plan, rewriting only the plan's values
    (``BoundLaunch.rebind``; building the launches anew at every step's first run cost 85-210 µs of the
    dev CPU's Python, session 20)."""

    def __init__(self, step: MLAStep, workspace: torch.Tensor, write_lse: bool, dot) -> None:
        plan, tiles, heads, d_ckv = step.device_plan, step.tiles, step.num_heads, step.head_dim_ckv
        device = plan.kv_len.device
        self.device = device
        self.workspace = workspace  # (its identity is in the launch's key)
        self.dummy = _device.per_device("unread", device, lambda: torch.zeros(16, dtype=torch.int32, device=device))
        self.splits = plan.has_splits or plan.always_merge
        # the Gluon kernel writes partial states only: its splits are merged by the merge pass
        self.merge_pass = self.splits and (_MERGE_PASS or not step.route.is_core)
        # arrival counters only for the fused merge (the merge pass is its own launch)
        self.fused = self.splits and not self.merge_pass
        kwargs = launch_constexprs(heads, d_ckv, step.head_dim_kpe, tiles, step.page_size, step.causal, write_lse,
                                   dot, step.sm_scale > 0, step.kv_dtype in FP8_DTYPES, 1 if self.merge_pass else 0)
        grid, tail = self._plan_tail(step)
        self.launch = _MLA.bind(grid, tail, kwargs)
        self._core_plan: Optional[tuple] = None  # (grid, tail) of a plan the core launch has not been moved to
        self.merge = None
        if self.merge_pass:
            self.merge = _MLA.bind(grid, tail, launch_constexprs(
                heads, d_ckv, step.head_dim_kpe, tiles, step.page_size, step.causal, write_lse, dot,
                step.sm_scale > 0, step.kv_dtype in FP8_DTYPES, 2))
        self.hopper = None
        if not step.route.is_core:
            from .kernels.mla_hopper import mla_hopper_kernel

            launcher = _device.per_device("mla_hopper", device, lambda: CachedLauncher(mla_hopper_kernel))
            mode, gather = hopper_mode(), _hopper.mla_gather_pages(step.page_size)
            hopper_kwargs = dict(
                NUM_HEADS=heads, HEAD_DIM_CKV=d_ckv, PAGE_SIZE=step.page_size, BLOCK_N=tiles.block_n,
                STAGES=_HOPPER_STAGES, IS_CAUSAL=step.causal, WRITE_LSE=write_lse, MODE=mode, GATHER=gather,
                num_warps=4, **hopper_regs(mode, gather))
            self.hopper = launcher.bind(grid, self._hopper_tail(tail), hopper_kwargs)

    @staticmethod
    def launch_key(step: MLAStep, workspace: torch.Tensor, write_lse: bool) -> tuple:
        """What ``__init__`` reads of a step beside its plan's tensors (the tiles are canonical objects)."""
        plan = step.device_plan
        return (write_lse, id(workspace), id(step.tiles), step.num_heads, step.head_dim_ckv, step.head_dim_kpe,
                step.page_size, step.causal, step.sm_scale > 0, step.q_dtype, step.kv_dtype,
                plan.has_splits or plan.always_merge, step.route.kernel)

    def bind_plan(self, step: MLAStep) -> None:
        """The launches over ``step``'s plan (one of the same ``launch_key``)."""
        grid, tail = self._plan_tail(step)
        if self.hopper is not None:
            self.hopper.rebind(grid, self._hopper_tail(tail))
            self._core_plan = grid, tail  # the core launch moves when a call takes it (rarely, on this route)
        else:
            self.launch.rebind(grid, tail)
        if self.merge is not None:
            self.merge.rebind(grid, tail)

    def _plan_tail(self, step: MLAStep) -> Tuple[tuple, tuple]:
        """The grid and the core kernel's bound arguments for ``step``; records the step (``run()`` compares
        it by identity) and what the calls read of it."""
        plan, tiles, heads, d_ckv, workspace = (step.device_plan, step.tiles, step.num_heads, step.head_dim_ckv,
                                                 self.workspace)
        states = plan.state_capacity
        if self.splits:
            need = states * heads * (d_ckv + 1)
            if workspace.numel() // 4 < need:
                raise ValueError(f"float_workspace_buffer: the plan needs {need * 4} bytes for split-KV states, "
                                 f"the buffer has {workspace.numel()}")
            ws = workspace[: (workspace.numel() // 4) * 4].view(torch.float32)
            part_o, part_lse = ws[: states * heads * d_ckv], ws[states * heads * d_ckv: need]
        else:
            part_o = part_lse = self.dummy  # never touched: every item writes its final output
        counters = plan.counters.get(plan.capacity * tiles.row_tiles) if self.fused else self.dummy
        self.step = step
        self.needs_pages = plan.reads_kv
        tail = (part_o, part_lse, counters, plan.work, plan.qo_indptr, step.kv_indptr, step.kv_indices, plan.kv_len,
                plan.state_offset, fault_record(self.device), step.kv_indices.numel(), tiles.tile_tokens)
        return (tiles.row_tiles, plan.capacity), tail

    @staticmethod
    def _hopper_tail(tail: tuple) -> tuple:
        """The Gluon kernel's bound arguments, from the core kernel's: the partial states, the plan's
        tensors and the tile tokens (no counters, fault record or page count)."""
        return tail[:2] + tail[3:9] + tail[11:]

    def __call__(self, q_nope, q_pe, ckv, kpe, out, lse, sm_scale_log2: float, lse_scale: float,
                 q_pe_scale: float = 1.0, v_scale: float = 1.0) -> tuple:
        """Launches the kernel and, with splits, its merge pass; returns their driver launches
        (``_launch.DriverCall``, None where one took Triton's path)."""
        if self.needs_pages and ckv.shape[0] == 0:
            raise ValueError("ckv_cache: the cache has no pages, but the plan reads KV from it")
        lse_args = (lse, lse.stride(0), lse.stride(1)) if lse is not None else (self.dummy, 0, 0)
        head = (q_nope, q_nope.stride(0), q_nope.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
                ckv, ckv.stride(0), ckv.stride(1), kpe, kpe.stride(0), kpe.stride(1), ckv.shape[0],
                out, out.stride(0), out.stride(1), *lse_args, sm_scale_log2, lse_scale, q_pe_scale, v_scale)
        if self.hopper is None:
            why = "core"
        elif q_pe_scale != 1.0 or v_scale != 1.0:
            why = "q_pe or output scales"
        elif not self.needs_pages:
            why = "no KV to read (an empty cache has no TMA descriptor)"
        else:
            why = MLA_ROUTE.at_run(self.step.route, q_nope, q_pe, ckv, kpe)
        if why:
            if self._core_plan is not None:
                self.launch.rebind(*self._core_plan)
                self._core_plan = None
            calls = (self.launch(*head),)
        else:
            calls = (self._launch_hopper(q_nope, q_pe, ckv, kpe, out, lse_args, sm_scale_log2, lse_scale),)
        if self.merge is not None:
            calls += (self.merge(*head),)
        return calls

    def _launch_hopper(self, q_nope, q_pe, ckv, kpe, out, lse_args, sm_scale_log2: float,
                       lse_scale: float) -> Optional[DriverCall]:
        """The Gluon kernel: q as [tokens * H, D] (rows ``_hopper.row_stride`` apart) in boxes of 64 rows,
        the caches as [pages * page, D] in boxes of a page (or of a tile's share of a larger page), or,
        for pages TMA cannot box (``_hopper.mla_gather_pages``), gathered row by row (the descriptors
        then only give the stages' layout). Page ids outside the cache are read as zeros by TMA, clamped into it by
        the gather, and reported by ``_hopper.check_page_ids`` (once per plan and cache size)."""
        step, plan = self.step, self.step.device_plan
        num_pages = ckv.shape[0]
        # (ids the plan had on the host were checked against this cache by run())
        if plan.pages_checked != num_pages and step.max_page_id is None:
            _hopper.check_page_ids(step.kv_indptr, step.kv_indices, step.batch, num_pages)
            plan.pages_checked = num_pages
        rows, heads = q_nope.shape[0], q_nope.shape[1]
        gather = _hopper.mla_gather_pages(step.page_size)
        box = step.tiles.block_n if gather else min(step.page_size, step.tiles.block_n)
        layout = _hopper.smem_layout(64, 64, q_nope.dtype)
        box_layout = _hopper.smem_layout(box, 64, q_nope.dtype)
        cache_rows = max(num_pages * step.page_size, box)
        q_row, qpe_row, ckv_row, kpe_row = (_hopper.row_stride(t) for t in (q_nope, q_pe, ckv, kpe))
        return self.hopper(TmaBox(q_nope, (rows * heads, step.head_dim_ckv), (q_row, 1), (64, 64), layout),
                    TmaBox(q_pe, (rows * heads, step.head_dim_kpe), (qpe_row, 1), (64, 64), layout),
                    TmaBox(ckv, (cache_rows, step.head_dim_ckv), (ckv_row, 1), (box, 64), box_layout),
                    TmaBox(kpe, (cache_rows, step.head_dim_kpe), (kpe_row, 1), (box, 64), box_layout),
                    out, out.stride(0), out.stride(1), *lse_args, sm_scale_log2, lse_scale,
                    ckv, ckv_row, kpe, kpe_row, num_pages)


def launch_constexprs(heads: int, d_ckv: int, d_kpe: int, tiles: Tiles, page_size: int, causal: bool,
                      write_lse: bool, dot, fold_scale: bool, scale_q_pe: bool, merge_mode: int) -> dict:
    """The MLA kernel's compile-time arguments (``kernels/mla.py``; ``merge_mode`` its ``MERGE_MODE``).
    The merge pass (2) takes ``_MERGE_COLUMNS``-column chunks: a 512-wide state's 16 chunks spread
    over up to 16 split programs; the fused merge (0) 4,096 / rows columns, one program walking them."""
    block_ckv = max(16, next_pow2(d_ckv))
    merge_dv = min(block_ckv, _MERGE_COLUMNS if merge_mode == 2 else max(16, 4096 // tiles.block_m))
    return dict(
        NUM_HEADS=heads, HEAD_DIM_CKV=d_ckv, HEAD_DIM_KPE=d_kpe, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_CKV=block_ckv, BLOCK_KPE=max(16, next_pow2(d_kpe)),
        PAGE_SIZE=page_size, IS_CAUSAL=causal, WRITE_LSE=write_lse, DOT_DTYPE=dot,
        FOLD_SCALE=fold_scale, NUM_STAGES=tiles.num_stages, KV_AS_M=tiles.kv_as_m,
        MASK_FREE_TILES=tiles.mask_free_tiles, SCALE_Q_PE=scale_q_pe,
        MERGE_DV_CHUNK=merge_dv,
        # (the merge pass at 16 rows spilled 16 bytes with 8 states a step)
        MERGE_SPLIT_BLOCK=max(1, min(4 if merge_mode == 2 else 8, 8192 // (tiles.block_m * merge_dv))),
        MERGE_MODE=merge_mode, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The output dtype: the query's; bfloat16 for fp8 queries (the kernel writes no fp8)."""
    return torch.bfloat16 if q_dtype in FP8_DTYPES else q_dtype


def check_mla_dtypes(q_data_type, kv_data_type, q_name: str = "q_data_type",
                     kv_name: str = "kv_data_type") -> Tuple[torch.dtype, torch.dtype]:
    """A plan's query and cache dtypes: fp16/bf16, an fp8 cache with either, fp8 queries only with
    an fp8 cache (as the attention core: its dots take fp16 operands converted from both)."""
    q_dtype = check_dtype_in(canonicalize_dtype(q_data_type, q_name), MLA_Q_DTYPES, q_name)
    kv_dtype = check_dtype_in(canonicalize_dtype(kv_data_type, kv_name), MLA_KV_DTYPES, kv_name)
    if q_dtype in FP8_DTYPES and kv_dtype not in FP8_DTYPES:
        raise ValueError(f"{q_name}: fp8 queries ({q_dtype}) need an fp8 cache, {kv_name} is {kv_dtype}")
    return q_dtype, kv_dtype


def _check_kv_scales(kv_dtype: torch.dtype, ckv_scale, kpe_scale, ckv_scale_arr) -> Tuple[float, float]:
    """``run()``'s fp8 dequantisation scales as floats (1 when not given). As later FlashInfer
    releases: only with an fp8 cache, finite and positive."""
    if ckv_scale_arr is not None:
        raise NotImplementedError("ckv_scale_arr: per-token, per-128-channel ckv scales are not implemented; "
                                  "use the per-tensor ckv_scale")
    if kv_dtype not in FP8_DTYPES:
        for value, name in ((ckv_scale, "ckv_scale"), (kpe_scale, "kpe_scale")):
            if value is not None:
                raise ValueError(f"{name}: only valid with an fp8 cache (the plan's kv_data_type is {kv_dtype})")
        return 1.0, 1.0
    scales = []
    for value, name in ((ckv_scale, "ckv_scale"), (kpe_scale, "kpe_scale")):
        if isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a float, got a tensor")
        f = 1.0 if value is None else float(value)
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"{name}: expected a finite positive float, got {value}")
        scales.append(f)
    return scales[0], scales[1]


def _check_index_dtype(t, name: str) -> None:
    check_tensor(t, name, ndim=1)
    if t.dtype != torch.int32:
        raise ValueError(f"Expected {name}.dtype == torch.int32, got {t.dtype}")


class _MLAPlanner:
    """The plan and run machinery shared by the two MLA wrappers: host checks, the work list, the
    upload (into fixed buffers in CUDA-graph mode) and the launch."""

    def _plan_step(self, *, qo_host: torch.Tensor, kv_indptr_host: torch.Tensor, kv_lens_host: torch.Tensor,
                   kv_indices: torch.Tensor, kv_indices_name: str, num_heads: int, head_dim_ckv: int,
                   head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_dtype: torch.dtype,
                   kv_dtype: torch.dtype, kv_indices_device: Optional[torch.Tensor]) -> MLAStep:
        """Checks a plan on the host and uploads it. ``kv_indices_device``: the page ids the kernel
        reads (the fixed buffer in CUDA-graph mode); None: ``kv_indices`` moved to the device."""
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        check_positive_int(num_heads, "num_heads")
        check_positive_int(head_dim_ckv, "head_dim_ckv")
        check_positive_int(head_dim_kpe, "head_dim_kpe")
        check_positive_int(page_size, "page_size")
        if isinstance(causal, torch.Tensor) or not isinstance(causal, (bool, int, np.bool_)):
            raise ValueError(f"causal: expected a bool, got {causal!r}")
        sm_scale = float(sm_scale)
        if not math.isfinite(sm_scale):
            raise ValueError(f"sm_scale: expected a finite float, got {sm_scale}")
        batch = kv_lens_host.numel()
        if qo_host.numel() < batch + 1:
            raise ValueError(f"qo_indptr: expected at least batch_size + 1 = {batch + 1} elements (batch_size is "
                             f"kv_len_arr's length), got {qo_host.numel()}")
        if kv_indptr_host.numel() < batch + 1:
            raise ValueError(f"kv_indptr: expected at least batch_size + 1 = {batch + 1} elements (batch_size is "
                             f"kv_len_arr's length), got {kv_indptr_host.numel()}")
        qo_host, kv_indptr_host = qo_host[: batch + 1], kv_indptr_host[: batch + 1]
        check_indptr_host(qo_host, "qo_indptr", zero_start=False)
        check_indptr_host(kv_indptr_host, "kv_indptr", zero_start=False)
        qo = qo_host.numpy().astype(np.int64)
        kvp = kv_indptr_host.numpy().astype(np.int64)
        kv_lens = kv_lens_host.numpy().astype(np.int64)
        pages = kvp[1:] - kvp[:-1]
        if (kv_lens < 0).any() or (kv_lens > pages * page_size).any():
            b = int(np.flatnonzero((kv_lens < 0) | (kv_lens > pages * page_size))[0])
            raise ValueError(f"kv_len_arr: request {b} has kv_len {int(kv_lens[b])}, outside [0, its {int(pages[b])} "
                             f"page(s) x page_size {page_size}] (kv_indptr)")
        num_indices = kv_indices.numel() if kv_indices_device is None else kv_indices_device.numel()
        if batch and int(kvp[-1]) > num_indices:
            raise ValueError(f"{kv_indices_name}: kv_indptr[-1] = {int(kvp[-1])} page ids, but it holds {num_indices}")
        max_page_id = None
        if kv_indices.device.type == "cpu" and kv_indices_device is None:
            used = kv_indices[int(kvp[0]) if batch else 0: int(kvp[-1]) if batch else 0]
            if used.numel():
                if int(used.min()) < 0:
                    raise ValueError(f"{kv_indices_name}: negative page id {int(used.min())}")
                max_page_id = int(used.max())

        qo_lens = qo[1:] - qo[:-1]
        if causal and ((qo_lens > kv_lens) & (qo_lens > 0)).any():
            b = int(np.flatnonzero((qo_lens > kv_lens) & (qo_lens > 0))[0])
            raise ValueError(f"qo_indptr: causal request {b} has {int(qo_lens[b])} query tokens but kv_len "
                             f"{int(kv_lens[b])}; causal MLA needs qo_len <= kv_len (as FlashInfer)")
        graph = self._graph
        route = MLA_ROUTE.at_plan(self.device, q_dtype, kv_dtype, head_dim_ckv, head_dim_kpe, page_size, sm_scale)
        avg_q_len = (int(qo[-1]) - int(qo[0])) / batch if batch else 1.0  # (the mean of qo_lens, without a numpy call)
        if graph is not None and graph.sized:
            tiles = graph.tiles
        elif not route.is_core:
            tiles = hopper_tiles(num_heads, avg_q_len)
        else:
            tiles = mla_tiles(num_heads, avg_q_len, kv_dtype in FP8_DTYPES)
        workspace_bytes = self._float_workspace_buffer.numel() * self._float_workspace_buffer.element_size()
        total_rows = int(qo[-1]) if batch else 0
        if graph is not None:
            if not graph.sized:
                # the work-list capacity holds any plan of at most this many query rows: a request's
                # query tiles are at most its rows / tile_tokens, rounded up
                rows = max(total_rows, batch, 1)
                q_tiles = min(rows, cdiv(rows, tiles.tile_tokens) + batch)
                graph.size(rows=rows, q_tiles=q_tiles, batch=max(batch, 1), tiles=tiles, num_sms=self._num_sms,
                           workspace_bytes=workspace_bytes, num_qo_heads=num_heads, head_dim_vo=head_dim_ckv)
            elif int(qo_lens.sum()) > graph.max_rows:
                raise ValueError(f"qo_indptr: the plan has {int(qo_lens.sum())} query rows, more than the "
                                 f"{graph.max_rows} of the first plan that sized the CUDA-graph buffers")
        work = plan_work(qo_lens=qo_lens, kv_lens=kv_lens, tiles=tiles, num_qo_heads=num_heads,
                         num_kv_heads=tiles.row_tiles, head_dim_vo=head_dim_ckv, page_size=page_size,
                         fixed_split_size=None, disable_split_kv=False, workspace_bytes=workspace_bytes,
                         num_sms=self._num_sms, graph=graph, heaviest_first=bool(causal),
                         merge_positions=merge_positions(tiles.block_m, head_dim_ckv, head_dim_kpe, kv_dtype))
        plan, (kv_indptr_d,) = upload_plan(self._uploader, graph, work, kv_lens, qo, [kvp], non_blocking=True)
        if kv_indices_device is None:
            kv_indices_device = kv_indices.to(self.device, torch.int32, non_blocking=True)
        return MLAStep(
            num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
            causal=bool(causal), sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype, batch=batch,
            total_rows=total_rows, tiles=tiles, device_plan=plan, kv_indptr=kv_indptr_d,
            kv_indices=kv_indices_device, max_page_id=max_page_id, route=route,
        )

    def _run_step(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, *, lse_base_e: bool = False,
                  scale: float = 1.0, names=("ckv_cache", "kpe_cache"), q_pe_scale: float = 1.0,
                  v_scale: float = 1.0):
        """The launch; ``scale`` multiplies ``sm_scale``, ``q_pe_scale`` q_pe (read with an fp8 cache
        only), ``v_scale`` the output (all checked by the caller). A call whose tensors match the last
        call's in all but their addresses, with the same scales, replays its launches (``_replay.py``)."""
        step = self._step
        inputs, options = None, (scale, q_pe_scale, v_scale, lse_base_e)
        if scalar_options(scale, q_pe_scale, v_scale):
            inputs = (q_nope, q_pe, ckv_cache, kpe_cache)
            done = replayed(self, inputs, options, out, lse, return_lse)
            if done is not None:
                return done
        if step is None:
            raise ValueError("run() was called before plan()")
        ckv_name, kpe_name = names
        heads, d_ckv, d_kpe = step.num_heads, step.head_dim_ckv, step.head_dim_kpe
        for t, name, d in ((q_nope, "q_nope", d_ckv), (q_pe, "q_pe", d_kpe)):
            check_tensor(t, name, ndim=3)
            if t.dtype != step.q_dtype:
                raise ValueError(f"The dtype of {name} {t.dtype} does not match the q_data_type {step.q_dtype} "
                                 "specified in plan function.")
            if t.shape[1] != heads or t.shape[2] != d or t.shape[0] < step.total_rows:
                raise ValueError(f"{name}: expected shape [>= {step.total_rows}, {heads}, {d}] (rows, num_heads, "
                                 f"head_dim of the plan), got {tuple(t.shape)}")
            if t.stride(2) != 1:
                raise ValueError(f"{name}: the last dimension must be contiguous")
        if q_pe.shape[0] != q_nope.shape[0]:
            raise ValueError(f"q_pe: {q_pe.shape[0]} rows, q_nope has {q_nope.shape[0]}")
        for t, name, d, plan_name in ((ckv_cache, ckv_name, d_ckv, "head_dim_ckv"),
                                      (kpe_cache, kpe_name, d_kpe, "head_dim_kpe")):
            check_tensor(t, name, ndim=3)
            if t.dtype != step.kv_dtype:
                raise ValueError(f"The dtype of {name} {t.dtype} does not match the kv_data_type {step.kv_dtype} "
                                 "specified in plan function.")
            if t.shape[2] != d:
                raise ValueError(f"{name}: latent dim {t.shape[2]} differs from the planned {plan_name} {d}")
            if t.shape[1] != step.page_size:
                raise ValueError(f"{name}: page_size {t.shape[1]} (dim 1) differs from the planned page_size "
                                 f"{step.page_size}")
            if t.shape[2] > 1 and t.stride(2) != 1:
                raise ValueError(f"{name}: the last dimension must be contiguous")
        if kpe_cache.shape[0] != ckv_cache.shape[0]:
            raise ValueError(f"{kpe_name}: {kpe_cache.shape[0]} pages, but {ckv_name} has {ckv_cache.shape[0]}")
        dev = self.device
        for t, name in ((q_nope, "q_nope"), (q_pe, "q_pe"), (ckv_cache, ckv_name), (kpe_cache, kpe_name)):
            if t.device != dev:
                raise ValueError(f"{name}: expected a tensor on the plan's device {dev}, got one on {t.device}")
        if step.max_page_id is not None and step.max_page_id >= ckv_cache.shape[0]:
            raise ValueError(f"kv_indices: page id {step.max_page_id} is outside the cache's "
                             f"[0, {ckv_cache.shape[0]}) pages")
        out_arg, lse_arg = out, lse
        out = check_out(out, tuple(q_nope.shape), out_dtype(step.q_dtype), dev, "out")
        if lse is not None or return_lse:
            # a caller's lse buffer is written whether or not it is returned, as in FlashInfer
            lse = check_out(lse, tuple(q_nope.shape[:2]), torch.float32, dev, "lse")
        workspace = self._float_workspace_buffer
        launches = step.device_plan.attention_launches
        key = MLALaunch.launch_key(step, workspace, lse is not None)
        launch = launches.get(key)
        if launch is None:
            if len(launches) >= 16:
                launches.clear()
            launch = launches[key] = MLALaunch(step, workspace, lse is not None, dot_dtype(step.q_dtype, step.kv_dtype))
        elif launch.step is not step:
            launch.bind_plan(step)
        calls = launch(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, step.sm_scale / _LN2 * scale,
                       _LN2 if lse_base_e else 1.0, q_pe_scale, v_scale)
        if inputs is not None:
            self._replay = RunReplay.record(step, inputs, options, out_arg, lse_arg, out, lse, return_lse, False, calls,
                                            self._replay)
        return (out, lse) if return_lse else out


class BatchMLAPagedAttentionWrapper(_MLAPlanner):
    """MLA (multi-head latent attention, DeepSeek V2/V3) over a paged latent cache, for decode and
    incremental prefill, with the matrix-absorption trick (``W_UK`` absorbed into the query,
    ``W_UV`` into the output projection). Planned once per step, run per layer.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.BatchMLAPagedAttentionWrapper(ws)
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, 128, 512, 64, 1, False,
    ...              1 / (192 ** 0.5), torch.bfloat16, torch.bfloat16)
    >>> o = wrapper.run(q_nope, q_pe, ckv, kpe)  # [rows, 128, 512]

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states (FlashInfer recommends 128 MB); its size is
        checked against each plan.
    use_cuda_graph : bool
        Fixed batch size and buffers: the launch grid and every device buffer the kernel reads are
        fixed by the first ``plan()``, so a graph captured after one plan stays valid after later
        plans (with at most as many query rows as the first).
    qo_indptr, kv_indptr, kv_indices, kv_len_arr : Optional[torch.Tensor]
        int32 buffers ``[batch_size + 1]``, ``[batch_size + 1]``, ``[max_pages]``, ``[batch_size]``;
        required with ``use_cuda_graph``. ``plan()`` copies its arguments into them (unless they are
        the buffers themselves) and the kernel reads its page ids from ``kv_indices``, so an engine
        may write the page table there itself and re-plan through ``_cached_module.plan``.
    backend : str
        ``"auto"``, ``"fa2"`` or ``"fa3"`` run tritoninfer's Triton kernel. ``"cutlass"`` (FlashInfer's
        SM100 kernel with a block-table ``run(kv_len=, page_table=)`` and no plan) raises
        ``NotImplementedError``; other values raise ``ValueError``.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        kv_indices: Optional[torch.Tensor] = None,
        kv_len_arr: Optional[torch.Tensor] = None,
        backend: str = "auto",
    ) -> None:
        if backend not in MLA_BACKENDS:
            raise ValueError(f"backend: expected one of {MLA_BACKENDS}, got {backend!r}")
        if backend == "cutlass":
            raise NotImplementedError(
                "backend='cutlass': FlashInfer's CUTLASS MLA kernel (SM100, block-table run() without plan()) "
                "is not implemented by tritoninfer; use backend='auto' with plan()/run()")
        init_planned_wrapper(self, float_workspace_buffer, use_cuda_graph)
        self._backend = backend
        if use_cuda_graph:
            check_graph_buffers(self.device, (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                                              ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)))
            self._fixed_batch_size = kv_len_arr.numel()
            for name, buf in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
                if buf.numel() < self._fixed_batch_size + 1:
                    raise ValueError(f"{name}: the buffer holds {buf.numel()} entries, batch_size + 1 = "
                                     f"{self._fixed_batch_size + 1} needed (batch_size from kv_len_arr)")
        else:
            self._fixed_batch_size = 0
        self._qo_indptr_buf = qo_indptr
        self._kv_indptr_buf = kv_indptr
        self._kv_indices_buf = kv_indices
        self._kv_len_arr_buf = kv_len_arr

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        """Plan MLA for one step (all layers).

        Parameters
        ----------
        qo_indptr : torch.Tensor
            ``[batch_size + 1]`` (or longer) int32: the query rows of request ``b`` are
            ``qo_indptr[b]:qo_indptr[b+1]`` (decode: ``[0, 1, ..., batch_size]``).
        kv_indptr : torch.Tensor
            ``[batch_size + 1]`` (or longer) int32: the pages of request ``b`` are
            ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices : torch.Tensor
            int32 page ids, ``[kv_indptr[batch_size]]`` or longer.
        kv_len_arr : torch.Tensor
            ``[batch_size]`` int32 KV length of each request (at most its pages times ``page_size``);
            its length is the batch size, as in FlashInfer.
        num_heads, head_dim_ckv, head_dim_kpe, page_size : int
            Query heads, the latent dims of ``ckv`` and ``kpe`` (512 and 64 for DeepSeek; any positive
            sizes run) and tokens per page.
        causal : bool
            Causal among each request's query tokens, bottom-right aligned (query ``i`` sees KV
            positions up to ``i + kv_len - qo_len``); needs ``qo_len <= kv_len`` per request.
        sm_scale : float
            Softmax scale (DeepSeek: ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` = ``1/sqrt(192)``).
        q_data_type, kv_data_type : torch.dtype
            ``float16`` or ``bfloat16`` (names accepted). Beyond FlashInfer 0.5.3: ``kv_data_type``
            ``float8_e4m3fn`` (or ``float8_e5m2``), an fp8 latent cache read at half the bytes, with
            ``run(ckv_scale=, kpe_scale=)``; its tiles are converted to fp16 for the dots (bf16 q
            too: exact for ``|q| < 65504``). fp8 ``q_data_type`` is accepted with an fp8 cache
            (converted on load; the output is then bfloat16).
        use_profiler : bool
            FlashInfer's intra-kernel profiler; tritoninfer has none: ``True`` raises
            ``NotImplementedError``.

        The index tensors are copied to the host here (a device tensor costs one device-to-host copy).
        """
        if use_profiler:
            raise NotImplementedError("use_profiler: FlashInfer's intra-kernel profiler is not part of tritoninfer")
        for t, name in ((kv_len_arr, "kv_len_arr"), (kv_indptr, "kv_indptr"), (qo_indptr, "qo_indptr"),
                        (kv_indices, "kv_indices")):
            _check_index_dtype(t, name)
        self._plan_impl(host_index(qo_indptr, "qo_indptr"), host_index(kv_indptr, "kv_indptr"), kv_indices,
                        host_index(kv_len_arr, "kv_len_arr"), num_heads, head_dim_ckv, head_dim_kpe, page_size,
                        causal, sm_scale, q_data_type, kv_data_type,
                        sources=(qo_indptr, kv_indptr, kv_indices, kv_len_arr))

    def _plan_impl(self, qo_host, kv_indptr_host, kv_indices, kv_len_host, num_heads, head_dim_ckv, head_dim_kpe,
                   page_size, causal, sm_scale, q_data_type, kv_data_type, sources=None) -> None:
        """``plan()`` from host copies of the indptrs and lengths. ``sources``: the caller's tensors,
        copied into the CUDA-graph buffers (None: the engine wrote the buffers itself)."""
        q_dtype, kv_dtype = check_mla_dtypes(q_data_type, kv_data_type)
        indices_dev = None
        if self._use_cuda_graph:
            indices_dev = self._kv_indices_buf
            if sources is not None:
                qo_src, kvp_src, idx_src, len_src = sources
            check_graph_plan(kv_len_host.numel(), self._fixed_batch_size, idx_src.numel() if sources else 0,
                             indices_dev, ("kv_indices", "the CUDA-graph kv_indices buffer"))
        step = self._plan_step(qo_host=qo_host, kv_indptr_host=kv_indptr_host, kv_lens_host=kv_len_host,
                               kv_indices=kv_indices, kv_indices_name="kv_indices", num_heads=num_heads,
                               head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
                               causal=causal, sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype,
                               kv_indices_device=indices_dev)
        if self._use_cuda_graph and sources is not None:
            # as FlashInfer: the caller's page table goes into the fixed buffers the kernel reads
            b = step.batch
            copy_into(self._qo_indptr_buf[: b + 1], qo_src[: b + 1].to(self.device, non_blocking=True), True)
            copy_into(self._kv_indptr_buf[: b + 1], kvp_src[: b + 1].to(self.device, non_blocking=True), True)
            copy_into(self._kv_indices_buf[: idx_src.numel()], idx_src.to(self.device, non_blocking=True), True)
            copy_into(self._kv_len_arr_buf, len_src.to(self.device, non_blocking=True), True)
        elif not self._use_cuda_graph:
            # FlashInfer keeps the plan's device tensors under these names (engines read them)
            plan = step.device_plan
            self._qo_indptr_buf, self._kv_indptr_buf = plan.qo_indptr, step.kv_indptr
            self._kv_indices_buf, self._kv_len_arr_buf = step.kv_indices, plan.kv_len
        self._step = step

    @overload
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: Literal[False] = False, profiler_buffer: Optional[torch.Tensor] = None,
            kv_len: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None,
            return_lse_base_on_e: bool = False, o_scale: Optional[float] = None, *,
            ckv_scale: Optional[float] = None, ckv_scale_arr: Optional[torch.Tensor] = None,
            kpe_scale: Optional[float] = None) -> torch.Tensor: ...

    @overload
    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
            out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
            return_lse: Literal[True] = True, profiler_buffer: Optional[torch.Tensor] = None,
            kv_len: Optional[torch.Tensor] = None, page_table: Optional[torch.Tensor] = None,
            return_lse_base_on_e: bool = False, o_scale: Optional[float] = None, *,
            ckv_scale: Optional[float] = None, ckv_scale_arr: Optional[torch.Tensor] = None,
            kpe_scale: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        profiler_buffer: Optional[torch.Tensor] = None,
        kv_len: Optional[torch.Tensor] = None,
        page_table: Optional[torch.Tensor] = None,
        return_lse_base_on_e: bool = False,
        o_scale: Optional[float] = None,
        *,
        ckv_scale: Optional[float] = None,
        ckv_scale_arr: Optional[torch.Tensor] = None,
        kpe_scale: Optional[float] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """MLA for the planned batch.

        Parameters
        ----------
        q_nope : torch.Tensor
            ``[rows, num_heads, head_dim_ckv]`` in ``q_data_type`` (``rows >= qo_indptr[batch_size]``;
            rows past the plan's are not written). Strided views are fine (last dim contiguous).
        q_pe : torch.Tensor
            ``[rows, num_heads, head_dim_kpe]``.
        ckv_cache : torch.Tensor
            ``[num_pages, page_size, head_dim_ckv]`` in ``kv_data_type``; may be a strided slice of a
            wider buffer (SGLang passes ``[..., :512]`` of a 576-wide cache, fp8 ones too), read in place.
        kpe_cache : torch.Tensor
            ``[num_pages, page_size, head_dim_kpe]``, the same number of pages.
        out : Optional[torch.Tensor]
            Preallocated output, q_nope's shape and dtype (bfloat16 for fp8 queries).
        lse : Optional[torch.Tensor]
            Preallocated float32 ``[rows, num_heads]``; written when given, even without ``return_lse``.
        return_lse : bool
            Also return the LSE: base 2 (``log2(sum exp(s))``) unless ``return_lse_base_on_e``.
        profiler_buffer : Optional[torch.Tensor]
            Ignored: only read by FlashInfer's profiler, which ``plan(use_profiler=True)`` would enable.
        kv_len, page_table : Optional[torch.Tensor]
            Ignored, as in FlashInfer outside its ``cutlass`` backend.
        return_lse_base_on_e : bool
            LSE in natural-log units (base-2 value times ln 2), as FlashInfer.
        o_scale : Optional[float]
            Later FlashInfer's fp8-output scale of its ``cutlass`` backend: must be None (``ValueError``).
        ckv_scale, kpe_scale : Optional[float]
            Keyword-only, an fp8 cache's per-tensor dequantisation scales (``real = stored * scale``;
            None: 1), as later FlashInfer releases name them; ``ValueError`` with a 16-bit cache.
            ``ckv_scale`` multiplies the scores' ckv part and the output (ckv is also the value),
            ``kpe_scale`` the scores' kpe part. The LSE is that of the dequantised scores.
        ckv_scale_arr : Optional[torch.Tensor]
            Later FlashInfer's per-token, per-128-channel ckv scales: ``NotImplementedError``.

        Returns
        -------
        ``out`` (and ``lse``). Rows that see no key (``kv_len`` 0) give 0 and LSE ``-inf``
        (FlashInfer leaves a finite value there).
        """
        if o_scale is not None:
            raise ValueError("o_scale: FlashInfer's fp8 output of its cutlass backend; tritoninfer writes "
                             "16-bit outputs (use None)")
        if _ops.compiling():
            return _traced_mla_run(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse,
                                   return_lse_base_on_e, ckv_scale, kpe_scale, ckv_scale_arr)
        return self._run_step(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse,
                              lse_base_e=bool(return_lse_base_on_e),
                              **self._scale_args(ckv_scale, kpe_scale, ckv_scale_arr))

    def _scale_args(self, ckv_scale, kpe_scale, ckv_scale_arr) -> dict:
        """``_run_step``'s factors for an fp8 cache's scales: ckv is both the keys' first part and the
        values, so its scale multiplies the scores and the output; kpe's enters through q_pe,
        relative to ckv's."""
        if self._step is None:
            return {}  # _run_step says run() came before plan()
        c, p = _check_kv_scales(self._step.kv_dtype, ckv_scale, kpe_scale, ckv_scale_arr)
        return dict(scale=c, q_pe_scale=p / c, v_scale=c)

    def _run_mla_into(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, lse_base_e: bool,
                      ckv_scale: Optional[float] = None, kpe_scale: Optional[float] = None) -> None:
        """``run()`` into ``out``/``lse``, eagerly: the implementation of the ``mla_run`` custom op."""
        self._run_step(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, False, lse_base_e=lse_base_e,
                       **self._scale_args(ckv_scale, kpe_scale, None))


def _traced_mla_run(wrapper, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, lse_base_e,
                    ckv_scale=None, kpe_scale=None, ckv_scale_arr=None):
    """What an MLA wrapper's ``run()`` does while Dynamo traces it: allocate the outputs from the
    tensors' shapes (the graph holds no plan) and call the ``mla_run`` custom op."""
    if ckv_scale_arr is not None:
        _check_kv_scales(ckv_cache.dtype, ckv_scale, kpe_scale, ckv_scale_arr)
    if out is None:
        out = torch.empty(q_nope.shape, dtype=out_dtype(q_nope.dtype), device=q_nope.device)
    if lse is None and return_lse:
        lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    _mla_run_op(wrapper._handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, bool(lse_base_e),
                None if ckv_scale is None else float(ckv_scale), None if kpe_scale is None else float(kpe_scale))
    return (out, lse) if return_lse else out


@_ops.custom_op("mla_run", mutates_args=("out", "lse"))
def _mla_run_op(handle: int, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                kpe_cache: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], lse_base_e: bool,
                ckv_scale: Optional[float] = None, kpe_scale: Optional[float] = None) -> None:
    """An MLA wrapper's ``run()`` into ``out`` (and ``lse``), for torch.compile (``_ops.py``): the
    wrapper is found by its handle and runs its current plan."""
    wrapper = _ops._WRAPPERS.get(handle)
    if wrapper is None:
        raise ValueError(f"tritoninfer::mla_run: the wrapper of handle {handle} no longer exists")
    wrapper._run_mla_into(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, lse_base_e, ckv_scale, kpe_scale)


class BatchDecodeMlaWithPagedKVCacheWrapper(_MLAPlanner):
    """FlashInfer's deprecated MLA decode wrapper (one query token per request, a last-page-length
    page table), run on the same kernel as :class:`BatchMLAPagedAttentionWrapper`. FlashInfer 0.5.3
    runs it on SM80 only; tritoninfer runs it wherever its kernels run.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states.
    use_cuda_graph : bool
        Fixed batch size and buffers (see :class:`BatchMLAPagedAttentionWrapper`).
    use_tensor_cores : bool
        Kept for compatibility; the kernel always uses ``tl.dot``.
    paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
        int32 ``[batch_size + 1]``, ``[max_pages]``, ``[batch_size]``; required with ``use_cuda_graph``.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
    ) -> None:
        init_planned_wrapper(self, float_workspace_buffer, use_cuda_graph)
        self._use_tensor_cores = bool(use_tensor_cores)
        init_graph_page_table(self, use_cuda_graph, paged_kv_indptr_buffer, paged_kv_indices_buffer,
                              paged_kv_last_page_len_buffer)
        self._settings = None  # (sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta) as planned

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace (``int_workspace_buffer`` is accepted: tritoninfer needs none)."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._float_workspace_buffer = float_workspace_buffer

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        head_dim_compressed_kv: int,
        page_size: int,
        sm_scale: float,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        data_type: Union[str, torch.dtype] = "float16",
        q_data_type: Optional[Union[str, torch.dtype]] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> None:
        """Plan MLA decode.

        Parameters
        ----------
        indptr, indices, last_page_len : torch.Tensor
            int32 page table: ``[batch_size + 1]``, ``[indptr[-1]]``, ``[batch_size]`` (entries used in
            each request's last page, 0 for a request with no pages).
        num_qo_heads, head_dim_compressed_kv, page_size : int
            Query heads, ``head_dim_ckv`` (kv_lora_rank) and tokens per page. ``head_dim_kpe`` is
            planned as 64 (FlashInfer's kernel has no other); a ``run()`` with another ``q_pe`` width
            re-plans once for it (on the host: not inside a CUDA-graph capture), later plans keep it.
        sm_scale : float
            Softmax scale.
        window_left, logits_soft_cap
            Must be -1 and None/0: the MLA kernel has no sliding window or soft cap
            (``NotImplementedError`` otherwise).
        data_type, q_data_type
            The cache and query dtypes (``q_data_type`` defaults to ``data_type``): fp16/bf16, or an
            fp8 cache as :meth:`BatchMLAPagedAttentionWrapper.plan` accepts.
        rope_scale, rope_theta : Optional[float]
            Accepted and kept; they do not enter the computation (``q_pe`` and ``kpe`` arrive rotated).
        """
        for t, name in ((indptr, "indptr"), (indices, "indices"), (last_page_len, "last_page_len")):
            check_tensor(t, name, ndim=1)
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
        if window_left is not None and int(window_left) != -1:
            raise NotImplementedError("window_left: the MLA kernel has no sliding window (use -1)")
        if logits_soft_cap is not None and float(logits_soft_cap) > 0:
            raise NotImplementedError("logits_soft_cap: the MLA kernel has no soft cap (use None or 0)")
        kv_dtype = canonicalize_dtype(data_type, "data_type")
        q_dtype, kv_dtype = check_mla_dtypes(q_data_type if q_data_type else kv_dtype, kv_dtype, kv_name="data_type")
        check_positive_int(page_size, "page_size")
        indptr_host = host_index(indptr, "indptr")
        lpl_host = host_index(last_page_len, "last_page_len")
        batch = lpl_host.numel()
        if indptr_host.numel() != batch + 1:
            raise ValueError(f"indptr: expected batch_size + 1 = {batch + 1} elements, got {indptr_host.numel()}")
        check_indptr_host(indptr_host, "indptr", zero_start=False)
        pages = (indptr_host[1:] - indptr_host[:-1]).to(torch.int64)
        lpl = lpl_host.to(torch.int64)
        if ((pages > 0) & ((lpl < 1) | (lpl > page_size))).any() or ((pages == 0) & (lpl != 0)).any():
            raise ValueError(f"last_page_len: expected 1..page_size ({page_size}) for requests with pages, 0 without")
        kv_lens = torch.where(pages > 0, (pages - 1) * page_size + lpl, torch.zeros_like(pages)).to(torch.int32)
        indices_dev = None
        if self._use_cuda_graph:
            check_graph_plan(batch, self._fixed_batch_size, len(indices), self._paged_kv_indices_buf)
            indices_dev = self._paged_kv_indices_buf
        self._head_dim_ckv = int(head_dim_compressed_kv)
        self._plan_args = dict(
            qo_host=torch.arange(batch + 1, dtype=torch.int32), kv_indptr_host=indptr_host, kv_lens_host=kv_lens,
            kv_indices=indices, kv_indices_name="indices", num_heads=num_qo_heads,
            head_dim_ckv=self._head_dim_ckv, page_size=page_size, causal=False, sm_scale=sm_scale, q_dtype=q_dtype,
            kv_dtype=kv_dtype, kv_indices_device=indices_dev)
        # head_dim_kpe is not a plan argument: FlashInfer's kernel fixes it at 64; another one is
        # planned for by the first run() that shows it (and kept by later plans)
        kpe = self._step.head_dim_kpe if self._step is not None else 64
        self._step = self._plan_step(head_dim_kpe=kpe, **self._plan_args)
        if self._use_cuda_graph:
            copy_graph_page_table(self, indptr, indices, last_page_len, len(indices), True)
        self._settings = (float(sm_scale), window_left, logits_soft_cap, rope_scale, rope_theta)

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        paged_ckv_cache: torch.Tensor,
        paged_kpe_cache: torch.Tensor,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """MLA decode for the planned batch.

        Parameters
        ----------
        q_nope : torch.Tensor
            ``[batch_size, num_qo_heads, head_dim_ckv]``.
        q_pe : torch.Tensor
            ``[batch_size, num_qo_heads, head_dim_kpe]``.
        paged_ckv_cache, paged_kpe_cache : torch.Tensor
            ``[max_num_pages, page_size, head_dim_ckv]`` and ``[max_num_pages, page_size, head_dim_kpe]``.
        q_scale, k_scale : Optional[float]
            Multiply ``sm_scale`` (positive). With an fp8 cache (``data_type`` e4m3/e5m2, beyond
            FlashInfer 0.5.3) ``k_scale`` is the cache's dequantisation scale (ckv and kpe alike).
        v_scale : Optional[float]
            Multiplies the output (inside the kernel): the fp8 cache's scale again, ckv being the values.
        out, lse : Optional[torch.Tensor]
            Preallocated output (q_nope's shape and dtype) and float32 ``[batch_size, num_qo_heads]`` LSE.
        return_lse : bool
            Also return the base-2 LSE.
        enable_pdl : bool
            Accepted; no effect on results.
        """
        if self._settings is None:
            raise ValueError("run() was called before plan()")
        if self._step.head_dim_kpe != q_pe.shape[-1]:
            check_tensor(q_pe, "q_pe", ndim=3)
            self._step = self._plan_step(head_dim_kpe=q_pe.shape[-1], **self._plan_args)
        scale = (1.0 if q_scale is None else float(q_scale)) * (1.0 if k_scale is None else float(k_scale))
        if not scale > 0:
            raise ValueError(f"q_scale, k_scale: their product must be positive, got {scale}")
        v = 1.0 if v_scale is None else float(v_scale)
        if not math.isfinite(v):
            raise ValueError(f"v_scale: expected a finite float, got {v_scale}")
        return self._run_step(q_nope, q_pe, paged_ckv_cache, paged_kpe_cache, out, lse, return_lse, scale=scale,
                              names=("paged_ckv_cache", "paged_kpe_cache"), v_scale=v)

    run_return_lse = functools.partialmethod(run, return_lse=True)


def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor,
    append_kpe: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    ckv_cache: Optional[torch.Tensor],
    kpe_cache: Optional[torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    r"""Append latent rows to a paged MLA cache, in place.

    Token ``t`` is written to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot
    ``pos % page_size`` of both caches, with ``b = batch_indices[t]`` and ``pos = positions[t]``.

    Parameters
    ----------
    append_ckv : torch.Tensor
        ``[nnz, head_dim_ckv]`` compressed KV rows to append.
    append_kpe : torch.Tensor
        ``[nnz, head_dim_kpe]`` rotary key rows to append.
    batch_indices, positions : torch.Tensor
        ``[nnz]`` int32 (or int64): request and position of each row (see
        ``get_batch_indices_positions``); batch index -1 marks padding, skipped.
    ckv_cache : torch.Tensor
        ``[num_pages, page_size, head_dim_ckv]``, written in place (strided views fine, last dim
        contiguous).
    kpe_cache : torch.Tensor
        ``[num_pages, page_size, head_dim_kpe]``, written in place.
    kv_indices, kv_indptr, kv_last_page_len : torch.Tensor
        The page table (int32), already including the appended tokens; ``kv_last_page_len`` is
        only checked for its shape.

    dtypes: the rows in the caches' dtype (FlashInfer 0.5.3 reinterprets the rows' storage as the
    cache's dtype, unchecked). An fp8 cache (read by the MLA wrappers beyond FlashInfer) also takes
    float16/bfloat16/float32 rows, converted in the kernel (round to nearest even), unscaled as in
    ``append_paged_kv_cache``: quantise with a scale by appending ``ckv / ckv_scale`` and running with
    ``ckv_scale`` (SGLang divides by its ``k_scale`` before storing). ``append_ckv`` and ``append_kpe``
    share a dtype, as do the two caches.

    Any ``head_dim_ckv`` / ``head_dim_kpe`` runs (FlashInfer: 512 / 64 only). Bounds as
    ``append_paged_kv_cache``: a request index, position or page id outside the page table or the
    cache is never written; the kernel skips it and reports it (``tritoninfer.check_errors()``, or
    the next plan), and CPU index tensors are checked at once with a ``ValueError``.
    """
    for t, name in ((ckv_cache, "ckv_cache"), (kpe_cache, "kpe_cache")):
        if t is None:
            raise ValueError(f"{name}: expected a [num_pages, page_size, D] tensor, got None")
        check_tensor(t, name, ndim=3)
    check_tensor(append_ckv, "append_ckv", ndim=2)
    check_tensor(append_kpe, "append_kpe", ndim=2)
    if append_kpe.shape[0] != append_ckv.shape[0]:
        raise ValueError(f"append_kpe: {append_kpe.shape[0]} rows, append_ckv has {append_ckv.shape[0]}")
    if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
        raise ValueError(f"kpe_cache: shape {tuple(kpe_cache.shape)} disagrees with ckv_cache "
                         f"{tuple(ckv_cache.shape)} on num_pages / page_size")
    if append_ckv.shape[1] != ckv_cache.shape[2]:
        raise ValueError(f"append_ckv: dim {append_ckv.shape[1]} differs from ckv_cache's {ckv_cache.shape[2]}")
    if append_kpe.shape[1] != kpe_cache.shape[2]:
        raise ValueError(f"append_kpe: dim {append_kpe.shape[1]} differs from kpe_cache's {kpe_cache.shape[2]}")
    if append_kpe.dtype != append_ckv.dtype:
        raise ValueError(f"append_kpe: dtype {append_kpe.dtype} differs from append_ckv's {append_ckv.dtype}")
    if kpe_cache.dtype != ckv_cache.dtype:
        raise ValueError(f"kpe_cache: dtype {kpe_cache.dtype} differs from ckv_cache's {ckv_cache.dtype}")
    if append_ckv.dtype != ckv_cache.dtype and not (ckv_cache.dtype in FP8_DTYPES and append_ckv.dtype in
                                                    (torch.float16, torch.bfloat16, torch.float32)):
        raise ValueError(f"append_ckv: dtype {append_ckv.dtype} does not match ckv_cache's {ckv_cache.dtype} (an "
                         "fp8 cache also takes float16/bfloat16/float32 rows, converted on store)")
    # one latent head: the paged-KV append kernel with K = ckv and V = kpe
    append_paged_kv_cache(append_ckv.unsqueeze(1), append_kpe.unsqueeze(1), batch_indices, positions,
                          (ckv_cache.unsqueeze(2), kpe_cache.unsqueeze(2)), kv_indices, kv_indptr, kv_last_page_len,
                          "NHD")
