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

# CSV columns, in order (see benchmarks/README.md for what each means).
COLUMNS = [
    "workload", "shape", "tag", "kv_form", "batch", "qo_len", "kv_len", "shared_len",
    "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "layout", "q_dtype", "kv_dtype", "causal",
    "provider", "impl", "status", "detail",
    "time_us", "p20_us", "p80_us", "timing", "copies",
    "eager_dev_us", "eager_host_us", "plan_host_us",
    "bytes", "tb_per_s", "flops", "tflop_per_s",
    "speedup", "speedup_eager",
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
            check=self.check_text(),
            check_against=self.check_against,
            rel_err=_num(self.rel_err),
            tol=_num(self.tol),
            err_vs_tritoninfer=_num(self.err_vs_tritoninfer),
        )
        return {c: d.get(c, "") for c in COLUMNS}


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
