"""Host cost of a decode (or paged prefill) step's ``plan()``, the first ``run()`` of that plan and a later ``run()``, on a
machine without a GPU: the GPU launch path runs on CPU tensors with the compiler and
``cuLaunchKernel`` faked (``tritoninfer.testing.fake_driver_launches``), so the numbers hold the
Python of planning, binding and launching, not Triton's compiled launcher, the driver call or CUDA
copies (on the H200 host those add ~10 µs a launch and the plan's upload; its Python runs ~2x slower
than this 2-core dev machine's). Indices are on the host, so ``plan()`` also checks every page id
(a GPU run with device indices skips that).

    python benchmarks/host_fake_driver.py [--batches 1 16 256] [--kv-len 4096] [--rounds 2000] [--prefill QO_LEN]
        [--ragged] [--hopper]

``--hopper``: the routes see an sm_90 GPU, so a prefill the Gluon kernel takes launches it (its TMA maps
are not encoded: on the H200 host a new K/V address costs one ``cuTensorMapEncodeTiled`` more).
"""

import argparse
import statistics
import time

import torch

import tritoninfer
from tritoninfer import testing

PAGE, HQ, HK, D = 16, 32, 8, 128


def measure(batch: int, kv_len: int, rounds: int, qo_len: int = 0, ragged: bool = False) -> dict:
    """Decode (``qo_len`` 0) or causal prefill of ``qo_len`` new tokens a request (paged, or ``ragged``
    K/V of ``qo_len`` tokens)."""
    pages_per = -(-kv_len // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
    indices = torch.arange(batch * pages_per, dtype=torch.int32) % 64
    last = torch.full((batch,), kv_len - (pages_per - 1) * PAGE, dtype=torch.int32)
    cache = torch.zeros(64, 2, PAGE, HK, D, dtype=torch.bfloat16)
    q = torch.zeros(batch * max(qo_len, 1), HQ, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    if ragged:
        w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * qo_len
        k = torch.zeros(batch * qo_len, HK, D, dtype=torch.bfloat16)
        cache = (k, torch.zeros_like(k))

        def plan():
            w.plan(qo_indptr, qo_indptr, HQ, HK, D, causal=True, q_data_type=torch.bfloat16)
    elif qo_len:
        w = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * qo_len

        def plan():
            w.plan(qo_indptr, indptr, indices, last, HQ, HK, D, PAGE, causal=True, q_data_type=torch.bfloat16)
    else:
        w = tritoninfer.BatchDecodeWithPagedKVCacheWrapper(ws)

        def plan():
            w.plan(indptr, indices, last, HQ, HK, D, PAGE, q_data_type=torch.bfloat16)
    plan_s, first_s, later_s = [], [], []
    run_args = cache if ragged else (cache,)
    for i in range(rounds):
        last[0] = 1 + i % PAGE  # each step's lengths differ, as a decode loop's do
        t0 = time.perf_counter()
        plan()
        t1 = time.perf_counter()
        w.run(q, *run_args, out=out)
        t2 = time.perf_counter()
        w.run(q, *run_args, out=out)
        t3 = time.perf_counter()
        plan_s.append(t1 - t0)
        first_s.append(t2 - t1)
        later_s.append(t3 - t2)
    skip = rounds // 10  # warm-up
    return {k: statistics.median(v[skip:]) * 1e6 for k, v in
            (("plan", plan_s), ("first run", first_s), ("later run", later_s))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--kv-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--prefill", type=int, default=0, metavar="QO_LEN",
                    help="causal paged prefill of QO_LEN new tokens a request instead of decode")
    ap.add_argument("--ragged", action="store_true", help="ragged K/V of QO_LEN tokens a request (with --prefill)")
    ap.add_argument("--hopper", action="store_true", help="route as on an sm_90 GPU (the Gluon prefill kernel)")
    args = ap.parse_args(argv)
    if args.ragged and not args.prefill:
        ap.error("--ragged needs --prefill QO_LEN")
    kind = (f"{'ragged' if args.ragged else 'paged'} prefill of {args.prefill} tokens a request, causal"
            if args.prefill else "decode")
    print(f"{kind}, {HQ}/{HK} heads, head_dim {D}, page {PAGE}, kv_len {args.kv_len}; median host µs"
          + (" (sm_90 routes)" if args.hopper else ""))
    with testing.fake_driver_launches(hopper=args.hopper) as record:
        for batch in args.batches:
            row = measure(batch, args.kv_len, args.rounds, args.prefill, args.ragged)
            print(f"batch {batch:4d}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
                  + f" (compiles so far {len(record.compiles)}, driver launches {len(record.launches)})")


if __name__ == "__main__":
    main()
