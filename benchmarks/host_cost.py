"""Host cost per call of decode ``plan()`` and ``run()`` (issue "Decode, part 2", target 4), with and
without tritoninfer's launch cache (``tritoninfer/_launch.py``), and of two small elementwise calls,
against FlashInfer in the same process.

"run" is host wall time per call over 1000 back-to-back calls (no sync inside the loop); "eager" is
device time per call of the same loop between CUDA events, i.e. the larger of host and device time.
"-jit" rows launch through Triton's ordinary ``kernel[grid](...)`` path.

    PYTHONPATH=. python benchmarks/host_cost.py
"""
import sys, time
import torch, triton
sys.path.insert(0, "benchmarks")
import tritoninfer
from tritoninfer._launch import CachedLauncher
try:
    import flashinfer
except Exception as e:
    print("no flashinfer", e); flashinfer = None
from decode_sweep import gpu_paged_kv
dev = "cuda"

def per_call(fn, n=1000):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    h = (time.perf_counter() - t) / n * 1e6; torch.cuda.synchronize(); return h

def eager_device(fn, n=200):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1e3

print("== host cost, decode 32/8 hd128 page 16 bf16", flush=True)
fast = CachedLauncher._launch
slow = lambda self, grid, args, kwargs: self.kernel[grid](*args, **kwargs)
for batch, kvl in ((1, 4096), (16, 1024), (256, 1024)):
    kv = gpu_paged_kv(batch, kvl, 8, 128, 16, torch.bfloat16, "NHD")
    q = torch.randn(batch, 32, 128, device=dev).to(torch.bfloat16); out = torch.empty_like(q)
    ind_h, last_h = kv.kv_indptr.cpu(), kv.kv_last_page_len.cpu()
    res = {}
    for name, mod, kw in (("ours", tritoninfer, {}), ("fi-tc", flashinfer, {"use_tensor_cores": True}), ("fi-cc", flashinfer, {})):
        if mod is None: continue
        w = mod.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), **kw)
        plan = lambda: w.plan(ind_h, kv.kv_indices, last_h, 32, 8, 128, 16, q_data_type=torch.bfloat16)
        plan()
        run = lambda: w.run(q, kv.cache, out=out)
        if name == "ours":
            CachedLauncher._launch = slow
            res["ours-jit run"] = per_call(run); res["ours-jit eager"] = eager_device(run)
            CachedLauncher._launch = fast
        res[f"{name} plan"] = per_call(plan, 300); res[f"{name} run"] = per_call(run); res[f"{name} eager"] = eager_device(run)
    print(f"batch {batch} kv {kvl}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)

print("== host cost, rope/rmsnorm small", flush=True)
q = torch.randn(64, 32, 128, device=dev, dtype=torch.bfloat16); k = torch.randn(64, 8, 128, device=dev, dtype=torch.bfloat16)
pos = torch.arange(64, device=dev, dtype=torch.int32)
x = torch.randn(128, 4096, device=dev, dtype=torch.bfloat16); wn = torch.randn(4096, device=dev, dtype=torch.bfloat16)
for name, f in (("rope_pos_ids", lambda m: m.apply_rope_pos_ids_inplace(q, k, pos)), ("rmsnorm", lambda m: m.rmsnorm(x, wn))):
    r = {"ours": per_call(lambda: f(tritoninfer))}
    CachedLauncher._launch = slow; r["ours-jit"] = per_call(lambda: f(tritoninfer)); CachedLauncher._launch = fast
    if flashinfer: r["fi"] = per_call(lambda: f(flashinfer))
    print(name, ", ".join(f"{a} {b:.1f} us" for a, b in r.items()), flush=True)
