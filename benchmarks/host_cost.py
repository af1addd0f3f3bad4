"""Host cost per call of decode ``plan()`` and ``run()`` (issue "Decode, part 2", target 4), with and
without tritoninfer's launch cache (``tritoninfer/_launch.py``), and of two small elementwise calls,
against FlashInfer in the same process.

"run" is host wall time per call over 1000 back-to-back calls (no sync inside the loop,
``host_overhead.per_call``); "eager" is device time per call of the same loop between CUDA events,
i.e. the larger of host and device time. "-jit" rows launch through Triton's ordinary
``kernel[grid](...)`` path; "-cached" rows through ``CachedLauncher`` with every argument keyed
and passed as a tensor (session 3), not through the plan's bound launch (``BoundLaunch``).

    PYTHONPATH=. python benchmarks/host_cost.py
"""
import contextlib
import sys

import torch

sys.path.insert(0, "benchmarks")
import tritoninfer  # noqa: E402
from decode_sweep import gpu_paged_kv  # noqa: E402
from host_overhead import per_call  # noqa: E402
from tritoninfer._launch import BoundLaunch, CachedLauncher  # noqa: E402

try:
    import flashinfer
except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
    print("flashinfer not importable:", exc)
    flashinfer = None


@contextlib.contextmanager
def triton_launch_path():
    """Every launch goes through Triton's ``kernel[grid](...)`` inside the block."""
    cached, bound = CachedLauncher._launch, BoundLaunch.__call__
    CachedLauncher._launch = lambda self, grid, args, kwargs: self.kernel[grid](*args, **kwargs)
    BoundLaunch.__call__ = lambda self, *head: self.launcher.kernel[self.grid](*head, *self.tail, **self.kwargs)
    try:
        yield
    finally:
        CachedLauncher._launch, BoundLaunch.__call__ = cached, bound


@contextlib.contextmanager
def unbound_launch_path():
    """Bound launches go through ``CachedLauncher`` with all their arguments inside the block."""
    bound = BoundLaunch.__call__
    BoundLaunch.__call__ = lambda self, *head: self.launcher._launch(self.grid, head + self.tail, self.kwargs)
    try:
        yield
    finally:
        BoundLaunch.__call__ = bound


def eager_device(fn, n=200):
    """Device µs per call of ``n`` back-to-back calls from Python (host-bound when the host is slower)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def decode_rows():
    print("== host cost, decode 32/8 hd128 page 16 bf16", flush=True)
    libs = (("ours", tritoninfer, {}), ("fi-tc", flashinfer, {"use_tensor_cores": True}), ("fi-cc", flashinfer, {}))
    for batch, kv_len in ((1, 4096), (16, 1024), (256, 1024)):
        kv = gpu_paged_kv(batch, kv_len, 8, 128, 16, torch.bfloat16, "NHD")
        q = torch.randn(batch, 32, 128, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(q)
        indptr, last = kv.kv_indptr.cpu(), kv.kv_last_page_len.cpu()
        res = {}
        for name, lib, kw in libs:
            if lib is None:
                continue
            w = lib.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), **kw)

            def plan():
                w.plan(indptr, kv.kv_indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16)

            def run():
                w.run(q, kv.cache, out=out)

            plan()
            if lib is tritoninfer:
                with triton_launch_path():
                    res["ours-jit run"], res["ours-jit eager"] = per_call(run, 1000), eager_device(run)
                with unbound_launch_path():
                    res["ours-cached run"], res["ours-cached eager"] = per_call(run, 1000), eager_device(run)
            res[f"{name} plan"] = per_call(plan, 300)
            res[f"{name} run"], res[f"{name} eager"] = per_call(run, 1000), eager_device(run)
        print(f"batch {batch} kv {kv_len}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


def elementwise_rows():
    print("== host cost, rope/rmsnorm small", flush=True)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(64, device="cuda", dtype=torch.int32)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    calls = (("rope_pos_ids", lambda lib: lib.apply_rope_pos_ids_inplace(q, k, pos)),
             ("rmsnorm", lambda lib: lib.rmsnorm(x, w)))
    for name, call in calls:
        res = {"ours": per_call(lambda: call(tritoninfer), 1000)}
        with triton_launch_path():
            res["ours-jit"] = per_call(lambda: call(tritoninfer), 1000)
        if flashinfer is not None:
            res["fi"] = per_call(lambda: call(flashinfer), 1000)
        print(name, ", ".join(f"{a} {b:.1f} us" for a, b in res.items()), flush=True)


if __name__ == "__main__":
    decode_rows()
    elementwise_rows()
