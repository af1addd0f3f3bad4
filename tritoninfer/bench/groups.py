"""What the ``tritoninfer bench GROUP`` commands share: the dispatch on the first word, the options
every group has, the device set-up (GPU, or tiny shapes through the Triton interpreter), the markdown
header, the output checks and writing ``DIR/GROUP.md``.

A group is a module of this package with ``parse_args(argv)`` (validates, imports no kernel module:
``--help`` and bad options answer before the interpreter switch) and ``main(argv)`` (returns 0, or 1
when a tritoninfer output failed its check).
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from .. import _device
from .timing import TimingConfig, copy_bandwidth

# group name -> (module, one line for ``tritoninfer bench --help``)
GROUPS = {
    "sampling": ("sampling", "the sampling functions vs FlashInfer and the plain PyTorch way"),
    "mla": ("mla", "DeepSeek-V3 MLA decode vs FlashInfer's MLA wrapper (fa2, fa3)"),
    "pod": ("pod", "POD (decode batch + prefill chunk, one launch) vs FlashInfer's POD and our two launches"),
    "sparse": ("sparse", "block-sparse attention at 50 %/90 % sparsity vs FlashInfer's"),
    "rope-append": ("rope_append", "fused RoPE + fp8 quantize + paged-cache append vs FlashInfer's"),
}

CPU_BANNER = ("CPU ONLY: no GPU, so tiny shapes ran through the Triton interpreter. The checks mean something; "
              "times are not shown (the interpreter's say nothing about GPU speed).")


def is_group(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0] in GROUPS


def run_group(argv: List[str], sets: Sequence[str] = (), full_argv: Optional[List[str]] = None) -> int:
    """``tritoninfer bench GROUP ARGS``: parse, switch to the interpreter without a GPU, apply the
    ``--set`` options (``settings.py``), run."""
    from .._interpreter_switch import interpreter_switch, interpreter_warnings_ignored
    from .settings import SettingError, apply

    module = importlib.import_module(f".{GROUPS[argv[0]][0]}", __package__)
    try:
        module.parse_args(argv[1:])
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message already printed)
        return int(exc.code) if isinstance(exc.code, int) else 2
    status = interpreter_switch("bench", full_argv if full_argv is not None else argv)
    if status is not None:
        return status
    try:
        apply(sets)
    except SettingError as exc:
        print(f"tritoninfer bench: error: {exc}", file=sys.stderr)
        return 2
    with interpreter_warnings_ignored():
        return module.main(argv[1:])


def epilog_lines() -> List[str]:
    return [f"  tritoninfer bench {name:12s} {text}" for name, (_, text) in GROUPS.items()]


# ---- options ----------------------------------------------------------------------------------


def parser(group: str, doc: str, quick: str, replays: int = 30, calls_per_graph: int = 10) -> argparse.ArgumentParser:
    """The group's parser with the options every group has: --quick, --out, timing."""
    from .cli import positive_int

    p = argparse.ArgumentParser(prog=f"tritoninfer bench {group}", description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=quick.replace("%", "%%"))  # argparse %-formats help
    p.add_argument("--out", type=Path, default=Path("bench-out"), metavar="DIR",
                   help=f"writes DIR/{group}.md (default bench-out)")
    p.add_argument("--replays", type=positive_int, default=replays, metavar="N",
                   help=f"timed CUDA-graph replays, or timed eager calls where the group times eager calls "
                        f"(default {replays})")
    p.add_argument("--calls-per-graph", type=positive_int, default=calls_per_graph, metavar="N",
                   help=f"calls captured in one CUDA graph (default {calls_per_graph})")
    return p


def int_list(what: str):
    from .cli import positive_ints

    return positive_ints(what)


def float_list(what: str, lo: float, hi: float):
    def parse(text: str) -> List[float]:
        try:
            values = [float(t) for t in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers ({what}), got {text!r}") from None
        if any(not lo <= v < hi for v in values):
            raise argparse.ArgumentTypeError(f"expected {what} in [{lo}, {hi}), got {text!r}")
        return values

    return parse


def name_list(allowed: Sequence[str], what: str):
    def parse(text: str) -> List[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)} (expected any of {', '.join(allowed)})")
        return items

    return parse


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Setup:
    group: str
    device: torch.device
    gpu: bool
    timing: TimingConfig
    copy_tb_s: Optional[float]
    argv: List[str]


def start(group: str, argv: Sequence[str], a: argparse.Namespace, eager_timed: bool = False) -> Setup:
    """The device (CUDA, else the CPU with the banner printed), the timing config from the common
    options and, on a GPU, the copy bandwidth measured now."""
    gpu = _device.has_gpu()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    timing = TimingConfig(calls_per_graph=a.calls_per_graph, replays=a.replays,
                          eager_reps=a.replays if eager_timed else 5, warmup=3)
    if not gpu:
        print(CPU_BANNER, flush=True)
        timing = TimingConfig.for_cpu(timing)
    copy_tb_s = copy_bandwidth(device) if gpu else None
    return Setup(group, device, gpu, timing, copy_tb_s, list(argv))


def peer_flashinfer(submodule: str) -> Tuple[Optional[object], str]:
    """The real FlashInfer's ``submodule`` and ``""``, or ``None`` and why not (absent, broken, or
    tritoninfer registered under its name: timing that would compare tritoninfer with itself)."""
    try:
        lib = importlib.import_module("flashinfer")
        mod = importlib.import_module(f"flashinfer.{submodule}")
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"not installed ({type(exc).__name__})"
    if getattr(lib, "__tritoninfer_version__", None):
        return None, "flashinfer is tritoninfer (install_as_flashinfer)"
    return mod, ""


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def error_text(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0][:100] if first else ''}"


# ---- checks -----------------------------------------------------------------------------------


def failed(check: str) -> bool:
    """A check string that reports a wrong output or an error (not "ok ...", "skipped ...", "unchecked ...")."""
    return check.startswith(("MISMATCH", "ERROR"))


def check_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    """``ok (err)`` or ``MISMATCH (err)``: relative Frobenius error of ``got`` against ``want``
    (``testing.rel_error``), NaN in ``got`` where ``want`` is finite failing."""
    from .. import testing

    if got.shape != want.shape:
        return f"MISMATCH (shape {tuple(got.shape)} vs {tuple(want.shape)})"
    if bool((torch.isnan(got.float()) & torch.isfinite(want.float())).any()):
        return "MISMATCH (NaN)"
    err = testing.rel_error(got, want)
    return f"{'ok' if err <= tol else 'MISMATCH'} ({err:.1e})"


def check_fp8_codes(got: torch.Tensor, want: torch.Tensor) -> str:
    """fp8 tensors: the same codes, except that one may be one code away (a fused multiply-add on
    the GPU moves a value across a rounding boundary) on at most 1 % of the elements."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"MISMATCH ({got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)})"
    o = got.detach().contiguous().view(torch.uint8).to(torch.int32)
    r = want.detach().contiguous().view(torch.uint8).to(torch.int32).to(o.device)
    differ = o != r
    n = int(differ.sum())
    if n == 0:
        return "ok (codes equal)"
    one_code = ((o & 0x80) == (r & 0x80)) & ((o & 0x7F) - (r & 0x7F)).abs().le(1)
    frac = n / differ.numel()
    ok = bool(one_code[differ].all()) and frac <= 1e-2
    return f"{'ok' if ok else 'MISMATCH'} ({frac:.1e} of codes differ)"


def merge_checks(*checks: str) -> str:
    """One string for several checks of one output: the first failing one, else the first."""
    for c in checks:
        if failed(c):
            return c
    return next((c for c in checks if c), "")


# ---- the report -------------------------------------------------------------------------------


def header(setup: Setup, title: str, notes: Iterable[str]) -> str:
    """The markdown head: title, CPU warning, the environment table (device, versions, commit, date,
    copy bandwidth), the command, then the group's notes as a list."""
    from . import report

    env = report.environment(setup.device, setup.copy_tb_s, None)
    lines = [f"# tritoninfer bench {setup.group}: {title}", ""]
    if not setup.gpu:
        lines += [f"> **{CPU_BANNER}**", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()]
    command = " ".join(shlex.quote(x) for x in ["tritoninfer", "bench", setup.group, *setup.argv])
    lines += ["", f"Command: `{command}`", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n\n"


def goal_line(what: str, hits: int, total: int) -> str:
    return f"**{what}: {hits} of {total}**" if total else f"**{what}: no row measured**"


def at_least_as_fast(rows, ours: str, peer: str, what: str) -> str:
    """Goal line over the shapes where both ``ours`` and ``peer`` were timed (rows with ``shape``,
    ``provider`` and ``time_us``): how many have ours at least as fast."""
    pairs = [(o, p) for o in rows for p in rows if o.provider == ours and p.provider == peer
             and o.shape == p.shape and o.time_us and p.time_us]
    return goal_line(what, sum(o.time_us <= p.time_us for o, p in pairs), len(pairs))


def finish(setup: Setup, out: Path, head: str, body: str, tail: Sequence[str] = ()) -> None:
    """Prints the report and writes it to ``out/GROUP.md``."""
    text = head + body + "\n" + "".join(f"\n{t}\n" for t in tail)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{setup.group}.md"
    path.write_text(text)
    print(f"wrote {path}", flush=True)


def markdown_table(rows: List[list], headers: Sequence[str]) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=True)


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "" if x is None else format(x, spec)


def ratio(peer_us: Optional[float], ours_us: Optional[float]) -> str:
    """Peer time / ours (> 1: tritoninfer faster)."""
    return f"{peer_us / ours_us:.2f}" if peer_us and ours_us else ""
