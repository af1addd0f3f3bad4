"""The two CUDA driver calls of the launch fast path, through ``ctypes`` (no build step): launching a
kernel Triton compiled and loaded, and encoding a TMA descriptor.

``libcuda.so.1`` is the driver library every CUDA process has loaded (PyTorch and Triton use it);
it is opened on first use. Errors are ``RuntimeError``s with the driver's message, as Triton's
launcher raises them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Sequence

_uint = ctypes.c_uint
_ptr = ctypes.c_void_p

# CUtensorMap is 128 bytes and must be 64-byte aligned (the driver checks it)
TENSOR_MAP_BYTES = 128


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernel.argtypes = [_ptr, _uint, _uint, _uint, _uint, _uint, _uint, _uint, _ptr, _ptr, _ptr]
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [_ptr, ctypes.c_int, _uint, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorString.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the driver library loads (a machine with a GPU driver)."""
    try:
        _lib()
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def launch_kernel():
    """``cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> CUresult``,
    without argument types: ctypes then converts each argument by its Python type, a third of what
    converting through ``argtypes`` costs (dev CPU, an 11-argument call: 0.4-0.6 against 1.2 µs; every
    launch pays it). So the caller passes ``function`` and ``stream`` as ``ctypes.c_void_p``, ``params``
    as a ctypes array, ``extra`` as None and the rest as Python ints below 2**31 (the C parameters are
    unsigned ints: a C int of the same value is passed the same way)."""
    launch = _lib()["cuLaunchKernel"]  # (a function object of its own: _lib's has argument types)
    launch.restype = ctypes.c_int
    return launch


def check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(result, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else f"error {result}"
        raise RuntimeError(f"Triton Error [CUDA]: {text} ({what})")


class TensorMap:
    """One encoded TMA descriptor in host memory that a launch passes by address."""

    __slots__ = ("buffer", "address")

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
        self.address = (ctypes.addressof(self.buffer) + 63) & ~63


OOB_FILL_NONE, OOB_FILL_NAN = 0, 1
L2_PROMOTION_128B = 2


def encode_tiled(tensor_map: TensorMap, dtype: int, address: int, shape: Sequence[int], strides: Sequence[int],
                 block: Sequence[int], elem_size: int, swizzle: int, nan_fill: bool) -> None:
    """``cuTensorMapEncodeTiled`` with Triton's settings (``fill_tma_descriptor``): ``shape``,
    ``strides`` (elements) and ``block`` outermost first, as Triton's tensor descriptors hold them."""
    rank = len(shape)
    dims = (ctypes.c_uint64 * rank)(*reversed(shape))
    byte_strides = (ctypes.c_uint64 * max(1, rank - 1))(*[s * elem_size for s in reversed(strides[:-1])])
    box = (_uint * rank)(*reversed(block))
    ones = (_uint * rank)(*([1] * rank))
    check(_lib().cuTensorMapEncodeTiled(tensor_map.address, dtype, rank, address, dims, byte_strides, box, ones, 0,
                                        swizzle, L2_PROMOTION_128B, OOB_FILL_NAN if nan_fill else OOB_FILL_NONE),
          "cuTensorMapEncodeTiled")
