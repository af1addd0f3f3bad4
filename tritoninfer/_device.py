"""The one place that asks about the device and about the Triton interpreter.

Every hardware query in tritoninfer goes through here, so that under ``TRITON_INTERPRET=1`` (the
CPU test suite) nothing touches CUDA and every answer is a safe, fixed default. tritoninfer never
sets ``TRITON_INTERPRET`` itself: Triton reads it when ``@triton.jit`` decorates a function, so a
test suite must set it before importing any kernel module (``tests/conftest.py`` does).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Dict, Tuple, TypeVar

import torch

T = TypeVar("T")

# What the planner assumes when there is no GPU to ask (interpreter runs): small, so that CPU tests
# exercise split-KV with tiny shapes.
INTERPRETER_NUM_SMS = 4


def is_interpreter() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def has_gpu() -> bool:
    """True when a CUDA device is usable for real (not interpreted) kernel launches."""
    return not is_interpreter() and _cuda_available()


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    # asked on every launch's path; the answer does not change within a process
    return torch.cuda.is_available()


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _props(index: int):
    return torch.cuda.get_device_properties(index)


def num_sms(device: torch.device | str | int | None = None) -> int:
    """Streaming multiprocessors of ``device`` (``INTERPRETER_NUM_SMS`` without a GPU)."""
    if not has_gpu() or (device is not None and torch.device(device).type != "cuda"):
        return INTERPRETER_NUM_SMS
    if isinstance(device, torch.device) and device.index is not None:
        return _props(device.index).multi_processor_count
    return _props(_index(device)).multi_processor_count


def capability(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """CUDA compute capability of ``device``; ``(0, 0)`` without a GPU."""
    if not has_gpu():
        return (0, 0)
    return torch.cuda.get_device_capability(_index(device))


def device_name(device: torch.device | str | int | None = None) -> str:
    """Human-readable device name, ``"cpu (Triton interpreter)"`` without a GPU."""
    if not has_gpu():
        return "cpu (Triton interpreter)" if is_interpreter() else "cpu"
    return _props(_index(device)).name


def can_pin_memory() -> bool:
    """Pinned host buffers make host-to-device copies asynchronous; only meaningful with a GPU."""
    return has_gpu()


CPU_TENSORS_HINT = (
    "CPU tensors run only through the Triton interpreter: set TRITON_INTERPRET=1 in the environment before "
    "importing tritoninfer (e.g. `TRITON_INTERPRET=1 python script.py`), or pass CUDA tensors"
)


def check_launchable(device: torch.device, name: str) -> None:
    """Raises ``ValueError`` (saying what to do) if kernels cannot run on ``device``: a CPU device
    without the interpreter."""
    if getattr(device, "type", None) != "cuda" and torch.device(device).type != "cuda" and not is_interpreter():
        raise ValueError(f"{name}: the tensors are on {device}. {CPU_TENSORS_HINT}")


_PER_DEVICE: Dict[Tuple, object] = {}


def device_key(device) -> str:
    """``"cpu"`` or ``"cuda:N"`` (``"cuda"`` alone means the current device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def per_device(name: str, device, make: Callable[[], T], *key) -> T:
    """The process's one ``name`` object for ``device`` (and ``key``), made by ``make()`` on first use and
    kept for the process: the single-request functions' scratch workspace and plan uploader, ALiBi
    slopes, the kernels' fault record, FlashInfer's range buffers. Objects that captured CUDA graphs
    point into are never dropped."""
    full = (name, device_key(device)) + key
    value = _PER_DEVICE.get(full)
    if value is None:
        value = _PER_DEVICE[full] = make()
    return value


def per_device_values(name: str, device=None) -> list:
    """The ``name`` objects ``per_device`` made, for ``device`` (every device when None)."""
    wanted = None if device is None else device_key(device)
    return [v for k, v in list(_PER_DEVICE.items()) if k[0] == name and (wanted is None or k[1] == wanted)]
