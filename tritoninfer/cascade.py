"""Attention-state merging (``merge_state``, ``merge_state_in_place``, ``merge_states``).

A state is an attention output ``v`` with the base-2 log-sum-exp ``s`` of its logits; merging two
states over disjoint KV gives the state of attention over their union. A state with LSE -inf
(attention over nothing) contributes nothing, and merging two such states gives output 0 and LSE
-inf. (FlashInfer 0.5.3 returns NaN there; tritoninfer deliberately does not.)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._options import check_tensor
from ._plan import next_pow2
from .kernels.merge import merge_state_kernel, merge_states_kernel

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]

_V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_pair(v: torch.Tensor, s: torch.Tensor, vname: str, sname: str) -> None:
    check_tensor(v, vname, ndim=3, dtype=_V_DTYPES)
    check_tensor(s, sname, ndim=2, dtype=torch.float32)
    if tuple(s.shape) != tuple(v.shape[:2]) or s.device != v.device:
        raise ValueError(f"{sname}: expected shape {tuple(v.shape[:2])} on {v.device} to match {vname}, got {tuple(s.shape)} on {s.device}")
    if v.stride(-1) != 1:
        raise ValueError(f"{vname}: the last dimension must be contiguous")


def _blocks(num_heads: int, head_dim: int) -> Tuple[int, int]:
    block_d = max(16, next_pow2(head_dim))
    block_h = max(1, min(next_pow2(num_heads), 4096 // block_d))
    return block_h, block_d


def _launch_merge_two(v_a, s_a, v_b, s_b, v_out, s_out, mask: Optional[torch.Tensor]) -> None:
    n, num_heads, head_dim = v_a.shape
    if n == 0:
        return
    block_h, block_d = _blocks(num_heads, head_dim)
    grid = (n, _cdiv(num_heads, block_h))
    merge_state_kernel[grid](
        v_a, v_a.stride(0), v_a.stride(1), s_a, s_a.stride(0), s_a.stride(1),
        v_b, v_b.stride(0), v_b.stride(1), s_b, s_b.stride(0), s_b.stride(1),
        v_out, v_out.stride(0), v_out.stride(1), s_out, s_out.stride(0), s_out.stride(1),
        mask if mask is not None else s_out, num_heads,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HAS_MASK=mask is not None,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states.

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, fp16, bf16 or fp32 (same dtype).
    s_a, s_b : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSEs.

    Returns
    -------
    ``(v, s)``: merged output in ``v_a``'s dtype and float32 LSE.
    """
    _check_pair(v_a, s_a, "v_a", "s_a")
    _check_pair(v_b, s_b, "v_b", "s_b")
    if v_a.shape != v_b.shape or v_a.dtype != v_b.dtype:
        raise ValueError(f"v_b: expected shape {tuple(v_a.shape)} and dtype {v_a.dtype} like v_a, got {tuple(v_b.shape)}, {v_b.dtype}")
    v = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    s = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    _launch_merge_two(v_a, s_a, v_b, s_b, v, s, None)
    return v, s


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    Parameters
    ----------
    v, v_other : torch.Tensor
        ``[seq_len, num_heads, head_dim]``.
    s, s_other : torch.Tensor
        ``[seq_len, num_heads]`` float32 base-2 LSEs.
    mask : Optional[torch.Tensor]
        bool ``[seq_len]`` on the same device: rows where it is False are left unchanged (lets a
        CUDA graph skip rows without changing shapes).
    """
    _check_pair(v, s, "v", "s")
    _check_pair(v_other, s_other, "v_other", "s_other")
    if v.shape != v_other.shape:
        raise ValueError(f"v_other: expected shape {tuple(v.shape)} like v, got {tuple(v_other.shape)}")
    if mask is not None:
        check_tensor(mask, "mask", ndim=1, dtype=torch.bool, device=v.device)
        if mask.numel() != v.shape[0]:
            raise ValueError(f"mask: expected {v.shape[0]} elements, got {mask.numel()}")
    _launch_merge_two(v, s, v_other, s_other, v, s, mask)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row.

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``, fp16, bf16 or fp32.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]`` float32 base-2 LSEs.

    Returns
    -------
    ``(v, s)``: ``[seq_len, num_heads, head_dim]`` in ``v``'s dtype and float32 ``[seq_len, num_heads]``.
    """
    check_tensor(v, "v", ndim=4, dtype=_V_DTYPES)
    check_tensor(s, "s", ndim=3, dtype=torch.float32)
    if tuple(s.shape) != tuple(v.shape[:3]) or s.device != v.device:
        raise ValueError(f"s: expected shape {tuple(v.shape[:3])} on {v.device}, got {tuple(s.shape)} on {s.device}")
    if v.stride(-1) != 1:
        raise ValueError("v: the last dimension must be contiguous")
    n, num_states, num_heads, head_dim = v.shape
    out = torch.empty((n, num_heads, head_dim), dtype=v.dtype, device=v.device)
    lse = torch.empty((n, num_heads), dtype=torch.float32, device=v.device)
    if n == 0:
        return out, lse
    block_h, block_d = _blocks(num_heads, head_dim)
    merge_states_kernel[(n, _cdiv(num_heads, block_h))](
        v, v.stride(0), v.stride(1), v.stride(2),
        s, s.stride(0), s.stride(1), s.stride(2),
        out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1),
        lse, num_heads, num_states,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HAS_MASK=False,
    )
    return out, lse
