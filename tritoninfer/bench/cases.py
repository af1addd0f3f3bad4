"""Inputs for one shape: a paged (or ragged) KV cache with shuffled pages, queries, page tables.

Built on the device with the device's random generator: benchmark caches reach tens of GB, which
``tritoninfer.testing.make_paged_kv`` (float32 data drawn on the CPU, a Python loop per request)
cannot build in reasonable time. Same conventions as ``make_paged_kv``: 5-D cache
``[P, 2, page, H, D]`` (NHD) or ``[P, 2, H, page, D]`` (HND), pages in random order, int32 CSR
page table, random data (never zeros) everywhere including unused slots.

Small inputs are made in several copies (``ncopies``) so that timed calls rotate among them and
no call finds its inputs in L2 left there by the previous one. Page tables are shared by all
copies: every provider plans once and runs on any copy.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .shapes import FP8, Shape, bytes_moved

# Generate fp8 data through bf16 in chunks of this many bytes (bounds the temporary).
_CHUNK_BYTES = 256 << 20


def num_copies(shape: Shape, l2_bytes: int, gpu: bool) -> int:
    """How many input copies the timed calls rotate among: enough that the calls of one CUDA
    graph touch more than 3× the L2 between two uses of the same copy (1 when one call alone
    does, and always 1 on the CPU)."""
    if not gpu:
        return 1
    moved = max(1, bytes_moved(shape))
    target = 3 * l2_bytes
    if moved >= target:
        return 1
    return int(min(512, -(-target // moved)))


def random_tensor(shape, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """Standard normal data of ``dtype`` (fp8 through bf16, chunked over dim 0)."""
    if dtype not in FP8:
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    flat = out.view(out.shape[0], -1)
    rows = max(1, _CHUNK_BYTES // max(1, flat.shape[1] * 2))
    for start in range(0, flat.shape[0], rows):
        stop = min(flat.shape[0], start + rows)
        flat[start:stop] = torch.randn((stop - start, flat.shape[1]), dtype=torch.bfloat16, device=device, generator=gen).to(dtype)
    return out


def _i32(values, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=device)


class PageTable:
    """An int32 CSR page table for ``batch`` requests of ``kv_len`` tokens each, over pages
    ``physical[b, j]`` (logical page ``j`` of request ``b``).

    Host copies (``*_h``) are what engines pass to ``plan()``; ``kv_indices`` lives on the device.
    """

    def __init__(self, physical: torch.Tensor, kv_len: int, page_size: int, device) -> None:
        batch, npages = physical.shape
        self.physical = physical  # [B, pages] int64, device
        self.kv_len = kv_len
        self.page_size = page_size
        self.batch = batch
        self.kv_indptr_h = _i32([i * npages for i in range(batch + 1)], "cpu")
        last = kv_len - (npages - 1) * page_size if npages else 0
        self.kv_last_page_len_h = _i32([last] * batch, "cpu")
        self.kv_indices = physical.reshape(-1).to(torch.int32).contiguous()
        self.kv_indptr = self.kv_indptr_h.to(device)
        self.kv_last_page_len = self.kv_last_page_len_h.to(device)


class Case:
    """Every input of one shape, in ``ncopies`` copies where they are large per call.

    Attributes set for every paged workload: ``cache`` (list of 5-D caches), ``table``
    (:class:`PageTable`), ``q`` (list of ``[batch*qo_len, H_qo, D]``), ``qo_indptr_h``/``qo_indptr``.
    Ragged prefill: ``k``, ``v`` (lists of ``[batch*kv_len, H_kv, D]``), ``kv_indptr_h``.
    Cascade: ``levels`` (two :class:`PageTable`-like level tables: the shared prefix, then the
    unique suffixes), ``qo_indptr_levels_h`` and ``table`` = the flat table (shared pages repeated
    in every request), ``flat_kv_len``.
    Append: ``append_key``, ``append_value`` (lists), ``batch_indices``, ``positions``.
    """

    def __init__(self, shape: Shape, device: torch.device, ncopies: int = 1, seed: int = 0) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.ncopies = ncopies
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._gen = gen
        s = shape
        B = s.batch
        dev = self.device
        self.qo_indptr_h = _i32([i * s.qo_len for i in range(B + 1)], "cpu")
        self.qo_indptr = self.qo_indptr_h.to(dev)

        if s.workload != "append":
            self.q = [random_tensor((s.total_q, s.num_qo_heads, s.head_dim), s.q_dtype, dev, gen) for _ in range(ncopies)]

        if s.kv_form == "ragged":
            n = B * s.kv_len
            self.kv_indptr_h = _i32([i * s.kv_len for i in range(B + 1)], "cpu")
            self.kv_indptr = self.kv_indptr_h.to(dev)
            self.k = [random_tensor((n, s.num_kv_heads, s.head_dim), s.kv_dtype, dev, gen) for _ in range(ncopies)]
            self.v = [random_tensor((n, s.num_kv_heads, s.head_dim), s.kv_dtype, dev, gen) for _ in range(ncopies)]
            return

        npages = s.num_pages
        perm = torch.randperm(npages, device=dev, generator=gen)
        cache_copies = 1 if s.workload == "append" else ncopies
        self.cache = [random_tensor(self._cache_shape(npages), s.kv_dtype, dev, gen) for _ in range(cache_copies)]

        if s.workload == "cascade":
            ns = s.shared_len // s.page_size
            nu = s.pages_per_request
            shared = perm[:ns]
            unique = perm[ns:].view(B, nu)
            self.levels = [
                PageTable(shared.view(1, ns), s.shared_len, s.page_size, dev),
                PageTable(unique, s.kv_len, s.page_size, dev),
            ]
            self.qo_indptr_levels_h = [_i32([0, s.total_q], "cpu"), self.qo_indptr_h]
            self.flat_kv_len = s.shared_len + s.kv_len
            self.table = PageTable(torch.cat([shared.view(1, ns).expand(B, ns), unique], dim=1),
                                   self.flat_kv_len, s.page_size, dev)
        else:
            self.table = PageTable(perm.view(B, s.pages_per_request), s.kv_len, s.page_size, dev)

        if s.workload == "append":
            nnz = B * s.qo_len
            shape_kv = (nnz, s.num_kv_heads, s.head_dim)
            self.append_key = [random_tensor(shape_kv, s.kv_dtype, dev, gen) for _ in range(ncopies)]
            self.append_value = [random_tensor(shape_kv, s.kv_dtype, dev, gen) for _ in range(ncopies)]
            b = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(s.qo_len)
            pos = torch.arange(s.kv_len - s.qo_len, s.kv_len, device=dev, dtype=torch.int32).repeat(B)
            self.batch_indices, self.positions = b.contiguous(), pos.contiguous()

    # ---- helpers ---------------------------------------------------------------------------------
    def _cache_shape(self, npages: int) -> Tuple[int, ...]:
        s = self.shape
        inner = (s.page_size, s.num_kv_heads) if s.layout == "NHD" else (s.num_kv_heads, s.page_size)
        return (npages, 2) + inner + (s.head_dim,)

    @staticmethod
    def pick(items: List, i: int):
        """Copy ``i`` (modulo the number of copies) of a per-copy list."""
        return items[i % len(items)]

    def kv_views(self, i: int = 0, cache: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of copy ``i`` (or of ``cache``, a tensor like it) as ``[pages, page_size, H, D]``
        views (NHD whatever the layout); writes go through to the cache."""
        cache = self.pick(self.cache, i) if cache is None else cache
        k, v = cache[:, 0], cache[:, 1]
        if self.shape.layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k, v

    def contiguous_kv(self, i: int = 0, table: Optional[PageTable] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of copy ``i`` gathered through the page table into contiguous
        ``[batch, H_kv, kv_len, D]`` tensors (what SDPA and non-paged FlexAttention take)."""
        s = self.shape
        if s.kv_form == "ragged":
            k = self.pick(self.k, i).view(s.batch, s.kv_len, s.num_kv_heads, s.head_dim)
            v = self.pick(self.v, i).view(s.batch, s.kv_len, s.num_kv_heads, s.head_dim)
            return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        table = table or self.table
        out = []
        for pages in self.kv_views(i):
            g = pages[table.physical]  # [B, n, page, H, D]
            B, n = table.physical.shape
            g = g.reshape(B, n * s.page_size, s.num_kv_heads, s.head_dim)[:, : table.kv_len]
            out.append(g.transpose(1, 2).contiguous())
        return out[0], out[1]

    def q_bhsd(self, i: int = 0) -> torch.Tensor:
        """Queries of copy ``i`` as ``[batch, H_qo, qo_len, D]`` (contiguous)."""
        s = self.shape
        q = self.pick(self.q, i).view(s.batch, s.qo_len, s.num_qo_heads, s.head_dim)
        return q.transpose(1, 2).contiguous()
