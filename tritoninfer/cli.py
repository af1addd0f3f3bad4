"""``tritoninfer`` command line: ``tritoninfer bench ...`` and ``tritoninfer demo ...``.

The library never imports this module; it imports the bench and the demo only when asked to run them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

USAGE = """usage: tritoninfer {bench,demo} [options]

  bench   side-by-side attention benchmark against FlashInfer, FlexAttention and SDPA
  demo    continuous-batching generation loop over a paged KV cache

Run `tritoninfer COMMAND --help` for a command's options."""


def _gpu_kernels_loaded() -> bool:
    """True if a tritoninfer module holds ``@triton.jit`` kernels decorated for the GPU (before
    ``TRITON_INTERPRET`` was set): those cannot run on the CPU."""
    if "triton" not in sys.modules:
        return False
    from triton.runtime.jit import JITFunction

    return any(
        name.startswith("tritoninfer") and module is not None
        and any(isinstance(v, JITFunction) for v in list(vars(module).values()))
        for name, module in list(sys.modules.items())
    )


def interpreter_switch(command: str, argv: List[str]) -> Optional[int]:
    """Without a GPU the commands run every kernel through the Triton interpreter, which Triton reads
    when ``@triton.jit`` decorates (at import). Sets ``TRITON_INTERPRET=1``; if kernel modules were
    already imported (``import tritoninfer`` imports them), re-runs ``tritoninfer COMMAND ARGV`` in a
    fresh process with the variable set and returns its exit status. ``None``: this process can go on.

    Only the command line does this; the library never sets ``TRITON_INTERPRET``.
    """
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    if not _gpu_kernels_loaded():
        return None
    print(f"no GPU: re-running `tritoninfer {command}` under TRITON_INTERPRET=1", file=sys.stderr, flush=True)
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "tritoninfer", command, *argv], env=dict(os.environ))


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
