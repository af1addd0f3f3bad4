"""Two planned attention launches as one (``kernels/attention.py``'s ``attention_pair_kernel``): POD's
prefill and decode halves in one grid, so the decode items fill the GPU beside the prefill tiles
instead of waiting for them.

Each half is an ``AttentionLaunch`` built as for a launch of its own (its variant, its bound plan
arguments, its partial states and split counters); this module only lays the two halves' arguments
out in the pair kernel's order and launches once. The halves must agree on the grid's other axes
(KV heads, row tiles).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._attention import AttentionLaunch
from ._launch import CachedLauncher
from .kernels.attention import attention_pair_kernel

_PAIR = CachedLauncher(attention_pair_kernel)

# attention_fwd_kernel's per-call arguments: 17 always passed, then 6 optional ones (lse, its row
# stride, sinks, three head scales) that AttentionLaunch binds as placeholders when absent
_OPTIONAL = 6


def _per_call(launch: AttentionLaunch, q: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor], kv,
              q_scale, k_scale, v_scale) -> Tuple[bool, tuple]:
    """One half's per-call arguments (all 23) and whether its folded-scale variant may run."""
    folded, head = launch.head_args(q, out, lse, kv, q_scale, k_scale, v_scale)
    return folded, head + launch.optional_args(lse, None, None)


class PairLaunch:
    """``first`` and ``second`` (each an ``AttentionLaunch`` of its own plan) in one launch: the grid's
    first ``first``-capacity programs run the first half's items, the rest the second's."""

    def __init__(self, first: AttentionLaunch, second: AttentionLaunch) -> None:
        g1, g2 = first.attention.grid, second.attention.grid
        if g1[1:] != g2[1:]:  # (fixed by the halves' shapes: a new plan's grids agree as these)
            raise ValueError(f"attention pair: the halves' grids disagree on KV heads / row tiles ({g1} vs {g2})")
        if first.variant.lanes or second.variant.lanes:
            # the pair shares one warp count; the dot-free lanes are sized by theirs
            raise ValueError("attention pair: the dot-free single-row tiles cannot be paired")
        self.first, self.second = first, second
        self._bound: dict = {}
        self.bound_to: Optional[tuple] = None  # the caller's identities of the plans bound (``bind_plans``)
        self.keep: tuple = ()  # objects whose identities are in the caller's key (POD's scores)
        self._set_grid()

    def _set_grid(self) -> None:
        g1, g2 = self.first.plan_grid, self.second.plan_grid
        self.grid = (g1[0] + g2[0], g1[1], g1[2])
        self.num_items_p = g1[0]

    def _tail(self) -> tuple:
        """The pair kernel's bound arguments: each half's (the folded and unfolded variants share them),
        then the prefill half's item count."""
        first, second = self.first, self.second
        return (first.plan_tail[_OPTIONAL - first.optional:] + second.plan_tail[_OPTIONAL - second.optional:]
                + (self.num_items_p,))

    def bind_plans(self, first: tuple, second: tuple, bound_to: tuple) -> None:
        """Both halves moved to other plans of the same shapes and settings (``first`` and ``second``:
        ``AttentionLaunch.bind_plan``'s arguments), the pair's launches rebound to the new grid and
        arguments; ``bound_to`` records what the caller compares to find them bound."""
        self.first.bind_plan(*first, rebind=False)
        self.second.bind_plan(*second, rebind=False)
        self._set_grid()
        tail = self._tail()
        for bound in self._bound.values():
            bound.rebind(self.grid, tail)
        self.bound_to = bound_to

    def _bind(self, fold_p: bool, fold_d: bool):
        key = (fold_p, fold_d)
        bound = self._bound.get(key)
        if bound is None:
            kw_p, kw_d = [(launch.attention if fold else launch.unfolded).kwargs
                          for launch, fold in ((self.first, fold_p), (self.second, fold_d))]
            kwargs = {}
            for prefix, kw in (("P_", kw_p), ("D_", kw_d)):
                kwargs.update({prefix + k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")})
            # one warp count for both halves: the larger (the prefill tiles' 8 where they run)
            kwargs["num_warps"] = max(kw_p["num_warps"], kw_d["num_warps"])
            kwargs["num_stages"] = max(kw_p["num_stages"], kw_d["num_stages"])
            bound = self._bound[key] = _PAIR.bind(self.grid, self._tail(), kwargs)
        return bound

    def __call__(self, p: tuple, d: tuple) -> None:
        """``p`` and ``d``: each half's ``(q, out, lse, kv, q_scale, k_scale, v_scale)``."""
        fold_p, head_p = _per_call(self.first, *p)
        fold_d, head_d = _per_call(self.second, *d)
        self._bind(fold_p, fold_d)(*head_p, *head_d)
