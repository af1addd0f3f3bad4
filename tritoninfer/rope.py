"""tritoninfer.rope: rotary positional embeddings, FlashInfer 0.5.3's ``flashinfer.rope`` API.

Every function launches the one kernel of ``kernels/rope.py``. Shapes and semantics:

- ``q`` is ``[nnz, num_q_heads, head_dim]`` and ``k`` is ``[nnz, num_k_heads, head_dim]`` (any
  strides; fp16, bf16 or fp32). The ``*_inplace`` forms overwrite ``q`` and ``k`` through their
  own strides; the others return new tensors made with ``torch.empty_like``.
- Ragged forms (``indptr``, ``offsets``): the token at row ``indptr[i] + j`` is at position
  ``offsets[i] + j``. Rows outside ``[indptr[0], indptr[-1])`` are left unrotated (FlashInfer
  leaves them unwritten in the out-of-place forms).
- ``pos_ids`` forms: the token at row ``t`` is at position ``pos_ids[t]``.
- Only the first ``rotary_dim`` dimensions (default ``head_dim``) are rotated; the rest pass through.
- ``interleave=False`` rotates pairs ``(x[j], x[j + rotary_dim/2])`` (rotate-half, NeoX);
  ``interleave=True`` rotates pairs ``(x[2j], x[2j+1])`` (GPT-J).
- Frequency of pair ``j``: ``rope_theta^(-2j/rotary_dim) / rope_scale``. The Llama 3.1 forms
  smooth it as Llama 3.1 does: with ``wavelen = 2*pi/f`` (``f = rope_theta^(-2j/rotary_dim)``),
  ``f`` is kept when ``wavelen < old_context_len/high_freq_factor``, divided by ``rope_scale`` when
  ``wavelen > old_context_len/low_freq_factor``, and interpolated in between with
  ``s = (old_context_len/wavelen - low_freq_factor)/(high_freq_factor - low_freq_factor)``:
  ``(1-s)*f/rope_scale + s*f``.
- Angles, cos/sin and the rotation are computed in fp32; the result is rounded once to the dtype.

tritoninfer is broader than FlashInfer here: any even ``head_dim`` and ``rotary_dim`` (FlashInfer
dispatches head_dim 64/128/256), fp32 inputs, and int32 or int64 index tensors.

``rope_quantize_fp8`` (and its MLA name) and ``rope_quantize_fp8_append_paged_kv_cache`` take the
rotary and non-rotary parts of q/k separately, rotate the former with a ``cos_sin_cache``, and write
everything as fp8 (saturating), the latter with K/V straight into a paged cache: one kernel each
(``rope_quantize_kernel``). Under the Triton interpreter, whose fp32 -> fp8 cast is wrong, the kernel
computes the fp8 bits itself (exact round-to-nearest-even); on the GPU it uses the hardware cast.
"""

from __future__ import annotations

import math
import struct
from typing import Optional, Sequence, Tuple

import torch

from . import _device, _errors, _ops
from ._launch import CachedLauncher
from ._options import FP8_DTYPES, INDEX_DTYPES, TensorLayout, canonicalize_dtype, parse_layout, same_device
from ._plan import cdiv, next_pow2
from .kernels.rope import rope_kernel, rope_quantize_kernel

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_ROPE = CachedLauncher(rope_kernel)
_ROPE_QUANTIZE = CachedLauncher(rope_quantize_kernel)

__all__ = [
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "rope_quantize_fp8",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------


def _check_float_tensor(t, name: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")


def _check_index_tensor(t, name: str, length: Optional[int], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: expected {length} elements, got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def _check_qk(q, k) -> Tuple[int, int, int, int]:
    _check_float_tensor(q, "q", 3)
    _check_float_tensor(k, "k", 3)
    nnz, num_q_heads, head_dim = q.shape
    if k.shape[0] != nnz:
        raise ValueError(f"k: expected {nnz} rows like q, got shape {tuple(k.shape)}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k: expected head_dim {head_dim} like q, got shape {tuple(k.shape)}")
    if k.device != q.device:
        raise ValueError(f"k: expected a tensor on {q.device} like q, got one on {k.device}")
    return nnz, num_q_heads, k.shape[1], head_dim


def _resolve_rotary_dim(rotary_dim: Optional[int], head_dim: int) -> int:
    if rotary_dim is None:
        rotary_dim = head_dim
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise ValueError(f"rotary_dim: expected None or an int, got {rotary_dim!r}")
    if rotary_dim <= 0 or rotary_dim % 2 != 0 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim: expected an even int in [2, head_dim={head_dim}], got {rotary_dim}"
        )
    return rotary_dim


def _check_positive(value, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a positive float, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}: expected a positive finite float, got {value!r}")
    return v


def _llama31_smoothing(low_freq_factor, high_freq_factor, old_context_len) -> Tuple[float, float]:
    """``smooth(f) = clamp(f * a + b, 0, 1)`` equals Llama 3.1's interpolation weight
    ``(old_context_len / wavelen - low) / (high - low)`` with ``wavelen = 2 pi / f``."""
    low = _check_positive(low_freq_factor, "low_freq_factor")
    high = _check_positive(high_freq_factor, "high_freq_factor")
    old = _check_positive(old_context_len, "old_context_len")
    if not high > low:
        raise ValueError(
            f"high_freq_factor ({high_freq_factor!r}) must be greater than low_freq_factor "
            f"({low_freq_factor!r})"
        )
    return old / (2.0 * math.pi * (high - low)), -low / (high - low)


# ---------------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------------


def _launch(
    q, k, q_out, k_out, *, rotary_dim: int, interleave: bool,
    pos_ids=None, indptr=None, offsets=None, cos_sin_cache=None,
    rope_scale: float = 1.0, rope_theta: float = 1e4, smooth_a: float = 0.0, smooth_b: float = 0.0,
) -> None:
    """Rotate ``q``/``k`` (3-D) into ``q_out``/``k_out`` (3-D, same shapes; may be ``q``/``k``)."""
    nnz, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    num_heads = num_q_heads + num_k_heads
    if nnz == 0 or num_heads == 0:
        return

    in_place = q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    half_pad = next_pow2(rotary_dim // 2)
    pass_dim = head_dim - rotary_dim
    pass_pad = next_pow2(pass_dim) if pass_dim > 0 else 1
    copy_pass = pass_dim > 0 and not in_place

    if _device.is_interpreter():
        # each interpreted op costs the same whatever the tile: few, large programs
        block_t = min(next_pow2(nnz), 64)
        n_groups = 1
        heads_per_prog = num_heads
        num_warps = 4
    else:
        # ~2K rotated elements per head step; split the heads over programs when there are few
        # token blocks (decode batches), as FlashInfer's head-parallel variant does
        block_t = max(1, min(64, 2048 // (2 * half_pad), next_pow2(nnz)))
        t_progs = cdiv(nnz, block_t)
        target = 8 * _device.num_sms(q.device)
        n_groups = min(num_heads, max(1, cdiv(target, t_progs)))
        heads_per_prog = cdiv(num_heads, n_groups)
        n_groups = cdiv(num_heads, heads_per_prog)
        num_warps = 4 if block_t * half_pad <= 1024 else 8

    ragged = indptr is not None
    use_cache = cos_sin_cache is not None
    dummy = q  # pointer arguments that the selected variant never reads
    batch_size = indptr.numel() - 1 if ragged else 0
    n_search = max(batch_size - 1, 0).bit_length()

    grid = (cdiv(nnz, block_t), n_groups)
    _ROPE[grid](
        q, k, q_out, k_out,
        pos_ids if pos_ids is not None else dummy,
        indptr if ragged else dummy,
        offsets if ragged else dummy,
        cos_sin_cache if use_cache else dummy,
        nnz, num_q_heads, num_k_heads, heads_per_prog, batch_size, n_search,
        cos_sin_cache.shape[0] if use_cache else 0,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos_sin_cache.stride(0) if use_cache else 0,
        cos_sin_cache.stride(1) if use_cache else 0,
        math.log2(rope_theta), 1.0 / rope_scale, smooth_a, smooth_b,
        ROT=rotary_dim, HALF_PAD=half_pad, HEAD_DIM=head_dim, PASS_PAD=pass_pad,
        INTERLEAVE=bool(interleave), RAGGED=ragged, USE_CACHE=use_cache,
        COPY_PASS=copy_pass, BLOCK_T=block_t,
        num_warps=num_warps,
    )


@_ops.custom_op("rope", mutates_args=("q_out", "k_out"))
def _rope_op(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, indptr: Optional[torch.Tensor],
             offsets: Optional[torch.Tensor], pos_ids: Optional[torch.Tensor], rotary_dim: Optional[int],
             interleave: bool, rope_scale: float, rope_theta: float, smooth_a: float, smooth_b: float) -> None:
    """RoPE of ``q``/``k`` into ``q_out``/``k_out`` (ragged: ``indptr``/``offsets``; else ``pos_ids``)."""
    args = (rotary_dim, interleave, rope_scale, rope_theta, smooth_a, smooth_b)
    if pos_ids is None:
        _ragged(q, k, indptr, offsets, *args, in_place=False, outs=(q_out, k_out))
    else:
        _pos_ids(q, k, pos_ids, *args, in_place=False, outs=(q_out, k_out))


@_ops.custom_op("rope_inplace", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, indptr: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
                     pos_ids: Optional[torch.Tensor], rotary_dim: Optional[int], interleave: bool, rope_scale: float,
                     rope_theta: float, smooth_a: float, smooth_b: float) -> None:
    args = (rotary_dim, interleave, rope_scale, rope_theta, smooth_a, smooth_b)
    if pos_ids is None:
        _ragged(q, k, indptr, offsets, *args, in_place=True)
    else:
        _pos_ids(q, k, pos_ids, *args, in_place=True)


def _traced(q, k, indptr, offsets, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, smooth_a, smooth_b,
            in_place):
    """Under torch.compile: the custom ops above (``_ops.py``)."""
    args = (rotary_dim, bool(interleave), float(rope_scale), float(rope_theta), float(smooth_a), float(smooth_b))
    if in_place:
        _rope_inplace_op(q, k, indptr, offsets, pos_ids, *args)
        return q, k
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _rope_op(q, k, q_out, k_out, indptr, offsets, pos_ids, *args)
    return q_out, k_out


def _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
            smooth_a, smooth_b, in_place: bool, outs=None):
    if _ops.compiling():
        return _traced(q, k, indptr, offsets, None, rotary_dim, interleave, rope_scale, rope_theta, smooth_a,
                       smooth_b, in_place)
    nnz, _, _, head_dim = _check_qk(q, k)
    _check_index_tensor(indptr, "indptr", None, q.device)
    if indptr.numel() < 1:
        raise ValueError("indptr: expected batch_size + 1 >= 1 elements, got 0")
    _check_index_tensor(offsets, "offsets", indptr.numel() - 1, q.device)
    rotary_dim = _resolve_rotary_dim(rotary_dim, head_dim)
    scale = _check_positive(rope_scale, "rope_scale")
    theta = _check_positive(rope_theta, "rope_theta")
    q_out, k_out = (q, k) if in_place else outs if outs is not None else (torch.empty_like(q), torch.empty_like(k))
    _launch(q, k, q_out, k_out, rotary_dim=rotary_dim, interleave=interleave,
            indptr=indptr, offsets=offsets, rope_scale=scale, rope_theta=theta,
            smooth_a=smooth_a, smooth_b=smooth_b)
    return q_out, k_out


def _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
             smooth_a, smooth_b, in_place: bool, outs=None):
    if _ops.compiling():
        return _traced(q, k, None, None, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, smooth_a,
                       smooth_b, in_place)
    nnz, _, _, head_dim = _check_qk(q, k)
    _check_index_tensor(pos_ids, "pos_ids", nnz, q.device)
    rotary_dim = _resolve_rotary_dim(rotary_dim, head_dim)
    scale = _check_positive(rope_scale, "rope_scale")
    theta = _check_positive(rope_theta, "rope_theta")
    q_out, k_out = (q, k) if in_place else outs if outs is not None else (torch.empty_like(q), torch.empty_like(k))
    _launch(q, k, q_out, k_out, rotary_dim=rotary_dim, interleave=interleave,
            pos_ids=pos_ids, rope_scale=scale, rope_theta=theta,
            smooth_a=smooth_a, smooth_b=smooth_b)
    return q_out, k_out


_COMMON_DOC = """
    Parameters
    ----------
    q : torch.Tensor
        Queries, shape ``[nnz, num_q_heads, head_dim]``, dtype fp16, bf16 or fp32, any strides.
    k : torch.Tensor
        Keys, shape ``[nnz, num_k_heads, head_dim]``, same head_dim as ``q``.
    {pos}
    rotary_dim : Optional[int]
        Rotate the first ``rotary_dim`` dimensions (even); the rest pass through. Default: head_dim.
    interleave : bool
        ``False``: rotate pairs ``(x[j], x[j + rotary_dim/2])`` (rotate-half, NeoX);
        ``True``: rotate pairs ``(x[2j], x[2j+1])``. Default ``False``.
    rope_scale : float
        Frequencies are divided by it. Default ``{scale}``.
    rope_theta : float
        Base of the frequencies ``rope_theta^(-2j/rotary_dim)``. Default ``{theta}``.{llama}
"""

_RAGGED_POS = """indptr : torch.Tensor
        int32/int64 ``[batch_size + 1]``: request ``i`` owns rows ``indptr[i]:indptr[i+1]``.
    offsets : torch.Tensor
        int32/int64 ``[batch_size]``: row ``indptr[i] + j`` is at position ``offsets[i] + j``."""

_IDS_POS = """pos_ids : torch.Tensor
        int32/int64 ``[nnz]``: the position of each row."""

_LLAMA_DOC = """
    low_freq_factor : float
        Llama 3.1 smoothing: wavelengths above ``old_context_len / low_freq_factor`` are scaled by
        ``1/rope_scale``. Default ``1``.
    high_freq_factor : float
        Wavelengths below ``old_context_len / high_freq_factor`` are kept; in between the
        frequency is interpolated. Must be greater than ``low_freq_factor``. Default ``4``.
    old_context_len : int
        The pre-training context length of Llama 3.1's smoothing. Default ``8192``."""


def _doc(summary: str, pos: str, scale: str, theta: str, llama: bool, returns: str) -> str:
    return summary + "\n" + _COMMON_DOC.format(
        pos=pos, scale=scale, theta=theta, llama=_LLAMA_DOC if llama else ""
    ) + returns


_RET_PAIR = """
    Returns
    -------
    (q_rope, k_rope) : Tuple[torch.Tensor, torch.Tensor]
        New tensors shaped like ``q`` and ``k`` (made with ``torch.empty_like``).
    """

_RET_NONE = """
    Returns
    -------
    None
        ``q`` and ``k`` are overwritten in place (through their own strides).
    """


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


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
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
                   0.0, 0.0, in_place=False)


def apply_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
            0.0, 0.0, in_place=True)


def apply_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
                    0.0, 0.0, in_place=False)


def apply_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
) -> None:
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
             0.0, 0.0, in_place=True)


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
    a, b = _llama31_smoothing(low_freq_factor, high_freq_factor, old_context_len)
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
                   a, b, in_place=False)


def apply_llama31_rope_inplace(
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
) -> None:
    a, b = _llama31_smoothing(low_freq_factor, high_freq_factor, old_context_len)
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
            a, b, in_place=True)


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
    a, b = _llama31_smoothing(low_freq_factor, high_freq_factor, old_context_len)
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
                    a, b, in_place=False)


def apply_llama31_rope_pos_ids_inplace(
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
) -> None:
    a, b = _llama31_smoothing(low_freq_factor, high_freq_factor, old_context_len)
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
             a, b, in_place=True)


apply_rope.__doc__ = _doc(
    "Apply RoPE to a ragged batch of queries/keys; cos/sin are computed in the kernel.",
    _RAGGED_POS, "1", "1e4", False, _RET_PAIR)
apply_rope_inplace.__doc__ = _doc(
    "Apply RoPE to a ragged batch of queries/keys, in place.",
    _RAGGED_POS, "1", "1e4", False, _RET_NONE)
apply_rope_pos_ids.__doc__ = _doc(
    "Apply RoPE to queries/keys at explicit positions ``pos_ids``.",
    _IDS_POS, "1", "1e4", False, _RET_PAIR)
apply_rope_pos_ids_inplace.__doc__ = _doc(
    "Apply RoPE to queries/keys at explicit positions ``pos_ids``, in place.",
    _IDS_POS, "1", "1e4", False, _RET_NONE)
apply_llama31_rope.__doc__ = _doc(
    "Apply Llama 3.1 RoPE (smoothed frequency scaling) to a ragged batch of queries/keys.",
    _RAGGED_POS, "8", "5e5", True, _RET_PAIR)
apply_llama31_rope_inplace.__doc__ = _doc(
    "Apply Llama 3.1 RoPE to a ragged batch of queries/keys, in place.",
    _RAGGED_POS, "8", "5e5", True, _RET_NONE)
apply_llama31_rope_pos_ids.__doc__ = _doc(
    "Apply Llama 3.1 RoPE to queries/keys at explicit positions ``pos_ids``.",
    _IDS_POS, "8", "5e5", True, _RET_PAIR)
apply_llama31_rope_pos_ids_inplace.__doc__ = _doc(
    "Apply Llama 3.1 RoPE to queries/keys at explicit positions ``pos_ids``, in place.",
    _IDS_POS, "8", "5e5", True, _RET_NONE)


def _as_heads(t: torch.Tensor, name: str, head_size: int) -> torch.Tensor:
    """``[nnz, H*head_size]`` or ``[nnz, H, head_size]`` -> a 3-D view ``[nnz, H, head_size]``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() == 3:
        if t.shape[2] != head_size:
            raise ValueError(
                f"{name}: expected last dim head_size={head_size}, got shape {tuple(t.shape)}"
            )
        return t
    if t.dim() == 2:
        if t.shape[1] % head_size != 0:
            raise ValueError(
                f"{name}: expected shape [nnz, num_heads * head_size] with head_size={head_size}, "
                f"got {tuple(t.shape)}"
            )
        return t.unflatten(1, (t.shape[1] // head_size, head_size))
    raise ValueError(f"{name}: expected a 2-D or 3-D tensor, got shape {tuple(t.shape)}")


@_ops.custom_op("rope_cos_sin_cache", mutates_args=("query_out", "key_out"))
def _cos_sin_cache_op(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, query_out: torch.Tensor,
                      key_out: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, in_place=False, outs=(query_out, key_out))


@_ops.custom_op("rope_cos_sin_cache_inplace", mutates_args=("query", "key"))
def _cos_sin_cache_inplace_op(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                              cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, in_place=True)


def _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, in_place, outs=None):
    if _ops.compiling():
        if in_place:
            _cos_sin_cache_inplace_op(positions, query, key, head_size, cos_sin_cache, bool(is_neox))
            return query, key
        query_out, key_out = torch.empty_like(query), torch.empty_like(key)
        _cos_sin_cache_op(positions, query, key, query_out, key_out, head_size, cos_sin_cache, bool(is_neox))
        return query_out, key_out
    if not isinstance(head_size, int) or isinstance(head_size, bool) or head_size <= 0:
        raise ValueError(f"head_size: expected a positive int, got {head_size!r}")
    q3 = _as_heads(query, "query", head_size)
    k3 = _as_heads(key, "key", head_size)
    nnz = q3.shape[0]
    if k3.shape[0] != nnz:
        raise ValueError(f"key: expected {nnz} rows like query, got shape {tuple(key.shape)}")
    if key.device != query.device:
        raise ValueError(f"key: expected a tensor on {query.device}, got one on {key.device}")
    _check_index_tensor(positions, "positions", nnz, query.device)
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache: expected a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache: expected dtype float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(
            f"cos_sin_cache: expected shape [max_pos, rotary_dim], got {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.device != query.device:
        raise ValueError(
            f"cos_sin_cache: expected a tensor on {query.device}, got one on {cos_sin_cache.device}"
        )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim <= 0 or rotary_dim % 2 != 0 or rotary_dim > head_size:
        raise ValueError(
            f"cos_sin_cache: expected an even rotary_dim (shape[1]) in [2, head_size={head_size}], "
            f"got {rotary_dim}"
        )
    if in_place:
        query_out, key_out = query, key
        qo3, ko3 = q3, k3
    else:
        query_out, key_out = outs if outs is not None else (torch.empty_like(query), torch.empty_like(key))
        qo3 = _as_heads(query_out, "query", head_size)
        ko3 = _as_heads(key_out, "key", head_size)
    _launch(q3, k3, qo3, ko3, rotary_dim=rotary_dim, interleave=not is_neox,
            pos_ids=positions, cos_sin_cache=cos_sin_cache)
    return query_out, key_out


def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE with precomputed cos/sin (the SGLang/vLLM convention).

    Parameters
    ----------
    positions : torch.Tensor
        int32/int64 ``[nnz]``: the position of each row. Positions outside
        ``[0, cos_sin_cache.shape[0])`` leave the row unrotated (no out-of-bounds read).
    query : torch.Tensor
        ``[nnz, num_q_heads * head_size]`` (or ``[nnz, num_q_heads, head_size]``), fp16/bf16/fp32.
    key : torch.Tensor
        ``[nnz, num_k_heads * head_size]`` (or ``[nnz, num_k_heads, head_size]``).
    head_size : int
        The head dimension.
    cos_sin_cache : torch.Tensor
        float32 ``[max_pos, rotary_dim]``: ``cos`` in the first ``rotary_dim/2`` columns, ``sin``
        in the last; pair ``j`` uses column ``j``. Dimensions ``[rotary_dim, head_size)`` pass through.
    is_neox : bool
        ``True``: rotate-half pairs ``(x[j], x[j + rotary_dim/2])``; ``False``: interleaved pairs
        ``(x[2j], x[2j+1])``. Default ``True``.

    Returns
    -------
    (query_out, key_out) : Tuple[torch.Tensor, torch.Tensor]
        New tensors shaped like ``query`` and ``key``.
    """
    return _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, in_place=False)


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """In-place :func:`apply_rope_with_cos_sin_cache`: ``query`` and ``key`` are overwritten
    through their own strides. Same parameters; returns ``None``."""
    _cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox, in_place=True)


# ---------------------------------------------------------------------------------------------
# RoPE + fp8 quantisation (+ paged KV append)
# ---------------------------------------------------------------------------------------------


def _fp8_constexprs(dtype: torch.dtype) -> dict:
    """The fp8 format for ``rope_quantize_kernel``: largest finite value (and its fp32 bits),
    mantissa bits, exponent bias."""
    mx = float(torch.finfo(dtype).max)
    mbits, ebias = (3, 7) if dtype == torch.float8_e4m3fn else (2, 15)
    return dict(FP8_MAX=mx, FP8_MBITS=mbits, FP8_EBIAS=ebias,
                FP8_MAX_BITS=struct.unpack("<i", struct.pack("<f", mx))[0])


def _last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")


def _fill_nope(q_rope, k_rope, q_nope, k_nope):
    """Type/rank checks the defaults need; ``None`` nope parts become size-0 tensors (as FlashInfer)."""
    for t, n in ((q_rope, "q_rope"), (k_rope, "k_rope")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
    if q_rope.dim() != 3:
        raise ValueError(
            f"q_rope: expected a 3-D tensor [nnz, num_qo_heads, rope_dim], got shape {tuple(q_rope.shape)}"
        )
    if k_rope.dim() not in (2, 3):
        raise ValueError(
            f"k_rope: expected [nnz, num_kv_heads, rope_dim] (GQA/MHA) or [nnz, rope_dim] (MLA), "
            f"got shape {tuple(k_rope.shape)}"
        )
    if q_nope is None:
        q_nope = q_rope.new_empty((q_rope.shape[0], q_rope.shape[1], 0))
    if k_nope is None:
        k_nope = k_rope.new_empty(tuple(k_rope.shape[:-1]) + (0,))
    return q_nope, k_nope


def _quantize_dtype(quantize_dtype, outs: Sequence[Optional[torch.Tensor]]) -> torch.dtype:
    """FlashInfer's rule: the given dtype, else the first given output's, else float8_e4m3fn."""
    if quantize_dtype is None:
        given = [o for o in outs if o is not None]
        if not given:
            return torch.float8_e4m3fn
        if not isinstance(given[0], torch.Tensor):
            raise TypeError(f"outputs: expected torch.Tensor buffers, got {type(given[0]).__name__}")
        dtype = given[0].dtype
        name = "the given output buffers' dtype (quantize_dtype=None)"
    else:
        dtype = canonicalize_dtype(quantize_dtype, "quantize_dtype")
        name = "quantize_dtype"
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return dtype


def _check_rq_inputs(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids):
    """-> (nnz, num_qo_heads, num_kv_heads, rope_dim, no_rope_dim); ``k_*`` 2-D is MLA (one KV head)."""
    nnz, num_qo_heads, rope_dim = q_rope.shape
    if q_rope.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q_rope: expected dtype float16, bfloat16 or float32, got {q_rope.dtype}")
    is_mla = k_rope.dim() == 2
    num_kv_heads = 1 if is_mla else k_rope.shape[1]
    if k_rope.shape[0] != nnz or k_rope.shape[-1] != rope_dim:
        raise ValueError(
            f"k_rope: expected {nnz} rows of rope_dim {rope_dim} like q_rope, got shape {tuple(k_rope.shape)}"
        )
    if rope_dim <= 0 or rope_dim % 2 != 0:
        raise ValueError(f"q_rope: expected an even rope_dim (last dim) >= 2, got {rope_dim}")
    for t, n in ((q_nope, "q_nope"), (k_nope, "k_nope")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor or None, got {type(t).__name__}")
    if q_nope.dim() != 3 or q_nope.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"q_nope: expected shape [{nnz}, {num_qo_heads}, no_rope_dim] like q_rope, got {tuple(q_nope.shape)}"
        )
    no_rope_dim = q_nope.shape[2]
    want_k_nope = tuple(k_rope.shape[:-1]) + (no_rope_dim,)
    if tuple(k_nope.shape) != want_k_nope:
        raise ValueError(
            f"k_nope: expected shape {list(want_k_nope)} (k_rope's rows and heads, q_nope's no_rope_dim), "
            f"got {tuple(k_nope.shape)}"
        )
    for t, n in ((k_rope, "k_rope"), (q_nope, "q_nope"), (k_nope, "k_nope")):
        if t.dtype != q_rope.dtype:
            raise ValueError(f"{n}: expected dtype {q_rope.dtype} like q_rope, got {t.dtype}")
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache: expected a torch.Tensor, got {type(cos_sin_cache).__name__}")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache: expected dtype float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        raise ValueError(
            f"cos_sin_cache: expected shape [max_seq_len, rope_dim={rope_dim}] ([cos | sin]), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    _check_index_tensor(pos_ids, "pos_ids", nnz, q_rope.device)
    for t, n in ((k_rope, "k_rope"), (q_nope, "q_nope"), (k_nope, "k_nope"), (cos_sin_cache, "cos_sin_cache")):
        if not same_device(t.device, q_rope.device):
            raise ValueError(f"{n}: expected a tensor on {q_rope.device} like q_rope, got one on {t.device}")
    for t, n in ((q_rope, "q_rope"), (k_rope, "k_rope"), (q_nope, "q_nope"), (k_nope, "k_nope")):
        _last_dim_contiguous(t, n)
    return nnz, num_qo_heads, num_kv_heads, rope_dim, no_rope_dim


def _check_out(out, name: str, like: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if out.shape != like.shape:
        raise ValueError(f"{name}: expected shape {tuple(like.shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (the quantize dtype), got {out.dtype}")
    if not same_device(out.device, like.device):
        raise ValueError(f"{name}: expected a tensor on {like.device}, got one on {out.device}")
    _last_dim_contiguous(out, name)


def _rows3(t: torch.Tensor) -> Tuple[int, int]:
    """(token, head) strides of a 3-D ``[nnz, H, d]`` or 2-D ``[nnz, d]`` (one head) tensor."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


# The GPU program shape of ``rope_quantize_kernel`` (benchmarks/rope_append_tune.py sweeps these):
# about _STEP_ELEMENTS elements a head step, heads split over programs until the grid holds
# _PROGRAMS_PER_SM programs an SM, _WIDE_WARPS warps for steps above 2,048 elements.
_STEP_ELEMENTS = 4096
_PROGRAMS_PER_SM = 8
_WIDE_WARPS = 8
# software-pipelined head loops (tl.range num_stages): 1 is the plain loop. On sm_90 3 stages turn each
# head's loads into cp.async issued a head ahead at ~the same 60-63 registers a thread; timed on the
# H200 (session 17, decode 4,096 tokens): 24.43 µs at 1, 27.81 at 2, 24.67 at 3. Kept for the tune script
_HEAD_STAGES = 1


def _rq_launch(q_rope, q_nope, k_rope, k_nope, v, q_rope_out, q_nope_out, k_rope_out, k_nope_out, v_out,
               cos_sin_cache, pos_ids, scale_q: float, scale_kv: float, interleave: bool,
               append: Optional[tuple] = None) -> None:
    """One launch of ``rope_quantize_kernel``. ``k_rope_out``/``k_nope_out``/``v_out`` are
    ``(tensor, (s_a, s_b, s_h))``: rows ``(token, 0, head)`` of the outputs, or ``(page, slot, head)``
    of the cache with ``append = (batch_indices, positions, kv_indices, kv_indptr, num_pages, page_size)``."""
    nnz, num_q_heads, rope_dim = q_rope.shape
    num_k_heads = k_rope.shape[1] if k_rope.dim() == 3 else 1
    no_rope_dim = q_nope.shape[2]
    head_dim = rope_dim + no_rope_dim
    has_v = v is not None
    units = num_q_heads + num_k_heads * (2 if has_v else 1)
    if nnz == 0:
        return
    fp8 = q_rope_out.dtype
    soft = _device.is_interpreter()
    half_pad = next_pow2(rope_dim // 2)
    nope_pad = next_pow2(no_rope_dim) if no_rope_dim else 1
    vd_pad = next_pow2(head_dim) if has_v else 1
    if soft:
        # each interpreted op costs the same whatever the tile: few, large programs
        block_t, n_groups, units_per_prog, num_warps = min(next_pow2(nnz), 64), 1, units, 4
    else:
        # ~4K elements per head step; split the heads over programs when there are few token
        # blocks (decode batches)
        widest = max(2 * half_pad, nope_pad, vd_pad)
        block_t = max(1, min(64, _STEP_ELEMENTS // widest, next_pow2(nnz)))
        target = _PROGRAMS_PER_SM * _device.num_sms(q_rope.device)
        n_groups = min(units, max(1, cdiv(target, cdiv(nnz, block_t))))
        units_per_prog = cdiv(units, n_groups)
        n_groups = cdiv(units, units_per_prog)
        num_warps = 4 if block_t * widest <= 2048 else _WIDE_WARPS

    # outputs as uint8 views when the kernel computes the fp8 bits itself (interpreter)
    def out(t):
        return t.view(torch.uint8) if soft else t

    k_rope_t, (s_okr_a, s_okr_b, s_okr_h) = k_rope_out
    k_nope_t, (s_okn_a, s_okn_b, s_okn_h) = k_nope_out if no_rope_dim else (k_rope_out[0], (0, 0, 0))
    v_t, (s_ov_a, s_ov_b, s_ov_h) = v_out if has_v else (k_rope_out[0], (0, 0, 0))
    # pointer arguments the selected variant never reads
    q_nope_in = q_nope if no_rope_dim else q_rope
    k_nope_in = k_nope if no_rope_dim else k_rope
    q_nope_o = q_nope_out if no_rope_dim else q_rope_out
    if append is None:
        batch_indices = positions = kv_indices = kv_indptr = pos_ids
        err, num_pages, page_size, batch_size, num_indices = pos_ids, 0, 1, 0, 0
    else:
        batch_indices, positions, kv_indices, kv_indptr, num_pages, page_size = append
        err = _errors.fault_record(q_rope.device)
        batch_size, num_indices = kv_indptr.numel() - 1, kv_indices.numel()

    _ROPE_QUANTIZE[(cdiv(nnz, block_t), n_groups)](
        q_rope, q_nope_in, k_rope, k_nope_in, v if has_v else q_rope,
        out(q_rope_out), out(q_nope_o), out(k_rope_t), out(k_nope_t), out(v_t),
        cos_sin_cache, pos_ids, batch_indices, positions, kv_indices, kv_indptr, err,
        nnz, num_q_heads, num_k_heads, units_per_prog, cos_sin_cache.shape[0],
        batch_size, num_pages, num_indices, page_size,
        *_rows3(q_rope), *_rows3(q_nope_in), *_rows3(q_rope_out), *_rows3(q_nope_o),
        *_rows3(k_rope), *_rows3(k_nope_in), *(_rows3(v) if has_v else (0, 0)),
        s_okr_a, s_okr_b, s_okr_h, s_okn_a, s_okn_b, s_okn_h, s_ov_a, s_ov_b, s_ov_h,
        cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        float(scale_q), float(scale_kv),
        ROT=rope_dim, HALF_PAD=half_pad, NOPE=no_rope_dim, NOPE_PAD=nope_pad, VD=head_dim, VD_PAD=vd_pad,
        INTERLEAVE=bool(interleave), APPEND=append is not None, HAS_V=has_v, SOFT_FP8=soft,
        **_fp8_constexprs(fp8), BLOCK_T=block_t, STAGES=_HEAD_STAGES, num_warps=num_warps,
    )


def _rope_quantize_into(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                        q_nope_out, k_nope_out, is_neox, quant_scale_q, quant_scale_kv) -> None:
    """Checks, then one launch (the work of :func:`rope_quantize_fp8`, also its custom op's)."""
    _check_rq_inputs(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids)
    fp8 = q_rope_out.dtype if isinstance(q_rope_out, torch.Tensor) else None
    if fp8 not in FP8_DTYPES:
        raise ValueError(f"q_rope_out: expected dtype torch.float8_e4m3fn or torch.float8_e5m2, got {fp8}")
    for out, name, like in ((q_rope_out, "q_rope_out", q_rope), (k_rope_out, "k_rope_out", k_rope),
                            (q_nope_out, "q_nope_out", q_nope), (k_nope_out, "k_nope_out", k_nope)):
        _check_out(out, name, like, fp8)
    _device.check_launchable(q_rope.device, "q_rope")
    k_rows = (k_rope_out, (k_rope_out.stride(0), 0, _rows3(k_rope_out)[1]))
    kn_rows = (k_nope_out, (k_nope_out.stride(0), 0, _rows3(k_nope_out)[1]))
    _rq_launch(q_rope, q_nope, k_rope, k_nope, None, q_rope_out, q_nope_out, k_rows, kn_rows, None,
               cos_sin_cache, pos_ids, quant_scale_q, quant_scale_kv, interleave=not is_neox)


@_ops.custom_op("rope_quantize_fp8", mutates_args=("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"))
def _rope_quantize_op(q_rope: torch.Tensor, k_rope: torch.Tensor, q_nope: torch.Tensor, k_nope: torch.Tensor,
                      cos_sin_cache: torch.Tensor, pos_ids: torch.Tensor, q_rope_out: torch.Tensor,
                      k_rope_out: torch.Tensor, q_nope_out: torch.Tensor, k_nope_out: torch.Tensor, is_neox: bool,
                      quant_scale_q: float, quant_scale_kv: float) -> None:
    _rope_quantize_into(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out,
                        q_nope_out, k_nope_out, is_neox, quant_scale_q, quant_scale_kv)


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
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Apply RoPE to the rotary part of q and k and quantise everything to fp8, in one kernel.

    For each token ``t`` at position ``p = pos_ids[t]``, pair ``j`` of the rotary part is rotated
    by ``cos = cos_sin_cache[p, j]``, ``sin = cos_sin_cache[p, rope_dim/2 + j]``; the non-rotary
    ("nope") part is left as it is. Every output is ``fp8(x * scale)`` (fp32 arithmetic, rounded
    to nearest even and saturated to the format's largest finite value, NaN kept, as FlashInfer's
    ``__NV_SATFINITE`` conversion), with ``quant_scale_q`` for q and ``quant_scale_kv`` for k.

    Parameters
    ----------
    q_rope : torch.Tensor
        Query, rotary part, shape ``[nnz, num_qo_heads, rope_dim]``, fp16/bf16 (fp32 too).
    k_rope : torch.Tensor
        Key, rotary part: ``[nnz, num_kv_heads, rope_dim]`` (GQA/MHA) or ``[nnz, rope_dim]`` (MLA).
    q_nope : Optional[torch.Tensor]
        Query, non-rotary part, ``[nnz, num_qo_heads, no_rope_dim]``; ``None`` means no_rope_dim 0.
    k_nope : Optional[torch.Tensor]
        Key, non-rotary part, ``[nnz, num_kv_heads, no_rope_dim]`` or ``[nnz, no_rope_dim]`` (MLA);
        ``None`` means no_rope_dim 0.
    cos_sin_cache : torch.Tensor
        float32 ``[max_seq_len, rope_dim]``: cos in the first half of a row, sin in the second.
        Positions outside ``[0, max_seq_len)`` leave the token unrotated (no out-of-bounds read).
    pos_ids : torch.Tensor
        int32/int64 ``[nnz]``: the position of each token.
    is_neox : bool
        ``True`` (default): rotate pairs ``(x[j], x[j + rope_dim/2])``; ``False``: interleaved pairs
        ``(x[2j], x[2j+1])`` (both use ``cos_sin_cache[p, j]`` for pair ``j``).
    quantize_dtype : Optional[torch.dtype]
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; ``None``: the dtype of the first given
        output buffer, else ``float8_e4m3fn``.
    quant_scale_q, quant_scale_kv : float
        Multipliers applied before the cast (default ``1.0``).
    q_rope_out, k_rope_out, q_nope_out, k_nope_out : Optional[torch.Tensor]
        Output buffers shaped like the matching inputs, in the quantize dtype (strided views with a
        contiguous last dim are fine, e.g. slices of one ``[nnz, H, head_dim]`` tensor); allocated
        with ``torch.empty_like`` when ``None``.
    enable_pdl : bool
        Accepted for FlashInfer compatibility; has no effect in Triton.

    Returns
    -------
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out) : Tuple[torch.Tensor, ...]
        The fp8 tensors (size-0 nope outputs when the nope inputs were ``None``).

    Note
    ----
    Broader than FlashInfer 0.5.3: any even ``rope_dim`` (FlashInfer: 16 to 256, powers of two),
    any ``no_rope_dim``, fp32 inputs, strided inputs.
    """
    q_nope, k_nope = _fill_nope(q_rope, k_rope, q_nope, k_nope)
    fp8 = _quantize_dtype(quantize_dtype, (q_rope_out, k_rope_out, q_nope_out, k_nope_out))
    q_rope_out = torch.empty_like(q_rope, dtype=fp8) if q_rope_out is None else q_rope_out
    k_rope_out = torch.empty_like(k_rope, dtype=fp8) if k_rope_out is None else k_rope_out
    q_nope_out = torch.empty_like(q_nope, dtype=fp8) if q_nope_out is None else q_nope_out
    k_nope_out = torch.empty_like(k_nope, dtype=fp8) if k_nope_out is None else k_nope_out
    args = (q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, q_rope_out, k_rope_out, q_nope_out,
            k_nope_out, bool(is_neox), float(quant_scale_q), float(quant_scale_kv))
    if _ops.compiling():
        _rope_quantize_op(*args)
    else:
        for out, name in ((q_rope_out, "q_rope_out"), (k_rope_out, "k_rope_out"), (q_nope_out, "q_nope_out"),
                          (k_nope_out, "k_nope_out")):
            if isinstance(out, torch.Tensor) and out.dtype != fp8:
                raise ValueError(f"{name}: expected dtype {fp8} (quantize_dtype), got {out.dtype}")
        _rope_quantize_into(*args)
    return q_rope_out, k_rope_out, q_nope_out, k_nope_out


def mla_rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r""":func:`rope_quantize_fp8` under its MLA name (FlashInfer's thin wrapper): typically
    ``k_rope`` ``[nnz, rope_dim]`` and ``k_nope`` ``[nnz, kv_lora_rank]`` (one shared latent head),
    ``q_rope`` ``[nnz, num_heads, rope_dim]``, ``q_nope`` ``[nnz, num_heads, kv_lora_rank]``.
    Same parameters and returns."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
                             quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out,
                             enable_pdl)


def _cache_rows(t: torch.Tensor) -> Tuple[int, int, int]:
    """(page, slot, head) strides of a cache view ``[P, page_size, H, d]`` or ``[P, page_size, d]``."""
    return (t.stride(0), t.stride(1), t.stride(2) if t.dim() == 4 else 0)


def _append_into(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, cache0, cache1, kv_indices, kv_indptr,
                 batch_indices, positions, q_rope_out, q_nope_out, is_neox, quant_scale_q, quant_scale_kv,
                 page_size, kv_layout) -> None:
    """Checks, then one launch (the work of :func:`rope_quantize_fp8_append_paged_kv_cache`, also its
    custom op's)."""
    nnz, num_qo_heads, num_kv_heads, rope_dim, no_rope_dim = _check_rq_inputs(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids)
    fp8 = q_rope_out.dtype if isinstance(q_rope_out, torch.Tensor) else None
    if fp8 not in FP8_DTYPES:
        raise ValueError(f"q_rope_out: expected dtype torch.float8_e4m3fn or torch.float8_e5m2, got {fp8}")
    _check_out(q_rope_out, "q_rope_out", q_rope, fp8)
    _check_out(q_nope_out, "q_nope_out", q_nope, fp8)
    for t, n in ((cache0, "paged_kv_cache[0]"), (cache1, "paged_kv_cache[1]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != fp8:
            raise ValueError(f"{n}: cache dtype {t.dtype} differs from the quantize dtype {fp8}")
        if not same_device(t.device, q_rope.device):
            raise ValueError(f"{n}: expected a tensor on {q_rope.device} like q_rope, got one on {t.device}")
        _last_dim_contiguous(t, n)
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    is_mla = k_rope.dim() == 2
    if is_mla:
        if v is not None:
            raise ValueError("v: MLA (2-D k_rope) takes no V tensor (k_nope is the compressed KV); pass None")
        ckv, kpe = cache0, cache1
        if ckv.dim() != 3 or kpe.dim() != 3:
            raise ValueError(
                f"paged_kv_cache: MLA expects (ckv_cache [max_pages, page_size, no_rope_dim], kpe_cache "
                f"[max_pages, page_size, rope_dim]), got shapes {tuple(ckv.shape)} and {tuple(kpe.shape)}"
            )
        want_ckv = (kpe.shape[0], page_size, no_rope_dim)
        if tuple(ckv.shape) != want_ckv or tuple(kpe.shape) != (ckv.shape[0], page_size, rope_dim):
            raise ValueError(
                f"paged_kv_cache: expected ckv_cache {list(want_ckv)} and kpe_cache [{kpe.shape[0]}, {page_size}, "
                f"{rope_dim}] (page_size {page_size}, no_rope_dim {no_rope_dim}, rope_dim {rope_dim}), got "
                f"{tuple(ckv.shape)} and {tuple(kpe.shape)}"
            )
        k_rows = (kpe, _cache_rows(kpe))
        kn_rows = (ckv, _cache_rows(ckv))
        v_rows = None
        num_pages = kpe.shape[0]
    else:
        layout = parse_layout(kv_layout)
        if not isinstance(v, torch.Tensor):
            raise ValueError("v: GQA/MHA (3-D k_rope) needs a V tensor [nnz, num_kv_heads, head_dim]; only MLA "
                             "passes None")
        head_dim = rope_dim + no_rope_dim
        if tuple(v.shape) != (nnz, num_kv_heads, head_dim):
            raise ValueError(
                f"v: expected shape [{nnz}, {num_kv_heads}, {head_dim}] (head_dim = rope_dim + no_rope_dim), "
                f"got {tuple(v.shape)}"
            )
        if v.dtype != q_rope.dtype:
            raise ValueError(f"v: expected dtype {q_rope.dtype} like q_rope, got {v.dtype}")
        if not same_device(v.device, q_rope.device):
            raise ValueError(f"v: expected a tensor on {q_rope.device} like q_rope, got one on {v.device}")
        _last_dim_contiguous(v, "v")
        if cache0.dim() != 4 or cache1.dim() != 4:
            raise ValueError(
                f"paged_kv_cache: GQA/MHA expects (k_cache, v_cache) 4-D [max_pages, page_size, num_kv_heads, "
                f"head_dim] (NHD) or [max_pages, num_kv_heads, page_size, head_dim] (HND), got shapes "
                f"{tuple(cache0.shape)} and {tuple(cache1.shape)}"
            )
        # [P, page_size, H, D] views of either layout
        if layout == TensorLayout.NHD:
            k_cache, v_cache = cache0, cache1
        else:
            k_cache, v_cache = cache0.transpose(1, 2), cache1.transpose(1, 2)
        want = (k_cache.shape[0], page_size, num_kv_heads, head_dim)
        for t, given, n in ((k_cache, cache0, "paged_kv_cache[0]"), (v_cache, cache1, "paged_kv_cache[1]")):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{n}: expected {layout.name} pages of {page_size} tokens x {num_kv_heads} heads x {head_dim} "
                    f"(page_size, num_kv_heads, rope_dim + no_rope_dim), got shape {tuple(given.shape)}"
                )
        k_rows = (k_cache, _cache_rows(k_cache))
        kn_rows = (k_cache[..., rope_dim:], _cache_rows(k_cache))
        v_rows = (v_cache, _cache_rows(v_cache))
        num_pages = k_cache.shape[0]
    _check_index_tensor(batch_indices, "batch_indices", nnz, q_rope.device)
    _check_index_tensor(positions, "positions", nnz, q_rope.device)
    _check_index_tensor(kv_indices, "kv_indices", None, q_rope.device)
    _check_index_tensor(kv_indptr, "kv_indptr", None, q_rope.device)
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr: expected batch_size + 1 >= 1 elements, got 0")
    _device.check_launchable(q_rope.device, "q_rope")
    _rq_launch(q_rope, q_nope, k_rope, k_nope, v if not is_mla else None, q_rope_out, q_nope_out, k_rows, kn_rows,
               v_rows, cos_sin_cache, pos_ids, quant_scale_q, quant_scale_kv, interleave=not is_neox,
               append=(batch_indices, positions, kv_indices, kv_indptr, num_pages, page_size))
    if q_rope.device.type == "cpu":
        # the interpreter has finished: a bad index is raised now, as append_paged_kv_cache does on the host
        _errors.raise_pending(q_rope.device)


@_ops.custom_op("rope_quantize_fp8_append_paged_kv_cache",
                mutates_args=("cache0", "cache1", "q_rope_out", "q_nope_out"))
def _append_op(q_rope: torch.Tensor, k_rope: torch.Tensor, q_nope: torch.Tensor, k_nope: torch.Tensor,
               v: Optional[torch.Tensor], cos_sin_cache: torch.Tensor, pos_ids: torch.Tensor, cache0: torch.Tensor,
               cache1: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, batch_indices: torch.Tensor,
               positions: torch.Tensor, q_rope_out: torch.Tensor, q_nope_out: torch.Tensor, is_neox: bool,
               quant_scale_q: float, quant_scale_kv: float, page_size: int, kv_layout: str) -> None:
    _append_into(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, cache0, cache1, kv_indices, kv_indptr,
                 batch_indices, positions, q_rope_out, q_nope_out, is_neox, quant_scale_q, quant_scale_kv,
                 page_size, kv_layout)


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: Optional[torch.Tensor],
    k_nope: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    paged_kv_cache: Tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""RoPE + fp8 quantisation of q and k (as :func:`rope_quantize_fp8`) and of v, with K and V
    written straight into a paged fp8 cache; one kernel. Returns the quantised q.

    Token ``t`` goes to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot
    ``pos % page_size``, with ``b = batch_indices[t]``, ``pos = positions[t]`` (as
    :func:`tritoninfer.page.append_paged_kv_cache`; the page table must already hold the
    appended tokens). GQA/MHA (3-D ``k_rope``): ``k_cache[page, slot, h] = fp8([rope(k_rope) |
    k_nope] * quant_scale_kv)`` and ``v_cache[page, slot, h] = fp8(v * quant_scale_kv)``. MLA (2-D
    ``k_rope``): ``kpe_cache[page, slot] = fp8(rope(k_rope) * quant_scale_kv)`` and
    ``ckv_cache[page, slot] = fp8(k_nope * quant_scale_kv)``.

    Parameters
    ----------
    q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quant_scale_q, quant_scale_kv
        As for :func:`rope_quantize_fp8` (``pos_ids`` are the RoPE positions).
    v : Optional[torch.Tensor]
        GQA/MHA: ``[nnz, num_kv_heads, rope_dim + no_rope_dim]``, the dtype of ``q_rope``. MLA: ``None``.
    paged_kv_cache : Tuple[torch.Tensor, torch.Tensor]
        GQA/MHA: ``(k_cache, v_cache)``, each ``[max_pages, page_size, num_kv_heads, head_dim]``
        (NHD) or ``[max_pages, num_kv_heads, page_size, head_dim]`` (HND). MLA: ``(ckv_cache
        [max_pages, page_size, no_rope_dim], kpe_cache [max_pages, page_size, rope_dim])``. fp8, in
        the quantize dtype; written in place (strided views with a contiguous last dim are fine).
    kv_indices : torch.Tensor
        int32/int64 ``[kv_indptr[-1]]``: the page ids of all requests.
    kv_indptr : torch.Tensor
        int32/int64 ``[batch_size + 1]``: request ``b`` owns ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    batch_indices, positions : torch.Tensor
        int32/int64 ``[nnz]``: request and position in its KV sequence of each token (see
        :func:`tritoninfer.page.get_batch_indices_positions`); batch index ``-1`` marks padding.
    quantize_dtype : Optional[torch.dtype]
        ``None``: the dtype of ``q_rope_out``, else of ``q_nope_out``, else ``float8_e4m3fn``. The
        caches must have this dtype.
    page_size : int
        Tokens per page (default 16); must match the cache.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``, for the GQA/MHA caches (ignored for MLA).
    q_rope_out, q_nope_out : Optional[torch.Tensor]
        Output buffers for the quantised q (allocated with ``torch.empty_like`` when ``None``).
    enable_pdl : bool
        Accepted for FlashInfer compatibility; has no effect in Triton.

    Returns
    -------
    (q_rope_out, q_nope_out) : Tuple[torch.Tensor, torch.Tensor]

    Note
    ----
    Page ids and positions are bounded in the kernel: a token whose request index, position (past
    the pages its request owns) or page id is outside the page table or the cache is not written
    and is recorded (``tritoninfer.check_errors()`` raises it; on CPU tensors it is raised when the
    call returns, after the other tokens were written). FlashInfer 0.5.3 reads and writes wherever
    such an index points. The call never synchronises with the GPU. Broader than FlashInfer: the
    inputs of :func:`rope_quantize_fp8`, int64 index tensors, and a ``page_size`` that disagrees
    with the cache raises instead of addressing it wrongly.
    """
    q_nope, k_nope = _fill_nope(q_rope, k_rope, q_nope, k_nope)
    fp8 = _quantize_dtype(quantize_dtype, (q_rope_out, q_nope_out))
    q_rope_out = torch.empty_like(q_rope, dtype=fp8) if q_rope_out is None else q_rope_out
    q_nope_out = torch.empty_like(q_nope, dtype=fp8) if q_nope_out is None else q_nope_out
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise TypeError("paged_kv_cache: expected a tuple of 2 tensors ((k_cache, v_cache) or (ckv_cache, kpe_cache))")
    cache0, cache1 = paged_kv_cache
    layout = parse_layout(kv_layout).name
    args = (q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, cache0, cache1, kv_indices, kv_indptr,
            batch_indices, positions, q_rope_out, q_nope_out, bool(is_neox), float(quant_scale_q),
            float(quant_scale_kv), page_size, layout)
    if _ops.compiling():
        _append_op(*args)
    else:
        for out, name in ((q_rope_out, "q_rope_out"), (q_nope_out, "q_nope_out")):
            if isinstance(out, torch.Tensor) and out.dtype != fp8:
                raise ValueError(f"{name}: expected dtype {fp8} (quantize_dtype), got {out.dtype}")
        _append_into(*args)
    return q_rope_out, q_nope_out
