"""The MLA decode calls whose kernels ``h200_checks.sh ncu-mla`` profiles with Nsight Compute (where the
Gluon MLA kernel's warps wait: issue 22's gap to FlashInfer's fa3): each shape planned and run twice
unprofiled (compilation, the driver launch path), then once between ``cudaProfilerStart``/``Stop``
(run under ``ncu --profile-from-start off``). Shapes as ``tritoninfer bench mla --shapes``
(heads:page:batch:kv_len:qo_len), default 128 and 16 heads, page 64, 64 x 8K, one query token.

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \\
        python benchmarks/ncu_mla.py [SHAPES]
"""
import sys

import torch
from _ncu import profile_once

from tritoninfer import BatchMLAPagedAttentionWrapper
from tritoninfer.bench import mla


def main() -> None:
    shapes = mla._shapes(sys.argv[1] if len(sys.argv) > 1 else "128:64:64:8192:1,16:64:64:8192:1")
    device = torch.device("cuda")
    calls = []
    for shape in shapes:
        copies, table = mla.make_inputs(shape, (mla.D_CKV, mla.D_KPE), 1, device, seed=0)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        _, run = mla.setup_wrapper(BatchMLAPagedAttentionWrapper(workspace), table, shape, (mla.D_CKV, mla.D_KPE),
                                   copies)
        calls.append(run)
    profile_once([lambda run=run: run(0) for run in calls])


if __name__ == "__main__":
    main()
