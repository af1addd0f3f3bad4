"""Experiment for issue "Prefill, part 2": a ragged prefill written in Gluon (Triton's explicit-layout
dialect) for Hopper, measured against tritoninfer's prefill and FlashInfer's fa3 on the same inputs.
Not part of the package: if it wins, it moves into ``tritoninfer/kernels``.

What Gluon allows that ``tl.dot`` code does not (benchmarks/NOTES.md, session 4, "Next"):
- K/V tiles arrive by TMA into a ring of shared-memory stages, each with an mbarrier, so the loads
  of later tiles run under the current tile's work without the compiler's pipeliner;
- the wgmma of S_j = Q K_j^T is issued *before* the wgmma of O += P_{j-1} V_{j-1} and the softmax
  of S_j runs while the tensor cores do the second (FlashAttention-3's intra-warpgroup overlap);
- P goes from the S accumulator's registers straight into the A operand of the PV wgmma.

One program: BLOCK_M query tokens of one query head (2 warpgroups of 64 rows each), grid
(query heads, query tiles) so the heads of one KV group run side by side and share K/V in L2.

    PYTHONPATH=. python benchmarks/prefill_gluon.py            # GPU: table of µs, TFLOP/s, error
    PYTHONPATH=. python benchmarks/prefill_gluon.py --compile  # no GPU: compile for sm_90, report
"""

import argparse
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


@gluon.jit
def _softmax_step(s, m_i, l_i, scale, cols, kv_hi, rows_diag, MASK, IS_CAUSAL):
    """Online softmax on a raw score tile s [BLOCK_M, BLOCK_N] (logits = s * scale, log2 units).
    Returns (p, m_new, l_new, alpha). MASK and IS_CAUSAL may be run-time values."""
    if MASK:
        keep = (cols[None, :] < kv_hi) & ((cols[None, :] <= rows_diag[:, None]) | (IS_CAUSAL == 0))
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def ragged_prefill_gluon_kernel(
    q_desc, k_desc, v_desc, o_ptr, stride_o_tok, stride_o_head,
    qo_indptr_ptr, kv_indptr_ptr, tile_req_ptr, tile_start_ptr, sm_scale_log2,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr,
):
    """q_desc: [tokens, H_qo * D] box [BLOCK_M, D]; k_desc/v_desc: [kv tokens, H_kv * D] box
    [BLOCK_N, D]; o: [tokens, H_qo, D]. Work item ``program_id(1)``: (request, first query token)."""
    head = gl.program_id(0)
    item = gl.program_id(1)
    req = gl.load(tile_req_ptr + item)
    m0 = gl.load(tile_start_ptr + item)
    q_start = gl.load(qo_indptr_ptr + req)
    q_len = gl.load(qo_indptr_ptr + req + 1) - q_start
    kv_start = gl.load(kv_indptr_ptr + req)
    kv_len = gl.load(kv_indptr_ptr + req + 1) - kv_start
    kv_col = (head // GROUP) * HEAD_DIM
    dtype: gl.constexpr = q_desc.dtype

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)

    # KV range of this tile: causal (bottom-right aligned) stops after the last row's diagonal
    kv_hi = kv_len
    if IS_CAUSAL:
        kv_hi = gl.minimum(kv_len, m0 + BLOCK_M + kv_len - q_len)
    n_tiles = gl.cdiv(kv_hi, BLOCK_N)
    # tiles from here on need a mask: the KV end, or the diagonal of the first row
    first_masked = kv_hi // BLOCK_N
    if IS_CAUSAL:
        first_masked = gl.minimum(first_masked, gl.maximum(m0 + kv_len - q_len + 1, 0) // BLOCK_N)

    kv_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
    mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        pred = i < n_tiles
        mbarrier.expect(kv_bar.index(i), kv_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [kv_start + i * BLOCK_N, kv_col], kv_bar.index(i), k_smem.index(i),
                                        pred=pred)
        tma.async_copy_global_to_shared(v_desc, [kv_start + i * BLOCK_N, kv_col], kv_bar.index(i), v_smem.index(i),
                                        pred=pred)

    rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    rows_diag = rows + kv_len - q_len
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        # prologue: S_0 and its softmax
        mbarrier.wait(kv_bar.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0, kv_hi, rows_diag,
                                           0 >= first_masked, IS_CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            stage = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(kv_bar.index(stage), (j // STAGES) & 1)
            # S_j first, then O += P_{j-1} V_{j-1}: the softmax of S_j runs under the second
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0 + j * BLOCK_N, kv_hi, rows_diag,
                                               j >= first_masked, IS_CAUSAL)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            # every warp is done with tile j-1's stage: refill it with tile j-1+STAGES
            gl.thread_barrier()
            nxt = j - 1 + STAGES
            pred = nxt < n_tiles
            mbarrier.expect(kv_bar.index(prev), kv_bytes, pred=pred)
            tma.async_copy_global_to_shared(k_desc, [kv_start + nxt * BLOCK_N, kv_col], kv_bar.index(prev),
                                            k_smem.index(prev), pred=pred)
            tma.async_copy_global_to_shared(v_desc, [kv_start + nxt * BLOCK_N, kv_col], kv_bar.index(prev),
                                            v_smem.index(prev), pred=pred)
        last = (n_tiles - 1) % STAGES
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
    else:
        for j in range(0, n_tiles):
            stage = j % STAGES
            mbarrier.wait(kv_bar.index(stage), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0 + j * BLOCK_N, kv_hi, rows_diag,
                                               j >= first_masked, IS_CAUSAL)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            gl.thread_barrier()
            nxt = j + STAGES
            pred = nxt < n_tiles
            mbarrier.expect(kv_bar.index(stage), kv_bytes, pred=pred)
            tma.async_copy_global_to_shared(k_desc, [kv_start + nxt * BLOCK_N, kv_col], kv_bar.index(stage),
                                            k_smem.index(stage), pred=pred)
            tma.async_copy_global_to_shared(v_desc, [kv_start + nxt * BLOCK_N, kv_col], kv_bar.index(stage),
                                            v_smem.index(stage), pred=pred)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))

    l_o = gl.convert_layout(l_i, row_o)
    o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    rows_o = m0 + gl.arange(0, BLOCK_M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = (o_ptr + (q_start + rows_o).to(gl.int64)[:, None] * stride_o_tok + head * stride_o_head
            + offs_d[None, :])
    gl.store(ptrs, o.to(dtype), mask=(rows_o < q_len)[:, None])


@gluon.jit
def _ws_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
             n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP):
    """Producer warp: K/V tiles into the ring. A stage is refilled once both consumers released it.
    (Constants come from the descriptors: a constexpr passed through ``warp_specialize``'s argument
    tuple arrives as a value.)"""
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    kv_bytes: gl.constexpr = 2 * BLOCK_N * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8
    for j in range(n_tiles):
        stage = j % stages
        mbarrier.wait(empty.index(stage), ((j // stages) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), kv_bytes)
        tma.async_copy_global_to_shared(k_desc, [kv_start + j * BLOCK_N, kv_col], ready.index(stage),
                                        k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [kv_start + j * BLOCK_N, kv_col], ready.index(stage),
                                        v_smem.index(stage))


@gluon.jit
def _ws_consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
                n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP,
                WG: gl.constexpr):
    """One consumer warpgroup: 64 query rows (rows WG*64.. of the tile) against every KV tile."""
    stages: gl.constexpr = k_smem.type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    my_q = q_smem.index(WG)
    my_bar = q_bar.index(WG)
    q_bytes: gl.constexpr = ROWS * HEAD_DIM * dtype.primitive_bitwidth // 8
    mbarrier.expect(my_bar, q_bytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + WG * ROWS, head * HEAD_DIM], my_bar, my_q)

    r0 = m0 + WG * ROWS
    kv_hi = kv_len
    if IS_CAUSAL:
        kv_hi = gl.minimum(kv_len, r0 + ROWS + kv_len - q_len)
    first_masked = kv_hi // BLOCK_N
    if IS_CAUSAL:
        first_masked = gl.minimum(first_masked, gl.maximum(r0 + kv_len - q_len + 1, 0) // BLOCK_N)
    rows = r0 + gl.arange(0, ROWS, layout=row_s)
    rows_diag = rows + kv_len - q_len
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(my_bar, 0)

    if OVERLAP:
        mbarrier.wait(ready.index(0), 0)
        s_tok = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0, kv_hi, rows_diag,
                                           0 >= first_masked, IS_CAUSAL)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            stage = j % stages
            prev = (j - 1) % stages
            mbarrier.wait(ready.index(stage), (j // stages) & 1)
            s_tok = warpgroup_mma(my_q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0 + j * BLOCK_N, kv_hi, rows_diag,
                                               j >= first_masked, IS_CAUSAL)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_tiles - 1) % stages
        o_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
        mbarrier.arrive(empty.index(last), count=1)
    else:
        for j in range(0, n_tiles):
            stage = j % stages
            mbarrier.wait(ready.index(stage), (j // stages) & 1)
            s_tok = warpgroup_mma(my_q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, sm_scale_log2, cols0 + j * BLOCK_N, kv_hi, rows_diag,
                                               j >= first_masked, IS_CAUSAL)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            o_tok = warpgroup_mma(p_op, v_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))
            mbarrier.arrive(empty.index(stage), count=1)

    l_o = gl.convert_layout(l_i, row_o)
    o = acc / gl.where(l_o > 0, l_o, 1.0)[:, None]
    rows_o = r0 + gl.arange(0, ROWS, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    q_start = q_row - m0
    ptrs = (o_ptr + (q_start + rows_o).to(gl.int64)[:, None] * stride_o_tok + head * stride_o_head
            + offs_d[None, :])
    gl.store(ptrs, o.to(dtype), mask=(rows_o < q_len)[:, None])


@gluon.jit
def _ws_consume0(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
                 n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP):
    _ws_consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
                n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP, 0)


@gluon.jit
def _ws_consume1(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
                 n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP):
    _ws_consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_row, head, kv_start, kv_col,
                n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP, 1)


@gluon.jit
def ragged_prefill_gluon_ws_kernel(
    q_desc, k_desc, v_desc, o_ptr, stride_o_tok, stride_o_head,
    qo_indptr_ptr, kv_indptr_ptr, tile_req_ptr, tile_start_ptr, sm_scale_log2,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """Warp-specialised: a 1-warp producer (TMA) and two 4-warp consumer warpgroups of 64 query rows
    each (the default partition is consumer 0), synchronised by per-stage ready/empty mbarriers
    instead of a CTA-wide barrier, so the two warpgroups drift and one's softmax overlaps the other's
    wgmma. q_desc box [64, D]; the rest as ``ragged_prefill_gluon_kernel`` with BLOCK_M = 128."""
    head = gl.program_id(0)
    item = gl.program_id(1)
    req = gl.load(tile_req_ptr + item)
    m0 = gl.load(tile_start_ptr + item)
    q_start = gl.load(qo_indptr_ptr + req)
    q_len = gl.load(qo_indptr_ptr + req + 1) - q_start
    kv_start = gl.load(kv_indptr_ptr + req)
    kv_len = gl.load(kv_indptr_ptr + req + 1) - kv_start
    kv_col = (head // GROUP) * HEAD_DIM
    dtype: gl.constexpr = q_desc.dtype
    kv_hi = kv_len
    if IS_CAUSAL:
        kv_hi = gl.minimum(kv_len, m0 + 128 + kv_len - q_len)
    n_tiles = gl.cdiv(kv_hi, BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_start + m0, head, kv_start,
            kv_col, n_tiles, o_ptr, stride_o_tok, stride_o_head, q_len, m0, kv_len, sm_scale_log2, IS_CAUSAL, OVERLAP)
    gl.warp_specialize([(_ws_consume0, args), (_ws_consume1, args), (_ws_load, args)], [4, 1],
                       [CONSUMER_REGS, 24])


def _gl_dtype(t):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t]


def prefill_gluon(q, k, v, qo_indptr, kv_indptr, causal, block_m=128, block_n=128, stages=2, overlap=True,
                  num_warps=8, ws=False, consumer_regs=240):
    """q [tokens, H_qo, D], k/v [kv tokens, H_kv, D] contiguous; indptrs int32 on the device (host copies
    are taken here once: an experiment, not a plan/run split)."""
    tokens, hq, d = q.shape
    hk = k.shape[1]
    gdt = _gl_dtype(q.dtype)
    q_box = 64 if ws else block_m
    q_desc = TensorDescriptor(q.view(tokens, hq * d), [tokens, hq * d], [hq * d, 1], [q_box, d],
                              gl.NVMMASharedLayout.get_default_for([q_box, d], gdt))
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)
    n_kv = k.shape[0]
    k_desc = TensorDescriptor(k.view(n_kv, hk * d), [n_kv, hk * d], [hk * d, 1], [block_n, d], kv_layout)
    v_desc = TensorDescriptor(v.view(n_kv, hk * d), [n_kv, hk * d], [hk * d, 1], [block_n, d], kv_layout)
    qo = qo_indptr.cpu().tolist()
    kv = kv_indptr.cpu().tolist()
    items = []
    for r in range(len(qo) - 1):
        q_len, kv_len = qo[r + 1] - qo[r], kv[r + 1] - kv[r]
        for m0 in range(0, q_len, block_m):
            work = kv_len if not causal else min(kv_len, m0 + block_m + kv_len - q_len)
            items.append((work, r, m0))
    items.sort(key=lambda t: -t[0])  # heaviest first
    tile_req = torch.tensor([t[1] for t in items], dtype=torch.int32, device=q.device)
    tile_start = torch.tensor([t[2] for t in items], dtype=torch.int32, device=q.device)
    o = torch.empty_like(q)
    sm_scale_log2 = d ** -0.5 * LOG2E

    def launch_ws():
        ragged_prefill_gluon_ws_kernel[(hq, len(items))](
            q_desc, k_desc, v_desc, o, o.stride(0), o.stride(1), qo_indptr, kv_indptr, tile_req, tile_start,
            sm_scale_log2, GROUP=hq // hk, HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, IS_CAUSAL=causal,
            OVERLAP=overlap, CONSUMER_REGS=consumer_regs, num_warps=4,
            maxnreg=(consumer_regs * 8 + 24 * 4) // 12 // 8 * 8)
        return o

    if ws:
        return launch_ws

    def launch():
        ragged_prefill_gluon_kernel[(hq, len(items))](
            q_desc, k_desc, v_desc, o, o.stride(0), o.stride(1), qo_indptr, kv_indptr, tile_req, tile_start,
            sm_scale_log2, GROUP=hq // hk, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
            IS_CAUSAL=causal, OVERLAP=overlap, num_warps=num_warps)
        return o

    return launch


def parse_config(cfg):
    """``BLOCK_M-BLOCK_N-STAGES-ov|seq-WARPS`` or ``ws-BLOCK_N-STAGES-ov|seq-CONSUMER_REGS`` -> kwargs of
    ``prefill_gluon``."""
    parts = cfg.split("-")
    if parts[0] == "ws":
        return dict(block_m=128, block_n=int(parts[1]), stages=int(parts[2]), overlap=parts[3] == "ov", ws=True,
                    consumer_regs=int(parts[4]), num_warps=4)
    return dict(block_m=int(parts[0]), block_n=int(parts[1]), stages=int(parts[2]), overlap=parts[3] == "ov",
                num_warps=int(parts[4]), ws=False)


def compile_only(args):
    """Compile for sm_90 without a GPU and print registers, shared memory and the wgmma count."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for cfg in args.configs.split(","):
        c = parse_config(cfg)
        bm, bn, stages, warps = c["block_m"], c["block_n"], c["stages"], c["num_warps"]
        d = 128
        host = torch.empty(1024, 32 * d, dtype=torch.bfloat16)

        def desc(rows):
            layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
            return mangle_type(TensorDescriptor(host, list(host.shape), list(host.stride()), [rows, d], layout))

        sig = {"q_desc": desc(64 if c["ws"] else bm), "k_desc": desc(bn), "v_desc": desc(bn), "o_ptr": "*bf16",
               "stride_o_tok": "i32",
               "stride_o_head": "i32", "qo_indptr_ptr": "*i32", "kv_indptr_ptr": "*i32", "tile_req_ptr": "*i32",
               "tile_start_ptr": "*i32", "sm_scale_log2": "fp32"}
        const = dict(GROUP=4, HEAD_DIM=d, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=args.causal, OVERLAP=c["overlap"],
                     num_warps=warps)
        options = dict(num_warps=warps)
        if c["ws"]:
            const["CONSUMER_REGS"] = c["consumer_regs"]
            options["maxnreg"] = (c["consumer_regs"] * 8 + 24 * 4) // 12 // 8 * 8
        else:
            const["BLOCK_M"] = bm
        for name in const:
            sig[name] = "constexpr"
        kernel = ragged_prefill_gluon_ws_kernel if c["ws"] else ragged_prefill_gluon_kernel
        src = GluonASTSource(kernel, sig, const)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
            sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True,
                                  text=True).stdout
        reg = next((line.strip() for line in usage.splitlines() if "REG:" in line), usage.strip())
        print(cfg, reg, "shared", k.metadata.shared, "HGMMA", len(re.findall(r"HGMMA", sass)),
              "instructions", len(re.findall(r"^\s*/\*[0-9a-f]+\*/", sass, re.M)))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU)")
    ap.add_argument("--causal", action="store_true", help="with --compile")
    ap.add_argument("--configs", default="128-128-2-ov-8,128-64-3-ov-8,128-128-2-seq-8,128-64-3-seq-8",
                    help="BLOCK_M-BLOCK_N-STAGES-ov|seq-WARPS, comma-separated")
    ap.add_argument("--fa3", action="store_true", help="also FlashInfer's fa3 backend (JIT-compiles)")
    args = ap.parse_args(argv)
    if args.compile:
        compile_only(args)
        return
    import tritoninfer
    from tritoninfer import testing

    sys.path.insert(0, "benchmarks")
    from decode_sweep import eager_time

    shapes = [(16, 1024, 32, 8, 128), (4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128)]
    ws_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print("| shape | causal | kernel | µs | TFLOP/s | rel err vs tritoninfer |")
    print("|---|---|---|---|---|---|")
    for batch, n, hq, hk, d in shapes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (testing.randn((batch * n, h, d), torch.bfloat16, "cuda", generator=g) for h in (hq, hk, hk))
        indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda")
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf)
            w.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
            ref = w.run(q, k, v)
            rows = [("tritoninfer", lambda: w.run(q, k, v))]
            # torch SDPA (FlashAttention/cuDNN class on this GPU) on [B, H, N, D] copies, output
            # brought back to tokens-major outside the timing
            q4, k4, v4 = (x.view(batch, n, -1, d).transpose(1, 2).contiguous() for x in (q, k, v))

            def sdpa(q4=q4, k4=k4, v4=v4, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)

            rows.append(("sdpa", sdpa))
            if args.fa3:
                import flashinfer

                fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf, backend="fa3")
                fw.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
                rows.append(("flashinfer-fa3", lambda fw=fw: fw.run(q, k, v)))
            for cfg in args.configs.split(","):
                try:
                    fn = prefill_gluon(q, k, v, indptr, indptr, causal, **parse_config(cfg))
                    fn()
                    rows.append((f"gluon {cfg}", fn))
                except Exception as e:  # noqa: BLE001 (a config that does not build is reported)
                    print(f"| {batch}x{n} | {causal} | gluon {cfg} | failed: {type(e).__name__}: {str(e)[:300]} | | |",
                          flush=True)
            for name, fn in rows:
                out = fn()
                if name == "sdpa":
                    out = out.transpose(1, 2).reshape(batch * n, hq, d)
                torch.cuda.synchronize()
                err = testing.rel_error(out.float(), ref.float())
                us = eager_time(fn, reps=10)
                print(f"| {batch}x{n} | {causal} | {name} | {us:.0f} | {flops / us / 1e6:.0f} | {err:.2e} |", flush=True)
                if err > 2e-2:
                    print(f"MISMATCH: {name} differs from tritoninfer by {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
