"""POD on one GPU: a decode batch of 64 requests x 4K tokens plus one 4K-token prefill chunk (causal, over 4K
keys), 32/8 heads, head_dim 128, page size 16, bf16. Compares, in one process on the same inputs:

- tritoninfer's ``PODWithPagedKVCacheWrapper`` (both halves in one launch);
- FlashInfer's ``PODWithPagedKVCacheWrapper`` (when FlashInfer is installed);
- tritoninfer's own decode (``BatchDecodeWithPagedKVCacheWrapper``, tensor cores) then prefill
  (``single_prefill_with_kv_cache``), launched one after the other.

Timing as ``tritoninfer.bench.timing.measure`` (CUDA-graph replays, median and p20-p80 in µs; an eager
loop timed with events where capture fails). Usage::

    python benchmarks/bench_pod.py [--decode-batch 64] [--decode-len 4096] [--prefill-len 4096]
"""

from __future__ import annotations

import argparse

import torch

from tritoninfer import testing
from tritoninfer.bench.timing import TimingConfig, measure
from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper
from tritoninfer.pod import PODWithPagedKVCacheWrapper
from tritoninfer.prefill import single_prefill_with_kv_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=4096)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    h, hk = args.heads
    d, page = args.head_dim, args.page_size
    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv([args.decode_len] * args.decode_batch, page, hk, d, dtype=dtype, device=dev,
                               generator=g)
    q_d = testing.randn((args.decode_batch, h, d), dtype, dev, g)
    n = args.prefill_len
    q_p, k_p, v_p = (testing.randn(s, dtype, dev, g) for s in ((n, h, d), (n, hk, d), (n, hk, d)))
    cfg = TimingConfig()
    rows = []

    ours = PODWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD")
    ours.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype)
    rows.append(("tritoninfer POD (one launch)",
                 measure(lambda i: ours.run(q_p, k_p, v_p, q_d, kv.cache, causal_p=True), device=dev, mode="graph",
                         ncopies=1, cfg=cfg)))

    decode = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD",
                                                use_tensor_cores=True)
    decode.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype)

    def separate(i):
        decode.run(q_d, kv.cache)
        single_prefill_with_kv_cache(q_p, k_p, v_p, causal=True)

    rows.append(("tritoninfer decode + prefill (two launches)",
                 measure(separate, device=dev, mode="graph", ncopies=1, cfg=cfg)))

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    if flashinfer is not None and not getattr(flashinfer, "__tritoninfer_version__", None):
        fi = flashinfer.PODWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD")
        fi.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, h, hk, d, page, q_data_type=dtype,
                kv_data_type=dtype)
        rows.append(("FlashInfer POD",
                     measure(lambda i: fi.run(q_p, k_p, v_p, q_d, kv.cache, causal_p=True), device=dev,
                             mode="graph", ncopies=1, cfg=cfg)))

    base = rows[0][1].time_us
    print(f"POD: decode {args.decode_batch} x {args.decode_len}, prefill {n} (causal), heads {h}/{hk}, "
          f"head_dim {d}, page {page}, bf16, {torch.cuda.get_device_name(dev)}")
    print(f"{'implementation':45s} {'median µs':>10s} {'p20-p80 µs':>17s} {'ours / this':>12s}  method")
    for name, t in rows:
        ratio = t.time_us / base if base else float("nan")
        print(f"{name:45s} {t.time_us:10.1f} {t.p20_us:8.1f}-{t.p80_us:<8.1f} {1 / ratio:12.3f}  {t.method}"
              + (f" ({t.note})" if t.note else ""))


if __name__ == "__main__":
    main()
