"""``tritoninfer demo``: continuous-batching generation (greedy or sampled) over a paged KV cache.

A Llama-architecture decoder (``model``) or a DeepSeek-style MLA decoder (``deepseek``, with
``--arch deepseek``) on tritoninfer's kernels, the attention of each (``attention``), a paged KV
cache with a page allocator (``kv_cache``), a continuous-batching scheduler (``scheduler``), the serving loop with
prefill / decode steps and CUDA graphs (``engine``), sampling with tritoninfer's sampling kernels
(``sampler``), a dense float32 reference for ``--check`` (``reference``), local Hugging Face
checkpoints (``hf``) and the command line (``cli``).
``docs/demo.md`` says how to run it.

Entry point: :func:`main` (``tritoninfer demo ARGS``, ``python -m tritoninfer demo ARGS``).
"""

from __future__ import annotations

import sys
from typing import List, Optional

__all__ = ["main"]


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``tritoninfer demo`` (see ``--help``). Returns 0, 1 if ``--check`` failed, 2 for bad options."""
    from .._interpreter_switch import interpreter_switch, interpreter_warnings_ignored
    from .cli import parse_args, run  # imports no kernel module: --help and bad options answer in this process

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a bad option (2, message printed)
        return exc.code if isinstance(exc.code, int) else 2
    status = interpreter_switch("demo", argv)
    if status is not None:
        return status
    with interpreter_warnings_ignored():
        return run(args)
