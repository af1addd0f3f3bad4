"""Multi-head latent attention (absorbed MLA) over a paged latent cache.

Every query head reads the same latent rows (``ckv`` [D_ckv] and ``kpe`` [D_kpe] per KV position), so
one program takes a block of BLOCK_M rows, each a (query token, head) pair of one request (row
``r`` of a work item is token ``r // NUM_HEADS``, head ``r % NUM_HEADS``), and loads each KV tile once
for all of them: the tile is the N of the score dots and the K of the output dot, the rows their
M. Scores are ``q_nope · ckv + q_pe · kpe`` in fp32; the softmax runs in base 2 with the scale folded
into exp2's argument; the output is ``P · ckv`` (the latent is also the value).

An fp8 cache (e4m3/e5m2) is converted to ``DOT_DTYPE`` (fp16) tile by tile, the query once per
program. Its per-tensor scales are folded: ``ckv_scale`` into ``sm_scale_log2`` and ``v_scale`` (the
output), ``kpe_scale / ckv_scale`` into ``q_pe`` on load (``SCALE_Q_PE``), so the loop is unchanged.

Work items are the attention core's (``_plan.py``: request, first query token, kv_start, kv_end,
split, splits, group). A request whose KV is split writes fp32 partial states, merged either by the
last split of a group to arrive (``MERGE_MODE`` 0: the arrival-counter scheme of
``kernels/attention.py``, one launch) or by a second launch over the same work list (``MERGE_MODE``
1, then 2), where each split's program merges its share of the value columns: a [64, 512] float32
state is 128 KB, and one program merging 64 of them alone took ~190 µs on the H200. Page ids and page-table ranges from the caller are bounded here and reported to
the fault record (``kernels/faults.py``), never followed outside the tensors.
"""

import triton
import triton.language as tl

from .attention import finalize, merge_split_columns, softmax_update
from .faults import bound_page_ids, report_bad_pages, report_fault

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mla_tile(m_i, l_i, acc, bad_page, q_nope, q_pe, start, hi, diag,
             ckv_ptr, stride_ckv_page, stride_ckv_slot, kpe_ptr, stride_kpe_page, stride_kpe_slot,
             kv_indices_ptr, page_base, num_pages, offs_c, offs_p, sm_scale_log2,
             HEAD_DIM_CKV: tl.constexpr, HEAD_DIM_KPE: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_CKV: tl.constexpr, BLOCK_KPE: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, FOLD_SCALE: tl.constexpr, KV_AS_M: tl.constexpr):
    """One KV tile ``[start, start + BLOCK_N)`` (positions at or past ``hi`` not read) for the block's
    rows. ``MASKED=False`` is for tiles every row sees in full: no score mask is built. ``diag``
    [BLOCK_M]: the last KV position each row sees (causal)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hi
    # [BLOCK_N] page ids, bounded to the cache (bad ones kept in bad_page for the fault record)
    page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE_SIZE, mask=n_ok, other=0)
    page, bad_page = bound_page_ids(page, bad_page, num_pages)
    slot = offs_n % PAGE_SIZE
    c_rows = page * stride_ckv_page + slot * stride_ckv_slot
    p_rows = page * stride_kpe_page + slot * stride_kpe_slot
    # [BLOCK_N, BLOCK_CKV]: the latent rows, the keys' first part and the values
    ckv = tl.load(ckv_ptr + c_rows[:, None] + offs_c[None, :],
                  mask=n_ok[:, None] & (offs_c < HEAD_DIM_CKV)[None, :], other=0.0).to(DOT_DTYPE)
    # [BLOCK_N, BLOCK_KPE]
    kpe = tl.load(kpe_ptr + p_rows[:, None] + offs_p[None, :],
                  mask=n_ok[:, None] & (offs_p < HEAD_DIM_KPE)[None, :], other=0.0).to(DOT_DTYPE)
    # [BLOCK_M, BLOCK_N]
    if KV_AS_M:
        # KV positions as the M of the dots (wgmma needs M >= 64, reading the latent tile from shared
        # memory), the few rows as N: mma.sync with 16 rows would hold the whole tile in registers
        s = tl.trans(tl.dot(kpe, tl.trans(q_pe), tl.dot(ckv, tl.trans(q_nope))))
    else:
        s = tl.dot(q_nope, tl.trans(ckv))
        s = tl.dot(q_pe, tl.trans(kpe), s)
    if not FOLD_SCALE:
        s = s * sm_scale_log2
    keep = True
    if MASKED:
        keep = n_ok[None, :]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= diag[:, None])
    m_i, l_i, acc, p = softmax_update(m_i, l_i, acc, s, keep, sm_scale_log2, FOLD_SCALE)
    if KV_AS_M:
        acc = tl.trans(tl.dot(tl.trans(ckv), tl.trans(p.to(DOT_DTYPE)), tl.trans(acc)))
    else:
        acc = tl.dot(p.to(DOT_DTYPE), ckv, acc)
    return m_i, l_i, acc, bad_page


@triton.jit
def mla_merge(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, lse_scale, v_scale,
              part_o_ptr, part_lse_ptr, first, num_splits, o_rows, lse_rows, head, row_ok, chunk_lo, chunk_hi,
              NUM_HEADS: tl.constexpr, HEAD_DIM_CKV: tl.constexpr, BLOCK_M: tl.constexpr,
              DV_CHUNK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, WRITE_LSE: tl.constexpr):
    """The final output of the block's rows from their ``num_splits`` partial states (``first``
    [BLOCK_M]: each row's first state), ``DV_CHUNK`` value columns at a time, chunks ``chunk_lo`` to
    ``chunk_hi`` (the LSE with chunk 0). The states were written by other programs (of this launch,
    or of the previous one): loaded through L2 (``.cg``), never from a stale L1 line."""
    offs_s = tl.arange(0, SPLIT_BLOCK)
    for chunk in range(chunk_lo, chunk_hi):
        offs_d = chunk * DV_CHUNK + tl.arange(0, DV_CHUNK)
        d_ok = offs_d < HEAD_DIM_CKV
        m_i, l_i, acc = merge_split_columns(part_o_ptr, part_lse_ptr, first, num_splits, NUM_HEADS, head, row_ok,
                                            offs_s, offs_d, d_ok, HEAD_DIM_CKV, BLOCK_M, DV_CHUNK, SPLIT_BLOCK)
        o, lse = finalize(m_i, l_i, acc, 0.0, v_scale, False)
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:
            if chunk == 0:
                tl.store(lse_ptr + lse_rows, lse * lse_scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_pages", "num_indices"])
def mla_fwd_kernel(
    # The arguments that change from call to call come first, those fixed by the plan after them
    # (``tritoninfer/mla.py`` binds the second group once per plan).
    # q_nope [rows, H, D_ckv], q_pe [rows, H, D_kpe]; o [rows, H, D_ckv]; lse [rows, H] float32
    q_nope_ptr, stride_qn_tok, stride_qn_head,
    q_pe_ptr, stride_qp_tok, stride_qp_head,
    # ckv [pages, page_size, D_ckv], kpe [pages, page_size, D_kpe] (element strides; last dim contiguous)
    ckv_ptr, stride_ckv_page, stride_ckv_slot,
    kpe_ptr, stride_kpe_page, stride_kpe_slot, num_pages,
    o_ptr, stride_o_tok, stride_o_head,
    lse_ptr, stride_lse_tok, stride_lse_head,
    # softmax scale times log2(e) (and ckv_scale); the LSE's factor on store (1: base 2, ln 2: base e);
    # q_pe's factor (kpe_scale / ckv_scale, read with SCALE_Q_PE); the output's (ckv_scale)
    sm_scale_log2, lse_scale, q_pe_scale, v_scale,
    # split-KV partial states: o [states, H, D_ckv] fp32, lse [states, H] fp32; arrival counters int32
    # [groups * row programs], zero between launches
    part_o_ptr, part_lse_ptr, counter_ptr,
    # plan: work items int32 [capacity, 7] = (request, first query token, kv_start, kv_end, split,
    # splits of the request, group); request < 0 marks an unused slot
    work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr, state_offset_ptr,
    # the fault record (tritoninfer/_errors.py), the length of kv_indices, query tokens per work item
    err_ptr, num_indices, tile_tokens,
    NUM_HEADS: tl.constexpr, HEAD_DIM_CKV: tl.constexpr, HEAD_DIM_KPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_CKV: tl.constexpr, BLOCK_KPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FOLD_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr, KV_AS_M: tl.constexpr, MASK_FREE_TILES: tl.constexpr,
    MERGE_DV_CHUNK: tl.constexpr, MERGE_SPLIT_BLOCK: tl.constexpr, SCALE_Q_PE: tl.constexpr,
    MERGE_MODE: tl.constexpr,
):
    """Grid ``(row programs, work items)``: the row programs of one item are neighbours in launch
    order, so their reads of the same KV tiles meet in L2. ``MERGE_MODE``: 0, a split item writes its
    partial state and the last of its group merges them; 1, it only writes it; 2 (the launch after a
    1), no attention: the item's program merges chunks ``split * c .. (split + 1) * c`` of its rows'
    value columns (``c`` = the chunks over the splits, rounded up)."""
    i_rows = tl.program_id(0)
    i_item = tl.program_id(1)
    w = work_ptr + i_item * 7
    req = tl.load(w)
    if req < 0:
        return
    q_tile_start = tl.load(w + 1)
    kv_start = tl.load(w + 2)
    kv_end = tl.load(w + 3)
    split = tl.load(w + 4)
    num_splits = tl.load(w + 5)

    q_start = tl.load(qo_indptr_ptr + req)
    q_len = tl.load(qo_indptr_ptr + req + 1) - q_start
    tile_end = tl.minimum(q_tile_start + tile_tokens, q_len)
    row0 = i_rows * BLOCK_M
    if row0 >= (tile_end - q_tile_start) * NUM_HEADS:
        return  # a row program past this item's rows (its request has fewer query tokens)
    offs_r = row0 + tl.arange(0, BLOCK_M)
    tok = q_tile_start + offs_r // NUM_HEADS
    head = offs_r % NUM_HEADS
    row_ok = tok < tile_end
    kv_len = tl.load(kv_len_ptr + req)
    # [BLOCK_M] the last KV position each row sees (bottom-right aligned causal mask)
    diag = tok + kv_len - q_len

    offs_c = tl.arange(0, BLOCK_CKV)
    offs_p = tl.arange(0, BLOCK_KPE)
    q_tok = (q_start + tok).to(tl.int64)
    o_rows = q_tok * stride_o_tok + head.to(tl.int64) * stride_o_head
    lse_rows = q_tok * stride_lse_tok + head.to(tl.int64) * stride_lse_head
    if MERGE_MODE == 2:
        if num_splits > 1:
            chunks: tl.constexpr = BLOCK_CKV // MERGE_DV_CHUNK
            share = (chunks + num_splits - 1) // num_splits
            first = tl.load(state_offset_ptr + req) + tok * num_splits
            mla_merge(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, lse_scale, v_scale,
                      part_o_ptr, part_lse_ptr, first, num_splits, o_rows, lse_rows, head, row_ok,
                      tl.minimum(split * share, chunks), tl.minimum((split + 1) * share, chunks),
                      NUM_HEADS, HEAD_DIM_CKV, BLOCK_M, MERGE_DV_CHUNK, MERGE_SPLIT_BLOCK, WRITE_LSE)
        return
    # [BLOCK_M, BLOCK_CKV]
    q_nope = tl.load(q_nope_ptr + (q_tok * stride_qn_tok + head * stride_qn_head)[:, None] + offs_c[None, :],
                     mask=row_ok[:, None] & (offs_c < HEAD_DIM_CKV)[None, :], other=0.0).to(DOT_DTYPE)
    # [BLOCK_M, BLOCK_KPE]
    q_pe = tl.load(q_pe_ptr + (q_tok * stride_qp_tok + head * stride_qp_head)[:, None] + offs_p[None, :],
                   mask=row_ok[:, None] & (offs_p < HEAD_DIM_KPE)[None, :], other=0.0)
    if SCALE_Q_PE:
        # kpe's scale relative to ckv's (already in sm_scale_log2), applied once here, not per tile
        q_pe = q_pe.to(tl.float32) * q_pe_scale
    q_pe = q_pe.to(DOT_DTYPE)

    page_base = tl.load(kv_indptr_ptr + req)
    lo = kv_start
    hi = kv_end
    first_tok = q_tile_start + row0 // NUM_HEADS
    full_hi = hi
    if IS_CAUSAL:
        last_tok = tl.minimum(q_tile_start + (row0 + BLOCK_M - 1) // NUM_HEADS, tile_end - 1)
        hi = tl.minimum(hi, last_tok + kv_len - q_len + 1)
        full_hi = tl.minimum(hi, first_tok + kv_len - q_len + 1)
    # the request's entries of kv_indices must exist: a page table from device memory (CUDA-graph
    # buffers) is bounded here, once per program, and a request that runs past it is cut short
    table_end = tl.where(page_base < 0, 0, (num_indices - page_base.to(tl.int64)) * PAGE_SIZE)
    if hi > table_end:
        report_fault(err_ptr, 2, req, page_base, num_indices)
        hi = tl.maximum(tl.minimum(hi, table_end), lo).to(hi.dtype)
    full_hi = tl.minimum(full_hi, hi)
    full_end = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N  # MASK_FREE_TILES only
    page_base = tl.maximum(page_base, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_CKV], tl.float32)
    # [BLOCK_N] the largest page ids (unsigned) met so far (bound_page_ids)
    bad_page = tl.zeros([BLOCK_N], tl.uint32)
    if MASK_FREE_TILES:
        # tiles every row sees in full, without a score mask; then the rest, masked
        for start in tl.range(lo, full_end, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc, bad_page = mla_tile(
                m_i, l_i, acc, bad_page, q_nope, q_pe, start, hi, diag, ckv_ptr, stride_ckv_page, stride_ckv_slot,
                kpe_ptr, stride_kpe_page, stride_kpe_slot, kv_indices_ptr, page_base, num_pages, offs_c, offs_p,
                sm_scale_log2, HEAD_DIM_CKV, HEAD_DIM_KPE, BLOCK_N, BLOCK_CKV, BLOCK_KPE, PAGE_SIZE, DOT_DTYPE,
                False, IS_CAUSAL, FOLD_SCALE, KV_AS_M)
        for start in tl.range(full_end, hi, BLOCK_N):
            m_i, l_i, acc, bad_page = mla_tile(
                m_i, l_i, acc, bad_page, q_nope, q_pe, start, hi, diag, ckv_ptr, stride_ckv_page, stride_ckv_slot,
                kpe_ptr, stride_kpe_page, stride_kpe_slot, kv_indices_ptr, page_base, num_pages, offs_c, offs_p,
                sm_scale_log2, HEAD_DIM_CKV, HEAD_DIM_KPE, BLOCK_N, BLOCK_CKV, BLOCK_KPE, PAGE_SIZE, DOT_DTYPE,
                True, IS_CAUSAL, FOLD_SCALE, KV_AS_M)
    else:
        # one loop, every tile masked: at 64 rows the 64 x 512 fp32 accumulator takes half of the
        # 255 registers, and with a second loop body ptxas spills (124-220 bytes for sm_90) where
        # one body spills nothing
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            m_i, l_i, acc, bad_page = mla_tile(
                m_i, l_i, acc, bad_page, q_nope, q_pe, start, hi, diag, ckv_ptr, stride_ckv_page, stride_ckv_slot,
                kpe_ptr, stride_kpe_page, stride_kpe_slot, kv_indices_ptr, page_base, num_pages, offs_c, offs_p,
                sm_scale_log2, HEAD_DIM_CKV, HEAD_DIM_KPE, BLOCK_N, BLOCK_CKV, BLOCK_KPE, PAGE_SIZE, DOT_DTYPE,
                True, IS_CAUSAL, FOLD_SCALE, KV_AS_M)
    report_bad_pages(err_ptr, bad_page, num_pages, req)

    if num_splits == 1:
        o, lse = finalize(m_i, l_i, acc, 0.0, v_scale, False)
        tl.store(o_ptr + o_rows[:, None] + offs_c[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_c < HEAD_DIM_CKV)[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + lse_rows, lse * lse_scale, mask=row_ok)
    else:
        # unscaled partial state: v_scale is applied once, by the merge
        o, lse = finalize(m_i, l_i, acc, 0.0, 1.0, False)
        first = tl.load(state_offset_ptr + req) + tok * num_splits
        st_row = (first + split).to(tl.int64) * NUM_HEADS + head
        tl.store(part_o_ptr + st_row[:, None] * HEAD_DIM_CKV + offs_c[None, :], o,
                 mask=row_ok[:, None] & (offs_c < HEAD_DIM_CKV)[None, :])
        tl.store(part_lse_ptr + st_row, lse, mask=row_ok)
        if MERGE_MODE == 0:
            # the last split of the group to arrive merges them all: every thread's stores are done
            # (barrier) before one thread's release; its acquire orders the other splits' stores first
            tl.debug_barrier()
            group = tl.load(w + 6)
            counter = counter_ptr + group.to(tl.int64) * tl.num_programs(0) + i_rows
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.store(counter, 0)  # every split has arrived: nothing else reads it in this launch
                mla_merge(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, lse_scale,
                          v_scale, part_o_ptr, part_lse_ptr, first, num_splits, o_rows, lse_rows, head, row_ok,
                          0, BLOCK_CKV // MERGE_DV_CHUNK, NUM_HEADS, HEAD_DIM_CKV, BLOCK_M, MERGE_DV_CHUNK,
                          MERGE_SPLIT_BLOCK, WRITE_LSE)
