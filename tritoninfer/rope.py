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
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import _device, _ops
from ._launch import CachedLauncher
from ._plan import cdiv, next_pow2
from .kernels.rope import rope_kernel

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_ROPE = CachedLauncher(rope_kernel)

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
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
    if t.dtype not in _INDEX_DTYPES:
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
