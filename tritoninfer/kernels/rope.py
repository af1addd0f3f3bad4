"""Rotary positional embedding (RoPE) applied to ragged q/k tensors: ``@triton.jit`` code only.

``rope_kernel`` serves every ``apply_rope*`` form of ``tritoninfer.rope``, ``rope_quantize_kernel``
(at the end) the fused RoPE + fp8 quantisation (+ paged KV append) forms. ``rope_kernel``:

- positions from ``pos_ids`` (``RAGGED=False``) or from a CSR ``indptr`` plus per-request
  ``offsets`` (``RAGGED=True``: token ``indptr[b] + j`` is at position ``offsets[b] + j``; the
  request of each token is found by a vectorised binary search over ``indptr``, so the grid does
  not depend on the request lengths and nothing is copied to the host);
- cos/sin computed on the fly from the frequencies (plain and Llama 3.1 smoothed), or read from a
  float32 ``[max_pos, rotary_dim]`` cache holding ``[cos | sin]`` (``USE_CACHE``);
- rotate-half pairs ``(j, j + ROT/2)`` (``INTERLEAVE=False``) or adjacent pairs ``(2j, 2j+1)``.

Grid: ``(cdiv(nnz, BLOCK_T), head_groups)``. A program computes cos/sin once for its ``BLOCK_T``
tokens and walks over its share of the ``num_q_heads + num_k_heads`` heads (q heads first), so the
trigonometry is paid once per token, not once per head.

Math, for pair j of ``ROT`` rotated dimensions (all in fp32):
    freq_j  = theta^(-2j/ROT)                                  (exp2(-(2j/ROT) * log2(theta)))
    smooth  = clamp(freq_j * smooth_a + smooth_b, 0, 1)          (0 for plain RoPE)
    freq_j' = (1 - smooth) * freq_j / rope_scale + smooth * freq_j
    out1 = x1 cos(pos freq_j') - x2 sin(pos freq_j'),  out2 = x2 cos + x1 sin
Dimensions ``[ROT, HEAD_DIM)`` pass through unchanged (copied bit for bit when not in place).
"""

import triton
import triton.language as tl

from .page import append_slots


@triton.jit
def _ragged_positions(indptr_ptr, offsets_ptr, offs_t, m_t, batch_size, n_search):
    """Position of each token ``offs_t`` [T] of a CSR batch; tokens outside ``[indptr[0],
    indptr[batch_size])`` get position 0 (left unrotated).

    Binary search for the request b with ``indptr[b] <= t < indptr[b+1]`` (empty requests are
    skipped naturally: the last b with ``indptr[b] <= t`` is the non-empty one).
    """
    lo = tl.zeros_like(offs_t)
    hi = tl.zeros_like(offs_t) + batch_size
    for _ in range(n_search):
        mid = (lo + hi) // 2
        v = tl.load(indptr_ptr + mid, mask=m_t, other=0)
        go_right = v <= offs_t
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    start = tl.load(indptr_ptr + lo, mask=m_t, other=0).to(tl.int64)
    end = tl.load(indptr_ptr + lo + 1, mask=m_t, other=0).to(tl.int64)
    off = tl.load(offsets_ptr + lo, mask=m_t, other=0).to(tl.int64)
    t = offs_t.to(tl.int64)
    valid = m_t & (t >= start) & (t < end)
    return tl.where(valid, off + t - start, 0)


@triton.jit
def _rotate_head(
    x_ptr, o_ptr, row_x, row_o, sxd, sod, e1, e2, m_2d, cos, sin, m_t,
    ROT: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_PAD: tl.constexpr, COPY_PASS: tl.constexpr,
):
    """Rotate one head of ``BLOCK_T`` tokens: rows start at ``row_x`` / ``row_o`` [T] (int64)."""
    # [BLOCK_T, HALF_PAD]
    x1 = tl.load(x_ptr + row_x[:, None] + e1[None, :] * sxd, mask=m_2d, other=0.0).to(tl.float32)
    # [BLOCK_T, HALF_PAD]
    x2 = tl.load(x_ptr + row_x[:, None] + e2[None, :] * sxd, mask=m_2d, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out_ty = o_ptr.dtype.element_ty
    tl.store(o_ptr + row_o[:, None] + e1[None, :] * sod, o1.to(out_ty), mask=m_2d)
    tl.store(o_ptr + row_o[:, None] + e2[None, :] * sod, o2.to(out_ty), mask=m_2d)
    if COPY_PASS:
        offs_p = ROT + tl.arange(0, PASS_PAD)
        m_p = m_t[:, None] & (offs_p < HEAD_DIM)[None, :]
        # [BLOCK_T, PASS_PAD]
        xp = tl.load(x_ptr + row_x[:, None] + offs_p[None, :] * sxd, mask=m_p, other=0.0)
        tl.store(o_ptr + row_o[:, None] + offs_p[None, :] * sod, xp.to(out_ty), mask=m_p)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    pos_ptr, indptr_ptr, offsets_ptr, cache_ptr,
    nnz, num_q_heads, num_k_heads, heads_per_prog, batch_size, n_search, max_pos,
    sqn, sqh, sqd, skn, skh, skd,
    soqn, soqh, soqd, sokn, sokh, sokd,
    scp, scd,
    log2_theta, rcp_scale, smooth_a, smooth_b,
    ROT: tl.constexpr, HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_PAD: tl.constexpr,
    INTERLEAVE: tl.constexpr, RAGGED: tl.constexpr, USE_CACHE: tl.constexpr,
    COPY_PASS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    HALF: tl.constexpr = ROT // 2
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = offs_t < nnz
    t64 = offs_t.to(tl.int64)

    # positions [BLOCK_T] (int64)
    if RAGGED:
        pos = _ragged_positions(indptr_ptr, offsets_ptr, offs_t, m_t, batch_size, n_search)
    else:
        pos = tl.load(pos_ptr + t64, mask=m_t, other=0).to(tl.int64)

    offs_j = tl.arange(0, HALF_PAD)
    m_j = offs_j < HALF
    m_2d = m_t[:, None] & m_j[None, :]

    if USE_CACHE:
        # positions outside the cache leave the token unrotated (cos 1, sin 0) instead of reading
        # out of bounds
        m_c = m_t & (pos >= 0) & (pos < max_pos)
        p_c = cache_ptr + pos[:, None] * scp + offs_j[None, :] * scd
        m_cj = m_c[:, None] & m_j[None, :]
        # [BLOCK_T, HALF_PAD]
        cos = tl.load(p_c, mask=m_cj, other=1.0).to(tl.float32)
        # [BLOCK_T, HALF_PAD]
        sin = tl.load(p_c + HALF * scd, mask=m_cj, other=0.0).to(tl.float32)
    else:
        # [HALF_PAD]
        freq = tl.exp2((2 * offs_j).to(tl.float32) / ROT * -log2_theta)
        smooth = tl.minimum(tl.maximum(freq * smooth_a + smooth_b, 0.0), 1.0)
        freq = (1.0 - smooth) * (freq * rcp_scale) + smooth * freq
        # [BLOCK_T, HALF_PAD]
        angle = pos.to(tl.float32)[:, None] * freq[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)

    if INTERLEAVE:
        e1 = 2 * offs_j
        e2 = 2 * offs_j + 1
    else:
        e1 = offs_j
        e2 = offs_j + HALF

    num_heads = num_q_heads + num_k_heads
    # int64 loop bounds: the head index multiplies strides
    h_begin = pid_g.to(tl.int64) * heads_per_prog
    h_end = tl.minimum(h_begin + heads_per_prog, num_heads)
    row_qx = t64 * sqn
    row_qo = t64 * soqn
    for h in range(h_begin, tl.minimum(h_end, num_q_heads)):
        _rotate_head(
            q_ptr, q_out_ptr, row_qx + h * sqh, row_qo + h * soqh, sqd, soqd,
            e1, e2, m_2d, cos, sin, m_t, ROT, HEAD_DIM, PASS_PAD, COPY_PASS,
        )
    row_kx = t64 * skn
    row_ko = t64 * sokn
    for h in range(tl.maximum(h_begin, num_q_heads), h_end):
        hk = h - num_q_heads
        _rotate_head(
            k_ptr, k_out_ptr, row_kx + hk * skh, row_ko + hk * sokh, skd, sokd,
            e1, e2, m_2d, cos, sin, m_t, ROT, HEAD_DIM, PASS_PAD, COPY_PASS,
        )


# ---------------------------------------------------------------------------------------------
# RoPE + fp8 quantisation (+ paged KV append): rope_quantize_fp8 and its append variant
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fp8_bits(y, FP8_MBITS: tl.constexpr, FP8_EBIAS: tl.constexpr, FP8_MAX_BITS: tl.constexpr):
    """fp32 ``y`` -> fp8 bits (uint8), in integer arithmetic: round to nearest even, subnormals
    kept, saturating to the largest finite value (``FP8_MAX_BITS`` is its fp32 bit pattern), NaN
    kept. Used under the interpreter, whose own fp32 -> fp8 cast loses the carry of a round-up
    into the exponent, flushes subnormals and overflows to NaN."""
    DROP: tl.constexpr = 23 - FP8_MBITS
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    # clamping the magnitude's bits saturates (inf included); NaN is restored below
    a = tl.minimum(bits & 0x7FFFFFFF, FP8_MAX_BITS)
    e = a >> 23
    # normal fp8 range: rounding the fp32 exponent|mantissa field carries into the exponent
    r_norm = ((a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)) >> DROP) - ((127 - FP8_EBIAS) << FP8_MBITS)
    # subnormal fp8 range: the 24-bit significand shifted down to multiples of the smallest subnormal
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(151 - FP8_EBIAS - FP8_MBITS - e, 31)
    r_sub = (mant + ((1 << (sh - 1)) - 1) + ((mant >> sh) & 1)) >> sh
    r = tl.where(e < 128 - FP8_EBIAS, r_sub, r_norm)
    r = tl.where(y != y, 0x7F, r)
    return (r | sign).to(tl.uint8)


@triton.jit
def _quantize(y, o_ptr, SOFT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MBITS: tl.constexpr,
              FP8_EBIAS: tl.constexpr, FP8_MAX_BITS: tl.constexpr):
    """fp32 -> the fp8 dtype of ``o_ptr``, saturating (as FlashInfer's ``__NV_SATFINITE``); with
    ``SOFT_FP8`` ``o_ptr`` is a uint8 view and the bits are computed by ``_fp8_bits``."""
    if SOFT_FP8:
        return _fp8_bits(y, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
    else:
        # Triton casts with cvt.rn.satfinite on sm_89+; the clamp keeps other lowerings saturating
        # too (comparisons are false for NaN, which stays NaN)
        y = tl.where(y > FP8_MAX, FP8_MAX, tl.where(y < -FP8_MAX, -FP8_MAX, y))
        return y.to(o_ptr.dtype.element_ty)


@triton.jit
def _rope_quant_head(
    x_ptr, o_ptr, row_x, row_o, m_load, m_store, e1, e2, cos, sin, scale,
    SOFT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MBITS: tl.constexpr, FP8_EBIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
):
    """Rotate one head of ``BLOCK_T`` rows (``row_x``/``row_o`` [T] int64, last dim contiguous),
    scale and quantise."""
    # [BLOCK_T, HALF_PAD]
    x1 = tl.load(x_ptr + row_x[:, None] + e1[None, :], mask=m_load, other=0.0).to(tl.float32)
    # [BLOCK_T, HALF_PAD]
    x2 = tl.load(x_ptr + row_x[:, None] + e2[None, :], mask=m_load, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin) * scale
    o2 = (x2 * cos + x1 * sin) * scale
    tl.store(o_ptr + row_o[:, None] + e1[None, :],
             _quantize(o1, o_ptr, SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS), mask=m_store)
    tl.store(o_ptr + row_o[:, None] + e2[None, :],
             _quantize(o2, o_ptr, SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS), mask=m_store)


@triton.jit
def _quant_rows(
    x_ptr, o_ptr, row_x, row_o, offs, m_load, m_store, scale,
    SOFT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MBITS: tl.constexpr, FP8_EBIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
):
    """Scale and quantise one head of ``BLOCK_T`` rows, columns ``offs``."""
    # [BLOCK_T, len(offs)]
    x = tl.load(x_ptr + row_x[:, None] + offs[None, :], mask=m_load, other=0.0).to(tl.float32)
    tl.store(o_ptr + row_o[:, None] + offs[None, :],
             _quantize(x * scale, o_ptr, SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS), mask=m_store)


@triton.jit(do_not_specialize=["batch_size", "num_pages", "num_indices", "max_pos"])
def rope_quantize_kernel(
    q_rope_ptr,  # [nnz, Hq, ROT]
    q_nope_ptr,  # [nnz, Hq, NOPE]
    k_rope_ptr,  # [nnz, Hk, ROT] (MLA: [nnz, ROT], Hk = 1)
    k_nope_ptr,  # [nnz, Hk, NOPE]
    v_ptr,  # [nnz, Hk, VD] (HAS_V)
    q_rope_out_ptr,  # [nnz, Hq, ROT] fp8
    q_nope_out_ptr,  # [nnz, Hq, NOPE] fp8
    k_rope_out_ptr,  # rows (a, b, h): [nnz, Hk, ROT] with (a, b) = (token, 0), or the cache with (page, slot)
    k_nope_out_ptr,  # rows (a, b, h), NOPE wide
    v_out_ptr,  # rows (a, b, h), VD wide (HAS_V)
    cache_ptr,  # [max_pos, ROT] float32: [cos | sin]
    pos_ptr,  # [nnz] RoPE positions
    batch_indices_ptr,  # [nnz] (APPEND)
    positions_ptr,  # [nnz] positions in the KV sequence (APPEND)
    kv_indices_ptr,  # [num_indices] page ids (APPEND)
    kv_indptr_ptr,  # [batch_size + 1] (APPEND)
    err_ptr,  # the fault record (tritoninfer/_errors.py) (APPEND)
    nnz, num_q_heads, num_k_heads, units_per_prog, max_pos,
    batch_size, num_pages, num_indices, page_size,
    s_qr_n, s_qr_h, s_qn_n, s_qn_h, s_oqr_n, s_oqr_h, s_oqn_n, s_oqn_h,
    s_kr_n, s_kr_h, s_kn_n, s_kn_h, s_v_n, s_v_h,
    s_okr_a, s_okr_b, s_okr_h, s_okn_a, s_okn_b, s_okn_h, s_ov_a, s_ov_b, s_ov_h,
    s_cp, s_cd,
    quant_scale_q, quant_scale_kv,
    ROT: tl.constexpr, HALF_PAD: tl.constexpr, NOPE: tl.constexpr, NOPE_PAD: tl.constexpr,
    VD: tl.constexpr, VD_PAD: tl.constexpr, INTERLEAVE: tl.constexpr, APPEND: tl.constexpr,
    HAS_V: tl.constexpr, SOFT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MBITS: tl.constexpr,
    FP8_EBIAS: tl.constexpr, FP8_MAX_BITS: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
):
    """RoPE on the rope part of q and k, everything times its scale and cast to fp8 (saturating):

        q_rope_out = fp8(rope(q_rope) * quant_scale_q),   q_nope_out = fp8(q_nope * quant_scale_q)
        k_rope_out = fp8(rope(k_rope) * quant_scale_kv),  k_nope_out = fp8(k_nope * quant_scale_kv)
        v_out      = fp8(v * quant_scale_kv)                                     (HAS_V)

    cos/sin of pair j at position p are ``cache[p, j]`` / ``cache[p, ROT/2 + j]``; positions outside
    ``[0, max_pos)`` leave the token unrotated. With ``APPEND`` the K (and V) rows go to the paged
    cache: token t to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot ``pos % page_size``
    (``b = batch_indices[t]``, ``pos = positions[t]``); a token whose request, position or page id
    is outside the page table or the cache is not written and is reported in the fault record (by
    the programs of head group 0; codes of append_paged_kv_cache), batch index -1 (padding) silently.

    Grid ``(cdiv(nnz, BLOCK_T), head_groups)``: a program loads positions and cos/sin once for its
    tokens and walks ``units_per_prog`` of the ``Hq + Hk (+ Hk)`` heads (q, then k, then v); with
    ``STAGES > 1`` Triton's pipeliner loads the next heads' rows (cp.async into shared memory) while
    one is rotated and stored.
    """
    HALF: tl.constexpr = ROT // 2
    pid_t = tl.program_id(0)
    pid_g = tl.program_id(1)

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = offs_t < nnz
    t64 = offs_t.to(tl.int64)

    # [BLOCK_T]
    pos = tl.load(pos_ptr + t64, mask=m_t, other=0).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)
    m_j = offs_j < HALF
    m_c = m_t & (pos >= 0) & (pos < max_pos)
    p_c = cache_ptr + pos[:, None] * s_cp + offs_j[None, :] * s_cd
    m_cj = m_c[:, None] & m_j[None, :]
    # [BLOCK_T, HALF_PAD]
    cos = tl.load(p_c, mask=m_cj, other=1.0).to(tl.float32)
    # [BLOCK_T, HALF_PAD]
    sin = tl.load(p_c + HALF * s_cd, mask=m_cj, other=0.0).to(tl.float32)
    if INTERLEAVE:
        e1 = 2 * offs_j
        e2 = 2 * offs_j + 1
    else:
        e1 = offs_j
        e2 = offs_j + HALF
    offs_n = tl.arange(0, NOPE_PAD)
    m_rot = m_t[:, None] & m_j[None, :]
    m_nope = m_t[:, None] & (offs_n < NOPE)[None, :]

    if APPEND:
        row_a, row_b, m_kv = append_slots(t64, m_t, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
                                          err_ptr, batch_size, num_pages, num_indices, page_size, pid_g == 0)
    else:
        m_kv = m_t
        row_a = t64
        row_b = t64 * 0

    num_qk = num_q_heads + num_k_heads
    num_units = num_qk
    if HAS_V:
        num_units = num_qk + num_k_heads
    # int64 loop bounds: the head index multiplies strides
    u_begin = pid_g.to(tl.int64) * units_per_prog
    u_end = tl.minimum(u_begin + units_per_prog, num_units)
    for h in tl.range(u_begin, tl.minimum(u_end, num_q_heads), num_stages=STAGES):
        _rope_quant_head(q_rope_ptr, q_rope_out_ptr, t64 * s_qr_n + h * s_qr_h, t64 * s_oqr_n + h * s_oqr_h,
                         m_rot, m_rot, e1, e2, cos, sin, quant_scale_q,
                         SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
        if NOPE > 0:
            _quant_rows(q_nope_ptr, q_nope_out_ptr, t64 * s_qn_n + h * s_qn_h, t64 * s_oqn_n + h * s_oqn_h,
                        offs_n, m_nope, m_nope, quant_scale_q,
                        SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
    m_rot_kv = m_kv[:, None] & m_j[None, :]
    m_nope_kv = m_kv[:, None] & (offs_n < NOPE)[None, :]
    for h in tl.range(tl.maximum(u_begin, num_q_heads), tl.minimum(u_end, num_qk), num_stages=STAGES):
        hk = h - num_q_heads
        _rope_quant_head(k_rope_ptr, k_rope_out_ptr, t64 * s_kr_n + hk * s_kr_h,
                         row_a * s_okr_a + row_b * s_okr_b + hk * s_okr_h,
                         m_rot, m_rot_kv, e1, e2, cos, sin, quant_scale_kv,
                         SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
        if NOPE > 0:
            _quant_rows(k_nope_ptr, k_nope_out_ptr, t64 * s_kn_n + hk * s_kn_h,
                        row_a * s_okn_a + row_b * s_okn_b + hk * s_okn_h,
                        offs_n, m_nope, m_nope_kv, quant_scale_kv,
                        SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
    if HAS_V:
        offs_v = tl.arange(0, VD_PAD)
        m_vd = (offs_v < VD)[None, :]
        for h in tl.range(tl.maximum(u_begin, num_qk), u_end, num_stages=STAGES):
            hv = h - num_qk
            _quant_rows(v_ptr, v_out_ptr, t64 * s_v_n + hv * s_v_h,
                        row_a * s_ov_a + row_b * s_ov_b + hv * s_ov_h,
                        offs_v, m_t[:, None] & m_vd, m_kv[:, None] & m_vd, quant_scale_kv,
                        SOFT_FP8, FP8_MAX, FP8_MBITS, FP8_EBIAS, FP8_MAX_BITS)
