"""The paged KV cache of the demo: one tensor for all layers and a page allocator.

``PagedKVCache.data`` is ``[layers, pages, 2, page_size, H_kv, D]``; ``layer(i)`` is the 5-D NHD view
``[pages, 2, page_size, H_kv, D]`` that tritoninfer's wrappers and ``append_paged_kv_cache`` take.
A page id means the same page in every layer, so one page table serves the whole model.

With an fp8 (e4m3) cache, K and V are stored as ``x / scale`` with one static scale per layer and
per tensor (K, V), calibrated on the first prefill; attention gets them as ``k_scale`` / ``v_scale``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["KV_DTYPES", "PageAllocator", "PagedKVCache", "PagedMLACache", "OutOfPages"]

KV_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    """A free list of page ids. ``peak_used`` is the largest number of pages held at once."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages}")
        self.num_pages = num_pages
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> List[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: List[int]) -> None:
        self._free.extend(reversed(pages))
        if len(self._free) > self.num_pages:
            raise RuntimeError("page allocator: more pages freed than allocated")


class PagedKVCache:
    """``[layers, pages, 2, page_size, H_kv, D]`` in ``dtype``, with per-layer fp8 scales."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
        self.is_fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if self.is_fp8:  # zero bytes are +0.0; made as uint8, so no fp8 fill kernel is needed
            self.data = torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)
        # per-layer static scales (fp8 only); None until calibrated
        self.k_scale: Optional[List[float]] = None
        self.v_scale: Optional[List[float]] = None

    def layer(self, i: int) -> torch.Tensor:
        return self.data[i]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.data.element_size()

    def scales(self, i: int):
        """``(k_scale, v_scale)`` for attention: ``(None, None)`` unless fp8."""
        if not self.is_fp8:
            return None, None
        return self.k_scale[i], self.v_scale[i]

    def calibrate(self, i: int, k: torch.Tensor, v: torch.Tensor, headroom: float = 2.0) -> None:
        """Set layer ``i``'s static fp8 scales from these K/V (``headroom * amax / fp8 max``); one
        device sync, done once per layer on the first prefill."""
        if not self.is_fp8:
            return
        if self.k_scale is None:
            self.k_scale = [1.0] * self.num_layers
            self.v_scale = [1.0] * self.num_layers
        fmax = torch.finfo(self.dtype).max
        amax = torch.stack([k.abs().max().float(), v.abs().max().float()]).tolist()
        self.k_scale[i] = headroom * amax[0] / fmax if amax[0] > 0 else 1.0
        self.v_scale[i] = headroom * amax[1] / fmax if amax[1] > 0 else 1.0

    def quantize(self, i: int, k: torch.Tensor, v: torch.Tensor):
        """K/V as stored in layer ``i``: unchanged for fp16/bf16 (cast), ``x / scale`` saturated to
        the fp8 range and rounded in torch for fp8 (see the note in the engine module)."""
        if not self.is_fp8:
            return k.to(self.dtype), v.to(self.dtype)
        fmax = torch.finfo(self.dtype).max
        kq = (k.float() * (1.0 / self.k_scale[i])).clamp_(-fmax, fmax).to(self.dtype)
        vq = (v.float() * (1.0 / self.v_scale[i])).clamp_(-fmax, fmax).to(self.dtype)
        return kq, vq


class PagedMLACache:
    """The latent cache of an MLA model: ``[layers, pages, page_size, kv_lora_rank + rope]`` in one
    buffer, as SGLang keeps it; ``ckv(i)`` / ``kpe(i)`` are layer ``i``'s strided slices
    ``[pages, page_size, kv_lora_rank]`` / ``[pages, page_size, rope]`` that the MLA wrapper and
    ``append_paged_mla_kv_cache`` take. One row per token, shared by every head. fp16/bf16 only
    (``BatchMLAPagedAttentionWrapper`` takes those, as FlashInfer 0.5.3)."""

    is_fp8 = False
    k_scale = v_scale = None

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kv_dtype: the MLA latent cache is fp16 or bf16, got {dtype}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_lora_rank, self.rope_dim, self.dtype = kv_lora_rank, rope_dim, dtype
        self.data = torch.zeros(num_layers, num_pages, page_size, kv_lora_rank + rope_dim, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)

    def ckv(self, i: int) -> torch.Tensor:
        return self.data[i, :, :, : self.kv_lora_rank]

    def kpe(self, i: int) -> torch.Tensor:
        return self.data[i, :, :, self.kv_lora_rank:]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * (self.kv_lora_rank + self.rope_dim) * self.data.element_size()

    def scales(self, i: int):
        return None, None

    def calibrate(self, i: int, *latents) -> None:
        """No scales to calibrate (no fp8 form)."""
