"""Decode over an e4m3 paged KV cache for Hopper (sm_90) in Gluon, with grouped-query attention: the
structure the Gluon prefill's ``FP8`` mode proved, applied to one query token per request (issue
"Speed, part 3", target 2: fp8 KV decode at ~2x the bf16 time). The attention core's fp8 decode
stalls on a chain of dependent steps per tile (shared-memory fragments, convert, mma, row
reductions, V convert; benchmarks/NOTES.md, session 2): here a producer warpgroup converts whole
tiles while a consumer warpgroup runs wgmma from shared memory.

A work item: one entry of the decode plan's work list (a request's KV split) for one KV head. A
program (one per SM, persistent) runs items in turn, as two partitions (``gl.warp_specialize``):
- a producer warpgroup that brings each tile's pages by TMA into a ring of ``FP8_STAGES`` e4m3 stages
  (a tile's page ids loaded while the tile before it is issued) and converts each into the consumer's
  ring of ``STAGES`` fp16 stages (the prefill kernel's ``_convert_tile``), running on across items;
- the consumer warpgroup, with KV as the wgmma's M (``_decode_consume_kv_m``): S^T = K Q^T over the GROUP
  query heads rounded up to 8 (the Q box's rows), the softmax over the tile's positions, O^T += V^T P
  through a small shared P tile: no padded rows. (A consumer with the query heads as its 64 rows ran
  4-5 % slower on the H200 in session 22 and was removed; both orientations are ~2.2x slower than the
  core's fp8 decode, which stays the default route: benchmarks/NOTES.md, session 22.)
Q (bf16/fp16) is converted to fp16 in place once it lands. An unsplit item writes its rows of the
output (and LSE); a split item writes its normalised partial state, and the last split of a
(request, KV head) to arrive (an arrival counter, as the attention core's fused merge) merges them all
into the output.

Gluon code does not run in the Triton interpreter: the CPU suite covers the route's gates and the host
side and compiles this kernel for sm_90 (tests/test_sm90_compile.py); tests/test_decode.py's ``gpu``
tests run it.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)

from .prefill_hopper import _convert_q, _convert_tile, _load_q

WORK_FIELDS = gl.constexpr(7)  # _plan.WORK_FIELDS: request, q tile, kv start, kv end, split, splits, group


@gluon.jit
def _decode_item(item, num_kv_heads, work_ptr):
    """Work item ``item`` (heads fastest): its request (-1: a padding entry), KV head, split, splits, and
    the split's first KV position and length."""
    kv_head = item % num_kv_heads
    entry = work_ptr + (item // num_kv_heads) * WORK_FIELDS
    req = gl.load(entry)
    kv_lo = gl.load(entry + 2)
    n_kv = gl.maximum(gl.load(entry + 3) - kv_lo, 0)
    split = gl.load(entry + 4)
    num_splits = gl.load(entry + 5)
    return req, kv_head, split, num_splits, kv_lo, n_kv


@gluon.jit
def _fp8_decode_partition(k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty, work_ptr,
                          kv_indptr_ptr, kv_indices_ptr, rows_per_page, num_kv_heads, num_items):
    """The producer warpgroup: tile t of the program's items by TMA into fp8 stage t % FP8_STAGES and,
    whenever that ring is full, the oldest tile converted into the fp16 ring (as the prefill kernel's
    ``_fp8_tiles``); the tiles still in flight at the end are converted last. A tile's page ids are
    loaded while the one before it is issued (ncu, session 19: a third of the producer's waits were on
    the page-id loads in front of each TMA box)."""
    stages8: gl.constexpr = k8_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k8_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k8_smem.type.shape[2]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    PAGES: gl.constexpr = BLOCK_N // PAGE
    kv_bytes: gl.constexpr = 2 * BLOCK_N * k_desc.block_type.nbytes // PAGE
    # every thread holds all the tile's ids: picking one is a sum within the thread, no exchange
    ids_layout: gl.constexpr = gl.BlockedLayout([PAGES], [32], [4], [0])
    slots = gl.arange(0, PAGES, layout=ids_layout)
    t = 0  # tiles issued
    c = 0  # tiles converted
    for item in range(gl.program_id(0), num_items, gl.num_programs(0)):
        req, kv_head, split, num_splits, kv_lo, n_kv = _decode_item(item, num_kv_heads, work_ptr)
        # the split's first entry in the page table (splits start on page boundaries: _route.DECODE)
        first_page = gl.load(kv_indptr_ptr + gl.maximum(req, 0)) + gl.maximum(kv_lo, 0) // PAGE
        n_pages = gl.cdiv(n_kv, PAGE)
        ids = gl.load(kv_indices_ptr + first_page + slots, mask=slots < n_pages, other=0)
        for j in range(gl.cdiv(n_kv, BLOCK_N)):
            nxt = (j + 1) * PAGES + slots
            ids_next = gl.load(kv_indices_ptr + first_page + nxt, mask=nxt < n_pages, other=0)
            s8 = t % stages8
            mbarrier.expect(ready8.index(s8), kv_bytes)
            for i in gl.static_range(PAGES):
                row = gl.sum(gl.where(slots == i, ids, 0), 0) * rows_per_page
                tma.async_copy_global_to_shared(k_desc, [row, kv_head * HEAD_DIM], ready8.index(s8),
                                                k8_smem.index(s8).slice(i * PAGE, PAGE))
                tma.async_copy_global_to_shared(v_desc, [row, kv_head * HEAD_DIM], ready8.index(s8),
                                                v8_smem.index(s8).slice(i * PAGE, PAGE))
            ids = ids_next
            t += 1
            if t - c == stages8:
                _convert_tile(c, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty)
                c += 1
    for r in range(c, t):
        _convert_tile(r, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty)


@gluon.jit
def _q_row(item, num_items, num_qo_heads, num_kv_heads, work_ptr, group):
    """The first of ``item``'s Q rows in q_desc ([batch * H_qo, D]); any valid item's for an ``item`` past
    the last (whose Q is not loaded)."""
    last = gl.minimum(item, num_items - 1)
    req = gl.maximum(gl.load(work_ptr + (last // num_kv_heads) * WORK_FIELDS), 0)
    return req * num_qo_heads + (last % num_kv_heads) * group


@gluon.jit
def _decode_consume_kv_m(q_desc, q_smem, q_bar, k_smem, v_smem, ready, empty, o_ptr, stride_o_tok, stride_o_head,
                         lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, counter_ptr, k_mult, v_mult, work_ptr,
                         state_offset_ptr, num_qo_heads, num_kv_heads, num_items, sm_scale_log2,
                         group):
    """The consumer warpgroup with KV as the wgmma's M: S^T = K Q^T, [BLOCK_N tokens, Q_ROWS
    heads] (Q_ROWS = the Q box's rows, the group rounded up to 8: no 64-row padding), the softmax over
    the tokens (axis 0), then O^T += V^T P ([D, Q_ROWS]; V^T read transposed from the fp16 stage, P
    through a small shared tile). Every step is small; the tiles run one after another."""
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
    Q_ROWS: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    q_load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, Q_ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, Q_ROWS, 16])
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, Q_ROWS], dtype)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # per head
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, Q_ROWS], p_smem_layout)
    tok0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([BLOCK_N, Q_ROWS], gl.float32, layout=s_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, Q_ROWS, layout=col_o)
    cols_s = gl.arange(0, Q_ROWS, layout=col_s)

    my_q = q_smem.index(0)
    convert_q: gl.constexpr = dtype != q_desc.dtype
    my_q_mma = my_q._reinterpret(dtype, [Q_ROWS, HEAD_DIM], q_desc.layout) if convert_q else my_q
    my_bar = q_bar.index(0)
    scale = sm_scale_log2 * k_mult
    first = gl.program_id(0)
    step = gl.num_programs(0)
    _load_q(q_desc, my_q, my_bar, _q_row(first, num_items, num_qo_heads, num_kv_heads, work_ptr, group), 0,
            first < num_items, 0, 1)
    t = 0  # KV tiles of the ring consumed before this item
    q_phase = 0
    for item in range(first, num_items, step):
        req, kv_head, split, num_splits, kv_lo, n_kv = _decode_item(item, num_kv_heads, work_ptr)
        n_tiles = gl.cdiv(n_kv, BLOCK_N)
        next_row = _q_row(item + step, num_items, num_qo_heads, num_kv_heads, work_ptr, group)
        mbarrier.wait(my_bar, q_phase)
        q_phase ^= 1
        if convert_q:
            _convert_q(my_q, my_q_mma, q_load_layout)
        m_i = gl.full([Q_ROWS], float("-inf"), gl.float32, layout=col_s)
        l_i = gl.zeros([Q_ROWS], gl.float32, layout=col_s)
        acc = gl.zeros([HEAD_DIM, Q_ROWS], gl.float32, layout=o_layout)
        for j in range(n_tiles):
            stage = (t + j) % stages
            mbarrier.wait(ready.index(stage), ((t + j) // stages) & 1)
            s = warpgroup_mma(k_smem.index(stage), my_q_mma.permute((1, 0)), s_zero, use_acc=False)
            keep = (j * BLOCK_N + tok0)[:, None] < n_kv
            s = gl.where(keep, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0) * scale)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s * scale - m_safe[None, :])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 0)
            m_i = m_new
            # every thread's part of P written and visible to the warpgroup's wgmma
            p_smem.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, col_o)[None, :]
            acc = warpgroup_mma(v_smem.index(stage).permute((1, 0)), p_smem, acc)
            mbarrier.arrive(empty.index(stage), count=1)
        t += n_tiles
        # every S of this item is done: the next item's Q may overwrite this one
        _load_q(q_desc, my_q, my_bar, next_row, 0, item + step < num_items, 0, 1)

        l_o = gl.convert_layout(l_i, col_o)
        o = acc / gl.where(l_o > 0, l_o, 1.0)[None, :] * v_mult
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        head_o = kv_head * group + cols_o
        head_s = kv_head * group + cols_s
        live = req >= 0
        split_rows = live & (num_splits > 1)
        whole_rows = live & (num_splits <= 1)
        state = gl.load(state_offset_ptr + gl.maximum(req, 0)) + split
        col_ok_o = cols_o < group
        col_ok_s = cols_s < group
        gl.store(o_ptr + req.to(gl.int64) * stride_o_tok + head_o[None, :] * stride_o_head + offs_d[:, None],
                 o.to(o_ptr.dtype.element_ty), mask=(col_ok_o & whole_rows)[None, :])
        gl.store(lse_ptr + req.to(gl.int64) * stride_lse_tok + head_s, lse, mask=col_ok_s & whole_rows)
        state_row = state.to(gl.int64) * num_qo_heads
        gl.store(part_o_ptr + ((state_row + head_o) * HEAD_DIM)[None, :] + offs_d[:, None], o,
                 mask=(col_ok_o & split_rows)[None, :])
        gl.store(part_lse_ptr + state_row + head_s, lse, mask=col_ok_s & split_rows)
        if split_rows:
            _arrive_and_merge(item, req, kv_head, split, num_splits, state, group, counter_ptr, work_ptr, num_kv_heads,
                              o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr,
                              num_qo_heads, HEAD_DIM)


@gluon.jit
def _arrive_and_merge(item, req, kv_head, split, num_splits, state, group, counter_ptr, work_ptr, num_kv_heads, o_ptr,
                      stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, num_qo_heads,
                      HEAD_DIM: gl.constexpr):
    """After a split item stored its state: the last split of (request, KV head) to arrive merges them all.
    The warpgroup's stores are done (barrier) before one thread's release; its acquire orders the other
    splits' stores before the merge's loads (as the attention core's fused merge)."""
    gl.thread_barrier()
    group_id = gl.load(work_ptr + (item // num_kv_heads) * WORK_FIELDS + 6)  # the request's query tile
    counter = counter_ptr + group_id * num_kv_heads + kv_head
    if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
        gl.store(counter, 0)  # every split has arrived: nothing else reads it in this launch
        _merge_splits(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, req,
                      (state - split).to(gl.int64), num_splits, num_qo_heads, kv_head, group, HEAD_DIM)


@gluon.jit
def _merge_splits(o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, req,
                  first_state, num_splits, num_qo_heads, kv_head, group, HEAD_DIM: gl.constexpr):
    """The output and LSE of one request's ``group`` query heads of KV head ``kv_head`` from its
    ``num_splits`` normalised states from ``first_state`` on (``part_o`` [states, H_qo, D], ``part_lse``
    [states, H_qo]), 16 heads at a time (few registers beside the consumer's own)."""
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([1, HEAD_DIM // 32], [1, 32], [4, 1], [1, 0])
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    for r0 in range(0, group, CHUNK):
        rows = r0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        row_ok = rows < group
        heads = kv_head * group + rows
        m_i = gl.full([CHUNK], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
        l_i = gl.zeros([CHUNK], gl.float32, layout=gl.SliceLayout(1, layout))
        acc = gl.zeros([CHUNK, HEAD_DIM], gl.float32, layout=layout)
        for sp in range(num_splits):
            row = (first_state + sp) * num_qo_heads + heads
            s = gl.load(part_lse_ptr + row, mask=row_ok, other=float("-inf"))
            v = gl.load(part_o_ptr + (row * HEAD_DIM)[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            m_new = gl.maximum(m_i, s)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            beta = gl.exp2(s - m_safe)
            l_i = l_i * alpha + beta
            acc = acc * alpha[:, None] + v * beta[:, None]
            m_i = m_new
        o = acc / gl.where(l_i > 0, l_i, 1.0)[:, None]
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        gl.store(o_ptr + req.to(gl.int64) * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        gl.store(lse_ptr + req.to(gl.int64) * stride_lse_tok + heads, lse, mask=row_ok)


@gluon.jit
def decode_hopper_kernel(
    q_desc, k_desc, v_desc, o_ptr, stride_o_tok, stride_o_head, lse_ptr, stride_lse_tok, k_mult, v_mult,
    part_o_ptr, part_lse_ptr, counter_ptr, work_ptr, kv_indptr_ptr, kv_indices_ptr, state_offset_ptr, num_qo_heads,
    num_kv_heads, num_items, sm_scale_log2, rows_per_page,
    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8_STAGES: gl.constexpr,
    PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """q_desc: q [batch, H_qo, D] (contiguous) as a 2-D view [batch * H_qo, D], box [Q_ROWS, D]
    (``_hopper.decode_q_rows``: the group rounded up to 8); k_desc / v_desc: 2-D views [rows, H_kv * D] of the e4m3
    K and V pages, box [PAGE, D] (8 to 128 positions, dividing BLOCK_N), page p starting at row p * rows_per_page;
    o: [batch, H_qo, D] (any row and head strides); lse: [batch, H_qo] float32 base 2 (always written: scratch when
    the caller wants none). ``work``: the decode plan's int32 [items, 7] list (``_plan.build_work``: request, 0, KV
    start and end, split, splits, group), one item per entry and KV head (``num_items`` = entries x H_kv);
    ``kv_indptr`` / ``kv_indices`` the page table; ``state_offset`` int32 [batch] each request's first partial
    state; ``part_o`` float32 [states, H_qo, D] and ``part_lse`` [states, H_qo]: the split items' states. ``k_mult``
    multiplies the scores (q_scale * k_scale; with ``sm_scale_log2``, log2 units: positive), ``v_mult`` the output.
    ``num_warps`` is 4: the consumer is the default partition, the producer a warpgroup of ``PRODUCER_REGS``
    registers a thread."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [1, q_desc.block_type.shape[0], HEAD_DIM], q_desc.layout)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16)
    k_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    k8_smem = gl.allocate_shared_memory(k_desc.dtype, [FP8_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v8_smem = gl.allocate_shared_memory(v_desc.dtype, [FP8_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ready8 = gl.allocate_shared_memory(gl.int64, [FP8_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(FP8_STAGES):
        mbarrier.init(ready8.index(i), count=1)

    consumer_args = (q_desc, q_smem, q_bar, k_smem, v_smem, ready, empty, o_ptr, stride_o_tok, stride_o_head,
                     lse_ptr, stride_lse_tok, part_o_ptr, part_lse_ptr, counter_ptr, k_mult, v_mult, work_ptr,
                     state_offset_ptr, num_qo_heads, num_kv_heads, num_items, sm_scale_log2, GROUP)
    producer_args = (k_desc, v_desc, k8_smem, v8_smem, ready8, k_smem, v_smem, ready, empty, work_ptr, kv_indptr_ptr,
                     kv_indices_ptr, rows_per_page, num_kv_heads, num_items)
    gl.warp_specialize([(_decode_consume_kv_m, consumer_args), (_fp8_decode_partition, producer_args)], [4],
                       [PRODUCER_REGS])
