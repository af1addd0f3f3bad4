"""Absorbed MLA for Hopper (sm_90) in Gluon: the attention part of ``kernels/mla.py``'s kernel with a
producer warp and two consumer warpgroups, for bf16/fp16 latent caches whose pages TMA can read
(``_route.MlaRoute``). The work list, the partial-state layout and the merge pass are
``kernels/mla.py``'s; this kernel writes what that kernel's attention part writes (``MERGE_MODE`` 1).

A program takes 64 rows of one work item (rows are (query token, head) pairs of one request: row r
is token r // H, head r % H, and q_nope/q_pe are read as 2-D views [tokens * H, D]) and the
item's KV range, in tiles of ``BLOCK_N`` positions:
- the producer warp loads the rows' q_nope (8 boxes of 64 columns) and q_pe once, then each tile's
  latent rows into a ring of ``STAGES`` stages: per page of the tile, 8 boxes of ckv's 512 columns
  and one of kpe's 64, every stage with a ``ready`` barrier (TMA byte count) and an ``empty`` one
  (both consumers released it);
- consumer warpgroup w holds output columns [256 w, 256 w + 256) as four 64 x 64 fp32
  accumulators (128 registers a thread). Both compute the tile's scores S = q_nope ckv^T + q_pe
  kpe^T (9 chained wgmmas) and the same online softmax, then O_w += P ckv[:, cols of w] (4 wgmmas,
  P from registers): the scores computed twice, 1.5x the useful tensor work at 128 heads (``MODE``
  0). In ``MODE`` 1 (shared P) only the first consumer computes them and hands P and the rescale factors to the second
  through shared memory (double-buffered, ``p_ready`` / ``p_free``), issuing tile j's scores before
  tile j - 1's P V and running the softmax while that P V does (the prefill kernel's order).

Pages of fewer than 8 positions (page 1: SGLang's MLA cache) cannot be read in TMA boxes of whole
8-row swizzle groups: with ``GATHER`` a producer warpgroup gathers each tile's rows with cp.async
instead (``_gather_partition``), into the same stages, and the consumers are the same.

Page ids are read as given: TMA keeps every box inside the cache (a box past it reads zeros), and
``_hopper.check_page_ids`` reports ids outside it. A request's last tile reads whole pages: the rows
past its end (whatever they hold, NaN included: FlashInfer's ``test_batch_mla_oob_kv_nan``) are
masked in the scores and zeroed in the consumer's value chunks before P V. Scores stay raw; the
softmax scale (log2 units, positive) is applied inside exp2's argument. Gluon code does not run in
the Triton interpreter: the CPU suite compiles it for sm_90 (tests/test_sm90_compile.py), the
``gpu`` tests run it.
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

ROWS = gl.constexpr(64)  # rows a program: one warpgroup's wgmma M, shared by both consumers
CHUNK = gl.constexpr(64)  # columns of a latent box (128 bytes: one swizzle row)


@gluon.jit
def _item(work_ptr, qo_indptr_ptr, kv_len_ptr, tile_tokens, num_heads):
    """This program's work item and rows: (request or -1, its first query token, this block's first
    token, the item's tokens end, KV range lo..hi, split, splits, rows in use, first row)."""
    w = work_ptr + gl.program_id(1) * 7
    req = gl.load(w)
    q_tile_start = gl.load(w + 1)
    lo = gl.load(w + 2)
    hi = gl.load(w + 3)
    split = gl.load(w + 4)
    num_splits = gl.load(w + 5)
    req_ok = gl.maximum(req, 0)
    q_start = gl.load(qo_indptr_ptr + req_ok)
    q_len = gl.load(qo_indptr_ptr + req_ok + 1) - q_start
    tile_end = gl.minimum(q_tile_start + tile_tokens, q_len)
    row0 = gl.program_id(0) * ROWS
    rows = (tile_end - q_tile_start) * num_heads - row0
    kv_len = gl.load(kv_len_ptr + req_ok)
    return req, q_start, q_len, q_tile_start, tile_end, lo, hi, split, num_splits, rows, row0, kv_len


@gluon.jit
def _kv_hi(hi, q_tile_start, row0, tile_end, q_len, kv_len, is_causal, num_heads):
    """The item's KV end for this block's rows: causal rows see up to their own token's diagonal
    (bottom-right aligned), so the block stops after its last token's."""
    if is_causal:
        last_tok = gl.minimum(q_tile_start + (row0 + ROWS - 1) // num_heads, tile_end - 1)
        hi = gl.minimum(hi, last_tok + kv_len - q_len + 1)
    return hi


@gluon.jit
def _zero_tail(ckv_smem, first, n_valid, BLOCK_N: gl.constexpr):
    """Zeros of rows ``n_valid`` .. of a consumer's four value chunks ``first`` .. ``first + 3`` of a
    stage: the positions past the request's end in its last page (any values there, NaN included)
    would reach the output through P V with P = 0 there. The other consumer may still be reading
    these chunks for its scores, whose columns past the end it masks; the rows before ``n_valid`` are
    written back unchanged."""
    zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    tail = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, zl))[:, None] >= n_valid
    for k in gl.static_range(4):
        chunk = ckv_smem.index(first + k)
        x = chunk.load(zl)
        chunk.store(gl.where(tail, gl.zeros_like(x), x))
    # the stores, by every warp of the warpgroup, before its wgmma reads the chunks
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _scores(q_smem, qpe_smem, ckv_smem, kpe_smem, stage, s_zero):
    """S = q_pe kpe^T + q_nope ckv^T of a stage: 9 chained asynchronous wgmmas (the token of the last)."""
    n_chunks: gl.constexpr = q_smem.type.shape[0]
    s = warpgroup_mma(qpe_smem, kpe_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    for c in gl.static_range(n_chunks):
        s = warpgroup_mma(q_smem.index(c), ckv_smem.index(stage * n_chunks + c).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, m_i, l_i, cols, hi, diag, sm_scale_log2):
    """Online softmax of raw scores s [64, BLOCK_N] (columns ``cols``; kept where below ``hi`` and at or
    before the row's ``diag``): (p, alpha, m, l), logits in log2 units."""
    keep = (cols[None, :] < hi) & (cols[None, :] <= diag[:, None])
    s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * sm_scale_log2)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * sm_scale_log2 - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _hand_over(p, alpha, j, p_smem, row_smem, p_ready, p_free):
    """Tile j's P and rescale factors to the second consumer, once it has read the buffer's previous
    ones (double-buffered)."""
    buf = j % 2
    mbarrier.wait(p_free.index(buf), ((j // 2) & 1) ^ 1)
    p_smem.index(buf).store(p.to(p_smem.dtype))
    row_smem.index(buf).store(alpha)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(p_ready.index(buf), count=1)


@gluon.jit
def _pv(a, ckv_smem, base, acc0, acc1, acc2, acc3, a_o):
    """O += A V on four 64-column value chunks ``base`` .., the accumulators rescaled by ``a_o`` first:
    four asynchronous wgmmas (their tokens)."""
    acc0 = warpgroup_mma(a, ckv_smem.index(base), acc0 * a_o, is_async=True)
    acc1 = warpgroup_mma(a, ckv_smem.index(base + 1), acc1 * a_o, is_async=True)
    acc2 = warpgroup_mma(a, ckv_smem.index(base + 2), acc2 * a_o, is_async=True)
    acc3 = warpgroup_mma(a, ckv_smem.index(base + 3), acc3 * a_o, is_async=True)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _load_partition(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
                    p_smem, row_smem, p_ready, p_free, fin_bar,
                    o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
                    lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
                    work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                    kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads):
    """Producer warp: the block's Q, then tile j's pages (positions lo + BLOCK_N j ...) into the ring's
    next stage once both consumers released its last use. Pages past the request's last read page
    0's boxes (those positions are masked), so every stage gets the bytes its barrier expects."""
    stages: gl.constexpr = kpe_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kpe_smem.type.shape[1]
    # a box: a page, or the tile's share of a page larger than the tile
    BOX: gl.constexpr = kpe_desc.block_type.shape[0]
    N_CHUNKS: gl.constexpr = ckv_smem.type.shape[0] // stages
    req, q_start, q_len, q_tile_start, tile_end, lo, hi, split, num_splits, rows, row0, kv_len = _item(
        work_ptr, qo_indptr_ptr, kv_len_ptr, tile_tokens, num_heads)
    if (req >= 0) & (rows > 0):
        q_row = (q_start + q_tile_start) * num_heads + row0
        bar = q_bar.index(0)
        mbarrier.expect(bar, N_CHUNKS * q_desc.block_type.nbytes + qpe_desc.block_type.nbytes)
        for c in gl.static_range(N_CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [q_row, c * CHUNK], bar, q_smem.index(c))
        tma.async_copy_global_to_shared(qpe_desc, [q_row, 0], bar, qpe_smem)
        hi = _kv_hi(hi, q_tile_start, row0, tile_end, q_len, kv_len, is_causal, num_heads)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        page_base = gl.load(kv_indptr_ptr + req)
        n_pages = gl.cdiv(kv_len, page_size)
        tile_bytes: gl.constexpr = BLOCK_N * (N_CHUNKS * CHUNK * 2 + kpe_desc.block_type.shape[1] * 2)
        for j in range(n_tiles):
            stage = j % stages
            # empty barriers start "released": the first pass over the ring waits on the other phase
            mbarrier.wait(empty.index(stage), ((j // stages) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), tile_bytes)
            for i in gl.static_range(BLOCK_N // BOX):
                # a box: page idx of the request, from its row (pos - idx * page_size) on
                pos = lo + j * BLOCK_N + i * BOX
                idx = pos // page_size
                page = gl.load(kv_indices_ptr + page_base + idx, mask=idx < n_pages, other=0)
                row = (page - idx) * page_size + pos
                for c in gl.static_range(N_CHUNKS):
                    tma.async_copy_global_to_shared(ckv_desc, [row, c * CHUNK], ready.index(stage),
                                                    ckv_smem.index(stage * N_CHUNKS + c).slice(i * BOX, BOX))
                tma.async_copy_global_to_shared(kpe_desc, [row, 0], ready.index(stage),
                                                kpe_smem.index(stage).slice(i * BOX, BOX))


@gluon.jit
def _gather_partition(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
                      p_smem, row_smem, p_ready, p_free, fin_bar,
                      o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
                      lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
                      work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
                      kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads):
    """Producer warpgroup for pages TMA cannot box (``GATHER``: pages of fewer than 8 positions, page 1
    as SGLang's MLA cache): the block's Q by TMA, then each tile's latent rows gathered row by row with
    cp.async, 16 bytes a thread and copy, into the same ring. A tile's copies are one group; tile j is
    published (``ready``) before tile j + LAG is issued, once its own copies are complete
    (``wait_group``), and fenced for the consumers' wgmma (async proxy). Page ids are clamped into
    the cache (``_hopper.check_page_ids`` reports the bad ones); positions past the end read the
    request's or page 0's rows, masked as on the TMA path."""
    stages: gl.constexpr = kpe_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kpe_smem.type.shape[1]
    gl.static_assert(kpe_smem.type.shape[2] == CHUNK)  # DeepSeek's 64 rope dims: one copy a row
    N_CHUNKS: gl.constexpr = ckv_smem.type.shape[0] // stages
    # tiles in flight beyond the consumers' (the ring's other stages)
    LAG: gl.constexpr = stages - 1
    # [BLOCK_N, 64] a copy: 8 bf16 (16 bytes) a thread, 8 rows x 4 threads a warp, 4 warps down
    gl_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    pos_layout: gl.constexpr = gl.SliceLayout(1, gl_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, gl_layout)
    req, q_start, q_len, q_tile_start, tile_end, lo, hi, split, num_splits, rows, row0, kv_len = _item(
        work_ptr, qo_indptr_ptr, kv_len_ptr, tile_tokens, num_heads)
    if (req >= 0) & (rows > 0):
        q_row = (q_start + q_tile_start) * num_heads + row0
        bar = q_bar.index(0)
        mbarrier.expect(bar, N_CHUNKS * q_desc.block_type.nbytes + qpe_desc.block_type.nbytes)
        for c in gl.static_range(N_CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [q_row, c * CHUNK], bar, q_smem.index(c))
        tma.async_copy_global_to_shared(qpe_desc, [q_row, 0], bar, qpe_smem)
        hi = _kv_hi(hi, q_tile_start, row0, tile_end, q_len, kv_len, is_causal, num_heads)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        page_base = gl.load(kv_indptr_ptr + req)
        n_pages = gl.cdiv(kv_len, page_size)
        offs_n = gl.arange(0, BLOCK_N, layout=pos_layout)
        cols = gl.arange(0, CHUNK, layout=col_layout)
        # rows 16 bytes apart (the route checks it), written as a multiple of 8 elements: Triton marks a stride
        # divisible by 16 elements only, and its 16-byte copies of rows of, e.g., a 584-wide buffer did not
        # compile (neither multiple_of nor assume on the scalar reaches the copies' alignment)
        ckv_stride = (stride_ckv_row // 8) * 8
        kpe_stride = (stride_kpe_row // 8) * 8
        for j in range(n_tiles):
            if j >= LAG:
                # tile j - LAG's copies done (LAG - 1 later groups may still be in flight): published
                # before this tile waits for its stage, which the consumers free only after tile j - LAG - 1
                async_copy.wait_group(LAG - 1)
                publish_stage(ready, j - LAG, stages)
            stage = j % stages
            mbarrier.wait(empty.index(stage), ((j // stages) & 1) ^ 1)
            pos = lo + j * BLOCK_N + offs_n
            idx = pos // page_size
            page = gl.load(kv_indices_ptr + page_base + idx, mask=idx < n_pages, other=0)
            # ids as unsigned, clamped to the last page: a bad one reads a page of the cache
            page = gl.minimum(page.to(gl.uint32, bitcast=True), (num_pages - 1).to(gl.uint32)).to(gl.int64)
            row = page * page_size + (pos - idx * page_size)
            ckv_rows = ckv_ptr + row[:, None] * ckv_stride + cols[None, :]
            for c in gl.static_range(N_CHUNKS):
                async_copy.async_copy_global_to_shared(ckv_smem.index(stage * N_CHUNKS + c), ckv_rows + c * CHUNK)
            async_copy.async_copy_global_to_shared(kpe_smem.index(stage),
                                                   kpe_ptr + row[:, None] * kpe_stride + cols[None, :])
            async_copy.commit_group()
        # the last tiles: every copy complete
        async_copy.wait_group(0)
        for j in range(gl.maximum(n_tiles - LAG, 0), n_tiles):
            publish_stage(ready, j, stages)


@gluon.jit
def _consume(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
             p_smem, row_smem, p_ready, p_free, fin_bar,
             o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
             lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
             work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
             kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads, WG: gl.constexpr):
    """Consumer warpgroup ``WG``: output columns [256 WG, 256 WG + 256) (four 64-column accumulators)
    of every tile, then the output (one split) or the partial state (several), and the LSE (WG 0).
    Without shared P (``p_smem`` a placeholder of one buffer) both consumers compute each tile's scores
    and softmax; with it (two buffers), WG 0 does and hands P and the rescale factors over through
    ``p_smem`` / ``row_smem`` (``p_ready`` / ``p_free``, double-buffered), and its final row sums and
    maxima through ``row_smem`` and ``fin_bar``."""
    SHARE_P: gl.constexpr = p_smem.type.shape[0] == 2
    stages: gl.constexpr = kpe_smem.type.shape[0]
    BLOCK_N: gl.constexpr = kpe_smem.type.shape[1]
    N_CHUNKS: gl.constexpr = ckv_smem.type.shape[0] // stages
    HEAD_DIM_CKV: gl.constexpr = N_CHUNKS * CHUNK
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, CHUNK, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    req, q_start, q_len, q_tile_start, tile_end, lo, hi, split, num_splits, rows, row0, kv_len = _item(
        work_ptr, qo_indptr_ptr, kv_len_ptr, tile_tokens, num_heads)
    if (req >= 0) & (rows > 0):
        hi = _kv_hi(hi, q_tile_start, row0, tile_end, q_len, kv_len, is_causal, num_heads)
        n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
        offs_r = gl.arange(0, ROWS, layout=row_s)
        # the last KV position each row sees (causal) and the item's end
        diag = q_tile_start + (row0 + offs_r) // num_heads + kv_len - q_len
        if is_causal == 0:
            diag = diag * 0 + hi
        cols0 = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
        acc0 = gl.zeros([ROWS, CHUNK], gl.float32, layout=o_layout)
        acc1 = gl.zeros([ROWS, CHUNK], gl.float32, layout=o_layout)
        acc2 = gl.zeros([ROWS, CHUNK], gl.float32, layout=o_layout)
        acc3 = gl.zeros([ROWS, CHUNK], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar.index(0), 0)
        if SHARE_P and WG == 0:
            # S of tile j is issued before P V of tile j - 1, and its softmax runs while that P V does
            if n_tiles > 0:
                mbarrier.wait(ready.index(0), 0)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, qpe_smem, ckv_smem, kpe_smem, 0,
                                                                        s_zero), ))
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, cols0, hi, diag, sm_scale_log2)
                _hand_over(p, alpha, 0, p_smem, row_smem, p_ready, p_free)
                for j in range(1, n_tiles):
                    stage = j % stages
                    prev = (j - 1) % stages
                    mbarrier.wait(ready.index(stage), (j // stages) & 1)
                    s = _scores(q_smem, qpe_smem, ckv_smem, kpe_smem, stage, s_zero)
                    # tile j - 1 is whole (only the last tile can end early)
                    acc0, acc1, acc2, acc3 = _pv(gl.convert_layout(p.to(dtype), p_layout), ckv_smem, prev * N_CHUNKS,
                                                 acc0, acc1, acc2, acc3, gl.convert_layout(alpha, row_o)[:, None])
                    s = warpgroup_mma_wait(num_outstanding=4, deps=(s, ))
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, cols0 + j * BLOCK_N, hi, diag, sm_scale_log2)
                    _hand_over(p, alpha, j, p_smem, row_smem, p_ready, p_free)
                    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
                    mbarrier.arrive(empty.index(prev), count=1)
                last = (n_tiles - 1) % stages
                n_valid = hi - (lo + (n_tiles - 1) * BLOCK_N)
                if n_valid < BLOCK_N:
                    _zero_tail(ckv_smem, last * N_CHUNKS, n_valid, BLOCK_N)
                acc0, acc1, acc2, acc3 = _pv(gl.convert_layout(p.to(dtype), p_layout), ckv_smem, last * N_CHUNKS,
                                             acc0, acc1, acc2, acc3, gl.convert_layout(alpha, row_o)[:, None])
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
                mbarrier.arrive(empty.index(last), count=1)
        else:
            for j in range(n_tiles):
                stage = j % stages
                mbarrier.wait(ready.index(stage), (j // stages) & 1)
                base = stage * N_CHUNKS + WG * 4
                n_valid = hi - (lo + j * BLOCK_N)
                if SHARE_P and WG == 1:
                    buf = j % 2
                    mbarrier.wait(p_ready.index(buf), (j // 2) & 1)
                    a_o = row_smem.index(buf).load(row_o)[:, None]
                    if n_valid < BLOCK_N:
                        _zero_tail(ckv_smem, base, n_valid, BLOCK_N)
                    acc0, acc1, acc2, acc3 = _pv(p_smem.index(buf), ckv_smem, base, acc0, acc1, acc2, acc3, a_o)
                    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
                    mbarrier.arrive(p_free.index(buf), count=1)
                else:
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, qpe_smem, ckv_smem, kpe_smem, stage,
                                                                            s_zero), ))
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, cols0 + j * BLOCK_N, hi, diag, sm_scale_log2)
                    a_o = gl.convert_layout(alpha, row_o)[:, None]
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                    if n_valid < BLOCK_N:
                        _zero_tail(ckv_smem, base, n_valid, BLOCK_N)
                    acc0, acc1, acc2, acc3 = _pv(p_op, ckv_smem, base, acc0, acc1, acc2, acc3, a_o)
                    acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
                mbarrier.arrive(empty.index(stage), count=1)
        if SHARE_P:
            # WG 1's rows: the final sums and maxima from WG 0 (buffers 2 and 3 of row_smem)
            if WG == 0:
                row_smem.index(2).store(l_i)
                row_smem.index(3).store(m_i)
                gl.thread_barrier()
                mbarrier.arrive(fin_bar.index(0), count=1)
            else:
                mbarrier.wait(fin_bar.index(0), 0)
                l_i = row_smem.index(2).load(row_s)
                m_i = row_smem.index(3).load(row_s)

        # rows that saw no key: output 0, LSE -inf (as kernels/mla.py's finalize)
        l_o = gl.convert_layout(l_i, row_o)
        inv = 1.0 / gl.where(l_o > 0, l_o, 1.0)
        lse = gl.where(l_i > 0, m_i + gl.log2(l_i), float("-inf"))
        r_o = row0 + gl.arange(0, ROWS, layout=row_o)
        tok_o = q_tile_start + r_o // num_heads
        head_o = r_o % num_heads
        ok_o = r_o < row0 + rows
        r_s = row0 + offs_r
        tok_s = q_tile_start + r_s // num_heads
        head_s = r_s % num_heads
        ok_s = r_s < row0 + rows
        offs_c = WG * 4 * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, o_layout))
        if num_splits == 1:
            o_rows = (q_start + tok_o).to(gl.int64) * stride_o_tok + head_o.to(gl.int64) * stride_o_head
            ptrs = o_ptr + o_rows[:, None] + offs_c[None, :]
            out_ty: gl.constexpr = o_ptr.dtype.element_ty
            gl.store(ptrs, (acc0 * inv[:, None]).to(out_ty), mask=ok_o[:, None])
            gl.store(ptrs + CHUNK, (acc1 * inv[:, None]).to(out_ty), mask=ok_o[:, None])
            gl.store(ptrs + 2 * CHUNK, (acc2 * inv[:, None]).to(out_ty), mask=ok_o[:, None])
            gl.store(ptrs + 3 * CHUNK, (acc3 * inv[:, None]).to(out_ty), mask=ok_o[:, None])
            if WG == 0:
                lse_rows = (q_start + tok_s).to(gl.int64) * stride_lse_tok + head_s.to(gl.int64) * stride_lse_head
                gl.store(lse_ptr + lse_rows, lse * lse_scale, mask=ok_s & (write_lse != 0))
        else:
            # the normalised partial state of this split, merged by kernels/mla.py's merge pass
            first_o = gl.load(state_offset_ptr + req) + tok_o * num_splits
            st_o = (first_o + split).to(gl.int64) * num_heads + head_o
            st_ptrs = part_o_ptr + st_o[:, None] * HEAD_DIM_CKV + offs_c[None, :]
            gl.store(st_ptrs, acc0 * inv[:, None], mask=ok_o[:, None])
            gl.store(st_ptrs + CHUNK, acc1 * inv[:, None], mask=ok_o[:, None])
            gl.store(st_ptrs + 2 * CHUNK, acc2 * inv[:, None], mask=ok_o[:, None])
            gl.store(st_ptrs + 3 * CHUNK, acc3 * inv[:, None], mask=ok_o[:, None])
            if WG == 0:
                first_s = gl.load(state_offset_ptr + req) + tok_s * num_splits
                st_s = (first_s + split).to(gl.int64) * num_heads + head_s
                gl.store(part_lse_ptr + st_s, lse, mask=ok_s)


@gluon.jit
def _consume0(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
              p_smem, row_smem, p_ready, p_free, fin_bar,
              o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
              lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
              work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
              kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads):
    _consume(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
             p_smem, row_smem, p_ready, p_free, fin_bar,
             o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
             lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
             work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
             kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads, 0)


@gluon.jit
def _consume1(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
              p_smem, row_smem, p_ready, p_free, fin_bar,
              o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
              lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
              work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
              kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads):
    _consume(q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
             p_smem, row_smem, p_ready, p_free, fin_bar,
             o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2,
             lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr,
             work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr,
             kv_len_ptr, state_offset_ptr, tile_tokens, page_size, is_causal, write_lse, num_heads, 1)


@gluon.jit
def mla_hopper_kernel(
    q_desc, qpe_desc, ckv_desc, kpe_desc, o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok,
    stride_lse_head, sm_scale_log2, lse_scale, ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages,
    part_o_ptr, part_lse_ptr, work_ptr, qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr, state_offset_ptr,
    tile_tokens,
    NUM_HEADS: gl.constexpr, HEAD_DIM_CKV: gl.constexpr, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr, MODE: gl.constexpr, GATHER: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid ``(row programs, work items)`` as ``kernels/mla.py``'s (work items int32 [capacity, 7]:
    request (< 0: unused), first query token, kv_start, kv_end, split, splits, group).

    q_desc: q_nope as [tokens * H, D_ckv], box [64, 64]; qpe_desc: q_pe as [tokens * H, D_kpe], box
    [64, D_kpe] (token stride H times the head stride). ckv_desc / kpe_desc: the caches as [pages *
    PAGE_SIZE, D] (page p from row p * PAGE_SIZE; a power of two from 8), boxes [min(PAGE_SIZE,
    BLOCK_N), 64] and [.., D_kpe]; work items start on multiples of BLOCK_N positions. With ``GATHER``
    the cache descriptors only give the stages' shapes and layouts (boxes [BLOCK_N, 64]): the rows are
    read through ``ckv_ptr`` / ``kpe_ptr`` (row ``page * PAGE_SIZE + slot``, ``stride_*_row`` elements
    apart; ``num_pages`` pages) by a 4-warp producer. o [tokens, H,
    D_ckv], lse [tokens, H] float32 (times ``lse_scale``; written with ``WRITE_LSE``); part_o [states *
    H, D_ckv] / part_lse [states * H] float32 at ``state_offset[req] + token * splits + split``. ``num_warps`` is 4: the first consumer
    is the default partition."""
    N_CHUNKS: gl.constexpr = HEAD_DIM_CKV // CHUNK
    # each consumer holds four 64-column accumulators: the latent must be 512 wide (DeepSeek's)
    gl.static_assert(N_CHUNKS == 8)
    D_KPE: gl.constexpr = kpe_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [N_CHUNKS, ROWS, CHUNK], q_desc.layout)
    qpe_smem = gl.allocate_shared_memory(dtype, [ROWS, D_KPE], qpe_desc.layout)
    ckv_smem = gl.allocate_shared_memory(dtype, [STAGES * N_CHUNKS, BLOCK_N, CHUNK], ckv_desc.layout)
    kpe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_KPE], kpe_desc.layout)
    # P handed from WG 0 to WG 1 (MODE 1: two buffers; MODE 0: a placeholder), with the rescale factors
    # of each buffer's tile and, at the end, the row sums and maxima
    gl.static_assert(MODE == 0 or MODE == 1)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype)
    if MODE == 1:
        p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_N], p_layout)
    else:
        p_smem = gl.allocate_shared_memory(dtype, [1, ROWS, BLOCK_N], p_layout)
    row_smem = gl.allocate_shared_memory(gl.float32, [4, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    mbarrier.init(fin_bar.index(0), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(p_free.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    args = (q_desc, qpe_desc, ckv_desc, kpe_desc, q_smem, qpe_smem, ckv_smem, kpe_smem, q_bar, ready, empty,
            p_smem, row_smem, p_ready, p_free, fin_bar,
            o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, stride_lse_head, sm_scale_log2, lse_scale,
            ckv_ptr, stride_ckv_row, kpe_ptr, stride_kpe_row, num_pages, part_o_ptr, part_lse_ptr, work_ptr,
            qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_len_ptr, state_offset_ptr, tile_tokens, PAGE_SIZE,
            IS_CAUSAL, WRITE_LSE, NUM_HEADS)
    if GATHER:
        gl.warp_specialize([(_consume0, args), (_consume1, args), (_gather_partition, args)], [4, 4],
                           [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consume0, args), (_consume1, args), (_load_partition, args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])
