"""Kernel-by-kernel device time of decode (``torch.profiler``), tritoninfer against FlashInfer's two
decode paths on the same inputs: what a small-batch step or a 32/32 fp8 step spends its time on
(issue "Decode, part 2"). With ``--once`` it runs one provider on one shape three times: a target
for Nsight Compute.

    PYTHONPATH=. python benchmarks/decode_profile.py
    ncu --clock-control none -k regex:"attention_fwd|BatchDecode" --launch-skip 2 --launch-count 1 \
        python benchmarks/decode_profile.py --once fi-cc --shape 32/32/64/4096 --kv-dtype float8_e4m3fn
"""
import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
import tritoninfer  # noqa: E402
from tritoninfer.bench.timing import kernel_times  # noqa: E402
from decode_sweep import gpu_paged_kv  # noqa: E402

try:
    import flashinfer
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None

PROVIDERS = {"ours": (tritoninfer, {}), "fi-tc": (flashinfer, {"use_tensor_cores": True}), "fi-cc": (flashinfer, {})}
SHAPES = (("32/8/1/4096", "bfloat16"), ("32/8/1/32768", "bfloat16"), ("32/32/16/4096", "float8_e4m3fn"),
          ("32/32/64/4096", "float8_e4m3fn"))


def setup(provider, shape, kv_dtype_name):
    hq, hk, batch, kv_len = map(int, shape.split("/"))
    kv_dtype = getattr(torch, kv_dtype_name)
    torch.manual_seed(0)
    kv = gpu_paged_kv(batch, kv_len, hk, 128, 16, kv_dtype, "NHD")
    q = torch.randn((batch, hq, 128), device="cuda").to(torch.bfloat16)
    lib, kw = PROVIDERS[provider]
    w = lib.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), **kw)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, 128, 16,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    scale = {} if kv_dtype == torch.bfloat16 else {"k_scale": 1.0, "v_scale": 1.0}
    return lambda: w.run(q, kv.cache, **scale)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", choices=sorted(PROVIDERS))
    ap.add_argument("--shape", default="32/32/64/4096", help="HQ/HK/BATCH/KV_LEN (with --once)")
    ap.add_argument("--kv-dtype", default="float8_e4m3fn")
    args = ap.parse_args(argv)
    if args.once:
        run = setup(args.once, args.shape, args.kv_dtype)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        return
    for shape, dtype in SHAPES:
        for name in PROVIDERS:
            if PROVIDERS[name][0] is None:
                continue
            print(f"{shape} {dtype} {name}: {kernel_times(setup(name, shape, dtype))}", flush=True)


if __name__ == "__main__":
    main()
