"""Page-table kernels: scatter appended K/V into a paged cache, and token -> (request, position).

``@triton.jit`` code only. The launchers (checks, cache-form normalisation, grid and tile choice)
live in ``tritoninfer/page.py``.
"""

import triton
import triton.language as tl

from .faults import report_fault


@triton.jit
def append_slots(o_t, m_t, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, err_ptr, batch_size,
                 num_pages, num_indices, page_size, report):
    """The cache slot of each appended token ``o_t`` [BLOCK_T] (``m_t``: tokens that exist): page id
    ``kv_indices[kv_indptr[b] + pos // page_size]`` and slot ``pos % page_size`` with
    ``b = batch_indices[t]``, ``pos = positions[t]``, and the mask of tokens to write. A request index,
    position or page id outside the page table or the cache masks the token (never read or written
    past a tensor) and, when ``report``, goes to the fault record; batch index -1 is padding."""
    # [BLOCK_T]
    b_b = tl.load(batch_indices_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    # [BLOCK_T]
    b_pos = tl.load(positions_ptr + o_t, mask=m_t, other=-1).to(tl.int64)
    m_tok = m_t & (b_b != -1)  # tokens that are not padding
    m_req = m_tok & (b_b >= 0) & (b_b < batch_size)
    # [BLOCK_T]
    b_start = tl.load(kv_indptr_ptr + b_b, mask=m_req, other=0).to(tl.int64)
    # [BLOCK_T]
    b_end = tl.load(kv_indptr_ptr + b_b + 1, mask=m_req, other=0).to(tl.int64)
    b_page_in_req = b_pos // page_size
    o_idx = b_start + b_page_in_req
    m_pos = m_req & (b_pos >= 0) & (b_page_in_req < b_end - b_start) & (o_idx >= 0) & (o_idx < num_indices)
    # [BLOCK_T]
    b_page = tl.load(kv_indices_ptr + o_idx, mask=m_pos, other=0).to(tl.int64)
    m_kv = m_pos & (b_page >= 0) & (b_page < num_pages)
    if report:
        if tl.max((m_tok & ~m_req).to(tl.int32), 0) > 0:
            report_fault(err_ptr, 5, 0, tl.max(tl.where(m_tok & ~m_req, b_b, -2147483648), 0), batch_size)
        if tl.max((m_req & ~m_pos).to(tl.int32), 0) > 0:
            bad = m_req & ~m_pos
            report_fault(err_ptr, 4, tl.max(tl.where(bad, b_b, 0), 0), tl.max(tl.where(bad, b_pos, -2147483648), 0),
                         num_indices)
        if tl.max((m_pos & ~m_kv).to(tl.int32), 0) > 0:
            bad = m_pos & ~m_kv
            report_fault(err_ptr, 3, tl.max(tl.where(bad, b_b, 0), 0), tl.max(tl.where(bad, b_page, -2147483648), 0),
                         num_pages)
    return b_page, b_pos % page_size, m_kv


@triton.jit(do_not_specialize=["batch_size", "num_pages", "num_indices"])
def append_paged_kv_cache_kernel(
    k_append_ptr,  # [nnz, H, D]
    v_append_ptr,  # [nnz, H, DV]
    batch_indices_ptr,  # [nnz] int32/int64
    positions_ptr,  # [nnz] int32/int64
    k_cache_ptr,  # [P, page_size, H, D] view (NHD order; HND caches arrive permuted), last dim contiguous
    v_cache_ptr,  # [P, page_size, H, DV] view, last dim contiguous
    kv_indices_ptr,  # [num_indices] page ids
    kv_indptr_ptr,  # [batch_size + 1]
    err_ptr,  # the fault record (tritoninfer/_errors.py)
    nnz,
    batch_size,
    num_pages,
    num_indices,
    page_size,
    stride_ka_t,
    stride_ka_h,
    stride_ka_d,
    stride_va_t,
    stride_va_h,
    stride_va_d,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """cache[kv_indices[kv_indptr[b] + pos // page_size], pos % page_size, h, :] = append[t, h, :]

    with ``b = batch_indices[t]`` and ``pos = positions[t]``. One program moves ``BLOCK_T`` tokens of
    one KV head (grid ``(cdiv(nnz, BLOCK_T), H)``), K and V both, converting to the cache dtype in
    registers (fp16/bf16 -> fp8 for fp8 caches). Tokens whose request index, position or page id
    falls outside the page table are skipped (masked), never written out of bounds, and reported in
    the fault record (by the programs of head 0); batch index -1 marks padding and is skipped silently.
    """
    i_t = tl.program_id(0)
    i_h = tl.program_id(1).to(tl.int64)

    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < nnz
    b_page, b_slot, m_t = append_slots(o_t, m_t, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
                                       err_ptr, batch_size, num_pages, num_indices, page_size, i_h == 0)

    o_ta = o_t.to(tl.int64)

    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    # The K/V loads are masked on the token range only, so they do not wait for the page lookups
    # above; the stores carry the full mask.
    m_in = o_t < nnz
    p_ka = k_append_ptr + (o_ta * stride_ka_t + i_h * stride_ka_h)[:, None] + o_d[None, :] * stride_ka_d
    # [BLOCK_T, BLOCK_D]
    b_k = tl.load(p_ka, mask=m_in[:, None] & (o_d[None, :] < D), other=0.0)
    p_va = v_append_ptr + (o_ta * stride_va_t + i_h * stride_va_h)[:, None] + o_dv[None, :] * stride_va_d
    # [BLOCK_T, BLOCK_DV]
    b_v = tl.load(p_va, mask=m_in[:, None] & (o_dv[None, :] < DV), other=0.0)

    p_kc = k_cache_ptr + (b_page * stride_kc_p + b_slot * stride_kc_s + i_h * stride_kc_h)[:, None] + o_d[None, :]
    tl.store(p_kc, b_k.to(k_cache_ptr.dtype.element_ty), mask=m_t[:, None] & (o_d[None, :] < D))
    p_vc = v_cache_ptr + (b_page * stride_vc_p + b_slot * stride_vc_s + i_h * stride_vc_h)[:, None] + o_dv[None, :]
    tl.store(p_vc, b_v.to(v_cache_ptr.dtype.element_ty), mask=m_t[:, None] & (o_dv[None, :] < DV))


@triton.jit
def batch_indices_positions_kernel(
    append_indptr_ptr,  # [batch_size + 1]
    seq_lens_ptr,  # [batch_size] KV lengths after the append
    batch_indices_ptr,  # [nnz] int32 out
    positions_ptr,  # [nnz] int32 out
    nnz,
    batch_size,
    BLOCK: tl.constexpr,
):
    """For token t of request b: batch_indices[t] = b, positions[t] = seq_lens[b] - (append_indptr[b+1] - t).

    Grid ``(batch_size + 1,)``: program b < batch_size writes request b's tokens; the last program
    writes the tokens ``[append_indptr[batch_size], nnz)`` that belong to no request (padding) as
    batch index -1 and position -1, which ``append_paged_kv_cache_kernel`` skips.
    """
    i_b = tl.program_id(0)
    is_req = i_b < batch_size
    start = tl.load(append_indptr_ptr + i_b).to(tl.int32)
    end = tl.load(append_indptr_ptr + i_b + 1, mask=is_req, other=0).to(tl.int32)
    end = tl.where(is_req, end, nnz)
    seq_len = tl.load(seq_lens_ptr + i_b, mask=is_req, other=0).to(tl.int32)
    b_val = tl.where(is_req, i_b, -1)
    for off in range(start, end, BLOCK):
        o_t = off + tl.arange(0, BLOCK)
        m_t = (o_t < end) & (o_t >= 0) & (o_t < nnz)
        pos = tl.where(is_req, seq_len - (end - o_t), -1)
        tl.store(batch_indices_ptr + o_t, tl.zeros([BLOCK], dtype=tl.int32) + b_val, mask=m_t)
        tl.store(positions_ptr + o_t, pos.to(tl.int32), mask=m_t)
