"""Reference semantics of ``flashinfer.sampling``: the filters and the exact distributions sampled.

Pure PyTorch on float32 inputs, written from the math of FlashInfer 0.5.3's kernels (their
rejection loops accept exactly the sets below), independently of the Triton kernels. Thresholds
are decided on float64 sums so that the reference itself does not wobble at a boundary; tests pick
parameters away from boundaries, where float32 sums in any order agree.

For a row of probabilities ``p`` (``V`` entries):

- **top-k** keeps ``{j : #{i : p_i > p_j} < k}``, i.e. every entry ``>=`` the k-th largest value:
  entries tied with the k-th largest are all kept (more than ``k`` may survive). ``k <= 0`` or
  ``k >= V`` keeps everything.
- **top-p** keeps ``{j : sum(p_i for p_i > p_j) < top_p}``: the smallest set of largest entries whose
  mass reaches ``top_p``, *including* the entry that crosses it (and its ties). ``top_p >= 1``
  keeps everything.
- **min-p** keeps ``{j : p_j >= min_p * max(p)}`` (inclusive).
- Sampling never returns an entry of probability 0; it samples ``p`` restricted to the kept set,
  renormalised.
- ``filter_apply_order="joint"`` keeps the intersection of the top-k and top-p sets of ``p``;
  ``"top_k_first"`` applies top-p to the top-k-renormalised row.

The renorm functions return float32: the kept entries divided by their sum (``top_k_renorm_probs``
returns ``p`` unchanged when ``k >= V``; ``top_p_renorm_probs`` divides by the row sum when
``top_p >= 1``); the sums are floored at ``1e-8`` as FlashInfer does.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = [
    "softmax",
    "top_k_keep_mask",
    "top_p_keep_mask",
    "min_p_keep_mask",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "top_k_mask_logits",
    "sampling_distribution",
    "top_k_sampling_distribution",
    "top_p_sampling_distribution",
    "min_p_sampling_distribution",
    "top_k_top_p_sampling_distribution",
    "chain_speculative_first_token_distribution",
]

Param = Union[torch.Tensor, float, int]

_MIN_SUM = 1e-8


def _per_row(param: Param, rows: int, device, dtype) -> torch.Tensor:
    """``[rows, 1]`` of a scalar or per-row parameter."""
    if isinstance(param, torch.Tensor):
        return param.to(device=device, dtype=dtype).reshape(rows, 1)
    return torch.full((rows, 1), param, device=device, dtype=dtype)


def softmax(logits: torch.Tensor, temperature: Optional[Param] = None) -> torch.Tensor:
    """float32 ``softmax(logits / temperature)`` over the last dim; a temperature of 0 scales by 0
    (FlashInfer multiplies by ``1/t``, taken as 0 for ``t == 0``)."""
    x = logits.float()
    t = _per_row(1.0 if temperature is None else temperature, x.shape[0], x.device, torch.float32)
    inv = torch.where(t == 0, torch.zeros_like(t), 1.0 / t)
    return torch.softmax(x * inv, dim=-1)


def top_k_keep_mask(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    """bool ``[B, V]``: entries ``>=`` the k-th largest of their row (ties kept); all when
    ``k <= 0`` or ``k >= V``."""
    x = probs.float()
    v = x.shape[-1]
    k = _per_row(top_k, x.shape[0], x.device, torch.int64)
    sorted_desc = torch.sort(x, dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k.clamp(1, v) - 1))
    keep = x >= kth
    return keep | (k <= 0) | (k >= v)


def top_p_keep_mask(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    """bool ``[B, V]``: ``sum(p_i for p_i > p_j) < top_p`` (float64 sums); all when ``top_p >= 1``."""
    x = probs.double()
    p = _per_row(top_p, x.shape[0], x.device, torch.float64)
    ascending = torch.sort(x, dim=-1).values
    cdf = torch.cumsum(ascending, dim=-1)
    # mass of the entries <= p_j: the cdf at the last entry equal to p_j
    at_or_below = cdf.gather(1, torch.searchsorted(ascending, x.contiguous(), right=True) - 1)
    mass_above = cdf[:, -1:] - at_or_below
    return (mass_above < p) | (p >= 1)


def min_p_keep_mask(probs: torch.Tensor, min_p: Param) -> torch.Tensor:
    """bool ``[B, V]``: ``p_j >= min_p * max(p)``."""
    x = probs.float()
    m = _per_row(min_p, x.shape[0], x.device, torch.float32)
    return x >= x.max(dim=-1, keepdim=True).values * m


def _renorm(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, x, torch.zeros_like(x))
    return kept / kept.sum(-1, keepdim=True).clamp_min(_MIN_SUM)


def top_k_renorm_probs(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    """float32 ``[B, V]``: the top-k entries (ties kept, zeros dropped) over their sum; rows whose
    ``k >= V`` (or ``k <= 0``: no filter) come back unchanged."""
    x = probs.float()
    k = _per_row(top_k, x.shape[0], x.device, torch.int64)
    out = _renorm(x, top_k_keep_mask(x, top_k) & (x > 0))
    return torch.where((k <= 0) | (k >= x.shape[-1]), x, out)


def top_p_renorm_probs(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    """float32 ``[B, V]``: the top-p set over its sum (``top_p >= 1``: the row over its sum)."""
    x = probs.float()
    return _renorm(x, top_p_keep_mask(x, top_p))


def top_k_mask_logits(logits: torch.Tensor, top_k: Param) -> torch.Tensor:
    """float32 ``[B, V]``: the logits ``>=`` the k-th largest, ``-inf`` elsewhere; rows whose
    ``k >= V`` unchanged."""
    x = logits.float()
    return torch.where(top_k_keep_mask(x, top_k), x, torch.full_like(x, float("-inf")))


def _distribution(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep & (x > 0), x.double(), torch.zeros_like(x, dtype=torch.float64))
    return (kept / kept.sum(-1, keepdim=True)).float()


def sampling_distribution(probs: torch.Tensor) -> torch.Tensor:
    """float32 ``[B, V]``: what ``sampling_from_probs`` samples (the row, renormalised)."""
    x = probs.float()
    return _distribution(x, torch.ones_like(x, dtype=torch.bool))


def top_k_sampling_distribution(probs: torch.Tensor, top_k: Param) -> torch.Tensor:
    x = probs.float()
    return _distribution(x, top_k_keep_mask(x, top_k))


def top_p_sampling_distribution(probs: torch.Tensor, top_p: Param) -> torch.Tensor:
    x = probs.float()
    return _distribution(x, top_p_keep_mask(x, top_p))


def min_p_sampling_distribution(probs: torch.Tensor, min_p: Param) -> torch.Tensor:
    x = probs.float()
    return _distribution(x, min_p_keep_mask(x, min_p))


def top_k_top_p_sampling_distribution(
    probs: torch.Tensor, top_k: Param, top_p: Param, filter_apply_order: str = "top_k_first"
) -> torch.Tensor:
    """float32 ``[B, V]``: ``"joint"``: top-k and top-p sets of ``probs`` intersected;
    ``"top_k_first"``: top-p of the top-k-renormalised row."""
    x = probs.float()
    if filter_apply_order == "joint":
        return _distribution(x, top_k_keep_mask(x, top_k) & top_p_keep_mask(x, top_p))
    if filter_apply_order == "top_k_first":
        renormed = top_k_renorm_probs(x, top_k)
        return _distribution(renormed, top_p_keep_mask(renormed, top_p))
    raise ValueError(f"filter_apply_order: expected 'top_k_first' or 'joint', got {filter_apply_order!r}")


def chain_speculative_first_token_distribution(
    draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    """float32 ``[B, V]``: the distribution of ``output_token_ids[:, 0]`` of
    ``chain_speculative_sampling`` for the given draft tokens.

    The first draft token ``d`` is accepted with probability ``min(1, q(d) / p(d))`` (``q`` the
    target's first row, ``p`` the draft's); otherwise a token is drawn from ``relu(q - p)``
    renormalised. (When ``d`` itself was drawn from ``p`` the result is distributed as ``q``.)
    """
    p = draft_probs[:, 0].double()
    q = target_probs[:, 0].double()
    d = draft_token_ids[:, 0].long()[:, None]
    pd, qd = p.gather(1, d), q.gather(1, d)
    accept = torch.where(pd > 0, (qd / pd).clamp(max=1.0), torch.ones_like(pd))
    accept = torch.where(qd > 0, accept, torch.zeros_like(accept))
    residual = (q - p).clamp_min(0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-300)
    out = (1 - accept) * residual
    out.scatter_add_(1, d, accept)
    return out.float()
