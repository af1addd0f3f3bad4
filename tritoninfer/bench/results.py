"""One result row per (shape, provider), and its CSV columns."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .shapes import Shape
from .timing import Timing

# Status values. "ok" rows have timings; the others say why they have none.
OK = "ok"
NOT_IMPLEMENTED = "not implemented"
REFUSED = "refused"
ERROR = "error"
NOT_INSTALLED = "not installed"
SKIPPED = "skipped"

# Issue 25's goal: tritoninfer at >= 0.95x the speed of FlashInfer's fastest path on every row.
GOAL = 0.95
# FlashInfer's paths per workload, whose fastest on a row is "FlashInfer's best" there.
FLASHINFER_PATHS = {
    "decode": ("flashinfer-cc", "flashinfer-tc"),
    "prefill": ("flashinfer-fa2", "flashinfer-fa3"),
    "append": ("flashinfer",),
    "cascade": ("flashinfer",),
}

# CSV columns, in order (see benchmarks/README.md for what each means).
COLUMNS = [
    "workload", "shape", "tag", "kv_form", "batch", "qo_len", "kv_len", "shared_len",
    "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "layout", "q_dtype", "kv_dtype", "causal",
    "provider", "impl", "status", "detail",
    "time_us", "p20_us", "p80_us", "timing", "copies",
    "eager_dev_us", "eager_host_us", "plan_host_us",
    "bytes", "tb_per_s", "flops", "tflop_per_s",
    "speedup", "speedup_eager", "best_peer", "vs_best", "below_goal",
    "check", "check_against", "rel_err", "tol", "err_vs_tritoninfer",
]


@dataclass
class Result:
    shape: Shape
    provider: str
    impl: str = ""
    status: str = OK
    detail: str = ""
    timing: Optional[Timing] = None
    copies: int = 1
    bytes: int = 0
    flops: int = 0
    speedup: Optional[float] = None  # provider time / tritoninfer time (> 1: tritoninfer faster)
    speedup_eager: Optional[float] = None
    check_against: str = ""
    rel_err: Optional[float] = None
    tol: Optional[float] = None
    match: Optional[bool] = None  # None: not compared
    err_vs_tritoninfer: Optional[float] = None
    is_baseline: bool = False
    # tritoninfer's row only: FlashInfer's fastest path that ran on this shape, and its time /
    # tritoninfer's (None when tritoninfer has no time).
    best_peer: str = ""
    vs_best: Optional[float] = None

    @property
    def below_goal(self) -> Optional[bool]:
        """Whether tritoninfer is under :data:`GOAL` × FlashInfer's best (None: not compared)."""
        if not self.best_peer:
            return None
        return self.vs_best is None or self.vs_best < GOAL

    @property
    def ok(self) -> bool:
        return self.status == OK and self.timing is not None and self.timing.time_us is not None

    @property
    def time_us(self) -> Optional[float]:
        return self.timing.time_us if self.ok else None

    @property
    def tb_per_s(self) -> Optional[float]:
        t = self.time_us
        return self.bytes / (t * 1e-6) / 1e12 if t and self.bytes else None

    @property
    def tflop_per_s(self) -> Optional[float]:
        t = self.time_us
        return self.flops / (t * 1e-6) / 1e12 if t and self.flops else None

    @property
    def mismatch(self) -> bool:
        return self.match is False

    def check_text(self) -> str:
        if self.is_baseline:
            return "baseline"
        if self.match is None:
            return "" if self.status != OK else "unchecked"
        return "ok" if self.match else "MISMATCH"

    def status_text(self, limit: Optional[int] = None) -> str:
        """``ok``, or ``refused: <reason>`` and the like."""
        if self.status == OK:
            return OK
        text = f"{self.status}: {self.detail}" if self.detail else self.status
        if limit and len(text) > limit:
            text = text[: limit - 1] + "…"
        return text

    def row(self) -> Dict[str, object]:
        """The CSV row (numbers unrounded; empty string for missing values)."""
        t = self.timing if self.ok else None
        d = dict(self.shape.as_dict())
        d.update(
            provider=self.provider,
            impl=self.impl,
            status=self.status,
            detail=self.detail,
            time_us=_num(t.time_us if t else None),
            p20_us=_num(t.p20_us if t else None),
            p80_us=_num(t.p80_us if t else None),
            timing=(t.method + (f"; {t.note}" if t.note else "")) if t else "",
            copies=self.copies,
            eager_dev_us=_num(t.eager_dev_us if t else None),
            eager_host_us=_num(t.eager_host_us if t else None),
            plan_host_us=_num(t.plan_host_us if t else None),
            bytes=self.bytes,
            tb_per_s=_num(self.tb_per_s),
            flops=self.flops,
            tflop_per_s=_num(self.tflop_per_s),
            speedup=_num(self.speedup),
            speedup_eager=_num(self.speedup_eager),
            best_peer=self.best_peer,
            vs_best=_num(self.vs_best),
            below_goal="" if self.below_goal is None else self.below_goal,
            check=self.check_text(),
            check_against=self.check_against,
            rel_err=_num(self.rel_err),
            tol=_num(self.tol),
            err_vs_tritoninfer=_num(self.err_vs_tritoninfer),
        )
        return {c: d.get(c, "") for c in COLUMNS}


def set_vs_best(rows: List[Result]) -> None:
    """On tritoninfer's row among one shape's ``rows``: FlashInfer's fastest timed path
    (``best_peer``) and its time / tritoninfer's (``vs_best``; None when tritoninfer has no time,
    which counts as below the goal)."""
    ti = next((r for r in rows if r.provider == "tritoninfer"), None)
    if ti is None:
        return
    paths = FLASHINFER_PATHS.get(ti.shape.workload, ())
    peers = [r for r in rows if r.provider in paths and r.ok]
    if not peers:
        ti.best_peer, ti.vs_best = "", None
        return
    best = min(peers, key=lambda r: r.time_us)
    ti.best_peer = best.provider
    ti.vs_best = best.time_us / ti.time_us if ti.ok else None


@dataclass
class GoalSummary:
    """The goal over one workload's rows: ``compared`` rows with a FlashInfer time, of which
    ``below`` are under the goal (``untimed`` of those because tritoninfer has no time), the
    worst timed one, and the rows without any FlashInfer time."""

    compared: int
    below: List[Result]
    untimed: int
    worst: Optional[Result]
    no_peer: int


def goal_summary(wr: "WorkloadResults") -> Optional[GoalSummary]:
    """None when no row has a FlashInfer time to compare with (a CPU run, FlashInfer absent)."""
    ti = [r for r in wr.results if r.provider == "tritoninfer"]
    compared = [r for r in ti if r.best_peer]
    if not compared:
        return None
    timed = [r for r in compared if r.vs_best is not None]
    worst = min(timed, key=lambda r: r.vs_best) if timed else None
    below = [r for r in compared if r.below_goal]
    return GoalSummary(len(compared), below, sum(r.vs_best is None for r in compared), worst,
                       sum(not r.best_peer for r in ti))


def _num(x: Optional[float]):
    if x is None:
        return ""
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return x


@dataclass
class WorkloadResults:
    workload: str
    results: List[Result] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def shapes(self) -> List[Shape]:
        seen: List[Shape] = []
        for r in self.results:
            if r.shape not in seen:
                seen.append(r.shape)
        return seen

    def providers(self) -> List[str]:
        names: List[str] = []
        for r in self.results:
            if r.provider not in names:
                names.append(r.provider)
        return names

    def get(self, shape: Shape, provider: str) -> Optional[Result]:
        for r in self.results:
            if r.shape == shape and r.provider == provider:
                return r
        return None
