"""``@triton.jit`` code only: no torch objects, no host logic, nothing imported from the package."""
