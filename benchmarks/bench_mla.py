"""MLA decode on a GPU: tritoninfer's ``BatchMLAPagedAttentionWrapper`` against FlashInfer's
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (backends fa2 and fa3), same process, same inputs.

DeepSeek-V3 dims (``head_dim_ckv`` 512, ``head_dim_kpe`` 64, bf16, ``sm_scale = 1/sqrt(192)``); the
latent cache is one 576-wide buffer that both wrappers read as ``[..., :512]`` / ``[..., 512:]``
slices, as SGLang passes it; requests have equal lengths and randomly permuted pages. Timing is
``tritoninfer.bench.timing.measure`` in graph mode (``benchmarks/README.md``, METHOD): ``calls``
back-to-back runs captured in one CUDA graph, rotating over input copies (a fresh cache per copy,
as many copies as keep about 2x the 50 MB L2 in flight, within ``--max-gb``), median per call.

Counted per call: bytes = the live latent rows once per request (576 x 2 bytes per KV position)
plus q and o; FLOPs = 2 x heads x qlen x kv x (576 + 512) per request (the causal mask of 4-token
verify steps is not subtracted). TB/s and TFLOP/s are 1e12 per second.

    python benchmarks/bench_mla.py --quick
    python benchmarks/bench_mla.py                       # the full grid of issue 22
    python benchmarks/bench_mla.py --shapes 128:64:64:8192:1,16:1:64:4096:4
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from typing import List, Optional, Tuple

import torch

from tritoninfer.bench.timing import TimingConfig, measure
from tritoninfer.mla import BatchMLAPagedAttentionWrapper

D_CKV, D_KPE = 512, 64
SM_SCALE = 1 / math.sqrt(192)
Shape = Tuple[int, int, int, int, int]  # heads, page_size, batch, kv_len, qo_len


def grid(args) -> List[Shape]:
    if args.shapes:
        return [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    if args.quick:
        return [(128, 64, 1, 8192, 1), (128, 64, 64, 8192, 1), (16, 64, 64, 8192, 1), (128, 1, 64, 4096, 1),
                (128, 64, 64, 4096, 4)]
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    return list(itertools.product(ints(args.heads), ints(args.page), ints(args.batch), ints(args.kv), ints(args.qlen)))


def make_inputs(shape: Shape, ncopies: int, device):
    heads, ps, batch, kv, ql = shape
    pages_per = math.ceil(kv / ps)
    num_pages = batch * pages_per
    copies = []
    for _ in range(ncopies):
        q = torch.randn(batch * ql, heads, D_CKV + D_KPE, dtype=torch.bfloat16, device=device)
        cache = torch.randn(num_pages, ps, D_CKV + D_KPE, dtype=torch.bfloat16, device=device)
        copies.append((q[..., :D_CKV], q[..., D_CKV:], cache[..., :D_CKV], cache[..., D_CKV:]))
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * ql
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per
    kv_indices = torch.randperm(num_pages, device=device).to(torch.int32)
    kv_len = torch.full((batch,), kv, dtype=torch.int32, device=device)
    return copies, (qo_indptr, kv_indptr, kv_indices, kv_len)


def counts(shape: Shape) -> Tuple[float, float]:
    heads, _, batch, kv, ql = shape
    nbytes = batch * kv * (D_CKV + D_KPE) * 2 + batch * ql * heads * (D_CKV + D_KPE + D_CKV) * 2
    flops = 2.0 * heads * ql * kv * (D_CKV + D_KPE + D_CKV) * batch
    return nbytes, flops


def time_wrapper(wrapper, table, shape: Shape, copies, cfg, device) -> float:
    heads, ps, _, _, ql = shape
    qo_indptr, kv_indptr, kv_indices, kv_len = table
    causal = ql > 1

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, D_CKV, D_KPE, ps, causal, SM_SCALE,
                     torch.bfloat16, torch.bfloat16)

    plan()
    outs = [torch.empty_like(c[0]) for c in copies]

    def run(i):
        q_nope, q_pe, ckv, kpe = copies[i]
        wrapper.run(q_nope, q_pe, ckv, kpe, out=outs[i])

    return measure(run, device=device, mode="graph", ncopies=len(copies), cfg=cfg, plan=plan)


def check(ours, theirs, shape, copies, table) -> float:
    """Relative difference of the two outputs on copy 0 (a sanity check, not a test)."""
    o1 = ours.run(*copies[0])
    o2 = theirs.run(*copies[0])
    return float((o1.float() - o2.float()).norm() / o2.float().norm())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="128,16")
    p.add_argument("--page", default="1,64")
    p.add_argument("--batch", default="1,16,64,128")
    p.add_argument("--kv", default="1024,8192,32768")
    p.add_argument("--qlen", default="1,4")
    p.add_argument("--shapes", default="", help="comma-separated heads:page:batch:kv:qlen (overrides the grid)")
    p.add_argument("--quick", action="store_true", help="a five-shape subset")
    p.add_argument("--backends", default="fa2,fa3", help="FlashInfer backends to time ('' for none)")
    p.add_argument("--max-gb", type=float, default=40.0, help="largest total of input copies per shape")
    p.add_argument("--replays", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = TimingConfig(replays=args.replays)
    try:
        import flashinfer  # the real FlashInfer, if installed

        backends = [b for b in args.backends.split(",") if b]
    except ImportError:
        flashinfer, backends = None, []
        print("# flashinfer is not installed: tritoninfer only")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | flashinfer "
          f"{getattr(flashinfer, '__version__', '-')} | bf16, ckv 512 / kpe 64, sm_scale 1/sqrt(192)")
    cols = ["heads", "page", "batch", "kv", "qlen", "ours_us", "ours_TB/s", "ours_TFLOP/s"] + \
        [f"{b}_us" for b in backends] + (["ours/best_FI", "rel_diff"] if backends else [])
    print(" | ".join(cols))
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    ws_fi = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    for shape in grid(args):
        nbytes, flops = counts(shape)
        cache_bytes = shape[2] * math.ceil(shape[3] / shape[1]) * shape[1] * (D_CKV + D_KPE) * 2
        ncopies = max(1, min(8, math.ceil(100e6 / max(nbytes, 1)), int(args.max_gb * 1e9 // max(cache_bytes, 1))))
        if ncopies < 1 or cache_bytes > args.max_gb * 1e9:
            print(f"# skipped {shape}: {cache_bytes / 1e9:.1f} GB of cache > --max-gb")
            continue
        copies, table = make_inputs(shape, ncopies, device)
        ours = BatchMLAPagedAttentionWrapper(ws)
        t = time_wrapper(ours, table, shape, copies, cfg, device)
        row = [*map(str, shape), f"{t.time_us:.1f}", f"{nbytes / t.time_us / 1e6:.2f}",
               f"{flops / t.time_us / 1e6:.1f}"]
        best, diff = None, None
        for b in backends:
            try:
                fi = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws_fi, backend=b)
                tf = time_wrapper(fi, table, shape, copies, cfg, device)
                row.append(f"{tf.time_us:.1f}")
                best = tf.time_us if best is None else min(best, tf.time_us)
                if diff is None:
                    diff = check(ours, fi, shape, copies, table)
            except Exception as exc:  # a backend the GPU lacks: say so in the row
                row.append(f"n/a ({type(exc).__name__})")
        if backends:
            row += [f"{t.time_us / best:.2f}" if best else "-", f"{diff:.1e}" if diff is not None else "-"]
        print(" | ".join(row), flush=True)
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
