"""Ragged prefill against FlashInfer's fa3 in one process, with no checks and few calls: the quickest A/B of the
Gluon prefill's head_dim 256 and 192 / 128 modes (session 24, when ``tritoninfer bench`` runs did not finish inside a
short device lease). Times one eager call with CUDA events, median of ``--reps`` after one warm-up.

    PYTHONPATH=.:/tmp/site python benchmarks/prefill_fa3_quick.py [--reps 10] [--no-fa3]
"""
import argparse

import torch

from tritoninfer import _route, testing
from tritoninfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

# (head_dim_qk, head_dim_vo, query heads, KV heads, tokens a request, requests, causal)
SHAPES = [(256, 256, 32, 8, 4096, 4, True), (256, 256, 32, 8, 4096, 4, False), (192, 128, 128, 128, 4096, 1, True),
          (192, 128, 16, 16, 8192, 1, True), (192, 128, 16, 16, 2048, 8, True)]


def device_us(call, reps):
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def setup(lib, d_qk, d_vo, hq, hk, n, batch, causal):
    """The call and its FLOPs (2 * (d_qk + d_vo) * heads * batch * n^2, halved when causal)."""
    indptr = torch.arange(batch + 1, dtype=torch.int32) * n
    q, k, v = (torch.randn(batch * n, h, d, device="cuda", dtype=torch.bfloat16)
               for h, d in ((hq, d_qk), (hk, d_qk), (hk, d_vo)))
    workspace = testing.make_workspace(256 << 20, "cuda")
    if lib == "tritoninfer":
        wrapper = BatchPrefillWithRaggedKVCacheWrapper(workspace)
    else:
        import flashinfer

        wrapper, indptr = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3"), indptr.cuda()
    wrapper.plan(indptr, indptr, hq, hk, d_qk, head_dim_vo=d_vo, causal=causal, q_data_type=torch.bfloat16)
    return (lambda: wrapper.run(q, k, v)), 2 * (d_qk + d_vo) * hq * batch * n * n / (2 if causal else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-fa3", action="store_true")
    args = ap.parse_args()
    _route.HOPPER_FORCE = True  # the Gluon kernel on every row (8 x 2048 causal is below the route's threshold)
    for lib in ("tritoninfer",) + (() if args.no_fa3 else ("fa3",)):
        for shape in SHAPES:
            call, flops = setup(lib, *shape)
            us = device_us(call, args.reps)
            print(f"{lib} {shape} {us:.1f} us {flops / us / 1e6:.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
