"""Compiles what issue 25's grid (``tritoninfer bench all --grid``) compiles on first use, at tiny sizes (one
request, short lengths): FlashInfer's JIT modules (one per path × head_dim × KV dtype; page size, mask and heads
are run-time arguments there) and tritoninfer's kernel variants. Cold, the JIT took most of a 10-minute
command on the H100 in session 23 (fa3 prefill modules 75-185 s each at MAX_JOBS=3); warmed this way, in
parallel processes and beside GPU test parts (a few MB of GPU memory each), the timed grid parts time kernels.
``h200_checks.sh warm-grid`` runs one process per provider and KV dtype (and per head_dim for FlashInfer's prefill
paths, whose modules take ~100 s each to build); FLASHINFER_WORKSPACE_BASE must be the timed run's.

    PYTHONPATH=.:/tmp/site python benchmarks/grid_warm.py [--provider flashinfer-fa3] [--kv-dtype e4m3] [--list]
"""
import argparse
import dataclasses
import time

import torch

from tritoninfer.bench import grid
from tritoninfer.bench.cases import Case
from tritoninfer.bench.providers import ApiDecode, ApiPrefill
from tritoninfer.bench.shapes import SHORT_DTYPE

PROVIDERS = {"decode": [ApiDecode("tritoninfer", "tritoninfer", True), ApiDecode("flashinfer-tc", "flashinfer", True),
                        ApiDecode("flashinfer-cc", "flashinfer", False)],
             "prefill": [ApiPrefill("tritoninfer", "tritoninfer", None),
                         ApiPrefill("flashinfer-fa2", "flashinfer", "fa2"),
                         ApiPrefill("flashinfer-fa3", "flashinfer", "fa3")]}


def jobs(provider=None, kv_dtype=None, head_dim=None):
    """(provider, tiny shape) for each distinct compile of the grid's rows, as the grid's estimate counts them
    (``grid.compile_keys``: FlashInfer by path × head_dim × KV dtype, tritoninfer by head_dim × KV dtype × page
    × mask; a variant of another GQA group still compiles in the timed run, seconds)."""
    seen, out = set(), []
    for row in grid.grid_rows("decode") + grid.grid_rows("prefill"):
        s = row.shape
        if (kv_dtype and SHORT_DTYPE[s.kv_dtype] != kv_dtype) or (head_dim and s.head_dim != head_dim):
            continue
        for p in PROVIDERS[s.workload]:
            if provider and p.name != provider:
                continue
            key = grid.compile_keys(s, [p.name])
            if not key <= seen:
                seen |= key
                n = 64 if s.workload == "prefill" else 512
                out.append((p, dataclasses.replace(s, batch=1, kv_len=n, qo_len=min(s.qo_len, n))))
    return out


def warm(p, s) -> str:
    start = time.time()
    what = f"{p.name} {s.workload} d{s.head_dim} {SHORT_DTYPE[s.kv_dtype]} p{s.page_size} {s.heads}"
    try:
        p.setup(Case(s, torch.device("cuda"))).run(0)
        torch.cuda.synchronize()
        return f"ok  {time.time() - start:6.1f} s  {what}"
    except Exception as exc:  # noqa: BLE001 (a path FlashInfer refuses is reported, the others still compile)
        return f"ERR {time.time() - start:6.1f} s  {what}: {type(exc).__name__}: {str(exc)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", choices=list(dict.fromkeys(p.name for ps in PROVIDERS.values() for p in ps)))
    ap.add_argument("--kv-dtype", choices=sorted(set(SHORT_DTYPE[d] for d in (torch.bfloat16, torch.float8_e4m3fn))))
    ap.add_argument("--head-dim", type=int, help="this head_dim's compiles only (FlashInfer builds one module a head_dim: "
                    "~100 s each for fa3, so one process each)")
    ap.add_argument("--list", action="store_true", help="print the compiles, run nothing")
    a = ap.parse_args()
    todo = jobs(a.provider, a.kv_dtype, a.head_dim)
    print(f"{len(todo)} compiles", flush=True)
    for p, s in todo:
        print(f"{p.name} {s}" if a.list else warm(p, s), flush=True)


if __name__ == "__main__":
    main()
