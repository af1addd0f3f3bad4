"""Which kernel runs a plan: the one place that chooses between the attention core and a specialised
kernel (today the Gluon prefill for Hopper, ``_hopper.py``).

A route is asked twice: once by ``plan()`` (:meth:`PrefillRoute.at_plan`, with what the plan knows:
device, dtypes, head dims, layout, mask, scores, lengths; it may return the core) and once by
``run()`` (:meth:`PrefillRoute.at_run`, with the call's tensors: strides that a TMA view can read,
sinks, scales). Every gate lives here. The decision says why (``repr``, and a debug record on the
``tritoninfer.route`` logger), and ``tests/test_route.py`` checks each gate on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import numpy as np
import torch

from . import _device, _hopper
from ._options import TensorLayout

log = logging.getLogger("tritoninfer.route")

# TRITONINFER_HOPPER_PREFILL=0 keeps every prefill on the attention core; =force sends every plan the
# Gluon kernel can compute there whatever its query lengths (to measure both sides of HOPPER_MIN_LEN).
_HOPPER_MODE = os.environ.get("TRITONINFER_HOPPER_PREFILL", "1")
HOPPER_PREFILL = _HOPPER_MODE != "0"
HOPPER_FORCE = _HOPPER_MODE == "force"
# mean query tokens per request from which a plan takes the Gluon kernel, by (paged, causal): the
# shortest measured faster than the core on the same KV (benchmarks/NOTES.md, session 6; the paged core
# is slower than the ragged one, so paged plans switch earlier)
HOPPER_MIN_LEN = {(False, False): 1024, (False, True): 4096, (True, False): 512, (True, True): 1024}
# ... for block-sparse plans (a request a block row, its non-zero column blocks its pages): block rows of
# 64 rows, the last one shorter (a mean of 48 admits them whatever M). Measured on the H200 (8K x 8K,
# 64 x 64 blocks, 32/32 heads, no mask; benchmarks/NOTES.md, session 15): 4,287 -> 2,040 us at 50 %
# sparsity, 1,024 -> 513 at 90 % (FlashInfer 2,131 / 510): the core's 64-row tiles reach ~130 TFLOP/s
# on those pages, the Gluon kernel ~270 with half of its tile idle. Not measured: 32-row block rows
BLOCK_SPARSE_MIN_LEN = 48
# POD's prefill half (one request, contiguous K/V) on the Gluon kernel where a single prefill of its shape
# would take it: two launches (the Gluon prefill, then the decode half on the core) instead of both halves
# in one grid of the core's pair kernel. False keeps every POD in one launch (to time both)
POD_PREFILL_ON_HOPPER = True
# Other page sizes (page 1: SGLang's default) in the paged mode with K/V rows gathered by cp.async
# (kernels/prefill_hopper.py's GATHER; False: the core). Session 19, H200: 4 x 4096 causal page 1 3,640 us
# against fa3's 1,199 (its producer waited on one page-id load a sub-tile: 16 dependent round trips a tile);
# session 25: one load a tile, handed on through shared memory. Session 26, H100: 12-22 % faster than the core
# on the grid's three page-1 rows (0.74-0.77x fa3, the core ~0.6). Session 27, H100, on: every prefill GPU test
# (its 6000-token causal case too) and FlashInfer's paged prefill tests (pages 1, 5, 16) pass; 4 x 4096 d128 causal
# page 1 1,463-1,499 us against the core's 1,710, d256 16 x 1024 1,056-1,092 against 1,303 (benchmarks/NOTES.md).
HOPPER_GATHER = True
# e4m3 K/V with bf16 queries on the Gluon kernel (its FP8 mode: a producer warpgroup converts each
# fp8 tile into the consumers' fp16 ring; issue "Speed, part 3", target 4; False: the core). Session 19,
# H200: its GPU tests pass; 4 x 4096 causal at 0.59x of the same kernel's bf16, against the core's fp8 only
# across runs: off until one run measures it faster than the core.
HOPPER_FP8 = False
# DeepSeek's non-absorbed prefill (ragged, head_dim_qk 192 / head_dim_vo 128: issue 22) on the Gluon kernel, Q and
# K in three 64-column chunks (_hopper.qk_chunk, STAGES_192; False: the core). Session 24, H200: its GPU test passes
# (both masks); 1.5-1.9x the core, 0.60-0.65x FlashInfer's fa3 (results/h200/prefill-gluon-d256-192-vs-fa3-s24.md)
HOPPER_192_128 = True
# head_dim 64 (16-bit K/V) on the Gluon kernel with three consumer warpgroups (192-token query tiles,
# _hopper.consumers; False: the core). Session 24, H200: its GPU tests pass (ragged and paged); 1.15-1.64x the core
# on every row of 32/8 page 16 4-16 x 1K-4K, 1.04-1.22x fa3 but causal 4K-length and 16 x 1K rows (0.87-0.92x)
# (results/h200/prefill-d64-gluon3-s24.md)
HOPPER_D64 = True
# head_dim 256 (Gemma's; 16-bit K/V) on the Gluon kernel with 64-position K/V stages (_hopper.kv_tile; False: the
# core). Session 24, H200: its GPU tests pass but the ragged non-causal case, which the bench ran unchecked; 1.8-2.0x
# the core at 4 x 4096, 0.60-0.64x fa3 (results/h200/prefill-gluon-d256-192-vs-fa3-s24.md)
HOPPER_D256 = True
# e4m3 paged decode with grouped-query attention on the Gluon fp8 decode (kernels/decode_hopper.py: a
# producer warpgroup converts each fp8 tile for a wgmma consumer; issue "Speed, part 3", target 2; False:
# the core). Session 22, H200: its GPU tests pass, but it runs ~2.2x slower than the core's fp8 decode (64 x 4096,
# 32/8 and 64/8 heads: 441-444 µs against 198-202); the producer's page-id loads and one-warp conversion bound it
# (benchmarks/NOTES.md, sessions 19 and 22): off.
DECODE_HOPPER_FP8 = False


@dataclasses.dataclass(frozen=True)
class Route:
    """A route's decision: the kernel, why, and (Gluon) the host work list the plan uploads."""

    kernel: str  # "core", "hopper" (the Gluon prefill), "decode_hopper" (the Gluon fp8 decode), "mla_hopper"
    reason: str
    work: Optional[np.ndarray] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def is_core(self) -> bool:
        return self.kernel == "core"

    def __repr__(self) -> str:
        return f"Route({self.kernel}: {self.reason})"


@dataclasses.dataclass(frozen=True)
class PlanFacts:
    """What a prefill ``plan()`` knows when it asks the route."""

    device: torch.device
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim_qk: int
    head_dim_vo: int
    layout: TensorLayout
    use_cuda_graph: bool
    has_mask: bool
    params: object  # _attention.ScoreParams
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    page_size: int  # 0: ragged K/V
    # mean query tokens per request from which the Gluon kernel is taken (None: HOPPER_MIN_LEN's)
    min_len: Optional[int] = None


def core(reason: str) -> Route:
    return Route("core", reason)


def is_sm90(device: torch.device) -> bool:
    """A Hopper GPU (the kernel uses wgmma and TMA as sm_90 has them)."""
    return device.type == "cuda" and _device.has_gpu() and _device.capability(device) == (9, 0)


class PrefillRoute:
    """Prefill (paged and ragged): the Gluon Hopper kernel where it was measured faster than the core
    and tested on the H200 (benchmarks/NOTES.md, sessions 5 and 6), the attention core elsewhere."""

    def at_plan(self, facts: PlanFacts) -> Route:
        route = self._at_plan(facts)
        log.debug("prefill plan: %r", route)
        return route

    def _at_plan(self, f: PlanFacts) -> Route:
        if not HOPPER_PREFILL:
            return core("TRITONINFER_HOPPER_PREFILL=0")
        if not is_sm90(f.device):
            return core("not an sm_90 GPU")
        if not _hopper.gluon_available():
            return core("the Gluon kernel needs Triton 3.6")
        if f.use_cuda_graph:
            return core("CUDA-graph mode (the kernel's grid is not fixed)")
        if f.has_mask:
            return core("custom mask")
        if f.layout != TensorLayout.NHD:
            return core("HND layout")
        fp8 = f.q_dtype == torch.bfloat16 and f.kv_dtype == torch.float8_e4m3fn
        if fp8 and not HOPPER_FP8:
            return core("e4m3 K/V (HOPPER_FP8 is off)")
        if not (f.q_dtype == torch.bfloat16 and (f.kv_dtype == f.q_dtype or fp8)):
            return core("not bf16 q and bf16 or e4m3 K/V")
        if (f.head_dim_qk, f.head_dim_vo) == (192, 128):
            if not HOPPER_192_128 or f.page_size > 0 or fp8:
                return core("head_dim 192 / 128 (the kernel takes it for contiguous 16-bit K/V with HOPPER_192_128)")
        elif f.head_dim_qk == f.head_dim_vo == 64:
            if not HOPPER_D64 or fp8:
                return core("head_dim 64 (the kernel takes it for 16-bit K/V with HOPPER_D64)")
        elif f.head_dim_qk == f.head_dim_vo == 256:
            if not HOPPER_D256 or fp8:
                return core("head_dim 256 (the kernel takes it for 16-bit K/V with HOPPER_D256)")
        elif not f.head_dim_qk == f.head_dim_vo == 128:
            return core("head_dim is not 64, 128, 256 or 192 / 128")
        reason = self.scores_unsupported(f.params)
        if reason:
            return core(reason)
        paged = f.page_size > 0
        kv_tile = _hopper.kv_tile(f.head_dim_qk)
        if paged and _hopper.gather_pages(f.page_size, f.head_dim_qk) and (fp8 or not HOPPER_GATHER):
            return core(f"page size {f.page_size} (TMA boxes take {_hopper.TMA_MIN_PAGE}-{kv_tile}, dividing "
                        f"{kv_tile}; {'the fp8 mode has no gather' if fp8 else 'HOPPER_GATHER is off'})")
        if not paged and int(f.kv_lens.sum()) < kv_tile:
            return core("K/V shorter than one TMA box")
        causal = bool(f.params.causal)
        mean = int(f.qo_lens.sum()) / max(f.qo_lens.size, 1)
        need = HOPPER_MIN_LEN[paged, causal] if f.min_len is None else f.min_len
        if mean < need and not HOPPER_FORCE:
            return core(f"{mean:.0f} query tokens per request on average, below {need}")
        return Route("hopper", f"{'paged' if paged else 'ragged'}, {mean:.0f} query tokens per request",
                     _hopper.work_tiles(f.qo_lens, f.kv_lens, causal, _hopper.query_tile(f.head_dim_qk, fp8)))

    def for_pod(self, facts: PlanFacts) -> Route:
        """POD's prefill half: the route a single prefill of that shape takes, unless
        ``POD_PREFILL_ON_HOPPER`` is off (then the pair kernel runs both halves)."""
        if not POD_PREFILL_ON_HOPPER:
            return core("POD_PREFILL_ON_HOPPER is off (one pair launch)")
        route = self._at_plan(facts)
        log.debug("POD prefill plan: %r", route)
        return route

    @staticmethod
    def scores_unsupported(params) -> str:
        """Why the kernel cannot compute these scores ('' when it can): it has no RoPE, ALiBi, soft
        cap, window or multi-item mask, and folds a positive scale into exp2."""
        if params.multi_item:
            return "multi-item scoring"
        if params.rope or params.alibi:
            return "RoPE or ALiBi"
        if params.logits_soft_cap > 0:
            return "soft cap"
        if params.window_left >= 0:
            return "sliding window"
        if not params.sm_scale > 0:
            return "a scale that is not positive"
        return ""

    def keep_for(self, route: Route, params) -> Route:
        """The route for a step whose scores were replaced after planning (the deprecated ``forward()``):
        the Gluon kernel only if it computes the new scores (its work list was planned already)."""
        if route.is_core:
            return route
        reason = self.scores_unsupported(params)
        return core(f"forward() settings: {reason}") if reason else route

    def at_run(self, route: Route, q: torch.Tensor, kv, *, sinks=None, head_scales=None, scaled: bool = False,
               k_mult: float = 1.0):
        """The Gluon kernel's K/V descriptors for this call, or None: the core runs it. ``kv`` is a
        ``PagedKV`` (paged) or a ``(k, v)`` pair (ragged); ``scaled``: q/k/v scales were passed (the fp8
        mode takes them, the 16-bit one has none), ``k_mult`` their product on the scores (the kernel
        folds the softmax scale into exp2: it must stay positive)."""
        if route.is_core:
            return None
        fp8 = (kv[0] if isinstance(kv, tuple) else kv.k).dtype == torch.float8_e4m3fn
        if sinks is not None or head_scales is not None or (scaled and not fp8):
            why = "sinks, per-head scales or scales of 16-bit K/V"
        elif not k_mult > 0:
            why = "q_scale * k_scale is not positive"
        elif not _hopper.tma_ready(q):
            why = "q's strides do not fit a TMA view"
        else:
            descriptors = _hopper.ragged_descriptors(*kv) if isinstance(kv, tuple) else _hopper.paged_descriptors(kv)
            if descriptors is not None:
                return descriptors
            why = "K/V strides do not fit a TMA view"
        log.debug("prefill run: core (%s)", why)
        return None


PREFILL = PrefillRoute()


def prefill_switches() -> tuple:
    """The module switches ``PREFILL.at_plan`` reads, for a caller that keeps a route's decision per shape
    (``single_prefill_with_kv_cache``'s kept steps and replays): set before any call in serving; tests and
    benchmarks that flip one between calls get a new decision."""
    return (HOPPER_PREFILL, HOPPER_FORCE, HOPPER_FP8, HOPPER_GATHER, HOPPER_192_128, HOPPER_D64, HOPPER_D256,
            id(HOPPER_MIN_LEN))


class DecodeRoute:
    """Paged decode (one query token per request): the Gluon fp8 decode for e4m3 caches under GQA on sm_90
    (``DECODE_HOPPER_FP8``), the attention core elsewhere."""

    def at_plan(self, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, num_qo_heads: int,
                num_kv_heads: int, head_dim: int, page_size: int, params, use_cuda_graph: bool,
                fixed_split_size: Optional[int], split_align: int) -> Route:
        """``split_align``: the plan's KV splits start on multiples of it (its tiles' ``block_n``); the kernel
        reads a split from its first page on."""
        route = self._at_plan(device, q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, page_size, params,
                              use_cuda_graph, fixed_split_size, split_align)
        log.debug("decode plan: %r", route)
        return route

    @staticmethod
    def _at_plan(device, q_dtype, kv_dtype, num_qo_heads, num_kv_heads, head_dim, page_size, params, use_cuda_graph,
                 fixed_split_size, split_align) -> Route:
        group = num_qo_heads // num_kv_heads
        if not DECODE_HOPPER_FP8:
            return core("DECODE_HOPPER_FP8 is off")
        if kv_dtype != torch.float8_e4m3fn or q_dtype not in (torch.float16, torch.bfloat16):
            return core("not an e4m3 cache with 16-bit queries")
        if not is_sm90(device):
            return core("not an sm_90 GPU")
        if not _hopper.gluon_available():
            return core("the Gluon kernel needs Triton 3.6")
        if head_dim != 128:
            return core(f"head_dim {head_dim} (the kernel takes 128)")
        if not 2 <= group <= 64:
            return core(f"a GQA group of {group} (the kernel takes 2 to 64 query heads a KV head)")
        if page_size < _hopper.TMA_MIN_PAGE or _hopper.DECODE_BLOCK_N % page_size:
            return core(f"page size {page_size} (TMA boxes of {_hopper.TMA_MIN_PAGE} to {_hopper.DECODE_BLOCK_N} "
                        f"positions dividing {_hopper.DECODE_BLOCK_N})")
        if use_cuda_graph:
            # (a captured launch would keep reading page ids that later plans write unchecked: the kernel's
            # TMA boxes stay inside the cache but a bad id is not reported, as the core reports it)
            return core("CUDA-graph mode (page ids of later plans go unchecked)")
        if fixed_split_size is not None or split_align % page_size:
            return core("fixed_split_size or splits that need not start on a page")
        reason = PrefillRoute.scores_unsupported(params)  # the two Gluon kernels' scores are the same
        if reason:
            return core(reason)
        return Route("decode_hopper", "e4m3 paged decode under GQA on sm_90")

    @staticmethod
    def at_run(route: Route, q: torch.Tensor, kv, *, sinks=None, k_mult: float = 1.0, q_len_per_req: int = 1):
        """The Gluon fp8 decode's K/V descriptors for this call (``kv`` the ``PagedKV``), or None: the core
        runs it."""
        if route.is_core:
            return None
        if q_len_per_req != 1 or sinks is not None:
            why = "several query tokens per request or sinks"
        elif kv.k.shape[0] == 0:
            why = "a cache without pages (no TMA view)"
        elif not k_mult > 0:
            why = "q_scale * k_scale is not positive"
        elif not q.is_contiguous() or q.data_ptr() % 16:
            why = "q is not contiguous and 16-byte aligned"
        else:
            descriptors = _hopper.paged_descriptors(kv)
            if descriptors is not None:
                return descriptors
            why = "the cache's strides do not fit a TMA view"
        log.debug("decode run: core (%s)", why)
        return None


DECODE = DecodeRoute()


# The Gluon MLA kernel (kernels/mla_hopper.py; False: every MLA plan on kernels/mla.py). Session 17,
# H200, bench mla --quick against the Triton kernel: 128 heads 64 x 8K 931.6 -> 332.2 µs, 16 heads
# 350.4 -> 202.2, four query tokens 64 x 4K 1,833 -> 727, 1 x 8K 35.6 -> 26.7.
MLA_HOPPER = True
# Page sizes the Gluon MLA kernel cannot read by TMA (_hopper.mla_gather_pages; page 1: SGLang's MLA
# cache) on that kernel with rows gathered by cp.async (kernels/mla_hopper.py's GATHER; False:
# kernels/mla.py). Session 19, H200: its 16 GPU tests and FlashInfer's MLA tests pass; bench mla, same
# process as FlashInfer: 128 heads 64 x 4K at page 1 498.0 -> 241.6 µs (fa3 134.6).
MLA_HOPPER_GATHER = True


class MlaRoute:
    """Absorbed MLA: the Gluon kernel for bf16/fp16 latent caches of DeepSeek's 512 / 64 dims, pages of
    8+ positions (a power of two; other pages with ``MLA_HOPPER_GATHER``) and a positive scale, on
    sm_90; ``kernels/mla.py`` elsewhere."""

    def at_plan(self, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_ckv: int,
                head_dim_kpe: int, page_size: int, sm_scale: float) -> Route:
        route = self._at_plan(device, q_dtype, kv_dtype, head_dim_ckv, head_dim_kpe, page_size, sm_scale)
        log.debug("MLA plan: %r", route)
        return route

    @staticmethod
    def _at_plan(device, q_dtype, kv_dtype, head_dim_ckv, head_dim_kpe, page_size, sm_scale) -> Route:
        if not MLA_HOPPER:
            return core("MLA_HOPPER is off")
        if not is_sm90(device):
            return core("not an sm_90 GPU")
        if not _hopper.gluon_available():
            return core("the Gluon kernel needs Triton 3.6")
        if q_dtype not in (torch.float16, torch.bfloat16) or kv_dtype != q_dtype:
            return core("not 16-bit q and latent cache of one dtype")
        if (head_dim_ckv, head_dim_kpe) != (512, 64):
            return core(f"latent dims {head_dim_ckv}/{head_dim_kpe} (the kernel takes 512/64)")
        if not sm_scale > 0:
            return core("a scale that is not positive")
        if _hopper.mla_gather_pages(page_size):
            if not MLA_HOPPER_GATHER:
                return core(f"page size {page_size} (TMA takes powers of two from {_hopper.TMA_MIN_PAGE}; "
                            "MLA_HOPPER_GATHER is off)")
            return Route("hopper", f"bf16/fp16 latent 512/64, page {page_size} gathered")
        return Route("hopper", "bf16/fp16 latent 512/64, paged")

    @staticmethod
    def at_run(route: Route, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> str:
        """Why this call's tensors cannot take the Gluon kernel ('' when they can): q_nope/q_pe whose
        (token, head) rows are evenly spaced ([tokens, H, D] read as a 2-D view [tokens * H, D], also
        as slices of one [tokens, H, 576] query) and caches whose pages are whole rows of a 2-D view,
        16-byte aligned (TMA)."""
        if route.is_core:
            return route.reason
        # each [A, B, D] tensor read as a 2-D view [A * B, D]: rows stride(1) apart (stride(0) when B is
        # 1: page 1's caches), also across dim 0
        for t, name in ((q_nope, "q_nope"), (q_pe, "q_pe"), (ckv, "ckv_cache"), (kpe, "kpe_cache")):
            if (t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1))
                    or (_hopper.row_stride(t) * t.element_size()) % 16 or t.data_ptr() % 16):
                return f"{name}'s rows are not evenly spaced 16-byte-aligned rows of a 2-D view"
        return ""


MLA = MlaRoute()
