"""Runs one decode shape with one tile config a few times, eagerly: a target for Nsight Compute.

    ncu --clock-control none -k regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/decode_once.py --config std-128-4-3-p --kv-dtype float8_e4m3fn
"""

import argparse
import dataclasses
import sys

import torch

import tritoninfer
from tritoninfer import _plan, decode

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv  # noqa: E402
from decode_tune import parse_config  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--shape", default="32/8/64/4096", help="HQ/HK/BATCH/KV_LEN")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    kv_as_m, block_n, warps, stages, prefetch, slots, lanes = parse_config(args.config)
    hq, hk, batch, kv_len = map(int, args.shape.split("/"))
    original = _plan.decode_tiles
    decode._decode_tiles.cache_clear()
    decode._plan.decode_tiles = lambda *a: dataclasses.replace(
        original(*a), kv_as_m=kv_as_m, block_n=block_n, num_warps=warps, num_stages=stages, prefetch_pages=prefetch,
        programs_per_sm=slots or original(*a).programs_per_sm, lanes=lanes)
    kv_dtype = getattr(torch, args.kv_dtype)
    kv = gpu_paged_kv(batch, kv_len, hk, 128, 16, kv_dtype, "NHD")
    q = torch.randn((batch, hq, 128), device="cuda").to(torch.bfloat16)
    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, 128, 16,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    for _ in range(args.calls):
        w.run(q, kv.cache, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
