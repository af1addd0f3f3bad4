"""The decode calls whose kernels ``h200_checks.sh ncu-decode`` profiles with Nsight Compute: e4m3 paged
decode at 32/8 heads, 64 x 4096, page 16, once on the Gluon fp8 decode (``_route.DECODE_HOPPER_FP8``) and
once on the attention core, each planned and run twice unprofiled (compilation, the driver launch
path), then once between ``cudaProfilerStart``/``Stop`` (run under ``ncu --profile-from-start off``):
where the Gluon kernel's warps wait, beside the core's.

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \\
        python benchmarks/ncu_decode.py [BATCH [KV_LEN]]
"""
import sys

import torch
from _ncu import profile_once

from tritoninfer import BatchDecodeWithPagedKVCacheWrapper, _route, testing


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    kv_len = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv([kv_len] * batch, 16, 8, 128, dtype=torch.float8_e4m3fn, device="cuda", generator=g)
    q = torch.randn(batch, 32, 128, generator=g).to("cuda", torch.bfloat16)
    calls = []
    for gluon in (True, False):
        _route.DECODE_HOPPER_FP8 = gluon
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16,
               kv_data_type=torch.float8_e4m3fn)
        assert (w._step.route.kernel == "decode_hopper") == gluon, w._step.route
        calls.append(lambda w=w: w.run(q, kv.cache, k_scale=0.5))
    profile_once(calls)


if __name__ == "__main__":
    main()
