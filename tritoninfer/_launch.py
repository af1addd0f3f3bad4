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

``BoundLaunch`` goes further for a wrapper's ``run()``: the arguments its plan fixes are bound
once (their key computed and their tensors turned into addresses), and a call keys and converts
only the per-call arguments.

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

    def bind(self, grid: tuple, tail: tuple, kwargs: dict) -> "BoundLaunch":
        """A launch whose trailing runtime arguments ``tail`` and compile-time ``kwargs`` are fixed."""
        return BoundLaunch(self, grid, tail, kwargs)

    def compile_and_launch(self, grid, args: tuple, kwargs: dict) -> Tuple[Any, tuple]:
        """Launches through Triton's ordinary path (compiling on first use); returns the compiled
        kernel and the constexpr values its launcher takes after ``args``."""
        compiled = self.kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        # the launcher takes every parameter in signature order, constexprs included
        tail = tuple(kwargs[p.name] if p.name in kwargs else p._param.default for p in self.kernel.params[len(args):])
        return compiled, tail

    def _launch(self, grid, args: tuple, kwargs: dict) -> None:
        if _device.is_interpreter():
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        key = (device, tuple(kwargs.items()), _args_key(args))
        hit = self._compiled.get(key)
        if hit is None:
            if len(self._compiled) >= 256:
                self._compiled.clear()
            self._compiled[key] = self.compile_and_launch(grid, args, kwargs)
            return
        compiled, tail = hit
        _run(compiled, grid, device, args, args, tail)


class BoundLaunch:
    """One kernel's launch with its grid, its trailing runtime arguments and its compile-time
    arguments fixed (a wrapper binds what its plan fixes, once per plan): ``bound(*head)``
    launches ``kernel[grid](*head, *tail, **kwargs)``.

    A call computes the specialisation key of ``head`` alone, and passes pointers to Triton's
    launcher as plain ints: for a tensor the launcher would otherwise call ``data_ptr()`` and the
    driver's ``cuPointerGetAttribute``, about a microsecond per pointer on the H200 host. The
    tensors of ``tail`` are kept alive by this object. The caller checks that every tensor is on
    the launch's device (a CPU tensor's address would not be caught here).
    """

    def __init__(self, launcher: CachedLauncher, grid: tuple, tail: tuple, kwargs: dict) -> None:
        self.launcher = launcher
        self.grid = grid
        self.tail = tail
        self.kwargs = kwargs
        self._tail_values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail)
        self._compiled: Dict[Tuple, Tuple[Any, tuple]] = {}

    def __call__(self, *head) -> None:
        if _device.is_interpreter():
            self.launcher.kernel[self.grid](*head, *self.tail, **self.kwargs)
            return
        device = _current_device()
        key = (device, _args_key(head))
        hit = self._compiled.get(key)
        if hit is None:
            if len(self._compiled) >= 64:
                self._compiled.clear()
            self._compiled[key] = self.launcher.compile_and_launch(self.grid, head + self.tail, self.kwargs)
            return
        compiled, constexprs = hit
        values = [a.data_ptr() if type(a) is torch.Tensor else a for a in head]
        values += self._tail_values
        _run(compiled, self.grid, device, values, head + self.tail, constexprs)


def _current_device() -> int:
    """The current CUDA device, as Triton's launcher needs it; without a GPU driver (CPU tensors, no
    interpreter) a ``ValueError`` that says what to do instead of Triton's "0 active drivers"."""
    try:
        return driver.active.get_current_device()
    except RuntimeError as exc:
        raise ValueError(_device.CPU_TENSORS_HINT) from exc


def _run(compiled, grid, device, values, args, constexprs) -> None:
    """Calls a compiled kernel's launcher with the runtime ``values`` (tensors or their addresses);
    launch hooks, when a profiler registered any, get the metadata of the tensors ``args``."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = driver.active.get_current_stream(device)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _no_hook(enter) and _no_hook(leave):
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *values, *constexprs)
    else:  # a profiler's hooks get what Triton's own launch gives them
        full = (*args, *constexprs)
        compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *full), enter, leave, *full)


def _no_hook(hook) -> bool:
    """Triton 3.6's hooks are chains, empty unless a profiler registered one."""
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)
