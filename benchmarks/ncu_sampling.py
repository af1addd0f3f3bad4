"""The sampling calls whose kernels ``h200_checks.sh ncu-sampling`` profiles with Nsight Compute: each
call twice unprofiled (compilation, the driver launch path), then once between
``cudaProfilerStart``/``Stop`` (run under ``ncu --profile-from-start off``).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python benchmarks/ncu_sampling.py [BATCH]
"""
import sys

import torch
from _ncu import profile_once

from tritoninfer import sampling


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(batch, 128256, device="cuda") * 3, -1)
    calls = [lambda: sampling.top_k_renorm_probs(probs, 50), lambda: sampling.top_p_renorm_probs(probs, 0.9),
             lambda: sampling.top_p_sampling_from_probs(probs, 0.9), lambda: sampling.sampling_from_probs(probs)]
    profile_once(calls)


if __name__ == "__main__":
    main()
