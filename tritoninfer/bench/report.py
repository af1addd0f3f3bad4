"""Tables (terminal and markdown), the CSV, the environment header and the plots."""

from __future__ import annotations

import csv
import datetime as _dt
import platform
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from .. import _device
from .results import COLUMNS, FLASHINFER_PATHS, GOAL, OK, Result, WorkloadResults, goal_summary
from .shapes import Shape

CPU_WARNING = (
    "CPU ONLY: no GPU, so every kernel ran through the Triton interpreter. This run checks correctness "
    "only: the interpreter's timings say nothing about GPU speed and are not shown."
)

SHORT_STATUS = {
    "not implemented": "n/impl",
    "refused": "refused",
    "error": "ERROR",
    "not installed": "n/inst",
    "skipped": "skip",
}

METRIC = {"decode": "TB/s", "prefill": "TFLOP/s", "append": "TB/s", "cascade": "TB/s"}


# --------------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------------


def working_tree_modified(start: Optional[Path] = None) -> Optional[bool]:
    """Whether tracked files differ from the checked-out commit (``git status``); ``None`` when
    git is unavailable or this is not a repository. A copy of a newer tree over an old checkout
    (as remote GPU machines get) shows up here, so the report cannot name the wrong commit."""
    here = (start or Path(__file__)).resolve()
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here.parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return bool(out.stdout.strip())


def _commit_and_state() -> str:
    commit = git_commit()
    if commit is None:
        return "unknown"
    return commit + (" + uncommitted changes" if working_tree_modified() else "")


def git_commit(start: Optional[Path] = None) -> Optional[str]:
    """The commit checked out in the repository holding ``start`` (default: this package), read from
    ``.git`` directly (no git process). ``None`` outside a repository."""
    here = (start or Path(__file__)).resolve()
    for folder in [here] + list(here.parents):
        dot = folder / ".git"
        if dot.exists():
            break
    else:
        return None
    try:
        gitdir = dot
        if dot.is_file():  # worktree or submodule: "gitdir: <path>"
            text = dot.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (folder / text.split(":", 1)[1].strip()).resolve()
        common = gitdir
        if (gitdir / "commondir").exists():
            common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
        head = (gitdir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head if re.fullmatch(r"[0-9a-f]{40}", head) else None
        ref = head.split(":", 1)[1].strip()
        for base in (gitdir, common):
            path = base / ref
            if path.exists():
                return path.read_text().strip()
        packed = common / "packed-refs"
        if packed.exists():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    except OSError:
        return None
    return None


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def environment(device: torch.device, copy_tb_s: Optional[float], l2_bytes: Optional[int]) -> Dict[str, str]:
    from .providers import flashinfer_version
    import triton

    from .._version import __version__ as ti_version

    gpu = device.type == "cuda"
    env = {
        "device": _device.device_name(device) if gpu else _device.device_name(),
        "driver": driver_version() if gpu else "n/a",
        "CUDA (torch)": str(torch.version.cuda) if gpu else "n/a",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": flashinfer_version() or "not installed",
        "tritoninfer": ti_version,
        "python": platform.python_version(),
        "git commit": _commit_and_state(),
        "date (UTC)": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }
    if gpu:
        env["SMs"] = str(_device.num_sms(device))
        env["L2"] = f"{l2_bytes / 2**20:.0f} MiB" if l2_bytes else "unknown"
    if copy_tb_s is not None:
        env["copy bandwidth"] = f"{copy_tb_s:.3f} TB/s (device-to-device copy, read + write, measured in this run)"
    from .settings import APPLIED

    if APPLIED:
        env["settings (--set)"] = ", ".join(f"{name}={value!r}" for name, value in APPLIED)
    return env


# --------------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------------


def fmt_us(x: Optional[float]) -> str:
    if x is None:
        return ""
    if x < 10:
        return f"{x:.2f}"
    if x < 1000:
        return f"{x:.1f}"
    return f"{x:.0f}"


def fmt(x: Optional[float], digits: int = 2) -> str:
    if x is None:
        return ""
    if 0 < abs(x) < 0.1:
        return f"{x:.2g}"  # CPU runs: keep something readable
    return f"{x:.{digits}f}"


def fmt_err(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.1e}"


def metric_of(r: Result) -> Optional[float]:
    return r.tflop_per_s if r.shape.workload == "prefill" else r.tb_per_s


def cell(r: Optional[Result], timed: bool = True) -> str:
    """One provider's cell of the summary: ``µs (metric) ×speedup`` (``timed``) or the check alone,
    or the status."""
    if r is None:
        return ""
    if not r.ok:
        return SHORT_STATUS.get(r.status, r.status)
    if not timed:
        return check_cell(r)
    text = f"{fmt_us(r.time_us)} ({fmt(metric_of(r))})"
    if r.provider != "tritoninfer" and r.speedup is not None:
        text += f" ×{r.speedup:.2f}"
    if r.mismatch:
        text += " MISMATCH"
    return text


def check_cell(r: Result) -> str:
    """``ok (relative error)``, ``MISMATCH (relative error > tolerance)``, ``baseline`` or ``unchecked``."""
    text = r.check_text()
    if r.rel_err is not None:
        text += f" ({fmt_err(r.rel_err)} > {fmt_err(r.tol)})" if r.mismatch else f" ({fmt_err(r.rel_err)})"
    return text


def _short(provider: str) -> str:
    return provider.replace("flashinfer-", "") or provider


def best_cell(r: Optional[Result]) -> str:
    """tritoninfer against FlashInfer's fastest path on the row: ``1.021 (tc)``, ``0.940 (fa3)
    BELOW`` (under the goal), ``no time (tc) BELOW``, or empty when nothing was compared."""
    if r is None or not r.best_peer:
        return ""
    text = "no time" if r.vs_best is None else f"{r.vs_best:.3f}"
    text += f" ({_short(r.best_peer)})"
    return text + (" BELOW" if r.below_goal else "")


BEST_HEADER = "vs FlashInfer best"


def summary_rows(wr: WorkloadResults, timed: bool = True) -> (List[str], List[List[str]]):
    providers = wr.providers()
    headers = ["shape", "tag"] + providers
    rows = []
    best = timed and any(r.best_peer for r in wr.results if r.provider == "tritoninfer")
    if best:
        headers.append(BEST_HEADER)
    for shape in wr.shapes():
        row = [shape.label(), shape.tag] + [cell(wr.get(shape, p), timed) for p in providers]
        if best:
            row.append(best_cell(wr.get(shape, "tritoninfer")))
        rows.append(row)
    if not any(r[1] for r in rows):
        headers.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    return headers, rows


def legend(workload: str, timed: bool = True) -> str:
    if not timed:
        return (
            "cells: each output checked against the baseline on the same inputs (the float32 reference where "
            "it ran): ok or MISMATCH, relative error in brackets; baseline: the output the others are compared "
            "with. No timings: the interpreter's say nothing about GPU speed. n/impl: not implemented, "
            "n/inst: not installed, skip: skipped."
        )
    return (
        f"cells: device µs per call ({METRIC[workload]}) ×speed-up, speed-up = provider time / tritoninfer time "
        "(>1: tritoninfer faster; within 0.95–1.05 is a tie). n/impl: not implemented, n/inst: not installed, "
        "skip: skipped, MISMATCH: output differs from the check baseline. "
        f"{BEST_HEADER}: the time of FlashInfer's fastest path on the row ({_paths(workload)}) / tritoninfer's; "
        f"BELOW: under the goal of {GOAL}."
    )


def _paths(workload: str) -> str:
    return " or ".join(_short(p) for p in FLASHINFER_PATHS.get(workload, ())) or "none"


def goal_line(wr: WorkloadResults) -> Optional[str]:
    """One line on issue 25's goal over the workload's rows: how many are below
    ``GOAL`` × FlashInfer's best, and the worst ratio and where. None when no row had a FlashInfer
    time to compare with."""
    g = goal_summary(wr)
    if g is None:
        return None
    head = f"goal ≥ {GOAL}× FlashInfer's best ({_paths(wr.workload)}):"
    if g.below:
        text = f"{head} {len(g.below)} of {g.compared} rows BELOW"
    else:
        text = f"{head} met on all {g.compared} rows"
    if g.worst is not None:
        text += (f"; worst {g.worst.vs_best:.3f}× on {g.worst.shape.label()}"
                 f"{f' [{g.worst.shape.tag}]' if g.worst.shape.tag else ''} against {g.worst.best_peer}")
    if g.untimed:
        text += f"; {g.untimed} of the rows below have no tritoninfer time"
    if g.no_peer:
        text += f"; {g.no_peer} rows have no FlashInfer time (not compared)"
    return text


# The columns of detail_rows that are timings or derived from them (left out of an untimed report).
TIMED_COLUMNS = ("µs", "p20–p80 µs", "eager dev µs", "eager host µs", "plan host µs", "TB/s", "TFLOP/s",
                 "speed-up", "speed-up eager")


def verdict(results: Sequence[WorkloadResults]) -> str:
    """The run's one-line verdict over every output that was compared with its check baseline
    (``check: all N outputs match the reference: OK`` or ``check: K of N outputs mismatch: ...``)."""
    compared = [r for wr in results for r in wr.results if r.match is not None]
    bad = [r for r in compared if r.mismatch]
    if not compared:
        return "check: no output was compared with the reference"
    if not bad:
        return f"check: all {len(compared)} outputs match the reference: OK"
    which = "; ".join(f"{r.provider} on {r.shape.workload} {r.shape.label()}" for r in bad)
    return f"check: {len(bad)} of {len(compared)} outputs mismatch: {which}"


def detail_rows(wr: WorkloadResults, timed: bool = True) -> (List[str], List[List[str]]):
    headers = ["shape", "provider", "impl", "status", "µs", "p20–p80 µs", "eager dev µs", "eager host µs",
               "plan host µs", "TB/s", "TFLOP/s", "speed-up", "speed-up eager", "check", "rel err", "vs",
               "err vs tritoninfer"]
    rows = []
    for r in wr.results:
        t = r.timing if r.ok else None
        rows.append([
            r.shape.label() + (f" [{r.shape.tag}]" if r.shape.tag else ""),
            r.provider,
            r.impl,
            r.status_text(120),
            fmt_us(r.time_us),
            f"{fmt_us(t.p20_us)}–{fmt_us(t.p80_us)}" if t else "",
            fmt_us(t.eager_dev_us) if t else "",
            fmt_us(t.eager_host_us) if t else "",
            fmt_us(t.plan_host_us) if t else "",
            fmt(r.tb_per_s),
            fmt(r.tflop_per_s, 1),
            fmt(r.speedup),
            fmt(r.speedup_eager),
            r.check_text(),
            fmt_err(r.rel_err),
            r.check_against,
            fmt_err(r.err_vs_tritoninfer),
        ])
    if not timed:
        keep = [i for i, h in enumerate(headers) if h not in TIMED_COLUMNS]
        headers = [headers[i] for i in keep]
        rows = [[row[i] for i in keep] for row in rows]
    return headers, rows


def notes(wr: WorkloadResults) -> List[str]:
    """Deduplicated notes: refusals, errors, skips, mismatches, graph fallbacks."""
    out: List[str] = list(wr.notes)
    seen = set()
    for r in wr.results:
        msg = None
        if r.mismatch:
            msg = (f"MISMATCH: {r.provider} on {r.shape.label()}: rel err {r.rel_err:.2e} > {r.tol:.1e} "
                   f"against {r.check_against}")
        elif r.status not in (OK, "skipped", "not installed") and r.detail:
            msg = f"{r.provider}: {r.status}: {r.detail}"
        elif r.status == "skipped" and r.detail.startswith("failed "):
            msg = f"{r.provider}: not run on the remaining shapes: {r.detail}"
        elif r.ok and r.timing and r.timing.note:
            msg = f"{r.provider}: {r.timing.note}"
        if msg and msg not in seen:
            seen.add(msg)
            out.append(msg)
    return out


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def write_csv(wr: WorkloadResults, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in wr.results:
            w.writerow(r.row())
    return path


def terminal_table(wr: WorkloadResults, timed: bool = True) -> str:
    from tabulate import tabulate

    headers, rows = summary_rows(wr, timed)
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def write_markdown(wr: WorkloadResults, path: Path, env: Dict[str, str], command: str, cpu_only: bool,
                   images: Sequence[Path] = ()) -> Path:
    from tabulate import tabulate

    lines = [f"# tritoninfer bench: {wr.workload}", ""]
    if cpu_only:
        lines += [f"> **{CPU_WARNING}**", ""]
    lines += ["| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", f"Command: `{command}`", "", _method_text(wr.workload, cpu_only), ""]
    headers, rows = summary_rows(wr, timed=not cpu_only)
    lines += ["## Summary", "", legend(wr.workload, timed=not cpu_only), "",
              tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), ""]
    goal = None if cpu_only else goal_line(wr)
    if goal:
        lines += [f"**{goal}**", ""]
    for img in images:
        lines += [f"![{img.stem}]({img.name})", ""]
    ns = notes(wr)
    if ns:
        lines += ["## Notes", ""] + [f"- {n}" for n in ns] + [""]
    headers, rows = detail_rows(wr, timed=not cpu_only)
    lines += ["## All rows", "", tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def _method_text(workload: str, cpu_only: bool) -> str:
    if cpu_only:
        return ("Correctness only: every output compared with the float32 reference on the same inputs. "
                "The host wall clock of each call through the interpreter is in the CSV; it says nothing "
                "about GPU speed.")
    how = ("median of CUDA-graph replays (each graph holds back-to-back calls rotating among input copies "
           "so that the inputs are not in L2), per call" if workload != "prefill"
           else "median of CUDA events around eager calls")
    return (f"Device time: {how}; p20–p80 over the samples. Eager: events and host wall time around one "
            "call from an idle device. plan: host wall time of plan() with CPU indptr. Bytes: live KV pages + "
            "q + o (TB = 1e12). FLOPs: 4·qo·kv·H·D per request, causal pairs exact. Ratios within ±5 % are ties.")


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------

_COLORS = ["#d62728", "#1f77b4", "#17becf", "#2ca02c", "#98df8a", "#9467bd", "#7f7f7f", "#ff7f0e", "#8c564b"]


def _colors(providers: Sequence[str]) -> Dict[str, str]:
    return {p: _COLORS[i % len(_COLORS)] for i, p in enumerate(providers)}


def plot(wr: WorkloadResults, path: Path, env: Dict[str, str], roofline_tb_s: Optional[float], cpu_only: bool,
         bars: bool = False) -> Path:
    """``bars``: one bar group per shape for decode too (the grid's rows share no kv_len axis to
    draw lines along)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = wr.providers()
    colors = _colors(providers)
    title = f"tritoninfer bench: {wr.workload} on {env.get('device', '?')}"
    if cpu_only:
        title += "\n(CPU interpreter: timings say nothing about GPU speed)"
    if wr.workload == "decode" and not bars:
        fig = _plot_decode(plt, wr, providers, colors, roofline_tb_s, title)
    else:
        fig = _plot_bars(plt, wr, providers, colors, roofline_tb_s if wr.workload != "prefill" else None, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _group_key(s: Shape):
    return (s.heads, s.head_dim, s.page_size, s.layout, s.dtypes, s.tag)


def _plot_decode(plt, wr, providers, colors, roofline, title):
    groups: Dict[tuple, List[Shape]] = {}
    for s in wr.shapes():
        groups.setdefault(_group_key(s), []).append(s)
    keys = list(groups)
    batches = sorted({s.batch for s in wr.shapes()}) or [1]
    nrows, ncols = max(1, len(keys)), len(batches)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols + 1, 2.9 * nrows + 1), squeeze=False)
    for gi, key in enumerate(keys):
        for bi, b in enumerate(batches):
            ax = axes[gi][bi]
            shapes = sorted([s for s in groups[key] if s.batch == b], key=lambda s: s.kv_len)
            if not shapes:
                ax.set_visible(False)  # e.g. the page-1 / HND / head_dim-64 rows exist at one batch only
                continue
            for p in providers:
                pts = [(s.kv_len, wr.get(s, p)) for s in shapes]
                pts = [(x, r.tb_per_s) for x, r in pts if r is not None and r.ok and r.tb_per_s]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colors[p], label=p,
                            linestyle="--" if p == "reference" else "-")
            if roofline:
                ax.axhline(roofline, color="black", linestyle=":", linewidth=1, label="copy roofline")
            heads, hd, page, layout, dtypes, tag = key
            ax.set_title(f"{heads} d{hd} p{page} {layout} {dtypes}{' ' + tag if tag else ''}, batch {b}", fontsize=8)
            ax.set_xscale("log", base=2)
            kvs = [s.kv_len for s in shapes]
            if kvs:
                ax.set_xticks(kvs)
                ax.set_xticklabels([_kfmt(x) for x in kvs])
                ax.minorticks_off()
                if len(kvs) == 1:
                    ax.set_xlim(kvs[0] / 2, kvs[0] * 2)
            ax.set_xlabel("kv_len", fontsize=8)
            ax.set_ylabel("TB/s", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_ylim(bottom=0)
    handles, labels = [], []
    for row in axes:
        for ax in row:
            for h, l in zip(*ax.get_legend_handles_labels()):
                if l not in labels:
                    handles.append(h)
                    labels.append(l)
    fig.suptitle(title)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.08 if nrows == 1 else 0.04, 1, 0.9 if nrows == 1 else 0.95))
    return fig


def _kfmt(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _plot_bars(plt, wr, providers, colors, roofline, title):
    shapes = wr.shapes()
    metric = METRIC[wr.workload]
    providers = [p for p in providers if any((r := wr.get(s, p)) is not None and r.ok and metric_of(r) for s in shapes)]
    n, k = max(1, len(shapes)), max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.25 * n * k + 2), 5.5))
    width = 0.8 / k
    any_bar = False
    for pi, p in enumerate(providers):
        xs, ys = [], []
        for si, s in enumerate(shapes):
            r = wr.get(s, p)
            v = metric_of(r) if r is not None and r.ok else None
            if v:
                xs.append(si + (pi - (k - 1) / 2) * width)
                ys.append(v)
        if xs:
            any_bar = True
            ax.bar(xs, ys, width=width, color=colors[p], label=p)
    if roofline:
        ax.axhline(roofline, color="black", linestyle=":", linewidth=1, label="copy roofline")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([s.label() + (f" [{s.tag}]" if s.tag else "") for s in shapes], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(metric)
    if not any_bar:
        ax.text(0.5, 0.5, "no timed results", ha="center", va="center", transform=ax.transAxes)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig
