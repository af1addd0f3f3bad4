"""What the ``ncu_*.py`` scripts share: the calls run twice unprofiled (compilation, the driver launch
path), then once between ``cudaProfilerStart``/``Stop``, for ``ncu --profile-from-start off``."""
from typing import Callable, Sequence

import torch


def profile_once(calls: Sequence[Callable[[], object]]) -> None:
    for call in calls:
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
