"""``tritoninfer bench``: tritoninfer against FlashInfer, FlexAttention and SDPA, side by side.

Entry point: :func:`main` (``tritoninfer bench ARGS`` and ``python -m tritoninfer bench ARGS``).
``benchmarks/README.md`` says how to run it and what every column means.

``tritoninfer bench GROUP`` runs a group with its own options (``groups.GROUPS``: ``sampling``,
``mla``, ``pod``, ``sparse``, ``rope-append``; what they share is in ``groups``). Modules of the
attention sweep: ``cli`` (options), ``shapes`` (sweeps, byte/FLOP counts), ``cases`` (inputs),
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
    from .groups import is_group, run_group

    from .settings import SettingError, apply, split_argv

    full_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, sets = split_argv(full_argv)
    except SettingError as exc:
        print(f"tritoninfer bench: error: {exc}", file=sys.stderr)
        return 2
    if is_group(argv):
        return run_group(argv, sets, full_argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message already printed)
        return int(exc.code) if isinstance(exc.code, int) else 2
    status = interpreter_switch("bench", full_argv)
    if status is not None:
        return status
    try:
        apply(sets)
    except SettingError as exc:
        print(f"tritoninfer bench: error: {exc}", file=sys.stderr)
        return 2
    from .runner import run_config

    with interpreter_warnings_ignored(), warnings.catch_warnings():
        # FlexAttention warns on every eager call on the CPU; the report says it ran eagerly.
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        return run_config(cfg)

