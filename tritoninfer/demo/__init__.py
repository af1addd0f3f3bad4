"""``tritoninfer demo``: continuous-batching greedy generation over a paged KV cache.

A Llama-architecture decoder (``model``) on tritoninfer's kernels, a paged KV cache with a page
allocator (``kv_cache``), a continuous-batching scheduler (``scheduler``), the serving loop with
prefill / decode steps and CUDA graphs (``engine``), a dense float32 reference for ``--check``
(``reference``), local Hugging Face checkpoints (``hf``) and the command line (``cli``).
``docs/demo.md`` says how to run it.

Entry point: :func:`main` (``tritoninfer demo ARGS``, ``python -m tritoninfer demo ARGS``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

__all__ = ["main"]


def _compiled_kernels_loaded() -> bool:
    """True if a tritoninfer module holds ``@triton.jit`` kernels built for the GPU (decorated before
    ``TRITON_INTERPRET`` was set): those cannot run on the CPU."""
    if "triton" not in sys.modules:
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover
        return False
    for name, module in list(sys.modules.items()):
        if (name.startswith("tritoninfer") and module is not None
                and any(isinstance(v, JITFunction) for v in list(vars(module).values()))):
            return True
    return False


def _interpreter_switch(argv: List[str]) -> Optional[int]:
    """Without a GPU the kernels must run through the Triton interpreter, which Triton reads when
    ``@triton.jit`` decorates (at import). Set ``TRITON_INTERPRET=1``; if kernel modules were already
    imported (``import tritoninfer`` imports them), re-run the command in a fresh process with the
    variable set and return its status. ``None``: this process can go on."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    if not _compiled_kernels_loaded():
        return None
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "tritoninfer", "demo", *argv], env=dict(os.environ))


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``tritoninfer demo`` (see ``--help``). Returns 0, 1 if ``--check`` failed, 2 for bad options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    status = _interpreter_switch(argv)
    if status is not None:
        return status
    import warnings

    from .cli import parse_args, run

    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message printed)
        return exc.code if isinstance(exc.code, int) else 2
    with warnings.catch_warnings():
        # the interpreter evaluates both sides of masked operations in numpy
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        return run(args)
