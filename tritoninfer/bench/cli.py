"""``tritoninfer bench`` argument parsing: every option is validated here, with argparse errors
that say what was wrong and what was expected."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from .._options import MAX_HEAD_DIM, canonicalize_dtype
from .grid import GRID_WORKLOADS, MODES as GRID_MODES
from .groups import epilog_lines
from .providers import all_names
from .shapes import SweepSpec, WORKLOADS
from .timing import TimingConfig

DESCRIPTION = """\
Side-by-side attention benchmark: tritoninfer against FlashInfer, FlexAttention and SDPA, on the
same inputs in the same process, through FlashInfer's own API. Prints a table and writes a CSV,
a markdown report and plots under --out. Without a GPU it runs tiny shapes through the Triton
interpreter: the correctness checks mean something, the timings do not."""

EPILOG = """\
examples:
  tritoninfer bench --quick
  tritoninfer bench decode --heads 32/8 --batch 16,64 --kv-len 4K,16K --kv-dtype bf16,e4m3
  tritoninfer bench prefill --heads 64/8 --head-dim 256 --page-size 1 --providers tritoninfer,flashinfer
  tritoninfer bench all --quick --out bench-out/quick
  tritoninfer bench all --grid --dry-run            # issue 25's grid: rows, parts, estimated time
  tritoninfer bench all --grid --grid-part 1/3 --out bench-out/grid-1

groups (each with its own options: tritoninfer bench GROUP --help):
{groups}

Every command also takes --set MODULE.NAME=VALUE (repeatable): a tritoninfer module constant changed
for the run, e.g. --set sampling._CAP=4096, to time one tree with and without a routing change; the
report's environment table lists it.

Lists are comma-separated; lengths take a K suffix (4K = 4096). See benchmarks/README.md."""

Q_DTYPE_NAMES = ("fp16", "bf16")
KV_DTYPE_NAMES = ("fp16", "bf16", "e4m3", "e5m2")


@dataclass
class BenchConfig:
    workloads: List[str]
    quick: bool
    spec: SweepSpec
    providers: Optional[List[str]]  # None: the default set
    out: Path
    mem_budget_gb: Optional[float]
    timing: TimingConfig
    ref_max_tokens: int
    plots: bool
    progress: bool
    seed: int
    argv: List[str] = field(default_factory=list)
    grid: Optional[str] = None  # None: the sweep; else a grid mode (grid.MODES)
    grid_extra: int = 0
    grid_part: Optional[Tuple[int, int]] = None  # (K, N), K 1-based
    dry_run: bool = False


# ---- value parsers (raise ArgumentTypeError: argparse prefixes "argument --opt: ") --------------


def _items(text: str) -> List[str]:
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def _int(text: str, what: str) -> int:
    t = text.strip()
    mult = 1
    if t[-1:] in ("k", "K"):
        mult, t = 1024, t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} (an integer, K suffix allowed), got {text!r}") from None
    return value


def positive_ints(what: str, minimum: int = 1):
    def parse(text: str) -> List[int]:
        values = [_int(t, what) for t in _items(text)]
        for v in values:
            if v < minimum:
                raise argparse.ArgumentTypeError(f"expected {what} >= {minimum}, got {v}")
        return values

    parse.__name__ = what
    return parse


def heads_list(text: str) -> List[Tuple[int, int]]:
    """``32/8,32/32`` (or ``32`` for 32/32)."""
    out = []
    for item in _items(text):
        parts = item.split("/")
        if len(parts) > 2:
            raise argparse.ArgumentTypeError(f"expected QO/KV head counts like 32/8, got {item!r}")
        try:
            hq = int(parts[0])
            hkv = int(parts[1]) if len(parts) == 2 else hq
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected QO/KV head counts like 32/8, got {item!r}") from None
        if hq <= 0 or hkv <= 0:
            raise argparse.ArgumentTypeError(f"head counts must be positive, got {item!r}")
        if hq % hkv:
            raise argparse.ArgumentTypeError(
                f"{hq} query heads are not a multiple of {hkv} KV heads in {item!r} (GQA needs H_qo % H_kv == 0)"
            )
        out.append((hq, hkv))
    return out


def head_dims(text: str) -> List[int]:
    values = positive_ints("a head_dim")(text)
    for d in values:
        if d % 8 or d > MAX_HEAD_DIM:
            raise argparse.ArgumentTypeError(f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {d}")
    return values


def dtypes(allowed: Sequence[str]):
    def parse(text: str) -> List[torch.dtype]:
        out = []
        allowed_dtypes = {canonicalize_dtype(a) for a in allowed}
        for item in _items(text):
            try:
                d = canonicalize_dtype(item)
            except ValueError:
                d = None
            if d not in allowed_dtypes:
                raise argparse.ArgumentTypeError(f"unknown or unsupported dtype {item!r}; expected one of {', '.join(allowed)}")
            out.append(d)
        return out

    parse.__name__ = "dtype list"
    return parse


def choices_list(allowed: Sequence[str], what: str, upper: bool = False):
    def parse(text: str) -> List[str]:
        out = []
        for item in _items(text):
            v = item.upper() if upper else item.lower()
            if v not in allowed:
                raise argparse.ArgumentTypeError(f"unknown {what} {item!r}; expected one of {', '.join(allowed)}")
            out.append(v)
        return out

    parse.__name__ = what
    return parse


def mask_list(text: str) -> List[bool]:
    vals = choices_list(("causal", "none", "both"), "mask")(text)
    out: List[bool] = []
    for v in vals:
        for c in ((True, False) if v == "both" else ((v == "causal"),)):
            if c not in out:
                out.append(c)
    return out


def provider_list(text: str) -> List[str]:
    allowed = all_names() + ["flashinfer", "all"]
    return choices_list(allowed, "provider")(text)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def grid_part(text: str) -> Tuple[int, int]:
    """``K/N``: part K (1-based) of N."""
    parts = text.split("/")
    try:
        k, n = (int(x) for x in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        k = n = None
    if k is None:
        raise argparse.ArgumentTypeError(f"expected K/N (part K of N, e.g. 2/3), got {text!r}")
    if n < 1 or not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"expected 1 <= K <= N in K/N, got {text!r}")
    return k, n


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def positive_int(text: str) -> int:
    if "," in text:
        raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
    return positive_ints("a positive integer")(text)[0]


# ---- the parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tritoninfer bench", description=DESCRIPTION,
        epilog=EPILOG.format(groups="\n".join(epilog_lines())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workload_pos", nargs="?", metavar="WORKLOAD", choices=WORKLOADS + ("all",),
                   help="decode (default), prefill, append, cascade, or all")
    p.add_argument("--workload", choices=WORKLOADS + ("all",), help="the same as the positional WORKLOAD")
    p.add_argument("--quick", action="store_true", help="a few shapes instead of the full sweep")

    g = p.add_argument_group("shapes (each a comma-separated list overriding the default sweep)")
    g.add_argument("--heads", type=heads_list, metavar="QO/KV", help="query/KV head counts, e.g. 32/8,32/32")
    g.add_argument("--head-dim", type=head_dims, metavar="D", help="head dims (multiples of 8 up to 256)")
    g.add_argument("--page-size", type=positive_ints("a page size"), metavar="P", help="tokens per page")
    g.add_argument("--layout", type=choices_list(("NHD", "HND"), "layout", upper=True), metavar="NHD|HND")
    g.add_argument("--q-dtype", type=dtypes(Q_DTYPE_NAMES), metavar="DT", help="fp16, bf16 (default bf16)")
    g.add_argument("--kv-dtype", type=dtypes(KV_DTYPE_NAMES), metavar="DT",
                   help="fp16, bf16, e4m3, e5m2 (default: the q dtype)")
    g.add_argument("--batch", type=positive_ints("a batch size"), metavar="B", help="requests per batch")
    g.add_argument("--kv-len", type=positive_ints("a KV length"), metavar="N",
                   help="KV tokens per request (cascade: the unique suffix; append: the length after appending)")
    g.add_argument("--qo-len", type=positive_ints("a query length"), metavar="N",
                   help="prefill: query tokens per request (default = kv-len); append: tokens appended; "
                        "cascade: queries per request (default 1)")
    g.add_argument("--shared-len", type=positive_ints("a shared prefix length"), metavar="N",
                   help="cascade: tokens of the prefix all requests share (a multiple of the page size)")
    g.add_argument("--mask", type=mask_list, metavar="causal|none|both", help="prefill/cascade masks (default both)")
    g.add_argument("--kv-form", type=choices_list(("paged", "ragged"), "KV form"), metavar="paged|ragged",
                   help="prefill: paged cache and/or ragged K/V (default both)")
    g.add_argument("--extras", dest="extras", action="store_true", default=None,
                   help="add the page-1, HND and small-head_dim rows (default: on in the full default sweep)")
    g.add_argument("--no-extras", dest="extras", action="store_false")

    gr = p.add_argument_group("issue 25's grid (decode and prefill; see benchmarks/README.md)")
    gr.add_argument("--grid", action="store_true",
                    help="run the grid instead of the sweep (decode, prefill or all). Default providers: "
                         "tritoninfer and FlashInfer's paths")
    gr.add_argument("--grid-mode", choices=GRID_MODES, metavar="star|pairs|full",
                    help="pairs (default): the star (each axis value with the others at the defaults) plus rows "
                         "until every pair of axis values appears at least once; star: the star alone; full: "
                         "the whole product")
    gr.add_argument("--grid-extra", type=non_negative_int, default=0, metavar="N",
                    help="add N rows drawn from the rest of the grid with a fixed seed (default 0)")
    gr.add_argument("--grid-part", type=grid_part, metavar="K/N",
                    help="run part K of N: contiguous parts of about equal estimated time that together "
                         "run every row once")
    gr.add_argument("--dry-run", action="store_true",
                    help="print the rows, their parts and the estimated H200 time, and run nothing")

    r = p.add_argument_group("what runs and where the results go")
    r.add_argument("--providers", type=provider_list, metavar="LIST",
                   help=f"any of {', '.join(n for n in all_names() if n != 'flashinfer')}; flashinfer (every "
                        "FlashInfer variant of the workload); all. Default: all but flex-contig")
    r.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR", help="output folder (default bench-out)")
    r.add_argument("--mem-budget-gb", type=positive_float, metavar="GB",
                   help="skip shapes whose inputs exceed this (default: 45%% of GPU memory; 2 GB on the CPU)")
    r.add_argument("--ref-max-tokens", type=positive_int, default=65536, metavar="N",
                   help="largest batch*kv_len checked against the float32 reference (default 65536); "
                        "larger shapes are checked against FlashInfer")
    r.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNGs")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    r.add_argument("--seed", type=int, default=0)

    t = p.add_argument_group("timing")
    t.add_argument("--calls-per-graph", type=positive_int, default=10, metavar="N",
                   help="calls captured in one CUDA graph (decode, append, cascade; default 10)")
    t.add_argument("--replays", type=positive_int, default=30, metavar="N", help="timed graph replays (default 30)")
    t.add_argument("--eager-reps", type=positive_int, default=20, metavar="N",
                   help="timed eager calls (prefill's device time; everyone's eager numbers; default 20)")
    t.add_argument("--plan-reps", type=positive_int, default=10, metavar="N", help="timed plan() calls (default 10)")
    t.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed calls before timing (default 3)")
    return p


def parse_args(argv: Sequence[str]) -> BenchConfig:
    """Parse and validate; bad options exit through ``parser.error`` (status 2, message on stderr)."""
    parser = build_parser()
    a = parser.parse_args(list(argv))
    if a.workload_pos and a.workload and a.workload_pos != a.workload:
        parser.error(f"workload given twice: {a.workload_pos!r} and --workload {a.workload!r}")
    workload = a.workload_pos or a.workload or "decode"
    workloads = list(WORKLOADS) if workload == "all" else [workload]
    if a.warmup < 0:
        parser.error(f"argument --warmup: expected a non-negative integer, got {a.warmup}")
    if a.shared_len and a.page_size:
        bad = [(s, p) for s in a.shared_len for p in a.page_size if s % p]
        if bad and "cascade" in workloads:
            s, pg = bad[0]
            parser.error(f"argument --shared-len: {s} is not a multiple of the page size {pg} "
                         "(the shared prefix must fill whole pages)")
    if a.qo_len and a.kv_len and workloads == ["append"]:
        if min(a.kv_len) < max(a.qo_len):
            parser.error(f"argument --qo-len: cannot append {max(a.qo_len)} tokens to requests of "
                         f"{min(a.kv_len)} (--kv-len is the length after appending)")
    if not a.grid:
        for opt, given in (("--grid-mode", a.grid_mode is not None), ("--grid-part", a.grid_part is not None),
                           ("--grid-extra", bool(a.grid_extra))):
            if given:
                parser.error(f"argument {opt}: only with --grid")
    else:
        # The grid fixes every axis: mixing in the sweep's axis options would leave a grid that the
        # goal and the parts no longer describe.
        sweep_opts = {"--quick": a.quick, "--heads": a.heads, "--head-dim": a.head_dim, "--page-size": a.page_size,
                      "--layout": a.layout, "--q-dtype": a.q_dtype, "--kv-dtype": a.kv_dtype, "--batch": a.batch,
                      "--kv-len": a.kv_len, "--qo-len": a.qo_len, "--shared-len": a.shared_len, "--mask": a.mask,
                      "--kv-form": a.kv_form, "--extras/--no-extras": a.extras is not None}
        given = [k for k, v in sweep_opts.items() if v]
        if given:
            parser.error(f"argument --grid: the grid fixes its shapes; leave out {', '.join(given)}")
        if workload not in GRID_WORKLOADS + ("all",):
            parser.error(f"argument --grid: the grid covers {' and '.join(GRID_WORKLOADS)} (or all), not {workload}")
        workloads = [w for w in workloads if w in GRID_WORKLOADS]
    spec = SweepSpec(
        heads=a.heads, head_dims=a.head_dim, page_sizes=a.page_size, layouts=a.layout, q_dtypes=a.q_dtype,
        kv_dtypes=a.kv_dtype, batches=a.batch, kv_lens=a.kv_len, qo_lens=a.qo_len, shared_lens=a.shared_len,
        causal=a.mask, kv_forms=a.kv_form, extras=a.extras,
    )
    timing = TimingConfig(calls_per_graph=a.calls_per_graph, replays=a.replays, eager_reps=a.eager_reps,
                          plan_reps=a.plan_reps, warmup=a.warmup)
    return BenchConfig(
        workloads=workloads, quick=a.quick, spec=spec, providers=a.providers, out=a.out,
        mem_budget_gb=a.mem_budget_gb, timing=timing, ref_max_tokens=a.ref_max_tokens, plots=a.plots,
        progress=a.progress, seed=a.seed, argv=list(argv), grid=(a.grid_mode or "pairs") if a.grid else None,
        grid_extra=a.grid_extra, grid_part=a.grid_part, dry_run=a.dry_run,
    )
