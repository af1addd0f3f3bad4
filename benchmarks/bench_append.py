"""Benchmark tritoninfer.page.append_paged_kv_cache (and FlashInfer's, when installed) on a GPU.

For each case: device time (median of ``triton.testing.do_bench``), bytes moved (appended K/V read
+ ``batch_indices``/``positions`` read + cache bytes written) and TB/s (10^12 bytes/s), against a
large ``torch`` copy's bandwidth measured in the same run (target: append >= 70 % of copy). If
``flashinfer`` is importable its ``append_paged_kv_cache`` runs on the same inputs: time, TB/s,
the ratio FlashInfer time / tritoninfer time (> 1: tritoninfer faster), and whether both wrote the
same cache bytes. FlashInfer has no fp8 conversion on append (it reads the K/V bytes as the cache
dtype), so rows that append bf16 K/V into an fp8 cache have no FlashInfer column. Prints a
markdown table and writes it to ``--out``.

    python benchmarks/bench_append.py --out benchmarks/results/append-h200.md
    python benchmarks/bench_append.py --smoke    # tiny shapes, CPU through the Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--layouts", default="NHD,HND", help="comma-separated: NHD,HND")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the reference torch copy (GiB)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter: checks the script, measures nothing")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402

import tritoninfer  # noqa: E402
from tritoninfer.page import append_paged_kv_cache, get_batch_indices_positions  # noqa: E402

try:  # optional peer
    import flashinfer  # noqa: E402
    import flashinfer.page  # noqa: E402
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None


def bench_ms(fn, device: str) -> float:
    """Median time of ``fn`` in ms: do_bench on the GPU; wall clock in smoke mode (meaningless)."""
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_tbs(device: str, gib: float) -> float:
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def make_inputs(num_reqs, append_len, max_prefix, page_size, heads, head_dim, layout, cache_dtype, src_dtype,
                device, seed=0):
    """A batch of ``num_reqs`` requests, each appending ``append_len`` tokens after a random prefix
    of ``[0, max_prefix]`` tokens; pages scattered at random over a cache with 5 % spare pages."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, max_prefix + 1, (num_reqs,), generator=g)
    seq_after = prefix + append_len
    pages = (seq_after + page_size - 1) // page_size
    total_pages = int(pages.sum())
    num_pages = total_pages + max(1, total_pages // 20)
    kv_indices = torch.randperm(num_pages, generator=g)[:total_pages].int()
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).int()
    last = (seq_after - (pages - 1) * page_size).int()
    append_indptr = torch.arange(num_reqs + 1, dtype=torch.int32) * append_len
    nnz = num_reqs * append_len
    page_dims = (page_size, heads) if layout == "NHD" else (heads, page_size)
    cache = torch.randn((num_pages, 2) + page_dims + (head_dim,), device=device).to(cache_dtype)
    k = torch.randn(nnz, heads, head_dim, device=device).to(src_dtype)
    v = torch.randn(nnz, heads, head_dim, device=device).to(src_dtype)
    kv_indices, kv_indptr, last = kv_indices.to(device), kv_indptr.to(device), last.to(device)
    bi, pos = get_batch_indices_positions(append_indptr.to(device), seq_after.int().to(device), nnz)
    return dict(append_key=k, append_value=v, batch_indices=bi, positions=pos, paged_kv_cache=cache,
                kv_indices=kv_indices, kv_indptr=kv_indptr, kv_last_page_len=last, kv_layout=layout)


def bytes_moved(inp) -> int:
    k, v, cache = inp["append_key"], inp["append_value"], inp["paged_kv_cache"]
    read = k.numel() * k.element_size() + v.numel() * v.element_size()
    read += inp["batch_indices"].numel() * inp["batch_indices"].element_size()
    read += inp["positions"].numel() * inp["positions"].element_size()
    written = (k.numel() + v.numel()) * cache.element_size()
    return read + written


def dtype_name(dt) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3",
            torch.float8_e5m2: "e5m2"}[dt]


def main(args) -> int:
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("bench_append: needs a CUDA GPU (or --smoke to check the script on CPU)", file=sys.stderr)
        return 1
    H, D, ps = args.heads, args.head_dim, args.page_size
    if args.smoke:
        shapes = [("4 req x 5 tok", 4, 5, 20), ("prefill 33 tok", 1, 33, 0)]
        H, D, ps = 2, 16, 3
        copy_gib = 1 / 1024
    else:
        shapes = [
            ("256 req x 256 tok", 256, 256, 2048),
            ("prefill 16K tok", 1, 16384, 0),
            ("64 req x 1 tok (decode)", 64, 1, 4096),
        ]
        copy_gib = args.copy_gib
    dtypes = [  # (cache dtype, appended K/V dtype)
        (torch.bfloat16, torch.bfloat16),
        (torch.float8_e4m3fn, torch.bfloat16),  # converted in the kernel
        (torch.float8_e4m3fn, torch.float8_e4m3fn),  # pre-quantised: a byte copy
    ]
    copy_tbs = copy_bandwidth_tbs(device, copy_gib)

    header = ["case", "layout", "cache", "K/V in", "tokens", "MB moved", "tritoninfer us", "TB/s",
              "% of copy"]
    if flashinfer is not None:
        header += ["flashinfer us", "FI TB/s", "FI/ti time", "same bytes"]
    rows = []
    for name, num_reqs, append_len, max_prefix in shapes:
        for layout in args.layouts.split(","):
            for cache_dtype, src_dtype in dtypes:
                inp = make_inputs(num_reqs, append_len, max_prefix, ps, H, D, layout, cache_dtype, src_dtype, device)
                nbytes = bytes_moved(inp)
                cache0 = inp["paged_kv_cache"].clone() if flashinfer is not None else None
                ms = bench_ms(lambda: append_paged_kv_cache(**inp), device)
                tbs = nbytes / (ms * 1e-3) / 1e12
                row = [name, layout, dtype_name(cache_dtype), dtype_name(src_dtype), str(inp["append_key"].shape[0]),
                       f"{nbytes / 1e6:.1f}", f"{ms * 1e3:.1f}", f"{tbs:.2f}", f"{100 * tbs / copy_tbs:.0f} %"]
                if flashinfer is not None and src_dtype != cache_dtype:
                    # FlashInfer reinterprets the K/V bytes as the cache dtype (no conversion): no peer
                    row += ["n/a", "-", "-", "-"]
                elif flashinfer is not None:
                    fi_inp = dict(inp, paged_kv_cache=cache0)
                    try:
                        fi_ms = bench_ms(lambda: flashinfer.page.append_paged_kv_cache(**fi_inp), device)
                        same = torch.equal(fi_inp["paged_kv_cache"].view(torch.uint8),
                                           inp["paged_kv_cache"].view(torch.uint8))
                        row += [f"{fi_ms * 1e3:.1f}", f"{nbytes / (fi_ms * 1e-3) / 1e12:.2f}", f"{fi_ms / ms:.2f}",
                                "yes" if same else "NO"]
                    except Exception as e:  # noqa: BLE001 - report, don't crash
                        row += [f"error: {type(e).__name__}", "-", "-", "-"]
                rows.append(row)
                del inp, cache0
                if device == "cuda":
                    torch.cuda.empty_cache()

    lines = [
        "# append_paged_kv_cache" + (" (SMOKE RUN on CPU: not a measurement)" if args.smoke else ""),
        "",
        f"- device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (Triton interpreter)'}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- versions: tritoninfer {tritoninfer.__version__}, torch {torch.__version__}, triton {triton.__version__}, "
        f"flashinfer {getattr(flashinfer, '__version__', '?') if flashinfer is not None else 'not installed'}, "
        f"python {platform.python_version()}",
        f"- shapes: {H} KV heads x head_dim {D}, page size {ps}, pages scattered at random",
        f"- time: median of triton.testing.do_bench; bytes = K/V read + batch_indices/positions read + cache "
        f"written; TB = 1e12 bytes",
        f"- reference: torch bf16 copy of {copy_gib:g} GiB: {copy_tbs:.2f} TB/s (read + write); target >= 70 %",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ] + ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
