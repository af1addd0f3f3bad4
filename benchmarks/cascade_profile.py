"""Kernel-by-kernel device time of cascade decode at 64 × (32K shared + 128), from ``torch.profiler``,
for tritoninfer's default tiles and a few alternatives for the shared level, and for FlashInfer.
Used to find what a cascade step spends its time on (``benchmarks/NOTES.md``, session 3).

    PYTHONPATH=. python benchmarks/cascade_profile.py
"""
import sys

import triton.testing

sys.path.insert(0, "benchmarks")
import bench_cascade as bc  # noqa: E402

import tritoninfer  # noqa: E402
from tritoninfer.bench.timing import kernel_times  # noqa: E402
from tritoninfer import _plan, prefill  # noqa: E402

try:
    import flashinfer
except Exception:  # noqa: BLE001
    flashinfer = None


def main():
    class Args:
        page_size, num_kv_heads, num_qo_heads, head_dim, dtype, layout = 16, 8, 32, 128, "bfloat16", "NHD"

    args = Args()
    x = bc.Inputs(args, 64, 32768, 128, "cuda", 2)
    default = prefill.prefill_tiles
    # (BLOCK_M, BLOCK_N, warps, stages, programs per SM) for the prefill tiles of both levels
    for cfg in (None, (128, 128, 8, 2, 1), (64, 64, 4, 3, 2), (256, 64, 8, 2, 1)):
        if cfg is None:
            prefill.prefill_tiles = default
        else:
            def tiles(group, head_dim, *_, c=cfg):
                return _plan.Tiles(c[0], c[1], c[2], c[3], c[0] // group, 1, mask_free_tiles=True, programs_per_sm=c[4])
            prefill.prefill_tiles = tiles
        plan, run, _ = bc.setup_provider("tritoninfer-cascade", tritoninfer, x, args)
        plan()
        us = triton.testing.do_bench(lambda: run(0)) * 1e3
        print(f"tritoninfer cascade, tiles {cfg or 'default'}: eager {us:.1f} µs; kernels {kernel_times(lambda: run(0))}",
              flush=True)
    prefill.prefill_tiles = default
    plan, run, _ = bc.setup_provider("tritoninfer-plain", tritoninfer, x, args)
    plan()
    print(f"tritoninfer plain decode over the same pages: kernels {kernel_times(lambda: run(0))}", flush=True)
    if flashinfer is not None:
        plan, run, _ = bc.setup_provider("flashinfer-cascade", flashinfer, x, args)
        plan()
        print(f"flashinfer cascade: kernels {kernel_times(lambda: run(0))}", flush=True)


if __name__ == "__main__":
    main()
