"""Sampling, top-k / top-p / min-p filters, softmax: ``@triton.jit`` code only.

The filtering and sampling work is split over a grid of (row blocks, segments): each program
handles ``ROWS`` rows (1 on the GPU; more under the interpreter, whose cost is per op and program)
and one segment of ``NUM_TILES * BLOCK`` entries of them, so a row is read by many programs at once.
A search is a few launches; each program of a launch rebuilds what it needs from the previous
launch's per-(row, segment) partial results (a few KB, read from L2), so there is no combine launch.
Nothing is sorted and no loop length depends on the data:

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
    return rows, m_r, src, src * stride_x, m_s


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
    offs = t * BLOCK + tl.arange(0, BLOCK)
    m = m_s[:, None] & (offs < V)[None, :]
    # [ROWS, BLOCK]
    x = tl.load(x_ptr + row_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
    return offs, m, x


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
        cum = tl.cumsum(h, axis=1, reverse=True)
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
    x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part,
    k_val, p_val, B, n_src, V, stride_x, n_segs,
    PASS: tl.constexpr, HAS_INDICES: tl.constexpr, USE_K: tl.constexpr, USE_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """Digit ``PASS`` of the top-k (``PASS < K_PASSES``) and top-p (``PASS < P_PASSES``) searches over
    one segment: resolves digit ``PASS - 1`` from the previous launch's partials, then writes this
    segment's histogram of digit ``PASS`` (counts for top-k, masses for top-p) to ``part[PASS % 2]``
    (``[2, B, n_segs, bins]``, double-buffered: the previous pass's stay readable)."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
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
    mass = tl.zeros([ROWS, PB], dtype=tl.float32)
    if DO_P:
        # top of the prefix's range: a tile with no key at or above lo_p + one digit step only
        # feeds digit 0, which is never tested
        step_p = lo_p + (tl.full([ROWS], 1, tl.int64) << (32 - (PASS + 1) * P_BITS))
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(m, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), _KEY_MIN)
        if DO_K:
            # one histogram for all ROWS rows: bin = row * 256 + digit
            d = _digit(key, lo_k, PASS, K_BITS, KB) + (r * KB)[:, None]
            count += tl.histogram(tl.reshape(d, [ROWS * BLOCK]), ROWS * KB)
        if DO_P:
            if tl.max(tl.max((key.to(tl.int64) >= step_p[:, None]).to(tl.int32), axis=1), axis=0) > 0:
                d = _digit(key, lo_p, PASS, P_BITS, PB)
                # [ROWS, BLOCK, 16] -> [ROWS, 16]
                mass += tl.sum(tl.where(d[:, :, None] == bp[None, None, :], x[:, :, None], 0.0), axis=1)
    out_row = (rows + B * (PASS % 2)).to(tl.int64) * n_segs + seg
    if DO_K:
        tl.store(k_part + out_row[:, None] * KB + tl.arange(0, KB)[None, :], tl.reshape(count, [ROWS, KB]),
                 mask=m_r[:, None])
    if DO_P:
        tl.store(p_part + out_row[:, None] * PB + bp[None, :], mass, mask=m_r[:, None])


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
    mx = tl.full([ROWS], float("-inf"), tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        mx = tl.maximum(mx, tl.max(tl.where(m, x, float("-inf")), axis=1))
    tl.store(max_part + rows.to(tl.int64) * n_segs + seg, mx, mask=m_r)


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
def _sample_setup(x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part,
                  k_val, p_val, B, n_src, V, stride_x, n_segs,
                  HAS_INDICES: tl.constexpr, IS_LOGITS: tl.constexpr,
                  USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
                  K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
                  ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    """What both sampling launches need: rows, thresholds, min-p pivot, softmax shift."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    seg = tl.program_id(1)
    pivot = tl.zeros([ROWS], dtype=tl.float32)
    shift_max = tl.zeros([ROWS], dtype=tl.float32)
    if IS_LOGITS or USE_MIN_P:
        mx = _row_max(max_part, rows, m_r, n_segs, ROWS, SEGS_P2)
        if IS_LOGITS:
            # an all -inf row keeps weight 0 everywhere instead of NaN
            shift_max = tl.where(mx == float("-inf"), 0.0, mx)
        if USE_MIN_P:
            pivot = tl.where(m_s, mx, 0.0) * _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
    lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                   k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, PARAM_BY_SOURCE,
                                   ROWS, SEGS_P2)
    return rows, m_r, row_off, m_s, seg, lo_k, lo_p, pivot, shift_max


@triton.jit
def sample_mass_kernel(
    x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, z_part,
    k_val, p_val, B, n_src, V, stride_x, n_segs,
    HAS_INDICES: tl.constexpr, IS_LOGITS: tl.constexpr,
    USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``z_part[row, seg]``: the segment's kept mass (weights of probabilities, or of logits with
    ``IS_LOGITS``: softmax), restricted to the top-k (``USE_K``), top-p (``USE_P``, with ``USE_K``
    their intersection) or min-p (``USE_MIN_P``, its ``min_p`` in ``p_ptr``/``p_val``) set."""
    rows, m_r, row_off, m_s, seg, lo_k, lo_p, pivot, shift_max = _sample_setup(
        x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, k_val, p_val, B, n_src, V,
        stride_x, n_segs, HAS_INDICES, IS_LOGITS, USE_K, USE_P, USE_MIN_P, K_ARR, P_ARR, PARAM_BY_SOURCE,
        ROWS, SEGS_P2)
    z = tl.zeros([ROWS], dtype=tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        z += tl.sum(_kept(x, m, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P), axis=1)
    tl.store(z_part + rows.to(tl.int64) * n_segs + seg, z, mask=m_r)


@triton.jit
def sample_pick_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, z_part,
    k_val, p_val, B, n_src, V, stride_x, n_segs,
    HAS_INDICES: tl.constexpr, IS_LOGITS: tl.constexpr,
    USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``out[i]`` (int32): the first kept entry whose running kept mass exceeds ``u[i] * Z``. Every
    program derives the same owner segment from ``z_part`` (the first whose running total exceeds
    ``u * Z``; when rounding leaves none, the last with mass; with no mass at all, segment 0, which
    then writes entry 0); only the owner scans and writes."""
    rows, m_r, row_off, m_s, seg, lo_k, lo_p, pivot, shift_max = _sample_setup(
        x_ptr, idx_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, max_part, k_val, p_val, B, n_src, V,
        stride_x, n_segs, HAS_INDICES, IS_LOGITS, USE_K, USE_P, USE_MIN_P, K_ARR, P_ARR, PARAM_BY_SOURCE,
        ROWS, SEGS_P2)
    s = tl.arange(0, SEGS_P2)
    # [ROWS, SEGS_P2]
    zs = tl.load(z_part + rows.to(tl.int64)[:, None] * n_segs + s[None, :],
                 mask=m_r[:, None] & (s < n_segs)[None, :], other=0.0)
    cum = tl.cumsum(zs, axis=1)
    target = tl.load(u_ptr + rows, mask=m_r, other=0.0) * tl.sum(zs, axis=1)
    hit_seg = tl.min(tl.where(cum > target[:, None], s[None, :], SEGS_P2), axis=1)
    last_seg = tl.max(tl.where(zs > 0.0, s[None, :], 0), axis=1)
    owner = tl.where(hit_seg < SEGS_P2, hit_seg, last_seg)
    mine = m_r & (owner == seg)
    run = tl.sum(tl.where(s[None, :] < seg, zs, 0.0), axis=1)
    first = tl.full([ROWS], V, dtype=tl.int32)
    last = tl.full([ROWS], -1, dtype=tl.int32)
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        m_own = m_s & mine
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_own, seg * NUM_TILES + t, V, BLOCK)
            # [ROWS, BLOCK]
            w = _kept(x, m, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
            cdf = tl.cumsum(w, axis=1) + run[:, None]
            hit = (cdf > target[:, None]) & (w > 0.0)
            first = tl.minimum(first, tl.min(tl.where(hit, offs[None, :], V), axis=1))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs[None, :], -1), axis=1))
            run += tl.sum(w, axis=1)
    # no hit: rounding put u * Z at or past the running total; no kept mass at all: entry 0
    sample = tl.where(first < V, first, tl.maximum(last, 0))
    tl.store(out_ptr + rows, sample, mask=mine)


@triton.jit
def renorm_mass_kernel(
    x_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, z_part,
    k_val, p_val, B, V, stride_x, n_segs,
    USE_K: tl.constexpr, USE_P: tl.constexpr, K_ARR: tl.constexpr, P_ARR: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``z_part[row, seg]``: the segment's kept positive mass (the renorm's denominator, in parts)."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    seg = tl.program_id(1)
    lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                   k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, True, ROWS, SEGS_P2)
    z = tl.zeros([ROWS], dtype=tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        key = _ordered_key(x)
        keep = (key >= lo_k[:, None]) & (key >= lo_p[:, None]) & (x > 0.0)
        z += tl.sum(tl.where(keep, x, 0.0), axis=1)
    tl.store(z_part + rows.to(tl.int64) * n_segs + seg, z, mask=m_r)


@triton.jit
def renorm_write_kernel(
    x_ptr, out_ptr, k_ptr, p_ptr, k_state, k_part, p_state, p_part, z_part,
    k_val, p_val, B, V, stride_x, stride_o, n_segs,
    USE_K: tl.constexpr, USE_P: tl.constexpr, MASK_LOGITS: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr,
    ROWS: tl.constexpr, SEGS_P2: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """float32 rows of ``out``, one segment a program: the top-k (``USE_K``) or top-p (``USE_P``)
    entries of ``x`` over their sum (floored at 1e-8; ``z_part`` from ``renorm_mass_kernel``), 0
    elsewhere; with ``MASK_LOGITS`` the top-k logits themselves, ``-inf`` elsewhere. A row with
    ``k <= 0`` or ``k >= V`` is copied unchanged; ``top_p >= 1`` divides the row by its sum."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    seg = tl.program_id(1)
    out_off = rows.to(tl.int64) * stride_o
    lo_k, lo_p = _final_thresholds(k_state, k_part, p_state, p_part, rows, m_r, src, B, V, n_segs, seg,
                                   k_ptr, p_ptr, k_val, p_val, USE_K, USE_P, K_ARR, P_ARR, True, ROWS, SEGS_P2)
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, True).to(tl.int32)
        no_filter = (k <= 0) | (k >= V)
    else:
        no_filter = rows < 0
    if not MASK_LOGITS:
        inv = 1.0 / tl.maximum(_row_sum(z_part, rows, m_r, n_segs, ROWS, SEGS_P2), 1e-8)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, seg * NUM_TILES + t, V, BLOCK)
        key = _ordered_key(x)
        keep = (key >= lo_k[:, None]) & (key >= lo_p[:, None])
        if MASK_LOGITS:
            y = tl.where(keep | no_filter[:, None], x, float("-inf"))
        else:
            y = tl.where(keep & (x > 0.0), x * inv[:, None], 0.0)
            if USE_K:
                y = tl.where(no_filter[:, None], x, y)
        tl.store(out_ptr + out_off[:, None] + offs[None, :], y, mask=m)


@triton.jit
def _row_sum(z_part, rows, m_r, n_segs, ROWS: tl.constexpr, SEGS_P2: tl.constexpr):
    s = tl.arange(0, SEGS_P2)
    v = tl.load(z_part + rows.to(tl.int64)[:, None] * n_segs + s[None, :],
                mask=m_r[:, None] & (s < n_segs)[None, :], other=0.0)
    return tl.sum(v, axis=1)

@triton.jit
def softmax_kernel(
    x_ptr, out_ptr, t_ptr, t_val, B, V, stride_x, stride_o,
    T_ARR: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """float32 ``softmax(x * (1 / t))`` per row (``1 / 0`` taken as 0, as FlashInfer does), online
    over the tiles: one pass for the max and the denominator, one to write."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    out_off = rows.to(tl.int64) * stride_o
    t = _param(t_ptr, t_val, rows, src, m_r, T_ARR, True).to(tl.float32)
    inv_t = tl.where(t == 0.0, 0.0, 1.0 / tl.where(t == 0.0, 1.0, t))
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], dtype=tl.float32)
    for i in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, i, V, BLOCK)
        y = tl.where(m, x * inv_t[:, None], float("-inf"))
        new_max = tl.maximum(run_max, tl.max(y, axis=1))
        # a row still all -inf so far adds nothing (and must not make NaN)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.exp(y - safe[:, None]), axis=1)
        run_max = new_max
    # a row of only -inf stays NaN (x - max is NaN), as torch.softmax gives; the guard only keeps
    # padding rows from dividing by zero
    inv_sum = 1.0 / tl.where(run_sum == 0.0, 1.0, run_sum)
    for i in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, i, V, BLOCK)
        y = tl.exp(x * inv_t[:, None] - run_max[:, None]) * inv_sum[:, None]
        tl.store(out_ptr + out_off[:, None] + offs[None, :], y, mask=m)


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
