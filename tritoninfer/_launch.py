"""Kernel launches without Triton's per-call argument binding, for the launches on ``run()``'s path.

``kernel[grid](*args, **kwargs)`` costs ~90 µs of host time on the H200 host for the attention
kernel's 63 arguments (binding and specialising every argument, the cache-key hash, launch
metadata), against ~24 µs for the compiled launcher alone (``benchmarks/NOTES.md``, session 3).
``CachedLauncher`` keeps the compiled kernel of each specialisation; a later call with the same
specialisation goes through ``DriverLaunch`` (below) with that call's grid and values, or, where the
driver path cannot take it (bools, profiler hooks, scratch memory), calls Triton's compiled launcher
directly.

The specialisation key holds the facts Triton specialises on, so a hit never reuses a kernel
compiled for another specialisation (``tests/test_launch.py`` checks the two agree): a tensor's
dtype and whether its address is 16-byte aligned; an int's width (i32, i64, u64), whether it is
divisible by 16, or that it is 1; a bool's value; a float nothing but its type (floats are not
specialised); anything else (``None``, the keyword constexprs) itself.

``BoundLaunch`` goes further for a wrapper's ``run()``: the arguments its plan fixes are bound
once (their key computed and their tensors turned into addresses), and a call keys and converts
only the per-call arguments. After a specialisation's first call (Triton's path, which compiles and
loads the kernel), its calls go through ``DriverLaunch``: the parameter buffer Triton's generated
launcher would build is built once, a call writes its values into it and makes one
``cuLaunchKernel`` (``_driver.py``, ctypes); ~10 µs per launch on the H200 host, of which the
driver call is most (``benchmarks/host_primitives.py``).

A wrapper plans every step and binds a launch per plan, so what a new bound launch costs is paid at
every step's first ``run()``: the compiled kernel of a specialisation is shared by the launcher's
bound launches (``CachedLauncher.bound_hits``: no ``kernel[grid]`` path after the first plan), the
parameter layout by every driver launch of a kernel and head kinds (``_param_layout``), and a bound
launch moved to a new plan of the same kind only rewrites its tail values (``BoundLaunch.rebind``).

Launch hooks registered with Triton (profilers) are called as Triton's own launch calls them (such
calls take Triton's path); under the interpreter every call takes the ordinary path.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import operator
import struct
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
from triton import knobs
from triton.runtime import driver

from . import _device, _driver

log = logging.getLogger("tritoninfer.launch")


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
    """``tuple(map(_arg_key, args))`` with the common cases (tensors, ints, ``None``, floats) inlined: this
    runs for every argument of every launch (the sampling kernels' 11-23 arguments: half the time)."""
    return tuple([(a.dtype, (a.data_ptr() & 15) == 0) if type(a) is torch.Tensor else
                  (1 if a == 1 else ((a & 15) == 0, -2147483648 <= a < 2147483648, a < 9223372036854775808))
                  if type(a) is int else None if a is None else float if type(a) is float else _arg_key(a)
                  for a in args])


# False: ``CachedLauncher`` calls Triton's compiled launcher on every hit (the driver path off, for
# comparisons; ``BoundLaunch`` keeps its own)
CACHED_DRIVER_PATH = True


class CachedLauncher:
    """``launcher[grid](*args, **kwargs)``, as ``kernel[grid](...)``.

    Runtime arguments are passed positionally and the compile-time ones (constexprs, ``num_warps``,
    ``num_stages``) by keyword, the same keywords at every call.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        # per specialisation key: [the compiled kernel and its constexprs, the driver path's
        # (DriverLaunch, HeadKinds) or None where it cannot take the kernel or its arguments (built at the
        # key's second call)]: one lookup a launch
        self._hits: Dict[Tuple, list] = {}
        # bound launches' compiled kernels by specialisation of the whole call (``shared_key``), with
        # the TMA layouts whose identities the key holds: a plan's new bound launch finds what the
        # previous plan's compiled instead of taking Triton's ``kernel[grid]`` path (~90 µs)
        self.bound_hits: Dict[Tuple, Tuple[Any, tuple]] = {}
        self._bound_keep: Dict[Tuple, tuple] = {}
        self.unspecialized = _unspecialized(kernel)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def bind(self, grid: tuple, tail: tuple, kwargs: dict) -> "BoundLaunch":
        """A launch whose trailing runtime arguments ``tail`` and compile-time ``kwargs`` are fixed."""
        return BoundLaunch(self, grid, tail, kwargs)

    @staticmethod
    def shared_key(device: int, kwargs: dict, head: tuple, tail: tuple) -> tuple:
        """What Triton specialises a bound launch's call on: the keywords, and every argument as
        ``_args_key`` has it, TMA boxes as ``_box_key`` has them."""
        spec = _args_key(head + tail)
        if any(type(a) is TmaBox for a in head):
            spec = tuple([_box_key((a,))[0] if type(a) is TmaBox else k for a, k in zip(head, spec)]) + spec[len(head):]
        return device, tuple(kwargs.items()), spec

    def keep_bound_hit(self, key: tuple, hit, head: tuple) -> None:
        if len(self.bound_hits) >= 256:
            self.bound_hits.clear()
            self._bound_keep.clear()
        self.bound_hits[key] = hit
        self._bound_keep[key] = tuple(a.layout for a in head if type(a) is TmaBox)

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
        try:
            device = _current_index()  # (Triton's get_current_device, without its Python wrappers)
        except (AttributeError, RuntimeError):  # no CUDA: Triton's, which says so
            device = _current_device()
        key = (device, tuple(kwargs.items()), _args_key(args))
        entry = self._hits.get(key)
        if entry is None:
            if len(self._hits) >= 256:
                self._hits.clear()
            self._hits[key] = [self.compile_and_launch(grid, args, kwargs), _UNBUILT]
            return
        hit, fast = entry
        if not CACHED_DRIVER_PATH:
            fast = None
        elif fast is _UNBUILT:
            fast = entry[1] = self._driver_launch(hit, grid, args, device)
        if fast is not None and type(grid) is tuple and _no_hooks():
            launch, kinds = fast
            tensors = kinds.tensors(args)
            # a tensor on another device (a CPU one by mistake) keeps Triton's launcher, which refuses
            # it: the key does not hold devices, and the driver would take any address
            ptrs = []
            for t in tensors:
                if t.get_device() != device:
                    break
                ptrs.append(t.data_ptr())
            else:
                launch(ptrs, kinds.ints(args), kinds.floats(args), (), grid + (1,) * (3 - len(grid)))
                return
        compiled, tail = hit
        _run(compiled, grid, device, args, args, tail)

    @staticmethod
    def _driver_launch(hit, grid, args: tuple, device: int) -> Optional[Tuple["DriverLaunch", "HeadKinds"]]:
        """The driver path for the later calls of one specialisation: every call of a key has the
        same kinds of arguments (tensors, ints, floats, ``None``), so they are found once. ``None``
        where an argument is of another kind (bools, TMA boxes, subclasses) or ``DriverLaunch``
        refuses the kernel."""
        kinds = HeadKinds.of(args, allow_none=True)
        if kinds is None or kinds.positions["b"] or type(grid) is not tuple:
            return None
        launch = DriverLaunch.build(hit, grid + (1,) * (3 - len(grid)), args, (), device)
        return None if launch is None else (launch, kinds)


def _unspecialized(kernel) -> frozenset:
    """Positions of the parameters Triton does not specialise (``do_not_specialize``). A kernel defined
    under the interpreter (``testing.fake_driver_launches`` runs the GPU launch path on such kernels)
    keeps the decorator's names and positions in ``kwargs`` instead of its parameters."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return frozenset(i for i, p in enumerate(params) if p.do_not_specialize)
    names = list(getattr(kernel, "arg_names", ()))
    listed = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ()
    return frozenset(names.index(x) if isinstance(x, str) else int(x) for x in listed)


class TmaBox(NamedTuple):
    """A TMA descriptor as a bound launch takes it per call: ``tensor`` viewed as ``shape`` with
    ``strides`` (elements, outermost first), read in boxes of ``block`` into shared memory of
    ``layout``. Triton's path gets Gluon's ``TensorDescriptor`` of it; the driver path encodes it
    (and keeps the encoding for the next call with the same address and view)."""

    tensor: torch.Tensor
    shape: tuple
    strides: tuple
    block: tuple
    layout: Any

    def gluon(self):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        return TensorDescriptor(self.tensor, list(self.shape), list(self.strides), list(self.block), self.layout)


class BoundLaunch:
    """One kernel's launch with its grid, its trailing runtime arguments and its compile-time
    arguments fixed (a wrapper binds what its plan fixes, once per plan): ``bound(*head)``
    launches ``kernel[grid](*head, *tail, **kwargs)``.

    The first call with a specialisation compiles and launches through Triton. Later calls take the
    driver path (``DriverLaunch``): the kernel's parameter buffer was built once, a call writes the
    head's values into it and makes one ``cuLaunchKernel`` call. The driver path needs every head
    value to be of the kind it had at the first call (tensor, int, float or ``TmaBox``), every
    tensor 16-byte aligned, the plan's device current and no profiler hook; any other call takes
    Triton's launcher with the specialisation key of ``head`` computed in full.

    Pointers go to either launcher as plain ints: for a tensor Triton's launcher would otherwise call
    ``data_ptr()`` and the driver's ``cuPointerGetAttribute``, about a microsecond per pointer on the
    H200 host. The tensors of ``tail`` are kept alive by this object. The caller checks that every
    tensor is on the launch's device (a CPU tensor's address would not be caught here).
    """

    def __init__(self, launcher: CachedLauncher, grid: tuple, tail: tuple, kwargs: dict) -> None:
        self.launcher = launcher
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = tail
        self.kwargs = kwargs
        self._tail_values = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail)
        self._compiled: Dict[Tuple, Tuple[Any, tuple]] = {}
        self._kinds: Optional[HeadKinds] = None
        self._driver: Dict[Tuple, Optional[DriverLaunch]] = {}
        self._tail_spec: Optional[tuple] = None  # _args_key(tail), computed at the first rebind
        self._head_len: Optional[int] = None  # the arguments a call passes, once one has

    def rebind(self, grid: tuple, tail: tuple) -> None:
        """Another grid and tail (a wrapper's next plan). Where the tail specialises as the old one
        did (the plan's tensors are aligned: ``PlanUploader.upload``), the compiled kernels and the
        driver launches stay and only their tail values are rewritten; otherwise they are dropped
        and the next call finds its kernel as a new bound launch would."""
        if self._tail_spec is None:
            self._tail_spec = self._specialised(_args_key(self.tail))
        self._tail_values = tuple([a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail])
        spec = self._specialised(_args_key(tail))
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.tail = tail
        if spec != self._tail_spec:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("rebind of %s: the tail specialises anew at positions %s", self.launcher.kernel.__name__,
                          [i for i, (a, b) in enumerate(zip(spec, self._tail_spec)) if a != b])
            self._tail_spec = spec
            self._compiled.clear()
            self._driver.clear()
            self._kinds = None
            return
        for launch in self._driver.values():
            if launch is not None:
                launch.set_tail(self._tail_values, self.grid)

    def _specialised(self, tail_key: tuple) -> tuple:
        """``tail_key`` without the parameters Triton does not specialise (an int such as the cache's
        page count changes at every plan and must not drop the compiled kernels). Their positions are
        known once a call has given the head's length."""
        if self._head_len is None:
            return tail_key
        unspecialized = [i - self._head_len for i in self.launcher.unspecialized if i >= self._head_len]
        if not unspecialized:
            return tail_key
        key = list(tail_key)
        for i in unspecialized:
            if i < len(key):
                key[i] = None
        return tuple(key)

    def __call__(self, *head) -> Optional["DriverCall"]:
        """Launches; returns the driver launch it took with the call's tensors, ints and floats (what a
        wrapper needs to repeat the call with other addresses: ``_replay.py``), or None (Triton's path)."""
        call = self._driver_path(head) if self._kinds is not None else None
        if call is None:
            self._triton_path(head)
        return call

    def _driver_path(self, head: tuple) -> Optional["DriverCall"]:
        """Launches ``head`` through its driver launch, if it has one that can take the call."""
        kinds = self._kinds
        tensors = kinds.tensors(head)
        ptrs = [t.data_ptr() for t in tensors]
        aligned = 0
        for p in ptrs:
            aligned |= p
        if aligned & 15:
            return None
        ints = kinds.ints(head)
        boxes = kinds.boxes(head)
        key = (tuple([t.dtype for t in tensors]), ints, _box_key(boxes) if boxes else ())
        fast = self._driver.get(key)
        if fast is None or _current_index() != fast.device or not _no_hooks():
            return None
        floats = kinds.floats(head)
        fast(ptrs, ints, floats, boxes)
        return DriverCall(fast, tensors, ints, floats, boxes)

    def _triton_path(self, head: tuple) -> None:
        self._head_len = len(head)
        if _device.is_interpreter():
            self.launcher.kernel[self.grid](*_gluon(head), *self.tail, **self.kwargs)
            return
        device = _current_device()
        key = (device, _args_key(head))
        hit = self._compiled.get(key)
        if hit is None:
            if len(self._compiled) >= 64:
                self._compiled.clear()
            # another bound launch of the same specialisation (the previous plan's) compiled it
            shared = self.launcher.shared_key(device, self.kwargs, head, self.tail)
            hit = self.launcher.bound_hits.get(shared)
            if hit is None:
                hit = self._compiled[key] = self.launcher.compile_and_launch(self.grid, _gluon(head) + self.tail,
                                                                             self.kwargs)
                self.launcher.keep_bound_hit(shared, hit, head)
                self._prepare(hit, head, device)
                return
            self._compiled[key] = hit
        # a known kernel with a new driver key (other ints, e.g. another cache size): built and taken
        self._prepare(hit, head, device)
        if self._kinds is not None and self._driver_path(head):
            return
        compiled, constexprs = hit
        args = _gluon(head)
        values = [a.data_ptr() if type(a) is torch.Tensor else a for a in args]
        values += self._tail_values
        _run(compiled, self.grid, device, values, args + self.tail, constexprs)

    def _prepare(self, hit, head: tuple, device: int) -> None:
        """The driver launch for later calls like ``head`` (same kinds, dtypes, ints and boxes, aligned
        tensors), once per such key; None where the kernel cannot take that path."""
        kinds = HeadKinds.of(head)
        if kinds is None or (self._kinds is not None and kinds != self._kinds):
            return
        tensors = kinds.tensors(head)
        if any(t.data_ptr() & 15 for t in tensors):
            return
        boxes = kinds.boxes(head)
        key = (tuple([t.dtype for t in tensors]), kinds.ints(head), _box_key(boxes) if boxes else ())
        if key in self._driver:
            return
        if len(self._driver) >= 64:
            self._driver.clear()
        launch = DriverLaunch.build(hit, self.grid, head, self.tail, device)
        if launch is not None:
            launch.keep.extend(b.layout for b in boxes)
        self._driver[key] = launch
        self._kinds = kinds


class DriverCall(NamedTuple):
    """One launch through a ``DriverLaunch``: the tensors whose addresses it passed (in its order), its
    ints, floats and TMA boxes."""

    launch: "DriverLaunch"
    tensors: tuple
    ints: tuple
    floats: tuple
    boxes: tuple


def box_values_of(boxes: tuple) -> list:
    """The TMA boxes' shapes and strides as a launch's parameters take them, box after box."""
    return [x for b in boxes for x in (*b.shape, *b.strides)]


# an id for each TMA box view (its position in the head, shape, strides and block) met lately; ids are
# never reused, so an id a replay kept names the same view however often this table is cleared
_VIEW_IDS: Dict[tuple, int] = {}
_NEXT_VIEW_ID = itertools.count()


def box_views_of(boxes: tuple) -> list:
    """Each box's view id: a launch keeps its encoded TMA maps by view id and address (two ints: cheaper
    to hash than the view itself, and a replayed call passes the ids it took at its record)."""
    ids = []
    for n, b in enumerate(boxes):
        key = (n, b.shape, b.strides, b.block)
        view = _VIEW_IDS.get(key)
        if view is None:
            if len(_VIEW_IDS) >= 4096:
                _VIEW_IDS.clear()
            view = _VIEW_IDS[key] = next(_NEXT_VIEW_ID)
        ids.append(view)
    return ids


def _box_key(boxes: tuple) -> tuple:
    """What Triton specialises a TMA descriptor argument on: its dtype, block and layout (by identity:
    hashing a Gluon layout runs Python code; ``DriverLaunch.keep`` holds the layouts of its key, so
    an identity is never reused while the entry exists)."""
    return tuple([(b.tensor.dtype, b.block, id(b.layout)) for b in boxes])


def _gluon(head: tuple) -> tuple:
    return tuple(h.gluon() if type(h) is TmaBox else h for h in head)


def _tuple_getter(positions: List[int]) -> Callable[[tuple], tuple]:
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class HeadKinds:
    """Where a bound launch's head holds tensors, ints, floats and TMA boxes: getters that pick each
    kind out of a call's arguments at C speed."""

    def __init__(self, kinds: tuple) -> None:
        self.kinds = kinds
        self.positions = {k: [i for i, x in enumerate(kinds) if x == k] for k in "tifb"}
        self.tensors = _tuple_getter(self.positions["t"])
        self.ints = _tuple_getter(self.positions["i"])
        self.floats = _tuple_getter(self.positions["f"])
        self.boxes = _tuple_getter(self.positions["b"])

    def __eq__(self, other) -> bool:
        return isinstance(other, HeadKinds) and self.kinds == other.kinds

    __hash__ = None

    @staticmethod
    def of(head: tuple, allow_none: bool = False) -> Optional["HeadKinds"]:
        """``allow_none``: a ``None`` argument (a constexpr parameter to Triton, no parameter slot)
        is kind ``n``, picked by no getter."""
        kinds = []
        for a in head:
            t = type(a)
            if t is torch.Tensor:
                kinds.append("t")
            elif t is int:
                kinds.append("i")
            elif t is float:
                kinds.append("f")
            elif t is TmaBox:
                kinds.append("b")
            elif a is None and allow_none:
                kinds.append("n")
            else:  # None, bools, subclasses: Triton's path
                return None
        return HeadKinds(tuple(kinds))


# struct formats of the kernel parameter types Triton's launcher passes (FLOAT_STORAGE_TYPE aside:
# 16-bit float scalars take Triton's path)
_FORMATS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H",
            "u32": "I", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}
# Triton's TMA element type numbering -> the driver's (triton/backends/nvidia/driver.py)
_TMA_DTYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}


class _ParamLayout:
    """Where each slot of a kernel's parameter array points, for one kind of head: computed once per
    compiled kernel and head kinds (~65 µs of Python on the dev CPU for the attention kernel's 45
    parameters) and shared by every ``DriverLaunch`` of them, so that a plan's new bound launch
    costs only its buffers. A slot is ``(buffer, offset)``: the head buffer, the tail buffer, the
    null scratch pointer, or a TMA map (its address set per call)."""

    HEAD, TAIL, SCRATCH, MAP = range(4)

    def __init__(self, compiled, head_format: struct.Struct, tail_format: struct.Struct, tail_positions: List[int],
                 slots: List[Tuple[int, int]], box_slots: List[int], box_meta: List[dict]) -> None:
        self.compiled = compiled  # alive while this layout is cached under its id
        self.head_format = head_format
        self.tail_format = tail_format
        self.tail_positions = tail_positions  # the tail values the tail buffer packs (not constexprs)
        self.tail_values = _tuple_getter(tail_positions)
        self.slots = slots
        self.box_slots = box_slots
        self.box_meta = box_meta


def _packed_offsets(codes: List[str]) -> List[int]:
    """Each item's offset in a native-aligned ``struct`` of ``codes``."""
    return [struct.calcsize("@" + "".join(codes[:k + 1])) - struct.calcsize(code) for k, code in enumerate(codes)]


def _param_layout(compiled, constexprs: tuple, head: tuple, tail: tuple) -> Optional[_ParamLayout]:
    """The parameter layout of ``compiled`` for heads of ``head``'s kinds, or None where this path
    cannot pass an argument (16-bit float scalars, TMA boxes in the tail, unknown types)."""
    meta = compiled.metadata
    signature = list(compiled.src.signature.values())
    values = list(head) + list(tail) + list(constexprs)
    if len(signature) != len(values) or not all(isinstance(ty, str) for ty in signature):
        return None
    kinds = HeadKinds.of(head, allow_none=True)
    if kinds is None or any(a is None and ty != "constexpr" for a, ty in zip(head, signature)):
        return None
    tma_meta = list(getattr(meta, "tensordesc_meta", None) or [])
    # the head buffer packs the call's pointers, ints, floats and TMA boxes' shapes and strides,
    # in that order: its format, and which head position each packed item comes from
    packed = [(p, "Q") for p in kinds.positions["t"]]
    for p in kinds.positions["i"]:
        packed.append((p, _FORMATS.get(signature[p], "q")))  # a constexpr int's slot goes unread
    for p in kinds.positions["f"]:
        if signature[p] not in ("fp32", "f32", "fp64"):
            return None
        packed.append((p, _FORMATS[signature[p]]))
    box_items = {}
    for n, p in enumerate(kinds.positions["b"]):
        if (n >= len(tma_meta) or tma_meta[n] is None or tma_meta[n].get("fp4_padded")
                or not signature[p].startswith("tensordesc")):
            return None
        ndim = len(head[p].shape)
        box_items[p] = list(range(len(packed), len(packed) + 2 * ndim))
        packed += [(p, "i")] * ndim + [(p, "q")] * ndim
    offsets = _packed_offsets([code for _, code in packed])
    first_item = {}
    for k, (p, _) in enumerate(packed):
        first_item.setdefault(p, k)
    slots: List[Tuple[int, int]] = []
    box_slots: List[int] = []
    box_meta: List[dict] = []
    tail_codes: List[str] = []
    tail_positions: List[int] = []
    for i, ty in enumerate(signature):
        if ty == "constexpr":
            continue
        if i < len(head):
            if i in box_items:
                box_slots.append(len(slots))
                box_meta.append(tma_meta[len(box_meta)])
                slots.append((_ParamLayout.MAP, 0))
                slots += [(_ParamLayout.HEAD, offsets[k]) for k in box_items[i]]
            else:
                slots.append((_ParamLayout.HEAD, offsets[first_item[i]]))
            continue
        if ty.startswith("tensordesc") or (ty[0] != "*" and ty not in _FORMATS):
            return None
        slots.append((_ParamLayout.TAIL, len(tail_codes)))  # the item's index until offsets are known
        tail_codes.append("Q" if ty[0] == "*" else _FORMATS[ty])
        tail_positions.append(i - len(head))
    tail_offsets = _packed_offsets(tail_codes)
    slots = [(b, tail_offsets[o]) if b == _ParamLayout.TAIL else (b, o) for b, o in slots]
    slots += [(_ParamLayout.SCRATCH, 0)] * 2  # null global and profile scratch pointers
    return _ParamLayout(compiled, struct.Struct("@" + "".join(code for _, code in packed)),
                        struct.Struct("@" + "".join(tail_codes)), tail_positions, slots, box_slots, box_meta)


# parameter layouts by (compiled kernel id, head value types, tail length); a layout keeps its kernel
_LAYOUTS: Dict[Tuple, Optional[_ParamLayout]] = {}
_UNBUILT = object()


class DriverLaunch:
    """A compiled kernel's launch through ``cuLaunchKernel`` (``tritoninfer/_driver.py``), with the
    parameter buffer Triton's generated launcher would build: one slot per non-constexpr parameter
    in signature order (a TMA descriptor expands to the 128-byte map, its shape and its strides),
    then the global and profile scratch pointers (null: kernels that need scratch take Triton's
    path). Head values are written into one packed buffer per call; tail values were packed once,
    into a buffer of their own, when the launch was built (``_ParamLayout`` says where)."""

    def __init__(self) -> None:
        self.device = 0
        self.function = 0
        self.grid = (1, 1, 1)
        self.block = 0
        self.shared = 0
        self.head_format: Optional[struct.Struct] = None
        self.head_buffer = None
        self.layout: Optional[_ParamLayout] = None
        self.tail_buffer = None
        self.keep: list = []  # ctypes buffers the parameter array points into
        self.params = None
        self.box_slots: List[int] = []  # parameter index of each head TMA box's map
        self.box_meta: List[dict] = []
        self.maps: Dict[Tuple, _driver.TensorMap] = {}

    @staticmethod
    def build(hit, grid: tuple, head: tuple, tail: tuple, device: int) -> Optional["DriverLaunch"]:
        """None when the kernel needs what this path does not do (clusters, PDL, cooperative launch,
        scratch memory, 16-bit float scalars, TMA boxes in the tail) or the driver does not load."""
        compiled, constexprs = hit
        meta = compiled.metadata
        if (getattr(meta, "num_ctas", 1) != 1 or meta.launch_pdl or meta.launch_cooperative_grid
                or meta.global_scratch_size or meta.profile_scratch_size or not _driver.available()):
            return None
        key = (id(compiled), tuple([len(a.shape) if type(a) is TmaBox else type(a) for a in head]), len(tail))
        layout = _LAYOUTS.get(key, _UNBUILT)
        if layout is _UNBUILT:
            if len(_LAYOUTS) >= 256:
                _LAYOUTS.clear()
            layout = _LAYOUTS[key] = _param_layout(compiled, constexprs, head, tail)
        if layout is None:
            return None
        self = DriverLaunch()
        self.head_format = layout.head_format
        self.head_buffer = ctypes.create_string_buffer(max(1, layout.head_format.size))
        tail_buffer = ctypes.create_string_buffer(max(8, layout.tail_format.size))
        scratch = ctypes.create_string_buffer(8)
        bases = (ctypes.addressof(self.head_buffer), ctypes.addressof(tail_buffer), ctypes.addressof(scratch), 0)
        self.params = (ctypes.c_void_p * len(layout.slots))(*[bases[b] + offset for b, offset in layout.slots])
        self.keep = [scratch, layout]
        self.layout, self.tail_buffer = layout, tail_buffer
        self.set_tail(tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail), grid)
        self.box_slots = layout.box_slots
        self.box_meta = layout.box_meta
        self.device = device
        self.function = compiled.function
        self.function_arg = ctypes.c_void_p(compiled.function)
        self.block = 32 * meta.num_warps
        self.shared = meta.shared
        self.launch = _driver.launch_kernel()
        return self

    def set_tail(self, values: tuple, grid: tuple) -> None:
        """Packs a tail's values (tensors as addresses) into the tail buffer the parameter array points
        into, and sets the grid of calls that pass none."""
        self.layout.tail_format.pack_into(self.tail_buffer, 0, *self.layout.tail_values(values))
        self.grid = tuple([int(g) for g in grid])  # (the driver call takes Python ints only: a plan's may be numpy's)

    def __call__(self, ptrs: list, ints: tuple, floats: tuple, boxes: tuple, grid: Optional[tuple] = None) -> None:
        """``grid``: this call's (3-D) grid, else the one it was built with."""
        if boxes:
            self._set_maps(boxes, [b.tensor.data_ptr() for b in boxes], box_views_of(boxes))
            self.head_format.pack_into(self.head_buffer, 0, *ptrs, *ints, *floats, *box_values_of(boxes))
        else:
            self.head_format.pack_into(self.head_buffer, 0, *ptrs, *ints, *floats)
        self._launch(grid or self.grid)

    def replay(self, ptrs: list, values: tuple, boxes: tuple, box_ptrs: list, box_views: list) -> None:
        """A call made before (``_replay.py``) again with other addresses: ``values`` its ints, floats and
        boxes' shapes and strides (in the head's order), ``box_ptrs`` the boxes' bases and ``box_views``
        their ids (``box_views_of``) at that call."""
        if boxes:
            self._set_maps(boxes, box_ptrs, box_views)
        self.head_format.pack_into(self.head_buffer, 0, *ptrs, *values)
        self._launch(self.grid)

    def _launch(self, grid: tuple) -> None:
        gx, gy, gz = grid
        if gx * gy * gz == 0:
            return
        raw = torch._C._cuda_getCurrentRawStream(self.device)
        stream = _STREAM_ARGS.get(raw)
        if stream is None:
            if len(_STREAM_ARGS) >= 64:
                _STREAM_ARGS.clear()
            stream = _STREAM_ARGS[raw] = ctypes.c_void_p(raw)
        result = self.launch(self.function_arg, gx, gy, gz, self.block, 1, 1, self.shared, stream, self.params, None)
        if result:
            _driver.check(result, "cuLaunchKernel")

    def _set_maps(self, boxes: tuple, addresses: list, views: list) -> None:
        """Each box's encoded TMA map (of its view at its base address) into its parameter slot; encodings
        are kept per view and address (bounded), so a layer's K/V and a reused activation buffer are
        encoded once."""
        maps = self.maps
        for n, (address, view) in enumerate(zip(addresses, views)):
            tensor_map = maps.get((view, address))
            if tensor_map is None:
                if len(maps) >= 512:
                    maps.clear()
                box, meta = boxes[n], self.box_meta[n]
                tensor_map = _driver.TensorMap()
                _driver.encode_tiled(tensor_map, _TMA_DTYPE[meta["elem_type"]], address, box.shape,
                                     box.strides, meta["block_size"], meta["elem_size"], meta["swizzle"], False)
                maps[(view, address)] = tensor_map
            self.params[self.box_slots[n]] = tensor_map.address


# the driver call's stream argument per raw stream handle (a ctypes object costs ~0.2 µs to make)
_STREAM_ARGS: Dict[int, ctypes.c_void_p] = {}


def _current_index() -> int:
    return torch._C._cuda_getDevice()


def _no_hooks() -> bool:
    return _no_hook(knobs.runtime.launch_enter_hook) and _no_hook(knobs.runtime.launch_exit_hook)


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
