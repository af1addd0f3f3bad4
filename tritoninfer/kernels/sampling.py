"""Sampling, top-k / top-p / min-p filters, softmax: ``@triton.jit`` code only.

Every kernel handles ``ROWS`` rows per program (1 on the GPU: one program per row; more under the
interpreter, whose cost is per op and program) and walks a row's ``V`` entries in ``NUM_TILES``
tiles of ``BLOCK``. Nothing is sorted and no loop length depends on the data:

- **Thresholds by radix search.** Each float32 entry gets an order-preserving int32 key
  (``_ordered_key``). The top-k threshold is the largest key ``T`` with
  ``count(key >= T) >= k`` (the k-th largest entry); the top-p threshold the largest key ``L`` with
  ``sum(p where key > L) >= top_p``. Both predicates are monotone, so the thresholds are built four
  bits at a time from the top: 8 passes over the row, each counting (or summing) the entries above
  16 candidate prefixes at once. Kept entries: ``key >= T`` (ties with the k-th largest are kept)
  and ``key > L`` (the entry whose mass crosses ``top_p`` is kept), FlashInfer's sets.
- **Sampling by inverse CDF.** One uniform ``u`` in ``[0, 1)`` per output row (drawn by the caller
  with torch, so a ``torch.Generator`` makes runs reproducible): the sample is the first entry whose
  running sum of kept mass exceeds ``u * Z`` (``Z`` the kept mass), found in one pass with
  ``tl.cumsum`` per tile; if rounding leaves nothing above ``u * Z``, the last kept entry.

Row ``i`` of the output reads source row ``indices[i]`` when ``HAS_INDICES`` (rows sharing a
distribution); source ids outside ``[0, n_src)`` read nothing (an all-zero row: sample 0).
Parameters (``top_k``, ``top_p``, ``min_p``, temperature) are per-row arrays when ``*_ARR``, indexed
by source row when ``PARAM_BY_SOURCE`` and by output row otherwise, else one scalar.
"""

import triton
import triton.language as tl

# the top bits of the 32-bit key space first, four at a time
_RADIX_BITS = tl.constexpr(4)
_RADIX = tl.constexpr(16)
_DIGITS = tl.constexpr(8)


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
def _row_max(x_ptr, row_off, m_s, V, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    mx = tl.full([ROWS], float("-inf"), tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
        mx = tl.maximum(mx, tl.max(tl.where(m, x, float("-inf")), axis=1))
    return mx


@triton.jit
def _radix_thresholds(x_ptr, row_off, m_s, V, k, p,
                      USE_K: tl.constexpr, USE_P: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr):
    """(T, L) [ROWS] int32 keys: the largest T with ``count(key >= T) >= k`` and the largest L with
    ``sum(x where key > L) >= p`` (the smallest key, -2**31, when even that fails). Both searches
    share the passes.

    A threshold is built from -2**31 by adding 4-bit digits from the top: a prefix plus
    ``b << shift`` (b < 16) never passes 2**31 - 1, so int32 holds every candidate. Candidate 0 is
    the current prefix, which satisfies the predicate, so only candidates b >= 1 (all above -2**31)
    are ever chosen: masked entries get key -2**31 and count for none of them."""
    b = tl.arange(0, _RADIX)
    lo_k = tl.full([ROWS], -2147483648, dtype=tl.int32)
    lo_p = tl.full([ROWS], -2147483648, dtype=tl.int32)
    for d in range(_DIGITS):
        shift = (_DIGITS - 1 - d) * _RADIX_BITS
        step = b << shift
        # [ROWS, RADIX]
        cand_k = lo_k[:, None] + step[None, :]
        cand_p = lo_p[:, None] + step[None, :]
        count = tl.zeros([ROWS, _RADIX], dtype=tl.int32)
        mass = tl.zeros([ROWS, _RADIX], dtype=tl.float32)
        for t in range(NUM_TILES):
            # inlined _tile and _ordered_key: nested jit calls are what costs most under the interpreter
            offs = t * BLOCK + tl.arange(0, BLOCK)
            m = m_s[:, None] & (offs < V)[None, :]
            # [ROWS, BLOCK]
            x = tl.load(x_ptr + row_off[:, None] + offs[None, :], mask=m, other=0.0).to(tl.float32)
            bits = x.to(tl.int32, bitcast=True)
            key = tl.where(m, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483648)
            if USE_K:
                # [ROWS, BLOCK, RADIX] -> [ROWS, RADIX]
                count += tl.sum((key[:, :, None] >= cand_k[:, None, :]).to(tl.int32), axis=1)
            if USE_P:
                mass += tl.sum(tl.where(key[:, :, None] > cand_p[:, None, :], x[:, :, None], 0.0), axis=1)
        if USE_K:
            lo_k += tl.max(tl.where(count >= k[:, None], b[None, :], 0), axis=1) << shift
        if USE_P:
            lo_p += tl.max(tl.where(mass >= p[:, None], b[None, :], 0), axis=1) << shift
    return lo_k, lo_p


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
            keep = keep & (key > lo_p[:, None])
    if USE_MIN_P:
        keep = keep & (v >= pivot[:, None])
    return tl.where(keep, v, 0.0)


@triton.jit
def sample_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, k_ptr, p_ptr,
    k_val, p_val, B, n_src, V, stride_x,
    HAS_INDICES: tl.constexpr, IS_LOGITS: tl.constexpr,
    USE_K: tl.constexpr, USE_P: tl.constexpr, USE_MIN_P: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr, PARAM_BY_SOURCE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """``out[i]`` (int32) drawn from row ``i`` (or ``indices[i]``) of probabilities, or of logits
    (``IS_LOGITS``: softmax), restricted to the top-k (``USE_K``), top-p (``USE_P``, with
    ``USE_K`` their intersection) or min-p (``USE_MIN_P``, its ``min_p`` in ``p_ptr``/``p_val``) set."""
    rows, m_r, src, row_off, m_s = _rows(B, n_src, idx_ptr, stride_x, HAS_INDICES, ROWS)
    lo_k = tl.full([ROWS], -2147483648, dtype=tl.int32)
    lo_p = tl.full([ROWS], -2147483648, dtype=tl.int32)
    pivot = tl.zeros([ROWS], dtype=tl.float32)
    shift_max = tl.zeros([ROWS], dtype=tl.float32)
    if IS_LOGITS or USE_MIN_P:
        mx = _row_max(x_ptr, row_off, m_s, V, ROWS, BLOCK, NUM_TILES)
        if IS_LOGITS:
            # an all -inf row keeps weight 0 everywhere instead of NaN
            shift_max = tl.where(mx == float("-inf"), 0.0, mx)
        if USE_MIN_P:
            pivot = tl.where(m_s, mx, 0.0) * _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
    if USE_K or USE_P:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, PARAM_BY_SOURCE).to(tl.int32)
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, PARAM_BY_SOURCE).to(tl.float32)
        # top_p <= 0 keeps the largest entries only (greedy)
        p_search = tl.maximum(p, 1e-30)
        lo_k, lo_p = _radix_thresholds(x_ptr, row_off, m_s, V, tl.minimum(tl.maximum(k, 1), V), p_search,
                                       USE_K, USE_P, ROWS, BLOCK, NUM_TILES)
        # k <= 0 or k >= V: no top-k filter; top_p >= 1: no top-p filter
        lo_k = tl.where((k <= 0) | (k >= V), -2147483648, lo_k)
        lo_p = tl.where(p >= 1.0, -2147483648, lo_p)

    z = tl.zeros([ROWS], dtype=tl.float32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
        z += tl.sum(_kept(x, m, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P), axis=1)

    target = tl.load(u_ptr + rows, mask=m_r, other=0.0) * z
    run = tl.zeros([ROWS], dtype=tl.float32)
    first = tl.full([ROWS], V, dtype=tl.int32)
    last = tl.full([ROWS], -1, dtype=tl.int32)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
        # [ROWS, BLOCK]
        w = _kept(x, m, lo_k, lo_p, pivot, shift_max, IS_LOGITS, USE_K, USE_P, USE_MIN_P)
        cdf = tl.cumsum(w, axis=1) + run[:, None]
        hit = (cdf > target[:, None]) & (w > 0.0)
        first = tl.minimum(first, tl.min(tl.where(hit, offs[None, :], V), axis=1))
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs[None, :], -1), axis=1))
        run += tl.sum(w, axis=1)
    # no hit: rounding put u * Z at or past the running total; no kept mass at all: entry 0
    sample = tl.where(first < V, first, tl.maximum(last, 0))
    tl.store(out_ptr + rows, sample, mask=m_r)


@triton.jit
def renorm_kernel(
    x_ptr, out_ptr, k_ptr, p_ptr,
    k_val, p_val, B, V, stride_x, stride_o,
    USE_K: tl.constexpr, USE_P: tl.constexpr, MASK_LOGITS: tl.constexpr,
    K_ARR: tl.constexpr, P_ARR: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_TILES: tl.constexpr,
):
    """float32 rows of ``out``: the top-k (``USE_K``) or top-p (``USE_P``) entries of ``x`` over
    their sum (floored at 1e-8), 0 elsewhere; with ``MASK_LOGITS`` the top-k logits themselves,
    ``-inf`` elsewhere. A row with ``k <= 0`` or ``k >= V`` is copied unchanged; ``top_p >= 1``
    divides the row by its sum."""
    rows, m_r, src, row_off, m_s = _rows(B, B, x_ptr, stride_x, False, ROWS)
    out_off = rows.to(tl.int64) * stride_o
    if USE_K:
        k = _param(k_ptr, k_val, rows, src, m_r, K_ARR, True).to(tl.int32)
        p = tl.zeros([ROWS], dtype=tl.float32)
        no_filter = (k <= 0) | (k >= V)
    else:
        k = tl.zeros([ROWS], dtype=tl.int32)
        p = _param(p_ptr, p_val, rows, src, m_r, P_ARR, True).to(tl.float32)
        no_filter = p >= 1.0
    lo_k, lo_p = _radix_thresholds(x_ptr, row_off, m_s, V, tl.minimum(tl.maximum(k, 1), V), tl.maximum(p, 1e-30),
                                   USE_K, USE_P, ROWS, BLOCK, NUM_TILES)
    lo_p = tl.where(no_filter, -2147483648, lo_p)

    if not MASK_LOGITS:
        z = tl.zeros([ROWS], dtype=tl.float32)
        for t in range(NUM_TILES):
            offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
            key = _ordered_key(x)
            keep = (key >= lo_k[:, None]) & (key > lo_p[:, None]) & (x > 0.0)
            z += tl.sum(tl.where(keep, x, 0.0), axis=1)
        inv = 1.0 / tl.maximum(z, 1e-8)
    for t in range(NUM_TILES):
        offs, m, x = _tile(x_ptr, row_off, m_s, t, V, BLOCK)
        key = _ordered_key(x)
        keep = (key >= lo_k[:, None]) & (key > lo_p[:, None])
        if MASK_LOGITS:
            y = tl.where(keep | no_filter[:, None], x, float("-inf"))
        else:
            y = tl.where(keep & (x > 0.0), x * inv[:, None], 0.0)
            if USE_K:
                y = tl.where(no_filter[:, None], x, y)
        tl.store(out_ptr + out_off[:, None] + offs[None, :], y, mask=m)


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
