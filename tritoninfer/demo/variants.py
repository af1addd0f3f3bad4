"""Which kernel variants the demo launches, so that it can show that its timed run compiles none.

Triton compiles a kernel once per *variant*: its compile-time arguments and what it specialises the
others on. On a GPU the variants are Triton's own compilations (its ``jit_post_compile_hook``).
Under the interpreter nothing is compiled, so each launch's variant is worked out the way Triton
3.6 keys its compilations: a constexpr by its value; a tensor by its dtype and whether its address
is 16-byte aligned; an int by whether it is 1, divisible by 16, and its width (i32, i64, u64),
except the parameters a kernel lists in ``do_not_specialize`` (width only); a bool by its value; a
float by its type. A CPU run then counts what a GPU run would compile.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Hashable, List, Set, Tuple

import torch

__all__ = ["KernelVariants"]


def _int_width(x: int) -> str:
    return "i32" if -(1 << 31) <= x < (1 << 31) else "i64" if -(1 << 63) <= x < (1 << 63) else "u64"


def _hashable(x: Any) -> Hashable:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def _specialisation(value: Any, specialise: bool, align: bool) -> Hashable:
    if isinstance(value, torch.Tensor):
        return value.dtype, align and value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        if not specialise:
            return _int_width(value)
        return _int_width(value), value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    return _hashable(value)


class _InterpretedKernel:
    """The variant key of one interpreted kernel's launches."""

    def __init__(self, kernel) -> None:
        self.name = kernel.fn.__name__
        self.signature = inspect.signature(kernel.fn)
        names = list(self.signature.parameters)

        def by_name(items) -> Set[str]:
            return {names[i] if isinstance(i, int) else i for i in (items or ())}

        self.constexprs = {n for n, p in self.signature.parameters.items() if "constexpr" in str(p.annotation)}
        self.no_specialise = by_name(kernel.kwargs.get("do_not_specialize"))
        self.no_align = by_name(kernel.kwargs.get("do_not_specialize_on_alignment"))

    def key(self, args: tuple, kwargs: Dict[str, Any]) -> Tuple:
        params = self.signature.parameters
        bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        options = tuple(sorted((k, _hashable(v)) for k, v in kwargs.items() if k not in params))  # num_warps, ...
        return (self.name, options) + tuple(
            _hashable(value) if name in self.constexprs
            else _specialisation(value, name not in self.no_specialise, name not in self.no_align)
            for name, value in bound.arguments.items()
        )


class KernelVariants:
    """Records the variants of the Triton kernels launched while it is entered (``with``).

    ``len(variants)`` is the number of distinct variants seen so far; the difference of two readings
    is how many a section launched for the first time, i.e. compiled on a GPU (where a variant that
    this process compiled before it was entered is not counted again).
    """

    def __init__(self) -> None:
        self.seen: Set[Hashable] = set()
        self._undo: List[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self.seen)

    def __enter__(self) -> "KernelVariants":
        from tritoninfer import _device

        if _device.is_interpreter():
            self._hook_interpreted_kernels()
        else:
            self._hook_compilations()
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def _hook_compilations(self) -> None:
        from triton import knobs

        previous = knobs.runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.seen.add((kwargs["fn"].name, str(kwargs["key"])))
            return previous(*args, **kwargs) if previous is not None else False

        knobs.runtime.jit_post_compile_hook = hook

        def undo() -> None:
            knobs.runtime.jit_post_compile_hook = previous

        self._undo.append(undo)

    def _hook_interpreted_kernels(self) -> None:
        # Every interpreted launch goes through InterpretedFunction.run: wrapping it there sees the
        # kernels of modules imported later too.
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        keyers: Dict[int, _InterpretedKernel] = {}

        def run(kernel, *args, **kwargs):
            keyer = keyers.get(id(kernel))
            if keyer is None:
                keyer = keyers[id(kernel)] = _InterpretedKernel(kernel)
            launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            self.seen.add(keyer.key(args, launch))
            return original(kernel, *args, **kwargs)

        InterpretedFunction.run = run

        def undo() -> None:
            InterpretedFunction.run = original

        self._undo.append(undo)
