"""``tritoninfer`` command line: ``tritoninfer bench ...``, ``tritoninfer demo ...``, ``--version``.

The library never imports this module. This module imports a command's package only when that
command runs, and nothing else of tritoninfer but its version, so ``tritoninfer --help`` and
``--version`` answer at once (no torch, no Triton, no kernel module).
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

from ._version import __version__

USAGE = """usage: tritoninfer [-h] [-V] {bench,demo} [options]

  bench   side-by-side attention benchmark against FlashInfer, FlexAttention and SDPA
  demo    continuous-batching generation loop over a paged KV cache

  -h, --help     show this message
  -V, --version  print tritoninfer's version

Run `tritoninfer COMMAND --help` for a command's options."""

# command -> the package whose ``main(argv) -> int`` runs it
COMMANDS = {"bench": "tritoninfer.bench", "demo": "tritoninfer.demo"}


def main(argv: Optional[List[str]] = None) -> int:
    """Runs ``tritoninfer ARGV``; returns the exit status (the command's, or 2 for a bad command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"tritoninfer {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tritoninfer: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest)
