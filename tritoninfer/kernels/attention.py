"""The attention core shared by decode and prefill, paged and ragged.

One program handles one *work item* (a request, a tile of its query tokens, a range of its KV
positions) for one KV head. Its rows are (query token, query head of the GQA group) pairs, so
each KV tile is loaded once per group and the group is the M dimension of ``tl.dot``; with
``KV_AS_M`` the dots are transposed instead (KV positions as M, the rows as N), which lets Triton
use wgmma with K and V read from shared memory for decode's few rows. The KV loop
(``attend_range``) runs twice: over the tiles every row sees in full without building a score
mask (``MASK_FREE_TILES``), then over the rest with masks.

Everything that defines the attention function lives here once: the logits transform (scale,
soft cap, ALiBi), the masks (causal, sliding window, packed custom mask), on-the-fly RoPE, the
online softmax in base 2, sinks, and the final normalisation. Scores are kept in log2 units
(multiplied by log2(e)) so the softmax uses ``exp2``; the LSE written out is base 2.
"""

import triton
import triton.language as tl

from .faults import bound_page_ids, report_bad_pages, report_fault

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _to_dot(x, DOT_DTYPE: tl.constexpr):
    """Operand for ``tl.dot``: fp8 K/V become the query dtype; under the interpreter everything is
    fp32 (its bf16 ``tl.dot`` is wrong)."""
    return x.to(DOT_DTYPE)


@triton.jit
def v_to_dot(v, DOT_DTYPE: tl.constexpr):
    """V tile [BLOCK_N, BLOCK_DV] as a ``tl.dot`` operand. fp8 is converted to fp16 by inline PTX
    that the compiler may not move (``is_pure=False``): otherwise Triton converts after loading
    fp8 straight into the dot operand layout, which for V (token-major, tokens being the dot's K)
    costs one shared-memory load per byte. This way V is loaded in wide rows, converted and
    re-laid out as fp16 (``ldmatrix.trans``): on sm_90, 809 instead of 1323 instructions and 162
    instead of 206 registers per 128-token fp8 tile, so three programs fit on an SM instead of two.
    (Doing the same to K, whose fp8 rows already load in wide pieces, measured 25 % slower.)"""
    if DOT_DTYPE == tl.float16 and v.dtype == tl.float8e4nv:
        return tl.inline_asm_elementwise(
            "{.reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b;}",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    elif DOT_DTYPE == tl.float16 and v.dtype == tl.float8e5:
        return tl.inline_asm_elementwise(
            "{.reg .b16 a, b; mov.b32 {a, b}, $2; cvt.rn.f16x2.e5m2x2 $0, a; cvt.rn.f16x2.e5m2x2 $1, b;}",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    else:
        return v.to(DOT_DTYPE)


@triton.jit
def rope_rotate(x, x_partner, pos, offs_d, HEAD_DIM: tl.constexpr, rope_rcp_scale, rope_log2_theta):
    """Rotate-half (NeoX-style) rotary embedding over the full head_dim, in fp32.

    x, x_partner: [R, BLOCK_D] (the partner holds element (d + D/2) mod D); pos: [R].
    Frequency of pair j = d mod D/2: theta^(-2j/D) / rope_scale.
    """
    half: tl.constexpr = HEAD_DIM // 2
    j = (offs_d % half).to(tl.float32)
    inv_freq = rope_rcp_scale * tl.exp2(-(2.0 * j / HEAD_DIM) * rope_log2_theta)
    # [R, BLOCK_D]
    angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return x.to(tl.float32) * tl.cos(angle) + sign[None, :] * x_partner.to(tl.float32) * tl.sin(angle)


@triton.jit
def transform_scores(s, sm_scale_log2, soft_cap, HAS_SOFT_CAP: tl.constexpr):
    """Raw q.k -> logits in log2 units. With a soft cap: cap * tanh(x * sm_scale / cap)."""
    if HAS_SOFT_CAP:
        # sm_scale_log2 / LOG2E == sm_scale; tanh(y) = 2 sigmoid(2y) - 1 (libdevice.tanh does not
        # run under the interpreter).
        y = s * (sm_scale_log2 / LOG2E) / soft_cap
        s = soft_cap * LOG2E * (2.0 * tl.sigmoid(2.0 * y) - 1.0)
    else:
        s = s * sm_scale_log2
    return s


@triton.jit
def visible_mask(
    offs_n, tok, kv_len, q_len, window_left, mask_ptr, mask_base, prefix_len, item_lo,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr, MULTI_ITEM: tl.constexpr,
):
    """[R, N] keep-mask of keys ``offs_n`` [N] for query tokens ``tok`` [R] (indices within the request).

    Causal is bottom-right aligned; the window keeps keys >= last visible position - window_left;
    the custom mask is FlashInfer's little-endian bit-packed [q_len, kv_len] row-major bitmap.
    Multi-item scoring (with causal) keeps the keys before ``prefix_len`` and those from the row's
    ``item_lo`` [R] on (``attention_item`` derives them).
    """
    # query token i sits at kv position i + kv_len - q_len
    diag = (tok + kv_len - q_len)[:, None]
    keep = offs_n[None, :] < kv_len
    if IS_CAUSAL:
        keep = keep & (offs_n[None, :] <= diag)
    if HAS_WINDOW:
        keep = keep & (offs_n[None, :] >= diag - window_left)
    if HAS_CUSTOM_MASK:
        bit = tok.to(tl.int64)[:, None] * kv_len + offs_n[None, :]
        byte = tl.load(mask_ptr + mask_base + (bit >> 3), mask=keep, other=0)
        keep = keep & (((byte.to(tl.int32) >> (bit & 7).to(tl.int32)) & 1) != 0)
    if MULTI_ITEM:
        keep = keep & ((offs_n[None, :] < prefix_len) | (offs_n[None, :] >= item_lo[:, None]))
    return keep


@triton.jit
def softmax_update(m_i, l_i, acc, s, keep, scale, FOLD_SCALE: tl.constexpr):
    """One online-softmax step in base 2. Returns (m, l, acc rescaled, p).

    ``s`` are logits in log2 units; with ``FOLD_SCALE`` they are raw scores whose logits are
    ``s * scale`` (``scale > 0``: the launcher never folds another): the row max is taken on the raw
    scores and the scale applied inside exp2's argument, one FFMA per score instead of a multiply
    and a subtraction (as FlashAttention does). Without it ``scale`` is unused.

    Rows that have seen no key keep m = -inf; the max is made finite before subtracting so such
    rows produce p = 0 and alpha = 0 instead of NaN.
    """
    s = tl.where(keep, s, float("-inf"))
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD_SCALE:
        p = tl.exp2(tl.fma(s, scale, -m_safe[:, None]))
    else:
        p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return m_new, l_i, acc, p


@triton.jit
def finalize(m_i, l_i, acc, sink_log2, v_scale, HAS_SINKS: tl.constexpr):
    """Normalised output and base-2 LSE of a state. No key seen: output 0, LSE -inf.

    A sink (a virtual logit in log2 units) adds to the denominator only; the LSE excludes it.
    """
    denom = l_i
    if HAS_SINKS:
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        denom = denom + tl.exp2(sink_log2 - m_safe)
    o = acc * (v_scale / tl.where(denom > 0, denom, 1.0))[:, None]
    # log2 of a positive argument only: the interpreter evaluates both sides of the where (numpy warns)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def item_rows(req, q_tile_start, i_kvh, row0, qo_indptr_ptr, q_len_per_req, tile_tokens,
              GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows ``row0 .. row0 + BLOCK_M`` of a work item: rows are (query token, head of
    the GQA group) pairs. Returns the request's first q row and length, and per row [BLOCK_M] the
    token index within the request, the query head and whether the row exists."""
    if q_len_per_req > 0:
        q_start = req * q_len_per_req
        q_len = q_len_per_req
    else:
        q_start = tl.load(qo_indptr_ptr + req)
        q_len = tl.load(qo_indptr_ptr + req + 1) - q_start
    offs_r = row0 + tl.arange(0, BLOCK_M)
    tok = q_tile_start + offs_r // GROUP
    qo_head = i_kvh * GROUP + offs_r % GROUP
    row_ok = (offs_r // GROUP < tile_tokens) & (tok < q_len)
    return q_start, q_len, tok, qo_head, row_ok


@triton.jit
def store_rows(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, o, lse, q_start, tok, qo_head, row_ok,
               offs_dv, dv_ok, WRITE_LSE: tl.constexpr):
    """Final output [BLOCK_M, BLOCK_DV] (cast to o's dtype) and LSE [BLOCK_M] of the rows."""
    o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + qo_head.to(tl.int64) * stride_o_head
    tl.store(o_ptr + o_rows[:, None] + offs_dv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + (q_start + tok).to(tl.int64) * stride_lse_tok + qo_head, lse, mask=row_ok)


@triton.jit
def kv_row_offsets(offs_n, page, token_base, stride_k_page, stride_k_slot, k_head, stride_v_page, stride_v_slot,
                   v_head, IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of the K and V rows of KV positions ``offs_n`` (any shape): paged (``page``:
    their page ids, int64) or ragged (``token_base``: the request's first KV row; ``page`` unused)."""
    if IS_PAGED:
        # int64 only where it is needed: page * page stride can pass 2^31 elements
        slot = offs_n % PAGE_SIZE
        k_rows = page * stride_k_page + (slot * stride_k_slot + k_head)
        v_rows = page * stride_v_page + (slot * stride_v_slot + v_head)
    else:
        t = token_base + offs_n
        k_rows = t * stride_k_page + k_head
        v_rows = t * stride_v_page + v_head
    return k_rows, v_rows


@triton.jit
def attend_range(
    m_i, l_i, acc, next_page, bad_page, q, lo, end, hi,
    k_ptr, stride_k_page, stride_k_slot, k_head, v_ptr, stride_v_page, stride_v_slot, v_head,
    kv_indices_ptr, num_pages, page_base, token_base, offs_dqk, offs_dqk_partner, dqk_ok, offs_dv, dv_ok,
    tok, kv_len, q_len, window_left, mask_ptr, mask_base, prefix_len, item_lo, row_scale, slope,
    sm_scale_log2, soft_cap, rope_rcp_scale, rope_log2_theta, q_elem,
    HEAD_DIM_QK: tl.constexpr, BLOCK_N: tl.constexpr, IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr, MULTI_ITEM: tl.constexpr, HAS_HEAD_SCALES: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PREFETCH_PAGES: tl.constexpr, KV_AS_M: tl.constexpr, MASKED: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
):
    """Online softmax over the KV tiles starting at lo, lo + BLOCK_N, ... below ``end``; positions
    at or past ``hi`` are not read. ``MASKED=False`` is for tiles that every row sees in full: no
    score mask is built. ``next_page`` holds the page ids of the first tile (with
    ``PREFETCH_PAGES``) and comes back holding those of the tile at ``end``; ``bad_page``
    (``bound_page_ids``) comes back with any page id outside the cache."""
    for start in range(lo, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        page = 0
        if IS_PAGED:
            if PREFETCH_PAGES:
                page = next_page
                offs_next = offs_n + BLOCK_N
                next_page = tl.load(kv_indices_ptr + page_base + offs_next // PAGE_SIZE, mask=offs_next < hi, other=0)
            else:
                page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            page, bad_page = bound_page_ids(page, bad_page, num_pages)
        k_rows, v_rows = kv_row_offsets(offs_n, page, token_base, stride_k_page, stride_k_slot, k_head, stride_v_page,
                                        stride_v_slot, v_head, IS_PAGED, PAGE_SIZE)

        # [BLOCK_N, BLOCK_DQK]
        k = tl.load(k_ptr + k_rows[:, None] + offs_dqk[None, :], mask=n_ok[:, None] & dqk_ok[None, :], other=0.0)
        if HAS_ROPE:
            # [BLOCK_N, BLOCK_DQK]
            k_partner = tl.load(k_ptr + k_rows[:, None] + offs_dqk_partner[None, :],
                                mask=n_ok[:, None] & dqk_ok[None, :], other=0.0)
            k = rope_rotate(k, k_partner, offs_n, offs_dqk, HEAD_DIM_QK, rope_rcp_scale, rope_log2_theta)
            k = k.to(q_elem.dtype)
        k = _to_dot(k, DOT_DTYPE)

        # [BLOCK_M, BLOCK_N]
        if KV_AS_M:
            # KV positions as the M of the dot (>= 64 rows: wgmma with K and V read from shared
            # memory); the few query rows are its N
            s = tl.trans(tl.dot(k, tl.trans(q)))
        else:
            s = tl.dot(q, tl.trans(k))
        if not FOLD_SCALE:
            if HAS_HEAD_SCALES:
                s = s * row_scale[:, None]
            s = transform_scores(s, sm_scale_log2, soft_cap, HAS_SOFT_CAP)
            if HAS_ALIBI:
                s += slope[:, None] * (offs_n[None, :] - tok[:, None]).to(tl.float32)
        keep = True
        if MASKED:
            keep = visible_mask(offs_n, tok, kv_len, q_len, window_left, mask_ptr, mask_base, prefix_len, item_lo,
                                IS_CAUSAL, HAS_WINDOW, HAS_CUSTOM_MASK, MULTI_ITEM)
            keep = keep & n_ok[None, :]
        m_i, l_i, acc, p = softmax_update(m_i, l_i, acc, s, keep, sm_scale_log2, FOLD_SCALE)

        # [BLOCK_N, BLOCK_DV]
        v = tl.load(v_ptr + v_rows[:, None] + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        v = v_to_dot(v, DOT_DTYPE)
        if KV_AS_M:
            acc = tl.trans(tl.dot(tl.trans(v), tl.trans(p.to(DOT_DTYPE)), tl.trans(acc)))
        else:
            acc += tl.dot(p.to(DOT_DTYPE), v)

    return m_i, l_i, acc, next_page, bad_page


@triton.jit
def attend_lanes(
    q, lo, hi, k_ptr, stride_k_page, stride_k_slot, k_head, v_ptr, stride_v_page, stride_v_slot, v_head,
    kv_indices_ptr, num_pages, page_base, token_base, offs_dqk, dqk_ok, offs_dv, dv_ok, sm_scale_log2, soft_cap,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, LANES: tl.constexpr, LANE_TOKENS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """The KV range [lo, hi) for one query row (q [1, BLOCK_DQK]) without ``tl.dot``: a GQA group of
    one would fill 1 of the 16 rows of an mma. Each iteration reads LANES x LANE_TOKENS positions;
    every lane keeps its own online-softmax state, so the only reductions in the loop are over a
    lane's own tokens and over head_dim (within a warp), and the lanes are combined once at the end.
    The caller has already narrowed [lo, hi) to the row's causal and window limits. Returns the
    row's (m [1], l [1], acc [1, BLOCK_DV]) and the bad page ids (``bound_page_ids``) [BLOCK_N]."""
    # [BLOCK_DQK]
    q_row = tl.sum(q.to(tl.float32), 0)
    lane = tl.arange(0, LANES)
    offs_t = tl.arange(0, LANE_TOKENS)
    m_i = tl.full([LANES], float("-inf"), tl.float32)
    l_i = tl.zeros([LANES], tl.float32)
    acc = tl.zeros([LANES, BLOCK_DV], tl.float32)
    # [LANES, LANE_TOKENS]
    bad_page = tl.zeros([LANES, LANE_TOKENS], tl.uint32)
    for start in tl.range(lo, hi, LANES * LANE_TOKENS, num_stages=NUM_STAGES):
        # [LANES, LANE_TOKENS]
        offs_n = start + lane[:, None] * LANE_TOKENS + offs_t[None, :]
        n_ok = offs_n < hi
        page = 0
        if IS_PAGED:
            page = tl.load(kv_indices_ptr + page_base + offs_n // PAGE_SIZE, mask=n_ok, other=0)
            page, bad_page = bound_page_ids(page, bad_page, num_pages)
        k_rows, v_rows = kv_row_offsets(offs_n, page, token_base, stride_k_page, stride_k_slot, k_head, stride_v_page,
                                        stride_v_slot, v_head, IS_PAGED, PAGE_SIZE)
        # [LANES, LANE_TOKENS, BLOCK_DQK]
        k = tl.load(k_ptr + k_rows[:, :, None] + offs_dqk[None, None, :],
                    mask=n_ok[:, :, None] & dqk_ok[None, None, :], other=0.0)
        s = transform_scores(tl.sum(k.to(tl.float32) * q_row[None, None, :], 2), sm_scale_log2, soft_cap,
                             HAS_SOFT_CAP)
        m_i, l_i, acc, p = softmax_update(m_i, l_i, acc, s, n_ok, 1.0, False)
        # [LANES, LANE_TOKENS, BLOCK_DV]
        v = tl.load(v_ptr + v_rows[:, :, None] + offs_dv[None, None, :],
                    mask=n_ok[:, :, None] & dv_ok[None, None, :], other=0.0)
        acc += tl.sum(v.to(tl.float32) * p[:, :, None], 1)
    m_row = tl.max(m_i, 0)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    w = tl.exp2(m_i - m_safe)
    zero = tl.zeros([1], tl.float32)
    return (zero + m_row, zero + tl.sum(l_i * w, 0), tl.sum(acc * w[:, None], 0)[None, :],
            tl.reshape(bad_page, [LANES * LANE_TOKENS]))


@triton.jit
def attention_item(
    # the work item this program runs (its row of the work list)
    i_item,
    # The arguments that change from call to call come first, those fixed by the plan after them
    # (``_attention.AttentionLaunch`` binds the second group once per plan).
    # q [tokens, H_qo, D_qk]; o [tokens, H_qo, D_vo]
    q_ptr, stride_q_tok, stride_q_head,
    o_ptr, stride_o_tok, stride_o_head,
    # paged: K/V element (page, slot, head, d); ragged: (token, -, head, d) with stride_*_slot unused;
    # num_pages: pages of the cache (paged; page ids outside [0, num_pages) are never read)
    k_ptr, stride_k_page, stride_k_slot, stride_k_head,
    v_ptr, stride_v_page, stride_v_slot, stride_v_head, num_pages,
    sm_scale_log2, v_scale,
    # the optional ones (a launch without them binds placeholders with the plan's arguments):
    # lse [tokens, H_qo] float32; sinks [H_qo]; per-head scales (single_prefill's scale_q [H_qo],
    # scale_k [H_kv], scale_v [H_kv])
    lse_ptr, stride_lse_tok, sinks_ptr, scale_q_ptr, scale_k_ptr, scale_v_ptr,
    # split-KV partial states: o [states, H_qo, D_vo] fp32, lse [states, H_qo] fp32; arrival counters
    # int32 [groups * H_kv * row programs], zero between launches
    part_o_ptr, part_lse_ptr, counter_ptr,
    # plan: work items int32 [capacity, 7] = (request, first query token, kv_start, kv_end, split
    # index, number of splits of the request, group); request < 0 marks an unused slot
    work_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr, state_offset_ptr,
    mask_ptr, mask_indptr_ptr, alibi_ptr,
    # the fault record (tritoninfer/_errors.py) and the length of kv_indices
    err_ptr, num_indices,
    q_len_per_req, tile_tokens, state_mult, num_qo_heads,
    soft_cap, rope_rcp_scale, rope_log2_theta, window_left,
    GROUP: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_VO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_ROPE: tl.constexpr,
    HAS_CUSTOM_MASK: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_HEAD_SCALES: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr, PREFETCH_PAGES: tl.constexpr, KV_AS_M: tl.constexpr,
    MASK_FREE_TILES: tl.constexpr, FOLD_SCALE: tl.constexpr, LANES: tl.constexpr, LANE_TOKENS: tl.constexpr,
    NUM_STAGES: tl.constexpr, MERGE_M: tl.constexpr, MERGE_DV_CHUNK: tl.constexpr, MERGE_SPLIT_BLOCK: tl.constexpr,
    MULTI_ITEM: tl.constexpr,
):
    # the dot-free single-row path computes plain (or soft-capped) scores of one row (_attention.attention_variant)
    tl.static_assert(LANES == 0 or not (HAS_ROPE or HAS_ALIBI or HAS_CUSTOM_MASK or HAS_HEAD_SCALES or KV_AS_M
                                        or GROUP != 1 or MULTI_ITEM),
                     "LANES: no RoPE, ALiBi, custom mask, head scales, groups or multi-item scoring")
    # multi-item scoring reads its positions through the custom mask's pointers and is causal
    tl.static_assert(not MULTI_ITEM or (IS_CAUSAL and not HAS_CUSTOM_MASK), "MULTI_ITEM: causal, no custom mask")
    i_kvh = tl.program_id(1)
    i_rows = tl.program_id(2)

    w = work_ptr + i_item * 7
    req = tl.load(w)
    if req < 0:
        return
    q_tile_start = tl.load(w + 1)
    kv_start = tl.load(w + 2)
    kv_end = tl.load(w + 3)
    split = tl.load(w + 4)
    num_splits = tl.load(w + 5)

    q_start, q_len, tok, qo_head, row_ok = item_rows(req, q_tile_start, i_kvh, i_rows * BLOCK_M, qo_indptr_ptr,
                                                     q_len_per_req, tile_tokens, GROUP, BLOCK_M)
    kv_len = tl.load(kv_len_ptr + req)
    tile_end = tl.minimum(q_tile_start + tile_tokens, q_len)

    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dqk_ok = offs_dqk < HEAD_DIM_QK
    dv_ok = offs_dv < HEAD_DIM_VO

    # [BLOCK_M, BLOCK_DQK]
    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + qo_head.to(tl.int64) * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_dqk[None, :], mask=row_ok[:, None] & dqk_ok[None, :], other=0.0)
    if HAS_ROPE:
        offs_dqk_partner = (offs_dqk + HEAD_DIM_QK // 2) % HEAD_DIM_QK
        # [BLOCK_M, BLOCK_DQK]
        q_partner = tl.load(q_ptr + q_rows[:, None] + offs_dqk_partner[None, :],
                            mask=row_ok[:, None] & dqk_ok[None, :], other=0.0)
        q = rope_rotate(q, q_partner, tok + kv_len - q_len, offs_dqk, HEAD_DIM_QK,
                        rope_rcp_scale, rope_log2_theta).to(q_ptr.dtype.element_ty)
    q = _to_dot(q, DOT_DTYPE)

    if HAS_HEAD_SCALES:
        # [BLOCK_M] logit scale per row
        row_scale = tl.load(scale_q_ptr + qo_head, mask=row_ok, other=0.0) * tl.load(scale_k_ptr + i_kvh)
        v_scale = v_scale * tl.load(scale_v_ptr + i_kvh)
    if HAS_ALIBI:
        # [BLOCK_M] slope per row, in log2 units
        slope = tl.load(alibi_ptr + qo_head, mask=row_ok, other=0.0) * LOG2E

    mask_base = 0
    if HAS_CUSTOM_MASK:
        mask_base = tl.load(mask_indptr_ptr + req).to(tl.int64)
    prefix_len = 0
    item_lo = tok
    if MULTI_ITEM:
        # multi-item scoring (FlashInfer's MaskMode::kMultiItemScoring): mask_indptr_ptr holds per request
        # (where sequence position 0 would sit in mask_ptr's token positions within items, prefix
        # length); the row at sequence position p >= prefix_len, t-th token of its item (t = 0: a
        # delimiter), sees its own item's keys from p - t + 1 on and the prefix
        mask_base = tl.load(mask_indptr_ptr + 2 * req).to(tl.int64)
        prefix_len = tl.load(mask_indptr_ptr + 2 * req + 1)
        pos = tok + kv_len - q_len
        in_item = row_ok & (pos >= prefix_len)
        item_pos = tl.load(mask_ptr + mask_base + pos, mask=in_item, other=0)
        item_lo = tl.where(in_item, pos - item_pos + 1, 0)
    if IS_PAGED:
        page_base = tl.load(kv_indptr_ptr + req)
    else:
        token_base = tl.load(kv_indptr_ptr + req).to(tl.int64)

    # KV range this tile can see: causal stops at the last row's diagonal, the window starts at
    # the first row's left edge.
    lo = kv_start
    hi = kv_end
    if IS_CAUSAL:
        hi = tl.minimum(hi, tile_end - 1 + kv_len - q_len + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, q_tile_start + kv_len - q_len - window_left)
    if IS_PAGED:
        # the request's entries of kv_indices must exist: a page table from device memory (CUDA-graph
        # buffers) is bounded here, once per program, and a request that runs past it is cut short
        table_end = tl.where(page_base < 0, 0, (num_indices - page_base.to(tl.int64)) * PAGE_SIZE)
        if hi > table_end:
            report_fault(err_ptr, 2, req, page_base, num_indices)
            hi = tl.maximum(tl.minimum(hi, table_end), lo).to(hi.dtype)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_head = i_kvh * stride_k_head
    v_head = i_kvh * stride_v_head
    if IS_PAGED and PREFETCH_PAGES:
        # page ids of the first tile; each iteration fetches the next tile's, so K/V addresses never
        # wait on a load issued in the same iteration
        offs_first = lo + tl.arange(0, BLOCK_N)
        next_page = tl.load(kv_indices_ptr + page_base + offs_first // PAGE_SIZE, mask=offs_first < hi, other=0)
    if not (IS_PAGED and PREFETCH_PAGES):
        next_page = tl.zeros([BLOCK_N], tl.int32)
    # [BLOCK_N] the largest page ids (unsigned) met so far (bound_page_ids)
    bad_page = tl.zeros([BLOCK_N], tl.uint32)
    if not IS_PAGED:
        page_base = 0
    else:
        token_base = 0
    if not HAS_HEAD_SCALES:
        row_scale = 0.0
    if not HAS_ALIBI:
        slope = 0.0
    if not HAS_ROPE:
        offs_dqk_partner = offs_dqk
    # tiles every row sees in full need no score mask: all of them unless a window or a custom
    # mask is set; with causal, those left of the first row's diagonal
    SPLIT_LOOP: tl.constexpr = MASK_FREE_TILES and not HAS_WINDOW and not HAS_CUSTOM_MASK
    full_end = lo
    if SPLIT_LOOP:
        full_hi = hi
        if IS_CAUSAL:
            full_hi = tl.minimum(full_hi, q_tile_start + kv_len - q_len + 1)
        if MULTI_ITEM:
            full_hi = tl.minimum(full_hi, prefix_len)
        full_end = lo + tl.maximum(full_hi - lo, 0) // BLOCK_N * BLOCK_N
    # the masked tiles: [full_end, hi), with multi-item scoring in two runs that leave out the keys
    # [prefix_len, skip_end) no row of this tile sees (a prefix row sees none past the prefix, an item
    # row none before its item_lo): where multi-item scoring saves its time
    masked_end = hi
    if MULTI_ITEM:
        skip_end = tl.min(tl.where(in_item, item_lo, hi), 0)
        masked_end = tl.minimum(hi, tl.maximum(full_end, prefix_len))
        resume = tl.maximum(full_end + tl.cdiv(masked_end - full_end, BLOCK_N) * BLOCK_N, skip_end)
    if LANES > 0:
        # one query row per program (a GQA group of one): no dots; the window and causal limits
        # are all in [lo, hi)
        m_i, l_i, acc, bad_page = attend_lanes(
            q, lo, hi, k_ptr, stride_k_page, stride_k_slot, k_head, v_ptr, stride_v_page, stride_v_slot, v_head,
            kv_indices_ptr, num_pages, page_base, token_base, offs_dqk, dqk_ok, offs_dv, dv_ok, sm_scale_log2, soft_cap,
            BLOCK_DQK, BLOCK_DV, IS_PAGED, PAGE_SIZE, HAS_SOFT_CAP, LANES, LANE_TOKENS, NUM_STAGES)
    # phase 0: the mask-free tiles [lo, full_end); phase 1: the rest, masked
    for phase in tl.static_range(2):
        if LANES == 0 and (phase == 1 or SPLIT_LOOP):
            m_i, l_i, acc, next_page, bad_page = attend_range(
                m_i, l_i, acc, next_page, bad_page, q, lo if phase == 0 else full_end,
                full_end if phase == 0 else masked_end,
                hi, k_ptr, stride_k_page, stride_k_slot, k_head, v_ptr, stride_v_page, stride_v_slot, v_head,
                kv_indices_ptr, num_pages, page_base, token_base, offs_dqk, offs_dqk_partner, dqk_ok, offs_dv, dv_ok,
                tok, kv_len, q_len, window_left, mask_ptr, mask_base, prefix_len, item_lo, row_scale, slope,
                sm_scale_log2, soft_cap, rope_rcp_scale, rope_log2_theta, tl.zeros([1], q_ptr.dtype.element_ty),
                HEAD_DIM_QK, BLOCK_N, IS_PAGED, PAGE_SIZE, IS_CAUSAL, HAS_WINDOW, HAS_SOFT_CAP, HAS_ALIBI, HAS_ROPE,
                HAS_CUSTOM_MASK, MULTI_ITEM, HAS_HEAD_SCALES, DOT_DTYPE, PREFETCH_PAGES, KV_AS_M, phase == 1,
                FOLD_SCALE)
    if MULTI_ITEM:
        if IS_PAGED and PREFETCH_PAGES:
            offs_resume = resume + tl.arange(0, BLOCK_N)
            next_page = tl.load(kv_indices_ptr + page_base + offs_resume // PAGE_SIZE, mask=offs_resume < hi, other=0)
        m_i, l_i, acc, next_page, bad_page = attend_range(
            m_i, l_i, acc, next_page, bad_page, q, resume, hi, hi,
            k_ptr, stride_k_page, stride_k_slot, k_head, v_ptr, stride_v_page, stride_v_slot, v_head,
            kv_indices_ptr, num_pages, page_base, token_base, offs_dqk, offs_dqk_partner, dqk_ok, offs_dv, dv_ok,
            tok, kv_len, q_len, window_left, mask_ptr, mask_base, prefix_len, item_lo, row_scale, slope,
            sm_scale_log2, soft_cap, rope_rcp_scale, rope_log2_theta, tl.zeros([1], q_ptr.dtype.element_ty),
            HEAD_DIM_QK, BLOCK_N, IS_PAGED, PAGE_SIZE, IS_CAUSAL, HAS_WINDOW, HAS_SOFT_CAP, HAS_ALIBI, HAS_ROPE,
            HAS_CUSTOM_MASK, MULTI_ITEM, HAS_HEAD_SCALES, DOT_DTYPE, PREFETCH_PAGES, KV_AS_M, True, FOLD_SCALE)

    if IS_PAGED:
        report_bad_pages(err_ptr, bad_page, num_pages, req)

    if num_splits == 1:
        sink_log2 = 0.0
        if HAS_SINKS:
            sink_log2 = tl.load(sinks_ptr + qo_head, mask=row_ok, other=0.0) * LOG2E
        o, lse = finalize(m_i, l_i, acc, sink_log2, v_scale, HAS_SINKS)
        store_rows(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, o, lse, q_start, tok, qo_head,
                   row_ok, offs_dv, dv_ok, WRITE_LSE)
    else:
        # unscaled partial state: v_scale and sinks are applied once, by the merge
        o, lse = finalize(m_i, l_i, acc, 0.0, 1.0, False)
        first = tl.load(state_offset_ptr + req) * state_mult + tok * num_splits
        st_row = (first + split).to(tl.int64) * num_qo_heads + qo_head
        tl.store(part_o_ptr + st_row[:, None] * HEAD_DIM_VO + offs_dv[None, :], o,
                 mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(part_lse_ptr + st_row, lse, mask=row_ok)
        # the last split of the group to arrive merges them all: every thread's stores are done
        # (barrier) before one thread's release; its acquire orders the other splits' stores first
        tl.debug_barrier()
        group = tl.load(w + 6)
        counter = counter_ptr + (group.to(tl.int64) * tl.num_programs(1) + i_kvh) * tl.num_programs(2) + i_rows
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # every split has arrived: nothing else reads it in this launch
            # the first MERGE_M rows of the block hold all its real rows (MERGE_M covers a decode
            # item's tokens x group, padded to a power of two, else the whole block): fewer rows,
            # wider loads, fewer dependent rounds on the merge's critical path
            m_start, m_len, m_tok, m_head, m_ok = item_rows(req, q_tile_start, i_kvh, i_rows * BLOCK_M, qo_indptr_ptr,
                                                            q_len_per_req, tile_tokens, GROUP, MERGE_M)
            sink_log2 = 0.0
            if HAS_SINKS:
                sink_log2 = tl.load(sinks_ptr + m_head, mask=m_ok, other=0.0) * LOG2E
            merge_splits(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr,
                         tl.load(state_offset_ptr + req) * state_mult + m_tok * num_splits, num_splits, num_qo_heads,
                         m_start, m_tok, m_head, m_ok, sink_log2, v_scale,
                         HEAD_DIM_VO, MERGE_M, BLOCK_DV, MERGE_DV_CHUNK, MERGE_SPLIT_BLOCK, HAS_SINKS, WRITE_LSE)


@triton.jit(do_not_specialize=["num_pages", "num_indices"])
def attention_fwd_kernel(
    # The arguments that change from call to call come first, those fixed by the plan after them
    # (``_attention.AttentionLaunch`` binds the second group once per plan).
    # q [tokens, H_qo, D_qk]; o [tokens, H_qo, D_vo]
    q_ptr, stride_q_tok, stride_q_head,
    o_ptr, stride_o_tok, stride_o_head,
    # paged: K/V element (page, slot, head, d); ragged: (token, -, head, d) with stride_*_slot unused;
    # num_pages: pages of the cache (paged; page ids outside [0, num_pages) are never read)
    k_ptr, stride_k_page, stride_k_slot, stride_k_head,
    v_ptr, stride_v_page, stride_v_slot, stride_v_head, num_pages,
    sm_scale_log2, v_scale,
    # the optional ones (a launch without them binds placeholders with the plan's arguments):
    # lse [tokens, H_qo] float32; sinks [H_qo]; per-head scales (single_prefill's scale_q [H_qo],
    # scale_k [H_kv], scale_v [H_kv])
    lse_ptr, stride_lse_tok, sinks_ptr, scale_q_ptr, scale_k_ptr, scale_v_ptr,
    # split-KV partial states: o [states, H_qo, D_vo] fp32, lse [states, H_qo] fp32; arrival counters
    # int32 [groups * H_kv * row programs], zero between launches
    part_o_ptr, part_lse_ptr, counter_ptr,
    # plan: work items int32 [capacity, 7] = (request, first query token, kv_start, kv_end, split
    # index, number of splits of the request, group); request < 0 marks an unused slot
    work_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr, state_offset_ptr,
    mask_ptr, mask_indptr_ptr, alibi_ptr,
    # the fault record (tritoninfer/_errors.py) and the length of kv_indices
    err_ptr, num_indices,
    q_len_per_req, tile_tokens, state_mult, num_qo_heads,
    soft_cap, rope_rcp_scale, rope_log2_theta, window_left,
    GROUP: tl.constexpr, HEAD_DIM_QK: tl.constexpr, HEAD_DIM_VO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_ROPE: tl.constexpr,
    HAS_CUSTOM_MASK: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_HEAD_SCALES: tl.constexpr,
    WRITE_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr, PREFETCH_PAGES: tl.constexpr, KV_AS_M: tl.constexpr,
    MASK_FREE_TILES: tl.constexpr, FOLD_SCALE: tl.constexpr, LANES: tl.constexpr, LANE_TOKENS: tl.constexpr,
    NUM_STAGES: tl.constexpr, MERGE_M: tl.constexpr, MERGE_DV_CHUNK: tl.constexpr, MERGE_SPLIT_BLOCK: tl.constexpr,
    MULTI_ITEM: tl.constexpr,
):
    """One launch of the attention core: program (item, KV head, row tile) runs work item ``item``
    (``attention_item``, whose arguments these are)."""
    attention_item(
        tl.program_id(0),
        q_ptr, stride_q_tok, stride_q_head, o_ptr, stride_o_tok, stride_o_head, k_ptr, stride_k_page,
        stride_k_slot, stride_k_head, v_ptr, stride_v_page, stride_v_slot, stride_v_head, num_pages, sm_scale_log2,
        v_scale, lse_ptr, stride_lse_tok, sinks_ptr, scale_q_ptr, scale_k_ptr, scale_v_ptr, part_o_ptr,
        part_lse_ptr, counter_ptr, work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr,
        state_offset_ptr, mask_ptr, mask_indptr_ptr, alibi_ptr, err_ptr, num_indices, q_len_per_req, tile_tokens,
        state_mult, num_qo_heads, soft_cap, rope_rcp_scale, rope_log2_theta, window_left, GROUP, HEAD_DIM_QK,
        HEAD_DIM_VO, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, IS_PAGED, PAGE_SIZE, IS_CAUSAL, HAS_WINDOW,
        HAS_SOFT_CAP, HAS_ALIBI, HAS_ROPE, HAS_CUSTOM_MASK, HAS_SINKS, HAS_HEAD_SCALES, WRITE_LSE, DOT_DTYPE,
        PREFETCH_PAGES, KV_AS_M, MASK_FREE_TILES, FOLD_SCALE, LANES, LANE_TOKENS, NUM_STAGES, MERGE_M,
        MERGE_DV_CHUNK, MERGE_SPLIT_BLOCK, MULTI_ITEM,
    )


@triton.jit(do_not_specialize=["p_num_pages", "d_num_pages", "p_num_indices", "d_num_indices", "num_items_p"])
def attention_pair_kernel(
    p_q_ptr, p_stride_q_tok, p_stride_q_head, p_o_ptr, p_stride_o_tok, p_stride_o_head, p_k_ptr, p_stride_k_page,
    p_stride_k_slot, p_stride_k_head, p_v_ptr, p_stride_v_page, p_stride_v_slot, p_stride_v_head, p_num_pages,
    p_sm_scale_log2, p_v_scale, p_lse_ptr, p_stride_lse_tok, p_sinks_ptr, p_scale_q_ptr, p_scale_k_ptr,
    p_scale_v_ptr, d_q_ptr, d_stride_q_tok, d_stride_q_head, d_o_ptr, d_stride_o_tok, d_stride_o_head, d_k_ptr,
    d_stride_k_page, d_stride_k_slot, d_stride_k_head, d_v_ptr, d_stride_v_page, d_stride_v_slot, d_stride_v_head,
    d_num_pages, d_sm_scale_log2, d_v_scale, d_lse_ptr, d_stride_lse_tok, d_sinks_ptr, d_scale_q_ptr,
    d_scale_k_ptr, d_scale_v_ptr, p_part_o_ptr, p_part_lse_ptr, p_counter_ptr, p_work_ptr, p_qo_indptr_ptr,
    p_kv_indptr_ptr, p_kv_indices_ptr, p_kv_len_ptr, p_state_offset_ptr, p_mask_ptr, p_mask_indptr_ptr,
    p_alibi_ptr, p_err_ptr, p_num_indices, p_q_len_per_req, p_tile_tokens, p_state_mult, p_num_qo_heads,
    p_soft_cap, p_rope_rcp_scale, p_rope_log2_theta, p_window_left, d_part_o_ptr, d_part_lse_ptr, d_counter_ptr,
    d_work_ptr, d_qo_indptr_ptr, d_kv_indptr_ptr, d_kv_indices_ptr, d_kv_len_ptr, d_state_offset_ptr, d_mask_ptr,
    d_mask_indptr_ptr, d_alibi_ptr, d_err_ptr, d_num_indices, d_q_len_per_req, d_tile_tokens, d_state_mult,
    d_num_qo_heads, d_soft_cap, d_rope_rcp_scale, d_rope_log2_theta, d_window_left, num_items_p,
    P_GROUP: tl.constexpr, P_HEAD_DIM_QK: tl.constexpr, P_HEAD_DIM_VO: tl.constexpr, P_BLOCK_M: tl.constexpr,
    P_BLOCK_N: tl.constexpr, P_BLOCK_DQK: tl.constexpr, P_BLOCK_DV: tl.constexpr, P_IS_PAGED: tl.constexpr,
    P_PAGE_SIZE: tl.constexpr, P_IS_CAUSAL: tl.constexpr, P_HAS_WINDOW: tl.constexpr, P_HAS_SOFT_CAP: tl.constexpr,
    P_HAS_ALIBI: tl.constexpr, P_HAS_ROPE: tl.constexpr, P_HAS_CUSTOM_MASK: tl.constexpr,
    P_HAS_SINKS: tl.constexpr, P_HAS_HEAD_SCALES: tl.constexpr, P_WRITE_LSE: tl.constexpr,
    P_DOT_DTYPE: tl.constexpr, P_PREFETCH_PAGES: tl.constexpr, P_KV_AS_M: tl.constexpr,
    P_MASK_FREE_TILES: tl.constexpr, P_FOLD_SCALE: tl.constexpr, P_LANES: tl.constexpr,
    P_LANE_TOKENS: tl.constexpr, P_NUM_STAGES: tl.constexpr, P_MERGE_M: tl.constexpr,
    P_MERGE_DV_CHUNK: tl.constexpr, P_MERGE_SPLIT_BLOCK: tl.constexpr, D_GROUP: tl.constexpr,
    D_HEAD_DIM_QK: tl.constexpr, D_HEAD_DIM_VO: tl.constexpr, D_BLOCK_M: tl.constexpr, D_BLOCK_N: tl.constexpr,
    D_BLOCK_DQK: tl.constexpr, D_BLOCK_DV: tl.constexpr, D_IS_PAGED: tl.constexpr, D_PAGE_SIZE: tl.constexpr,
    D_IS_CAUSAL: tl.constexpr, D_HAS_WINDOW: tl.constexpr, D_HAS_SOFT_CAP: tl.constexpr, D_HAS_ALIBI: tl.constexpr,
    D_HAS_ROPE: tl.constexpr, D_HAS_CUSTOM_MASK: tl.constexpr, D_HAS_SINKS: tl.constexpr,
    D_HAS_HEAD_SCALES: tl.constexpr, D_WRITE_LSE: tl.constexpr, D_DOT_DTYPE: tl.constexpr,
    D_PREFETCH_PAGES: tl.constexpr, D_KV_AS_M: tl.constexpr, D_MASK_FREE_TILES: tl.constexpr,
    D_FOLD_SCALE: tl.constexpr, D_LANES: tl.constexpr, D_LANE_TOKENS: tl.constexpr, D_NUM_STAGES: tl.constexpr,
    D_MERGE_M: tl.constexpr, D_MERGE_DV_CHUNK: tl.constexpr, D_MERGE_SPLIT_BLOCK: tl.constexpr,
    P_MULTI_ITEM: tl.constexpr, D_MULTI_ITEM: tl.constexpr,
):
    """Two planned attention launches in one grid (POD: a prefill batch and a decode batch). Programs
    ``0 .. num_items_p - 1`` of axis 0 run the first launch's work items with its arguments (``p_*``)
    and compile-time choices (``P_*``), the others the second's (``d_*``, ``D_*``). Each half has its
    own work list, tensors, scores, tiles, partial states and split counters; both share the grid's
    other axes (KV heads, row tiles: equal for both halves) and the launch's warps. Each half's
    arguments are ``attention_fwd_kernel``'s: the per-call ones of both halves first, then the plan's."""
    i_item = tl.program_id(0)
    if i_item < num_items_p:
        attention_item(
            i_item,
            p_q_ptr, p_stride_q_tok, p_stride_q_head, p_o_ptr, p_stride_o_tok, p_stride_o_head, p_k_ptr,
            p_stride_k_page, p_stride_k_slot, p_stride_k_head, p_v_ptr, p_stride_v_page, p_stride_v_slot,
            p_stride_v_head, p_num_pages, p_sm_scale_log2, p_v_scale, p_lse_ptr, p_stride_lse_tok, p_sinks_ptr,
            p_scale_q_ptr, p_scale_k_ptr, p_scale_v_ptr, p_part_o_ptr, p_part_lse_ptr, p_counter_ptr, p_work_ptr,
            p_qo_indptr_ptr, p_kv_indptr_ptr, p_kv_indices_ptr, p_kv_len_ptr, p_state_offset_ptr, p_mask_ptr,
            p_mask_indptr_ptr, p_alibi_ptr, p_err_ptr, p_num_indices, p_q_len_per_req, p_tile_tokens, p_state_mult,
            p_num_qo_heads, p_soft_cap, p_rope_rcp_scale, p_rope_log2_theta, p_window_left, P_GROUP, P_HEAD_DIM_QK,
            P_HEAD_DIM_VO, P_BLOCK_M, P_BLOCK_N, P_BLOCK_DQK, P_BLOCK_DV, P_IS_PAGED, P_PAGE_SIZE, P_IS_CAUSAL,
            P_HAS_WINDOW, P_HAS_SOFT_CAP, P_HAS_ALIBI, P_HAS_ROPE, P_HAS_CUSTOM_MASK, P_HAS_SINKS,
            P_HAS_HEAD_SCALES, P_WRITE_LSE, P_DOT_DTYPE, P_PREFETCH_PAGES, P_KV_AS_M, P_MASK_FREE_TILES,
            P_FOLD_SCALE, P_LANES, P_LANE_TOKENS, P_NUM_STAGES, P_MERGE_M, P_MERGE_DV_CHUNK, P_MERGE_SPLIT_BLOCK,
            P_MULTI_ITEM,
        )
    else:
        attention_item(
            i_item - num_items_p,
            d_q_ptr, d_stride_q_tok, d_stride_q_head, d_o_ptr, d_stride_o_tok, d_stride_o_head, d_k_ptr,
            d_stride_k_page, d_stride_k_slot, d_stride_k_head, d_v_ptr, d_stride_v_page, d_stride_v_slot,
            d_stride_v_head, d_num_pages, d_sm_scale_log2, d_v_scale, d_lse_ptr, d_stride_lse_tok, d_sinks_ptr,
            d_scale_q_ptr, d_scale_k_ptr, d_scale_v_ptr, d_part_o_ptr, d_part_lse_ptr, d_counter_ptr, d_work_ptr,
            d_qo_indptr_ptr, d_kv_indptr_ptr, d_kv_indices_ptr, d_kv_len_ptr, d_state_offset_ptr, d_mask_ptr,
            d_mask_indptr_ptr, d_alibi_ptr, d_err_ptr, d_num_indices, d_q_len_per_req, d_tile_tokens, d_state_mult,
            d_num_qo_heads, d_soft_cap, d_rope_rcp_scale, d_rope_log2_theta, d_window_left, D_GROUP, D_HEAD_DIM_QK,
            D_HEAD_DIM_VO, D_BLOCK_M, D_BLOCK_N, D_BLOCK_DQK, D_BLOCK_DV, D_IS_PAGED, D_PAGE_SIZE, D_IS_CAUSAL,
            D_HAS_WINDOW, D_HAS_SOFT_CAP, D_HAS_ALIBI, D_HAS_ROPE, D_HAS_CUSTOM_MASK, D_HAS_SINKS,
            D_HAS_HEAD_SCALES, D_WRITE_LSE, D_DOT_DTYPE, D_PREFETCH_PAGES, D_KV_AS_M, D_MASK_FREE_TILES,
            D_FOLD_SCALE, D_LANES, D_LANE_TOKENS, D_NUM_STAGES, D_MERGE_M, D_MERGE_DV_CHUNK, D_MERGE_SPLIT_BLOCK,
            D_MULTI_ITEM,
        )


@triton.jit
def merge_splits(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, first,
                 num_splits, num_qo_heads, q_start, tok, qo_head, row_ok, sink_log2, v_scale,
                 HEAD_DIM_VO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, DV_CHUNK: tl.constexpr,
                 SPLIT_BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr):
    """The output of BLOCK_M rows from their ``num_splits`` partial states (``first``: each row's first
    state), ``DV_CHUNK`` value columns at a time. The states were written by other programs of this
    launch: loaded through L2 (``.cg``), never from a stale L1 line."""
    offs_s = tl.arange(0, SPLIT_BLOCK)
    for chunk in tl.static_range(BLOCK_DV // DV_CHUNK):
        offs_dv = chunk * DV_CHUNK + tl.arange(0, DV_CHUNK)
        dv_ok = offs_dv < HEAD_DIM_VO
        m_i, l_i, acc = merge_split_columns(part_o_ptr, part_lse_ptr, first, num_splits, num_qo_heads, qo_head,
                                            row_ok, offs_s, offs_dv, dv_ok, HEAD_DIM_VO, BLOCK_M, DV_CHUNK,
                                            SPLIT_BLOCK)
        o, lse = finalize(m_i, l_i, acc, sink_log2, v_scale, HAS_SINKS)
        store_rows(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, o, lse, q_start, tok, qo_head,
                   row_ok, offs_dv, dv_ok, WRITE_LSE and chunk == 0)


@triton.jit
def merge_split_columns(part_o_ptr, part_lse_ptr, first, num_splits, num_heads, head, row_ok, offs_s, offs_d, d_ok,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DV_CHUNK: tl.constexpr,
                        SPLIT_BLOCK: tl.constexpr):
    """The running merge (m, l, acc [BLOCK_M, DV_CHUNK]) of each row's ``num_splits`` partial states
    (``first``: the row's first state; state rows are ``state * num_heads + head``) over the value
    columns ``offs_d``, loaded through L2 (``.cg``): other programs of this launch wrote them."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_CHUNK], tl.float32)
    # SPLIT_BLOCK states per iteration, loaded together: a loop of one state per iteration
    # waits one memory latency per split
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        split_ok = row_ok[:, None] & ((s0 + offs_s) < num_splits)[None, :]
        # [BLOCK_M, SPLIT_BLOCK]
        st_row = (first[:, None] + s0 + offs_s[None, :]).to(tl.int64) * num_heads + head[:, None]
        s_lse = tl.load(part_lse_ptr + st_row, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
        # [BLOCK_M, SPLIT_BLOCK, DV_CHUNK]
        v = tl.load(part_o_ptr + st_row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=split_ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(s_lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(s_lse - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(beta, 1)
        acc = acc * alpha[:, None] + tl.sum(v * beta[:, :, None], 1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def merge_update(m_i, l_i, acc, s, v):
    """Adds a normalised state (v [R, D], base-2 LSE s [R]) to a running merge (m, l, acc).

    The merged output is acc / l and the merged LSE m + log2(l); states with LSE -inf add nothing.
    """
    m_new = tl.maximum(m_i, s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(s - m_safe)
    l_i = l_i * alpha + beta
    acc = acc * alpha[:, None] + v.to(tl.float32) * beta[:, None]
    return m_new, l_i, acc
