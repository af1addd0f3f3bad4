"""Tile/split sweep for the decode kernel (issue "Decode, part 2"): which (BLOCK_N, warps, stages,
programs per SM) is fastest per shape and KV dtype. Patches the planner's choices at run time;
results go to benchmarks/NOTES.md by hand.

    PYTHONPATH=. python benchmarks/decode_tune.py --out tune.md
"""

import argparse
import itertools
import sys

import torch

import tritoninfer
from tritoninfer import _attention, _plan, decode

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv, graph_time  # noqa: E402

SHAPES = [(32, 8, 1, 4096), (32, 8, 16, 4096), (32, 8, 64, 4096), (32, 8, 256, 4096), (32, 32, 64, 4096)]
CONFIGS = list(itertools.product([64, 128, 256], [4, 8], [2, 3], [True, False], [True, False]))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    args = ap.parse_args(argv)
    original = _plan.decode_tiles
    lines = ["| heads | batch x kv | kv dtype | BLOCK_N | warps | stages | prefetch | fp16 dot | us | TB/s |", "|" + "---|" * 10]
    best = {}
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = getattr(torch, kv_name)
        for hq, hk, batch, kv_len in SHAPES:
            torch.manual_seed(0)
            kv = gpu_paged_kv(batch, kv_len, hk, 128, 16, kv_dtype, "NHD")
            copies = [kv.cache] + [kv.cache.clone() for _ in range(max(0, min(7, int(3e8 // kv.cache.nbytes))))]
            q = torch.randn((batch, hq, 128), device="cuda").to(torch.bfloat16)
            nbytes = sum(c.nbytes for c in [kv.cache]) + 2 * q.nbytes
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            for block_n, warps, stages, prefetch, fp16dot in CONFIGS:
                if (block_n == 256 and warps == 4) or (fp16dot and kv_dtype == torch.bfloat16):
                    continue

                def tiles(group, L, d, eb=2, _bn=block_n, _w=warps, _s=stages, _p=prefetch):
                    t = original(group, L, d, eb)
                    return _plan.Tiles(t.block_m, _bn, _w, _s, t.tile_tokens, t.row_tiles, _p)

                decode._decode_tiles.cache_clear()
                decode._plan.decode_tiles = tiles
                _attention.FP8_DOT_FP16 = fp16dot
                w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws)
                w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, 128, 16,
                       q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                i = [0]

                def call():
                    w.run(q, copies[i[0] % len(copies)], k_scale=1.0, v_scale=1.0)
                    i[0] += 1

                try:
                    us = graph_time(call, replays=15)
                except Exception as e:  # noqa: BLE001 (a config that does not compile is skipped)
                    print("skip", block_n, warps, stages, type(e).__name__, str(e)[:200], flush=True)
                    continue
                tbs = nbytes / us / 1e6
                key = (hq, hk, batch, kv_len, kv_name)
                if key not in best or us < best[key][0]:
                    best[key] = (us, block_n, warps, stages, prefetch, fp16dot)
                lines.append(f"| {hq}/{hk} | {batch}x{kv_len} | {kv_name} | {block_n} | {warps} | {stages} | {prefetch} | {fp16dot} | {us:.1f} | {tbs:.2f} |")
                print(lines[-1], flush=True)
    decode._plan.decode_tiles = original
    lines += ["", "best:", ""] + [f"- {k}: {v[0]:.1f} us with BLOCK_N {v[1]}, warps {v[2]}, stages {v[3]}, prefetch {v[4]}, fp16 dot {v[5]}"
                                   for k, v in best.items()]
    text = "\n".join(lines)
    print("\n".join(lines[-len(best) - 1:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
