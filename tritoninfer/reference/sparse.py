"""Block-sparse attention (``flashinfer.sparse``), in float32: the ground truth for ``tritoninfer.sparse``.

FlashInfer 0.5.3 runs block-sparse attention as a batch of paged prefills: each block row is one
request whose query rows are that row's rows and whose keys are the non-zero column blocks of the row,
concatenated in the order ``indices`` lists them. Masks and positions are those of that request:
a causal mask is bottom-right aligned on the concatenated keys, RoPE puts key ``j`` of the request at
position ``j`` and query ``i`` at ``i + kv_len - qo_len``, and ALiBi uses ``j - i``. Without causal,
RoPE or ALiBi this equals dense attention under the mask :func:`bsr_dense_mask` (FlashInfer's own
test); with them, the per-request semantics above hold, and the functions here reproduce them.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .attention import _check_float_tensor, _host_ints, attention

__all__ = [
    "bsr_dense_mask",
    "block_sparse_attention",
    "variable_block_dense_mask",
    "variable_block_sparse_attention",
]


def _bsr(indptr, indices, M: int, N: int, R: int, C: int):
    ptr = _host_ints(indptr, "indptr")
    idx = _host_ints(indices, "indices")
    mb = -(-M // R)
    if len(ptr) != mb + 1:
        raise ValueError(f"indptr: expected ceil(M/R) + 1 = {mb + 1} elements, got {len(ptr)}")
    if N % C:
        raise ValueError(f"N: expected a multiple of C ({C}), got {N}")
    if any(not 0 <= j < N // C for j in idx[:ptr[-1]]):
        raise ValueError(f"indices: expected block columns in [0, {N // C})")
    return ptr, idx


def bsr_dense_mask(indptr, indices, M: int, N: int, R: int, C: int,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense ``[M, N]`` bool mask of a BSR matrix (scipy's ``bsr_matrix((mask, indices, indptr))``).

    Parameters
    ----------
    indptr : int tensor ``[ceil(M/R) + 1]``; indices : int tensor ``[nnz]`` (block columns).
    mask : bool tensor ``[nnz, R, C]``, optional
        Elements kept inside each non-zero block (all when None).
    """
    ptr, idx = _bsr(indptr, indices, M, N, R, C)
    mb = len(ptr) - 1
    dense = torch.zeros(mb * R, N, dtype=torch.bool)
    for i in range(mb):
        for b in range(ptr[i], ptr[i + 1]):
            j = idx[b]
            dense[i * R:(i + 1) * R, j * C:(j + 1) * C] = True if mask is None else mask[b].cpu().bool()
    return dense[:M]


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indptr,
    indices,
    M: int,
    N: int,
    R: int,
    C: int,
    mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    pos_encoding_mode: str = "NONE",
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    scale_q: Optional[torch.Tensor] = None,
    scale_k: Optional[torch.Tensor] = None,
    scale_v: Optional[torch.Tensor] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference of ``BlockSparseAttentionWrapper.plan(...)`` then ``run(q, k, v, scale_q, scale_k, scale_v)``.

    Parameters
    ----------
    q : ``[M, H_qo, D]``; k, v : ``[N, H_kv, D]`` (any floating dtype, fp8 included).
    indptr, indices, M, N, R, C, mask, causal, pos_encoding_mode, logits_soft_cap, sm_scale, rope_*
        As the wrapper's ``plan``; block row ``i`` has query rows ``[i*R, min((i+1)*R, M))``.
    scale_q, scale_k, scale_v : float32 ``[H_qo]``, ``[H_kv]``, ``[H_kv]``, optional
        Per-head dequantisation scales (logits times ``scale_q[h]*scale_k[h // group]``, output times
        ``scale_v[h // group]``).

    Returns
    -------
    o : float32 ``[M, H_qo, D]``; lse : float32 ``[M, H_qo]`` (base 2), only with ``return_lse``.
    """
    _check_float_tensor(q, "q", 3)
    ptr, idx = _bsr(indptr, indices, M, N, R, C)
    o = torch.zeros(M, q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((M, q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
    kb = k.reshape(N // C, C, *k.shape[1:])
    vb = v.reshape(N // C, C, *v.shape[1:])
    for i in range(len(ptr) - 1):
        rows = slice(i * R, min((i + 1) * R, M))
        cols = torch.tensor(idx[ptr[i]:ptr[i + 1]], dtype=torch.long, device=k.device)
        ki = kb[cols].reshape(-1, *k.shape[1:])
        vi = vb[cols].reshape(-1, *v.shape[1:])
        mi = None
        if mask is not None:
            # [qo, blocks * C]: the blocks side by side, in the order indices lists them
            mi = mask[ptr[i]:ptr[i + 1]].bool().permute(1, 0, 2).reshape(R, -1)[:rows.stop - rows.start]
        oi, li = attention(q[rows], ki, vi, causal=causal and mi is None, custom_mask=mi, sm_scale=sm_scale,
                           logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                           rope_scale=rope_scale, rope_theta=rope_theta, q_scale=scale_q, k_scale=scale_k,
                           v_scale=scale_v)
        o[rows] = oi
        lse[rows] = li
    return (o, lse) if return_lse else o


def variable_block_dense_mask(block_mask_map: torch.Tensor, block_row_sz: torch.Tensor,
                              block_col_sz: torch.Tensor) -> torch.Tensor:
    """The dense per-KV-head mask ``[H_kv, qo_len, kv_len]`` (bool) of a variable block-sparse layout:
    block ``(r, c)`` of head ``h`` covers ``block_row_sz[h, r]`` rows and ``block_col_sz[h, c]`` columns."""
    out = []
    for h in range(block_mask_map.shape[0]):
        rows = torch.repeat_interleave(block_mask_map[h].cpu().bool(), block_row_sz[h].cpu().long(), dim=0)
        out.append(torch.repeat_interleave(rows, block_col_sz[h].cpu().long(), dim=1))
    return torch.stack(out)


def variable_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask_map: torch.Tensor,
    block_row_sz: torch.Tensor,
    block_col_sz: torch.Tensor,
    causal: bool = False,
    pos_encoding_mode: str = "NONE",
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference of ``VariableBlockSparseAttentionWrapper.plan(...)`` then ``run(q, k, v)``.

    Parameters
    ----------
    q : ``[H_qo, qo_len, D]``; k, v : ``[H_kv, kv_len, D]`` (HND).
    block_mask_map : bool ``[H_kv, MB, NB]``; block_row_sz : int ``[H_kv, MB]`` (each row sums to
        ``qo_len``); block_col_sz : int ``[H_kv, NB]`` (each row sums to ``kv_len``).
    causal, pos_encoding_mode, ...
        Per request (KV head ``h``, block row ``r``): its keys are head ``h``'s selected column blocks
        of row ``r`` in column order.

    Returns
    -------
    o : float32 ``[H_qo, qo_len, D]``; lse : float32 ``[H_qo, qo_len]`` (base 2), only with ``return_lse``.
    """
    _check_float_tensor(q, "q", 3)
    hq, qo_len = q.shape[0], q.shape[1]
    hk = k.shape[0]
    group = hq // hk
    o = torch.zeros(hq, qo_len, v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((hq, qo_len), float("-inf"), dtype=torch.float32, device=q.device)
    for h in range(hk):
        row_sz = [int(x) for x in block_row_sz[h].cpu()]
        col_sz = torch.as_tensor(block_col_sz[h]).cpu().long()
        col_start = torch.cumsum(col_sz, 0) - col_sz
        start = 0
        for r, n in enumerate(row_sz):
            sel = block_mask_map[h, r].cpu().bool()
            tokens = torch.cat([torch.arange(int(col_start[c]), int(col_start[c] + col_sz[c]))
                                for c in torch.nonzero(sel).flatten().tolist()] or [torch.zeros(0, dtype=torch.long)])
            heads = slice(h * group, (h + 1) * group)
            # [n, group, D] queries over [tokens, 1, D] keys
            qi = q[heads, start:start + n].transpose(0, 1)
            ki = k[h, tokens.to(k.device)].unsqueeze(1)
            vi = v[h, tokens.to(v.device)].unsqueeze(1)
            oi, li = attention(qi, ki, vi, causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                               pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta)
            o[heads, start:start + n] = oi.transpose(0, 1)
            lse[heads, start:start + n] = li.transpose(0, 1)
            start += n
    return (o, lse) if return_lse else o
