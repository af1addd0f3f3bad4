"""Reference semantics of the elementwise APIs: RoPE (and RoPE + fp8 quantisation), RMSNorm
variants, LayerNorm, gated activations.

Pure PyTorch, computed in float32 from the (upcast) inputs, written from the FlashInfer 0.5.3
documentation and the Llama 3.1 paper/code conventions, independently of the Triton kernels. Every
function here is *functional*: nothing is modified in place, results come back as float32 tensors
on the inputs' device (the in-place public functions correspond to a reference that returns the
new values).

RoPE conventions (FlashInfer's):

- frequency of rotated pair ``j`` (``0 <= j < rotary_dim/2``): ``theta^(-2j/rotary_dim) / scale``,
  evaluated in float64 and rounded to float32; the angle ``position * freq`` is formed in float32
  (as the kernels do) and its cos/sin are taken in float32;
- ``interleave=False`` (NeoX / rotate-half) pairs ``x[j]`` with ``x[j + rotary_dim/2]``;
  ``interleave=True`` (GPT-J) pairs ``x[2j]`` with ``x[2j+1]``;
- ``out_a = a cos - b sin``, ``out_b = b cos + a sin`` for each pair ``(a, b)``;
- dimensions ``[rotary_dim, head_dim)`` pass through.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__all__ = [
    "rope_inv_freq",
    "llama31_rope_inv_freq",
    "ragged_positions",
    "rotate_pairs",
    "apply_rope",
    "apply_rope_pos_ids",
    "apply_llama31_rope",
    "apply_llama31_rope_pos_ids",
    "apply_rope_with_cos_sin_cache",
    "quantize_fp8_saturating",
    "rope_quantize_fp8",
    "mla_rope_quantize_fp8",
    "rmsnorm",
    "fused_add_rmsnorm",
    "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "layernorm",
    "silu_and_mul",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
]


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(rotary_dim: int, rope_scale: float = 1.0, rope_theta: float = 1e4) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]``: ``rope_theta ** (-2j / rotary_dim) / rope_scale``."""
    j = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return (float(rope_theta) ** (-2.0 * j / rotary_dim) / float(rope_scale)).to(torch.float32)


def llama31_rope_inv_freq(
    rotary_dim: int,
    rope_scale: float = 8.0,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    old_context_len: int = 8192,
) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]``: Llama 3.1's smoothed frequencies.

    With ``f = rope_theta ** (-2j / rotary_dim)`` and ``wavelen = 2 pi / f``:
    ``wavelen < old_context_len / high_freq_factor`` keeps ``f``;
    ``wavelen > old_context_len / low_freq_factor`` gives ``f / rope_scale``;
    otherwise ``s = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor -
    low_freq_factor)`` and the frequency is ``(1 - s) * f / rope_scale + s * f``.
    """
    j = torch.arange(rotary_dim // 2, dtype=torch.float64)
    f = float(rope_theta) ** (-2.0 * j / rotary_dim)
    wavelen = 2.0 * math.pi / f
    low_wavelen = old_context_len / low_freq_factor
    high_wavelen = old_context_len / high_freq_factor
    s = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1.0 - s) * f / rope_scale + s * f
    out = torch.where(
        wavelen < high_wavelen, f, torch.where(wavelen > low_wavelen, f / rope_scale, smoothed)
    )
    return out.to(torch.float32)


def ragged_positions(indptr: torch.Tensor, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """int64 ``[nnz]``: row ``indptr[i] + j`` is at position ``offsets[i] + j``.

    Rows outside ``[indptr[0], indptr[-1])`` get position 0 (no rotation)."""
    pos = torch.zeros(nnz, dtype=torch.int64)
    ind = indptr.cpu().tolist()
    off = offsets.cpu().tolist()
    for i in range(len(ind) - 1):
        start, end = ind[i], ind[i + 1]
        pos[start:end] = off[i] + torch.arange(end - start, dtype=torch.int64)
    return pos.to(indptr.device)


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` [nnz, H, D] (float32) by ``cos``/``sin``
    ``[nnz, rotary_dim/2]``; the other dims pass through."""
    x = x.to(torch.float32)
    half = cos.shape[-1]
    rot = 2 * half
    c = cos.to(torch.float32)[:, None, :]
    s = sin.to(torch.float32)[:, None, :]
    out = x.clone()
    if interleave:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * c - b * s
        out[..., 1:rot:2] = b * c + a * s
    else:
        a, b = x[..., :half], x[..., half:rot]
        out[..., :half] = a * c - b * s
        out[..., half:rot] = b * c + a * s
    return out


def _rotate_at(x, positions, inv_freq, interleave):
    angle = positions.to(x.device, torch.float32)[:, None] * inv_freq.to(x.device)[None, :]
    return rotate_pairs(x, torch.cos(angle), torch.sin(angle), interleave)


def apply_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` [nnz, Hq, D] and ``k`` [nnz, Hk, D] at positions ``pos_ids`` [nnz]."""
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = rope_inv_freq(rotary_dim, rope_scale, rope_theta)
    return _rotate_at(q, pos_ids, inv_freq, interleave), _rotate_at(k, pos_ids, inv_freq, interleave)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged RoPE: row ``indptr[i] + j`` at position ``offsets[i] + j``."""
    pos = ragged_positions(indptr, offsets, q.shape[0])
    return apply_rope_pos_ids(q, k, pos, rotary_dim, interleave, rope_scale, rope_theta)


def apply_llama31_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Llama 3.1 RoPE (see :func:`llama31_rope_inv_freq`) at positions ``pos_ids``."""
    rotary_dim = q.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = llama31_rope_inv_freq(
        rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len
    )
    return _rotate_at(q, pos_ids, inv_freq, interleave), _rotate_at(k, pos_ids, inv_freq, interleave)


def apply_llama31_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged Llama 3.1 RoPE: row ``indptr[i] + j`` at position ``offsets[i] + j``."""
    pos = ragged_positions(indptr, offsets, q.shape[0])
    return apply_llama31_rope_pos_ids(
        q, k, pos, rotary_dim, interleave, rope_scale, rope_theta,
        low_freq_factor, high_freq_factor, old_context_len,
    )


def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE with a ``[max_pos, rotary_dim]`` cache holding ``[cos | sin]``; ``query``/``key`` are
    ``[nnz, H * head_size]`` (or 3-D); results have the input shapes."""
    cache = cos_sin_cache.to(torch.float32)
    half = cache.shape[1] // 2
    rows = cache[positions.long()]
    cos, sin = rows[:, :half], rows[:, half:]

    def one(x):
        x3 = x.reshape(x.shape[0], -1, head_size)
        return rotate_pairs(x3, cos, sin, interleave=not is_neox).reshape(x.shape)

    return one(query), one(key)


# ---------------------------------------------------------------------------------------------
# RoPE + fp8 quantisation
# ---------------------------------------------------------------------------------------------


def quantize_fp8_saturating(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` -> fp8 ``dtype``: round to nearest even, values beyond the largest finite one
    (infinities included) become it, NaN stays NaN (CUDA's ``__NV_SATFINITE`` conversion, which
    FlashInfer uses; ``Tensor.to`` alone overflows e5m2 to inf)."""
    mx = torch.finfo(dtype).max
    x = x.to(torch.float32)
    return torch.where(torch.isnan(x), x, x.clamp(-mx, mx)).to(dtype)


def _cache_cos_sin(cos_sin_cache: torch.Tensor, pos_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[nnz, rope_dim/2]`` from a ``[max_pos, rope_dim]`` ``[cos | sin]`` cache; positions
    outside the cache give cos 1, sin 0 (the token is left unrotated)."""
    cache = cos_sin_cache.to(torch.float32)
    half = cache.shape[1] // 2
    pos = pos_ids.long().to(cache.device)
    inside = (pos >= 0) & (pos < cache.shape[0])
    rows = cache[torch.where(inside, pos, torch.zeros_like(pos))]
    cos = torch.where(inside[:, None], rows[:, :half], torch.ones_like(rows[:, :half]))
    sin = torch.where(inside[:, None], rows[:, half:], torch.zeros_like(rows[:, half:]))
    return cos, sin


def rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: Optional[torch.Tensor],
    k_nope: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_rope_out, k_rope_out, q_nope_out, k_nope_out)`` in the fp8 ``quantize_dtype`` (default
    e4m3): the rope parts rotated in float32 with ``cos_sin_cache[pos]`` (pairs ``(j, j + rope_dim/2)``
    when ``is_neox``, else ``(2j, 2j+1)``; pair ``j`` uses column ``j``), every part times its scale
    (``quant_scale_q`` for q, ``quant_scale_kv`` for k) and cast by :func:`quantize_fp8_saturating`.
    ``k_*`` may be 2-D (MLA); ``None`` nope parts give size-0 outputs."""
    dtype = torch.float8_e4m3fn if quantize_dtype is None else quantize_dtype
    if q_nope is None:
        q_nope = q_rope.new_zeros((q_rope.shape[0], q_rope.shape[1], 0))
    if k_nope is None:
        k_nope = k_rope.new_zeros(tuple(k_rope.shape[:-1]) + (0,))
    cos, sin = _cache_cos_sin(cos_sin_cache, pos_ids)
    q_rot = rotate_pairs(q_rope, cos, sin, interleave=not is_neox)
    k3 = k_rope if k_rope.dim() == 3 else k_rope.unsqueeze(1)
    k_rot = rotate_pairs(k3, cos, sin, interleave=not is_neox).reshape(k_rope.shape)
    return (
        quantize_fp8_saturating(q_rot * quant_scale_q, dtype),
        quantize_fp8_saturating(k_rot * quant_scale_kv, dtype),
        quantize_fp8_saturating(q_nope.to(torch.float32) * quant_scale_q, dtype),
        quantize_fp8_saturating(k_nope.to(torch.float32) * quant_scale_kv, dtype),
    )


mla_rope_quantize_fp8 = rope_quantize_fp8


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


def _rms_normalize(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in float32 (``input`` 2-D or 3-D)."""
    return _rms_normalize(input, weight.to(torch.float32), eps)


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2, -1) + eps) * (1 + weight)`` in float32."""
    return _rms_normalize(input, 1.0 + weight.to(torch.float32), eps)


def fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Functional form of the in-place op: ``r = residual + input`` (float32), returns
    ``(rmsnorm(r) * weight, r)``: the new ``input`` and the new ``residual``."""
    r = input.to(torch.float32) + residual.to(torch.float32)
    return _rms_normalize(r, weight.to(torch.float32), eps), r


def gemma_fused_add_rmsnorm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rmsnorm` with Gemma's ``1 + weight``."""
    r = input.to(torch.float32) + residual.to(torch.float32)
    return _rms_normalize(r, 1.0 + weight.to(torch.float32), eps), r


def layernorm(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * gemma + beta`` over the last dim, float32 (``var`` the
    biased variance ``mean((x - mean)^2)``)."""
    x = input.to(torch.float32)
    mean = x.mean(dim=-1, keepdim=True)
    var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * gemma.to(torch.float32) + beta.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# gated activations: input [..., 2d] -> [..., d]
# ---------------------------------------------------------------------------------------------


def _halves(input: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    x = input.to(torch.float32)
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` with ``silu(a) = a * sigmoid(a)``, float32."""
    a, b = _halves(input)
    return torch.nn.functional.silu(a) * b


def gelu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``gelu(x[..., :d]) * x[..., d:]`` with the exact erf GELU ``a/2 (1 + erf(a/sqrt 2))``."""
    a, b = _halves(input)
    return torch.nn.functional.gelu(a, approximate="none") * b


def gelu_tanh_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` with
    ``gelu_tanh(a) = a/2 (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))``."""
    a, b = _halves(input)
    return torch.nn.functional.gelu(a, approximate="tanh") * b
