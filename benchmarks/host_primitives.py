"""Host cost of the primitives a ``plan()`` or ``run()`` is made of, on the machine it runs on: what
the host path can hope for (issue "The host path"). Median µs per call over back-to-back calls.

    PYTHONPATH=. python benchmarks/host_primitives.py
"""

import statistics
import sys
import time

import numpy as np
import torch
import triton
import triton.language as tl

import tritoninfer
from tritoninfer import _launch


@triton.jit
def _tiny_kernel(x_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) * scale, mask=offs < n)


def per_call(fn, n=2000):
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main():
    rows = {}
    dev = torch.device("cuda")
    rows["python: sum(range(100))"] = per_call(lambda: sum(range(100)))
    rows["torch.cuda.current_stream()"] = per_call(lambda: torch.cuda.current_stream())
    rows["torch._C._cuda_getCurrentRawStream(0)"] = per_call(lambda: torch._C._cuda_getCurrentRawStream(0))
    rows["torch._C._cuda_getDevice()"] = per_call(lambda: torch._C._cuda_getDevice())
    rows["torch.cuda.Event()"] = per_call(lambda: torch.cuda.Event())
    ev = torch.cuda.Event()
    rows["event.record()"] = per_call(lambda: ev.record())
    stream = torch.cuda.current_stream()
    rows["event.record(stream)"] = per_call(lambda: ev.record(stream))
    ev.synchronize()
    rows["event.synchronize() (done)"] = per_call(lambda: ev.synchronize())
    rows["event.query() (done)"] = per_call(lambda: ev.query())
    rows["torch.empty(4096, int32, cuda)"] = per_call(lambda: torch.empty(4096, dtype=torch.int32, device=dev))
    pinned = torch.empty(4096, dtype=torch.int32, pin_memory=True)
    target = torch.empty(4096, dtype=torch.int32, device=dev)
    rows["copy_ 16 KB pinned->dev non_blocking"] = per_call(lambda: target.copy_(pinned, non_blocking=True), 500)
    pageable = torch.empty(4096, dtype=torch.int32)
    rows["copy_ 16 KB pageable->dev non_blocking"] = per_call(lambda: target.copy_(pageable, non_blocking=True), 500)
    arr = np.arange(4096, dtype=np.int32)
    host_np = pinned.numpy()
    rows["numpy copy into pinned view (16 KB)"] = per_call(lambda: host_np.__setitem__(slice(0, 4096), arr))
    x = torch.randn(1 << 12, device=dev)
    bound = _launch.BoundLaunch(_launch.CachedLauncher(_tiny_kernel), (4,), (), dict(BLOCK=1024))
    for _ in range(3):
        bound(x, 4096, 1.0)
    rows["BoundLaunch(x, n, scale): tiny kernel"] = per_call(lambda: bound(x, 4096, 1.0))
    fast = next(v for v in bound._driver.values() if v is not None)
    ptr = [x.data_ptr()]
    rows["DriverLaunch only (pack + cuLaunchKernel)"] = per_call(lambda: fast(ptr, (4096,), (1.0,), ()))
    compiled, constexprs = next(iter(bound._compiled.values()))
    run = compiled.run
    raw = torch._C._cuda_getCurrentRawStream(0)
    xp = x.data_ptr()
    rows["Triton compiled.run (3 args)"] = per_call(
        lambda: run(4, 1, 1, raw, compiled.function, compiled.packed_metadata, None, None, None, xp, 4096, 1.0, 1024))
    rows["kernel[grid](...) (Triton JIT path)"] = per_call(lambda: _tiny_kernel[(4,)](x, 4096, 1.0, BLOCK=1024))
    rows["torch x.mul_(1.0)"] = per_call(lambda: x.mul_(1.0))
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    decode_breakdown()


def decode_breakdown():
    """run() of decode 32/8 1 x 4096 whole, with its launches skipped, and its launches alone."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    cache = torch.randn(300, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    indptr = torch.tensor([0, 256], dtype=torch.int32)
    indices = torch.arange(256, dtype=torch.int32, device="cuda")
    last = torch.tensor([16], dtype=torch.int32)
    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    whole = per_call(lambda: w.run(q, cache, out=out), 1000)
    calls = []
    original = _launch.BoundLaunch.__call__
    _launch.BoundLaunch.__call__ = lambda self, *head: calls.append(1)
    try:
        python_only = per_call(lambda: w.run(q, cache, out=out), 1000)
    finally:
        _launch.BoundLaunch.__call__ = original
    print(f"| decode 1x4096 run() | {whole:.2f} |")
    print(f"| decode 1x4096 run() without its {len(calls) // 1001} launches | {python_only:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
