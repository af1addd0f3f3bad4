"""The paged KV cache forms FlashInfer accepts, reduced to (K view, V view, page size, strides)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Optional, Tuple, Union

import numpy as np
import torch

from ._options import (INDEX_DTYPES, TensorLayout, check_graph_buffers, check_int_index_tensor, check_tensor, copy_into,
                       host_index)

PagedKVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class PagedKV:
    """K and V of a paged cache as element strides over (page, slot in page, head); dim is contiguous.
    (Not frozen: run() builds one per call, and a frozen dataclass costs microseconds to build.)"""

    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    num_heads: int
    head_dim_qk: int
    head_dim_vo: int
    k_strides: Tuple[int, int, int]  # page, slot, head
    v_strides: Tuple[int, int, int]
    # the Gluon prefill's TMA view of this cache, once computed (``_hopper.paged_descriptors``; a
    # ``CacheViews`` entry keeps the same object for a cache, so its run() calls compute it once)
    tma: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device


def _strides_4d(t: torch.Tensor, layout: TensorLayout, name: str) -> Tuple[Tuple[int, int, int], int, int, int]:
    """4-D [P, page, H, D] (NHD) or [P, H, page, D] (HND) -> ((page, slot, head) strides, page, H, D)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got strides {tuple(t.stride())}")
    if layout == TensorLayout.NHD:
        _, page, heads, dim = t.shape
        return (t.stride(0), t.stride(1), t.stride(2)), page, heads, dim
    _, heads, page, dim = t.shape
    return (t.stride(0), t.stride(2), t.stride(1)), page, heads, dim


# (form, shapes, strides, dtypes, devices, layout) -> the checked sizes and strides of PagedKV;
# no tensor is kept, so a freed cache is not held alive
_UNPACKED: dict = {}


def unpack_paged_kv_cache(paged_kv_cache: PagedKVCache, layout: TensorLayout) -> PagedKV:
    """Every cache form of FlashInfer 0.5.3.

    - a 5-D tensor ``[P, 2, page_size, H, D]`` (NHD) or ``[P, 2, H, page_size, D]`` (HND);
    - a 4-D tensor ``[P, 2, H, D]``: page size 1;
    - a ``(k_cache, v_cache)`` tuple of 4-D tensors ``[P, page_size, H, D]`` / ``[P, H, page_size, D]``;
    - a ``(k, v)`` tuple of 3-D ``[tokens, H, D]`` tensors: page size 1 (SGLang's form).

    ``run()`` calls this every step with the same cache: the checks run once per distinct
    geometry (shapes, strides, dtypes, devices), later calls only take the K and V views.
    """
    if isinstance(paged_kv_cache, torch.Tensor):
        key = (paged_kv_cache.shape, paged_kv_cache.stride(), paged_kv_cache.dtype, paged_kv_cache.device, layout)
        known = _UNPACKED.get(key)
        if known is not None:
            if paged_kv_cache.dim() == 4:
                paged_kv_cache = paged_kv_cache.unsqueeze(2 if layout == TensorLayout.NHD else 3)
            return PagedKV(*paged_kv_cache.unbind(1), *known)  # one call for both views
        kv = _unpack(paged_kv_cache, layout)
    elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2 and \
            all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
        k, v = paged_kv_cache
        key = (k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device, layout)
        known = _UNPACKED.get(key)
        if known is not None:
            if k.dim() == 3:
                axis = 1 if layout == TensorLayout.NHD else 2
                k, v = k.unsqueeze(axis), v.unsqueeze(axis)
            return PagedKV(k, v, *known)
        kv = _unpack(paged_kv_cache, layout)
    else:
        return _unpack(paged_kv_cache, layout)
    if len(_UNPACKED) > 64:
        _UNPACKED.clear()
    _UNPACKED[key] = (kv.page_size, kv.num_heads, kv.head_dim_qk, kv.head_dim_vo, kv.k_strides, kv.v_strides)
    return kv


class _Remembered:
    """One cache object's unpacked views, and what a wrapper built from them for its current step."""

    __slots__ = ("refs", "facts", "kv", "step", "source")

    def __init__(self, refs: tuple, facts: tuple, kv: PagedKV) -> None:
        self.refs, self.facts, self.kv = refs, facts, kv
        self.step: Any = None
        self.source: Any = None


def _facts(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


class CacheViews:
    """``unpack_paged_kv_cache`` remembered per cache object, for a wrapper's ``run()``: engines pass the
    same cache tensors (a layer's cache, or a ``(k, v)`` pair of them) every step, so the views and
    the checks against the plan are made once per cache and step, and a call compares the object's
    identity, address, shape and strides (a cache changed in place in any of these is unpacked
    again).

    An entry holds the cache's views (or, for a pair, its tensors), and a PyTorch view keeps its base
    alive, so an entry keeps its cache and the cache's memory: a cache is remembered only from the
    second call that passes that same object (weakly noted at the first), so caches a caller makes per
    call (a view of a bigger buffer, a cache grown by concatenation) are never held. At most ``LIMIT``
    caches are remembered (then all are dropped)."""

    LIMIT = 256

    def __init__(self, layout: TensorLayout) -> None:
        self.layout = layout
        self._entries: dict = {}
        self._seen: dict = {}  # key -> weak references of a cache met once (nothing of it held)

    def source(self, cache: PagedKVCache, step, build: Callable[[PagedKV], Any]) -> Tuple[PagedKV, Any]:
        """The unpacked cache and ``build(kv)`` (the checks against ``step`` and the kernel's source),
        built once per cache object and step."""
        if type(cache) is torch.Tensor:
            key = id(cache)
            entry = self._entries.get(key)
            hit = entry is not None and entry.refs[0]() is cache and entry.facts == _facts(cache)
            parts = (cache,)
        elif type(cache) is tuple and len(cache) == 2 and type(cache[0]) is torch.Tensor \
                and type(cache[1]) is torch.Tensor:
            k, v = cache
            key = (id(k), id(v))
            entry = self._entries.get(key)
            hit = (entry is not None and entry.refs[0]() is k and entry.refs[1]() is v
                   and entry.facts == _facts(k) + _facts(v))
            parts = cache
        else:
            kv = unpack_paged_kv_cache(cache, self.layout)
            return kv, build(kv)
        if not hit:
            kv = unpack_paged_kv_cache(cache, self.layout)
            seen = self._seen.pop(key, None)
            if seen is None or any(ref() is not t for ref, t in zip(seen, parts)):
                if len(self._seen) >= self.LIMIT:
                    self._seen.clear()
                self._seen[key] = tuple(weakref.ref(t, _forget(self._seen, key)) for t in parts)
                return kv, build(kv)
            if len(self._entries) >= self.LIMIT:
                self._entries.clear()
            forget = _forget(self._entries, key)
            entry = _Remembered(tuple(weakref.ref(t, forget) for t in parts),
                                sum((_facts(t) for t in parts), ()), kv)
            self._entries[key] = entry
        if entry.step is not step:
            entry.source = build(entry.kv)
            entry.step = step
        return entry.kv, entry.source


def _forget(entries: dict, key) -> Callable:
    def forget(_ref) -> None:
        entries.pop(key, None)

    return forget


def _unpack(paged_kv_cache: PagedKVCache, layout: TensorLayout) -> PagedKV:
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected a (k_cache, v_cache) pair, got {len(paged_kv_cache)} tensors")
        k, v = paged_kv_cache
        check_tensor(k, "paged_kv_cache[0]")
        check_tensor(v, "paged_kv_cache[1]")
        if k.dim() != v.dim() or k.dim() not in (3, 4):
            raise ValueError(
                f"paged_kv_cache: expected a tuple of two 4-D (or two 3-D, page size 1) tensors, "
                f"got shapes {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dim() == 3:
            k = k.unsqueeze(1) if layout == TensorLayout.NHD else k.unsqueeze(2)
            v = v.unsqueeze(1) if layout == TensorLayout.NHD else v.unsqueeze(2)
    else:
        check_tensor(paged_kv_cache, "paged_kv_cache")
        cache = paged_kv_cache
        if cache.dim() == 4:
            cache = cache.unsqueeze(2) if layout == TensorLayout.NHD else cache.unsqueeze(3)
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ValueError(
                "paged_kv_cache: expected a 5-D tensor [num_pages, 2, page_size, num_kv_heads, head_dim] "
                f"(NHD) or [num_pages, 2, num_kv_heads, page_size, head_dim] (HND), got shape {tuple(paged_kv_cache.shape)}"
            )
        k, v = cache[:, 0], cache[:, 1]
    if k.dtype != v.dtype:
        raise ValueError(f"paged_kv_cache: K and V must share a dtype, got {k.dtype} and {v.dtype}")
    if k.device != v.device:
        raise ValueError("paged_kv_cache: K and V must be on the same device")
    k_strides, page, heads, dqk = _strides_4d(k, layout, "paged_kv_cache (K)")
    v_strides, page_v, heads_v, dvo = _strides_4d(v, layout, "paged_kv_cache (V)")
    if (page, heads) != (page_v, heads_v) or k.shape[0] != v.shape[0]:
        raise ValueError(f"paged_kv_cache: K {tuple(k.shape)} and V {tuple(v.shape)} disagree on pages, page size or heads")
    return PagedKV(k, v, page, heads, dqk, dvo, k_strides, v_strides)


def page_table_from_block_tables(block_tables: torch.Tensor, seq_lens: Optional[torch.Tensor], page_size: int):
    """``block_tables`` [batch, max_pages] + ``seq_lens`` [batch] -> (indptr host, indices, last_page_len host)."""
    check_tensor(block_tables, "block_tables", ndim=2, dtype=INDEX_DTYPES)
    if seq_lens is None:
        raise ValueError("seq_lens: required with block_tables")
    lens = host_index(seq_lens, "seq_lens").to(torch.int64)
    if lens.numel() != block_tables.shape[0]:
        raise ValueError(f"seq_lens: expected {block_tables.shape[0]} elements, got {lens.numel()}")
    pages = (lens + page_size - 1) // page_size
    if bool((pages > block_tables.shape[1]).any()):
        raise ValueError("block_tables: a sequence needs more pages than block_tables has columns")
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens)).to(torch.int32)
    keep = torch.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = block_tables[keep.to(block_tables.device)].to(torch.int32)
    return indptr, indices, last


@dataclasses.dataclass
class HostPageTable:
    """A page table's host-side facts, as plan() needs them."""

    indptr: np.ndarray  # int64 [batch + 1]
    last_page_len: np.ndarray  # int64 [batch]
    kv_lens: np.ndarray  # int64 [batch]
    num_pages_used: int  # indptr[-1]
    # page ids the table uses, when they are on the host (else None: the kernels bound them)
    page_ids: Optional[np.ndarray] = None
    max_page_id: int = -1
    prefix: str = ""

    def check_cache(self, num_pages: int) -> None:
        """Raises ``ValueError`` if a page id on the host is outside a cache of ``num_pages`` pages
        (``run()`` calls it with the cache it gets: one int comparison unless an id is bad)."""
        if self.max_page_id >= num_pages:
            bad = int(np.argmax(self.page_ids >= num_pages))
            raise _page_id_error(self, bad, num_pages)


def _page_id_error(table: HostPageTable, position: int, num_pages: Optional[int]) -> ValueError:
    """The error for the page id at ``position`` of the table's ids, naming its request."""
    request = int(np.searchsorted(table.indptr[1:] - table.indptr[0], position, side="right"))
    where = f"outside the paged KV cache's [0, {num_pages}) pages" if num_pages is not None else "negative"
    return ValueError(f"{table.prefix}indices: request {request} refers to page id {int(table.page_ids[position])}, "
                      f"{where}")


def host_page_table(indptr_host: torch.Tensor, last_page_len_host: torch.Tensor, indices: torch.Tensor,
                    page_size: int, prefix: str = "") -> HostPageTable:
    """Checks a CSR page table whose indptr and last_page_len are on the host (argument names are
    ``prefix + "indptr"`` etc.) and derives the KV lengths: ``(pages - 1) * page_size + last_page_len``,
    0 for a request with no pages. The indptr may start past 0 (a slice of a larger table)."""
    entries = indptr_host.numel()
    if entries < 1:
        raise ValueError(f"{prefix}indptr: expected at least one element (batch_size + 1)")
    check_int_index_tensor(indices, prefix + "indices")
    batch = entries - 1
    if last_page_len_host.numel() != batch:
        raise ValueError(f"{prefix}last_page_len: expected {batch} elements (batch_size), got {last_page_len_host.numel()}")
    # plan() runs every step: few numpy calls (each costs ~1-2 µs of host time), the common case
    # (every request has pages, every id valid) first
    ind = indptr_host.numpy().astype(np.int64)
    pages = ind[1:] - ind[:-1]
    fewest = int(pages.min()) if batch else 1
    first = int(ind[0])
    if first < 0 or fewest < 0:
        raise ValueError(f"{prefix}indptr: expected a non-decreasing array")
    num_pages_used = int(ind[-1])
    if indices.numel() < num_pages_used:
        raise ValueError(f"{prefix}indices: {prefix}indptr[-1] is {num_pages_used} but {prefix}indices has only "
                         f"{indices.numel()} elements")
    lpl = last_page_len_host.numpy().astype(np.int64)
    # 1 <= lpl <= page_size where a request has pages (requests without pages may hold anything)
    if fewest > 0:
        bad = batch and (int(lpl.min()) < 1 or int(lpl.max()) > page_size)
    else:
        bad = (lpl - 1).astype(np.uint64) >= page_size  # (one unsigned comparison)
        bad &= pages > 0
        bad = bad.any()
    if bad:
        i = int(np.argmax(((lpl < 1) | (lpl > page_size)) & (pages > 0)))
        raise ValueError(f"{prefix}last_page_len: request {i} has {int(lpl[i])}, expected 1..page_size ({page_size})")
    kv_lens = pages * page_size
    kv_lens += lpl
    kv_lens -= page_size
    if fewest == 0:
        kv_lens[pages == 0] = 0
    table = HostPageTable(ind, lpl, kv_lens, num_pages_used, prefix=prefix)
    if indices.is_cpu and num_pages_used > first:
        # ids on the host are checked here and against the cache at run(); ids on the GPU are bounded
        # by the kernels (kernels/faults.py)
        # a copy: run() judges the ids the plan saw, whatever the caller does to its tensor afterwards
        ids = indices.reshape(-1)[first:num_pages_used].numpy().copy()
        table.page_ids = ids
        # one reduction: as unsigned integers the negative ids are the largest
        largest = int(ids.view(np.uint32 if ids.dtype == np.int32 else np.uint64).max())
        if largest >= (1 << (8 * ids.itemsize - 1)):
            raise _page_id_error(table, int(np.argmax(ids < 0)), None)
        table.max_page_id = largest
    return table


# CUDA-graph mode of the wrappers with FlashInfer's ``paged_kv_*_buffer`` arguments (decode, POD's
# decode half, MLA decode): the page table the kernels read lives in fixed buffers, kept as the
# wrapper attributes FlashInfer has (engines read and replace them).

def init_graph_page_table(wrapper, use_cuda_graph: bool, indptr_buf: Optional[torch.Tensor],
                          indices_buf: Optional[torch.Tensor], last_page_len_buf: Optional[torch.Tensor]) -> None:
    """Checks the buffers (required with ``use_cuda_graph``) and sets ``_paged_kv_*_buf`` and
    ``_fixed_batch_size`` (0 without CUDA graphs)."""
    wrapper._fixed_batch_size = 0
    if use_cuda_graph:
        check_graph_buffers(wrapper.device, (("paged_kv_indptr_buffer", indptr_buf),
                                             ("paged_kv_indices_buffer", indices_buf),
                                             ("paged_kv_last_page_len_buffer", last_page_len_buf)))
        wrapper._fixed_batch_size = len(last_page_len_buf)
        if len(indptr_buf) != wrapper._fixed_batch_size + 1:
            raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
    wrapper._paged_kv_indptr_buf = indptr_buf
    wrapper._paged_kv_indices_buf = indices_buf
    wrapper._paged_kv_last_page_len_buf = last_page_len_buf


def check_graph_plan(batch: int, fixed_batch: int, num_pages: int = 0, indices_buf: Optional[torch.Tensor] = None,
                     names: Tuple[str, str] = ("indices", "paged_kv_indices_buffer")) -> None:
    """A plan in CUDA-graph mode: the batch size of the constructor's buffers, and ``num_pages`` page
    ids that fit in ``indices_buf`` (``names``: the argument's and the buffer's)."""
    if batch != fixed_batch:
        raise ValueError(
            f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
            f" mismatches the batch size set during initialization {fixed_batch}")
    if indices_buf is not None and num_pages > len(indices_buf):
        raise ValueError(f"{names[0]}: the plan uses {num_pages} pages but {names[1]} holds {len(indices_buf)}")


def copy_graph_page_table(wrapper, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                          num_pages: int, non_blocking: bool) -> None:
    """A plan's page table into the fixed buffers (the first ``num_pages`` ids)."""
    copy_into(wrapper._paged_kv_indptr_buf, indptr, non_blocking)
    copy_into(wrapper._paged_kv_indices_buf[:num_pages], indices[:num_pages], non_blocking)
    copy_into(wrapper._paged_kv_last_page_len_buf, last_page_len, non_blocking)
