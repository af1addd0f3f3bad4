"""Host-side planning: tile choices, split-KV decisions and work lists. No kernels, no device syncs.

A *work item* is (request, first query token of its tile, kv_start, kv_end, split index, number of
splits of the request); the attention kernel runs one program per item and KV head. Tile sizes are
compile-time choices keyed on head_dim, dtypes and group size, never on sequence lengths; split
counts and work lists are run-time plan data and may depend on lengths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from . import _device

# request, q_tile_start, kv_start, kv_end, split, num_splits, group (the request's query tile: the
# items of one group are the splits whose partial states the last of them merges)
WORK_FIELDS = 7


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceiling division (``triton.cdiv`` costs ~10 µs a call from Python in Triton 3.6)."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Compile-time tile shape of one attention launch."""

    block_m: int  # rows per program: (query token, head of the group) pairs
    block_n: int  # KV positions per loop iteration
    num_warps: int
    num_stages: int
    tile_tokens: int  # query tokens per work item
    row_tiles: int  # programs along the row axis per item (decode: L*group may exceed block_m)
    prefetch_pages: bool = True  # load the next KV tile's page ids one iteration ahead
    kv_as_m: bool = False  # KV positions as the M of the dots, query rows as N (decode on Hopper)
    programs_per_sm: int = 2  # resident programs per SM (registers, shared memory) on the H200
    mask_free_tiles: bool = False  # a separate loop without score masks for tiles every row sees
    # softmax scale applied inside exp2's argument (FFMA), the row max taken on raw scores; only
    # where the scores need no other transform (no soft cap, ALiBi or per-head scales)
    fold_scale: bool = False
    # > 0: one query row per program, no dots: the KV tile is LANES x (block_n // LANES) positions and
    # every lane keeps its own softmax state (a GQA group of one; decode_tiles sizes the lanes so that
    # a lane's reductions stay within its warp)
    lanes: int = 0


# the dot-free single-row tiles per KV element size: (KV positions per lane and iteration, warps,
# stages, programs per SM). Only fp8: for 16-bit KV the wgmma tiles (kv_as_m) stay faster
# (benchmarks/NOTES.md, session 5)
LANE_TILES = {1: (4, 4, 3, 4)}


# fp8 decode's pipeline stages and the programs an SM they leave (the split policy's count): module
# constants so that a run can try others (``tritoninfer bench decode --set _plan.FP8_DECODE_STAGES=3
# --set _plan.FP8_DECODE_PROGRAMS=2``)
FP8_DECODE_STAGES = 2
FP8_DECODE_PROGRAMS = 3


def decode_tiles(group: int, q_len_per_req: int, head_dim: int, kv_elem_bytes: int = 2,
                 lanes_ok: bool = False) -> Tiles:
    """Tiles for decode: one work item covers all ``q_len_per_req`` tokens of a request.

    ``lanes_ok``: the scores need nothing the dot-free single-row path lacks (RoPE on the fly,
    ALiBi, a custom mask, per-head scales), so a single row (a GQA group of one) may take it."""
    rows = group * q_len_per_req
    if rows == 1 and lanes_ok and head_dim <= 128 and kv_elem_bytes in LANE_TILES:
        if _device.is_interpreter():
            return Tiles(1, 16, 1, 1, 1, 1, prefetch_pages=False, lanes=4)
        lane_tokens, warps, stages, programs = LANE_TILES[kv_elem_bytes]
        # a row of head_dim is loaded in 16-byte pieces by neighbouring threads; the rest of a
        # warp's 32 threads are lanes, so each lane's reductions stay within its warp
        lanes = warps * max(1, 32 * 16 // (next_pow2(head_dim) * kv_elem_bytes))
        return Tiles(1, lanes * lane_tokens, warps, stages, 1, 1, prefetch_pages=False, programs_per_sm=programs,
                     lanes=lanes)
    block_m = min(max(16, next_pow2(rows)), 64)
    if _device.is_interpreter():
        return Tiles(block_m, 16, 1, 1, q_len_per_req, math.ceil(rows / block_m))
    row_tiles = math.ceil(rows / block_m)
    # the head_dim 64 and 256 tiles below were measured (H200, benchmarks/NOTES.md, session 25) on one
    # query token in 16 rows only: at 64 rows the head_dim 256 one spills and the head_dim 64 one needs
    # 120 KB (one program an SM)
    one_token_tile = block_m == 16 and q_len_per_req == 1
    if head_dim > 128 and kv_elem_bytes == 2 and one_token_tile:
        # 16-bit KV at head_dim 256: KV positions as M in 32-position tiles, three stages, page ids
        # ahead (89 KB, two programs an SM): 32/8 64 x 4096 p16 481 us (4.47 TB/s) against the query-rows-
        # as-M 32-position tiles' 694
        return Tiles(block_m, 32, 4, 3, q_len_per_req, row_tiles, prefetch_pages=True, kv_as_m=True)
    if head_dim > 128:
        return Tiles(block_m, 32, 4, 2, q_len_per_req, row_tiles, prefetch_pages=False)
    if kv_elem_bytes == 1:
        # fp8: query rows as M (mma.sync), 128-token tiles, page ids one tile ahead; 162 registers
        # and 74 KB of shared memory leave three programs per SM (benchmarks/NOTES.md, v4). Those 2
        # stages give the K/V tiles one shared buffer (sm_90 TTGIR), the programs hide the latency;
        # 3 stages give two buffers (106 KB, two programs an SM), 4 three (139 KB, one)
        return Tiles(block_m, 128, 4, FP8_DECODE_STAGES, q_len_per_req, row_tiles, prefetch_pages=True,
                     programs_per_sm=FP8_DECODE_PROGRAMS)
    # 16-bit KV: KV positions as M (wgmma reads K and V from shared memory), three stages
    # (benchmarks/NOTES.md, v4); 64-token tiles at head_dim 128, 128-token ones at 64 and below in a
    # 16-row tile, so that a stage holds as many bytes (32/8 64 x 4096 p16: 138 us against 188)
    block_n = 128 if head_dim <= 64 and one_token_tile else 64
    return Tiles(block_m, block_n, 4, 3, q_len_per_req, row_tiles, prefetch_pages=True, kv_as_m=True)


_TILES: "dict[Tiles, Tiles]" = {}


def canonical(tiles: Tiles) -> Tiles:
    """One object per distinct tile choice: bound launches are kept by the identity of their tiles
    (``_attention.launch_attention``), so a plan's equal tiles must be the same object for its first
    run to find the previous plan's launch."""
    return _TILES.setdefault(tiles, tiles)


def prefill_tiles(group: int, head_dim: int, avg_packed_rows: Optional[float] = None,
                  kv_elem_bytes: int = 2) -> Tiles:
    return canonical(_prefill_tiles(group, head_dim, avg_packed_rows, kv_elem_bytes))


def _prefill_tiles(group: int, head_dim: int, avg_packed_rows: Optional[float] = None,
                   kv_elem_bytes: int = 2) -> Tiles:
    """Tiles for prefill: each work item covers ``block_m // group`` query tokens.

    ``avg_packed_rows`` is the batch's query rows per request times the group (FlashInfer's
    "packed" length). At 64 or fewer (decode-like steps through the prefill API, a cascade's
    per-request level) a 128-row tile would be mostly empty: the tiles are then decode's, sized to
    the rows, as FlashInfer also picks a smaller query tile from the same average.
    """
    if _device.is_interpreter():
        block_m = max(16, next_pow2(group))
        return Tiles(block_m, 16, 1, 1, block_m // group, 1, mask_free_tiles=True, fold_scale=True)
    if avg_packed_rows is not None and avg_packed_rows <= 64 and group <= 64:
        block_m = min(max(16, next_pow2(math.ceil(avg_packed_rows)), next_pow2(group)), 64)
        tokens = block_m // group
        return dataclasses.replace(decode_tiles(group, tokens, head_dim, kv_elem_bytes), tile_tokens=tokens,
                                   row_tiles=1, mask_free_tiles=True)
    block_m = max(64 if head_dim > 128 else 128, next_pow2(group))
    block_n = 32 if head_dim > 128 else 64
    # 128 x 64 tiles, 8 warps, 3 stages and a mask-free loop for the tiles every row sees in full:
    # the best of the sweep in benchmarks/NOTES.md (prefill, v1)
    return Tiles(block_m, block_n, 8 if block_m >= 128 else 4, 3 if head_dim <= 128 else 2, block_m // group, 1,
                 mask_free_tiles=True, fold_scale=True)


@dataclasses.dataclass
class WorkPlan:
    """A work list on the host, ready to be copied to the device."""

    work: np.ndarray  # int32 [num_items, WORK_FIELDS]
    state_offset: np.ndarray  # int32 [batch]: first partial state (times state_mult) of each request
    num_states: int  # partial states needed with state_mult 1
    has_splits: bool


def kv_split_chunk(
    kv_lens: np.ndarray,
    q_tiles: Optional[np.ndarray],
    num_kv_heads: int,
    num_sms: int,
    block_n: int,
    page_size: int,
    fixed_split_size: Optional[int],
    disable_split_kv: bool,
    programs_per_sm: int = 2,
    merge_positions: int = 0,
) -> Optional[int]:
    """KV positions per split, or None for no split. ``q_tiles``: each request's query tiles (None:
    one each, decode).

    ``fixed_split_size`` is in pages (FlashInfer's unit) and makes the split of each request
    independent of the rest of the batch. Otherwise the chunk minimises an estimate of the
    launch's duration in KV positions: programs run in waves of ``programs_per_sm * num_sms``
    (the resident slots), a wave lasts as long as its longest program, and a split costs a merge.
    Cutting requests finer than needed to fill the slots only adds merges, but cutting them so
    that the last wave is full pays: 512 equal programs on 396 slots take two full-length waves,
    while 1536 programs of a third of the length take four waves of a third.

    ``merge_positions``: what merging one split's partial state costs the merging program, in KV
    positions of reading (MLA: a [64, 512] float32 state is ~114 positions of its 1,152-byte latent
    rows). With it, a request's splits also cost that many positions each, and chunks that cut the
    longest request into 2-64 pieces are candidates too: the fewest splits that fill the GPU can
    leave one program merging 64 states alone.
    """
    if disable_split_kv or kv_lens.size == 0:
        return None
    if fixed_split_size is not None and int(fixed_split_size) > 0:
        # FlashInfer's -1 (what None becomes there) means "no fixed split"
        chunk = int(fixed_split_size) * page_size
        return None if int(kv_lens.max()) <= chunk else chunk
    slots = programs_per_sm * num_sms
    kv = kv_lens.astype(np.int64, copy=False)
    if q_tiles is None:
        total, all_pairs = int(kv.sum()) * num_kv_heads, kv.size * num_kv_heads
    else:
        pairs = q_tiles.astype(np.int64) * num_kv_heads
        total, all_pairs = int((kv * pairs).sum()), int(pairs.sum())
    longest = int(kv.max())
    if total == 0:
        return None
    # every request that has programs is as long as the longest (no third reduction for it)
    equal = total == longest * all_pairs
    best, best_time = None, max(longest, -(-all_pairs // slots) * total / all_pairs)
    # the candidates, rounded to tiles and shorter than the longest request, in the order they are
    # tried (the first of equal times wins), each once (plan() runs every step): they shrink with the
    # waves, so the waves that would not cut (total >= waves * slots * longest) are skipped, and they
    # stop at the two-tile floor
    floor = 2 * block_n
    chunks = []
    for waves in range(total // (slots * longest) + 1, 9):
        chunk = -(-max(floor, -(-total // (waves * slots))) // block_n) * block_n
        if chunk < longest and (not chunks or chunk != chunks[-1]):
            chunks.append(chunk)
        if chunk == floor:
            break
    if merge_positions:
        chunks += [c for c in (-(-(-(-longest // pieces)) // block_n) * block_n for pieces in (2, 4, 8, 16, 32, 64))
                   if c < longest]
    for chunk in chunks:
        # programs after the cut: exact for equal lengths, an upper bound otherwise
        items = all_pairs * -(-longest // chunk) if equal else -(-total // chunk) + all_pairs
        # + a merge: about one tile, or the merging program's reads of every split's state
        merge = -(-longest // chunk) * merge_positions if merge_positions else block_n
        t = max(chunk, -(-items // slots) * total / items) + merge
        if t < best_time * 0.97:  # a split must win clearly: partial states are not free
            best, best_time = chunk, t
    return best


def build_work(
    q_lens: Optional[np.ndarray],
    kv_lens: np.ndarray,
    tile_tokens: int,
    chunk: Optional[int],
    max_splits: Optional[int] = None,
    align: int = 1,
) -> WorkPlan:
    """Vectorised work list: for each request, its query tiles times its KV splits (``q_lens`` None:
    one query token per request, decode).

    With ``max_splits`` (CUDA-graph capacity) a request never gets more splits than that; its
    chunk grows instead, to a multiple of ``align`` positions (the Gluon MLA kernel reads a split
    in boxes that must not cross a page: its splits start on multiples of its tile).
    """
    kv_lens = kv_lens.astype(np.int64, copy=False)
    if chunk is None:
        num_splits = None
    else:
        req_chunk = chunk  # (one for every request, unless a capacity grows some: fewer numpy calls)
        if max_splits is not None:
            grown = -(-(-(-kv_lens // max_splits)) // align) * align
            req_chunk = np.where(-(-kv_lens // chunk) > max_splits, np.maximum(chunk, grown), chunk)
        num_splits = np.maximum(1, -(-kv_lens // req_chunk))
    layout = _work_layout(q_lens, num_splits, tile_tokens, kv_lens.size)
    work = layout.work.copy()
    if chunk is None:
        # (decode: one item a request, in order)
        work[:, 3] = kv_lens if q_lens is None else kv_lens[layout.req]
    else:
        item_chunk = req_chunk if max_splits is None else req_chunk[layout.req]
        kv_start = layout.split * item_chunk
        work[:, 2] = kv_start
        work[:, 3] = np.minimum(kv_start + item_chunk, kv_lens[layout.req])
    return WorkPlan(work, layout.state_offset, layout.num_states, layout.has_splits)


@dataclasses.dataclass(frozen=True)
class _WorkLayout:
    """What a work list's shape fixes: every field but the KV range, per item (request, split)."""

    work: np.ndarray  # int32 [items, WORK_FIELDS], KV columns left 0
    req: np.ndarray  # int64 [items]
    split: np.ndarray  # int64 [items]
    state_offset: np.ndarray
    num_states: int
    has_splits: bool


_LAYOUTS: "dict[tuple, _WorkLayout]" = {}


def _work_layout(q_lens: Optional[np.ndarray], num_splits: Optional[np.ndarray], tile_tokens: int,
                 batch: int) -> _WorkLayout:
    """The layout for per-request query lengths (None: one token each) and splits (None: one each),
    remembered: consecutive decode plans keep their splits while the lengths grow, and plan() runs
    every step (host time matters)."""
    key = (None if q_lens is None else q_lens.astype(np.int64, copy=False).tobytes(),
           None if num_splits is None else num_splits.tobytes(), tile_tokens, batch)
    layout = _LAYOUTS.get(key)
    if layout is not None:
        return layout
    q_lens = np.ones(batch, np.int64) if q_lens is None else q_lens.astype(np.int64, copy=False)
    if num_splits is None:
        num_splits = np.ones(batch, np.int64)
    q_tiles = -(-q_lens // tile_tokens)
    counts = q_tiles * num_splits
    total = int(counts.sum())
    req = np.repeat(np.arange(batch, dtype=np.int64), counts)
    local = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    ns = num_splits[req]
    split = local % ns
    work = np.zeros((total, WORK_FIELDS), np.int32)
    work[:, 0] = req
    work[:, 1] = (local // ns) * tile_tokens
    work[:, 4] = split
    work[:, 5] = ns
    work[:, 6] = np.repeat(np.cumsum(q_tiles) - q_tiles, counts) + local // ns
    split_states = np.where(num_splits > 1, q_lens * num_splits, 0)
    layout = _WorkLayout(work, req, split, (np.cumsum(split_states) - split_states).astype(np.int32),
                         int(split_states.sum()), bool((num_splits > 1).any()))
    for a in (layout.work, layout.req, layout.split, layout.state_offset):
        a.setflags(write=False)
    if len(_LAYOUTS) >= 256:
        _LAYOUTS.clear()
    _LAYOUTS[key] = layout
    return layout


def state_bytes(num_states: int, num_qo_heads: int, head_dim_vo: int) -> int:
    """Workspace bytes for split-KV partial states (fp32 output and LSE)."""
    return num_states * num_qo_heads * (head_dim_vo + 1) * 4


def fit_work(
    q_lens: Optional[np.ndarray],
    kv_lens: np.ndarray,
    tile_tokens: int,
    chunk: Optional[int],
    workspace_bytes: int,
    num_qo_heads: int,
    head_dim_vo: int,
    fixed: bool,
    max_splits: Optional[int] = None,
    align: int = 1,
) -> WorkPlan:
    """``build_work``, with automatic splits made coarser until their partial states fit the
    workspace; a ``fixed`` split that does not fit is an error (reported in plan())."""
    work = build_work(q_lens, kv_lens, tile_tokens, chunk, max_splits, align)
    while work.has_splits and state_bytes(work.num_states, num_qo_heads, head_dim_vo) > workspace_bytes:
        if fixed:
            raise ValueError(
                f"float_workspace_buffer: fixed_split_size needs {state_bytes(work.num_states, num_qo_heads, head_dim_vo)} "
                f"bytes of split-KV states, the buffer has {workspace_bytes}"
            )
        chunk *= 2
        work = build_work(q_lens, kv_lens, tile_tokens, chunk if chunk < int(kv_lens.max()) else None, max_splits,
                          align)
    return work


def heaviest_first(plan: WorkPlan, q_lens: np.ndarray, kv_lens: np.ndarray, tile_tokens: int,
                   causal: bool) -> WorkPlan:
    """The work items ordered by the KV each reads, most first (stable): the GPU starts programs in
    grid order, so the last wave holds the shortest ones instead of a causal prefill's longest
    (FlashAttention schedules its query tiles the same way). Items are independent of their
    position: partial states are addressed by request, token and split."""
    w = plan.work
    if w.shape[0] < 2:
        return plan
    req = w[:, 0].astype(np.int64)
    reads = w[:, 3].astype(np.int64)
    if causal:
        q_len, kv_len = q_lens[req].astype(np.int64), kv_lens[req].astype(np.int64)
        last_row = np.minimum(w[:, 1] + tile_tokens, q_len) - 1
        reads = np.minimum(reads, last_row + kv_len - q_len + 1)
    order = np.argsort(w[:, 2] - reads, kind="stable")
    return dataclasses.replace(plan, work=w[order])


def alibi_slopes(num_heads: int) -> np.ndarray:
    """FlashInfer's ALiBi slopes (float32 [num_heads])."""
    n2 = 2 ** math.floor(math.log2(num_heads))
    slopes = (2.0 ** (-8.0 / n2)) ** np.arange(1, n2 + 1)
    if n2 < num_heads:
        extra = (2.0 ** (-4.0 / n2)) ** np.arange(1, 1 + 2 * (num_heads - n2), 2)
        slopes = np.concatenate([slopes, extra])
    return slopes.astype(np.float32)
