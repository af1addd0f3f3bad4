"""Bad indices found by the kernels, reported on the host without a device synchronisation.

A page id outside the paged KV cache, or a page table that runs past ``kv_indices``, can come from
device memory that no host check saw (CUDA-graph buffers written by an engine, page tables that
stay on the GPU). The kernels never read or write outside their tensors for it: they bound every
such index and write one *fault record* here instead.

The record is two int64 in pinned host memory (mapped into the GPU's address space, so a kernel
writes it directly and the host reads it without a copy or a sync): ``[fault, limit]`` with
``fault = code << 60 | request << 32 | value`` (``value`` the offending int32, ``request`` the index
of the request in its batch) and ``limit`` the bound it broke. One 64-bit store keeps code, request
and value together when several programs report at once. Every ``plan()`` looks at the record of its
device (a host memory read, no sync) and raises the pending fault; :func:`check_errors` first waits
for the device, so it sees faults of every kernel launched so far.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _device

# codes of a fault record (kernels/attention.py, kernels/page.py and kernels/prefill_hopper.py write them)
FAULT_PAGE_ID = 1  # attention: a kv_indices entry outside [0, num_pages)
FAULT_PAGE_TABLE = 2  # attention: a request's pages run past the end of kv_indices
FAULT_APPEND_PAGE_ID = 3  # append_paged_kv_cache: a page id outside [0, num_pages)
FAULT_APPEND_POSITION = 4  # append_paged_kv_cache: a position beyond the pages the request owns
FAULT_APPEND_REQUEST = 5  # append_paged_kv_cache: a batch index outside [0, batch_size) other than -1

def fault_record(device: torch.device) -> torch.Tensor:
    """int64 [2] fault record that kernels launched on ``device`` write (kept for the process: captured
    CUDA graphs hold its address)."""
    pinned = torch.device(device).type == "cuda" and _device.can_pin_memory()
    return _device.per_device("fault_record", device, lambda: torch.zeros(2, dtype=torch.int64, pin_memory=pinned))


def describe(fault: int, limit: int) -> str:
    """The message of a fault record."""
    code, request, value = fault >> 60, (fault >> 32) & 0x0FFFFFFF, fault & 0xFFFFFFFF
    value = value - (1 << 32) if value >= 1 << 31 else value
    since = "found by a kernel launched since the last check; that request's output is not valid"
    if code == FAULT_PAGE_ID:
        return (f"kv_indices: request {request} refers to page id {value}, outside the paged KV cache's "
                f"[0, {limit}) pages ({since})")
    if code == FAULT_PAGE_TABLE:
        return (f"kv_indptr: the pages of request {request} (from entry {value}) run past the end of "
                f"kv_indices ({limit} entries) ({since})")
    if code == FAULT_APPEND_PAGE_ID:
        return (f"kv_indices: append_paged_kv_cache: a token of request {request} maps to page id {value}, "
                f"outside the cache's [0, {limit}) pages; it was not written")
    if code == FAULT_APPEND_POSITION:
        return (f"positions: append_paged_kv_cache: a token of request {request} has position {value}, beyond "
                f"the pages it owns in kv_indptr/kv_indices (or past the end of kv_indices, {limit} entries); "
                "it was not written")
    if code == FAULT_APPEND_REQUEST:
        return (f"batch_indices: append_paged_kv_cache: request index {value} is outside [0, {limit}) (and not "
                "-1, padding); that token was not written")
    return f"a tritoninfer kernel reported fault code {code} (request {request}, value {value}, limit {limit})"


def raise_pending(device: Optional[torch.device] = None) -> None:
    """Raises the fault recorded on ``device`` (every device when None) as a ``ValueError``, and clears
    it. Reads host memory only: a kernel still running may report after this returns."""
    for record in _device.per_device_values("fault_record", device):
        values = record.numpy()
        if values[0] != 0:
            fault, limit = int(values[0]), int(values[1])
            values[:] = 0
            raise ValueError(describe(fault, limit))


class FaultWatch:
    """A wrapper's view of its device's fault record: ``plan()`` calls :meth:`raise_pending`, one host
    memory read when nothing is recorded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values = fault_record(device).numpy()

    def raise_pending(self) -> None:
        if self.values[0] != 0:
            raise_pending(self.device)


def check_errors(device: Optional[torch.device | str | int] = None) -> None:
    """Waits for the GPU, then raises a ``ValueError`` for a bad index a tritoninfer kernel met since the
    last check: a ``kv_indices`` entry outside the paged KV cache, a page table that runs past
    ``kv_indices``, or an ``append_paged_kv_cache`` token with no valid page. Those kernels never read
    or write outside their tensors; they skip what the bad index points to and record it. Every
    ``plan()`` also raises a recorded fault, without waiting for the GPU.

    Parameters
    ----------
    device : optional
        The CUDA device to check (``None``: every device tritoninfer has launched on). This call
        synchronises with that device; do not call it inside a CUDA-graph capture.
    """
    if device is not None:
        device = torch.device(device)
    if _device.has_gpu():
        torch.cuda.synchronize(device if device is not None and device.type == "cuda" else None)
    raise_pending(device)


__all__ = ["check_errors"]
