"""tritoninfer.page: paged KV-cache management (FlashInfer 0.5.3's ``flashinfer.page``).

- :func:`append_paged_kv_cache` scatters appended K/V tokens into a paged cache (a Triton kernel).
- :func:`get_batch_indices_positions` turns a ragged append (``append_indptr``) into per-token
  request indices and positions (a Triton kernel).
- :func:`get_seq_lens` computes KV lengths from the page table (one torch expression).

Paged cache forms (FlashInfer's): a 5-D tensor ``[num_pages, 2, page_size, H_kv, D]`` (NHD) or
``[num_pages, 2, H_kv, page_size, D]`` (HND); a ``(k_cache, v_cache)`` tuple of 4-D tensors
``[num_pages, page_size, H_kv, D]`` (NHD) or ``[num_pages, H_kv, page_size, D]`` (HND); for page
size 1, a 4-D tensor ``[num_tokens, 2, H_kv, D]`` or a tuple of 3-D ``[num_tokens, H_kv, D]``
tensors. Strided views work as long as the last (head_dim) dimension is contiguous.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from . import _device, _ops
from ._errors import fault_record
from ._launch import CachedLauncher
from ._options import KV_DTYPES, FP8_DTYPES, TensorLayout, check_int_index_tensor, check_tensor, parse_layout
from ._plan import cdiv, next_pow2
from .kernels.page import append_paged_kv_cache_kernel, batch_indices_positions_kernel

# the launches on every call's path skip Triton's per-call binding (_launch.py)
_APPEND_PAGED_KV_CACHE = CachedLauncher(append_paged_kv_cache_kernel)
_BATCH_INDICES_POSITIONS = CachedLauncher(batch_indices_positions_kernel)

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]

# Dtypes accepted for the appended K/V when the cache is fp8 (converted in the kernel).
_FP8_SOURCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Cache dtypes: FlashInfer's KV dtypes, plus float32 (a tritoninfer extra, handy for references).
_CACHE_DTYPES = KV_DTYPES + (torch.float32,)


def _unpack_paged_kv_cache(
    paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], layout: TensorLayout
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Any cache form -> (k, v) 4-D views in NHD order ``[num_pages, page_size, H_kv, D]`` (no copy)."""
    name = "paged_kv_cache"
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() == 4:  # page size 1: [num_tokens, 2, H, D]
            paged_kv_cache = paged_kv_cache.unsqueeze(2 if layout == TensorLayout.NHD else 3)
        if paged_kv_cache.dim() != 5:
            raise ValueError(
                f"{name}: expected a 5-D tensor [num_pages, 2, page_size, H_kv, D] (NHD) or "
                f"[num_pages, 2, H_kv, page_size, D] (HND), or a 4-D tensor [num_tokens, 2, H_kv, D] "
                f"for page size 1; got shape {tuple(paged_kv_cache.shape)}"
            )
        if paged_kv_cache.shape[1] != 2:
            raise ValueError(f"{name}: dimension 1 must be 2 (K and V), got shape {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k, v = paged_kv_cache
        for t, n in ((k, f"{name}[0]"), (v, f"{name}[1]")):
            check_tensor(t, n)
        if k.dim() != v.dim() or k.dim() not in (3, 4):
            raise ValueError(
                f"{name}: expected (k_cache, v_cache) 4-D tensors [num_pages, page_size, H_kv, D] (NHD) or "
                f"[num_pages, H_kv, page_size, D] (HND), or 3-D [num_tokens, H_kv, D] for page size 1; "
                f"got shapes {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dim() == 3:
            k, v = k.unsqueeze(1), v.unsqueeze(1)  # [N, 1, H, D]: NHD order directly
            return k, v
    else:
        raise TypeError(
            f"{name}: expected a torch.Tensor or a (k_cache, v_cache) tuple, got {type(paged_kv_cache).__name__}"
        )
    if layout == TensorLayout.HND:  # [P, H, page, D] -> [P, page, H, D] view
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _check_append_inputs(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                         kv_indices, kv_indptr, kv_last_page_len):
    check_tensor(append_key, "append_key", ndim=3)
    check_tensor(append_value, "append_value", ndim=3)
    nnz, num_heads, head_dim = append_key.shape
    if append_value.shape[0] != nnz or append_value.shape[1] != num_heads:
        raise ValueError(
            f"append_value: expected shape [{nnz}, {num_heads}, D_v] to match append_key {tuple(append_key.shape)}, "
            f"got {tuple(append_value.shape)}"
        )
    if append_value.dtype != append_key.dtype:
        raise ValueError(f"append_value: dtype {append_value.dtype} differs from append_key's {append_key.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"paged_kv_cache: K and V caches have different dtypes ({k_cache.dtype}, {v_cache.dtype})")
    cache_dtype = k_cache.dtype
    if cache_dtype not in _CACHE_DTYPES:
        raise ValueError(f"paged_kv_cache: dtype {cache_dtype} is not supported; expected one of {list(_CACHE_DTYPES)}")
    src_ok = append_key.dtype == cache_dtype or (cache_dtype in FP8_DTYPES and append_key.dtype in _FP8_SOURCE_DTYPES)
    if not src_ok:
        raise ValueError(
            f"append_key: dtype {append_key.dtype} does not match the paged_kv_cache dtype {cache_dtype} "
            "(an fp8 cache also accepts float16/bfloat16/float32 K/V, converted on store)"
        )
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[1] != v_cache.shape[1]:
        raise ValueError(
            f"paged_kv_cache: K and V caches disagree on num_pages/page_size: "
            f"{tuple(k_cache.shape)} vs {tuple(v_cache.shape)} (NHD order)"
        )
    if k_cache.shape[2] != num_heads or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"paged_kv_cache: K cache has {k_cache.shape[2]} heads of dim {k_cache.shape[3]}, but append_key has "
            f"{num_heads} heads of dim {head_dim}"
        )
    if v_cache.shape[2] != num_heads or v_cache.shape[3] != append_value.shape[2]:
        raise ValueError(
            f"paged_kv_cache: V cache has {v_cache.shape[2]} heads of dim {v_cache.shape[3]}, but append_value has "
            f"{num_heads} heads of dim {append_value.shape[2]}"
        )
    for t, n in ((k_cache, "paged_kv_cache (K)"), (v_cache, "paged_kv_cache (V)")):
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(
                f"{n}: the last (head_dim) dimension must be contiguous (stride 1), got strides {t.stride()}"
            )
    check_int_index_tensor(batch_indices, "batch_indices", length=nnz)
    check_int_index_tensor(positions, "positions", length=nnz)
    check_int_index_tensor(kv_indices, "kv_indices")
    check_int_index_tensor(kv_indptr, "kv_indptr")
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr: expected batch_size + 1 >= 1 elements, got 0")
    check_int_index_tensor(kv_last_page_len, "kv_last_page_len", length=kv_indptr.numel() - 1)
    device = k_cache.device
    for t, n in ((append_key, "append_key"), (append_value, "append_value"), (v_cache, "paged_kv_cache (V)"),
                 (batch_indices, "batch_indices"), (positions, "positions"), (kv_indices, "kv_indices"),
                 (kv_indptr, "kv_indptr"), (kv_last_page_len, "kv_last_page_len")):
        if t.device != device:
            raise ValueError(f"{n}: expected a tensor on {device} (the cache's device), got one on {t.device}")


def _check_positions_host(batch_indices, positions, kv_indices, kv_indptr, num_pages, page_size):
    """Value checks, only for tensors already on the host (never forces a device sync)."""
    batch_size = kv_indptr.numel() - 1
    b = batch_indices.long()
    pos = positions.long()
    if bool(((b < 0) | (b >= batch_size)).any()):
        bad = int(b[(b < 0) | (b >= batch_size)][0])
        raise ValueError(
            f"batch_indices: request index {bad} is outside [0, {batch_size}) (batch_size from kv_indptr; "
            "-1 marks padding)"
        )
    if bool((pos < 0).any()):
        raise ValueError(f"positions: negative position {int(pos[pos < 0][0])}")
    indptr = kv_indptr.long()
    num_req_pages = (indptr[1:] - indptr[:-1])[b]
    over = pos >= num_req_pages * page_size
    if bool(over.any()):
        t = int(over.nonzero()[0, 0])
        raise ValueError(
            f"positions: token {t} of request {int(b[t])} has position {int(pos[t])}, beyond the "
            f"{int(num_req_pages[t])} page(s) x page_size {page_size} it owns in kv_indices/kv_indptr "
            "(the page table must already include the appended tokens)"
        )
    idx = indptr[b] + pos // page_size
    if pos.numel() and int(idx.max()) >= kv_indices.numel():
        raise ValueError(f"kv_indptr: points past the end of kv_indices ({kv_indices.numel()} entries)")
    pages = kv_indices.long()[idx]
    if bool(((pages < 0) | (pages >= num_pages)).any()):
        bad = int(pages[(pages < 0) | (pages >= num_pages)][0])
        raise ValueError(f"kv_indices: page id {bad} is outside the cache's [0, {num_pages}) pages")


def _append_block_sizes(head_dim: int, head_dim_v: int) -> Tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_D, BLOCK_DV, num_warps): about 4K elements of K per program, keyed on head_dim only."""
    block_d = next_pow2(head_dim)
    block_dv = next_pow2(head_dim_v)
    block_t = max(1, min(64, 4096 // max(block_d, block_dv)))
    return block_t, block_d, block_dv, 4


@_ops.custom_op("append_paged_kv_cache", mutates_args=("cache", "v_cache"))
def _append_op(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor,
               positions: torch.Tensor, cache: torch.Tensor, v_cache: Optional[torch.Tensor], kv_indices: torch.Tensor,
               kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str) -> None:
    """``append_paged_kv_cache`` for torch.compile (``_ops.py``): ``cache`` is the single-tensor cache, or
    the K cache of a ``(k_cache, v_cache)`` pair."""
    _append_eager(append_key, append_value, batch_indices, positions,
                  cache if v_cache is None else (cache, v_cache), kv_indices, kv_indptr, kv_last_page_len, kv_layout)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    r"""Append a batch of key-value pairs to a paged key-value cache, in place.

    Token ``t`` is written to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot
    ``pos % page_size``, with ``b = batch_indices[t]`` and ``pos = positions[t]``. The page table
    (``kv_indices``, ``kv_indptr``, ``kv_last_page_len``) must already include the appended tokens.

    Parameters
    ----------
    append_key : torch.Tensor
        The keys to append, shape: ``[append_indptr[-1], num_kv_heads, head_dim]``.
    append_value : torch.Tensor
        The values to append, shape: ``[append_indptr[-1], num_kv_heads, head_dim_v]``.
    batch_indices : torch.Tensor
        The request index of each appended token, shape: ``[append_indptr[-1]]``, dtype: ``torch.int32``
        (``int64`` is accepted too).
    positions : torch.Tensor
        The position of each appended token within its request's KV sequence, shape:
        ``[append_indptr[-1]]``, dtype: ``torch.int32`` (or ``int64``). See
        :func:`get_batch_indices_positions`.
    paged_kv_cache : Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
        The paged KV cache, written in place: a 5-D tensor ``[max_num_pages, 2, page_size, num_kv_heads,
        head_dim]`` (NHD) or ``[max_num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND); or a tuple
        ``(k_cache, v_cache)`` of 4-D tensors ``[max_num_pages, page_size, num_kv_heads, head_dim]`` (NHD)
        or ``[max_num_pages, num_kv_heads, page_size, head_dim]`` (HND); for page size 1 also a 4-D
        tensor ``[num_tokens, 2, num_kv_heads, head_dim]`` or a tuple of 3-D ``[num_tokens, num_kv_heads,
        head_dim]`` tensors. Strided views are fine; the last dimension must be contiguous. dtype:
        ``float16``, ``bfloat16``, ``float8_e4m3fn`` or ``float8_e5m2`` (``float32`` too).
    kv_indices : torch.Tensor
        The page ids of all requests, shape: ``[kv_indptr[-1]]``, dtype: ``torch.int32``.
    kv_indptr : torch.Tensor
        The indptr of the page table, shape: ``[batch_size + 1]``, dtype: ``torch.int32``.
    kv_last_page_len : torch.Tensor
        The number of entries in each request's last page, shape: ``[batch_size]``, dtype:
        ``torch.int32``. Only its shape is checked: the kernel does not need it.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``: the layout of the cache's pages.

    Notes
    -----
    - The appended K/V must have the cache's dtype, except for an fp8 cache, which also accepts
      ``float16``/``bfloat16``/``float32`` K/V: they are converted (round to nearest even) in the kernel.
      Scaling is the caller's business: pass ``k / k_scale`` and use ``k_scale`` in attention (see
      :func:`tritoninfer.quantization.quantize_fp8`).
    - The call never synchronises with the device. Value checks that need the data (request index in
      range, ``positions`` within the pages the request owns, page ids within the cache) are done only
      when the tensors are already on the host (CPU tensors) and raise ``ValueError``. On the GPU the
      kernel skips (masks out) any token whose request index, position or page id falls outside the
      page table or the cache, so a bad token is never written out of bounds but is silently dropped.
    - Two tokens mapped to the same slot race; the result is one of them.
    - A batch index of ``-1`` marks padding (what :func:`get_batch_indices_positions` writes for tokens
      beyond ``append_indptr[-1]``): such tokens are skipped on every device.
    - Accepted beyond FlashInfer 0.5.3 (which requires these): ``int64`` index tensors; a V head_dim
      different from K's (tuple caches); K and V caches with different strides; appended K/V whose
      last dimension is strided; K/V converted to an fp8 cache's dtype (FlashInfer reinterprets the
      bytes instead).
    """
    if _ops.compiling():
        pair = isinstance(paged_kv_cache, (tuple, list))
        _append_op(append_key, append_value, batch_indices, positions, paged_kv_cache[0] if pair else paged_kv_cache,
                   paged_kv_cache[1] if pair else None, kv_indices, kv_indptr, kv_last_page_len, kv_layout)
        return
    layout = parse_layout(kv_layout)
    k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache, layout)
    _check_append_inputs(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                         kv_indices, kv_indptr, kv_last_page_len)
    nnz, num_heads, head_dim = append_key.shape
    head_dim_v = append_value.shape[2]
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if k_cache.device.type == "cpu":
        keep = batch_indices != -1  # padding tokens (-1) are skipped
        _check_positions_host(batch_indices[keep], positions[keep], kv_indices, kv_indptr, num_pages, page_size)
    if nnz == 0 or num_heads == 0:
        return
    _device.check_launchable(k_cache.device, "paged_kv_cache")
    block_t, block_d, block_dv, num_warps = _append_block_sizes(head_dim, head_dim_v)
    grid = (cdiv(nnz, block_t), num_heads)
    _APPEND_PAGED_KV_CACHE[grid](
        append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
        fault_record(k_cache.device), nnz, kv_indptr.numel() - 1, num_pages, kv_indices.numel(), page_size,
        append_key.stride(0), append_key.stride(1), append_key.stride(2),
        append_value.stride(0), append_value.stride(1), append_value.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        D=head_dim, DV=head_dim_v, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=num_warps,
    )


# the eager function itself, for its custom op: the public name may be replaced by its compiled self
_append_eager = append_paged_kv_cache


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token request index and position of a ragged append, for :func:`append_paged_kv_cache`.

    For token ``t`` of request ``b`` (``append_indptr[b] <= t < append_indptr[b+1]``):
    ``batch_indices[t] = b`` and ``positions[t] = seq_lens[b] - (append_indptr[b+1] - t)``; that is,
    ``seq_lens`` are the KV lengths *after* the append.

    Parameters
    ----------
    append_indptr : torch.Tensor
        The indptr of the appended tokens, shape: ``[batch_size + 1]``, dtype: ``torch.int32``.
    seq_lens : torch.Tensor
        The KV length of each request after the append, shape: ``[batch_size]``, dtype: ``torch.int32``
        (see :func:`get_seq_lens`).
    nnz : int
        The number of appended tokens, ``append_indptr[-1]``, passed by the caller so that nothing is
        read back from the device.

    Returns
    -------
    batch_indices : torch.Tensor
        shape: ``[nnz]``, dtype: ``torch.int32``.
    positions : torch.Tensor
        shape: ``[nnz]``, dtype: ``torch.int32``.

    Note
    ----
    A Triton kernel with grid ``batch_size + 1``; no device sync. If ``nnz > append_indptr[-1]``
    (padding), tritoninfer writes ``-1`` to both outputs for the extra tokens, and
    :func:`append_paged_kv_cache` skips them; FlashInfer leaves them uninitialised.
    """
    check_int_index_tensor(append_indptr, "append_indptr")
    if append_indptr.numel() < 1:
        raise ValueError("append_indptr: expected batch_size + 1 >= 1 elements, got 0")
    batch_size = append_indptr.numel() - 1
    check_int_index_tensor(seq_lens, "seq_lens", length=batch_size)
    if seq_lens.device != append_indptr.device:
        raise ValueError(f"seq_lens: expected a tensor on {append_indptr.device}, got one on {seq_lens.device}")
    if isinstance(nnz, torch.Tensor):
        nnz = int(nnz)
    if not isinstance(nnz, int) or isinstance(nnz, bool) or nnz < 0:
        raise ValueError(f"nnz: expected a non-negative int, got {nnz!r}")
    device = append_indptr.device
    batch_indices = torch.empty((nnz,), dtype=torch.int32, device=device)
    positions = torch.empty((nnz,), dtype=torch.int32, device=device)
    if nnz == 0:
        return batch_indices, positions
    _device.check_launchable(append_indptr.device, "append_indptr")
    _BATCH_INDICES_POSITIONS[(batch_size + 1,)](
        append_indptr, seq_lens, batch_indices, positions, nnz, batch_size, BLOCK=256,
    )
    return batch_indices, positions


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    r"""KV length of each request from the page table.

    ``clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len``.

    Parameters
    ----------
    kv_indptr : torch.Tensor
        The indptr of the page table, shape: ``[batch_size + 1]``.
    kv_last_page_len : torch.Tensor
        The number of entries in each request's last page, shape: ``[batch_size]``.
    page_size : int
        The page size of the cache.

    Returns
    -------
    torch.Tensor
        shape: ``[batch_size]``, the dtype of the inputs' arithmetic (``int32`` for ``int32`` inputs).
    """
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len
