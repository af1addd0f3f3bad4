"""Pure-PyTorch ground truth for multi-head latent attention (MLA) over a paged latent cache.

Absorbed MLA (DeepSeek V2/V3, Kimi K2): every query head attends to the same latent cache, one row
per KV position made of a compressed part ``ckv`` (``head_dim_ckv``, 512 for DeepSeek) and a
rotary part ``kpe`` (``head_dim_kpe``, 64). For query row ``q = [q_nope; q_pe]`` of head ``h``:

    s_j = (q_nope · ckv_j + q_pe · kpe_j) * sm_scale
    out = sum_j softmax(s)_j * ckv_j                      (head_dim_ckv values)
    lse = log2(sum_j exp(s_j))                            (base 2, as FlashInfer's MLA returns it)

Causal masks are bottom-right aligned: query ``i`` of a request with ``qo_len`` queries and
``kv_len`` keys sees keys ``j <= i + kv_len - qo_len``. Rows that see no key give output 0 and
LSE ``-inf``. Inputs are upcast to float32 (float64 stays float64) before any arithmetic; an fp8
cache is dequantised first (``ckv * ckv_scale``, ``kpe * kpe_scale``).
Nothing here imports a kernel or a wrapper.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch

__all__ = ["mla_paged_attention", "append_paged_mla_kv_cache"]

_LOG2E = 1.0 / math.log(2.0)


def _ints(t, name: str) -> List[int]:
    if not torch.is_tensor(t) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D int32/int64 tensor")
    return [int(x) for x in t.tolist()]


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    sm_scale: float,
    causal: bool = False,
    ckv_scale: float = 1.0,
    kpe_scale: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA of a batch of requests over a paged latent cache.

    Parameters
    ----------
    q_nope : torch.Tensor
        ``[qo_indptr[-1], num_heads, head_dim_ckv]``, any float dtype.
    q_pe : torch.Tensor
        ``[qo_indptr[-1], num_heads, head_dim_kpe]``.
    ckv_cache : torch.Tensor
        ``[num_pages, page_size, head_dim_ckv]``.
    kpe_cache : torch.Tensor
        ``[num_pages, page_size, head_dim_kpe]``.
    qo_indptr : torch.Tensor
        ``[batch_size + 1]`` int: the query rows of request ``b`` are ``qo_indptr[b]:qo_indptr[b+1]``.
    kv_indptr : torch.Tensor
        ``[batch_size + 1]`` (or longer) int: the pages of request ``b`` are
        ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    kv_indices : torch.Tensor
        int page ids.
    kv_len : torch.Tensor
        ``[batch_size]`` int: KV positions of each request (at most its pages times page_size);
        its length defines the batch, as in FlashInfer.
    sm_scale : float
        Scale of the logits.
    causal : bool
        Bottom-right aligned causal mask within each request.
    ckv_scale, kpe_scale : float
        Dequantisation scales of the caches (``real = stored * scale``; fp8 caches).

    Returns
    -------
    ``(out, lse)``: ``out`` ``[rows, num_heads, head_dim_ckv]`` and ``lse`` ``[rows, num_heads]``
    (base 2), float32 (float64 if any input is float64). Rows of requests past ``kv_len``'s batch
    are zero / ``-inf``.
    """
    dtype = torch.float64 if torch.float64 in (q_nope.dtype, q_pe.dtype, ckv_cache.dtype) else torch.float32
    qo = _ints(qo_indptr, "qo_indptr")
    kvp = _ints(kv_indptr, "kv_indptr")
    idx = _ints(kv_indices, "kv_indices")
    lens = _ints(kv_len, "kv_len")
    batch = len(lens)
    rows, num_heads, d_ckv = q_nope.shape
    page_size = ckv_cache.shape[1]
    out = torch.zeros(rows, num_heads, d_ckv, dtype=dtype, device=q_nope.device)
    lse = torch.full((rows, num_heads), float("-inf"), dtype=dtype, device=q_nope.device)
    for b in range(batch):
        q0, q1 = qo[b], qo[b + 1]
        n = lens[b]
        if q1 <= q0 or n == 0:
            continue
        pages = idx[kvp[b]:kvp[b + 1]]
        if n > len(pages) * page_size:
            raise ValueError(f"kv_len: request {b} has {n} positions but {len(pages)} pages of {page_size}")
        page_ids = torch.tensor(pages, dtype=torch.long, device=ckv_cache.device)
        ckv = ckv_cache[page_ids].reshape(-1, d_ckv)[:n].to(dtype) * ckv_scale
        kpe = kpe_cache[page_ids].reshape(-1, kpe_cache.shape[-1])[:n].to(dtype) * kpe_scale
        qn = q_nope[q0:q1].to(dtype)
        qp = q_pe[q0:q1].to(dtype)
        # [qo_len, heads, kv_len]
        s = (torch.einsum("qhd,kd->qhk", qn, ckv) + torch.einsum("qhd,kd->qhk", qp, kpe)) * sm_scale
        if causal:
            qo_len = q1 - q0
            diag = torch.arange(qo_len, device=s.device)[:, None] + (n - qo_len)
            keep = torch.arange(n, device=s.device)[None, :] <= diag
            s = s.masked_fill(~keep[:, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True)
        seen = torch.isfinite(m)
        m = torch.where(seen, m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = torch.einsum("qhk,kd->qhd", p / torch.where(denom > 0, denom, torch.ones_like(denom)), ckv)
        out[q0:q1] = o
        lse[q0:q1] = torch.where(seen[..., 0], (m[..., 0] + torch.log(denom[..., 0])) * _LOG2E,
                                 torch.full_like(m[..., 0], float("-inf")))
    return out, lse


def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor,
    append_kpe: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    """In place: token ``t`` (``append_ckv [nnz, head_dim_ckv]``, ``append_kpe [nnz, head_dim_kpe]``)
    goes to page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot ``pos % page_size`` of
    ``ckv_cache``/``kpe_cache`` ``[num_pages, page_size, D]``, with ``b = batch_indices[t]`` and
    ``pos = positions[t]``; batch index -1 is padding (skipped). ``kv_last_page_len`` is unused."""
    page_size = ckv_cache.shape[1]
    idx = _ints(kv_indices, "kv_indices")
    kvp = _ints(kv_indptr, "kv_indptr")
    for t, (b, pos) in enumerate(zip(_ints(batch_indices, "batch_indices"), _ints(positions, "positions"))):
        if b == -1:
            continue
        page = idx[kvp[b] + pos // page_size]
        ckv_cache[page, pos % page_size] = append_ckv[t].to(ckv_cache.dtype)
        kpe_cache[page, pos % page_size] = append_kpe[t].to(kpe_cache.dtype)
