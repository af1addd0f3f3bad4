"""Prefill for Hopper (sm_90) in Gluon, Triton's explicit-layout dialect: FlashAttention-3's
schedule, written out. Used by ``BatchPrefillWithRaggedKVCacheWrapper`` (and so
``single_prefill_with_kv_cache``), and in its paged mode by ``BatchPrefillWithPagedKVCacheWrapper``,
when the attention is plain: 16-bit Q/K/V of one dtype, causal or not, no mask/window/soft
cap/ALiBi/RoPE/sinks/scales (``_route.PrefillRoute``) at head_dim 64, 128 and 256, and at DeepSeek's
head_dim_qk 192 / head_dim_vo 128 over contiguous K/V: Q and K then sit in shared memory as ``QK_CHUNKS``
tiles of 64 columns, TMA boxes being powers of two, and S is that many chained wgmmas).
Everything else, and every other GPU, runs the shared attention core.

A work item: 64 x ``CONSUMERS`` query tokens of one query head. A program (one per SM, persistent) runs items in
turn, as three partitions (``gl.warp_specialize``):
- a producer warp that brings K/V tiles by TMA into a ring of ``STAGES`` shared-memory stages, each
  with a ``ready`` mbarrier (TMA byte count) and an ``empty`` one (every consumer released it);
  (paged K/V whose pages TMA cannot box, page 1 as SGLang's: a producer warpgroup that gathers the rows
  by cp.async into the same ring instead, ``GATHER``);
- ``CONSUMERS`` consumer warpgroups of 64 query rows each: two, three at head_dim 64 (FlashAttention-3's
  192-row tiles there: a tile's softmax costs as much as at 128 for half the wgmma work, so a third
  warpgroup's softmax overlaps the other two's wgmmas). A consumer issues the wgmma of S_j = Q K_j^T before
  the wgmma of O += P_{j-1} V_{j-1} and runs the softmax of S_j while the second one works; P goes
  from the S accumulator's registers into the PV wgmma's A operand. The consumers are tied only
  by the ring, so one's softmax overlaps the other's wgmma.
Scores stay raw; the softmax scale (log2 units) is applied inside exp2's argument.

``FP8`` (e4m3 K/V, bf16 Q): the producer is a warpgroup that brings each tile by TMA into a second,
fp8 ring and converts it into the fp16 ring the consumers read (one ``cvt.rn.f16x2.e4m3x2`` per two
elements, exact; the attention core computes fp8 K/V in fp16 too); the fp8 ring's stages are the
producer's alone (a stage is reused only once this warpgroup has converted its tile). Each consumer
converts its Q tile to fp16 in place once it lands. The call's scales act on the scores
(``k_mult`` = q_scale * k_scale, with the softmax scale) and the output (``v_mult`` = v_scale); both
are 1 for 16-bit K/V.

Gluon code does not run in the Triton interpreter: the CPU test suite covers the selection logic and
the fallback, the ``gpu`` tests this kernel (tests/test_prefill.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gather import publish_stage

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (the wgmma M of one warpgroup)


@gluon.jit
def _softmax_step(s, m_i, l_i, scale, cols, kv_hi, rows_diag, masked, is_causal):
    """Online softmax on raw scores s [ROWS, BLOCK_N] (logits = s * scale, log2 units). ``masked``
    (run time): the tile holds the KV end or the causal diagonal. Returns (p, m, l, alpha)."""
    if masked:
        keep = (cols[None, :] < kv_hi) & ((cols[None, :] <= rows_diag[:, None]) | (is_causal == 0))
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _head_and_tile(item, num_items, num_qo_heads, heads_per_section, head_sections):
    """Work item ``item``'s query head and query tile: heads fastest, or (``head_sections``) heads fastest within
    sections of ``heads_per_section`` heads, one section's items (all its tiles) before the next section's, so
    that the programs running side by side read the K/V of few heads (L2 reuse)."""
    if head_sections:
        per_section = heads_per_section * (num_items // num_qo_heads)
        section = item // per_section
        r = item - section * per_section
        head = section * heads_per_section + r % heads_per_section
        tile = r // heads_per_section
    else:
        head = item % num_qo_heads
        tile = item // num_qo_heads
    return head, tile


@gluon.jit
def _item(item, num_items, num_qo_heads, heads_per_section, head_sections, group, tile_req_ptr, tile_start_ptr,
          qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, is_causal, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work item ``item`` (a ``BLOCK_M``-token query tile of one query head, ``_head_and_tile``): its request's
    first query token, the tile's first token m0, the request's query length, first KV entry (token
    or page-table offset) and KV length, the KV tiles it reads, its query head and its KV head."""
    head, tile = _head_and_tile(item, num_items, num_qo_heads, heads_per_section, head_sections)
    req = gl.load(tile_req_ptr + tile)
    m0 = gl.load(tile_start_ptr + tile)
    q_start = gl.load(qo_indptr_ptr + req)
    q_len = gl.load(qo_indptr_ptr + req + 1) - q_start
    kv_start = gl.load(kv_indptr_ptr + req)
    kv_len = gl.load(kv_len_ptr + req)
    kv_hi = kv_len
    if is_causal:
        kv_hi = gl.minimum(kv_len, m0 + BLOCK_M + kv_len - q_len)
    n_tiles = gl.cdiv(gl.maximum(kv_hi, 0), BLOCK_N)
    return q_start, m0, q_len, kv_start, kv_len, n_tiles, head, head // group


@gluon.jit
def _issue_kv_tile(k_desc, v_desc, k_ring, v_ring, stage, bar, kv_start, kv_len, j, kv_head, kv_indices_ptr,
                   rows_per_page, PAGED: gl.constexpr):
    """Tile j of an item's K/V by TMA into ring stage ``stage`` (of ``v_ring`` [stages, BLOCK_N, D_VO] and
    ``k_ring`` [stages * chunks, BLOCK_N, QC]: K in chunks of QC columns), completing on ``bar``, whose
    byte count the caller set. Contiguous: rows kv_start + j * BLOCK_N ... of the descriptors, K head
    ``kv_head``'s chunks, V its columns. Paged (one chunk): BLOCK_N / PAGE pages, one box [PAGE, D] each
    into its rows of the stage; ``kv_start`` is the request's first entry in ``kv_indices``, page p's
    rows start at row p * rows_per_page of the descriptors. Boxes of pages past the request's end read
    page 0 (their positions are masked by the consumers), so every stage gets the bytes its barrier
    expects."""
    BLOCK_N: gl.constexpr = v_ring.type.shape[1]
    QK_CHUNKS: gl.constexpr = k_ring.type.shape[0] // v_ring.type.shape[0]
    QC: gl.constexpr = k_ring.type.shape[2]
    v_stage = v_ring.index(stage)
    v_col = kv_head * v_ring.type.shape[2]
    if PAGED:
        gl.static_assert(QK_CHUNKS == 1, "paged K/V take K in one chunk")
        k_stage = k_ring.index(stage)
        kv_col = kv_head * QC
        PAGE: gl.constexpr = k_desc.block_type.shape[0]
        n_pages = gl.cdiv(kv_len, PAGE)
        for i in gl.static_range(BLOCK_N // PAGE):
            idx = j * (BLOCK_N // PAGE) + i
            page = gl.load(kv_indices_ptr + kv_start + idx, mask=idx < n_pages, other=0)
            row = page * rows_per_page
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], bar, k_stage.slice(i * PAGE, PAGE))
            tma.async_copy_global_to_shared(v_desc, [row, v_col], bar, v_stage.slice(i * PAGE, PAGE))
    else:
        for c in gl.static_range(QK_CHUNKS):
            tma.async_copy_global_to_shared(k_desc, [kv_start + j * BLOCK_N, (kv_head * QK_CHUNKS + c) * QC], bar,
                                            k_ring.index(stage * QK_CHUNKS + c))
        tma.async_copy_global_to_shared(v_desc, [kv_start + j * BLOCK_N, v_col], bar, v_stage)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
                    stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
                    k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
                    kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
                    num_items, page_size, idle_skip, heads_per_section, head_sections):
    """Producer warp, contiguous K/V: the program's items in turn, tile j of an item (rows kv_start +
    j * BLOCK_N ...) into the ring's next stage once every consumer released its last use; the ring
    runs on across items, so the next item's first tiles load under this one's last. (Constants come
    from the shared-memory and descriptor types: a constexpr passed through ``warp_specialize``'s
    argument tuple arrives as a value.)"""
    _load_tiles(k_desc, v_desc, k_smem, v_smem, q_bar, ready, empty, is_causal, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr,
                kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group, num_items,
                heads_per_section, head_sections, False)


@gluon.jit
def _load_tiles(k_desc, v_desc, k_smem, v_smem, q_bar, ready, empty, is_causal, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr,
                kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group, num_items,
                heads_per_section, head_sections, PAGED: gl.constexpr):
    """The TMA producer warp's loop (contiguous or paged K/V, ``_issue_kv_tile``)."""
    stages: gl.constexpr = v_smem.type.shape[0]
    BLOCK_M: gl.constexpr = ROWS * q_bar.type.shape[0]  # a Q barrier a consumer
    BLOCK_N: gl.constexpr = v_smem.type.shape[1]
    QK_CHUNKS: gl.constexpr = k_smem.type.shape[0] // stages
    # K (its chunks) and V, BLOCK_N rows of boxes each (a page's or the tile's rows)
    kv_bytes: gl.constexpr = BLOCK_N * (QK_CHUNKS * k_desc.block_type.nbytes // k_desc.block_type.shape[0]
                                        + v_desc.block_type.nbytes // v_desc.block_type.shape[0])
    t = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        q_start, m0, q_len, kv_start, kv_len, n_tiles, head, kv_head = _item(
            item, num_items, num_qo_heads, heads_per_section, head_sections, group, tile_req_ptr, tile_start_ptr,
            qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, is_causal, BLOCK_N, BLOCK_M)
        for j in range(n_tiles):
            stage = t % stages
            # empty barriers start "released": the first pass over the ring waits on the other phase
            mbarrier.wait(empty.index(stage), ((t // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), kv_bytes)
            _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, stage, ready.index(stage), kv_start, kv_len, j, kv_head,
                           kv_indices_ptr, rows_per_page, PAGED)
            t += 1


@gluon.jit
def _load_paged_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
                          stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages,
                          sm_scale_log2, k_mult, v_mult, is_causal, qo_indptr_ptr,
                          kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
                          num_qo_heads, group, num_items, page_size, idle_skip, heads_per_section, head_sections):
    """Producer warp, paged K/V: tile j is BLOCK_N / PAGE pages, one TMA box each (``_issue_kv_tile``)."""
    _load_tiles(k_desc, v_desc, k_smem, v_smem, q_bar, ready, empty, is_causal, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr,
                kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group, num_items,
                heads_per_section, head_sections, True)


@gluon.jit
def _gather_paged_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
                            stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages,
                            sm_scale_log2, k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr,
                            kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group, num_items,
                            page_size, idle_skip, heads_per_section, head_sections):
    """Producer warpgroup, paged K/V whose pages TMA cannot box (``GATHER``; page 1: SGLang's cache):
    tile j's rows gathered by cp.async, 16 bytes a thread and copy, in sub-tiles of 8 rows (few
    addresses live at once: the warpgroup keeps 24 registers a thread), into the same ring. The tile's
    page ids (one a position) are loaded once, one a thread, and handed to the sub-tiles through shared
    memory (two buffers: a tile's ids are written while no thread still reads the previous tile's): a
    load a sub-tile made every copy wait for its own round trip (sm_90 SASS: 16 dependent loads a
    128-position tile; session 19 measured this path 3x slower than fa3). A tile's
    copies are one group; the ring's tile t is published (``ready``) before tile t + LAG is issued,
    once its copies are complete, and fenced for the consumers' wgmma (async proxy); the ring runs on
    across items as the TMA producers'. Page ids are clamped into the cache (``_hopper.check_page_ids``
    reports the bad ones); positions past the end read page 0's rows, masked by the consumers."""
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    gl.static_assert(v_smem.type.shape[0] == stages and v_smem.type.shape[2] == HEAD_DIM,
                     "the gather reads K and V rows of one width, K in one chunk")
    BLOCK_M: gl.constexpr = ROWS * q_bar.type.shape[0]
    SUB: gl.constexpr = 8
    LAG: gl.constexpr = stages - 1
    # [SUB, HEAD_DIM]: 8 elements (16 bytes) a thread, a warp across HEAD_DIM / 8 threads of a row
    cols_t: gl.constexpr = HEAD_DIM // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_t, cols_t], [4, 1], [1, 0])
    offs_r = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    # a tile's page ids: one a thread (the warpgroup's 128 threads), through shared memory to the sub-tiles
    ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs_n = gl.arange(0, BLOCK_N, layout=ids_layout)
    ids_smem = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    last_page = (num_pages - 1).to(gl.uint32)
    t = 0
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        q_start, m0, q_len, kv_start, kv_len, n_tiles, head, kv_head = _item(
            item, num_items, num_qo_heads, heads_per_section, head_sections, group, tile_req_ptr, tile_start_ptr,
            qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, is_causal, BLOCK_N, BLOCK_M)
        kv_col = kv_head * HEAD_DIM
        n_pages = gl.cdiv(kv_len, page_size)
        for j in range(n_tiles):
            if t >= LAG:
                async_copy.wait_group(LAG - 1)
                publish_stage(ready, t - LAG, stages)
            stage = t % stages
            idx_n = (j * BLOCK_N + offs_n) // page_size
            ids = ids_smem.index(t % 2)
            ids.store(gl.load(kv_indices_ptr + kv_start + idx_n, mask=idx_n < n_pages, other=0))
            gl.thread_barrier()
            mbarrier.wait(empty.index(stage), ((t // stages) & 1) ^ 1)
            for sub in gl.static_range(BLOCK_N // SUB):
                pos = j * BLOCK_N + sub * SUB + offs_r
                idx = pos // page_size
                page = ids.slice(sub * SUB, SUB).load(gl.SliceLayout(1, layout))
                page = gl.minimum(page.to(gl.uint32, bitcast=True), last_page).to(gl.int64)
                row = (page * rows_per_page + (pos - idx * page_size)) * stride_kv_row + kv_col
                offs = row[:, None] + cols[None, :]
                async_copy.async_copy_global_to_shared(k_smem.index(stage).slice(sub * SUB, SUB), k_ptr + offs)
                async_copy.async_copy_global_to_shared(v_smem.index(stage).slice(sub * SUB, SUB), v_ptr + offs)
            async_copy.commit_group()
            t += 1
    async_copy.wait_group(0)
    for r in range(gl.maximum(t - LAG, 0), t):
        publish_stage(ready, r, stages)


@gluon.jit
def _convert_stage(src, dst):
    """One fp8 stage [BLOCK_N, D] into a 16-bit stage, in chunks of rows a warpgroup
    covers with 8 elements a thread (8 bytes of fp8 in, 16 bytes out): few registers live at once (the
    producer has 32 a thread)."""
    BLOCK_N: gl.constexpr = src.type.shape[0]
    HEAD_DIM: gl.constexpr = src.type.shape[1]
    cols_t: gl.constexpr = HEAD_DIM // 8
    CH: gl.constexpr = 4 * (32 // cols_t)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_t, cols_t], [4, 1], [1, 0])
    for r in gl.static_range(0, BLOCK_N, CH):
        x = src.slice(r, CH).load(layout)
        dst.slice(r, CH).store(x.to(dst.dtype))


@gluon.jit
def _convert_tile(c, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty):
    """Ring tile c: once its fp8 boxes have landed and every consumer released its 16-bit stage, K and
    V converted into that stage and published to the consumers (``publish_stage``)."""
    stages8: gl.constexpr = k8_smem.type.shape[0]
    stages: gl.constexpr = k_smem.type.shape[0]
    s8 = c % stages8
    s = c % stages
    mbarrier.wait(ready8.index(s8), (c // stages8) & 1)
    mbarrier.wait(empty.index(s), ((c // stages) & 1) ^ 1)
    _convert_stage(k8_smem.index(s8), k_smem.index(s))
    _convert_stage(v8_smem.index(s8), v_smem.index(s))
    publish_stage(ready, c, stages)


@gluon.jit
def _fp8_tiles(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty, is_causal,
               qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
               num_qo_heads, group, num_items, heads_per_section, head_sections, PAGED: gl.constexpr):
    """The fp8 producer warpgroup's loop (``FP8``): tile t by TMA into fp8 stage t % S8 (one elected
    thread issues it), and whenever S8 tiles are in flight the oldest converted into the 16-bit ring
    (``_convert_tile``), so a fp8 stage is refilled only after this warpgroup read it; the tiles
    still in flight at the end are converted last."""
    stages8: gl.constexpr = k8_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k8_smem.type.shape[1]
    BLOCK_M: gl.constexpr = ROWS * q_bar.type.shape[0]
    kv_bytes: gl.constexpr = 2 * BLOCK_N * k_desc.block_type.nbytes // k_desc.block_type.shape[0]
    t = 0  # tiles issued
    c = 0  # tiles converted
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        q_start, m0, q_len, kv_start, kv_len, n_tiles, head, kv_head = _item(
            item, num_items, num_qo_heads, heads_per_section, head_sections, group, tile_req_ptr, tile_start_ptr,
            qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, is_causal, BLOCK_N, BLOCK_M)
        for j in range(n_tiles):
            s8 = t % stages8
            mbarrier.expect(ready8.index(s8), kv_bytes)
            _issue_kv_tile(k_desc, v_desc, k8_smem, v8_smem, s8, ready8.index(s8), kv_start, kv_len, j, kv_head,
                           kv_indices_ptr, rows_per_page, PAGED)
            t += 1
            if t - c == stages8:
                _convert_tile(c, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty)
                c += 1
    for r in range(c, t):
        _convert_tile(r, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty)


@gluon.jit
def _fp8_partition(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty, is_causal,
                   qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr,
                   tile_start_ptr, num_qo_heads, group, num_items, heads_per_section, head_sections):
    _fp8_tiles(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty, is_causal,
               qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
               num_qo_heads, group, num_items, heads_per_section, head_sections, False)


@gluon.jit
def _fp8_paged_partition(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty,
                         is_causal, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page,
                         tile_req_ptr, tile_start_ptr, num_qo_heads, group, num_items, heads_per_section,
                         head_sections):
    _fp8_tiles(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty, is_causal,
               qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
               num_qo_heads, group, num_items, heads_per_section, head_sections, True)


@gluon.jit
def _q_origin(item, num_items, num_qo_heads, heads_per_section, head_sections, tile_req_ptr, tile_start_ptr,
              qo_indptr_ptr, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Where a consumer's 64 query rows of ``item`` start in q_desc: (row, column); any valid item's
    for an ``item`` past the last (whose Q is not loaded)."""
    if head_sections:
        head, tile = _head_and_tile(gl.minimum(item, num_items - 1), num_items, num_qo_heads, heads_per_section,
                                    True)
    else:
        tile = gl.minimum(item, num_items - 1) // num_qo_heads
        head = item % num_qo_heads
    row = gl.load(qo_indptr_ptr + gl.load(tile_req_ptr + tile)) + gl.load(tile_start_ptr + tile) + WG * ROWS
    return row, head * HEAD_DIM


@gluon.jit
def _load_q(q_desc, my_q, my_bar, row, col, valid, q_base, QK_CHUNKS: gl.constexpr):
    """A consumer's Q tile by TMA: one box into ``my_q``, or (``QK_CHUNKS`` > 1) one a chunk, into tiles
    q_base ... of ``my_q`` (then all of Q's shared memory, [consumers * chunks, ROWS, QC])."""
    if valid:
        mbarrier.expect(my_bar, QK_CHUNKS * q_desc.block_type.nbytes)
        if QK_CHUNKS == 1:
            tma.async_copy_global_to_shared(q_desc, [row, col], my_bar, my_q)
        else:
            for c in gl.static_range(QK_CHUNKS):
                tma.async_copy_global_to_shared(q_desc, [row, col + c * q_desc.block_type.shape[1]], my_bar,
                                                my_q.index(q_base + c))


@gluon.jit
def _scores(q_op, q_base, k_smem, stage, s_zero, QK_CHUNKS: gl.constexpr):
    """S = Q K^T of ring stage ``stage``, issued asynchronously: one wgmma, or one a chunk of columns
    chained (Q chunk c at ``q_op`` index q_base + c, K chunk c of the stage at ``k_smem`` index
    stage * chunks + c)."""
    if QK_CHUNKS == 1:
        s = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        s = warpgroup_mma(q_op.index(q_base), k_smem.index(stage * QK_CHUNKS).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        for c in gl.static_range(1, QK_CHUNKS):
            s = warpgroup_mma(q_op.index(q_base + c), k_smem.index(stage * QK_CHUNKS + c).permute((1, 0)), s,
                              is_async=True)
    return s


@gluon.jit
def _convert_q(src, dst, layout):
    """A consumer's Q tile into the ring's dtype, in place (``dst`` reinterprets ``src``'s bytes): every
    thread's part read, then written, then made visible to the warpgroup's wgmma."""
    ROWS_Q: gl.constexpr = src.type.shape[0]
    CH: gl.constexpr = 4 * (32 // (src.type.shape[1] // 8))
    for r in gl.static_range(0, ROWS_Q, CH):
        x = src.slice(r, CH).load(layout)
        gl.thread_barrier()
        dst.slice(r, CH).store(x.to(dst.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _attend_tiles(q_op, q_base, k_smem, v_smem, ready, empty, t, n_tiles, m_i, l_i, acc, s_zero, scale, cols0, kv_hi, rows_diag,
                  first_masked, is_causal, p_layout, row_o):
    """A consumer's query rows ``q_op`` (a shared-memory tile or registers) against an item's KV tiles, ring
    tiles t ... t + n_tiles - 1 (n_tiles > 0): S_j = Q K_j^T issued before O += P_{j-1} V_{j-1}, the
    softmax of S_j running under the second wgmma, each stage released once its PV is done. Returns the
    last tile's PV in flight, its stage, and the row maxima and sums: the caller issues what it needs
    meanwhile, then waits for that PV (``warpgroup_mma_wait``) and releases the stage."""
    stages: gl.constexpr = v_smem.type.shape[0]
    BLOCK_N: gl.constexpr = v_smem.type.shape[1]
    QK_CHUNKS: gl.constexpr = k_smem.type.shape[0] // stages
    dtype: gl.constexpr = k_smem.dtype
    stage = t % stages
    mbarrier.wait(ready.index(stage), (t // stages) & 1)
    s_tok = _scores(q_op, q_base, k_smem, stage, s_zero, QK_CHUNKS)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, cols0, kv_hi, rows_diag, 0 >= first_masked, is_causal)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_tiles):
        stage = (t + j) % stages
        prev = (t + j - 1) % stages
        mbarrier.wait(ready.index(stage), ((t + j) // stages) & 1)
        s_tok = _scores(q_op, q_base, k_smem, stage, s_zero, QK_CHUNKS)
        o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, scale, cols0 + j * BLOCK_N, kv_hi, rows_diag,
                                           j >= first_masked, is_causal)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = (t + n_tiles - 1) % stages
    o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    return o_tok, last, m_i, l_i


@gluon.jit
def _release_tiles(ready, empty, t, n):
    """Ring tiles t ... t + n - 1 released without reading them: each once it has landed (so that this
    arrival counts towards its own use of the stage, not the next)."""
    stages: gl.constexpr = ready.type.shape[0]
    for j in range(n):
        stage = (t + j) % stages
        mbarrier.wait(ready.index(stage), ((t + j) // stages) & 1)
        mbarrier.arrive(empty.index(stage), count=1)


@gluon.jit
def _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
             stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
             k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
             kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
             num_items, page_size, idle_skip, heads_per_section, head_sections,
             WG: gl.constexpr):
    """Consumer warpgroup ``WG``: for each of the program's items, query rows m0 + 64 WG ... + 63 of its
    ``BLOCK_M``-token tile against the item's KV tiles up to its own causal limit (the rest released unread). The next item's Q loads once this item's last S is done,
    under the last PV and the epilogue. Where the ring's dtype is not Q's (``FP8``: fp16), the Q tile
    is converted in place once it lands, and the wgmmas read it as the ring's dtype."""
    BLOCK_N: gl.constexpr = v_smem.type.shape[1]
    BLOCK_M: gl.constexpr = ROWS * q_bar.type.shape[0]
    QK_CHUNKS: gl.constexpr = k_smem.type.shape[0] // v_smem.type.shape[0]
    QC: gl.constexpr = k_smem.type.shape[2]  # Q and K columns a chunk (all of head_dim_qk with one chunk)
    HEAD_DIM_VO: gl.constexpr = v_smem.type.shape[2]
    dtype: gl.constexpr = k_smem.dtype  # the wgmmas' operands (P too)
    convert_q: gl.constexpr = dtype != q_desc.dtype
    q_load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (QC // 8), QC // 8], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM_VO, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    offs_d = gl.arange(0, HEAD_DIM_VO, layout=gl.SliceLayout(0, o_layout))

    q_base = WG * QK_CHUNKS  # with chunks: this warpgroup's first Q tile, my_q all of Q's shared memory
    if QK_CHUNKS == 1:
        my_q = q_smem.index(WG)
    else:
        gl.static_assert(not convert_q, "fp8 K/V take Q in one chunk")
        my_q = q_smem
    my_q_mma = my_q._reinterpret(dtype, [ROWS, QC], q_desc.layout) if convert_q else my_q
    my_bar = q_bar.index(WG)
    scale = sm_scale_log2 * k_mult
    first = gl.program_id(0)
    step = gl.num_programs(0)
    q_row, q_col = _q_origin(first, num_items, num_qo_heads, heads_per_section, head_sections, tile_req_ptr,
                             tile_start_ptr, qo_indptr_ptr, WG, QK_CHUNKS * QC)
    _load_q(q_desc, my_q, my_bar, q_row, q_col, first < num_items, q_base, QK_CHUNKS)
    t = 0  # KV tiles of the ring consumed before this item
    q_phase = 0
    for item in range(first, num_items, step):
        q_start, m0, q_len, kv_start, kv_len, n_tiles, head, kv_head = _item(
            item, num_items, num_qo_heads, heads_per_section, head_sections, group, tile_req_ptr, tile_start_ptr,
            qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, is_causal, BLOCK_N, BLOCK_M)
        # the next item's Q origin, read now so the loads are done when its TMA is issued
        q_row, q_col = _q_origin(item + step, num_items, num_qo_heads, heads_per_section, head_sections,
                                 tile_req_ptr, tile_start_ptr, qo_indptr_ptr, WG, QK_CHUNKS * QC)
        r0 = m0 + WG * ROWS
        # this warpgroup's KV limit (causal: bottom-right aligned) and its first tile that needs a mask
        kv_hi = kv_len
        if is_causal:
            kv_hi = gl.minimum(kv_len, r0 + ROWS + kv_len - q_len)
        first_masked = kv_hi // BLOCK_N
        if is_causal:
            first_masked = gl.minimum(first_masked, gl.maximum(r0 + kv_len - q_len + 1, 0) // BLOCK_N)
        mbarrier.wait(my_bar, q_phase)
        q_phase ^= 1
        if convert_q:
            _convert_q(my_q, my_q_mma, q_load_layout)
        rows_diag = r0 + gl.arange(0, ROWS, layout=row_s) + kv_len - q_len
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM_VO], gl.float32, layout=o_layout)

        # the item's tiles past this warpgroup's causal limit (the later rows' diagonal) are released unread, and
        # (``IDLE_SKIP``) all of them where its rows are past the request's last query token
        n_mine = gl.minimum(n_tiles, gl.cdiv(gl.maximum(kv_hi, 0), BLOCK_N))
        if idle_skip:
            if r0 >= q_len:
                n_mine = 0
        if n_mine > 0:
            o_tok, last, m_i, l_i = _attend_tiles(my_q_mma, q_base, k_smem, v_smem, ready, empty, t, n_mine, m_i, l_i, acc,
                                                  s_zero, scale, cols0, kv_hi, rows_diag, first_masked, is_causal,
                                                  p_layout, row_o)
            # every S of this item is done: the next item's Q may overwrite this one
            _load_q(q_desc, my_q, my_bar, q_row, q_col, item + step < num_items, q_base, QK_CHUNKS)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            mbarrier.arrive(empty.index(last), count=1)
        else:
            _load_q(q_desc, my_q, my_bar, q_row, q_col, item + step < num_items, q_base, QK_CHUNKS)
        _release_tiles(ready, empty, t + n_mine, n_tiles - n_mine)
        t += n_tiles

        # rows that saw no key: output 0, LSE -inf (as the attention core)
        l_o = gl.convert_layout(l_i, row_o)
        o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None] * v_mult
        rows_o = r0 + gl.arange(0, ROWS, layout=row_o)
        ptrs = (o_ptr + (q_start + rows_o).to(gl.int64)[:, None] * stride_o_tok + head * stride_o_head
                + offs_d[None, :])
        gl.store(ptrs, o.to(o_ptr.dtype.element_ty), mask=(rows_o < q_len)[:, None])
        # always written (the launcher passes scratch when the caller wants none): Triton 3.6 fails to
        # lower a warp-specialised region whose store sits under a constant-false condition
        rows_s = r0 + gl.arange(0, ROWS, layout=row_s)
        lse = gl.where(l_i > 0, m_i + gl.log2(l_i), float("-inf"))
        gl.store(lse_ptr + (q_start + rows_s).to(gl.int64) * stride_lse_tok + head, lse, mask=rows_s < q_len)


@gluon.jit
def _consume0(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
              stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
              k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
              kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
              num_items, page_size, idle_skip, heads_per_section, head_sections):
    _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
             stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
             k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
             kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
             num_items, page_size, idle_skip, heads_per_section, head_sections, 0)


@gluon.jit
def _consume1(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
              stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
              k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
              kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
              num_items, page_size, idle_skip, heads_per_section, head_sections):
    _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
             stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
             k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
             kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
             num_items, page_size, idle_skip, heads_per_section, head_sections, 1)


@gluon.jit
def _consume2(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
              stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
              k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
              kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
              num_items, page_size, idle_skip, heads_per_section, head_sections):
    _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok,
             stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2,
             k_mult, v_mult, is_causal, qo_indptr_ptr, kv_indptr_ptr,
             kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr, num_qo_heads, group,
             num_items, page_size, idle_skip, heads_per_section, head_sections, 2)


@gluon.jit
def prefill_hopper_kernel(
    q_desc, k_desc, v_desc, o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, k_ptr, v_ptr,
    stride_kv_row, num_pages, k_mult, v_mult, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, tile_req_ptr, tile_start_ptr,
    num_qo_heads, num_items, sm_scale_log2, kv_indices_ptr, rows_per_page, heads_per_section,
    GROUP: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PAGE_SIZE: gl.constexpr, GATHER: gl.constexpr, FP8: gl.constexpr, FP8_STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, QK_CHUNKS: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr,
    IDLE_SKIP: gl.constexpr, HEAD_SECTIONS: gl.constexpr, num_warps: gl.constexpr,
):
    """q_desc: [tokens, H_qo * D] box [64, D]; o: [tokens, H_qo, D] (any row and head strides); lse:
    [tokens, H_qo] float32 base 2. ``tile_req`` / ``tile_start`` int32 [tiles]: the request and first
    query token of each ``64 * CONSUMERS``-token tile (heaviest first); ``kv_len`` int32 [batch]. Work items are
    (tile, query head), heads fastest, so the heads of a KV group run side by side and share K/V in L2; with
    ``HEAD_SECTIONS``, heads fastest within sections of ``heads_per_section`` heads (a multiple of the group that
    divides num_qo_heads), each section's items before the next's (``_head_and_tile``);
    program p takes items p, p + grid, ... (grid = the SM count: persistent, so one item's epilogue
    and the next one's loads overlap; grid = items runs one item per program). ``num_warps`` is 4:
    the first consumer is the default partition.

    ``BLOCK_N``: K/V positions a ring stage holds (128; 64 at head_dim 256). ``IDLE_SKIP``: a consumer whose rows
    all lie past its request's last query token releases the item's tiles unread (``_hopper.IDLE_SKIP``).
    ``PAGE_SIZE == 0``: contiguous K/V, k_desc / v_desc [kv tokens, H_kv * D] box [BLOCK_N, D],
    ``kv_indptr`` token offsets (``kv_indices_ptr`` and ``rows_per_page`` unused).
    ``PAGE_SIZE > 0`` (8 to BLOCK_N, dividing it): k_desc / v_desc are 2-D views [rows, H_kv * D] of
    the K and V pages, box [PAGE_SIZE, D], page p starting at row p * rows_per_page; ``kv_indptr`` /
    ``kv_indices`` the page table. With ``GATHER`` (any ``PAGE_SIZE``: page 1, SGLang's), the same
    rows are read by cp.async through ``k_ptr`` / ``v_ptr`` (``stride_kv_row`` elements a row,
    ``num_pages`` pages) and the descriptors only give the stages' layout (box [BLOCK_N, D]).
    ``k_ptr`` ... ``num_pages`` are unread otherwise.

    ``QK_CHUNKS`` > 1 (contiguous 16-bit K/V only: head_dim_qk 192 = 3 x 64): q_desc and k_desc read boxes of
    D = head_dim_qk / QK_CHUNKS columns, Q and K held as that many tiles a buffer; v_desc's box [BLOCK_N, D_VO] and
    o [tokens, H_qo, D_VO] may be narrower than head_dim_qk (DeepSeek's non-absorbed prefill: 192 / 128).

    ``FP8``: k_desc / v_desc read e4m3 K/V (either mode above, not ``GATHER``) into ``FP8_STAGES``
    stages, which the producer warpgroup (``PRODUCER_REGS`` registers a thread) converts into the
    consumers' ``STAGES`` fp16 stages; Q (bf16) is converted to fp16 by the consumers. ``k_mult``
    multiplies the scores (with ``sm_scale_log2``), ``v_mult`` the output (1 and 1 without fp8 scales)."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    HEAD_DIM_VO: gl.constexpr = v_desc.block_type.shape[1]
    gl.static_assert((QK_CHUNKS == 1 and HEAD_DIM_VO == HEAD_DIM) or not (FP8 or GATHER or PAGE_SIZE > 0),
                     "paged, gathered and fp8 K/V take one head_dim, in one chunk")
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * QK_CHUNKS, ROWS, HEAD_DIM], q_desc.layout)
    if FP8:
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16)
        k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [STAGES * QK_CHUNKS, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM_VO], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)

    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, o_ptr, stride_o_tok, stride_o_head,
            lse_ptr, stride_lse_tok, k_ptr, v_ptr, stride_kv_row, num_pages, sm_scale_log2, k_mult, v_mult, IS_CAUSAL,
            qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
            num_qo_heads, GROUP, num_items, PAGE_SIZE, IDLE_SKIP, heads_per_section, HEAD_SECTIONS)
    if FP8:
        k8_smem = gl.allocate_shared_memory(k_desc.dtype, [FP8_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v8_smem = gl.allocate_shared_memory(v_desc.dtype, [FP8_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        ready8 = gl.allocate_shared_memory(gl.int64, [FP8_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(FP8_STAGES):
            mbarrier.init(ready8.index(i), count=1)
        args8 = (k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, q_bar, ready, empty, IS_CAUSAL,
                 qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr, kv_indices_ptr, rows_per_page, tile_req_ptr, tile_start_ptr,
                 num_qo_heads, GROUP, num_items, heads_per_section, HEAD_SECTIONS)
        gl.static_assert(CONSUMERS == 2, "the fp8 mode has two consumers")
        if PAGE_SIZE > 0:
            gl.warp_specialize([(_consume0, args), (_consume1, args), (_fp8_paged_partition, args8)], [4, 4],
                               [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume0, args), (_consume1, args), (_fp8_partition, args8)], [4, 4],
                               [CONSUMER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 3:
        # (warp_specialize takes its functions as written here: a helper could not receive the producer)
        if GATHER:
            gl.warp_specialize([(_consume0, args), (_consume1, args), (_consume2, args), (_gather_paged_partition, args)],
                               [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        elif PAGE_SIZE > 0:
            gl.warp_specialize([(_consume0, args), (_consume1, args), (_consume2, args), (_load_paged_partition, args)],
                               [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consume0, args), (_consume1, args), (_consume2, args), (_load_partition, args)],
                               [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    elif GATHER:
        # the producer a warpgroup (registers are handed out per warpgroup: the TMA warp's PRODUCER_REGS)
        gl.warp_specialize([(_consume0, args), (_consume1, args), (_gather_paged_partition, args)], [4, 4],
                           [CONSUMER_REGS, PRODUCER_REGS])
    elif PAGE_SIZE > 0:
        gl.warp_specialize([(_consume0, args), (_consume1, args), (_load_paged_partition, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume0, args), (_consume1, args), (_load_partition, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])
