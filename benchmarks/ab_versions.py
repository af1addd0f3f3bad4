"""Versions of tritoninfer in one process, on the same inputs, timed in interleaved rounds.

The working tree's ``tritoninfer`` ("new") against older checkouts' (``--old DIR``, repeatable: a
directory that holds a ``tritoninfer`` package, e.g. a ``git worktree``; the first is the baseline
"old", the others are named by ``--old NAME=DIR``), each imported under a name of its own. Decode rows are
median CUDA-graph replays (each graph holds ``--calls`` runs); prefill rows are eager runs timed with
CUDA events. Rounds alternate the versions so that clock and thermal drift hit both alike.

    python benchmarks/ab_versions.py --old /tmp/old --out $OUT/ab.md
"""

import argparse
import faulthandler
import importlib
import os
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import tritoninfer  # noqa: E402
from decode_sweep import eager_time  # noqa: E402

DECODE_SHAPES = [(hq, hk, b, n) for hq, hk in ((32, 8), (32, 32)) for b in (1, 16, 64, 256)
                 for n in (1024, 4096, 16384, 32768)]
PREFILL_SHAPES = [(32, 8, 16, 1024, True), (32, 8, 4, 4096, True), (32, 8, 1, 16384, True), (32, 8, 4, 4096, False)]


def say(msg: str) -> None:
    """Progress on stderr, unbuffered: a run killed by a timeout still shows how far it got."""
    print(msg, file=sys.stderr, flush=True)


def load_old(path: str, name: str):
    tmp = tempfile.mkdtemp()
    shutil.copytree(os.path.join(path, "tritoninfer"), os.path.join(tmp, f"tritoninfer_{name}"))
    sys.path.insert(0, tmp)
    return importlib.import_module(f"tritoninfer_{name}")


def paged_cache(batch, kv_len, hk, d, page, dtype):
    pages_per = -(-kv_len // page)
    num_pages = batch * pages_per
    cache = torch.randn((num_pages, 2, page, hk, d), device="cuda", dtype=torch.bfloat16)
    if dtype != torch.bfloat16:
        cache = cache.to(dtype)
    indices = torch.randperm(num_pages, device="cuda", dtype=torch.int64).to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    last = torch.full((batch,), kv_len - (pages_per - 1) * page, dtype=torch.int32)
    return cache, indptr, indices, last


def decode_graph(pkg, ws, cache, indptr, indices, last, q, hq, hk, d, page, kv_dtype, calls):
    w = pkg.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    for _ in range(3):
        w.run(q, cache, out=out)
    torch.cuda.synchronize()
    say("  eager runs done")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            w.run(q, cache, out=out)
    return g, out


def decode_eager(pkg, ws, cache, indptr, indices, last, q, hq, hk, d, page, kv_dtype):
    """(a function running one eager decode, its output): device time by events, no graph capture."""
    w = pkg.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    run = lambda: w.run(q, cache, out=out)  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    say("  eager runs done")
    return run, out


def time_graph(g, calls, reps=20):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, action="append",
                    help="[NAME=]DIR: a directory holding an older tritoninfer package (the first is the baseline)")
    ap.add_argument("--shapes", default="all", choices=["all", "few"], help="few: 8 decode shapes")
    ap.add_argument("--heads", default=None, help="only these decode heads, e.g. 32/8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tolerance", type=float, default=0.0, help="largest output difference allowed between versions")
    ap.add_argument("--eager", action="store_true",
                    help="decode timed as eager calls with events (launch gaps included), no CUDA graphs")
    ap.add_argument("--watchdog", type=float, default=None,
                    help="after this many seconds print every thread's stack and exit (a run that hangs says where)")
    args = ap.parse_args(argv)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    versions = {}
    for i, spec in enumerate(args.old):
        name, _, path = spec.rpartition("=")
        name = name or ("old" if i == 0 else f"old{i}")
        versions[name] = load_old(path, name)
        say(f"loaded {name} from {path}")
    versions["new"] = tritoninfer
    names = list(versions)
    base = names[0]
    kv_dtype = getattr(torch, args.kv_dtype)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    how = "20 eager calls timed with events" if args.eager else f"20 replays of a {args.calls}-call CUDA graph"
    lines = [f"# A/B: {args.old} (old) against the working tree (new), {torch.cuda.get_device_name()}", "",
             f"decode: median of {args.rounds} interleaved rounds x {how}, "
             f"bf16 q, {args.kv_dtype} KV, head_dim 128, page 16", "",
             "| heads | batch | kv_len | " + " | ".join(f"{k} µs" for k in names) + " | " +
             " | ".join(f"{k}/{base}" for k in names[1:]) + " |", "|---" * (3 + 2 * len(names) - 1) + "|"]
    ratios = {k: [] for k in names[1:]}
    shapes = [] if args.skip_decode else DECODE_SHAPES if args.shapes == "all" else [
        (32, 8, 1, 4096), (32, 8, 16, 4096), (32, 8, 64, 4096), (32, 8, 64, 32768), (32, 8, 256, 4096),
        (32, 8, 256, 32768), (32, 32, 16, 16384), (32, 32, 64, 16384)]
    for hq, hk, b, n in shapes:
        if b * n * hk * 128 * 2 * 2 > 40e9 or (args.heads and args.heads != f"{hq}/{hk}"):
            continue
        cache, indptr, indices, last = paged_cache(b, n, hk, 128, 16, kv_dtype)
        q = torch.randn((b, hq, 128), device="cuda", dtype=torch.bfloat16)
        graphs = {}
        for k, p in versions.items():
            say(f"{hq}/{hk} {b}x{n}: {k} " + ("runs eagerly" if args.eager else "captures"))
            if args.eager:
                graphs[k] = decode_eager(p, ws, cache, indptr, indices, last, q, hq, hk, 128, 16, kv_dtype)
            else:
                graphs[k] = decode_graph(p, ws, cache, indptr, indices, last, q, hq, hk, 128, 16, kv_dtype,
                                         args.calls)
        for k in names[1:]:
            diff = (graphs[base][1].float() - graphs[k][1].float()).abs().max().item()
            # bit-identical unless a version changes the arithmetic (e.g. the split merge's order)
            assert diff <= args.tolerance, f"outputs of {k} differ by {diff} at {hq}/{hk} {b}x{n}"
        t = {k: [] for k in versions}
        for _ in range(args.rounds):
            for k in versions:
                t[k].append(eager_time(graphs[k][0], reps=20) if args.eager else time_graph(graphs[k][0], args.calls))
        med = {k: statistics.median(v) for k, v in t.items()}
        for k in names[1:]:
            ratios[k].append(med[k] / med[base])
        lines.append(f"| {hq}/{hk} | {b} | {n} | " + " | ".join(f"{med[k]:.1f}" for k in names) + " | " +
                     " | ".join(f"{med[k] / med[base]:.3f}" for k in names[1:]) + " |")
        print(lines[-1], flush=True)
        del graphs, cache, indices
        torch.cuda.empty_cache()
    lines += [""] + [f"decode {k}/{base}: median {statistics.median(r):.3f}, min {min(r):.3f}, max {max(r):.3f} "
                     f"over {len(r)} shapes" for k, r in ratios.items() if r] + [""]
    if not args.skip_prefill:
        lines += ["prefill (paged, page 16, bf16, head_dim 128): median of interleaved rounds x 10 eager runs", "",
                  "| heads | batch x len | causal | " + " | ".join(f"{k} µs" for k in names) + " | " +
                  " | ".join(f"{k}/{base}" for k in names[1:]) + " |", "|---" * (3 + 2 * len(names) - 1) + "|"]
        for hq, hk, b, n, causal in PREFILL_SHAPES:
            cache, indptr, indices, last = paged_cache(b, n, hk, 128, 16, torch.bfloat16)
            q = torch.randn((b * n, hq, 128), device="cuda", dtype=torch.bfloat16)
            qo_indptr = torch.arange(b + 1, dtype=torch.int32) * n
            runs, outs = {}, {}
            for k, p in versions.items():
                w = p.BatchPrefillWithPagedKVCacheWrapper(ws)
                w.plan(qo_indptr, indptr, indices, last, hq, hk, 128, 16, causal=causal, q_data_type=torch.bfloat16)
                out = torch.empty_like(q)
                runs[k] = (lambda w=w, out=out: w.run(q, cache, out=out))
                outs[k] = out
            for k in versions:
                runs[k]()
            torch.cuda.synchronize()
            for k in names[1:]:
                diff = (outs[base].float() - outs[k].float()).abs().max().item()
                assert diff <= args.tolerance, f"prefill outputs of {k} differ by {diff}"
            t = {k: [] for k in versions}
            for _ in range(args.rounds):
                for k in versions:
                    t[k].append(eager_time(runs[k], reps=10))
            med = {k: statistics.median(v) for k, v in t.items()}
            lines.append(f"| {hq}/{hk} | {b} x {n} | {causal} | " + " | ".join(f"{med[k]:.1f}" for k in names) +
                         " | " + " | ".join(f"{med[k] / med[base]:.3f}" for k in names[1:]) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
