"""Host cost of ``plan()`` and ``run()`` over the default sweep's decode and prefill rows, against
FlashInfer 0.5.3 in the same process (issue "The host path", targets 1 and 2).

Per row and provider:

- ``run``: host wall time of one ``run()`` call issued back to back with the previous ones (no sync
  in between; the median of per-call ``perf_counter`` deltas over at most 200 calls, fewer when the
  device time would fill the launch queue);
- ``plan``: host wall time of ``plan()`` with host (CPU) indptr tensors, median of per-call deltas;
- ``step``: eager latency of one ``run()`` from an idle device (synchronise, call, synchronise), median;
- ``plan+run``: host wall time of ``plan()`` followed by the first ``run()`` of that plan, median: what
  an eager engine pays once per step on top of its other layers' ``run()``s (tritoninfer binds a new
  plan's launch at that first run).

The K/V pages are drawn from a pool of at most 4096 pages (page ids repeat across requests), so every
row fits in memory; host time does not depend on what the pages hold. ``--old NAME=DIR`` adds an
older checkout's ``tritoninfer`` (imported under its own name) as a provider. ``--profile`` prints a
cProfile breakdown of our ``run()`` at decode 1 x 4096 and paged prefill 4 x 4096.

    PYTHONPATH=. python benchmarks/host_path.py --out host.md [--old pre=.ab/pre24] [--quick]
"""

import argparse
import cProfile
import importlib
import io
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
import tritoninfer  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # the bench extra installs it; plain rows otherwise
    tabulate = None

POOL_PAGES = 4096
PAGE = 16
HEAD_DIM = 128


def load_old(spec: str):
    name, path = spec.split("=", 1)
    tmp = tempfile.mkdtemp()
    shutil.copytree(os.path.join(path, "tritoninfer"), os.path.join(tmp, f"tritoninfer_{name}"))
    sys.path.insert(0, tmp)
    return name, importlib.import_module(f"tritoninfer_{name}")


def host_times(fn, n):
    """Median host µs of ``n`` back-to-back calls (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    deltas = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        deltas.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(deltas) * 1e6


def step_latency(fn, n=30):
    """Median µs from an idle device to the end of one call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def plan_then_run(plan, run, n):
    """Median host µs of ``plan(); run()`` pairs (after one warm-up pair)."""
    plan()
    run()
    torch.cuda.synchronize()
    deltas = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        plan()
        run()
        deltas.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(deltas) * 1e6


def calls_for(fn):
    """How many back-to-back calls keep the launch queue short and the row under ~0.3 s."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    device_s = time.perf_counter() - t
    return int(max(20, min(200, 0.3 / max(device_s, 1e-6))))


def paged_table(batch, kv_len, device="cuda"):
    pages_per = -(-kv_len // PAGE)
    g = torch.Generator().manual_seed(batch * 7919 + kv_len)
    indices = torch.randint(0, POOL_PAGES, (batch * pages_per,), generator=g, dtype=torch.int32).to(device)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    last = torch.full((batch,), kv_len - (pages_per - 1) * PAGE, dtype=torch.int32)
    return indptr, indices, last


def decode_providers(libs, fi):
    out = [(name, lib, {}) for name, lib in libs]
    if fi is not None:
        out += [("fi-cc", fi, {}), ("fi-tc", fi, {"use_tensor_cores": True})]
    return out


def decode_row(providers, hq, hk, batch, kv_len, cache, ws):
    indptr, indices, last = paged_table(batch, kv_len)
    q = torch.randn(batch, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    row = {"row": f"decode {hq}/{hk} {batch}x{kv_len}"}
    for name, lib, kw in providers:
        w = lib.BatchDecodeWithPagedKVCacheWrapper(ws, **kw)

        def plan():
            w.plan(indptr, indices, last, hq, hk, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)

        def run():
            w.run(q, cache, out=out)

        plan()
        row[f"{name} plan"] = host_times(plan, 100)
        plan()
        row[f"{name} run"] = host_times(run, calls_for(run))
        row[f"{name} step"] = step_latency(run)
        row[f"{name} plan+run"] = plan_then_run(plan, run, 50)
    return row


def prefill_row(providers, hq, hk, batch, qo_len, causal, form, cache, ws):
    q = torch.randn(batch * qo_len, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * qo_len
    row = {"row": f"prefill {form} {hq}/{hk} {batch}x{qo_len} {'causal' if causal else 'full'}"}
    if form == "paged":
        indptr, indices, last = paged_table(batch, qo_len)
    else:
        k = torch.randn(batch * qo_len, hk, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    for name, lib, kw in providers:
        if form == "paged":
            w = lib.BatchPrefillWithPagedKVCacheWrapper(ws, **kw)

            def plan():
                w.plan(qo_indptr, indptr, indices, last, hq, hk, HEAD_DIM, PAGE, causal=causal,
                       q_data_type=torch.bfloat16)

            def run():
                w.run(q, cache, out=out)
        else:
            w = lib.BatchPrefillWithRaggedKVCacheWrapper(ws, **kw)

            def plan():
                w.plan(qo_indptr, qo_indptr, hq, hk, HEAD_DIM, causal=causal, q_data_type=torch.bfloat16)

            def run():
                w.run(q, k, v, out=out)
        plan()
        row[f"{name} plan"] = host_times(plan, 50)
        plan()
        row[f"{name} run"] = host_times(run, calls_for(run))
        row[f"{name} step"] = step_latency(run, 10)
        row[f"{name} plan+run"] = plan_then_run(plan, run, 20)
    return row


def profile_runs(lib):
    """cProfile of our run() at decode 1 x 4096 and paged prefill 4 x 4096 (32/8 heads), and of decode plan() at
    1 and 256 x 4096."""
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cache = torch.randn(POOL_PAGES, 2, PAGE, 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    report = io.StringIO()
    for label, batch, qo_len, kv_len in (("decode 1x4096", 1, 1, 4096), ("paged prefill 4x4096", 4, 4096, 4096)):
        indptr, indices, last = paged_table(batch, kv_len)
        q = torch.randn(batch * qo_len, 32, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        if qo_len == 1:
            w = lib.BatchDecodeWithPagedKVCacheWrapper(ws)
            w.plan(indptr, indices, last, 32, 8, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)
        else:
            w = lib.BatchPrefillWithPagedKVCacheWrapper(ws)
            w.plan(torch.arange(batch + 1, dtype=torch.int32) * qo_len, indptr, indices, last, 32, 8, HEAD_DIM,
                   PAGE, causal=True, q_data_type=torch.bfloat16)
        for _ in range(3):
            w.run(q, cache, out=out)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            w.run(q, cache, out=out)
        prof.disable()
        torch.cuda.synchronize()
        report.write(f"\n### cProfile, {label}, 200 run() calls\n\n```\n")
        pstats.Stats(prof, stream=report).sort_stats("tottime").print_stats(22)
        report.write("```\n")
    for batch in (1, 256):
        indptr, indices, last = paged_table(batch, 4096)
        w = lib.BatchDecodeWithPagedKVCacheWrapper(ws)
        for _ in range(3):
            w.plan(indptr, indices, last, 32, 8, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            w.plan(indptr, indices, last, 32, 8, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)
        prof.disable()
        report.write(f"\n### cProfile, decode plan() {batch} x 4096, 200 calls\n\n```\n")
        pstats.Stats(prof, stream=report).sort_stats("tottime").print_stats(25)
        report.write("```\n")
    return report.getvalue()


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def table(rows):
    keys = list(dict.fromkeys(k for r in rows for k in r))
    body = [[r.get(k, "") if k == "row" else (f"{r[k]:.1f}" if k in r else "") for k in keys] for r in rows]
    if tabulate is not None:
        return tabulate(body, headers=keys, tablefmt="github")
    return "\n".join(["| " + " | ".join(keys) + " |"] + ["| " + " | ".join(map(str, b)) + " |" for b in body])


def summary(rows, ours, peers):
    lines = []
    for kind in ("run", "plan", "step", "plan+run"):
        for prefix in ("decode", "prefill"):
            sel = [r for r in rows if r["row"].startswith(prefix)]
            for name in ours:
                mine = [r[f"{name} {kind}"] for r in sel if f"{name} {kind}" in r]
                if not mine:
                    continue
                text = f"- {prefix} {kind}: {name} median {statistics.median(mine):.1f} max {max(mine):.1f} µs"
                for p in peers:
                    theirs = [r[f"{p} {kind}"] for r in sel if f"{p} {kind}" in r]
                    if theirs:
                        worse = sum(1 for r in sel if f"{p} {kind}" in r and r[f"{name} {kind}"] > r[f"{p} {kind}"])
                        text += (f"; {p} median {statistics.median(theirs):.1f} max {max(theirs):.1f}"
                                 f" (ours slower on {worse}/{len(theirs)} rows)")
                lines.append(text)
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", action="append", default=[])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="a few rows")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args(argv)
    try:
        import flashinfer as fi
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        print("flashinfer not importable:", exc, file=sys.stderr)
        fi = None
    libs = [("ours", tritoninfer)] + [load_old(s) for s in args.old]
    ours = [n for n, _ in libs]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    batches = (1, 16) if args.quick else (1, 16, 64, 256)
    kv_lens = (4096,) if args.quick else (1024, 4096, 16384, 32768)
    heads = ((32, 8),) if args.quick else ((32, 8), (32, 32))
    for hq, hk in heads:
        cache = torch.randn(POOL_PAGES, 2, PAGE, hk, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for batch in batches:
            for kv_len in kv_lens:
                rows.append(decode_row(decode_providers(libs, fi), hq, hk, batch, kv_len, cache, ws))
                print(rows[-1], flush=True)
    if not args.skip_prefill:
        prefill_providers = [(n, lib, {}) for n, lib in libs] + ([("fi", fi, {})] if fi is not None else [])
        pairs = ((4, 4096),) if args.quick else ((16, 1024), (4, 4096), (1, 16384))
        for form, hq, hk in (("paged", 32, 8), ("paged", 32, 32), ("ragged", 32, 8)):
            cache = torch.randn(POOL_PAGES, 2, PAGE, hk, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            for batch, qo_len in pairs:
                for causal in (True, False):
                    rows.append(prefill_row(prefill_providers, hq, hk, batch, qo_len, causal, form, cache, ws))
                    print(rows[-1], flush=True)
    peers = ["fi-cc", "fi-tc", "fi"] if fi is not None else []
    text = (f"# Host path: plan() and run() host µs, {torch.cuda.get_device_name()}, host CPU "
            f"{cpu_name()} ({os.cpu_count()} cores), Python {platform.python_version()}\n\n"
            f"{summary(rows, ours, peers)}\n\n{table(rows)}\n")
    if args.profile:
        text += profile_runs(tritoninfer)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
