"""Runs one prefill shape a few times, eagerly: a target for Nsight Compute (issue "Prefill, part 2":
what paging and fp8 KV cost against ragged bf16 KV on the same shape).

    ncu --clock-control none -k regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python benchmarks/prefill_once.py --kv paged --kv-dtype float8_e4m3fn

bf16 KV on an H200 (ragged, or paged with pages of 8+ tokens) runs the Gluon kernel
(``-k regex:prefill_hopper_kernel``; ``--page source --print-source sass --csv`` gives per-instruction
stall samples, as in benchmarks/results/h200/prefill-gluon-session6.md); set
TRITONINFER_HOPPER_PREFILL=0 for the attention core on the same shape.
"""

import argparse
import sys

import torch

import tritoninfer
from tritoninfer.bench import settings

sys.path.insert(0, "benchmarks")
from decode_sweep import gpu_paged_kv  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", choices=["paged", "ragged"], default="paged")
    ap.add_argument("--kv-dtype", default="bfloat16")
    ap.add_argument("--shape", default="32/8/4/4096", help="HQ/HK/BATCH/LEN")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-dim-vo", type=int, default=None, help="ragged only (DeepSeek's prefill: 192 / 128)")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a tritoninfer module constant for the run, as tritoninfer bench --set")
    args = ap.parse_args(argv)
    settings.apply(args.set)
    hq, hk, batch, n = map(int, args.shape.split("/"))
    d, d_vo = args.head_dim, args.head_dim_vo or args.head_dim
    if args.kv == "paged" and d_vo != d:
        ap.error("--head-dim-vo: ragged K/V only")
    kv_dtype = getattr(torch, args.kv_dtype)
    q = torch.randn((batch * n, hq, d), device="cuda").to(torch.bfloat16)
    qo_indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if args.kv == "paged":
        kv = gpu_paged_kv(batch, n, hk, d, args.page_size, kv_dtype, "NHD")
        w = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, args.page_size,
               causal=args.causal, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

        def run():
            return w.run(q, kv.cache)
    else:
        k, v = (torch.randn((batch * n, hk, dim), device="cuda").to(kv_dtype) for dim in (d, d_vo))
        w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(qo_indptr, qo_indptr, hq, hk, d, head_dim_vo=d_vo, causal=args.causal, q_data_type=torch.bfloat16,
               kv_data_type=kv_dtype)

        def run():
            return w.run(q, k, v)
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
