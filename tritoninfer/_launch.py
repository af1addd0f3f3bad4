"""Kernel launches without Triton's per-call argument binding, for the launches on ``run()``'s path.

``kernel[grid](*args, **kwargs)`` costs ~90 µs of host time on the H200 host for the attention
kernel's 63 arguments (binding and specialising every argument, the cache-key hash, launch
metadata), against ~24 µs for the compiled launcher alone (``benchmarks/NOTES.md``, session 3).
``CachedLauncher`` keeps the compiled kernel of each specialisation and calls its launcher
directly when a later call has the same specialisation.

The specialisation key holds the facts Triton specialises on, so a hit never reuses a kernel
compiled for another specialisation (``tests/test_launch.py`` checks the two agree): a tensor's
dtype and whether its address is 16-byte aligned; an int's width (i32, i64, u64), whether it is
divisible by 16, or that it is 1; a bool's value; a float nothing but its type (floats are not
specialised); anything else (``None``, the keyword constexprs) itself.

Launch hooks registered with Triton (profilers) are called as Triton's own launch calls them;
under the interpreter every call takes the ordinary path.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import triton
from triton import knobs
from triton.runtime import driver

from . import _device


def _arg_key(a: Any):
    """What Triton specialises an argument on (``_launch.py`` docstring)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        if a == 1:
            return 1
        return (a & 15) == 0, -(1 << 31) <= a < (1 << 31), a < (1 << 63)
    if isinstance(a, float):
        return float
    return a


def _args_key(args: tuple) -> tuple:
    """``tuple(map(_arg_key, args))`` with the two common cases (tensors, ints) inlined: this runs
    for every argument of every launch."""
    return tuple([(a.dtype, (a.data_ptr() & 15) == 0) if type(a) is torch.Tensor else
                  (1 if a == 1 else ((a & 15) == 0, -2147483648 <= a < 2147483648, a < 9223372036854775808))
                  if type(a) is int else _arg_key(a) for a in args])


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)``, as ``kernel[grid](...)``.

    Runtime arguments are passed positionally and the compile-time ones (constexprs, ``num_warps``,
    ``num_stages``) by keyword, the same keywords at every call.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self._compiled: Dict[Tuple, Tuple[Any, tuple]] = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict) -> None:
        if _device.is_interpreter():
            self.kernel[grid](*args, **kwargs)
            return
        device = driver.active.get_current_device()
        key = (device, tuple(kwargs.items()), _args_key(args))
        hit = self._compiled.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            # the launcher takes every parameter in signature order, constexprs included
            tail = tuple(kwargs[p.name] if p.name in kwargs else p._param.default
                         for p in self.kernel.params[len(args):])
            if len(self._compiled) >= 256:
                self._compiled.clear()
            self._compiled[key] = (compiled, tail)
            return
        compiled, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _no_hook(enter) and _no_hook(leave):
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
        else:  # a profiler's hooks get what Triton's own launch gives them
            full = (*args, *tail)
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid, stream, *full), enter, leave, *full)


def _no_hook(hook) -> bool:
    """Triton 3.6's hooks are chains, empty unless a profiler registered one."""
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)
