"""RMSNorm, fused residual-add RMSNorm and LayerNorm: ``@triton.jit`` code only.

    y = x / sqrt(mean(x^2) + eps) * (weight + weight_bias)        (weight_bias 1 for Gemma)

Rows are the leading dims of a 2-D ``[M, N]`` or 3-D ``[B, H, N]`` tensor (row ``r`` is
``(r // H, r % H)``; a 2-D tensor has ``H = 1``), addressed through strides, so strided views
(e.g. q inside a packed qkv) need no copy. One program handles ``ROWS`` rows of ``BLOCK_N``
columns; rows longer than ``BLOCK_N`` are walked in ``NUM_CHUNKS`` chunks twice (sum of squares,
then normalise). The reduction and the scaling are in fp32; the result is rounded once.

With ``FUSED_ADD``: ``r = x + residual`` (fp32) is written back to ``residual`` and ``rmsnorm(r)``
to the output (which is ``input`` itself for FlashInfer's in-place op). With one chunk the fp32
``r`` is normalised, as FlashInfer does; with several, the second pass re-reads the rounded
``residual``.
"""

import triton
import triton.language as tl


@triton.jit
def _row_offsets(rows, H, s0, s1):
    """int64 offset of the start of each row ``rows`` [ROWS] of a ``[B, H, N]`` tensor."""
    r = rows.to(tl.int64)
    return (r // H) * s0 + (r % H) * s1


@triton.jit
def rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    M, N, H,
    sx0, sx1, sx2, sr0, sr1, sr2, so0, so1, so2, sw,
    eps, weight_bias,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    FUSED_ADD: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    m_r = rows < M
    row_x = _row_offsets(rows, H, sx0, sx1)
    row_o = _row_offsets(rows, H, so0, so1)
    if FUSED_ADD:
        row_r = _row_offsets(rows, H, sr0, sr1)
    cols = tl.arange(0, BLOCK_N)

    if NUM_CHUNKS == 1:
        m_c = cols < N
        m = m_r[:, None] & m_c[None, :]
        # [ROWS, BLOCK_N]
        x = tl.load(x_ptr + row_x[:, None] + cols[None, :] * sx2, mask=m, other=0.0).to(tl.float32)
        if FUSED_ADD:
            p_r = res_ptr + row_r[:, None] + cols[None, :] * sr2
            # [ROWS, BLOCK_N]
            x += tl.load(p_r, mask=m, other=0.0).to(tl.float32)
            tl.store(p_r, x.to(res_ptr.dtype.element_ty), mask=m)
        # [ROWS]
        rrms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        # [BLOCK_N]
        w = tl.load(w_ptr + cols * sw, mask=m_c, other=0.0).to(tl.float32) + weight_bias
        y = x * rrms[:, None] * w[None, :]
        tl.store(out_ptr + row_o[:, None] + cols[None, :] * so2, y.to(out_ptr.dtype.element_ty), mask=m)
    else:
        # pass 1: sum of squares (and the residual update)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_N + cols
            m = m_r[:, None] & (cc < N)[None, :]
            # [ROWS, BLOCK_N]
            x = tl.load(x_ptr + row_x[:, None] + cc[None, :] * sx2, mask=m, other=0.0).to(tl.float32)
            if FUSED_ADD:
                p_r = res_ptr + row_r[:, None] + cc[None, :] * sr2
                x += tl.load(p_r, mask=m, other=0.0).to(tl.float32)
                tl.store(p_r, x.to(res_ptr.dtype.element_ty), mask=m)
            acc += x * x
        rrms = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        # pass 2: normalise
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_N + cols
            m_c = cc < N
            m = m_r[:, None] & m_c[None, :]
            if FUSED_ADD:
                p_in = res_ptr + row_r[:, None] + cc[None, :] * sr2
            else:
                p_in = x_ptr + row_x[:, None] + cc[None, :] * sx2
            # [ROWS, BLOCK_N]
            x = tl.load(p_in, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cc * sw, mask=m_c, other=0.0).to(tl.float32) + weight_bias
            y = x * rrms[:, None] * w[None, :]
            tl.store(out_ptr + row_o[:, None] + cc[None, :] * so2, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def layernorm_kernel(
    x_ptr,  # [M, N]
    gamma_ptr,  # [N]
    beta_ptr,  # [N]
    out_ptr,  # [M, N]
    M, N,
    sx0, sx1, so0, so1, sg, sb,
    eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta, with mean and the biased variance
    ``mean((x - mean)^2)`` over a row (two-pass, as FlashInfer's kernel), all in fp32; rounded once.

    One program handles ``ROWS`` rows of ``BLOCK_N`` columns; longer rows are walked in
    ``NUM_CHUNKS`` chunks three times (sum, squared deviations, normalise).
    """
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    m_r = rows < M
    row_x = rows.to(tl.int64) * sx0
    row_o = rows.to(tl.int64) * so0
    cols = tl.arange(0, BLOCK_N)

    if NUM_CHUNKS == 1:
        m_c = cols < N
        m = m_r[:, None] & m_c[None, :]
        # [ROWS, BLOCK_N]
        x = tl.load(x_ptr + row_x[:, None] + cols[None, :] * sx1, mask=m, other=0.0).to(tl.float32)
        # [ROWS]
        mean = tl.sum(x, axis=1) / N
        d = tl.where(m, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
        # [BLOCK_N]
        g = tl.load(gamma_ptr + cols * sg, mask=m_c, other=0.0).to(tl.float32)
        # [BLOCK_N]
        b = tl.load(beta_ptr + cols * sb, mask=m_c, other=0.0).to(tl.float32)
        y = d * rstd[:, None] * g[None, :] + b[None, :]
        tl.store(out_ptr + row_o[:, None] + cols[None, :] * so1, y.to(out_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_N + cols
            m = m_r[:, None] & (cc < N)[None, :]
            acc += tl.load(x_ptr + row_x[:, None] + cc[None, :] * sx1, mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=1) / N
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_N + cols
            m = m_r[:, None] & (cc < N)[None, :]
            x = tl.load(x_ptr + row_x[:, None] + cc[None, :] * sx1, mask=m, other=0.0).to(tl.float32)
            d = tl.where(m, x - mean[:, None], 0.0)
            acc += d * d
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        for c in range(NUM_CHUNKS):
            cc = c * BLOCK_N + cols
            m_c = cc < N
            m = m_r[:, None] & m_c[None, :]
            x = tl.load(x_ptr + row_x[:, None] + cc[None, :] * sx1, mask=m, other=0.0).to(tl.float32)
            g = tl.load(gamma_ptr + cc * sg, mask=m_c, other=0.0).to(tl.float32)
            b = tl.load(beta_ptr + cc * sb, mask=m_c, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
            tl.store(out_ptr + row_o[:, None] + cc[None, :] * so1, y.to(out_ptr.dtype.element_ty), mask=m)
