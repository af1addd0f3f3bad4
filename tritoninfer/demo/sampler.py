"""Sampling for the demo (``--sampling``): tritoninfer's sampling kernels on each step's logits.

The chain, per row (requests may differ: the parameters are per-row tensors):

- ``tritoninfer.sampling.softmax(logits, temperature)``;
- without min-p: ``top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order="joint")``
  (one kernel; the entries in both the top-k and the top-p set of the row);
- with min-p (as SGLang's sampler does it): ``top_k_renorm_probs``, ``top_p_renorm_probs``, then
  ``min_p_sampling_from_probs``;
- rows of temperature 0 take the argmax instead (``torch.where``, so the batch stays one graph).

Which chain runs is fixed per engine (a CUDA graph holds one chain): the min-p one when the
engine's default ``min_p`` is above 0. Neutral values switch a filter off for a row: ``top_k`` 0,
``top_p`` 1, ``min_p`` 0.

Randomness: one ``torch.Generator`` on the device, seeded with ``SamplingConfig.seed``; the sampling
functions draw their uniforms from it with ``torch.rand``. Inside a CUDA graph each replay draws new
numbers from it because every graph that samples registers it (``register_generator_state``) before
capture; the engine re-seeds it after the warm-up, so a run's tokens depend only on the seed.

The ``--check`` of sampled tokens (:func:`allowed_rows`): the kernels sample from logits that differ
from the float32 reference by up to ``eps`` per row (measured), so membership is tested against the
reference widened by exactly that much: a token passes when some logits within ``eps`` of the
reference put it in the kept set, which holds for every token the kernels may return and fails for
tokens well outside the set.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["SamplingParams", "SamplingConfig", "Sampler", "SamplingBuffers", "allowed_rows"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters (neutral values switch a filter off)."""

    temperature: float = 1.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no top-p filter
    min_p: float = 0.0  # 0: no min-p filter

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: expected a finite value >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a value in (0, 1] (1: off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: expected a value in [0, 1] (0: off), got {self.min_p}")

    def describe(self) -> str:
        if self.temperature == 0:
            return "temperature 0 (greedy)"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.min_p > 0:
            parts.append(f"min-p {self.min_p:g}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """An engine's sampling: the requests' default parameters and the generator's seed."""

    params: SamplingParams = SamplingParams()
    seed: int = 0

    @property
    def min_p_chain(self) -> bool:
        return self.params.min_p > 0

    def describe(self) -> str:
        chain = ("softmax, top-k renorm, top-p renorm, min-p sampling" if self.min_p_chain
                 else "softmax, joint top-k/top-p sampling")
        return f"{self.params.describe()}, seed {self.seed}; kernels: {chain}"


@dataclasses.dataclass
class SamplingBuffers:
    """Per-row parameters on the device (fixed buffers: a CUDA graph reads them at every replay)."""

    temperature: torch.Tensor  # float32 [n]
    top_k: torch.Tensor  # int32 [n]
    top_p: torch.Tensor  # float32 [n]
    min_p: torch.Tensor  # float32 [n]
    _last: Optional[Tuple] = None  # host values last copied in (unchanged ones are not copied again)


class Sampler:
    def __init__(self, cfg: SamplingConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.generator = torch.Generator(device=device)
        self.reset()

    def reset(self) -> None:
        """Back to the seed's first number (after the warm-up, which drew from the generator)."""
        self.generator.manual_seed(self.cfg.seed)

    def params_of(self, reqs: Sequence) -> List[SamplingParams]:
        return [r.sampling or self.cfg.params for r in reqs]

    def check_request(self, params: Optional[SamplingParams]) -> None:
        if params is not None and params.min_p > 0 and not self.cfg.min_p_chain:
            raise ValueError("min_p: this engine runs the joint top-k/top-p chain (its default min_p is 0); "
                             "give the engine a default min_p > 0 to sample some requests with min-p")

    def buffers(self, n: int) -> SamplingBuffers:
        f = dict(dtype=torch.float32, device=self.device)
        return SamplingBuffers(torch.ones(n, **f), torch.zeros(n, dtype=torch.int32, device=self.device),
                               torch.ones(n, **f), torch.zeros(n, **f))

    def fill(self, bufs: SamplingBuffers, reqs: Sequence) -> None:
        """Copy the requests' parameters into ``bufs``; rows past ``len(reqs)`` (padding) get neutral ones."""
        n = bufs.top_k.shape[0]
        params = self.params_of(reqs) + [SamplingParams()] * (n - len(reqs))
        key = tuple(params)
        if key == bufs._last:
            return
        host = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                             [p.min_p for p in params]], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32)
        cuda = bufs.top_k.is_cuda
        if cuda:
            # pinned, so the copies do not wait for the step in flight (the engine prepares the next
            # step while the device runs the previous one); PyTorch's pinned-memory cache keeps each
            # block until its copy has run
            host, top_k = host.pin_memory(), top_k.pin_memory()
        bufs.temperature.copy_(host[0], non_blocking=cuda)
        bufs.top_p.copy_(host[1], non_blocking=cuda)
        bufs.min_p.copy_(host[2], non_blocking=cuda)
        bufs.top_k.copy_(top_k, non_blocking=cuda)
        bufs._last = key

    def sample(self, logits: torch.Tensor, bufs: SamplingBuffers) -> torch.Tensor:
        """int64 token ids ``[n]`` of ``logits`` ``[n, vocab]``: no host synchronisation, fixed
        shapes, so it can be captured in a CUDA graph (with :attr:`generator` registered)."""
        from tritoninfer import sampling  # here: the command line parses options without the kernels

        g = self.generator
        probs = sampling.softmax(logits, bufs.temperature)
        if self.cfg.min_p_chain:
            probs = sampling.top_k_renorm_probs(probs, bufs.top_k)
            probs = sampling.top_p_renorm_probs(probs, bufs.top_p)
            tokens = sampling.min_p_sampling_from_probs(probs, bufs.min_p, generator=g)
        else:
            tokens = sampling.top_k_top_p_sampling_from_probs(probs, bufs.top_k, bufs.top_p,
                                                              filter_apply_order="joint", generator=g)
        return torch.where(bufs.temperature == 0, logits.argmax(-1), tokens.long())


def allowed_rows(ref_logits: torch.Tensor, eps: torch.Tensor, tokens: torch.Tensor,
                 params: Sequence[SamplingParams], min_p_chain: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(``within``, ``exact``), bool ``[n]``: token ``i`` lies in row ``i``'s kept set of logits
    within ``eps[i]`` of the float32 reference (``within``), and in the kept set of the reference
    itself as ``tritoninfer.reference.sampling`` defines it (``exact``).

    For kernel logits ``l`` with ``|l - ref| <= eps`` and ``T > 0`` each filter keeping token ``t``
    implies, on the reference:
    top-k: fewer than ``k`` entries with ``ref_i > ref_t + 2 eps``;
    top-p: those entries' reference mass is below ``top_p * exp(2 eps / T)`` (each probability moves
    by at most a factor ``exp(2 eps / T)``; in the min-p chain top-p runs on the top-k-renormalised
    row, which only keeps fewer entries);
    min-p: ``ref_t >= max(ref) + T log(min_p) - 2 eps`` (the renorms keep the row's largest entry, so
    min-p compares with it);
    temperature 0: ``ref_t >= max(ref) - 2 eps``."""
    from tritoninfer.reference import sampling as ref_sampling

    ref = ref_logits.double()
    n = ref.shape[0]
    dev = ref.device
    t = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)
    k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)
    rows = torch.arange(n, device=dev)
    tok = tokens.to(dev).long()
    # float32 rounding of the kernels' probabilities and sums, on top of the logit difference
    slack = 2 * eps.double().to(dev) + 1e-4
    ref_t = ref[rows, tok]
    top = ref.max(-1).values
    greedy = t == 0
    safe_t = torch.where(greedy, torch.ones_like(t), t)
    above = ref > (ref_t + slack)[:, None]  # entries above t whatever logits within eps
    ok_k = (k <= 0) | (above.sum(-1) < k)
    probs = torch.softmax(ref / safe_t[:, None], -1)
    ok_p = (top_p >= 1) | ((probs * above).sum(-1) < top_p * torch.exp(slack / safe_t))
    log_min_p = torch.log(min_p.clamp_min(1e-300))
    ok_min_p = (min_p <= 0) | (ref_t >= top + safe_t * log_min_p - slack)
    within = torch.where(greedy, ref_t >= top - slack, ok_k & ok_p & ok_min_p)

    ref32 = ref_logits.float()
    rprobs = ref_sampling.softmax(ref32, safe_t.float())
    kf, pf, mf = k.to(torch.int32), top_p.float(), min_p.float()
    keep = ref_sampling.top_k_keep_mask(rprobs, kf)
    if min_p_chain:  # top-p of the top-k-renormalised row
        renormed = ref_sampling.top_k_renorm_probs(rprobs, kf)
        keep = keep & ref_sampling.top_p_keep_mask(renormed, pf) & ref_sampling.min_p_keep_mask(rprobs, mf)
    else:
        keep = keep & ref_sampling.top_p_keep_mask(rprobs, pf)
    exact = torch.where(greedy, ref32[rows, tok] >= ref32.max(-1).values, keep[rows, tok])
    return within, exact
