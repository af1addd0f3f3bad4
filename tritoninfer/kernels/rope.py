"""Rotary positional embedding (RoPE) applied to ragged q/k tensors: ``@triton.jit`` code only.

One kernel serves every public form of ``tritoninfer.rope``:

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
