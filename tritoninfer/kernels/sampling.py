"""Sampling, top-k / top-p / min-p filters, softmax: ``@triton.jit`` code only.

The filtering and sampling work is split over a grid of (row blocks, segments): each program
handles ``ROWS`` rows (1 on the GPU; more under the interpreter, whose cost is per op and program)
and one segment of ``NUM_TILES * BLOCK`` entries of them, so a row is read by many programs at once.
A search is a few launches; each program of a launch rebuilds what it needs from the previous
launch's per-(row, segment) partial results (a few KB, read from L2), so there is no combine launch.
Nothing is sorted and no launch count depends on the data (only the rounds of the top-p rejection
sampler, a loop inside one launch):

- **Thresholds by radix search.** Each float32 entry gets an order-preserving int32 key
  (``_ordered_key``). The top-k threshold is the largest key ``T`` with ``count(key >= T) >= k``
  (the k-th largest entry); the top-p threshold the largest key ``L'`` with
  ``sum(p where key >= L') >= top_p``. Both predicates are monotone, so each threshold is built
  digit by digit from the top, one launch per digit (``radix_pass_kernel``): top-k with 8-bit digits
  counted by ``tl.histogram`` (4 launches), top-p with 4-bit digits whose masses are summed over a
  ``[BLOCK, 16]`` one-hot (8 launches). Kept entries: ``key >= T`` (ties with the k-th largest are
  kept) and ``key >= L'`` (the entry whose mass crosses ``top_p`` is kept), FlashInfer's sets.
- **Sampling by inverse CDF**, two launches. One uniform ``u`` in ``[0, 1)`` per output row (drawn
  by the caller with torch, so a ``torch.Generator`` makes runs reproducible). ``sample_mass_kernel``
  sums each segment's kept mass; in ``sample_pick_kernel`` every program finds, from those sums, the
  segment where the running kept mass first exceeds ``u * Z`` (``Z`` the kept mass) and only that
  segment scans for the entry (with ``tl.cumsum`` per tile). If rounding leaves nothing above
  ``u * Z``, the last kept entry (of that segment, or of the row).

- **Compaction first.** A top-k or top-p call starts with a bound pass and a copy of each row's
  candidates (entries that can pass the filters) into ``[B, cap]``, where one program a row finishes
  the searches and the sample (``compact_finish_kernel``); the passes above run afterwards, gated, for
  the rows with more than ``cap`` candidates only (section "compaction" below). Top-k, top-p and
  joint top-k/top-p sampling of probabilities sample those rows by rejection instead
  (``rejection_sample_kernel``, one program a row). Min-p needs only the row max (``max_pass_kernel``).
- **Softmax**: per (row, segment) the max and the denominator, then each segment written from its
  row's partials; or, for many short rows, one program a whole row (``softmax_row_kernel``).

Row ``i`` of the output reads source row ``indices[i]`` when ``HAS_INDICES`` (rows sharing a
distribution); source ids outside ``[0, n_src)`` read nothing (an all-zero row: sample 0).
Parameters (``top_k``, ``top_p``, ``min_p``, temperature) are per-row arrays when ``*_ARR``, indexed
by source row when ``PARAM_BY_SOURCE`` and by output row otherwise, else one scalar.
"""

import triton
import triton.language as tl

# digit widths: top-k counts 8 bits a launch (tl.histogram is a few ops per entry whatever the
# bins); top-p sums masses over a one-hot of the digit, whose cost grows with the bins: 4 bits
K_BITS = tl.constexpr(8)
K_BINS = tl.constexpr(256)
K_PASSES = tl.constexpr(4)
P_BITS = tl.constexpr(4)
P_BINS = tl.constexpr(16)
P_PASSES = tl.constexpr(8)
_KEY_MIN = tl.constexpr(-2147483648)
# the bound pass's probability bins (compaction comment below): bin b >= 1 holds the keys with
# key >> PROB_BIN_SHIFT == b + PROB_BIN_BASE (the exponent and one mantissa bit: from 1.5 * 2**-32, a
# factor 4/3 or 3/2 a bin); 0.75 and above share the top bin. 64 bins, not 256: the 256-bin pass was
# compute-bound on the H200 (0.8 TB/s), and tl.histogram's ballots per bit of the bin plus its
# shared-memory merge compile (sm_90) to ~49 instructions an entry of the tile loop with 64 bins
# against ~68 with 256; the coarser bins add ~10-35 % candidates (the bench's rows)
PROB_BIN_SHIFT = tl.constexpr(22)
PROB_BIN_BASE = tl.constexpr(190)
PROB_BOUND_BINS = tl.constexpr(64)


def bound_bins(prob_bins: bool) -> int:
    """The bound pass's bins: ``PROB_BOUND_BINS`` for probabilities, ``K_BINS`` for any floats."""
    return int(PROB_BOUND_BINS) if prob_bins else int(K_BINS)


@triton.jit
def _ordered_key(x):
    """int32 key of float32 ``x``, ordered (as signed integers) as the floats are."""
    i = x.to(tl.int32, bitcast=True)
    # negative floats: larger magnitude is smaller, so flip the magnitude bits
    return tl.where(i >= 0, i, i ^ 0x7FFFFFFF)


@triton.jit
def _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES: tl.constexpr, ROWS: tl.constexpr):
    """(output rows [ROWS], row mask, source rows, int64 source offsets, source mask)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = rows < B
    if HAS_INDICES:
        src = tl.load(idx_ptr + rows, mask=m_r, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    m_s = m_r & (src >= 0) & (src < n_src)
    # a source id outside [0, n_src) reads nothing: row 0's offsets (every load of it is masked by
    # m_s), and row 0 of the per-source parameter arrays
    src = tl.where(m_s, src, 0)
    return rows, m_r, src, src * stride_x, m_s


@triton.jit
def _gated_rows(B, n_src, idx_ptr, stride_x, gate_ptr, gate_min,
                HAS_INDICES: tl.constexpr, GATE: tl.constexpr, ROWS: tl.constexpr):
    """``_rows``, keeping with ``GATE`` only the rows whose ``gate[row] > gate_min``: the full-pass
    fallback of the compacted path runs for the rows that overflowed (``ncand > cap``, or a source
    row's flag ``> 0``); the others mask everything (no loads, no stores) and skip the tile loops."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    if GATE:
        m_r = m_r & (tl.load(gate_ptr + rows, mask=m_r, other=0) > gate_min)
        m_s = m_s & m_r
    return rows, m_r, src, row_off, m_s


@triton.jit
def _param(arr_ptr, val, rows, src, m_r, IS_ARR: tl.constexpr, BY_SOURCE: tl.constexpr):
    """[ROWS] of a per-row parameter array, or the scalar ``val`` broadcast."""
    if IS_ARR:
        at = src if BY_SOURCE else rows.to(tl.int64)
        return tl.load(arr_ptr + at, mask=m_r, other=0)
    else:
        return tl.zeros_like(rows).to(tl.float32) + val


@triton.jit
def _tile(x_ptr, row_off, m_s, t, V, BLOCK: tl.constexpr):
    """(column offsets [BLOCK], mask [ROWS, BLOCK], float32 values [ROWS, BLOCK], 0 where masked)."""
    return _tile_at(x_ptr, row_off, m_s, t * BLOCK + tl.arange(0, BLOCK), V)


@triton.jit
def _tile_at(x_ptr, row_off, m_s, offs, V):
    """``_tile`` at column offsets ``offs`` [BLOCK]."""
    m = m_s[:, None] & (offs < V)[None, :]
    # [ROWS, BLOCK]
    x = tl.load(x_ptr + row_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    return offs, m, x


@triton.jit
def _renorm_rows(rt_ptr, rinv_ptr, src, m_s, RENORMED: tl.constexpr):
    """(int32 key threshold, float32 1 / Z) [ROWS] of each source row's top-k renorm, as
    ``renorm_write_kernel`` with ``PARAMS_ONLY`` stores them (unused without ``RENORMED``)."""
    if RENORMED:
        t = tl.load(rt_ptr + src, mask=m_s, other=0)
        inv = tl.load(rinv_ptr + src, mask=m_s, other=0.0)
    else:
        t = tl.zeros_like(src).to(tl.int32)
        inv = tl.zeros_like(src).to(tl.float32)
    return t, inv


@triton.jit
def _renormed(x, t, inv, RENORMED: tl.constexpr):
    """With ``RENORMED``, ``x`` [ROWS, BLOCK] as ``renorm_write_kernel`` writes the top-k renorm (``x *
    inv`` where ``key >= t`` and ``x > 0``, else 0): the sampler then reads the renormalised rows
    without them being written (``top_k_first``)."""
    if RENORMED:
        x = tl.where((_ordered_key(x) >= t[:, None]) & (x > 0.0), x * inv[:, None], 0.0)
    return x


@triton.jit
def _suffix_sum(h, NB: tl.constexpr):
    """[ROWS, NB] -> [ROWS, NB]: the sum of each row's entries at or after each position (a reverse
    cumsum). Not ``tl.cumsum(reverse=True)``: its sm_90 lowering put ~2.3 KB a thread on the stack
    in the compaction's prologue (the layouts of 16-byte loads). Up to 16 bins (the top-p masses) a
    masked sum, a fixed order for floats; beyond (the top-k counts, integers) total - prefix."""
    if NB <= 16:
        b = tl.arange(0, NB)
        return tl.sum(tl.where(b[:, None] >= b[None, :], h[:, :, None], 0), axis=1)
    return tl.sum(h, axis=1)[:, None] - tl.cumsum(h, axis=1) + h


@triton.jit
def _prefix(state_ptr, part_ptr, rows, m_r, B, n_segs, seg, need,
            SLOT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, WRITE: tl.constexpr, ROWS: tl.constexpr,
            SEGS_P2: tl.constexpr):
    """int64 [ROWS]: a threshold after ``SLOT`` digits of ``BITS``: the prefix after ``SLOT - 1`` digits
    (``state[SLOT - 1]``, written by the previous launch) plus the largest digit ``b >= 1`` whose
    cumulative count / mass from the top, summed over the segments' partial histograms of pass
    ``SLOT - 1`` (``part[(SLOT - 1) % 2]``), reaches ``need``; ``b = 0`` (the prefix itself satisfies
    the predicate) otherwise. ``WRITE``: segment 0 stores the result as ``state[SLOT]`` for the next
    launch (each slot written by one launch and read by the next: no race)."""
    lo = tl.full([ROWS], _KEY_MIN, dtype=tl.int64)
    if SLOT >= 2:
        lo = tl.load(state_ptr + rows + B * (SLOT - 1), mask=m_r, other=0).to(tl.int64)
    if SLOT >= 1:
        b = tl.arange(0, NB)
        s = tl.arange(0, SEGS_P2)
        base = ((rows + B * ((SLOT - 1) % 2)).to(tl.int64) * n_segs)[:, None, None]
        m = m_r[:, None, None] & (s < n_segs)[None, :, None]
        # [ROWS, SEGS_P2, NB] -> [ROWS, NB]
        h = tl.sum(tl.load(part_ptr + (base + s[None, :, None]) * NB + b[None, None, :], mask=m, other=0), axis=1)
        cum = _suffix_sum(h, NB)
        digit = tl.max(tl.where((cum >= need[:, None]) & (b[None, :] >= 1), b[None, :], 0), axis=1)
        lo += digit.to(tl.int64) << (32 - SLOT * BITS)
        if WRITE:
            if seg == 0:
                tl.store(state_ptr + rows + B * SLOT, lo.to(tl.int32), mask=m_r)
    return lo


@triton.jit
def _digit(key, lo, SLOT: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr):
    """int32 digit ``SLOT`` of ``key`` under prefix ``lo``, clamped to [0, 2**BITS): keys below the
    prefix's range land in 0 (never counted: only digits >= 1 are tested), keys above it in the top
    bin (they count for every digit >= 1, as they must)."""
    d = (key.to(tl.int64) - lo[:, None]) >> (32 - (SLOT + 1) * BITS)
    return tl.minimum(tl.maximum(d, 0), NB - 1).to(tl.int32)


@triton.jit
def _thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                k_ptr, p_ptr, k_val, p_val,
                SLOT_K: tl.constexpr, SLOT_P: tl.constexpr, WRITE: tl.constexpr,
                USE_K: tl.constexpr, USE_P: tl.constexpr, K_ARR: tl.constexpr, P_ARR: tl.constexpr,
                BY_SOURCE: tl.constexpr, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    """(top-k prefix, top-p prefix) int64 [ROWS] after ``SLOT_K`` / ``SLOT_P`` digits."""
    lo_k = tl.full([ROWS], _KEY_MIN, dtype=tl.int64)
    lo_p = tl.full([ROWS], _KEY_MIN, dtype=tl.int64)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, BY_SOURCE).to(tl.int32)
        lo_k = _prefix(k_state, k_part, rows, m_r, B, n_segs, seg, tl.minimum(tl.maximum(k, 1), V),
                       SLOT_K, K_BITS, K_BINS, WRITE, ROWS, SEGS_P2)
    if USE_P:
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, BY_SOURCE).to(tl.float32)
        # top_p <= 0 keeps the largest entries only (greedy)
        lo_p = _prefix(p_state, p_part, rows, m_r, B, n_segs, seg, tl.maximum(p, 1e-30),
                       SLOT_P, P_BITS, P_BINS, WRITE, ROWS, SEGS_P2)
    return lo_k, lo_p


@triton.jit
def _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                      k_ptr, p_ptr, k_val, p_val,
                      USE_K: tl.constexpr, USE_P: tl.constexpr, K_ARR: tl.constexpr, P_ARR: tl.constexpr,
                      BY_SOURCE: tl.constexpr, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    """(T, L') int32 [ROWS]: kept entries are ``key >= T`` and ``key >= L'``; ``-2**31`` for a filter
    that is off (``k <= 0`` or ``k >= V``; ``top_p >= 1``)."""
    lo_k, lo_p = _thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                             k_ptr, p_ptr, k_val, p_val, K_PASSES, P_PASSES, False,
                             USE_K, USE_P, K_ARR, P_ARR, BY_SOURCE, ROWS, SEGS_P2)
    t = lo_k.to(tl.int32)
    lp = lo_p.to(tl.int32)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, BY_SOURCE).to(tl.int32)
        t = tl.where((k <= 0) | (k >= V), _KEY_MIN, t)
    if USE_P:
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, BY_SOURCE).to(tl.float32)
        lp = tl.where(p >= 1.0, _KEY_MIN, lp)
    return t, lp


@triton.jit
def radix_pass_kernel(
    x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, gate_ptr,
    k_val, p_val, B, n_src, V, stride_x, n_segs, gate_min,
    PASS: tl.constexpr, HAS_INDICES: tl.constexpr, GATE: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """Digit ``PASS`` of the top-k (``PASS < K_PASSES``) and top-p (``PASS < P_PASSES``) searches over
    one segment: resolves digit ``PASS - 1`` from the previous launch's partials, then writes this
    segment's histogram of digit ``PASS`` (counts for top-k, masses for top-p) to ``part[PASS % 2]``
    (``[2, B, n_segs, bins]``, double-buffered: the previous pass's stay readable)."""
    rows, m_r, src, row_off, m_s = _gated_rows(B, n_src, idx_ptr, stride_x, gate_ptr, gate_min, HAS_INDICES, GATE, ROWS)
    # a program with no row to search (gated off: its rows were compacted) stops before the prologue's
    # partial loads and scans, which made each gated-off launch ~8-9 µs at 64-256 rows of 128K
    if tl.max(m_r.to(tl.int32), axis=0) > 0:
        seg = tl.program_id(1)
        DO_K: tl.constexpr = USE_K and PASS < K_PASSES
        DO_P: tl.constexpr = USE_P and PASS < P_PASSES
        lo_k, lo_p = _thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                 k_ptr, p_ptr, k_val, p_val, PASS, PASS, True,
                                 DO_K, DO_P, K_ARR, P_ARR, PARAM_BY_SOURCE, ROWS, SEGS_P2)
        KB: tl.constexpr = K_BINS
        PB: tl.constexpr = P_BINS
        r = tl.arange(0, ROWS)
        bp = tl.arange(0, PB)
        count = tl.zeros([ROWS * KB], dtype=tl.int32)
        # per-lane masses, summed over the lanes once after the loop: a cross-thread reduction in
        # every tile made each program a chain of barriers
        mass_lanes = tl.zeros([ROWS, BLOCK, PB], dtype=tl.float32)
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
            bits = x.to(tl.int32, bitcast=True)
            key = tl.where(m, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), _KEY_MIN)
            if DO_K:
                # one histogram for all ROWS rows: bin = row * 256 + digit
                d = _digit(key, lo_k, PASS, K_BITS, KB) + (r * KB)[:, None]
                count += tl.histogram(tl.reshape(d, [ROWS * BLOCK]), ROWS * KB)
            if DO_P:
                # keys below the prefix's range land in digit 0, which is never tested
                d = _digit(key, lo_p, PASS, P_BITS, PB)
                mass_lanes += tl.where(d[:, :, None] == bp[None, None, :], x[:, :, None], 0.0)
        out_row = (rows + B * (PASS % 2)).to(tl.int64) * n_segs + seg
        if DO_K:
            tl.store(k_part + out_row[:, None] * KB + tl.arange(0, KB)[None, :], tl.reshape(count, [ROWS, KB]),
                     mask=m_r[:, None])
        if DO_P:
            # [ROWS, BLOCK, 16] -> [ROWS, 16]
            tl.store(p_part + out_row[:, None] * PB + bp[None, :], tl.sum(mass_lanes, axis=1), mask=m_r[:, None])


@triton.jit
def _row_max(max_part, rows, m_r, n_segs, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    s = tl.arange(0, SEGS_P2)
    v = tl.load(max_part + rows.to(tl.int64)[:, None] * n_segs + s[None, :],
                mask=m_r[:, None] & (s < n_segs)[None, :], other=float("-inf"))
    return tl.max(v, axis=1)


@triton.jit
def max_pass_kernel(
    x_ptr, idx_ptr, max_part, B, n_src, V, stride_x, n_segs,
    HAS_INDICES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``max_part[row, seg]``: the largest entry of the segment (-inf for none)."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    seg = tl.program_id(1)
    mx = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        mx = tl.maximum(mx, tl.where(m, x, float("-inf")))
    tl.store(max_part + rows.to(tl.int64) * n_segs + seg, tl.max(mx, axis=1), mask=m_r)


@triton.jit
def _kept(x, m, lo_k, lo_p, pivot, shift_max,
          IS_LOGITS: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr):
    """float32 [ROWS, BLOCK]: the sampling weight of each entry, 0 outside the kept set."""
    if IS_LOGITS:
        v = tl.where(m, tl.exp(x - shift_max[:, None]), 0.0)
    else:
        v = tl.where(m, x, 0.0)
    keep = v > 0.0
    if USE_K or USE_P:
        key = _ordered_key(x)
        if USE_K:
            keep = keep & (key >= lo_k[:, None])
        if USE_P:
            keep = keep & (key >= lo_p[:, None])
    if USE_MIN_P:
        keep = keep & (v >= pivot[:, None])
    return tl.where(keep, v, 0.0)


@triton.jit
def _sample_setup(x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, gate_ptr,
                  k_val, p_val, B, n_src, V, stride_x, n_segs, gate_min,
                  HAS_INDICES: tl.constexpr, GATE: tl.constexpr, IS_LOGITS: tl.constexpr,
                  USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
                  K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
                  PER_SOURCE: tl.constexpr, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    """What both sampling launches need: rows, thresholds, min-p pivot, softmax shift, and the rows
    of the search state, max and mass partials (``PER_SOURCE``: the source rows, ``n_src`` of them,
    where the passes ran once per source row; else the output rows)."""
    rows, m_r, src, row_off, m_s = _gated_rows(B, n_src, idx_ptr, stride_x, gate_ptr, gate_min, HAS_INDICES, GATE,
                                               ROWS)
    if PER_SOURCE:
        srow, m_st, b_st = src.to(tl.int32), m_s, n_src
    else:
        srow, m_st, b_st = rows, m_r, B
    seg = tl.program_id(1)
    pivot = tl.zeros([ROWS], dtype=tl.float32)
    shift_max = tl.zeros([ROWS], dtype=tl.float32)
    if IS_LOGITS or USE_MIN_P:
        mx = _row_max(max_part, srow, m_st, n_segs, ROWS, SEGS_P2)
        if IS_LOGITS:
            # an all -inf row keeps weight 0 everywhere instead of NaN
            shift_max = tl.where(mx == float("-inf"), 0.0, mx)
        if USE_MIN_P:
            pivot = tl.where(m_s, mx, 0.0) * _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
    lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, srow, m_st, src, b_st, V, n_segs, seg,
                                   k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, PARAM_BY_SOURCE,
                                   ROWS, SEGS_P2)
    return rows, m_r, row_off, m_s, seg, lo_k, lo_p, pivot, shift_max, srow, m_st


@triton.jit
def sample_mass_kernel(
    x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, z_part, gate_ptr,
    k_val, p_val, B, n_src, V, stride_x, n_segs, gate_min,
    HAS_INDICES: tl.constexpr, GATE: tl.constexpr, IS_LOGITS: tl.constexpr,
    USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``z_part[row, seg]``: the segment's kept mass (weights of probabilities, or of logits with
    ``IS_LOGITS``: softmax), restricted to the top-k (``USE_K``), top-p (``USE_P``, with ``USE_K``
    their intersection) or min-p (``USE_MIN_P``, its ``min_p`` in ``p_ptr``/``p_val``) set."""
    rows, m_r, row_off, m_s, seg, lo_k, lo_p, pivot, shift_max, _, _ = _sample_setup(
        x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, gate_ptr, k_val, p_val, B, n_src,
        V, stride_x, n_segs, gate_min, HAS_INDICES, GATE, IS_LOGITS, USE_K, USE_P, USE_MIN_P, K_ARR, P_ARR,
        PARAM_BY_SOURCE, False, ROWS, SEGS_P2)
    z = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    if tl.max(m_r.to(tl.int32), axis=0) > 0:
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
            z += _kept(x, m, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
    tl.store(z_part + rows.to(tl.int64) * n_segs + seg, tl.sum(z, axis=1), mask=m_r)


@triton.jit
def sample_row_kernel(
    x_ptr, idx_ptr, p_ptr, u_ptr, out_ptr, p_val, B, n_src, V, stride_x,
    HAS_INDICES: tl.constexpr, IS_LOGITS: tl.constexpr, USE_MIN_P: tl.constexpr, P_ARR: tl.constexpr,
    PARAM_BY_SOURCE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Plain sampling (of probabilities, or of logits with ``IS_LOGITS``: softmax weights) or min-p
    sampling (``USE_MIN_P``, its ``min_p`` in ``p_ptr``/``p_val``), one program a row holding the whole
    row (``BLOCK >= V``) as ``BLOCK // CHUNK`` chunks: one read, where the segmented passes read it
    twice (max, mass) plus the pick's segment. ``sample_pick_kernel``'s rule in index order: the chunk
    where the running kept mass first exceeds ``u * Z``, in it the first kept entry past that, else
    its last kept entry; no kept mass: entry 0."""
    NCH: tl.constexpr = BLOCK // CHUNK
    row = tl.program_id(0)
    if HAS_INDICES:
        src = tl.load(idx_ptr + row).to(tl.int64)
    else:
        src = row.to(tl.int64)
    # a source id outside [0, n_src) reads nothing: an all-zero row, sample 0
    ok = (src >= 0) & (src < n_src)
    src = tl.where(ok, src, 0)
    c = tl.arange(0, NCH)
    j = tl.arange(0, CHUNK)
    offs = c[:, None] * CHUNK + j[None, :]
    m = ok & (offs < V)
    x = tl.load(x_ptr + src * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if IS_LOGITS or USE_MIN_P:
        mx = tl.max(tl.max(tl.where(m, x, float("-inf")), axis=1), axis=0)
    if IS_LOGITS:
        # an all -inf row keeps weight 0 everywhere instead of NaN
        w = tl.where(m, tl.exp(x - tl.where(mx == float("-inf"), 0.0, mx)), 0.0)
    else:
        w = tl.where(m, x, 0.0)
    keep = w > 0.0
    if USE_MIN_P:
        if P_ARR:
            min_p = tl.load(p_ptr + (src if PARAM_BY_SOURCE else row.to(tl.int64))).to(tl.float32)
        else:
            min_p = p_val
        keep = keep & (w >= tl.where(ok, mx, 0.0) * min_p)
    w = tl.where(keep, w, 0.0)
    # [NCH]: the chunks' masses and running masses
    csum = tl.sum(w, axis=1)
    ccum = tl.cumsum(csum, axis=0)
    target = tl.load(u_ptr + row) * tl.sum(csum, axis=0)
    # a chunk without mass is never the hit (the GPU's scan is not monotonic over zeros)
    hit_c = tl.min(tl.where((ccum > target) & (csum > 0.0), c, NCH), axis=0)
    last_c = tl.max(tl.where(csum > 0.0, c, -1), axis=0)
    own = tl.where(hit_c < NCH, hit_c, tl.maximum(last_c, 0))
    before = tl.sum(tl.where(c == own, ccum - csum, 0.0), axis=0)
    # [CHUNK]: the owner chunk's weights, then its running mass past the target
    wc = tl.sum(tl.where(c[:, None] == own, w, 0.0), axis=0)
    cum = tl.cumsum(wc, axis=0) + (before - target)
    hit = tl.min(tl.where((cum > 0.0) & (wc > 0.0), j, CHUNK), axis=0)
    last = tl.max(tl.where(wc > 0.0, j, -1), axis=0)
    pos = tl.where(hit < CHUNK, hit, tl.maximum(last, 0))
    tl.store(out_ptr + row, tl.where(last_c >= 0, own * CHUNK + pos, 0))


@triton.jit
def _own_tile(x_ptr, row_off, m_own, own, t, NUM_TILES: tl.constexpr, V, BLOCK: tl.constexpr):
    """Tile ``t`` of each row's owner segment ``own``: (float32 values [ROWS, BLOCK], mask), masked
    past the segment and the row."""
    offs = (own * NUM_TILES + t)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (m_own & (t < NUM_TILES))[:, None] & (offs < V)
    return tl.load(x_ptr + row_off[:, None] + offs, mask=m, other=0.0).to(tl.float32), m


@triton.jit
def sample_pick_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, z_part, gate_ptr,
    k_val, p_val, B, n_src, V, stride_x, n_segs, gate_min,
    HAS_INDICES: tl.constexpr, GATE: tl.constexpr, IS_LOGITS: tl.constexpr,
    USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr, PER_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
    TILES_P2: tl.constexpr,
):
    """``out[i]`` (int32): the kept entry where the running kept mass first exceeds ``u[i] * Z``, in
    segment order and, within a segment, lane-major order (lane ``i % BLOCK`` of the segment's tiles,
    then tile; the compaction's order, so both paths pick the same entry; any fixed order samples the
    same distribution). Grid ``(row blocks, 1)``: each program finds its rows' owner segments from
    ``z_part`` (the first with mass whose running total exceeds ``u * Z``; when rounding leaves none, the last
    with mass; with no mass at all, segment 0, whose entry 0 is written), then per lane the kept mass
    of the segment (one read, no cross-lane work a tile), the lane by one scan, and the tile by one
    gather of that lane's entries. ``PER_SOURCE``: the state and ``z_part`` are per source row."""
    rows, m_r, row_off, m_s, _, lo_k, lo_p, pivot, shift_max, srow, m_st = _sample_setup(
        x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, gate_ptr, k_val, p_val, B, n_src,
        V, stride_x, n_segs, gate_min, HAS_INDICES, GATE, IS_LOGITS, USE_K, USE_P, USE_MIN_P, K_ARR, P_ARR,
        PARAM_BY_SOURCE, PER_SOURCE, ROWS, SEGS_P2)
    s = tl.arange(0, SEGS_P2)
    # [ROWS, SEGS_P2]
    zs = tl.load(z_part + srow.to(tl.int64)[:, None] * n_segs + s[None, :],
                 mask=m_st[:, None] & (s < n_segs)[None, :], other=0.0)
    cum = tl.cumsum(zs, axis=1)
    target = tl.load(u_ptr + rows, mask=m_r, other=0.0) * tl.sum(zs, axis=1)
    # a segment without mass is never the hit: the GPU's parallel scan is not monotonic over zeros (a
    # zero segment's running total can round above its predecessor's), which picked unkept entries
    hit_seg = tl.min(tl.where((cum > target[:, None]) & (zs > 0.0), s[None, :], SEGS_P2), axis=1)
    last_seg = tl.max(tl.where(zs > 0.0, s[None, :], 0), axis=1)
    own = tl.where(hit_seg < SEGS_P2, hit_seg, last_seg)
    mine = m_r
    run = tl.sum(tl.where(s[None, :] < own[:, None], zs, 0.0), axis=1)
    lanes = tl.arange(0, BLOCK)
    m_own = m_s & mine
    # [ROWS, BLOCK]: each lane's kept mass in the owner segment
    lane_w = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    if tl.max(mine.to(tl.int32), axis=0) > 0:  # gated-off rows (compacted ones): nothing to read
        # four tiles a step, loaded before they are used (tiles past the segment masked)
        for t in range(0, NUM_TILES, 4):
            x0, m0 = _own_tile(x_ptr, row_off, m_own, own, t, NUM_TILES, V, BLOCK)
            x1, m1 = _own_tile(x_ptr, row_off, m_own, own, t + 1, NUM_TILES, V, BLOCK)
            x2, m2 = _own_tile(x_ptr, row_off, m_own, own, t + 2, NUM_TILES, V, BLOCK)
            x3, m3 = _own_tile(x_ptr, row_off, m_own, own, t + 3, NUM_TILES, V, BLOCK)
            lane_w += (_kept(x0, m0, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
                       + _kept(x1, m1, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
                       + _kept(x2, m2, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
                       + _kept(x3, m3, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P))
    # the running mass less u * Z (> 0: past the target); `cum > target[:, None]` made the 19.5 us
    # pick of one row on the H200 (_row_column)
    cum = tl.cumsum(lane_w, axis=1) + _row_column(run - target, ROWS)
    hit_lane = tl.min(tl.where((cum > 0.0) & (lane_w > 0.0), lanes[None, :], BLOCK), axis=1)
    last_lane = tl.max(tl.where(lane_w > 0.0, lanes[None, :], -1), axis=1)
    # no hit: rounding put u * Z at or past the running total (the last lane with mass); no kept mass
    # at all: lane 0, tile 0 of segment 0, entry 0
    lane = tl.where(hit_lane < BLOCK, hit_lane, tl.maximum(last_lane, 0))
    before = tl.sum(tl.where(lanes[None, :] == lane[:, None], cum - lane_w, 0.0), axis=1)
    # [ROWS, TILES_P2]: the lane's entries, one a tile
    tiles = tl.arange(0, TILES_P2)
    col = (own[:, None] * NUM_TILES + tiles[None, :]) * BLOCK + lane[:, None]
    m_col = m_own[:, None] & (tiles < NUM_TILES)[None, :] & (col < V)
    x_col = tl.load(x_ptr + row_off[:, None] + col, mask=m_col, other=0.0).to(tl.float32)
    w_col = _kept(x_col, m_col, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
    hit = ((tl.cumsum(w_col, axis=1) + before[:, None]) > 0.0) & (w_col > 0.0)
    first_t = tl.min(tl.where(hit, tiles[None, :], TILES_P2), axis=1)
    last_t = tl.max(tl.where(w_col > 0.0, tiles[None, :], -1), axis=1)
    tile = tl.where(first_t < TILES_P2, first_t, tl.maximum(last_t, 0))
    sample = (own * NUM_TILES + tile) * BLOCK + lane
    tl.store(out_ptr + rows, sample, mask=mine)


@triton.jit
def renorm_mass_kernel(
    x_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, z_part, gate_ptr,
    k_val, p_val, B, V, stride_x, n_segs, gate_min,
    GATE: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr, K_ARR: tl.constexpr, P_ARR: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``z_part[row, seg]``: the segment's kept positive mass (the renorm's denominator, in parts)."""
    rows, m_r, src, row_off, m_s = _gated_rows(B, B, x_ptr, stride_x, gate_ptr, gate_min, False, GATE, ROWS)
    if tl.max(m_r.to(tl.int32), axis=0) > 0:  # gated off: no prologue (radix_pass_kernel)
        seg = tl.program_id(1)
        lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                       k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, True, ROWS, SEGS_P2)
        z = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
            key = _ordered_key(x)
            keep = (key >= lo_k[:, None]) & (key >= lo_p[:, None]) & (x > 0.0)
            z += tl.where(keep, x, 0.0)
        tl.store(z_part + rows.to(tl.int64) * n_segs + seg, tl.sum(z, axis=1), mask=m_r)


@triton.jit
def renorm_write_kernel(
    x_ptr, out_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, z_part, gate_ptr,
    fin_t_ptr, fin_p_ptr, fin_inv_ptr, rt_ptr, rinv_ptr,
    k_val, p_val, B, V, stride_x, stride_o, n_segs, gate_min,
    FIN: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr, MASK_LOGITS: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAMS_ONLY: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """float32 rows of ``out``, one segment a program: the top-k (``USE_K``) or top-p (``USE_P``)
    entries of ``x`` over their sum (floored at 1e-8; ``z_part`` from ``renorm_mass_kernel``), 0
    elsewhere; with ``MASK_LOGITS`` the top-k logits themselves, ``-inf`` elsewhere. A row with
    ``k <= 0`` or ``k >= V`` is copied unchanged; ``top_p >= 1`` divides the row by its sum. With
    ``FIN``, rows that did not overflow (``gate[row] <= gate_min``) take their thresholds and ``1 / Z``
    from ``fin_*`` (``compact_finish_kernel``'s). ``PARAMS_ONLY`` (top-k of probabilities, grid
    ``(row blocks, 1)``): no row is written; ``rt``/``rinv`` [B] get each row's threshold key and ``1 / Z``
    (``-2**31`` and 1 for a row without filter), what ``_renormed`` applies on load."""
    rows, m_r, src, row_off, m_s = _gated_rows(B, B, x_ptr, stride_x, gate_ptr, gate_min, False, False, ROWS)
    seg = tl.program_id(1)
    out_off = rows.to(tl.int64) * stride_o
    lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                   k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, True, ROWS, SEGS_P2)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, True).to(tl.int32)
        no_filter = (k <= 0) | (k >= V)
    else:
        no_filter = rows < 0
    inv = tl.full([ROWS], 1.0, tl.float32)  # the mask has no denominator
    if not MASK_LOGITS:
        inv = 1.0 / tl.maximum(_row_sum(z_part, rows, m_r, n_segs, ROWS, SEGS_P2), 1e-8)
    if FIN:
        compacted = m_r & (tl.load(gate_ptr + rows, mask=m_r, other=0) <= gate_min)
        lo_k = tl.where(compacted, tl.load(fin_t_ptr + rows, mask=compacted, other=0), lo_k)
        lo_p = tl.where(compacted, tl.load(fin_p_ptr + rows, mask=compacted, other=0), lo_p)
        if not MASK_LOGITS:
            inv = tl.where(compacted, tl.load(fin_inv_ptr + rows, mask=compacted, other=0.0), inv)
    if PARAMS_ONLY:
        tl.store(rt_ptr + rows, tl.where(no_filter, _KEY_MIN, lo_k), mask=m_r)
        tl.store(rinv_ptr + rows, tl.where(no_filter, 1.0, inv), mask=m_r)
    elif tl.max(m_r.to(tl.int32), axis=0) > 0:
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
            key = _ordered_key(x)
            keep = (key >= lo_k[:, None]) & (key >= lo_p[:, None])
            y = _renorm_out(x, keep, no_filter[:, None], inv[:, None], MASK_LOGITS)
            tl.store(out_ptr + out_off[:, None] + offs[None, :], y, mask=m)


@triton.jit
def _renorm_out(x, keep, no_filter, inv, MASK_LOGITS: tl.constexpr):
    """What a renorm writes for entries ``x`` with their ``keep`` mask: ``x * inv`` (kept, positive)
    or 0; with ``MASK_LOGITS``, ``x`` or ``-inf``. A row without filter (``no_filter``) keeps ``x``."""
    if MASK_LOGITS:
        return tl.where(keep | no_filter, x, float("-inf"))
    return tl.where(no_filter, x, tl.where(keep & (x > 0.0), x * inv, 0.0))


@triton.jit
def _row_total(v):
    """The sum of a whole row held as [chunks, CHUNK]: over the chunks first (within each thread),
    then across the lanes (one cross-warp step; the other order reduces every chunk across warps)."""
    return tl.sum(tl.sum(v, axis=0), axis=0)


@triton.jit
def top_k_row_kernel(
    x_ptr, out_ptr, k_ptr, rt_ptr, rinv_ptr, k_val, B, V, stride_x, stride_o,
    K_ARR: tl.constexpr, MASK_LOGITS: tl.constexpr, PARAMS_ONLY: tl.constexpr, BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """``renorm_write_kernel``'s top-k outputs (the renorm, ``MASK_LOGITS``'s mask, or ``PARAMS_ONLY``'s
    ``rt``/``rinv``) of one row a program holding the whole row (``BLOCK >= V``) as ``BLOCK // CHUNK``
    chunks: one read and one write. The threshold, the largest key ``T`` with ``count(key >= T) >= k``
    (the k-th largest, as the radix searches find it), is built bit by bit from the top, one count of
    the row a bit."""
    NCH: tl.constexpr = BLOCK // CHUNK
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NCH)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    m = offs < V
    # the row is held as keys only (64 registers a thread at 16 warps for 32K entries); the values
    # come back from them (the key map is its own inverse) for the write
    key = tl.where(m, _ordered_key(tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)),
                   _KEY_MIN)
    if K_ARR:
        k = tl.load(k_ptr + row).to(tl.int32)
    else:
        k = k_val
    no_filter = (k <= 0) | (k >= V)
    need = tl.minimum(tl.maximum(k, 1), V)
    # the top bit (0 or KEY_MIN), then lo + 2**b, within int32; masked lanes (KEY_MIN) never count
    lo = tl.where(_row_total((key >= 0).to(tl.int32)) >= need, 0, _KEY_MIN)
    for b in tl.static_range(30, -1, -1):
        cand = lo + (1 << b)
        count = _row_total((key >= cand).to(tl.int32))
        lo = tl.where(count >= need, cand, lo)
    t = tl.where(no_filter, _KEY_MIN, lo)
    kept = key >= t
    x = _ordered_key(key).to(tl.float32, bitcast=True)
    inv = 1.0  # the mask has no denominator
    if not MASK_LOGITS:
        inv = 1.0 / tl.maximum(_row_total(tl.where(kept & (x > 0.0), x, 0.0)), 1e-8)
    if PARAMS_ONLY:
        tl.store(rt_ptr + row, t)
        tl.store(rinv_ptr + row, tl.where(no_filter, 1.0, inv))
    else:
        tl.store(out_ptr + row * stride_o + offs, _renorm_out(x, kept, no_filter, inv, MASK_LOGITS), mask=m)


# --------------------------------------------------------------------------------------------------
# compaction: a row's candidates into [B, cap], the searches and the sample finished there
# --------------------------------------------------------------------------------------------------
#
# ``bound_pass_kernel`` (one read) counts each segment's keys in 64 (probabilities) or 256 bins and sums the positive
# entries (top-p). From those every program of ``compact_kernel`` derives the
# same bound bin ``bb`` per row: every entry the filters can keep has ``key >= lo(bb)`` (below), so the
# candidates are whole bins and their number, and each segment's write offset, follow exactly from
# the counts. Rows with more than ``cap`` candidates are left to the full passes (``ncand > cap``);
# the rest are copied, values and ids, in vocabulary order (so the inverse-CDF scan meets them in
# the order the full pass would), and ``compact_finish_kernel`` finishes them in one program a row.
#
# Why the searches on the candidates give the full row's thresholds. Each threshold is the largest
# key L with f(key >= L) >= need for a count or a positive mass f. Let every kept entry have
# key >= bound. On the candidates f_c(key >= L) = f(key >= L) for L >= bound, and f_c(key >= L) =
# f(key >= bound) for L < bound. A threshold X >= bound is therefore found unchanged; one below the
# bound has f(key >= bound) < need, so f_c never reaches need and the search returns KEY_MIN, which
# is still below the other thresholds where it matters (kept = key >= max(thresholds), and a valid
# bound is <= max(thresholds)). The bounds, each a bin start:
# The bins (``_bound_bin``), each a contiguous key range [lo(b), lo(b + 1)), increasing with b:
# - any floats (logits): the keys' top 8 bits, bin b holding [KEY_MIN + b * 2**24, KEY_MIN + (b + 1) *
#   2**24): two binary exponents a bin (a factor 4 in value), half of the bins for negative floats;
# - probabilities (``PROB_BINS``): bin b >= 1 holds the keys whose top 10 bits (sign, exponent, 1
#   mantissa bit) are b + PROB_BIN_BASE, a factor 4/3 or 3/2 in value, from 1.5 * 2**-32 up to 0.75
#   (bin 63: 0.75 and above, negative and smaller values in bin 0). A flat row's top-p 0.9 set
#   (softmax(randn * 3) over 128K: ~6K entries) then has ~7.9K candidates (~5.8K with 256 bins of
#   2**(1/8), ~20K with the float binning); top-k 50 ~60 (54). (Min-p takes the full passes: its
#   pivot needs the row max only.)
# - top-k (k-th largest T): the largest bin b >= 1 whose keys and those above number >= k (the first
#   radix digit): count(key >= lo(b)) >= k gives T >= lo(b).
# - top-p (L': the smallest kept key; kept j when mass of the entries above p_j < top_p): with Z the
#   positive mass and U_c = sum over bins <= c of count_c * hi_c (hi_c the bin's upper value, 0 for
#   the negative bins of the float binning, infinite for the open top bin), an entry of bin c has at most U_c of positive mass at or below it, so at least
#   Z - U_c above it; a bin with Z - U_c >= top_p (1e-4 relative margins for float32 sums, far above
#   their ~1e-6 error, so the full pass's own float sums agree) holds no kept entry, and U_c grows with
#   c, so the excluded bins are a prefix: bb = one past the last. top_p <= 0 counts as 1e-30.
# - joint (key >= max(T, L')): max of the two bounds (each <= its threshold, so the max is <= the
#   max of the thresholds).
# A filter that is off for a row (k <= 0 or >= V, top_p >= 1) contributes bin 0 (everything).


@triton.jit
def bound_pass_kernel(
    x_ptr, idx_ptr, cnt_part, sum_part, rt_ptr, rinv_ptr, B, n_src, V, stride_x, n_segs,
    HAS_INDICES: tl.constexpr, NEED_SUM: tl.constexpr, PROB_BINS: tl.constexpr,
    RENORMED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """Per (row, segment): ``cnt_part[row, seg, bound_bins(PROB_BINS)]`` the keys' histogram over ``_bound_bin``'s
    bins (masked lanes in bin 0), ``sum_part[row, seg]`` the positive mass (``NEED_SUM``). ``RENORMED``: of the
    rows top-k renormalised on load."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    rt, rinv = _renorm_rows(rt_ptr, rinv_ptr, src, m_s, RENORMED)
    seg = tl.program_id(1)
    KB: tl.constexpr = PROB_BOUND_BINS if PROB_BINS else K_BINS
    r = tl.arange(0, ROWS)
    count = tl.zeros([ROWS * KB], dtype=tl.int32)
    z = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        x = _renormed(x, rt, rinv, RENORMED)
        key = tl.where(m, _ordered_key(x), _KEY_MIN)
        count += tl.histogram(tl.reshape(_bound_bin(key, PROB_BINS) + (r * KB)[:, None], [ROWS * BLOCK]), ROWS * KB)
        if NEED_SUM:
            z += tl.where(x > 0.0, x, 0.0)
    out = rows.to(tl.int64) * n_segs + seg
    tl.store(cnt_part + out[:, None] * KB + tl.arange(0, KB)[None, :], tl.reshape(count, [ROWS, KB]),
             mask=m_r[:, None])
    if NEED_SUM:
        tl.store(sum_part + out, tl.sum(z, axis=1), mask=m_r)


@triton.jit
def _bound_bin(key, PROB_BINS: tl.constexpr):
    """The bound pass's bin of int32 ``key``s: the probability binning (0 to ``PROB_BOUND_BINS - 1``)
    or the float binning (0-255)."""
    if PROB_BINS:
        return tl.minimum(tl.maximum((key >> PROB_BIN_SHIFT) - PROB_BIN_BASE, 0), PROB_BOUND_BINS - 1)
    return (key >> 24) + 128


@triton.jit
def _bin_lo(b, PROB_BINS: tl.constexpr):
    """int64 smallest key of bin ``b`` (KEY_MIN for bin 0)."""
    b = b.to(tl.int64)
    if PROB_BINS:
        return tl.where(b == 0, _KEY_MIN, (b + PROB_BIN_BASE) << PROB_BIN_SHIFT)
    return (b << 24) + _KEY_MIN  # tensor first: the interpreter keeps constexpr + tensor a constexpr


@triton.jit
def _candidates(cnt_part, sum_part, k_ptr, p_ptr, k_val, p_val, rows, m_r, src, m_s, V, n_segs, seg,
                SEG_LEN: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr,
                K_ARR: tl.constexpr, P_ARR: tl.constexpr, BY_SOURCE: tl.constexpr, PROB_BINS: tl.constexpr,
                ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    """(int64 key bound [ROWS], candidates of the row (``key >= bound``), candidates in the segments
    before ``seg``): the bound bin of the comment above, from ``bound_pass_kernel``'s partials."""
    KB: tl.constexpr = PROB_BOUND_BINS if PROB_BINS else K_BINS
    b = tl.arange(0, KB)
    s = tl.arange(0, SEGS_P2)
    m_seg = m_r[:, None] & (s < n_segs)[None, :]
    base = (rows.to(tl.int64) * n_segs)[:, None] + s[None, :]
    # [ROWS, SEGS_P2, KB] -> [ROWS, KB]
    h = tl.load(cnt_part + base[:, :, None] * KB + b[None, None, :], mask=m_seg[:, :, None], other=0)
    hs = tl.sum(h, axis=1)
    bk = tl.zeros([ROWS], dtype=tl.int32)
    bp = tl.zeros([ROWS], dtype=tl.int32)
    k_off = rows < 0
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, BY_SOURCE).to(tl.int32)
        k_off = (k <= 0) | (k >= V)
        need = tl.minimum(tl.maximum(k, 1), V)
        cum = _suffix_sum(hs, KB)
        bk = tl.max(tl.where((cum >= need[:, None]) & (b[None, :] >= 1), b[None, :], 0), axis=1)
        bk = tl.where(k_off, 0, bk)
    if USE_P:
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, BY_SOURCE).to(tl.float32)
        zs = tl.sum(tl.load(sum_part + base, mask=m_seg, other=0.0), axis=1)
        if PROB_BINS:
            # upper value of a bin below the top one: the next bin's smallest float (bin 0's positive
            # values are below bin 1's); the open top bin costs inf when not empty
            hi = tl.where(b >= KB - 1, 0.0, ((b + PROB_BIN_BASE + 1) << PROB_BIN_SHIFT).to(tl.float32, bitcast=True))
            cost = hs.to(tl.float32) * hi[None, :]
        else:
            # upper value of bin c >= 128 (non-negative floats): the float whose bits are (c - 127) << 24
            # (the top bin, floats >= 2**127 and inf, costs inf when not empty)
            hi = tl.where(b >= KB - 1, 0.0, (tl.maximum(b - 127, 1) << 24).to(tl.float32, bitcast=True))
            cost = tl.where(b[None, :] >= 128, hs.to(tl.float32) * hi[None, :], 0.0)
        cost = tl.where((b[None, :] >= KB - 1) & (hs > 0), float("inf"), cost)
        u = tl.cumsum(cost, axis=1)
        excl = zs[:, None] * (1.0 - 1e-4) - u * (1.0 + 1e-4) >= tl.maximum(p, 1e-30)[:, None]
        bp = tl.max(tl.where(excl, b[None, :] + 1, 0), axis=1)
        bp = tl.where(p >= 1.0, 0, bp)
    bb = tl.maximum(bk, bp)
    # per segment: [ROWS, SEGS_P2]
    cs = tl.sum(tl.where(b[None, None, :] >= bb[:, None, None], h, 0), axis=2)
    count = tl.sum(cs, axis=1)
    before = tl.sum(tl.where(s[None, :] < seg, cs, 0), axis=1)
    # bin 0 also holds the masked lanes past the row's end: every entry is a candidate
    whole = bb == 0
    count = tl.where(whole, tl.where(m_s, V, 0), count)
    before = tl.where(whole, seg * SEG_LEN, before)
    return _bin_lo(bb, PROB_BINS), count, before


@triton.jit
def _is_candidate(x, m, lo_col):
    # lo_col: the bound key as a [ROWS, 1] int32 column, or a scalar (_row_column)
    return m & (_ordered_key(x) >= lo_col)


@triton.jit
def _row_column(v, ROWS: tl.constexpr):
    """A per-row value [ROWS] to compare or add across a [ROWS, BLOCK] tile: a scalar for one row a
    program (the GPU's tiles). As a [ROWS, 1] column Triton broadcast some of these to [ROWS, BLOCK]
    in another layout and converted the tile through shared memory (sm_90 SASS: 1,042 stores a
    thread in the one-row pick at BLOCK 4096, 560 in the top-p compaction)."""
    if ROWS == 1:
        return tl.sum(v, axis=0)
    else:
        return v[:, None]


@triton.jit
def _scatter_tile(x_ptr, row_off, m_s, t, V, BLOCK: tl.constexpr, OPAQUE: tl.constexpr):
    """``_tile`` for a loop that scatters what it loads (``_put_candidates``). ``OPAQUE`` (the GPU; the
    interpreter has no inline PTX): the offsets pass through a ``mov`` the compiler cannot see
    through, so the loads take the one-element-a-thread layout Triton gives the scattered stores.
    With the offsets' contiguity the loads were 16 bytes wide and every store converted the tile,
    its pointers and its mask through shared memory (sm_90 SASS of the top-k compaction: 16 of its
    42 barriers, 100 registers; with this 64)."""
    offs = t * BLOCK + tl.arange(0, BLOCK)
    if OPAQUE:
        offs = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [offs], dtype=tl.int32, is_pure=True, pack=1)
    return _tile_at(x_ptr, row_off, m_s, offs, V)


@triton.jit
def _put_candidates(cval_row, cid_row, at, cap, x, c, offs):
    """Stores a tile's candidates (``c``) at each lane's next slot ``at`` (int32, within the row's
    ``cap`` slots at ``cval_row``/``cid_row``); returns the slots after them. The slots come from the
    bound pass's counts and this pass's, which agree; a slot at or past ``cap`` is still never
    written. A tile without candidates costs its lanes' predicated-off stores only (a block-wide
    test for any candidate first cost a reduction and two barriers a tile)."""
    keep = c & (at < cap)
    tl.store(cval_row + at, x, mask=keep)
    tl.store(cid_row + at, tl.zeros_like(at) + offs[None, :], mask=keep)
    return at + c.to(tl.int32)


@triton.jit
def compact_kernel(
    x_ptr, idx_ptr, k_ptr, p_ptr, cnt_part, sum_part, ncand_ptr, cval_ptr, cid_ptr, rt_ptr, rinv_ptr,
    k_val, p_val, B, n_src, V, stride_x, n_segs, cap,
    HAS_INDICES: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr, K_ARR: tl.constexpr,
    P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr, PROB_BINS: tl.constexpr, RENORMED: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
    OPAQUE: tl.constexpr,
):
    """Copies the segment's candidates (``key >= bound``) of rows with at most ``cap`` of them to
    ``cval``/``cid`` ``[B, cap]`` (values, token ids) from the row's position for the segment on,
    in the segment's lane-major order (lane ``i % BLOCK`` of its tiles, then tile: the full pick's
    order, ``sample_pick_kernel``); segment 0 stores ``ncand[row]`` (``> cap``: the row overflowed).
    Two reads of the segment: per-lane counts, one scan over the lanes,
    then each lane writes at its own offset, with no scan a tile (a loop-carried scan a tile cost
    100-290 µs at 64-256 rows of 128K on the H200). ``RENORMED``: the rows top-k renormalised on load
    (the copy holds the renormalised values)."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    rt, rinv = _renorm_rows(rt_ptr, rinv_ptr, src, m_s, RENORMED)
    seg = tl.program_id(1)
    lo, count, pos = _candidates(cnt_part, sum_part, k_ptr, p_ptr, k_val, p_val, rows, m_r, src, m_s,
                                 V, n_segs, seg, NUM_TILES * BLOCK, USE_K, USE_P,
                                 K_ARR, P_ARR, PARAM_BY_SOURCE, PROB_BINS, ROWS, SEGS_P2)
    if seg == 0:
        tl.store(ncand_ptr + rows, count, mask=m_r)
    fits = m_s & (count <= cap)
    # [ROWS, 1] the row's copy; slots within it stay int32 (int64 slots for 4 x BLOCK lanes cost 32
    # registers a thread: the kernel spilled at 255 with Triton's pointer and length specialisations)
    c_row = _row_column(rows.to(tl.int64) * cap, ROWS)
    cval_row = cval_ptr + c_row
    cid_row = cid_ptr + c_row
    if tl.max(fits.to(tl.int32), axis=0) > 0:
        # four tiles a step, loaded before they are used (tiles past the segment masked)
        # lo is a key (int32 range) kept in int64 by the bound's arithmetic: compared in 32 bits
        lo_col = _row_column(lo.to(tl.int32), ROWS)
        cnt = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        for t in range(0, NUM_TILES, 4):
            o0, m0, x0 = _tile(x_ptr, row_off, fits, seg * NUM_TILES + t, V, BLOCK)
            o1, m1, x1 = _tile(x_ptr, row_off, fits & (t + 1 < NUM_TILES), seg * NUM_TILES + t + 1, V, BLOCK)
            o2, m2, x2 = _tile(x_ptr, row_off, fits & (t + 2 < NUM_TILES), seg * NUM_TILES + t + 2, V, BLOCK)
            o3, m3, x3 = _tile(x_ptr, row_off, fits & (t + 3 < NUM_TILES), seg * NUM_TILES + t + 3, V, BLOCK)
            x0, x1 = _renormed(x0, rt, rinv, RENORMED), _renormed(x1, rt, rinv, RENORMED)
            x2, x3 = _renormed(x2, rt, rinv, RENORMED), _renormed(x3, rt, rinv, RENORMED)
            cnt += (_is_candidate(x0, m0, lo_col).to(tl.int32) + _is_candidate(x1, m1, lo_col).to(tl.int32)
                    + _is_candidate(x2, m2, lo_col).to(tl.int32) + _is_candidate(x3, m3, lo_col).to(tl.int32))
        # [ROWS, BLOCK]: each lane's next slot in its row's copy
        at = (_row_column(pos, ROWS) + tl.cumsum(cnt, axis=1) - cnt).to(tl.int32)
        for t in range(0, NUM_TILES, 4):
            o0, m0, x0 = _scatter_tile(x_ptr, row_off, fits, seg * NUM_TILES + t, V, BLOCK, OPAQUE)
            o1, m1, x1 = _scatter_tile(x_ptr, row_off, fits & (t + 1 < NUM_TILES), seg * NUM_TILES + t + 1, V, BLOCK,
                                       OPAQUE)
            o2, m2, x2 = _scatter_tile(x_ptr, row_off, fits & (t + 2 < NUM_TILES), seg * NUM_TILES + t + 2, V, BLOCK,
                                       OPAQUE)
            o3, m3, x3 = _scatter_tile(x_ptr, row_off, fits & (t + 3 < NUM_TILES), seg * NUM_TILES + t + 3, V, BLOCK,
                                       OPAQUE)
            x0, x1 = _renormed(x0, rt, rinv, RENORMED), _renormed(x1, rt, rinv, RENORMED)
            x2, x3 = _renormed(x2, rt, rinv, RENORMED), _renormed(x3, rt, rinv, RENORMED)
            at = _put_candidates(cval_row, cid_row, at, cap, x0, _is_candidate(x0, m0, lo_col), o0)
            at = _put_candidates(cval_row, cid_row, at, cap, x1, _is_candidate(x1, m1, lo_col), o1)
            at = _put_candidates(cval_row, cid_row, at, cap, x2, _is_candidate(x2, m2, lo_col), o2)
            at = _put_candidates(cval_row, cid_row, at, cap, x3, _is_candidate(x3, m3, lo_col), o3)


@triton.jit
def _cload(cval_ptr, c_row, n, c, CBLOCK: tl.constexpr):
    """Chunk ``c`` of the compacted rows: (positions [CBLOCK], mask [ROWS, CBLOCK], values)."""
    j = c * CBLOCK + tl.arange(0, CBLOCK)
    m = j[None, :] < n[:, None]
    x = tl.load(cval_ptr + c_row[:, None] + j[None, :], mask=m, other=0.0)
    return j, m, x


@triton.jit
def compact_finish_kernel(
    idx_ptr, u_ptr, out_ptr, k_ptr, p_ptr, ncand_ptr, cval_ptr, cid_ptr, fin_t_ptr, fin_p_ptr, fin_inv_ptr,
    k_val, p_val, B, n_src, V, cap,
    HAS_INDICES: tl.constexpr, RENORM: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr, ROWS: tl.constexpr,
    CBLOCK: tl.constexpr,
):
    """The rows with ``ncand <= cap``, one program for ``ROWS`` rows over their compacted candidates:
    the top-k threshold (8-bit digits, 4 rounds), the top-p threshold (4-bit digits, 8 rounds), the
    same searches as the full passes; then, with
    ``RENORM``, ``fin_t``/``fin_p``/``fin_inv`` (thresholds and ``1 / max(Z, 1e-8)``) for
    ``renorm_write_kernel``, else the inverse-CDF sample of ``u`` into ``out`` (``sample_pick_kernel``'s
    rule, in the copy's order, which is the pick's: the first kept candidate whose running mass
    exceeds ``u * Z``, else the last kept, else entry 0)."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, 0, HAS_INDICES, ROWS)
    n = tl.load(ncand_ptr + rows, mask=m_r, other=0)
    act = m_r & (n <= cap)
    n = tl.where(act, n, 0)
    n_chunks = (tl.max(n, axis=0) + CBLOCK - 1) // CBLOCK
    c_row = rows.to(tl.int64) * cap
    r = tl.arange(0, ROWS)
    KB: tl.constexpr = K_BINS
    PB: tl.constexpr = P_BINS
    bk = tl.arange(0, KB)
    bp = tl.arange(0, PB)
    t = tl.full([ROWS], _KEY_MIN, dtype=tl.int32)
    lp = tl.full([ROWS], _KEY_MIN, dtype=tl.int32)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, PARAM_BY_SOURCE).to(tl.int32)
        k_off = (k <= 0) | (k >= V)
        need_k = tl.minimum(tl.maximum(k, 1), V)
        lo = tl.full([ROWS], _KEY_MIN, dtype=tl.int64)
        for slot in tl.static_range(K_PASSES):
            count = tl.zeros([ROWS * KB], dtype=tl.int32)
            for c in range(n_chunks):
                j, m, x = _cload(cval_ptr, c_row, n, c, CBLOCK)
                key = tl.where(m, _ordered_key(x), _KEY_MIN)
                d = _digit(key, lo, slot, K_BITS, KB) + (r * KB)[:, None]
                count += tl.histogram(tl.reshape(d, [ROWS * CBLOCK]), ROWS * KB)
            cum = _suffix_sum(tl.reshape(count, [ROWS, KB]), KB)
            digit = tl.max(tl.where((cum >= need_k[:, None]) & (bk[None, :] >= 1), bk[None, :], 0), axis=1)
            lo += digit.to(tl.int64) << (32 - (slot + 1) * K_BITS)
        t = tl.where(k_off, _KEY_MIN, lo.to(tl.int32))
    if USE_P:
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
        need_p = tl.maximum(p, 1e-30)
        lo = tl.full([ROWS], _KEY_MIN, dtype=tl.int64)
        for slot in tl.static_range(P_PASSES):
            # per-lane masses, reduced once a round (as radix_pass_kernel)
            mass_lanes = tl.zeros([ROWS, CBLOCK, PB], dtype=tl.float32)
            for c in range(n_chunks):
                j, m, x = _cload(cval_ptr, c_row, n, c, CBLOCK)
                key = tl.where(m, _ordered_key(x), _KEY_MIN)
                d = _digit(key, lo, slot, P_BITS, PB)
                mass_lanes += tl.where(d[:, :, None] == bp[None, None, :], x[:, :, None], 0.0)
            cum = _suffix_sum(tl.sum(mass_lanes, axis=1), PB)
            digit = tl.max(tl.where((cum >= need_p[:, None]) & (bp[None, :] >= 1), bp[None, :], 0), axis=1)
            lo += digit.to(tl.int64) << (32 - (slot + 1) * P_BITS)
        lp = tl.where(p >= 1.0, _KEY_MIN, lo.to(tl.int32))
    if RENORM:
        z = tl.zeros([ROWS, CBLOCK], dtype=tl.float32)
        for c in range(n_chunks):
            j, m, x = _cload(cval_ptr, c_row, n, c, CBLOCK)
            key = _ordered_key(x)
            z += tl.where((key >= t[:, None]) & (key >= lp[:, None]) & (x > 0.0), x, 0.0)
        tl.store(fin_t_ptr + rows, t, mask=act)
        tl.store(fin_p_ptr + rows, lp, mask=act)
        tl.store(fin_inv_ptr + rows, 1.0 / tl.maximum(tl.sum(z, axis=1), 1e-8), mask=act)
    else:
        pivot = tl.zeros([ROWS], dtype=tl.float32)
        z = tl.zeros([ROWS, CBLOCK], dtype=tl.float32)
        for c in range(n_chunks):
            j, m, x = _cload(cval_ptr, c_row, n, c, CBLOCK)
            z += _kept(x, m, t, lp, pivot, pivot, False, USE_K, USE_P, False)
        target = tl.load(u_ptr + rows, mask=m_r, other=0.0) * tl.sum(z, axis=1)
        # positions in the copy (the full pick's order, not the token ids'), then the token id there
        run = tl.zeros([ROWS], dtype=tl.float32)
        first = tl.zeros([ROWS], dtype=tl.int32) + cap
        last = tl.full([ROWS], -1, dtype=tl.int32)
        for c in range(n_chunks):
            j, m, x = _cload(cval_ptr, c_row, n, c, CBLOCK)
            w = _kept(x, m, t, lp, pivot, pivot, False, USE_K, USE_P, False)
            cdf = tl.cumsum(w, axis=1) + run[:, None]
            hit = (cdf > target[:, None]) & (w > 0.0)
            first = tl.minimum(first, tl.min(tl.where(hit, j[None, :], cap), axis=1))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, j[None, :], -1), axis=1))
            run += tl.sum(w, axis=1)
        at = tl.where(first < cap, first, tl.maximum(last, 0))
        sample = tl.load(cid_ptr + c_row + at, mask=act, other=0)
        # no kept mass at all: entry 0
        sample = tl.where((first < cap) | (last >= 0), sample, 0)
        tl.store(out_ptr + rows, sample, mask=act)


@triton.jit
def _row_sum(z_part, rows, m_r, n_segs, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    s = tl.arange(0, SEGS_P2)
    v = tl.load(z_part + rows.to(tl.int64)[:, None] * n_segs + s[None, :],
                mask=m_r[:, None] & (s < n_segs)[None, :], other=0.0)
    return tl.sum(v, axis=1)

@triton.jit
def _inv_temperature(t_ptr, t_val, rows, m_r, T_ARR: tl.constexpr):
    """float32 [ROWS] ``1 / t`` (``1 / 0`` taken as 0, as FlashInfer does)."""
    t = _param(t_ptr, t_val, rows, rows, m_r, T_ARR, True).to(tl.float32)
    return tl.where(t == 0.0, 0.0, 1.0 / tl.where(t == 0.0, 1.0, t))


@triton.jit
def _scaled_tile(x_ptr, row_off, m_s, t, V, inv_t_col, BLOCK: tl.constexpr):
    """Tile ``t`` of the rows times their ``1 / t`` (``_row_column``), ``-inf`` where masked."""
    offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
    return tl.where(m, x * inv_t_col, float("-inf"))


@triton.jit
def softmax_partial_kernel(
    x_ptr, t_ptr, max_part, sum_part, t_val, B, V, stride_x, n_segs,
    T_ARR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """Per (row, segment) of ``softmax(x / t)``: ``max_part`` the segment's max of ``x / t`` and
    ``sum_part`` its ``sum(exp(x / t - max))`` (0 for a segment of only ``-inf``). Each lane keeps its
    own running max and sum over four tiles a step (one rescale a step, no cross-lane work in the
    loop), reduced once at the end."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    inv_t = _row_column(_inv_temperature(t_ptr, t_val, rows, m_r, T_ARR), ROWS)
    seg = tl.program_id(1)
    lane_max = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for t in range(0, NUM_TILES, 4):
        t0 = seg * NUM_TILES + t
        y0 = _scaled_tile(x_ptr, row_off, m_s, t0, V, inv_t, BLOCK)
        y1 = _scaled_tile(x_ptr, row_off, m_s & (t + 1 < NUM_TILES), t0 + 1, V, inv_t, BLOCK)
        y2 = _scaled_tile(x_ptr, row_off, m_s & (t + 2 < NUM_TILES), t0 + 2, V, inv_t, BLOCK)
        y3 = _scaled_tile(x_ptr, row_off, m_s & (t + 3 < NUM_TILES), t0 + 3, V, inv_t, BLOCK)
        new_max = tl.maximum(tl.maximum(lane_max, tl.maximum(y0, y1)), tl.maximum(y2, y3))
        # a lane still all -inf adds nothing (and must not make NaN)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = (lane_sum * tl.exp(lane_max - safe) + tl.exp(y0 - safe) + tl.exp(y1 - safe)
                    + tl.exp(y2 - safe) + tl.exp(y3 - safe))
        lane_max = new_max
    seg_max = tl.max(lane_max, axis=1)
    safe = tl.where(seg_max == float("-inf"), 0.0, seg_max)
    seg_sum = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - safe[:, None])), axis=1)
    out = rows.to(tl.int64) * n_segs + seg
    tl.store(max_part + out, seg_max, mask=m_r)
    tl.store(sum_part + out, seg_sum, mask=m_r)


@triton.jit
def softmax_write_kernel(
    x_ptr, out_ptr, t_ptr, max_part, sum_part, t_val, B, V, stride_x, stride_o, n_segs,
    T_ARR: tl.constexpr, ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    """float32 ``softmax(x / t)`` of the segment, from the row's ``softmax_partial_kernel`` partials:
    the row max ``M`` and ``Z = sum(sum_part * exp(max_part - M))``."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    inv_t = _row_column(_inv_temperature(t_ptr, t_val, rows, m_r, T_ARR), ROWS)
    seg = tl.program_id(1)
    s = tl.arange(0, SEGS_P2)
    part = rows.to(tl.int64)[:, None] * n_segs + s[None, :]
    m_seg = m_r[:, None] & (s < n_segs)[None, :]
    mx = tl.load(max_part + part, mask=m_seg, other=float("-inf"))
    row_max = tl.max(mx, axis=1)
    safe = tl.where(row_max == float("-inf"), 0.0, row_max)
    z = tl.sum(tl.where(mx == float("-inf"), 0.0,
                        tl.load(sum_part + part, mask=m_seg, other=0.0) * tl.exp(mx - safe[:, None])), axis=1)
    # a row of only -inf stays NaN (x - max is NaN), as torch.softmax gives; the guard only keeps
    # padding rows from dividing by zero
    inv_sum = _row_column(1.0 / tl.where(z == 0.0, 1.0, z), ROWS)
    row_max = _row_column(row_max, ROWS)
    out_off = rows.to(tl.int64) * stride_o
    for t in range(0, NUM_TILES, 2):
        o0, m0, x0 = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        o1, m1, x1 = _tile(x_ptr, row_off, m_s & (t + 1 < NUM_TILES), seg * NUM_TILES + t + 1, V, BLOCK)
        tl.store(out_ptr + out_off[:, None] + o0[None, :],
                 tl.exp(x0 * inv_t - row_max) * inv_sum, mask=m0)
        tl.store(out_ptr + out_off[:, None] + o1[None, :],
                 tl.exp(x1 * inv_t - row_max) * inv_sum, mask=m1)


@triton.jit
def softmax_row_kernel(
    x_ptr, out_ptr, t_ptr, t_val, B, V, stride_x, stride_o, T_ARR: tl.constexpr, BLOCK: tl.constexpr,
):
    """float32 ``softmax(x / t)`` of one row a program, the whole row one tile (``BLOCK >= V``): one
    read and one write, where the segmented passes read the row twice."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, 1)
    inv_t = _row_column(_inv_temperature(t_ptr, t_val, rows, m_r, T_ARR), 1)
    offs, m, x = _tile(x_ptr, row_off, m_s, 0, V, BLOCK)
    y = tl.where(m, x * inv_t, float("-inf"))
    # a row of only -inf is NaN (-inf - -inf), as torch.softmax gives
    e = tl.exp(y - _row_column(tl.max(y, axis=1), 1))
    z = _row_column(tl.sum(e, axis=1), 1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + offs[None, :], e / z, mask=m)


@triton.jit
def chain_speculative_kernel(
    draft_ptr, ids_ptr, target_ptr, u_ptr, out_ptr, accepted_ptr, emitted_ptr,
    B, V, sd_b, sd_n, si_b, st_b, st_n,
    N: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``ROWS`` requests per program. Draft token ``i`` is accepted while ``u_i * p(d_i) < q(d_i)``;
    at the first rejection ``pos`` (or ``N`` when all pass) a token is drawn from ``relu(q - p)``
    of row ``pos`` (``q`` alone for the bonus row ``N``, or when ``relu(q - p)`` has no mass) and the
    rest are -1. ``accepted`` counts ``pos`` plus independent re-tests of rows ``pos..N-1`` with
    fresh uniforms (FlashInfer's metric). Uniforms per request: ``N`` chain tests, ``N`` re-tests,
    one draw, at ``u_ptr + b * (2N + 1)``. ``N`` (the draft length, fixed for a deployment) is a
    compile-time constant."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = rows < B
    b = rows.to(tl.int64)
    u_row = u_ptr + b * (2 * N + 1)
    out_row = out_ptr + b * (N + 1)
    # the bonus slot stays -1 unless every draft token is accepted (then the draw lands there)
    tl.store(out_row + N, tl.full([ROWS], -1, dtype=tl.int32), mask=m_r)
    pos = tl.zeros([ROWS], dtype=tl.int32) + N
    alive = tl.full([ROWS], 1, dtype=tl.int32)
    retested = tl.zeros([ROWS], dtype=tl.int32)
    for i in range(N):
        # ids outside [0, V) read nothing: q = p = 0 rejects the token
        d = tl.load(ids_ptr + b * si_b + i, mask=m_r, other=0).to(tl.int64)
        m_d = m_r & (d >= 0) & (d < V)
        q = tl.load(target_ptr + b * st_b + i * st_n + d, mask=m_d, other=0.0).to(tl.float32)
        p = tl.load(draft_ptr + b * sd_b + i * sd_n + d, mask=m_d, other=0.0).to(tl.float32)
        ok = (tl.load(u_row + i, mask=m_r, other=1.0) * p < q).to(tl.int32)
        pos = tl.where((alive == 1) & (ok == 0), i, pos)
        alive = alive * ok
        tl.store(out_row + i, tl.where(alive == 1, d.to(tl.int32), -1), mask=m_r)
        ok_again = (tl.load(u_row + N + i, mask=m_r, other=1.0) * p < q).to(tl.int32)
        retested += tl.where(i >= pos, ok_again, 0)
    tl.store(accepted_ptr + rows, pos + retested, mask=m_r)
    tl.store(emitted_ptr + rows, pos, mask=m_r)

    q_off = b * st_b + pos.to(tl.int64) * st_n
    p_off = b * sd_b + pos.to(tl.int64) * sd_n
    has_draft = m_r & (pos < N)
    z_res = tl.zeros([ROWS], dtype=tl.float32)
    z_q = tl.zeros([ROWS], dtype=tl.float32)
    for t in range(NUM_TILES):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        m = m_r[:, None] & (offs < V)[None, :]
        # [ROWS, BLOCK]
        q = tl.load(target_ptr + q_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
        p = tl.load(draft_ptr + p_off[:, None] + offs[None, :], mask=m & has_draft[:, None], other=0.0).to(tl.float32)
        z_res += tl.sum(tl.maximum(q - p, 0.0), axis=1)
        z_q += tl.sum(q, axis=1)
    use_q = z_res <= 0.0
    target = tl.load(u_row + 2 * N, mask=m_r, other=0.0) * tl.where(use_q, z_q, z_res)
    run = tl.zeros([ROWS], dtype=tl.float32)
    first = tl.full([ROWS], V, dtype=tl.int32)
    last = tl.full([ROWS], -1, dtype=tl.int32)
    for t in range(NUM_TILES):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        m = m_r[:, None] & (offs < V)[None, :]
        q = tl.load(target_ptr + q_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
        p = tl.load(draft_ptr + p_off[:, None] + offs[None, :], mask=m & has_draft[:, None], other=0.0).to(tl.float32)
        # [ROWS, BLOCK]
        w = tl.where(use_q[:, None], q, tl.maximum(q - p, 0.0))
        cdf = tl.cumsum(w, axis=1) + run[:, None]
        hit = (cdf > target[:, None]) & (w > 0.0)
        first = tl.minimum(first, tl.min(tl.where(hit, offs[None, :], V), axis=1))
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs[None, :], -1), axis=1))
        run += tl.sum(w, axis=1)
    sample = tl.where(first < V, first, tl.maximum(last, 0))
    tl.store(out_row + pos, sample, mask=m_r)


@triton.jit
def _tiles4(x_ptr, row_off, m_s, t, V, BLOCK: tl.constexpr):
    """Tiles ``t .. t + 3`` (float32 [ROWS, BLOCK] each, 0 where masked), all loads issued first."""
    _, _, x0 = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
    _, _, x1 = _tile(x_ptr, row_off, m_s, t + 1, V, BLOCK)
    _, _, x2 = _tile(x_ptr, row_off, m_s, t + 2, V, BLOCK)
    _, _, x3 = _tile(x_ptr, row_off, m_s, t + 3, V, BLOCK)
    return x0, x1, x2, x3


@triton.jit
def _above(x, pivot):
    return tl.where(x > pivot[:, None], x, 0.0)


@triton.jit
def _count_above(x, pivot):
    return (x > pivot[:, None]).to(tl.int32)


@triton.jit
def rejection_sample_kernel(
    x_ptr, idx_ptr, k_ptr, p_ptr, u_ptr, seed_ptr, out_ptr, gate_ptr, rt_ptr, rinv_ptr,
    k_val, p_val, B, n_src, V, stride_x, gate_min,
    HAS_INDICES: tl.constexpr, GATE: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr, RENORMED: tl.constexpr,
    MAX_ROUNDS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
    TILES_P2: tl.constexpr,
):
    """Top-k (``USE_K``), top-p (``USE_P``) or joint top-k/top-p sampling of whole rows by rejection
    with two pivots (FlashInfer's method), one program for ``ROWS`` rows.

    The row is read as ``NUM_TILES`` tiles of ``BLOCK`` lanes, and each lane keeps the sum of its
    entries' weights above ``low`` (no cross-lane work in the loops). A round: (1) an inverse-CDF
    sample ``j`` of the entries above ``low`` in lane-major order (any fixed order samples the same
    distribution): one scan over the lane sums finds the lane where the running mass passes ``u *
    Z``, one gather of that lane's ``NUM_TILES`` entries and a scan find the entry; (2) one read for
    the mass (and with ``USE_K`` the count) of the entries above ``p_j`` and above ``mid = (p_j +
    high) / 2``, per lane. ``j`` is kept, and returned, when fewer than ``k`` entries and less than
    ``top_p`` of mass lie above it (the kept set is ``{p >= tau}``, so the accepted sample follows
    the renormalised kept set, ties included); otherwise ``tau`` is above ``mid`` (``low = mid``) or
    in ``(p_j, mid]`` (``low = p_j``, ``high = mid``): no kept entry is dropped, and the lane masses
    above the new ``low`` are the ones just read. So a row costs one read plus one a round; a row
    whose kept set holds most of its mass accepts in round 0 most of the time. Round 0 uses
    ``u[row]``, later rounds ``tl.rand(seed, row * MAX_ROUNDS + round)``. After ``MAX_ROUNDS``
    rejections a row keeps its last sample (never seen: each round halves ``high - low`` or
    accepts). ``GATE``: only rows with ``gate[row] > gate_min``. ``RENORMED``: the rows top-k
    renormalised on load (``top_k_first``: what the renorm would have written)."""
    rows, m_r, src, row_off, m_s = _gated_rows(B, n_src, idx_ptr, stride_x, gate_ptr, gate_min, HAS_INDICES, GATE,
                                               ROWS)
    rt, rinv = _renorm_rows(rt_ptr, rinv_ptr, src, m_s, RENORMED)
    # top_p <= 0 keeps the largest entries only, >= 1 every entry; k <= 0 or >= V: no top-k filter
    p_on = rows < 0
    top_p = tl.full([ROWS], 1.0, tl.float32)
    if USE_P:
        p_raw = _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
        p_on = p_raw < 1.0
        top_p = tl.maximum(p_raw, 1e-30)
    k_on = rows < 0
    k = tl.full([ROWS], 0, tl.int32)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, PARAM_BY_SOURCE).to(tl.int32)
        k_on = (k > 0) & (k < V)
    seed = tl.load(seed_ptr).to(tl.int32, bitcast=True)
    lanes = tl.arange(0, BLOCK)
    tiles = tl.arange(0, TILES_P2)
    # [ROWS, BLOCK]: each lane's mass above `low` (0 to start), and the row max
    lane_w = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    mx_lanes = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    if tl.max(m_r.to(tl.int32), axis=0) > 0:
        # four tiles a step, loaded before they are used: one program streams a whole row, and a
        # load-then-use tile loop keeps one tile in flight (~20 GB/s a program on the H200)
        for t in range(0, NUM_TILES, 4):
            x0, x1, x2, x3 = _tiles4(x_ptr, row_off, m_s, t, V, BLOCK)
            x0, x1 = _renormed(x0, rt, rinv, RENORMED), _renormed(x1, rt, rinv, RENORMED)
            x2, x3 = _renormed(x2, rt, rinv, RENORMED), _renormed(x3, rt, rinv, RENORMED)
            lane_w += (tl.where(x0 > 0.0, x0, 0.0) + tl.where(x1 > 0.0, x1, 0.0)
                       + tl.where(x2 > 0.0, x2, 0.0) + tl.where(x3 > 0.0, x3, 0.0))
            mx_lanes = tl.maximum(tl.maximum(mx_lanes, tl.maximum(x0, x1)), tl.maximum(x2, x3))
    low = tl.zeros([ROWS], dtype=tl.float32)
    high = tl.max(mx_lanes, axis=1)
    done = ~m_r
    sample = tl.zeros([ROWS], dtype=tl.int32)
    u = tl.load(u_ptr + rows, mask=m_r, other=0.0)
    r = 0
    while (r < MAX_ROUNDS) & (tl.min(done.to(tl.int32), axis=0) == 0):
        if r > 0:
            u = tl.rand(seed, rows * MAX_ROUNDS + r)
        # (1) the lane, then the tile, where the lane-major running mass first exceeds u * Z
        total = tl.sum(lane_w, axis=1)
        target = u * total
        cum = tl.cumsum(lane_w, axis=1)
        hit_lane = tl.min(tl.where((cum > target[:, None]) & (lane_w > 0.0), lanes[None, :], BLOCK), axis=1)
        last_lane = tl.max(tl.where(lane_w > 0.0, lanes[None, :], -1), axis=1)
        lane = tl.where(hit_lane < BLOCK, hit_lane, tl.maximum(last_lane, 0))
        before = tl.sum(tl.where(lanes[None, :] == lane[:, None], cum - lane_w, 0.0), axis=1)
        # [ROWS, TILES_P2]: the lane's entries, one a tile
        col = tiles[None, :] * BLOCK + lane[:, None]
        m_col = (m_s & ~done)[:, None] & (tiles < NUM_TILES)[None, :] & (col < V)
        x_col = tl.load(x_ptr + row_off[:, None] + col, mask=m_col, other=0.0).to(tl.float32)
        x_col = _renormed(x_col, rt, rinv, RENORMED)
        w_col = tl.where(x_col > low[:, None], x_col, 0.0)
        hit = (tl.cumsum(w_col, axis=1) > (target - before)[:, None]) & (w_col > 0.0)
        first_t = tl.min(tl.where(hit, tiles[None, :], TILES_P2), axis=1)
        last_t = tl.max(tl.where(w_col > 0.0, tiles[None, :], -1), axis=1)
        tile = tl.where(first_t < TILES_P2, first_t, tl.maximum(last_t, 0))
        j = tile * BLOCK + lane
        p_j = tl.load(x_ptr + row_off + j, mask=m_s & ~done, other=0.0).to(tl.float32)
        if RENORMED:
            p_j = tl.sum(_renormed(p_j[:, None], rt, rinv, RENORMED), axis=1)
        mid = (p_j + high) * 0.5
        # (2) per lane, the mass (and count) of the entries above p_j and above mid
        mass_j = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        mass_mid = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        cnt_j = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        cnt_mid = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        for t in range(0, NUM_TILES, 4):
            x0, x1, x2, x3 = _tiles4(x_ptr, row_off, m_s & ~done, t, V, BLOCK)
            x0, x1 = _renormed(x0, rt, rinv, RENORMED), _renormed(x1, rt, rinv, RENORMED)
            x2, x3 = _renormed(x2, rt, rinv, RENORMED), _renormed(x3, rt, rinv, RENORMED)
            mass_j += _above(x0, p_j) + _above(x1, p_j) + _above(x2, p_j) + _above(x3, p_j)
            mass_mid += _above(x0, mid) + _above(x1, mid) + _above(x2, mid) + _above(x3, mid)
            if USE_K:
                # masked entries load as 0, never above a pivot (pivots are entries, >= 0)
                cnt_j += _count_above(x0, p_j) + _count_above(x1, p_j) + _count_above(x2, p_j) + _count_above(x3, p_j)
                cnt_mid += (_count_above(x0, mid) + _count_above(x1, mid) + _count_above(x2, mid)
                            + _count_above(x3, mid))
        keep = ~p_on | (tl.sum(mass_j, axis=1) < top_p)
        below_mid = p_on & (tl.sum(mass_mid, axis=1) >= top_p)
        if USE_K:
            keep = keep & (~k_on | (tl.sum(cnt_j, axis=1) < k))
            below_mid = below_mid | (k_on & (tl.sum(cnt_mid, axis=1) >= k))
        # a row with no mass above `low` (an all-zero row) keeps its fallback sample
        accept = ~done & (keep | (total <= 0.0))
        sample = tl.where(accept | (~done & (r == MAX_ROUNDS - 1)), j, sample)
        to_mid = ~done & ~accept & below_mid
        to_j = ~done & ~accept & ~below_mid
        low = tl.where(to_j, p_j, tl.where(to_mid, mid, low))
        high = tl.where(to_j, mid, high)
        lane_w = tl.where(to_j[:, None], mass_j, tl.where(to_mid[:, None], mass_mid, lane_w))
        done = done | accept
        r += 1
    tl.store(out_ptr + rows, sample, mask=m_r)
