"""First-use cost of a decode kernel variant (issue "Decode, part 2", target 5): wall time of the first
run() in a fresh process (Triton compiles the variant, or loads it from its cache), then of a second
variant (fp8 KV), then of a steady-state call.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python benchmarks/compile_time.py   # cold: compiles
    PYTHONPATH=. python benchmarks/compile_time.py                                  # warm: cache hits
"""

import time

import torch

import tritoninfer


def first_call(kv_dtype):
    batch, kv_len, hq, hk, d, page = 4, 1024, 32, 8, 128, 16
    pages = batch * kv_len // page
    cache = torch.randn(pages, 2, page, hk, d, device="cuda").to(kv_dtype)
    indptr = torch.arange(0, pages + 1, kv_len // page, dtype=torch.int32)
    indices = torch.arange(pages, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), page, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    torch.cuda.synchronize()
    t = time.perf_counter()
    w.run(q, cache, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    t = time.perf_counter()
    w.run(q, cache, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()
    return first, time.perf_counter() - t


if __name__ == "__main__":
    torch.cuda.init()
    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        first, again = first_call(dt)
        print(f"{str(dt)[6:]}: first run() {first:.2f} s, second {again * 1e3:.2f} ms", flush=True)
