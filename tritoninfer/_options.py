"""Enums, dtype canonicalisation and the argument checks shared by every public entry point.

Each check raises ``ValueError`` or ``TypeError`` naming the argument and what was expected. None of
them reads device memory: a check that would need a device-to-host copy is done only where the
data is already on the host (``plan()`` receives host copies of the page table).
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

DTypeLike = Union[str, torch.dtype, None]


class PosEncodingMode(enum.Enum):
    """Positional encoding applied inside the attention kernels (FlashInfer's values)."""

    NONE = 0
    ROPE_LLAMA = 1
    ALIBI = 2


class MaskMode(enum.Enum):
    """Mask applied inside the attention kernels (FlashInfer's values)."""

    NON_CAUSAL = 0
    CAUSAL = 1
    CUSTOM = 2
    MULTIITEMSCORING = 3


class TensorLayout(enum.Enum):
    """KV layout: ``NHD`` is ``[..., tokens, heads, dim]``, ``HND`` is ``[..., heads, tokens, dim]``."""

    NHD = 0
    HND = 1


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
Q_DTYPES = (torch.float16, torch.bfloat16)
KV_DTYPES = (torch.float16, torch.bfloat16) + FP8_DTYPES

_DTYPE_NAMES = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
}


def canonicalize_dtype(dtype: DTypeLike, name: str = "dtype") -> Optional[torch.dtype]:
    """``torch.dtype`` or its string name (``"float16"``, ``"torch.bfloat16"``, ``"e4m3"``) -> ``torch.dtype``.

    ``None`` passes through.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype[len("torch."):] if dtype.startswith("torch.") else dtype
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(f"{name}: unknown dtype name {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}")
    raise TypeError(f"{name}: expected a torch.dtype or its name as a str, got {type(dtype).__name__}")


def check_dtype_in(dtype: torch.dtype, allowed: Sequence[torch.dtype], name: str) -> torch.dtype:
    if dtype not in allowed:
        raise ValueError(f"{name}: dtype {dtype} is not supported; expected one of {list(allowed)}")
    return dtype


def _parse_enum(enum_cls, value, name: str):
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value in enum_cls.__members__:
        return enum_cls[value]
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return enum_cls(value)
        except ValueError:
            pass
    raise ValueError(f"{name}: expected one of {list(enum_cls.__members__)}, got {value!r}")


def parse_pos_encoding_mode(value: Union[str, int, PosEncodingMode], name: str = "pos_encoding_mode") -> PosEncodingMode:
    return _parse_enum(PosEncodingMode, value, name)


def parse_layout(value: Union[str, int, TensorLayout], name: str = "kv_layout") -> TensorLayout:
    return _parse_enum(TensorLayout, value, name)


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    """Validate head counts and return the GQA group size ``num_qo_heads // num_kv_heads``."""
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_qo_heads // num_kv_heads


MAX_HEAD_DIM = 256


def check_head_dim(head_dim: int, name: str = "head_dim") -> int:
    """Any multiple of 8 from 8 to 256."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ValueError(f"{name}: expected a positive int, got {head_dim!r}")
    if head_dim % 8 != 0 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{name}: expected a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}")
    return head_dim


def check_positive_int(value: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def check_window_left(window_left: int) -> int:
    if not isinstance(window_left, int) or isinstance(window_left, bool) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a non-negative int, got {window_left!r}")
    return window_left


def _as_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def check_soft_cap(logits_soft_cap: Optional[float]) -> float:
    """``None`` or ``0`` means no soft cap; returns 0.0 for off."""
    if logits_soft_cap is None:
        return 0.0
    cap = _as_float(logits_soft_cap, "logits_soft_cap")
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"logits_soft_cap: expected None or a non-negative finite float, got {logits_soft_cap!r}")
    return cap


def resolve_sm_scale(sm_scale: Optional[float], head_dim_qk: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(check_positive_int(head_dim_qk, "head_dim"))
    sm_scale = _as_float(sm_scale, "sm_scale")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite float, got {sm_scale!r}")
    return sm_scale


def resolve_rope(rope_scale: Optional[float], rope_theta: Optional[float]) -> Tuple[float, float]:
    scale = 1.0 if rope_scale is None else _as_float(rope_scale, "rope_scale")
    theta = 1e4 if rope_theta is None else _as_float(rope_theta, "rope_theta")
    if not (0 < scale < math.inf and 0 < theta < math.inf):
        raise ValueError(f"rope_scale and rope_theta must be positive, got {rope_scale!r}, {rope_theta!r}")
    return scale, theta


def check_tensor(t, name: str, *, ndim: Optional[int] = None, dtype=None, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, (tuple, list)) else (dtype,)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: expected dtype {' or '.join(map(str, allowed))}, got {t.dtype}")
    if device is not None and not same_device(t.device, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_graph_buffers(device, buffers, mode: str = "cudagraph mode") -> None:
    """CUDA-graph mode's fixed index buffers, ``(name, tensor)`` pairs: each a 1-D int32 tensor on
    ``device`` (FlashInfer's message for a missing one)."""
    for name, buf in buffers:
        if not torch.is_tensor(buf):
            raise ValueError(f"{name} should be a torch.Tensor in {mode}")
        check_tensor(buf, name, ndim=1, dtype=torch.int32, device=device)


def plan_dtypes(q_data_type, kv_data_type, data_type, q_default=None) -> Tuple[torch.dtype, torch.dtype]:
    """A plan's query and K/V dtypes from FlashInfer's arguments: the deprecated ``data_type`` fills
    whichever is None, else a None ``q_data_type`` is ``q_default``; K/V defaults to the query's."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    elif q_data_type is None:
        q_data_type = q_default
    q_dtype = check_dtype_in(canonicalize_dtype(q_data_type, "q_data_type"), Q_DTYPES, "q_data_type")
    kv_dtype = q_dtype if kv_data_type is None else canonicalize_dtype(kv_data_type, "kv_data_type")
    return q_dtype, check_dtype_in(kv_dtype, KV_DTYPES, "kv_data_type")


def check_query(q, dtype: torch.dtype, shape: tuple, shape_doc: str, name: str = "q") -> None:
    """A query tensor of the planned dtype and shape whose last dimension is contiguous (one
    comparison per fact on the path every ``run()`` takes; the messages name what differs)."""
    if type(q) is torch.Tensor and q.dtype == dtype and q.shape == shape and q.stride(-1) == 1:
        return
    check_tensor(q, name, ndim=len(shape))
    check_same_dtype_as_plan(q, dtype, name, f"{name}_data_type")
    if tuple(q.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} {shape_doc}, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


INDEX_DTYPES = (torch.int32, torch.int64)  # page tables, indptrs, positions, indices


def check_int_index_tensor(t, name: str, *, length: Optional[int] = None) -> torch.Tensor:
    """1-D int32/int64 index tensor (page tables, indptrs)."""
    if type(t) is not torch.Tensor or t.dim() != 1 or (t.dtype is not torch.int32 and t.dtype is not torch.int64):
        check_tensor(t, name, ndim=1, dtype=INDEX_DTYPES)  # (plan() runs every step: its message, when it fails)
    if length is not None and t.numel() != length:
        raise ValueError(f"{name}: expected {length} elements, got {t.numel()}")
    return t


def check_indptr_host(indptr_host: torch.Tensor, name: str, zero_start: bool = True) -> None:
    """Checks that need the values: only called on host copies. A page-table indptr may start
    past 0 (``zero_start=False``): vLLM plans a slice of a larger page table."""
    if indptr_host.numel() < 1:
        raise ValueError(f"{name}: expected at least one element (batch_size + 1)")
    values = indptr_host.numpy()
    if zero_start and values[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {int(values[0])}")
    if values[0] < 0 or (values.size > 1 and (values[1:] < values[:-1]).any()):
        raise ValueError(f"{name}: expected a non-decreasing array")


def check_same_dtype_as_plan(t: torch.Tensor, planned: torch.dtype, name: str, plan_name: str) -> None:
    if t.dtype != planned:
        raise ValueError(
            f"The dtype of {name} {t.dtype} does not match the {plan_name} {planned} specified in plan function."
        )


def check_out(out: Optional[torch.Tensor], shape, dtype, device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    # the common case in one comparison chain (every run() passes here)
    if type(out) is torch.Tensor and out.shape == shape and out.dtype == dtype and out.device == device \
            and out.stride(-1) == 1:
        return out
    check_tensor(out, name)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(
            f"{name}: expected shape {tuple(shape)}, dtype {dtype} on {device}; "
            f"got shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    return out


def check_sinks(sinks: Optional[torch.Tensor], num_qo_heads: int, device) -> Optional[torch.Tensor]:
    if sinks is None:
        return None
    check_tensor(sinks, "sinks", ndim=1, dtype=torch.float32)
    if sinks.numel() != num_qo_heads or sinks.device != device:
        raise ValueError(f"sinks: expected a float32 [{num_qo_heads}] tensor on {device}, got {tuple(sinks.shape)} on {sinks.device}")
    return sinks if sinks.is_contiguous() else sinks.contiguous()


def host_index(t: torch.Tensor, name: str) -> torch.Tensor:
    """Host copy of a small index tensor (a device tensor costs one device-to-host copy)."""
    check_int_index_tensor(t, name)
    return t if t.is_cpu else t.to("cpu")


def copy_into(buf: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    if src.data_ptr() != buf.data_ptr() or src.device != buf.device:
        buf.copy_(src, non_blocking=non_blocking)


def cached_by_value(parse: Callable) -> Callable:
    """``parse`` (positional arguments only) remembered by its arguments' values and types: plan() runs
    every step, and the types keep e.g. ``window_left=True`` refused where ``parse`` refuses it.
    Arguments that cannot be hashed (a tensor scale) are parsed at every call. Errors are not
    remembered: a bad argument raises each time."""
    cached = functools.lru_cache(maxsize=256)(lambda args, _types: parse(*args))

    @functools.wraps(parse)
    def call(*args):
        try:
            return cached(args, tuple(map(type, args)))
        except TypeError as e:
            if "unhashable" not in str(e):
                raise
            return parse(*args)

    call.cache_clear = cached.cache_clear
    return call
