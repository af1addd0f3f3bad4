"""Tile sweep for the decode kernel (issue "Decode, part 2"): which compile-time tile is fastest per
shape and KV dtype. Patches the planner's tile choice at run time; results go to
benchmarks/NOTES.md by hand.

    PYTHONPATH=. python benchmarks/decode_tune.py --configs std-128-4-2,kvm-128-4-3-p --out tune.md

A config is ``ORIENT-BLOCK_N-WARPS-STAGES[-p][-sSLOTS]``: ORIENT ``std`` puts the query rows in the M
of the dots (mma.sync, M padded to 16), ``kvm`` puts the KV positions there (wgmma), ``cc`` is the
dot-free single-row path (group 1 only; 4 lanes per warp); ``-p`` loads page
ids one tile ahead; ``-sN`` tells the split planner N programs fit on an SM. ``--programs-per-sm`` changes the resident slots the split planner assumes.
``auto`` is the planner's own choice for the shape (the baseline of a sweep).
"""

import argparse
import dataclasses
import sys

import torch

import tritoninfer
from tritoninfer import _plan, decode

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv, graph_time  # noqa: E402

SHAPES = [(32, 8, 1, 4096), (32, 8, 16, 4096), (32, 8, 64, 4096), (32, 8, 256, 4096), (32, 32, 64, 4096)]


def parse_config(text):
    """``ORIENT-BLOCK_N-WARPS-STAGES[-p][-sSLOTS]`` -> (kv_as_m, block_n, warps, stages, prefetch, slots, lanes)."""
    parts = text.split("-")
    orient, block_n, warps, stages = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    if orient not in ("std", "kvm", "cc"):
        raise ValueError(f"config {text!r}: orientation must be std, kvm or cc")
    slots = [int(p[1:]) for p in parts[4:] if p.startswith("s")]
    return (orient == "kvm", block_n, warps, stages, "p" in parts[4:], slots[0] if slots else 0,
            4 * warps if orient == "cc" else 0)


def clear_tile_caches():
    """The decode module's remembered tile choices: per tile arguments, and per plan configuration (a plan with
    the same arguments would otherwise keep the first config's tiles: sessions 22-24's sweeps did)."""
    decode._decode_tiles.cache_clear()
    decode._decode_config.cache_clear()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="comma-separated ORIENT-BLOCK_N-WARPS-STAGES[-p]")
    ap.add_argument("--kv-dtypes", default="bfloat16,float8_e4m3fn")
    ap.add_argument("--shapes", default=None, help="comma-separated HQ/HK/BATCH/KV_LEN[/HEAD_DIM[/PAGE]] (head_dim 128 "
                    "and page 16 where left out; default: a fixed set)")
    ap.add_argument("--programs-per-sm", default="0", help="comma-separated resident programs per SM for the "
                    "split planner (0: the planner's own)")
    ap.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = [None if c == "auto" else parse_config(c) for c in args.configs.split(",")]
    shapes = [tuple(s) + (128, 16)[len(s) - 4:] for s in
              (SHAPES if args.shapes is None else [tuple(map(int, s.split("/"))) for s in args.shapes.split(",")])]
    original = _plan.decode_tiles
    lines = ["| heads | head_dim | page | batch x kv | kv dtype | config | programs/SM | us | TB/s |", "|" + "---|" * 9]
    best = {}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for kv_name in args.kv_dtypes.split(","):
        kv_dtype = getattr(torch, kv_name)
        for hq, hk, batch, kv_len, d, page in shapes:
            torch.manual_seed(0)
            kv = gpu_paged_kv(batch, kv_len, hk, d, page, kv_dtype, args.layout)
            copies = [kv.cache] + [kv.cache.clone() for _ in range(max(0, min(7, int(3e8 // kv.cache.nbytes))))]
            q = torch.randn((batch, hq, d), device="cuda").to(torch.bfloat16)
            nbytes = kv.cache.nbytes + 2 * q.nbytes
            reference_out = None
            for config, name in zip(configs, args.configs.split(",")):
                kv_as_m, block_n, warps, stages, prefetch, slots, lanes = config or (None, 0, 0, 0, None, 0, 0)
                if lanes and hq != hk:
                    continue
                for pps in ([slots] if slots else [0] if config is None else map(int, args.programs_per_sm.split(","))):
                    def tiles(*a, _c=(kv_as_m, block_n, warps, stages, prefetch, lanes), _pps=pps):
                        # a dot config on a group of one takes the dot tiles, a cc config the lane tiles
                        t = original(*a[:4], lanes_ok=bool(_c[5]) and a[4])
                        return dataclasses.replace(t, kv_as_m=_c[0], block_n=_c[1], num_warps=_c[2], num_stages=_c[3],
                                                   prefetch_pages=_c[4], programs_per_sm=_pps or t.programs_per_sm,
                                                   lanes=_c[5] if t.lanes else 0)

                    clear_tile_caches()
                    decode._plan.decode_tiles = original if config is None else tiles
                    w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws, args.layout)
                    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page,
                           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                    planned = w._step.tiles
                    if config is not None and (planned.block_n, planned.num_warps, planned.num_stages) != (
                            block_n, warps, stages):
                        raise RuntimeError(f"the plan took {planned}, not the config {name}")
                    i = [0]

                    def call():
                        w.run(q, copies[i[0] % len(copies)], k_scale=1.0, v_scale=1.0)
                        i[0] += 1

                    try:
                        out = w.run(q, kv.cache, k_scale=1.0, v_scale=1.0)
                        us = graph_time(call, replays=15)
                    except Exception as e:  # noqa: BLE001 (a config that does not compile is skipped)
                        print("skip", name, type(e).__name__, str(e)[:300], flush=True)
                        continue
                    if reference_out is None:
                        reference_out = out.float()
                    err = ((out.float() - reference_out).norm() / reference_out.norm()).item()
                    if err > 2e-2:
                        print(f"MISMATCH {name}: relative error {err:.3g} against the first config", flush=True)
                    key = (hq, hk, d, page, batch, kv_len, kv_name)
                    if key not in best or us < best[key][0]:
                        best[key] = (us, name, pps)
                    lines.append(f"| {hq}/{hk} | {d} | {page} | {batch}x{kv_len} | {kv_name} {args.layout} | {name} | {pps} | "
                                 f"{us:.1f} | {nbytes / us / 1e6:.2f} |")
                    print(lines[-1], flush=True)
    decode._plan.decode_tiles = original
    clear_tile_caches()
    write_table(lines, [f"- {k}: {v[0]:.1f} us with {v[1]}, programs/SM {v[2]}" for k, v in best.items()], args.out)


def write_table(lines, best_lines, out):
    """Prints the best config per shape and writes the whole table (markdown) to ``out``."""
    lines = lines + ["", "best:", ""] + best_lines
    print("\n".join(best_lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
