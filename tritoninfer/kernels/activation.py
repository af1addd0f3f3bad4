"""Gated activations ``act(x[..., :d]) * x[..., d:]``: ``@triton.jit`` code only.

``ACT``: 0 SiLU ``a * sigmoid(a)``; 1 exact GELU ``a/2 (1 + erf(a / sqrt 2))``; 2 tanh GELU
``a/2 (1 + tanh(u))`` with ``u = sqrt(2/pi) (a + 0.044715 a^3)``, computed as the identical
``a * sigmoid(2u)`` (``libdevice.tanh`` does not run under the interpreter, and this form has no
cancellation near 0). All in fp32, rounded once.

Grid ``(cdiv(M, ROWS), cdiv(d, BLOCK_D))`` over the 2-D view ``[M, 2d] -> [M, d]``.
"""

import triton
import triton.language as tl

SQRT1_2 = tl.constexpr(0.7071067811865476)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def act_and_mul_kernel(
    x_ptr, out_ptr, M, D,
    sxm, sxd, som, sod,
    ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_m * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (rows < M)[:, None] & (cols < D)[None, :]
    p_a = x_ptr + rows[:, None] * sxm + cols[None, :].to(tl.int64) * sxd
    # [ROWS, BLOCK_D]
    a = tl.load(p_a, mask=m, other=0.0).to(tl.float32)
    # [ROWS, BLOCK_D]
    b = tl.load(p_a + D * sxd, mask=m, other=0.0).to(tl.float32)
    # exp arguments are capped at 80 (e^80 < FLT_MAX): the quotients are ~0 there either way, and
    # no inf is formed
    if ACT == 0:
        g = a / (1.0 + tl.exp(tl.minimum(-a, 80.0)))
    elif ACT == 1:
        g = 0.5 * a * (1.0 + tl.math.erf(a * SQRT1_2))
    else:
        u = SQRT_2_OVER_PI * (a + 0.044715 * a * a * a)
        g = a / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))
    y = g * b
    p_o = out_ptr + rows[:, None] * som + cols[None, :].to(tl.int64) * sod
    tl.store(p_o, y.to(out_ptr.dtype.element_ty), mask=m)
