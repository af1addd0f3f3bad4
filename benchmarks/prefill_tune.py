"""Tile sweep for prefill (issue "Prefill, part 2"): which compile-time tile is fastest per shape,
on ragged and paged KV. Patches the planner's tile choice at run time; results go to
benchmarks/NOTES.md by hand.

    PYTHONPATH=. python benchmarks/prefill_tune.py --configs 128-64-8-2,128-128-8-3 --out tune.md

A config is ``BLOCK_M-BLOCK_N-WARPS-STAGES[-masked]`` (``-masked``: one loop that masks every
tile, instead of a mask-free loop for the tiles every row sees in full); BLOCK_M counts rows, i.e. (query token, head of the
GQA group) pairs. Time: median of CUDA-event timed calls after a warm-up call. FLOPs: ``testing.prefill_flops``
(causal counts the visible half).
"""

import argparse
import dataclasses
import sys

import torch

import tritoninfer
from tritoninfer import _plan, prefill, testing

sys.path.insert(0, "benchmarks")
from decode_sweep import eager_time  # noqa: E402
from decode_tune import write_table  # noqa: E402

SHAPES = [(16, 1024), (4, 4096), (1, 16384)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="comma-separated BLOCK_M-BLOCK_N-WARPS-STAGES")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--forms", default="ragged,paged")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    hq, hk = map(int, args.heads.split("/"))
    d = args.head_dim
    kv_dtype = getattr(torch, args.kv_dtype)
    original = _plan.prefill_tiles
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    lines = ["| shape | form | causal | config | us | TFLOP/s |", "|" + "---|" * 6]
    best = {}
    for batch, n in SHAPES:
        torch.manual_seed(0)
        q = torch.randn(batch * n, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch * n, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch * n, hk, d, device="cuda", dtype=torch.bfloat16)
        indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda")
        pages_per = n // 16
        perm = torch.randperm(batch * pages_per, device="cuda")
        cache = torch.empty(batch * pages_per, 2, 16, hk, d, device="cuda", dtype=kv_dtype)
        cache[perm, 0] = k.view(-1, 16, hk, d).to(kv_dtype)
        cache[perm, 1] = v.view(-1, 16, hk, d).to(kv_dtype)
        kv_indptr = torch.arange(0, batch * pages_per + 1, pages_per, dtype=torch.int32, device="cuda")
        last = torch.full((batch,), 16, dtype=torch.int32, device="cuda")
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            for form in args.forms.split(","):
                for name in args.configs.split(","):
                    parts = name.split("-")
                    bm, bn, warps, stages = map(int, parts[:4])

                    def tiles(group, head_dim, _c=(bm, bn, warps, stages), _mf="masked" not in parts):
                        return dataclasses.replace(original(group, head_dim), block_m=_c[0], block_n=_c[1],
                                                   num_warps=_c[2], num_stages=_c[3], tile_tokens=_c[0] // group,
                                                   mask_free_tiles=_mf)

                    prefill.prefill_tiles = tiles
                    if form == "ragged":
                        w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws)
                        w.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
                        call = lambda: w.run(q, k, v)  # noqa: E731
                    else:
                        w = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws)
                        w.plan(indptr, kv_indptr, perm.to(torch.int32), last, hq, hk, d, 16, causal=causal,
                               q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
                        scale = {} if kv_dtype == torch.bfloat16 else {"k_scale": 1.0, "v_scale": 1.0}
                        call = lambda: w.run(q, cache, **scale)  # noqa: E731
                    try:
                        us = eager_time(call, reps=10)
                    except Exception as e:  # noqa: BLE001 (a config that does not compile is skipped)
                        print("skip", name, type(e).__name__, str(e)[:300], flush=True)
                        continue
                    key = (batch, n, form, causal)
                    if key not in best or us < best[key][0]:
                        best[key] = (us, name)
                    lines.append(f"| {batch}x{n} | {form} | {causal} | {name} | {us:.0f} | {flops / us / 1e6:.0f} |")
                    print(lines[-1], flush=True)
    prefill.prefill_tiles = original
    write_table(lines, [f"- {k}: {v[0]:.0f} us with {v[1]}" for k, v in best.items()], args.out)


if __name__ == "__main__":
    main()
