"""Launcher of the warp-specialised Gluon prefill kernel for Hopper (``kernels/prefill_hopper.py``):
its work list, its TMA descriptors and its launch. Whether a plan takes it is decided in
``_route.py``, nowhere else.

The kernel runs plain attention (no mask, window, soft cap, RoPE, ALiBi, sinks or per-head scales)
of bf16 queries over bf16 K/V, or e4m3 K/V with their scales (its fp8 mode), contiguous NHD or an NHD
paged cache (one TMA box per page), FlashAttention-3's schedule: a producer loading K/V tiles into a
ring of shared-memory stages (in the fp8 mode a warpgroup converting fp8 tiles into it) and two
consumer warpgroups, each a 64-row half of a 128-token query tile (three of a 192-token tile at head_dim 64,
``consumers``). The fp8 decode (``decode_launch``,
``kernels/decode_hopper.py``) shares its TMA views of a paged cache and its converting producer.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch

from . import _device, _plan
from ._errors import fault_record
from ._kvcache import PagedKV
from ._launch import BoundLaunch, CachedLauncher, DriverCall, TmaBox

TILE = 128  # K/V positions a ring stage holds; query tokens per work item with two consumer warpgroups of 64
STAGES = 3  # K/V ring depth: 3 x 64 KB at head_dim 128, with Q 224 KB of the H200's 227
# head_dim_qk 192 / head_dim_vo 128 (DeepSeek's non-absorbed prefill, _route.HOPPER_192_128): 2 x (48 + 32) KB,
# with Q's 48 KB 208 KB
STAGES_192 = 2
# head_dim 256 (Gemma's, _route.HOPPER_D256): stages of 64 positions (KV_TILE_256), 2 x 64 KB, with Q's 64 KB
# 192 KB; the consumers' O accumulator takes 128 of their 240 registers a thread
STAGES_256 = 2
KV_TILE_256 = 64
CONSUMER_REGS = 240  # per consumer thread; the producer warpgroup keeps 24
PRODUCER_REGS = 24
# head_dim 64: three consumer warpgroups (192-token query tiles, FlashAttention-3's there) of 160 registers a
# thread and a producer of 32 (3 x 160 + 32 = 512: the register file's 64K over 16 warps)
CONSUMERS_64 = 3
CONSUMER_REGS_64 = 160
PRODUCER_REGS_64 = 32
# e4m3 K/V (the kernel's FP8 mode): two 16-bit stages the consumers read (FP8_STAGES) and two fp8
# stages the producer warpgroup converts from (FP8_RING), 2 x 64 + 2 x 32 KB, with Q 224 KB; the
# consumers keep 240 registers a thread and the converting warpgroup 32 (2 x 240 + 32 = 512: the
# register file's 64K over 384 threads; 232 spilled in the consumers, 8 bytes, sm_90 compile)
FP8_STAGES = 2
FP8_RING = 2
FP8_CONSUMER_REGS = 240
FP8_PRODUCER_REGS = 32
# the Gluon fp8 decode (kernels/decode_hopper.py): one consumer warpgroup and one converting producer;
# BLOCK_N-position tiles, DECODE_STAGES fp16 and DECODE_FP8_STAGES e4m3 stages: 64-position tiles, 3 x 32 +
# 6 x 16 KB with Q 208 KB, so up to 6 tiles (96 KB) in flight an SM (session 19, H200: 128-position tiles
# with 2 + 2 stages, one tile in flight while the producer converted the one before, took 2.6 µs a tile:
# 1.2-1.6 TB/s); registers per consumer thread (248: none spilled with the fused split merge, sm_90
# compile; 232 spilled 8 bytes at a group of 16) and per producer thread (one program an SM)
DECODE_BLOCK_N = 64
DECODE_STAGES = 3
DECODE_FP8_STAGES = 6
DECODE_CONSUMER_REGS = 248
DECODE_PRODUCER_REGS = 40
PERSISTENT = True  # one program per SM running work items in turn (False: one item per program)
# a consumer warpgroup whose 64 rows all lie past its request's last query token releases the item's KV tiles
# unread (the kernel's IDLE_SKIP): the last query tile of a request of 1,024 tokens has 64 rows of 192 at head_dim
# 64, so two of its three consumers would compute the request's longest KV span for nothing. H200, session 25
# (benchmarks/NOTES.md): 32/8 16 x 1088 causal p16 d64 354 -> 312 us, 4 x 1088 112 -> 95, d128 455 -> 445 and
# 144 -> 132; GPU tests (tests/test_prefill.py -k idle_skip) pass both ways
IDLE_SKIP = True
# work items in sections of a few query heads (the kernel's HEAD_SECTIONS): items run heads fastest, so the
# programs side by side take the same query tile of ~132 different heads and, with many KV heads (DeepSeek's
# 128-head MHA prefill), share no K/V in L2: ncu, session 25, 192 / 128 128 heads 1 x 4096 causal: L2 hit rate
# 8 %, DRAM 69 % busy (d128 32/8: 76 %). Sections of SECTION_HEADS heads (a multiple of the group) put ~16 tiles
# of each head side by side. Measured on an H100 (session 26, benchmarks/NOTES.md; no H200 came): 192 / 128
# ragged causal 128 heads 1 x 4096 2,043-2,081 -> 1,616 us (L2 hit 41 %), 16 heads 8 x 2048 587-598 -> 506,
# 16 heads 1 x 8192 829-832 -> 875 (slower); d256 32/8 4 x 4096 causal ragged 2,458-2,541 -> 2,322, paged 16
# beside fa3 0.82 -> 0.92x; d128 32/8 4 x 4096 979 -> 996 (slower): on from SECTIONS_FROM_HEAD_DIM
HEAD_SECTIONS = True
SECTIONS_FROM_HEAD_DIM = 192
SECTION_HEADS = 8
# smallest page the Gluon kernels read by TMA: a box per page lands in an 8-row slice of a 128-byte
# swizzled stage; Triton 3.6 cannot slice one below its 8-row swizzle pattern
TMA_MIN_PAGE = 8


def decode_q_rows(group: int) -> int:
    """The rows of the fp8 decode's Q box: the group's heads rounded up to 8 (the consumer's wgmma N)."""
    return -(-group // 8) * 8


def kv_tile(head_dim_qk: int) -> int:
    """K/V positions of a prefill ring stage (the kernel's ``BLOCK_N``): 128, 64 at head_dim 256."""
    return KV_TILE_256 if head_dim_qk == 256 else TILE


def gather_pages(page_size: int, head_dim_qk: int = 128) -> bool:
    """Pages the prefill kernel's paged mode gathers by cp.async (its ``GATHER``) rather than TMA boxes:
    fewer than ``TMA_MIN_PAGE`` positions, or not dividing the K/V tile (``kv_tile``)."""
    return page_size > 0 and (page_size < TMA_MIN_PAGE or kv_tile(head_dim_qk) % page_size != 0)


def mla_gather_pages(page_size: int) -> bool:
    """Pages the MLA kernel gathers (its ``GATHER``): fewer than ``TMA_MIN_PAGE`` positions or not a
    power of two (its boxes are a page, or a 32-position tile's share of one)."""
    return page_size < TMA_MIN_PAGE or bool(page_size & (page_size - 1))


def row_stride(t: torch.Tensor) -> int:
    """Elements between the consecutive rows of a [A, B, D] tensor read as [A * B, D] (B page slots or
    heads): ``stride(1)``, or ``stride(0)`` when B is 1 (page 1's caches)."""
    return t.stride(0) if t.shape[1] == 1 else t.stride(1)


def maxnreg(consumer_regs: int, producer_regs: int = PRODUCER_REGS, consumers: int = 2) -> int:
    """The kernel-wide register limit that leaves ``consumer_regs`` to each consumer thread:
    registers are handed out per warpgroup, the consumers' and the producer's (a warp of it counts as
    a warpgroup), 4 * (consumers + 1) warps in all."""
    return (consumers * 4 * consumer_regs + 4 * producer_regs) // (4 * (consumers + 1)) // 8 * 8


def consumers(head_dim_qk: int, fp8: bool = False) -> int:
    """Consumer warpgroups of the prefill kernel: three for 16-bit K/V at head_dim 64, else two."""
    return CONSUMERS_64 if head_dim_qk == 64 and not fp8 else 2


def query_tile(head_dim_qk: int, fp8: bool = False) -> int:
    """Query tokens of a prefill work item: 64 a consumer warpgroup."""
    return 64 * consumers(head_dim_qk, fp8)


def decode_config() -> dict:
    """The Gluon fp8 decode's compile-time constants and ``maxnreg`` (two warpgroups: the launch's limit
    is the mean of the consumer's and the producer's, which ``warp_specialize`` then redistributes)."""
    return dict(BLOCK_N=DECODE_BLOCK_N, STAGES=DECODE_STAGES, FP8_STAGES=DECODE_FP8_STAGES,
                PRODUCER_REGS=DECODE_PRODUCER_REGS,
                maxnreg=(DECODE_CONSUMER_REGS + DECODE_PRODUCER_REGS) // 2 // 8 * 8)


def qk_chunk(head_dim_qk: int) -> int:
    """Columns of the prefill kernel's Q and K boxes and shared tiles: all of head_dim_qk where it is a
    power of two (TMA boxes and Gluon tiles are), else chunks of 64 (192: three)."""
    return head_dim_qk if head_dim_qk & (head_dim_qk - 1) == 0 else 64


def head_sections(head_dim_qk: int) -> bool:
    """Whether the kernel runs its work items in sections of heads (``HEAD_SECTIONS``) at this head_dim."""
    return HEAD_SECTIONS and head_dim_qk >= SECTIONS_FROM_HEAD_DIM


def section_heads(num_qo_heads: int, group: int) -> int:
    """Query heads a section of work items holds (``HEAD_SECTIONS``): the largest multiple of ``group`` that
    divides ``num_qo_heads`` and is at most ``SECTION_HEADS`` (at least ``group``: a KV head's heads stay in one
    section). All of them (one section, the kernel's plain order) where that is every head."""
    best = group
    for n in range(group, min(SECTION_HEADS, num_qo_heads) + 1, group):
        if num_qo_heads % n == 0:
            best = n
    return best


def kernel_config(fp8: bool, head_dim_qk: int = 128) -> dict:
    """The kernel's ring, tile and register constants (and ``maxnreg``) for 16-bit or e4m3 K/V: at head_dim_qk
    192 Q and K in chunks (``qk_chunk``) and a shallower ring (``STAGES_192``), at 64 three consumers
    (``consumers``), at 256 stages of 64 positions (``kv_tile``, ``STAGES_256``)."""
    if fp8:
        return dict(STAGES=FP8_STAGES, FP8=True, FP8_STAGES=FP8_RING, CONSUMER_REGS=FP8_CONSUMER_REGS,
                    PRODUCER_REGS=FP8_PRODUCER_REGS, QK_CHUNKS=1, CONSUMERS=2, BLOCK_N=TILE, IDLE_SKIP=IDLE_SKIP,
                    HEAD_SECTIONS=head_sections(head_dim_qk), maxnreg=maxnreg(FP8_CONSUMER_REGS, FP8_PRODUCER_REGS))
    n = consumers(head_dim_qk)
    regs, producer = (CONSUMER_REGS, PRODUCER_REGS) if n == 2 else (CONSUMER_REGS_64, PRODUCER_REGS_64)
    stages = STAGES if head_dim_qk <= 128 else STAGES_192 if head_dim_qk == 192 else STAGES_256
    return dict(STAGES=stages, FP8=False, FP8_STAGES=1, CONSUMER_REGS=regs, PRODUCER_REGS=producer,
                QK_CHUNKS=head_dim_qk // qk_chunk(head_dim_qk), CONSUMERS=n, BLOCK_N=kv_tile(head_dim_qk),
                IDLE_SKIP=IDLE_SKIP, HEAD_SECTIONS=head_sections(head_dim_qk), maxnreg=maxnreg(regs, producer, n))


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
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


def work_tiles(qo_lens: np.ndarray, kv_lens: np.ndarray, causal: bool, tile: int = TILE) -> np.ndarray:
    """int32 [2, tiles]: request and first query token of every ``tile``-token query tile (``query_tile``),
    the tiles that read the most KV first: the attention core's work list (no splits), heaviest first."""
    plan = _plan.heaviest_first(_plan.build_work(qo_lens, kv_lens, tile, None), qo_lens, kv_lens, tile, causal)
    return np.ascontiguousarray(plan.work[:, :2].T)


def padded_tiles(work: np.ndarray) -> np.ndarray:
    """``work_tiles``' [2, tiles] as a plan uploads it: rows of a multiple of 4 entries, so that the second
    row's device address is 16-byte aligned as the first's (Triton specialises pointers on that: a
    misaligned row would be another compiled kernel, compiled mid-serving). ``tiles_view`` reads it."""
    n = work.shape[1]
    out = np.zeros((2, -(-n // 4) * 4), np.int32)
    out[:, :n] = work
    return out


def tiles_view(view: torch.Tensor, work: np.ndarray) -> torch.Tensor:
    """The uploaded ``padded_tiles(work)`` as the kernel takes it: int32 [2, tiles]."""
    return view.view(2, -1)[:, :work.shape[1]]


def tma_ready(t: torch.Tensor) -> bool:
    """A [tokens, H, D] tensor that a 2-D TMA box can read as [tokens, H * D]."""
    s = t.stride()  # (one call: run() pays for each, and stride(i) costs as much as stride())
    return s[2] == 1 and s[1] == t.shape[2] and (s[0] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=None)
def smem_layout(rows: int, head_dim: int, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], {torch.float16: gl.float16,
                                                                   torch.bfloat16: gl.bfloat16,
                                                                   torch.float8_e4m3fn: gl.float8e4nv}[dtype])


class KVBoxes(NamedTuple):
    """The kernel's view of K/V for one call: TMA boxes of K and V, rows per page (0: contiguous), the
    page size (0: contiguous), the pages in the cache (the gather's clamp)."""

    boxes: tuple
    rows_per_page: int
    page_size: int = 0
    num_pages: int = 0


def ragged_descriptors(k: torch.Tensor, v: torch.Tensor) -> Optional[KVBoxes]:
    """TMA boxes of contiguous NHD K/V (``kv_tile``-token boxes of one head, K's of ``qk_chunk`` columns, V's of
    its head_dim), or None where a 2-D TMA view does not fit them (the run then takes the core)."""
    if not (tma_ready(k) and tma_ready(v)):
        return None
    n, h, dk = k.shape
    dv = v.shape[2]
    ck, rows = qk_chunk(dk), kv_tile(dk)
    return KVBoxes((TmaBox(k, (n, h * dk), (k.stride()[0], 1), (rows, ck), smem_layout(rows, ck, k.dtype)),
                    TmaBox(v, (n, h * dv), (v.stride()[0], 1), (rows, dv), smem_layout(rows, dv, v.dtype))), 0)


def paged_descriptors(kv: PagedKV) -> Optional[KVBoxes]:
    """TMA boxes of an NHD paged cache for the kernel's paged mode: K and V as 2-D views
    [rows, H * D] with a box of one page of one head, page p starting at row p * rows_per_page (in a
    5-D cache K and V pages alternate: rows_per_page = 2 * page); for pages the kernel gathers
    (``gather_pages``) boxes of a 128-row tile, which only give the stages' layout. None where the
    cache does not fit that view (heads or slots not packed, page strides that are not whole rows or
    differ). Kept on ``kv`` (``PagedKV.tma``), ``False`` standing for None."""
    if kv.tma is None:
        kv.tma = _paged_descriptors(kv) or False
    return kv.tma or None


def _paged_descriptors(kv: PagedKV) -> Optional[Tuple[tuple, int]]:
    page, h, d = kv.page_size, kv.num_heads, kv.head_dim_qk
    row = h * d
    page_stride, slot, head = kv.k_strides
    if (kv.k_strides != kv.v_strides or (page > 1 and slot != row) or head != d or page_stride % row
            or (page_stride * kv.k.element_size()) % 16 or kv.k.data_ptr() % 16 or kv.v.data_ptr() % 16):
        return None
    rows_per_page = page_stride // row
    rows = (kv.k.shape[0] - 1) * rows_per_page + page
    box = kv_tile(d) if gather_pages(page, d) else page
    layout = smem_layout(box, d, kv.k.dtype)
    return KVBoxes(tuple(TmaBox(t, (max(rows, box), row), (row, 1), (box, d), layout) for t in (kv.k, kv.v)),
                   rows_per_page, page, kv.k.shape[0])


def _check_page_ids_launcher():
    from .kernels.faults import check_page_ids_kernel

    return CachedLauncher(check_page_ids_kernel)


def check_page_ids(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, batch: int, num_pages: int) -> None:
    """Reports (``tritoninfer/_errors.py``) a page id outside the cache: the kernel reads pages through
    TMA boxes, which the hardware keeps inside the cache, so it would not see a bad id itself.
    ``kv_indptr`` is the plan's own, checked on the host."""
    launcher = _device.per_device("check_page_ids", kv_indices.device, _check_page_ids_launcher)
    launcher[(batch,)](kv_indptr, kv_indices, fault_record(kv_indices.device), num_pages, BLOCK=256)


def launch(q, kv_descriptors, out, lse, qo_indptr, kv_indptr, kv_len, tiles: torch.Tensor, num_kv_heads: int,
           sm_scale: float, causal: bool, launches: dict, kv_indices=None, k_mult: float = 1.0,
           v_mult: float = 1.0) -> Optional[DriverCall]:
    """The kernel over ``kv_descriptors`` (from ``ragged_descriptors`` with token offsets ``kv_indptr``,
    or ``paged_descriptors`` with the page table ``kv_indptr`` / ``kv_indices``); ``kv_len`` int32
    [batch]; ``tiles`` the uploaded ``work_tiles`` (int32 [2, tiles]). e4m3 K/V take the kernel's ``FP8``
    mode, ``k_mult`` (q_scale * k_scale) multiplying the scores and ``v_mult`` (v_scale) the output.

    ``launches``: where a wrapper keeps its bound launches (``DevicePlan.attention_launches``, shared by
    its plans, as the attention core's), keyed by what compiles: a run of a new plan rebinds the plan's
    tensors and grid into the launch the last plan used (``_HopperLaunch.bind_plan``) instead of
    building another (session 20: ~90 µs of the dev CPU's Python at every step's first run)."""
    (k_box, v_box), rows_per_page, page, num_pages = kv_descriptors
    tokens, hq, d = q.shape
    key = ("hopper", hq, num_kv_heads, d, v_box.block[1], q.dtype, k_box.tensor.dtype, sm_scale, causal, page)
    bound = launches.get(key)
    if bound is None:
        if len(launches) >= 16:
            launches.clear()
        bound = launches[key] = _HopperLaunch(q.device, hq, num_kv_heads, sm_scale, causal, page,
                                              k_box.tensor.dtype == torch.float8_e4m3fn, d)
    plan_of = bound.plan_of
    if (plan_of is None or plan_of[0] is not tiles or plan_of[1] is not kv_indices or plan_of[2] is not kv_indptr
            or plan_of[3] is not qo_indptr or plan_of[4] is not kv_len or plan_of[5] != rows_per_page):
        bound.bind_plan(qo_indptr, kv_indptr, kv_len, tiles, kv_indices, rows_per_page)
    if lse is None:  # the kernel always writes one (see kernels/prefill_hopper.py)
        lse = bound.lse_scratch(tokens)
    c = k_box.block[1]  # qk_chunk(d)
    q_box = TmaBox(q, (tokens, hq * d), (q.stride()[0], 1), (64, c), smem_layout(64, c, q.dtype))
    os_ = out.stride()
    # (the gather's reads: the caches' bases, row stride and pages; unread by the TMA modes)
    return bound.launch(q_box, k_box, v_box, out, os_[0], os_[1], lse, lse.stride()[0], k_box.tensor,
                        v_box.tensor, k_box.strides[0], num_pages, float(k_mult), float(v_mult))


class _HopperLaunch:
    """The kernel's launch for one configuration (heads, dtypes, scale, mask, page size), moved from plan
    to plan by ``bind_plan``: the compiled kernel and its driver launches stay, only the plan's tensors
    and the grid are rewritten (``BoundLaunch.rebind``). A scratch LSE for runs without one."""

    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, sm_scale: float, causal: bool,
                 page: int, fp8: bool, head_dim_qk: int = 128) -> None:
        from .kernels.prefill_hopper import prefill_hopper_kernel

        self.device = device
        self.num_qo_heads = num_qo_heads
        self.sm_scale_log2 = sm_scale * math.log2(math.e)
        self.launcher = _device.per_device("prefill_hopper", device, lambda: CachedLauncher(prefill_hopper_kernel))
        self.kwargs = dict(GROUP=num_qo_heads // num_kv_heads, IS_CAUSAL=causal, PAGE_SIZE=page,
                           GATHER=gather_pages(page, head_dim_qk), num_warps=4, **kernel_config(fp8, head_dim_qk))
        self.heads_per_section = section_heads(num_qo_heads, num_qo_heads // num_kv_heads)  # (read with HEAD_SECTIONS)
        self.launch: Optional[BoundLaunch] = None
        # the plan's tensors the launch holds (compared by identity at each run; kept alive here) and
        # its rows per page
        self.plan_of: Optional[tuple] = None
        self._lse: Optional[torch.Tensor] = None
        self._lse_rows: Optional[torch.Tensor] = None

    def bind_plan(self, qo_indptr, kv_indptr, kv_len, tiles, kv_indices, rows_per_page: int) -> None:
        hq = self.num_qo_heads
        num_items = tiles.shape[1] * hq
        grid = (min(num_items, _device.num_sms(self.device)) if PERSISTENT else num_items,)
        tail = (qo_indptr, kv_indptr, kv_len, tiles[0], tiles[1], hq, num_items, self.sm_scale_log2,
                kv_indices if kv_indices is not None else kv_indptr, rows_per_page, self.heads_per_section)
        if self.launch is None:
            self.launch = BoundLaunch(self.launcher, grid, tail, self.kwargs)
        else:
            self.launch.rebind(grid, tail)
        self.plan_of = (tiles, kv_indices, kv_indptr, qo_indptr, kv_len, rows_per_page)

    def lse_scratch(self, tokens: int) -> torch.Tensor:
        """float32 [tokens, H_qo] the kernel may write (rows of a buffer grown as plans need; the same view
        object while ``tokens`` stays: a replayed run finds it by identity, ``_replay.py``)."""
        if self._lse is None or self._lse.shape[0] < tokens:
            self._lse = torch.empty((max(tokens, 1), self.num_qo_heads), dtype=torch.float32, device=self.device)
            self._lse_rows = None
        if self._lse_rows is None or self._lse_rows.shape[0] != tokens:
            self._lse_rows = self._lse[:tokens]
        return self._lse_rows


def decode_launch(q: torch.Tensor, kv_descriptors: KVBoxes, out: torch.Tensor, lse: Optional[torch.Tensor], plan,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_kv_heads: int, sm_scale: float,
                  workspace: torch.Tensor, k_mult: float, v_mult: float) -> Optional[DriverCall]:
    """The Gluon fp8 decode (``kernels/decode_hopper.py``) over ``plan`` (a decode ``DevicePlan``: its
    work list, one entry per request split; split states merged inside the kernel) and the e4m3 pages
    of ``kv_descriptors`` (``paged_descriptors``). ``q`` [batch, H_qo, D] contiguous. The launch is kept
    in ``plan.attention_launches`` (the wrapper's, shared by its plans) and moved to a new plan by
    ``_DecodeLaunch.bind_plan``, as the prefill kernel's (``launch``)."""
    (k_box, v_box), rows_per_page, page, _ = kv_descriptors
    batch, hq, d = q.shape
    key = ("decode_hopper", id(workspace), hq, num_kv_heads, d, q.dtype, sm_scale, page)
    launches = plan.attention_launches
    bound = launches.get(key)
    if bound is None:
        if len(launches) >= 16:
            launches.clear()
        bound = launches[key] = _DecodeLaunch(q.device, hq, num_kv_heads, d, sm_scale, workspace)
    plan_of = bound.plan_of
    if (plan_of is None or plan_of[0] is not plan or plan_of[1] is not kv_indices or plan_of[2] is not kv_indptr
            or plan_of[3] != rows_per_page):
        bound.bind_plan(plan, kv_indptr, kv_indices, rows_per_page)
    lse_out = bound.lse_scratch(batch) if lse is None else lse
    rows = bound.q_rows
    q_box = TmaBox(q, (batch * hq, d), (d, 1), (rows, d), smem_layout(rows, d, q.dtype))
    os_ = out.stride()
    return bound.launch(q_box, k_box, v_box, out, os_[0], os_[1], lse_out, lse_out.stride()[0], float(k_mult),
                        float(v_mult))


class _DecodeLaunch:
    """The Gluon fp8 decode's launch for one configuration (heads, head_dim, scale, page size, workspace),
    moved from plan to plan by ``bind_plan``: the plan's work list and page table, the partial states'
    views of the workspace and the split-arrival counters. A scratch LSE for runs without one."""

    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float,
                 workspace: torch.Tensor) -> None:
        from .kernels.decode_hopper import decode_hopper_kernel

        self.device = device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.sm_scale_log2 = sm_scale * math.log2(math.e)
        self.workspace = workspace  # (its identity is in the launch's key)
        self.launcher = _device.per_device("decode_hopper", device, lambda: CachedLauncher(decode_hopper_kernel))
        self.kwargs = dict(GROUP=num_qo_heads // num_kv_heads, num_warps=4, **decode_config())
        self.q_rows = decode_q_rows(num_qo_heads // num_kv_heads)  # the Q box the bound consumer expects
        self.launch: Optional[BoundLaunch] = None
        self.plan_of: Optional[tuple] = None  # the plan and page table bound (identities), rows per page
        self._lse: Optional[torch.Tensor] = None

    def bind_plan(self, plan, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, rows_per_page: int) -> None:
        hq, hk, d, workspace = self.num_qo_heads, self.num_kv_heads, self.head_dim, self.workspace
        num_items = plan.capacity * hk
        states = plan.state_capacity  # (the layout a captured graph keeps: fixed in CUDA-graph mode)
        need = states * hq * (d + 1) * 4
        if plan.has_splits and need > workspace.numel():
            raise ValueError(f"float_workspace_buffer: the plan needs {need} bytes for split-KV states, the buffer "
                             f"has {workspace.numel()}")
        ws = workspace[: (workspace.numel() // 4) * 4].view(torch.float32)
        # float32 views even when the plan has no split (never written then): one specialisation either way
        part_o, part_lse = ws[: max(states * hq * d, 4)], ws[states * hq * d: max(states * hq * (d + 1), 4)]
        # one counter per (request's query tile, KV head): zero between launches (the last split resets it)
        counters = plan.counters.get(num_items)
        tail = (part_o, part_lse, counters, plan.work, kv_indptr, kv_indices, plan.state_offset, hq, hk, num_items,
                self.sm_scale_log2, rows_per_page)
        grid = (max(1, min(num_items, _device.num_sms(self.device))),)
        if self.launch is None:
            self.launch = BoundLaunch(self.launcher, grid, tail, self.kwargs)
        else:
            self.launch.rebind(grid, tail)
        self.plan_of = (plan, kv_indices, kv_indptr, rows_per_page)

    def lse_scratch(self, batch: int) -> torch.Tensor:
        """float32 [batch, H_qo] the kernel may write (rows of a buffer grown as plans need)."""
        if self._lse is None or self._lse.shape[0] < batch:
            self._lse = torch.empty((max(batch, 1), self.num_qo_heads), dtype=torch.float32, device=self.device)
        return self._lse[:batch]
