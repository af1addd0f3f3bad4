"""Merging attention states (output, base-2 LSE): the public ``merge_state*`` kernels."""

import triton
import triton.language as tl

from .attention import finalize, merge_update


@triton.jit
def merge_states_kernel(
    # v [n, S, H, D]; s [n, S, H] float32; out [n, H, D]; lse_out [n, H] float32
    v_ptr, stride_v_n, stride_v_s, stride_v_h,
    s_ptr, stride_s_n, stride_s_s, stride_s_h,
    out_ptr, stride_o_n, stride_o_h,
    lse_out_ptr, stride_lo_n, stride_lo_h,
    mask_ptr, num_heads, num_states,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """One program merges the ``num_states`` states of BLOCK_H heads of one row."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    if HAS_MASK:
        if tl.load(mask_ptr + i_n) == 0:
            return
    offs_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    d_ok = offs_d < HEAD_DIM

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(0, num_states):
        # [BLOCK_H]
        s = tl.load(s_ptr + i_n * stride_s_n + i * stride_s_s + offs_h * stride_s_h, mask=h_ok, other=float("-inf"))
        # [BLOCK_H, BLOCK_D]
        v = tl.load(v_ptr + i_n * stride_v_n + i * stride_v_s + offs_h[:, None] * stride_v_h + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = merge_update(m_i, l_i, acc, s.to(tl.float32), v)

    o, lse = finalize(m_i, l_i, acc, 0.0, 1.0, False)
    tl.store(out_ptr + i_n * stride_o_n + offs_h[:, None] * stride_o_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
    tl.store(lse_out_ptr + i_n * stride_lo_n + offs_h * stride_lo_h, lse, mask=h_ok)


@triton.jit
def merge_state_kernel(
    # v_a, v_b, out [n, H, D]; s_a, s_b, lse_out [n, H] float32 (strides per tensor)
    va_ptr, stride_va_n, stride_va_h, sa_ptr, stride_sa_n, stride_sa_h,
    vb_ptr, stride_vb_n, stride_vb_h, sb_ptr, stride_sb_n, stride_sb_h,
    out_ptr, stride_o_n, stride_o_h, lse_out_ptr, stride_lo_n, stride_lo_h,
    mask_ptr, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Two states per row; ``out``/``lse_out`` may alias ``v_a``/``s_a`` (in-place merge)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    if HAS_MASK:
        if tl.load(mask_ptr + i_n) == 0:
            return
    offs_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]

    # [BLOCK_H]
    s_a = tl.load(sa_ptr + i_n * stride_sa_n + offs_h * stride_sa_h, mask=h_ok, other=float("-inf"))
    s_b = tl.load(sb_ptr + i_n * stride_sb_n + offs_h * stride_sb_h, mask=h_ok, other=float("-inf"))
    # [BLOCK_H, BLOCK_D]
    v_a = tl.load(va_ptr + i_n * stride_va_n + offs_h[:, None] * stride_va_h + offs_d[None, :], mask=hd_ok, other=0.0)
    v_b = tl.load(vb_ptr + i_n * stride_vb_n + offs_h[:, None] * stride_vb_h + offs_d[None, :], mask=hd_ok, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = merge_update(m_i, l_i, acc, s_a.to(tl.float32), v_a)
    m_i, l_i, acc = merge_update(m_i, l_i, acc, s_b.to(tl.float32), v_b)
    o, lse = finalize(m_i, l_i, acc, 0.0, 1.0, False)
    tl.store(out_ptr + i_n * stride_o_n + offs_h[:, None] * stride_o_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=hd_ok)
    tl.store(lse_out_ptr + i_n * stride_lo_n + offs_h * stride_lo_h, lse, mask=h_ok)
