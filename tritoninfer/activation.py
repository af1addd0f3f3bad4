"""tritoninfer.activation: gated activations, FlashInfer 0.5.3's ``flashinfer.activation``.

``input`` is ``[..., 2 * d]`` (fp16, bf16 or fp32, any strides); the result is
``act(input[..., :d]) * input[..., d:]`` of shape ``[..., d]``, computed in fp32 and rounded once.
FlashInfer also requires ``d * itemsize`` to be a multiple of 16 bytes; tritoninfer takes any ``d``.

``enable_pdl`` (programmatic dependent launch, a CUDA launch attribute FlashInfer uses on Hopper)
is accepted for compatibility and has no effect: Triton launches do not expose it.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _device, _ops
from ._launch import CachedLauncher
from ._plan import cdiv, next_pow2
from .kernels.activation import act_and_mul_kernel

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_ACT_AND_MUL = CachedLauncher(act_and_mul_kernel)

__all__ = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SILU, _GELU, _GELU_TANH = 0, 1, 2


def _as_2d(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A 2-D view ``[M, last]`` of ``t`` without copying, or ``None`` when the strides forbid it."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


@_ops.custom_op("act_and_mul", mutates_args=("out",))
def _act_and_mul_op(input: torch.Tensor, out: torch.Tensor, act: int) -> None:
    _act_and_mul(input, out, act)


def _act_and_mul(input, out, act: int) -> torch.Tensor:
    if _ops.compiling():
        if out is None:
            out = torch.empty(input.shape[:-1] + (input.shape[-1] // 2,), dtype=input.dtype, device=input.device)
        _act_and_mul_op(input, out, act)
        return out
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1:
        raise ValueError("input: expected at least 1 dimension [..., 2 * d], got a scalar")
    if input.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"input: expected dtype float16, bfloat16 or float32, got {input.dtype}")
    if input.shape[-1] % 2 != 0:
        raise ValueError(
            f"input: expected an even last dim [..., 2 * d], got shape {tuple(input.shape)}"
        )
    d = input.shape[-1] // 2
    out_shape = input.shape[:-1] + (d,)
    if out is None:
        out = torch.empty(out_shape, dtype=input.dtype, device=input.device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.shape != out_shape:
            raise ValueError(
                f"out: expected shape {tuple(out_shape)} (input's with the last dim halved), "
                f"got {tuple(out.shape)}"
            )
        if out.dtype != input.dtype:
            raise ValueError(f"out: expected dtype {input.dtype} like input, got {out.dtype}")
        if out.device != input.device:
            raise ValueError(f"out: expected a tensor on {input.device}, got one on {out.device}")
    if out.numel() == 0:
        return out

    x2 = _as_2d(input)
    if x2 is None:
        x2 = input.reshape(-1, input.shape[-1])
    o2 = _as_2d(out)
    # an out buffer whose strides cannot be flattened to 2-D is written through a temporary
    target = o2 if o2 is not None else torch.empty((x2.shape[0], d), dtype=out.dtype, device=out.device)
    m = x2.shape[0]

    if _device.is_interpreter():
        block_d = next_pow2(d)
        rows = max(1, min(next_pow2(m), 16384 // block_d))
        num_warps = 4
    else:
        block_d = min(next_pow2(d), 2048)
        rows = max(1, min(next_pow2(m), 2048 // block_d))
        num_warps = 4 if rows * block_d <= 1024 else 8
    grid = (cdiv(m, rows), cdiv(d, block_d))
    _ACT_AND_MUL[grid](
        x2, target, m, d,
        x2.stride(0), x2.stride(1), target.stride(0), target.stride(1),
        ACT=act, ROWS=rows, BLOCK_D=block_d, num_warps=num_warps,
    )
    if o2 is None:
        out.copy_(target.view(out_shape))
    return out


_DOC = """{summary}

    Parameters
    ----------
    input : torch.Tensor
        ``[..., 2 * d]``, fp16, bf16 or fp32.
    out : Optional[torch.Tensor]
        Output buffer ``[..., d]`` with ``input``'s dtype (any strides). Allocated when ``None``.
    enable_pdl : Optional[bool]
        Accepted for FlashInfer compatibility; has no effect in Triton.

    Returns
    -------
    torch.Tensor
        ``[..., d]``: ``{formula}`` (``out`` when given).
    """


def silu_and_mul(
    input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None
) -> torch.Tensor:
    return _act_and_mul(input, out, _SILU)


def gelu_and_mul(
    input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None
) -> torch.Tensor:
    return _act_and_mul(input, out, _GELU)


def gelu_tanh_and_mul(
    input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None
) -> torch.Tensor:
    return _act_and_mul(input, out, _GELU_TANH)


silu_and_mul.__doc__ = _DOC.format(
    summary="Fused SiLU and multiply (SwiGLU): ``silu(x[..., :d]) * x[..., d:]``.",
    formula="x1 * sigmoid(x1) * x2",
)
gelu_and_mul.__doc__ = _DOC.format(
    summary="Fused exact (erf) GELU and multiply: ``gelu(x[..., :d]) * x[..., d:]``.",
    formula="x1 / 2 * (1 + erf(x1 / sqrt(2))) * x2",
)
gelu_tanh_and_mul.__doc__ = _DOC.format(
    summary="Fused tanh-approximated GELU and multiply: ``gelu_tanh(x[..., :d]) * x[..., d:]``.",
    formula="x1 / 2 * (1 + tanh(sqrt(2/pi) * (x1 + 0.044715 x1^3))) * x2",
)
