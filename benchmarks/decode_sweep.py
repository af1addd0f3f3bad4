"""Quick decode sweep for kernel work (issue "Decode, part 2"): tritoninfer against FlashInfer's two
decode paths, same process, same inputs, CUDA-graph replays.

    PYTHONPATH=. python benchmarks/decode_sweep.py --out results.md [--shapes small]

Time = median over replays of a graph holding ``CALLS`` back-to-back run() calls, divided by
``CALLS``. Bytes = live KV pages + q + o (TB = 1e12). Several caches are rotated inside the graph
so that a call never finds its KV in L2 (60 MB on the H200).
"""

import argparse
import statistics
import sys
import time

import torch

import tritoninfer
from tritoninfer import testing

CALLS = 10


def graph_time(fn, replays=30):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def eager_time(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


class _KV:
    pass


def gpu_paged_kv(batch, kv_len, hk, d, page, kv_dtype, layout):
    """Random cache made on the GPU (host-side generation of GBs is too slow), random page order."""
    pages_per = -(-kv_len // page)
    num_pages = batch * pages_per
    shape = (num_pages, 2, page, hk, d) if layout == "NHD" else (num_pages, 2, hk, page, d)
    kv = _KV()
    kv.cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    kv.kv_indices = torch.randperm(num_pages, device="cuda").to(torch.int32)
    kv.kv_indptr = torch.arange(0, num_pages + 1, pages_per, dtype=torch.int32, device="cuda")
    kv.kv_last_page_len = torch.full((batch,), kv_len - (pages_per - 1) * page, dtype=torch.int32, device="cuda")
    return kv


def run_shape(batch, kv_len, hq, hk, d, page, kv_dtype, fi, layout="NHD"):
    torch.manual_seed(0)
    kv = gpu_paged_kv(batch, kv_len, hk, d, page, kv_dtype, layout)
    q = torch.randn((batch, hq, d), device="cuda").to(torch.bfloat16)
    nbytes = testing.decode_bytes([kv_len] * batch, page, hq, hk, d, torch.bfloat16, kv_dtype)
    ncopies = max(1, min(8, int(200e6 // max(nbytes, 1))))
    caches = [kv.cache] + [kv.cache.clone() for _ in range(ncopies - 1)]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    row = {"shape": f"{hq}/{hk} {batch}x{kv_len} {str(kv_dtype)[6:]} {layout}"}
    scale = {} if kv_dtype in (torch.bfloat16, torch.float16) else {"k_scale": 1.0, "v_scale": 1.0}

    def bench(name, wrapper, **run_kw):
        i = [0]

        def call():
            wrapper.run(q, caches[i[0] % ncopies], **run_kw)
            i[0] += 1

        try:
            t0 = time.perf_counter()
            wrapper.plan(kv.kv_indptr.cpu(), kv.kv_indices, kv.kv_last_page_len.cpu(), hq, hk, d, page,
                         q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            row[f"{name} plan us"] = (time.perf_counter() - t0) * 1e6
            us = graph_time(call)
            row[f"{name} us"] = us
            row[f"{name} TB/s"] = nbytes / us / 1e6
            row[f"{name} eager us"] = eager_time(call)
            return wrapper.run(q, kv.cache, **run_kw)
        except Exception as e:  # a peer refusing a shape is reported, not fatal
            row[f"{name} us"] = f"refused: {type(e).__name__}"
            return None

    ours = bench("triton", tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout), **scale)
    if fi is not None:
        for tc in (False, True):
            ref = bench(f"fi_tc{int(tc)}", fi.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), layout, use_tensor_cores=tc), **scale)
            if ref is not None and ours is not None:
                row[f"err_vs_fi_tc{int(tc)}"] = testing.rel_error(ours, ref)
    return row


SHAPES = {
    "small": [(1, 4096), (16, 4096), (64, 4096)],
    "full": [(1, 4096), (1, 32768), (16, 4096), (64, 4096), (256, 4096), (16, 32768), (64, 16384), (128, 1024)],
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="full", choices=sorted(SHAPES))
    ap.add_argument("--heads", default="32/8,32/32")
    ap.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--layout", default="NHD")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        import flashinfer as fi
    except Exception as e:  # noqa: BLE001
        print(f"flashinfer not importable ({e}); tritoninfer only", file=sys.stderr)
        fi = None
    rows = []
    for heads in args.heads.split(","):
        hq, hk = map(int, heads.split("/"))
        for kv_dtype in args.kv_dtypes.split(","):
            for batch, kv_len in SHAPES[args.shapes]:
                row = run_shape(batch, kv_len, hq, hk, 128, 16, getattr(torch, kv_dtype), fi, args.layout)
                rows.append(row)
                print(row, flush=True)
    cols = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}\n\n{text}\n")


if __name__ == "__main__":
    main()
