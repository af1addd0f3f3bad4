"""``tritoninfer bench``: tritoninfer against FlashInfer, FlexAttention and SDPA, side by side.

Entry point: :func:`main` (``tritoninfer bench ARGS`` and ``python -m tritoninfer bench ARGS``).
``benchmarks/README.md`` says how to run it and what every column means.

Modules: ``cli`` (options), ``shapes`` (sweeps, byte/FLOP counts), ``cases`` (inputs),
``providers`` (what is timed), ``timing`` (how), ``runner`` (the sweep), ``report`` (tables,
CSV, markdown, plots), ``results`` (the row record).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

__all__ = ["main"]


def _jit_functions_already_built() -> bool:
    """True if some tritoninfer module already holds ``@triton.jit`` kernels compiled for the GPU
    (decorated before ``TRITON_INTERPRET`` was set): they cannot run on the CPU."""
    if "triton" not in sys.modules:
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - other Triton layouts
        return False
    for name, module in list(sys.modules.items()):
        if not name.startswith("tritoninfer") or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction):
                return True
    return False


def _interpreter_switch(argv: List[str]) -> Optional[int]:
    """Without a GPU, kernels must run through the Triton interpreter, which Triton reads when
    ``@triton.jit`` decorates, i.e. when a kernel module is imported. Set ``TRITON_INTERPRET=1``
    now; if kernel modules were already imported (``import tritoninfer`` imports the wrappers),
    re-run this command in a fresh interpreter process with the variable set and return its status.
    Returns ``None`` when this process can go on."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    if not _jit_functions_already_built():
        return None
    print("no GPU: re-running under TRITON_INTERPRET=1 (kernel modules were imported before it could be set)",
          file=sys.stderr, flush=True)
    return subprocess.call([sys.executable, "-m", "tritoninfer", "bench", *argv], env=dict(os.environ))


def main(argv: Optional[List[str]] = None) -> int:
    """``tritoninfer bench`` (see ``tritoninfer bench --help``); returns the exit status: 0, 1 if
    some output mismatched its check, 2 for bad options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    status = _interpreter_switch(argv)
    if status is not None:
        return status
    import warnings

    from .cli import parse_args
    from .runner import run_config

    try:
        cfg = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message already printed)
        return int(exc.code) if isinstance(exc.code, int) else 2
    with warnings.catch_warnings():
        # FlexAttention warns on every eager call on the CPU; the report says it ran eagerly.
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        # The interpreter evaluates both sides of masked log2/division in numpy.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        return run_config(cfg)
