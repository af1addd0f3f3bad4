"""The speed grid of issue 25 (``tritoninfer bench decode|prefill|all --grid``): which rows, in
which parts, and how long each part should take on an H200.

Rows. The full products are large (decode 3 pages × 3 head_dims × 5 head configs × 2 KV dtypes ×
4 batches × 3 lengths = 1080 rows; prefill 3 × 3 × 2 masks × 3 lengths × 2 = 108), so ``--grid``
(mode ``pairs``) runs a sample of them:

- the *star*: the defaults (:data:`DECODE_AXES`, :data:`PREFILL_AXES`), then every other value of
  every axis with the other axes at their defaults. Each value is thus seen alone;
- *pairs*: for every two axes, every pair of their values appears in at least one row. Rows are
  added greedily, each covering the most pairs not yet covered (ties: the row with more axes at
  their defaults, then the cheaper, then the first in product order), from the rows that fit
  :data:`PLAN_BUDGET`. Interactions of two axes (page 1 × head_dim 256, e4m3 × 28/4, ...) are
  each seen at least once. Deterministic: no random choice;
- ``--grid-extra N`` adds N rows drawn from the rest of the product with a fixed seed.

``--grid-mode star`` runs the star alone, ``--grid-mode full`` the whole product.

Parts. Rows are ordered so that those sharing a FlashInfer JIT module (head_dim × KV dtype) are
adjacent, then cut into N contiguous parts of about equal estimated time (:func:`split`), so that
``--grid-part K/N`` runs part K and the N parts together run every row exactly once.

Estimates (:func:`row_seconds`, :func:`compile_seconds`) are rough, from the timing options and
the constants below, which were set against session 4's default sweep on the H200 (decode 32/8:
35 shapes × 4 providers in 131 s, estimated 211 s; prefill: 21 shapes × 5 providers in ~305 s,
estimated 331 s). They err long on purpose: a part that overruns its 10-minute command loses its
last rows. Prefill compile times are the least certain number: correct ``FLASHINFER_JIT_S`` after
a grid run.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from .cases import num_copies
from .results import FLASHINFER_PATHS
from .shapes import SHORT_DTYPE, Shape, bytes_moved, flops, input_bytes
from .timing import TimingConfig

GRID_WORKLOADS = ("decode", "prefill")
MODES = ("star", "pairs", "full")

# Rows over this many input bytes are never chosen as pairwise or random rows (45 % of an H200, the
# default budget there), so the sample does not waste rows that the run would skip. Fixed, not the
# run's budget, so that the grid and its parts are the same on every machine.
PLAN_BUDGET = 64e9
H200_L2 = 60 << 20

# ---- the estimate's constants (seconds, bytes/s, FLOP/s) ----------------------------------------
STARTUP_S = 30.0  # one command: installing the wheels, imports, the copy-bandwidth measurement
ROW_S = 0.3  # per row: page table, checks, freeing the inputs
PROVIDER_S = 0.4  # per provider per row: set-up, plan() repetitions, graph capture, Python
BUILD_BPS = 1.0e12  # random input generation
DECODE_BPS = 2.5e12  # a decode call, the slowest provider: bytes / this
PREFILL_FLOPS = 250e12  # a prefill call, the slowest provider (fp8 and head_dim 64 included)
CALL_FLOOR_S = 10e-6
FLASHINFER_JIT_S = {"decode": 10.0, "prefill": 30.0}  # per JIT module, MAX_JOBS=16
TRITON_COMPILE_S = 4.0  # per tritoninfer kernel variant
FLEX_COMPILE_S = 5.0  # FlexAttention compiles once per row (static shapes)
PART_TARGET_S = 480.0  # what a part should stay under: 10-minute commands, with room for error



@dataclass(frozen=True)
class Axis:
    name: str
    values: Tuple
    default: object


BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn

# The axes; the defaults are the centre of the star.
DECODE_AXES = (
    Axis("page", (1, 16, 64), 16),
    Axis("head_dim", (64, 128, 256), 128),
    Axis("heads", ((32, 32), (32, 8), (28, 4), (64, 8), (16, 2)), (32, 8)),
    Axis("kv_dtype", (BF16, E4M3), BF16),
    Axis("batch", (1, 16, 64, 256), 64),
    Axis("kv_len", (1024, 4096, 32768), 4096),
)
# Prefill: heads fixed at 32/8 (the issue names no heads axis); 4 × 4K is the middle length.
PREFILL_HEADS = (32, 8)
PREFILL_AXES = (
    Axis("page", (1, 16, 32), 16),
    Axis("head_dim", (64, 128, 256), 128),
    Axis("causal", (True, False), True),
    Axis("lengths", ((16, 1024), (4, 4096), (1, 16384)), (4, 4096)),
    Axis("kv_dtype", (BF16, E4M3), BF16),
)
# The same structure in tiny sizes for the CPU, where the interpreter runs each call in seconds.
CPU_DECODE_AXES = (
    Axis("page", (1, 16), 16),
    Axis("head_dim", (32, 64), 64),
    Axis("heads", ((4, 4), (4, 2), (6, 2)), (4, 2)),
    Axis("kv_dtype", (BF16, E4M3), BF16),
    Axis("batch", (1, 3), 3),
    Axis("kv_len", (20, 50), 50),
)
CPU_PREFILL_HEADS = (4, 2)
CPU_PREFILL_AXES = (
    Axis("page", (1, 16), 16),
    Axis("head_dim", (32, 64), 64),
    Axis("causal", (True, False), True),
    Axis("lengths", ((2, 24), (1, 40)), (2, 24)),
    Axis("kv_dtype", (BF16, E4M3), BF16),
)

Point = Tuple  # one value per axis, in the axes' order


def axes_of(workload: str, gpu: bool) -> Tuple[Axis, ...]:
    if workload == "decode":
        return DECODE_AXES if gpu else CPU_DECODE_AXES
    if workload == "prefill":
        return PREFILL_AXES if gpu else CPU_PREFILL_AXES
    raise ValueError(f"the grid covers decode and prefill, not {workload!r}")


def _value_text(axis: Axis, v) -> str:
    if axis.name == "heads":
        return f"{v[0]}/{v[1]}"
    if axis.name == "kv_dtype":
        return SHORT_DTYPE[v]
    if axis.name == "causal":
        return "causal" if v else "full"
    if axis.name == "lengths":
        return f"{v[0]}×{_k(v[1])}"
    if axis.name == "kv_len":
        return _k(v)
    return str(v)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def to_shape(workload: str, axes: Sequence[Axis], point: Point, tag: str, gpu: bool) -> Shape:
    v = {a.name: x for a, x in zip(axes, point)}
    if workload == "decode":
        hq, hkv = v["heads"]
        return Shape("decode", v["batch"], v["kv_len"], 1, hq, hkv, v["head_dim"], v["page"], "NHD", BF16,
                     v["kv_dtype"], False, "paged", 0, tag)
    hq, hkv = PREFILL_HEADS if gpu else CPU_PREFILL_HEADS
    b, n = v["lengths"]
    return Shape("prefill", b, n, n, hq, hkv, v["head_dim"], v["page"], "NHD", BF16, v["kv_dtype"], v["causal"],
                 "paged", 0, tag)


def point_of(workload: str, axes: Sequence[Axis], s: Shape) -> Point:
    """The grid point of a grid row's shape (the inverse of :func:`to_shape`)."""
    v = {"page": s.page_size, "head_dim": s.head_dim, "heads": (s.num_qo_heads, s.num_kv_heads),
         "kv_dtype": s.kv_dtype, "batch": s.batch, "kv_len": s.kv_len, "causal": s.causal,
         "lengths": (s.batch, s.kv_len)}
    return tuple(v[a.name] for a in axes)


# --------------------------------------------------------------------------------------------------
# the sample
# --------------------------------------------------------------------------------------------------


def star(axes: Sequence[Axis]) -> List[Tuple[Point, str]]:
    """The defaults, then each other value of each axis with the rest at the defaults."""
    center = tuple(a.default for a in axes)
    out = [(center, "star: defaults")]
    for i, a in enumerate(axes):
        for v in a.values:
            if v != a.default:
                out.append((center[:i] + (v,) + center[i + 1:], f"star: {a.name} {_value_text(a, v)}"))
    return out


def pairs_of(point: Point) -> Set[Tuple]:
    """The (axis i, value, axis j, value) pairs a row covers (values by index in their axis)."""
    return {(i, point[i], j, point[j]) for i, j in itertools.combinations(range(len(point)), 2)}


def all_pairs(axes: Sequence[Axis]) -> Set[Tuple]:
    return {(i, a, j, b) for i, j in itertools.combinations(range(len(axes)), 2)
            for a in range(len(axes[i].values)) for b in range(len(axes[j].values))}


def _index_point(axes: Sequence[Axis], point: Point) -> Point:
    return tuple(a.values.index(v) for a, v in zip(axes, point))


def pairwise(axes: Sequence[Axis], start: Sequence[Point], candidates: Sequence[Point], cost) -> List[Point]:
    """Rows from ``candidates`` (in product order) added greedily until every pair of axis values is
    covered by ``start`` or the rows added; each covers the most uncovered pairs, ties going to the
    row with more axes at their defaults (easier to read: fewer things changed at once), then to
    the lower ``cost(point)``, then to the first candidate."""
    uncovered = all_pairs(axes)
    for p in start:
        uncovered -= pairs_of(_index_point(axes, p))
    taken = set(start)
    pool = [(p, pairs_of(_index_point(axes, p)), (sum(v == a.default for a, v in zip(axes, p)), -cost(p)))
            for p in candidates if p not in taken]
    chosen: List[Point] = []
    while uncovered:
        best = None
        for k, (p, pairs, tie) in enumerate(pool):
            gain = len(pairs & uncovered)
            if gain and (best is None or (gain, tie) > best[0]):
                best = ((gain, tie), k)
        if best is None:
            raise ValueError("the candidates cannot cover every pair of axis values")
        p, pairs, _ = pool.pop(best[1])
        chosen.append(p)
        uncovered -= pairs
    return chosen


@dataclass
class GridRow:
    workload: str
    shape: Shape
    kind: str  # star, pairs, random, full


def grid_rows(workload: str, mode: str = "pairs", extra: int = 0, gpu: bool = True) -> List[GridRow]:
    """The grid of ``workload`` in ``mode`` (:data:`MODES`) plus ``extra`` random rows, ordered so
    that rows sharing a FlashInfer JIT module (head_dim × KV dtype) are adjacent."""
    if mode not in MODES:
        raise ValueError(f"unknown grid mode {mode!r}; expected one of {', '.join(MODES)}")
    axes = axes_of(workload, gpu)
    product = list(itertools.product(*(a.values for a in axes)))

    def fits(p: Point) -> bool:
        s = to_shape(workload, axes, p, "", gpu)
        return input_bytes(s) * num_copies(s, H200_L2, True) <= PLAN_BUDGET

    def cost(p: Point) -> float:
        return row_seconds(to_shape(workload, axes, p, "", gpu), TimingConfig(), 3)

    rows: List[Tuple[Point, str, str]] = []
    if mode == "full":
        rows = [(p, "grid: full", "full") for p in product]
    else:
        rows = [(p, tag, "star") for p, tag in star(axes)]
        if mode == "pairs":
            start = [p for p, _, _ in rows]
            rows += [(p, "grid: pairs", "pairs") for p in pairwise(axes, start, [p for p in product if fits(p)], cost)]
    if extra:
        have = {p for p, _, _ in rows}
        rest = [p for p in product if p not in have and fits(p)]
        # A string seed: Python's random hashes it with SHA-512, the same in every process.
        rng = random.Random(f"tritoninfer bench grid {workload}")
        rows += [(p, "grid: random", "random") for p in rng.sample(rest, min(extra, len(rest)))]

    names = [a.name for a in axes]
    first = [names.index("head_dim"), names.index("kv_dtype"), names.index("page")]
    order = first + [i for i in range(len(axes)) if i not in first]

    def key(row):
        idx = _index_point(axes, row[0])
        return tuple(idx[i] for i in order)

    rows.sort(key=key)
    return [GridRow(workload, to_shape(workload, axes, p, tag, gpu), kind) for p, tag, kind in rows]


# --------------------------------------------------------------------------------------------------
# estimates
# --------------------------------------------------------------------------------------------------


def call_seconds(s: Shape) -> float:
    if s.workload == "prefill":
        return max(flops(s) / PREFILL_FLOPS, bytes_moved(s) / DECODE_BPS) + CALL_FLOOR_S
    return bytes_moved(s) / DECODE_BPS + CALL_FLOOR_S


def row_seconds(s: Shape, timing: TimingConfig, nproviders: int, flex: bool = False) -> float:
    """Estimated seconds for one row with ``nproviders`` providers, compiles excluded."""
    copies = num_copies(s, H200_L2, True)
    if s.workload == "prefill":  # CUDA events around eager calls
        calls = 1 + timing.warmup + timing.eager_reps
    else:  # + side-stream warm-up, capture, 3 untimed and the timed replays
        per_graph = max(timing.calls_per_graph, copies)
        calls = 1 + timing.warmup + timing.eager_reps + 2 + per_graph * (1 + 3 + timing.replays)
    build = input_bytes(s) * copies / BUILD_BPS
    return ROW_S + build + nproviders * (PROVIDER_S + calls * call_seconds(s)) + (FLEX_COMPILE_S if flex else 0.0)


def compile_keys(s: Shape, providers: Sequence[str]) -> Set[Tuple]:
    """What a row makes compile on first use: FlashInfer JIT modules (one per path × head_dim × KV
    dtype; page size and mask are run-time arguments of a module) and tritoninfer kernel variants
    (head_dim × KV dtype × page size × mask)."""
    keys: Set[Tuple] = set()
    kv = SHORT_DTYPE[s.kv_dtype]
    for p in FLASHINFER_PATHS.get(s.workload, ()):
        if p in providers:
            keys.add(("flashinfer", p, s.head_dim, kv))
    if "tritoninfer" in providers:
        keys.add(("tritoninfer", s.workload, s.head_dim, kv, s.page_size, s.causal))
    return keys


def compile_seconds(keys: Set[Tuple]) -> float:
    total = 0.0
    for k in keys:
        if k[0] == "flashinfer":
            total += FLASHINFER_JIT_S["prefill" if k[1] in FLASHINFER_PATHS["prefill"] else "decode"]
        else:
            total += TRITON_COMPILE_S
    return total


def split(costs: Sequence[float], n: int) -> List[int]:
    """Part index (0-based) of each item: contiguous runs of about equal total cost. Item i goes to
    the part that holds the midpoint of its cost on the cumulative scale, so every item is in
    exactly one part and the parts keep the items' order."""
    total = sum(costs)
    out, before = [], 0.0
    for c in costs:
        mid = before + c / 2
        out.append(min(n - 1, int(n * mid / total)) if total > 0 else 0)
        before += c
    return out


@dataclass
class Plan:
    """Every grid row of the selected workloads, its part, and the estimates."""

    rows: List[GridRow]
    parts: List[int]  # per row, 0-based
    nparts: int
    providers: Dict[str, List[str]]  # per workload
    timing: TimingConfig
    splittable: bool = True  # False for the sweep (--dry-run without --grid): no --grid-part there

    def part_rows(self, k: int) -> List[GridRow]:
        return [r for r, p in zip(self.rows, self.parts) if p == k]

    def shapes(self, workload: str, k: Optional[int]) -> List[Shape]:
        rows = self.rows if k is None else self.part_rows(k)
        return [r.shape for r in rows if r.workload == workload]

    def _row_s(self, r: GridRow) -> float:
        names = self.providers[r.workload]
        return row_seconds(r.shape, self.timing, len(names), "flex" in names)

    def seconds(self, rows: Sequence[GridRow]) -> float:
        """Estimated wall time of one command running ``rows``: start-up, compiles, rows."""
        if not rows:
            return 0.0
        keys: Set[Tuple] = set()
        for r in rows:
            keys |= compile_keys(r.shape, self.providers[r.workload])
        return STARTUP_S + compile_seconds(keys) + sum(self._row_s(r) for r in rows)

    def counts(self, workload: str) -> Tuple[int, int, int]:
        """(rows, tritoninfer variants, FlashInfer JIT modules) of one workload's whole grid."""
        rows = [r for r in self.rows if r.workload == workload]
        variants = {(r.shape.head_dim, r.shape.kv_dtype, r.shape.page_size, r.shape.causal) for r in rows}
        modules: Set[Tuple] = set()
        for r in rows:
            modules |= {k for k in compile_keys(r.shape, FLASHINFER_PATHS.get(workload, ())) if k[0] == "flashinfer"}
        return len(rows), len(variants), len(modules)

    def text(self, part: Optional[int], estimates: bool = True) -> str:
        """The counts, and each part's rows and (``estimates``) its estimated H200 time."""
        lines = []
        for w in dict.fromkeys(r.workload for r in self.rows):
            n, variants, modules = self.counts(w)
            kinds: Dict[str, int] = {}
            for r in self.rows:
                if r.workload == w:
                    kinds[r.kind] = kinds.get(r.kind, 0) + 1
            what = " + ".join(f"{v} {k}" for k, v in kinds.items())
            var = "head_dim × KV dtype × page" + (" × mask" if w == "prefill" else "")
            text = f"{'grid ' if self.splittable else ''}{w}: {n} rows ({what}); {variants} kernel variants ({var}); "
            if w in FLASHINFER_PATHS:
                paths = "/".join(p.replace("flashinfer-", "") for p in FLASHINFER_PATHS[w])
                text += f"{modules} FlashInfer JIT modules (head_dim × KV dtype × {paths}); "
            lines.append(text + f"providers {', '.join(self.providers[w]) or 'none'}")
        t = self.timing
        if estimates:
            lines.append(f"estimated time per part (H200, --replays {t.replays} --eager-reps {t.eager_reps} "
                         f"--calls-per-graph {t.calls_per_graph}; start-up {STARTUP_S:.0f} s, compiles and rows):")
        else:
            lines.append("parts (no estimate: these are the CPU's tiny shapes):")
        total = 0.0
        for k in range(self.nparts):
            rows = self.part_rows(k)
            secs = self.seconds(rows)
            total += secs
            per = ", ".join(f"{sum(r.workload == w for r in rows)} {w}" for w in dict.fromkeys(r.workload for r in rows))
            mark = "  <- this run" if part == k and self.nparts > 1 else ""
            over = ""
            if secs > PART_TARGET_S:
                over = "  OVER 8 MINUTES: " + ("use more parts" if self.splittable else "split it with the axis options")
            secs_text = f", ~{secs:.0f} s{over}" if estimates else ""
            lines.append(f"  part {k + 1}/{self.nparts}: {len(rows)} rows ({per or 'none'}){secs_text}{mark}")
        if self.splittable and estimates:
            lines.append(f"  all parts: ~{total:.0f} s; parts needed to stay under {PART_TARGET_S:.0f} s each: "
                         f"{suggest_parts(self)}")
        return "\n".join(lines)


def plan(workloads: Sequence[str], mode: str, extra: int, gpu: bool, timing: TimingConfig,
         providers: Dict[str, List[str]], nparts: int = 1) -> Plan:
    rows: List[GridRow] = []
    for w in workloads:
        rows += grid_rows(w, mode, extra, gpu)
    p = Plan(rows, [0] * len(rows), nparts, providers, timing)
    p.parts = _assign(p, nparts)
    return p


def _assign(p: Plan, nparts: int) -> List[int]:
    # A compile is charged to the first row that needs it: rows of one module are adjacent, so a
    # part that starts mid-group pays it again (counted in Plan.seconds, not here).
    seen: Set[Tuple] = set()
    costs = []
    for r in p.rows:
        keys = compile_keys(r.shape, p.providers[r.workload]) - seen
        seen |= keys
        costs.append(p._row_s(r) + compile_seconds(keys))
    return split(costs, nparts)


def suggest_parts(p: Plan, limit: int = 64) -> int:
    """The fewest parts whose every estimate stays under :data:`PART_TARGET_S`."""
    for n in range(1, limit + 1):
        q = Plan(p.rows, [], n, p.providers, p.timing, p.splittable)
        q.parts = _assign(q, n)
        if all(q.seconds(q.part_rows(k)) <= PART_TARGET_S for k in range(n)):
            return n
    return limit
