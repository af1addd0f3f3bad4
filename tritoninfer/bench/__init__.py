"""``tritoninfer bench``: tritoninfer against FlashInfer, FlexAttention and SDPA, side by side.

Entry point: :func:`main` (``tritoninfer bench ARGS`` and ``python -m tritoninfer bench ARGS``).
``benchmarks/README.md`` says how to run it and what every column means.

``tritoninfer bench sampling`` is its own group (``sampling``: the sampling functions, with its own
options). Modules: ``cli`` (options), ``shapes`` (sweeps, byte/FLOP counts), ``cases`` (inputs),
``providers`` (what is timed), ``timing`` (how), ``runner`` (the sweep), ``report`` (tables,
CSV, markdown, plots), ``results`` (the row record).
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """``tritoninfer bench`` (see ``tritoninfer bench --help``); returns the exit status: 0, 1 if
    some output mismatched its check, 2 for bad options."""
    import warnings

    from .._interpreter_switch import interpreter_switch, interpreter_warnings_ignored
    from .cli import parse_args  # imports no kernel module: --help and bad options answer in this process

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sampling"]:
        return _sampling(argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message already printed)
        return int(exc.code) if isinstance(exc.code, int) else 2
    status = interpreter_switch("bench", argv)
    if status is not None:
        return status
    from .runner import run_config

    with interpreter_warnings_ignored(), warnings.catch_warnings():
        # FlexAttention warns on every eager call on the CPU; the report says it ran eagerly.
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        return run_config(cfg)


def _sampling(argv: List[str]) -> int:
    """``tritoninfer bench sampling ARGS``: its own options (``bench.sampling``), no attention shapes."""
    from .._interpreter_switch import interpreter_switch, interpreter_warnings_ignored
    from .sampling import parse_args

    try:
        parse_args(argv[1:])
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    status = interpreter_switch("bench", argv)
    if status is not None:
        return status
    from .sampling import main as sampling_main

    with interpreter_warnings_ignored():
        return sampling_main(argv[1:])
