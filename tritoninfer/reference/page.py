"""Reference semantics of ``tritoninfer.page``, ``tritoninfer.quantization``'s bit packing, and the
fused RoPE + fp8 + paged append of ``tritoninfer.rope``.

Pure torch (``packbits``/``segment_packbits`` via ``numpy.packbits``), written from FlashInfer
0.5.3's documented behaviour, independent of the kernels. Slow and simple on purpose.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from .elementwise import quantize_fp8_saturating, rope_quantize_fp8

__all__ = [
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "packbits",
    "segment_packbits",
    "rope_quantize_fp8_append_paged_kv_cache",
]

CacheLike = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _nhd_views(cache: CacheLike, kv_layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views ``[pages, page_size, H, D]`` of any cache form (writes go through to ``cache``)."""
    if isinstance(cache, torch.Tensor):
        if cache.dim() == 4:  # page size 1: [N, 2, H, D]
            return cache[:, 0].unsqueeze(1), cache[:, 1].unsqueeze(1)
        k, v = cache[:, 0], cache[:, 1]
    else:
        k, v = cache
        if k.dim() == 3:  # page size 1: [N, H, D]
            return k.unsqueeze(1), v.unsqueeze(1)
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    elif kv_layout != "NHD":
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    return k, v


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: CacheLike,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> CacheLike:
    """Same arguments as ``tritoninfer.page.append_paged_kv_cache``; returns an updated copy of the cache.

    The input cache is left untouched; the copy has the same form (tensor or tuple), shape, dtype
    and strides-independent contents. Token ``t`` goes to page ``kv_indices[kv_indptr[b] + pos //
    page_size]``, slot ``pos % page_size``; K/V are cast to the cache dtype with ``Tensor.to``
    (round to nearest even). Tokens with ``batch_indices[t] == -1`` (padding) are skipped.
    ``kv_last_page_len`` is not used.
    """
    if isinstance(paged_kv_cache, torch.Tensor):
        out: CacheLike = paged_kv_cache.clone()
    else:
        out = (paged_kv_cache[0].clone(), paged_kv_cache[1].clone())
    k_cache, v_cache = _nhd_views(out, kv_layout)
    page_size = k_cache.shape[1]
    dev = k_cache.device
    b = batch_indices.long().to(dev)
    pos = positions.long().to(dev)
    keep = b != -1
    b, pos = b[keep], pos[keep]
    page = kv_indices.long().to(dev)[kv_indptr.long().to(dev)[b] + pos // page_size]
    slot = pos % page_size
    # Assign through a same-size integer view: index_put does not take every fp8 dtype.
    for cache, src in ((k_cache, append_key), (v_cache, append_value)):
        bits = torch.int8 if cache.element_size() == 1 else (torch.int16 if cache.element_size() == 2 else torch.int32)
        cache.view(bits)[page, slot] = src[keep.to(src.device)].to(dev).to(cache.dtype).view(bits)
    return out


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(batch_indices, positions)``, int32 ``[nnz]``: token ``t`` of request ``b`` gets ``b`` and
    ``seq_lens[b] - (append_indptr[b+1] - t)``. Tokens at or beyond ``append_indptr[-1]`` get -1 and -1."""
    indptr = append_indptr.long()
    lens = seq_lens.long()
    t = torch.arange(nnz, device=indptr.device)
    # Request of token t: how many requests end at or before t.
    b = torch.searchsorted(indptr[1:].contiguous(), t, right=True)
    inside = b < indptr.numel() - 1
    b_safe = torch.where(inside, b, torch.zeros_like(b))
    pos = lens[b_safe] - (indptr[1:][b_safe] - t) if lens.numel() else torch.zeros_like(t)
    batch_indices = torch.where(inside, b, torch.full_like(b, -1)).to(torch.int32)
    positions = torch.where(inside, pos, torch.full_like(pos, -1)).to(torch.int32)
    return batch_indices, positions


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """``page_size * max(num_pages - 1, 0) + last_page_len`` per request, int64."""
    indptr = kv_indptr.long()
    num_pages = indptr[1:] - indptr[:-1]
    return torch.where(num_pages > 0, num_pages - 1, torch.zeros_like(num_pages)) * page_size + kv_last_page_len.long()


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """``numpy.packbits(x.flatten() != 0, bitorder=bitorder)`` as a uint8 tensor on ``x``'s device."""
    bits = (x.detach().cpu().flatten() != 0).numpy()
    return torch.from_numpy(np.packbits(bits, bitorder=bitorder).copy()).to(x.device)


def segment_packbits(
    x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each segment ``x[indptr[i]:indptr[i+1]]`` packed on its own (padded to whole bytes).

    Returns ``(y, new_indptr)`` with ``new_indptr[i+1] - new_indptr[i] = ceil(len_i / 8)`` and
    ``new_indptr`` in ``indptr``'s dtype.
    """
    bits = (x.detach().cpu().flatten() != 0).numpy()
    ptr = indptr.long().cpu().tolist()
    pieces = [np.packbits(bits[ptr[i]:ptr[i + 1]], bitorder=bitorder) for i in range(len(ptr) - 1)]
    new_indptr = [0]
    for p in pieces:
        new_indptr.append(new_indptr[-1] + p.size)
    y = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
    return (
        torch.from_numpy(y.astype(np.uint8)).to(x.device),
        torch.tensor(new_indptr, dtype=indptr.dtype, device=indptr.device),
    )


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
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    kv_layout: str = "NHD",
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``(q_rope_out, q_nope_out, new_cache)``: q as :func:`rope_quantize_fp8` gives it, and a copy of
    the ``(k_cache, v_cache)`` (GQA/MHA, 3-D ``k_rope``) or ``(ckv_cache, kpe_cache)`` (MLA, 2-D
    ``k_rope``) pair with the quantised tokens written in the caches' dtype.

    Token ``t`` goes to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot ``pos % page_size``
    (``b = batch_indices[t]``, ``pos = positions[t]``): K as ``[rope(k_rope) | k_nope]`` and V (times
    ``quant_scale_kv``) for GQA/MHA; ``kpe = rope(k_rope)``, ``ckv = k_nope`` for MLA. Tokens that
    have no valid slot (batch index outside the batch, -1 included; a position outside the pages the
    request owns; a page id outside the cache) are not written.
    """
    dtype = paged_kv_cache[0].dtype
    q_ro, k_ro, q_no, k_no = rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                                                dtype, quant_scale_q, quant_scale_kv)
    c0, c1 = paged_kv_cache[0].clone(), paged_kv_cache[1].clone()
    is_mla = k_rope.dim() == 2
    if is_mla:
        views = (c1.unsqueeze(2), c0.unsqueeze(2))  # (kpe, ckv) as [P, page_size, 1, d]
        rows = (k_ro.unsqueeze(1), k_no.unsqueeze(1))
    else:
        k_cache, v_cache = (c0, c1) if kv_layout == "NHD" else (c0.transpose(1, 2), c1.transpose(1, 2))
        views = (k_cache, v_cache)
        rows = (torch.cat([k_ro.view(torch.uint8), k_no.view(torch.uint8)], dim=-1).view(dtype),
                quantize_fp8_saturating(v.to(torch.float32) * quant_scale_kv, dtype))
    num_pages, page_size = views[0].shape[0], views[0].shape[1]
    dev = c0.device
    b = batch_indices.long()
    pos = positions.long()
    indptr = kv_indptr.tolist()
    indices = kv_indices.tolist()
    batch_size = len(indptr) - 1
    # tokens with a slot, looked up one by one (slow and simple)
    keep, page, slot = [], [], []
    for t, (bt, pt) in enumerate(zip(b.tolist(), pos.tolist())):
        if not (0 <= bt < batch_size and pt >= 0):
            continue
        idx = indptr[bt] + pt // page_size
        if not (idx < indptr[bt + 1] and 0 <= idx < len(indices)):
            continue
        p = indices[idx]
        if 0 <= p < num_pages:
            keep.append(t)
            page.append(p)
            slot.append(pt % page_size)
    keep, page, slot = (torch.tensor(x, dtype=torch.int64, device=dev) for x in (keep, page, slot))
    # assign through uint8 views: index_put does not take every fp8 dtype
    for view, src in zip(views, rows):
        view.view(torch.uint8)[page, slot] = src.to(dev).view(torch.uint8)[keep]
    return q_ro, q_no, (c0, c1)
