"""Host time of plan() and run() for decode (issue "Decode, part 2", target 4): wall time per call
over many calls, and a cProfile breakdown of run().

    PYTHONPATH=. python benchmarks/host_overhead.py
"""

import cProfile
import pstats
import sys
import time

import torch

import tritoninfer

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv  # noqa: E402


def per_call(fn, n=500):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return host * 1e6


def main():
    try:
        import flashinfer
    except Exception:  # noqa: BLE001
        flashinfer = None
    for batch in (1, 256):
        kv = gpu_paged_kv(batch, 1024, 8, 128, 16, torch.bfloat16, "NHD")
        q = torch.randn((batch, 32, 128), device="cuda").to(torch.bfloat16)
        indptr, last = kv.kv_indptr.cpu(), kv.kv_last_page_len.cpu()
        for name, mod in (("tritoninfer", tritoninfer), ("flashinfer", flashinfer)):
            if mod is None:
                continue
            w = mod.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"),
                                                      use_tensor_cores=True)

            def plan():
                w.plan(indptr, kv.kv_indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)

            plan()
            out = torch.empty_like(q)
            print(f"{name} batch {batch}: plan {per_call(plan, 200):.1f} us/call, "
                  f"run {per_call(lambda: w.run(q, kv.cache, out=out)):.1f} us/call (host)", flush=True)
    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    kv = gpu_paged_kv(16, 1024, 8, 128, 16, torch.bfloat16, "NHD")
    q = torch.randn((16, 32, 128), device="cuda").to(torch.bfloat16)
    w.plan(kv.kv_indptr.cpu(), kv.kv_indices, kv.kv_last_page_len.cpu(), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        w.run(q, kv.cache, out=out)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        w.plan(kv.kv_indptr.cpu(), kv.kv_indices, kv.kv_last_page_len.cpu(), 32, 8, 128, 16, q_data_type=torch.bfloat16)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
