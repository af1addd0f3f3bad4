"""``tritoninfer`` command line: ``tritoninfer bench ...`` and ``tritoninfer demo ...``.

The library never imports this module; it imports the bench and the demo only when asked to run them.
"""

from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: tritoninfer {bench,demo} [options]

  bench   side-by-side attention benchmark against FlashInfer, FlexAttention and SDPA
  demo    continuous-batching generation loop over a paged KV cache

Run `tritoninfer COMMAND --help` for a command's options."""


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    print(f"tritoninfer: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
