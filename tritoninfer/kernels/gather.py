"""Gluon helpers of the Hopper kernels' gathering producers (``kernels/prefill_hopper.py``,
``kernels/mla_hopper.py``): pages TMA cannot box are read by cp.async into the same ring of stages."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier


@gluon.jit
def publish_stage(ready, t, stages: gl.constexpr):
    """Ring tile t's stage to the consumers once this warpgroup's cp.async writes to it are complete
    (the caller's ``wait_group``): the writes made visible to their wgmma (async proxy), then one
    arrive on the stage's ``ready`` barrier."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(ready.index(t % stages), count=1)
