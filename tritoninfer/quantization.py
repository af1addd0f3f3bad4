"""tritoninfer.quantization: bit packing of boolean masks (FlashInfer 0.5.3's ``flashinfer.quantization``)
and a per-tensor fp8 quantiser for KV caches (a tritoninfer extra).

``packbits``/``segment_packbits`` are vectorised torch (no Python loop, no kernel): they are used
to build packed custom attention masks, which FlashInfer reads with ``bitorder="little"``.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

from . import _ops
from ._options import FP8_DTYPES, canonicalize_dtype, check_int_index_tensor, check_tensor

__all__ = ["packbits", "segment_packbits", "quantize_fp8"]

_BIT_WEIGHTS = {
    "big": (128, 64, 32, 16, 8, 4, 2, 1),
    "little": (1, 2, 4, 8, 16, 32, 64, 128),
}


def _weights(bitorder: str, device) -> torch.Tensor:
    if bitorder not in _BIT_WEIGHTS:
        raise ValueError(f"bitorder: expected 'big' or 'little', got {bitorder!r}")
    return torch.tensor(_BIT_WEIGHTS[bitorder], dtype=torch.int32, device=device)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    r"""Pack the elements of a binary-valued tensor into bits of a uint8 tensor (``numpy.packbits``).

    Parameters
    ----------
    x : torch.Tensor
        The binary-valued input (``bool``, or any dtype where nonzero means 1), shape: ``[n]``
        (other shapes are flattened, as ``numpy.packbits`` does without ``axis``).
    bitorder : str
        ``"big"`` (default; the first element goes to the most significant bit) or ``"little"``.
        FlashInfer's packed custom attention masks use ``"little"``.

    Returns
    -------
    torch.Tensor
        shape: ``[ceil(n / 8)]``, dtype: ``torch.uint8``, on ``x``'s device; the last byte is
        zero-padded.
    """
    check_tensor(x, "x")
    weights = _weights(bitorder, x.device)
    bits = (x.reshape(-1) != 0).to(torch.int32)
    n = bits.numel()
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def segment_packbits(
    x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Pack each segment ``x[indptr[i]:indptr[i+1]]`` into bits separately, each padded to whole bytes.

    Parameters
    ----------
    x : torch.Tensor
        The binary-valued input, shape: ``[indptr[-1]]`` (other shapes are flattened).
    indptr : torch.Tensor
        The segment boundaries, shape: ``[num_segments + 1]``, dtype: ``torch.int32`` (or ``int64``).
    bitorder : str
        ``"big"`` (default) or ``"little"`` (what packed attention masks use).

    Returns
    -------
    y : torch.Tensor
        The packed segments, concatenated, dtype: ``torch.uint8``, shape: ``[new_indptr[-1]]``.
    new_indptr : torch.Tensor
        ``new_indptr[i+1] - new_indptr[i] = ceil((indptr[i+1] - indptr[i]) / 8)``, shape:
        ``[num_segments + 1]``, ``indptr``'s dtype and device.

    Note
    ----
    The output size depends on ``indptr``'s values, so this reads ``new_indptr[-1]`` back to the host
    (one sync on a GPU), as FlashInfer does.
    """
    if _ops.compiling():
        new_indptr = torch.empty_like(indptr)
        return _segment_packbits_op(x, indptr, new_indptr, bitorder), new_indptr
    return _segment_packbits(x, indptr, bitorder)


def _segment_packbits_fake(x: torch.Tensor, indptr: torch.Tensor, new_indptr: torch.Tensor,
                           bitorder: str) -> torch.Tensor:
    # the packed size is new_indptr[-1], known only once the op has run
    return x.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.uint8)


@_ops.custom_op("segment_packbits", mutates_args=("new_indptr",), fake=_segment_packbits_fake)
def _segment_packbits_op(x: torch.Tensor, indptr: torch.Tensor, new_indptr: torch.Tensor,
                         bitorder: str) -> torch.Tensor:
    packed, offsets = _segment_packbits(x, indptr, bitorder)
    new_indptr.copy_(offsets)
    return packed


def _segment_packbits(x, indptr, bitorder):
    check_tensor(x, "x")
    check_int_index_tensor(indptr, "indptr")
    if indptr.numel() < 1:
        raise ValueError("indptr: expected num_segments + 1 >= 1 elements, got 0")
    if indptr.device != x.device:
        raise ValueError(f"indptr: expected a tensor on {x.device}, got one on {indptr.device}")
    weights = _weights(bitorder, x.device)
    bits = (x.reshape(-1) != 0).to(torch.int32)
    start = indptr[:-1].long()
    seg_len = indptr[1:].long() - start
    if bool((seg_len < 0).any()):
        raise ValueError("indptr: expected a non-decreasing array")
    packed_len = (seg_len + 7) // 8
    new_indptr = torch.zeros_like(indptr)
    new_indptr[1:] = torch.cumsum(packed_len, dim=0).to(indptr.dtype)
    total = int(new_indptr[-1])
    if total == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device), new_indptr
    if indptr.numel() > 1 and int(indptr[-1]) > bits.numel():
        raise ValueError(f"indptr: indptr[-1] = {int(indptr[-1])} exceeds x's {bits.numel()} elements")
    out_pos = torch.arange(total, device=x.device)
    # The segment of each output byte: the number of segment ends (in bytes) at or before it.
    seg = torch.searchsorted(new_indptr[1:].long(), out_pos, right=True)
    byte_in_seg = out_pos - new_indptr[:-1].long()[seg]
    bit_in_seg = byte_in_seg[:, None] * 8 + torch.arange(8, device=x.device)  # [total, 8]
    valid = bit_in_seg < seg_len[seg][:, None]
    src = torch.where(valid, start[seg][:, None] + bit_in_seg, torch.zeros_like(bit_in_seg))
    gathered = torch.where(valid, bits[src], torch.zeros_like(src, dtype=torch.int32))
    return (gathered * weights).sum(dim=1).to(torch.uint8), new_indptr


def quantize_fp8(
    x: torch.Tensor, dtype: Union[str, torch.dtype] = torch.float8_e4m3fn
) -> Tuple[torch.Tensor, float]:
    r"""Per-tensor fp8 quantisation: ``(x / scale).to(dtype), scale`` with ``scale = amax(|x|) / finfo(dtype).max``.

    A tritoninfer extra (FlashInfer has no such helper). The returned ``scale`` is what FlashInfer's
    attention takes as ``k_scale`` / ``v_scale``: write ``x_fp8`` into an fp8 KV cache (e.g. with
    :func:`tritoninfer.page.append_paged_kv_cache`) and pass ``k_scale=scale`` (for keys) or
    ``v_scale=scale`` (for values) to ``run()``, which multiplies them back in.

    Parameters
    ----------
    x : torch.Tensor
        Any floating tensor (e.g. keys ``[nnz, num_kv_heads, head_dim]``).
    dtype : Union[str, torch.dtype]
        ``torch.float8_e4m3fn`` (default) or ``torch.float8_e5m2`` (or their names).

    Returns
    -------
    x_fp8 : torch.Tensor
        ``x``'s shape, dtype ``dtype``; values clamped to the format's finite range.
    scale : float
        ``amax / finfo(dtype).max``, or ``1.0`` when ``x`` is all zeros or empty.

    Note
    ----
    Reads ``amax`` back to the host (one sync on a GPU); meant for calibration and tests, not for a
    serving loop's hot path.
    """
    check_tensor(x, "x")
    dtype = canonicalize_dtype(dtype, "dtype")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype: expected one of {list(FP8_DTYPES)}, got {dtype}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    fmax = torch.finfo(dtype).max
    xf = x.float()
    amax = float(xf.abs().max()) if xf.numel() else 0.0
    if amax != amax or amax == float("inf"):
        raise ValueError("x: contains non-finite values (NaN or inf)")
    scale = amax / fmax if amax > 0 else 1.0
    scale = max(scale, torch.finfo(torch.float32).tiny)  # stays a normal fp32 number
    return (xf / scale).clamp(-fmax, fmax).to(dtype), scale
