"""tritoninfer.norm: RMSNorm, fused residual-add RMSNorm and LayerNorm, FlashInfer 0.5.3's ``flashinfer.norm``.

``input`` is 2-D ``[batch, hidden]`` or 3-D ``[batch, heads, head_dim]`` (normalised over the last
dim, e.g. per-head q/k norm), fp16, bf16 or fp32, any strides. ``weight`` is 1-D over the last dim
(any float dtype; FlashInfer reads it in the input's dtype). The reduction and the scaling are in
fp32 and the result is rounded once.

``enable_pdl`` (programmatic dependent launch, a CUDA launch attribute FlashInfer uses on Hopper)
is accepted for compatibility and has no effect: Triton launches do not expose it.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _device, _ops
from ._launch import CachedLauncher
from ._plan import cdiv, next_pow2
from .kernels.norm import layernorm_kernel, rmsnorm_kernel

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_RMSNORM = CachedLauncher(rmsnorm_kernel)
_LAYERNORM = CachedLauncher(layernorm_kernel)

__all__ = ["rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "layernorm"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# columns held in registers per program before the kernel switches to a two-pass chunked loop
_MAX_BLOCK_N = 16384


def _check_input(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in (2, 3):
        raise ValueError(f"{name}: expected a 2-D or 3-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")


def _check_like(t, name: str, input: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != input.shape:
        raise ValueError(
            f"{name}: expected shape {tuple(input.shape)} like input, got {tuple(t.shape)}"
        )
    if t.dtype != input.dtype:
        raise ValueError(f"{name}: expected dtype {input.dtype} like input, got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{name}: expected a tensor on {input.device}, got one on {t.device}")


def _check_weight(weight, input: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or weight.shape[0] != input.shape[-1]:
        raise ValueError(
            f"weight: expected shape ({input.shape[-1]},) (the last dim of input), "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight: expected dtype float16, bfloat16 or float32, got {weight.dtype}")
    if weight.device != input.device:
        raise ValueError(f"weight: expected a tensor on {input.device}, got one on {weight.device}")


def _strides3(t: torch.Tensor):
    """(s0, s1, s2) of a 2-D (as ``[M, 1, N]``) or 3-D tensor."""
    if t.dim() == 2:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _launch(input, residual, weight, out, eps: float, weight_bias: float) -> None:
    n = input.shape[-1]
    h = input.shape[1] if input.dim() == 3 else 1
    m = input.numel() // n if n else 0
    if m == 0 or n == 0:
        return
    block_n = min(next_pow2(n), _MAX_BLOCK_N)
    num_chunks = cdiv(n, block_n)
    if _device.is_interpreter():
        # each interpreted op costs the same whatever the tile: few, large programs
        rows = max(1, min(next_pow2(m), 16384 // block_n))
        num_warps = 4
    else:
        # small rows (per-head q/k norm): several rows per program, ~2K elements each
        rows = max(1, min(next_pow2(m), 2048 // block_n))
        elems = rows * block_n
        num_warps = 4 if elems <= 1024 else 8 if elems <= 4096 else 16
    fused = residual is not None
    res = residual if fused else input
    _RMSNORM[(cdiv(m, rows),)](
        input, res, weight, out,
        m, n, h,
        *_strides3(input), *_strides3(res), *_strides3(out), weight.stride(0),
        float(eps), float(weight_bias),
        ROWS=rows, BLOCK_N=block_n, NUM_CHUNKS=num_chunks, FUSED_ADD=fused,
        num_warps=num_warps,
    )


@_ops.custom_op("rmsnorm", mutates_args=("out",))
def _rmsnorm_op(input: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, weight_bias: float) -> None:
    _rmsnorm(input, weight, eps, out, weight_bias)


@_ops.custom_op("fused_add_rmsnorm", mutates_args=("input", "residual"))
def _fused_add_rmsnorm_op(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          weight_bias: float) -> None:
    _fused_add_rmsnorm(input, residual, weight, eps, weight_bias)


def _rmsnorm(input, weight, eps, out, weight_bias):
    if _ops.compiling():
        out = torch.empty_like(input) if out is None else out
        _rmsnorm_op(input, weight, out, float(eps), float(weight_bias))
        return out
    _check_input(input, "input")
    _check_weight(weight, input)
    if out is None:
        out = torch.empty_like(input)
    else:
        _check_like(out, "out", input)
    _launch(input, None, weight, out, eps, weight_bias)
    return out


def _fused_add_rmsnorm(input, residual, weight, eps, weight_bias):
    if _ops.compiling():
        _fused_add_rmsnorm_op(input, residual, weight, float(eps), float(weight_bias))
        return
    _check_input(input, "input")
    _check_like(residual, "residual", input)
    _check_weight(weight, input)
    _launch(input, residual, weight, input, eps, weight_bias)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
) -> torch.Tensor:
    r"""Root mean square normalisation: ``out = input / sqrt(mean(input^2) + eps) * weight``.

    Parameters
    ----------
    input : torch.Tensor
        ``[batch_size, hidden_size]`` or ``[batch_size, num_heads, head_dim]``; fp16, bf16 or fp32.
    weight : torch.Tensor
        ``[hidden_size]`` (the last dim of ``input``).
    eps : float
        Added to the mean square. Default ``1e-6``.
    out : Optional[torch.Tensor]
        Output buffer, same shape and dtype as ``input`` (any strides; may be ``input`` itself).
    enable_pdl : Optional[bool]
        Accepted for FlashInfer compatibility; has no effect in Triton.

    Returns
    -------
    torch.Tensor
        The normalised tensor (``out`` when given).
    """
    return _rmsnorm(input, weight, eps, out, 0.0)


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
) -> None:
    r"""Fused residual add and RMSNorm, in place:

    ``residual[i] = residual[i] + input[i]``;
    ``input[i] = residual[i] / sqrt(mean(residual[i]^2) + eps) * weight``.

    The sum is kept in fp32 for the normalisation (rows up to 16384 wide) and rounded once into
    ``residual``.

    Parameters
    ----------
    input : torch.Tensor
        ``[batch_size, hidden_size]`` (or 3-D); overwritten with the normalised sum.
    residual : torch.Tensor
        Same shape and dtype as ``input``; overwritten with ``residual + input``.
    weight : torch.Tensor
        ``[hidden_size]``.
    eps : float
        Default ``1e-6``.
    enable_pdl : Optional[bool]
        Accepted for FlashInfer compatibility; has no effect in Triton.
    """
    _fused_add_rmsnorm(input, residual, weight, eps, 0.0)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
) -> torch.Tensor:
    r"""Gemma-style RMSNorm: ``out = input / sqrt(mean(input^2) + eps) * (weight + 1)``.

    Parameters are those of :func:`rmsnorm` (``enable_pdl`` has no effect in Triton).
    """
    return _rmsnorm(input, weight, eps, out, 1.0)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
) -> None:
    r"""Gemma-style fused residual add and RMSNorm, in place:

    ``residual += input``; ``input = residual / sqrt(mean(residual^2) + eps) * (weight + 1)``.

    Parameters are those of :func:`fused_add_rmsnorm` (``enable_pdl`` has no effect in Triton).
    """
    _fused_add_rmsnorm(input, residual, weight, eps, 1.0)


def _check_affine(t, name: str, input: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != input.shape[-1]:
        raise ValueError(f"{name}: expected shape ({input.shape[-1]},) (the last dim of input), got {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 (float16 or bfloat16 accepted), got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{name}: expected a tensor on {input.device}, got one on {t.device}")


def _layernorm_into(input, gemma, beta, out, eps) -> None:
    """Checks, then one launch (the work of :func:`layernorm`, also its custom op's)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() != 2:
        raise ValueError(f"input: expected a 2-D tensor [batch_size, hidden_size], got shape {tuple(input.shape)}")
    if input.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"input: expected dtype bfloat16 (float16 or float32 accepted), got {input.dtype}")
    _check_affine(gemma, "gemma", input)
    _check_affine(beta, "beta", input)
    _check_like(out, "out", input)
    m, n = input.shape
    if m == 0 or n == 0:
        return
    _device.check_launchable(input.device, "input")
    block_n = min(next_pow2(n), _MAX_BLOCK_N)
    if _device.is_interpreter():
        # each interpreted op costs the same whatever the tile: few, large programs
        rows, num_warps = max(1, min(next_pow2(m), 16384 // block_n)), 4
    else:
        # one row per program for wide rows (FlashInfer's one block per token), several for narrow ones
        rows = max(1, min(next_pow2(m), 2048 // block_n))
        elems = rows * block_n
        num_warps = 4 if elems <= 1024 else 8 if elems <= 4096 else 16
    _LAYERNORM[(cdiv(m, rows),)](
        input, gemma, beta, out, m, n,
        input.stride(0), input.stride(1), out.stride(0), out.stride(1), gemma.stride(0), beta.stride(0),
        float(eps),
        ROWS=rows, BLOCK_N=block_n, NUM_CHUNKS=cdiv(n, block_n), num_warps=num_warps,
    )


@_ops.custom_op("layernorm", mutates_args=("out",))
def _layernorm_op(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    _layernorm_into(input, gemma, beta, out, eps)


def layernorm(
    input: torch.Tensor,
    gemma: torch.Tensor,
    beta: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""Layer normalisation: ``out = (input - mean) / sqrt(var + eps) * gemma + beta`` per row, with
    ``var`` the biased variance ``mean((input - mean)^2)``; fp32 arithmetic, rounded once.

    Parameters
    ----------
    input : torch.Tensor
        ``[batch_size, hidden_size]``, bfloat16 (FlashInfer 0.5.3's only dtype; float16 and float32
        are accepted too), any strides.
    gemma : torch.Tensor
        The scale (FlashInfer's name for gamma), ``[hidden_size]``, float32 (fp16/bf16 accepted).
    beta : torch.Tensor
        The shift, ``[hidden_size]``, float32 (fp16/bf16 accepted).
    eps : float
        Added to the variance. Default ``1e-6``.

    Returns
    -------
    torch.Tensor
        ``[batch_size, hidden_size]``, the dtype of ``input`` (a new tensor).
    """
    out = torch.empty_like(input)
    if _ops.compiling():
        _layernorm_op(input, gemma, beta, out, float(eps))
    else:
        _layernorm_into(input, gemma, beta, out, eps)
    return out
