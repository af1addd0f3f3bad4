"""What the ``tritoninfer bench`` and ``tritoninfer demo`` commands do about the Triton interpreter
when there is no GPU: switch it on before any kernel module is imported, and keep its numpy
warnings away from the user.

Only the commands use this; the library never sets ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from typing import Iterator, List, Optional


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
    already imported (by a program that imported them before calling the command's ``main``),
    re-runs ``tritoninfer COMMAND ARGV`` in a fresh process with the variable set and returns its
    exit status. ``None``: this process can go on.

    The commands call this after parsing their options, so ``--help`` and bad options never re-run;
    from the command line no kernel module is imported by then (``import tritoninfer`` is lazy).
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


@contextlib.contextmanager
def interpreter_warnings_ignored() -> Iterator[None]:
    """Within the block, numpy's warnings raised inside the interpreter are not shown: it evaluates
    both sides of masked operations (``log2(0)`` for a row that sees no key, whose result the kernel
    then discards) and converts arrays to scalars in ways numpy deprecates, so they say nothing
    about the results."""
    with warnings.catch_warnings():
        for category in (RuntimeWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"triton\.runtime\.interpreter")
        yield
