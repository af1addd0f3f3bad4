"""Device code only: ``@triton.jit`` kernels, and ``@gluon.jit`` for the Hopper ragged prefill
(``prefill_hopper``). No torch objects, no host logic, nothing imported from the package."""
