"""Runs one decode shape with one tile config a few times, eagerly: a target for Nsight Compute.

    ncu --clock-control none -k regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/decode_once.py --config std-128-4-3-p --kv-dtype float8_e4m3fn

``--config auto`` (the default) runs the planner's own tiles.
"""

import argparse
import dataclasses
import sys

import torch

import tritoninfer
from tritoninfer import _plan, decode

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv  # noqa: E402
import decode_tune  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="auto", help="ORIENT-BLOCK_N-WARPS-STAGES[-p][-sSLOTS] or auto")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--shape", default="32/8/64/4096", help="HQ/HK/BATCH/KV_LEN[/HEAD_DIM[/PAGE]] (128 and 16 where "
                    "left out)")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    shape = tuple(map(int, args.shape.split("/")))
    hq, hk, batch, kv_len, head_dim, page = shape + (128, 16)[len(shape) - 4:]
    decode_tune.clear_tile_caches()
    if args.config != "auto":
        kv_as_m, block_n, warps, stages, prefetch, slots, lanes = decode_tune.parse_config(args.config)
        original = _plan.decode_tiles
        decode._plan.decode_tiles = lambda *a: dataclasses.replace(
            original(*a), kv_as_m=kv_as_m, block_n=block_n, num_warps=warps, num_stages=stages,
            prefetch_pages=prefetch, programs_per_sm=slots or original(*a).programs_per_sm, lanes=lanes)
    kv_dtype = getattr(torch, args.kv_dtype)
    kv = gpu_paged_kv(batch, kv_len, hk, head_dim, page, kv_dtype, "NHD")
    q = torch.randn((batch, hq, head_dim), device="cuda").to(torch.bfloat16)
    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, head_dim, page,
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    for _ in range(args.calls):
        w.run(q, kv.cache, k_scale=1.0, v_scale=1.0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
