"""The implementations a benchmark row can time: small classes with ``setup(case) -> Runner``.

tritoninfer and FlashInfer are driven by the *same* classes through FlashInfer 0.5.3's public API
(``lib`` names the package), so a tritoninfer name starts appearing in the tables the day it
exists, with no change here. Until then its rows say "not implemented".

=================  ==========================================================================
name               what runs
=================  ==========================================================================
tritoninfer        ``tritoninfer.decode.BatchDecodeWithPagedKVCacheWrapper`` (decode),
                   ``tritoninfer.prefill.BatchPrefillWith{Paged,Ragged}KVCacheWrapper``,
                   ``tritoninfer.page.append_paged_kv_cache``,
                   ``tritoninfer.cascade.MultiLevelCascadeAttentionWrapper``
flashinfer-tc      FlashInfer decode, ``use_tensor_cores=True``
flashinfer-cc      FlashInfer decode, ``use_tensor_cores=False`` (CUDA cores)
flashinfer-fa2/3   FlashInfer prefill (paged or ragged), ``backend="fa2"`` / ``"fa3"``
flashinfer         FlashInfer append / cascade
flashinfer-flat    cascade shapes without cascade: FlashInfer decode (tensor cores) or fa2 prefill
                   over each request's full page table (shared pages repeated)
flex               ``torch.compile(flex_attention)`` over the paged cache through a block mask
                   whose KV blocks are pages (falls back to contiguous KV, and says so)
flex-contig        the same on K/V gathered into contiguous tensors (opt-in)
sdpa               ``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V
reference          ``tritoninfer.reference`` (pure PyTorch, float32; small shapes only)
=================  ==========================================================================
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .cases import Case
from .shapes import FP8, Shape, cache_bytes


class Refused(Exception):
    """A provider declines a shape it cannot run; the message says why."""


class Skipped(Exception):
    """The bench chose not to run a provider on a shape (e.g. too large for the reference)."""


@dataclass
class Runner:
    """What ``Provider.setup`` returns.

    run(i)   one call on input copy ``i``: what is timed.
    check()  one call on copy 0 that returns the output to compare, in the canonical layout
             ``[tokens, H_qo, D]`` (append: the appended slots read back, ``[tokens, 2, H_kv, D]``).
    plan()   the host-side planning step, if the API has one (already called once by ``setup``).
    """

    run: Callable[[int], object]
    check: Callable[[], torch.Tensor]
    plan: Optional[Callable[[], None]] = None
    graphable: bool = True
    impl: str = ""  # replaces the provider's description for this shape when set


class Provider:
    name = ""
    impl = ""
    workloads: Tuple[str, ...] = ()

    def unavailable(self, device: torch.device) -> Optional[str]:
        """``None`` when the provider can run here, else the reason ("not installed: ...")."""
        return None

    def setup(self, case: Case) -> Runner:  # pragma: no cover - interface
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# FlashInfer's API, for tritoninfer and FlashInfer alike
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _import_status(lib: str) -> Optional[str]:
    try:
        importlib.import_module(lib)
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def flashinfer_version() -> Optional[str]:
    """The installed flashinfer's version, without importing it (None if absent)."""
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _api(lib: str, module: str, name: str):
    """``lib.module.name``; a missing tritoninfer name means "not implemented"."""
    try:
        mod = importlib.import_module(f"{lib}.{module}")
    except ImportError as exc:
        if lib == "tritoninfer":
            raise NotImplementedError(f"tritoninfer.{module} cannot be imported: {exc}") from exc
        raise
    obj = getattr(mod, name, None)
    if obj is None:
        raise NotImplementedError(f"{lib}.{module}.{name} does not exist yet")
    return obj


def _nan_out(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


class _ApiProvider(Provider):
    """Common part of the FlashInfer-API drivers: the library and a workspace per device."""

    workspace_bytes = 128 << 20

    def __init__(self, name: str, lib: str, impl: str) -> None:
        self.name, self.lib, self.impl = name, lib, impl
        self._workspace: Dict[str, torch.Tensor] = {}

    def unavailable(self, device: torch.device) -> Optional[str]:
        if self.lib == "tritoninfer":
            return None
        if device.type != "cuda":
            return "not installed: needs a CUDA GPU"
        status = _import_status(self.lib)
        return None if status is None else f"not installed: {status}"

    def workspace(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._workspace:
            nbytes = self.workspace_bytes if device.type == "cuda" else 16 << 20
            self._workspace[key] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return self._workspace[key]


class ApiDecode(_ApiProvider):
    workloads = ("decode",)

    def __init__(self, name: str, lib: str, use_tensor_cores: bool) -> None:
        super().__init__(name, lib, f"BatchDecodeWithPagedKVCacheWrapper, use_tensor_cores={use_tensor_cores}")
        self.use_tensor_cores = use_tensor_cores

    def setup(self, case: Case) -> Runner:
        s, t = case.shape, case.table
        cls = _api(self.lib, "decode", "BatchDecodeWithPagedKVCacheWrapper")
        w = cls(self.workspace(case.device), kv_layout=s.layout, use_tensor_cores=self.use_tensor_cores)

        def plan():
            w.plan(t.kv_indptr_h, t.kv_indices, t.kv_last_page_len_h, s.num_qo_heads, s.num_kv_heads,
                   s.head_dim, s.page_size, q_data_type=s.q_dtype, kv_data_type=s.kv_dtype)

        plan()

        def run(i):
            return w.run(case.pick(case.q, i), case.pick(case.cache, i))

        def check():
            return w.run(case.q[0], case.cache[0], out=_nan_out(case.q[0]))

        return Runner(run, check, plan)


class ApiPrefill(_ApiProvider):
    workloads = ("prefill",)
    workspace_bytes = 256 << 20  # 128 MiB overflowed on large fp8 causal prefills (flashinfer-api.md)

    def __init__(self, name: str, lib: str, backend: Optional[str]) -> None:
        super().__init__(name, lib, "BatchPrefillWith*KVCacheWrapper" + (f", backend={backend!r}" if backend else ""))
        self.backend = backend

    def setup(self, case: Case) -> Runner:
        s = case.shape
        if self.lib == "flashinfer" and self.backend == "fa3" and s.kv_form == "paged" and s.layout == "HND":
            # Seen on the H200 with 0.5.3: a wrong result, then a floating-point exception that can take
            # the whole process down (shared/reference/flashinfer-api.md, appendix).
            raise Refused("FlashInfer 0.5.3's fa3 backend with the HND layout gives wrong results, then crashes")
        kw = {"backend": self.backend} if self.backend else {}
        dt = dict(q_data_type=s.q_dtype, kv_data_type=s.kv_dtype)
        if s.kv_form == "ragged":
            cls = _api(self.lib, "prefill", "BatchPrefillWithRaggedKVCacheWrapper")
            w = cls(self.workspace(case.device), kv_layout="NHD", **kw)

            def plan():
                w.plan(case.qo_indptr_h, case.kv_indptr_h, s.num_qo_heads, s.num_kv_heads, s.head_dim,
                       causal=s.causal, **dt)

            def run(i):
                return w.run(case.pick(case.q, i), case.pick(case.k, i), case.pick(case.v, i))

            def check():
                return w.run(case.q[0], case.k[0], case.v[0], out=_nan_out(case.q[0]))

            impl = "BatchPrefillWithRaggedKVCacheWrapper" + (f", backend={self.backend!r}" if self.backend else "")
        else:
            t = case.table
            cls = _api(self.lib, "prefill", "BatchPrefillWithPagedKVCacheWrapper")
            w = cls(self.workspace(case.device), kv_layout=s.layout, **kw)

            def plan():
                w.plan(case.qo_indptr_h, t.kv_indptr_h, t.kv_indices, t.kv_last_page_len_h, s.num_qo_heads,
                       s.num_kv_heads, s.head_dim, s.page_size, causal=s.causal, **dt)

            def run(i):
                return w.run(case.pick(case.q, i), case.pick(case.cache, i))

            def check():
                return w.run(case.q[0], case.cache[0], out=_nan_out(case.q[0]))

            impl = "BatchPrefillWithPagedKVCacheWrapper" + (f", backend={self.backend!r}" if self.backend else "")
        plan()
        return Runner(run, check, plan, impl=impl)


class ApiCascade(_ApiProvider):
    workloads = ("cascade",)
    workspace_bytes = 256 << 20

    def __init__(self, name: str, lib: str) -> None:
        super().__init__(name, lib, "MultiLevelCascadeAttentionWrapper, 2 levels (shared prefix, unique suffix)")

    def setup(self, case: Case) -> Runner:
        s = case.shape
        cls = _api(self.lib, "cascade", "MultiLevelCascadeAttentionWrapper")
        w = cls(2, self.workspace(case.device), kv_layout=s.layout)
        lv = case.levels

        def plan():
            w.plan(case.qo_indptr_levels_h, [x.kv_indptr_h for x in lv], [x.kv_indices for x in lv],
                   [x.kv_last_page_len_h for x in lv], s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size,
                   causal=s.causal, q_data_type=s.q_dtype, kv_data_type=s.kv_dtype)

        plan()

        def run(i):
            return w.run(case.pick(case.q, i), case.pick(case.cache, i))

        return Runner(run, lambda: run(0), plan)


class ApiCascadeFlat(_ApiProvider):
    """Cascade shapes attended the plain way, over each request's full page table."""

    workloads = ("cascade",)
    workspace_bytes = 256 << 20

    def __init__(self, name: str, lib: str) -> None:
        super().__init__(name, lib, "no cascade: each request's full page table (shared pages repeated)")

    def setup(self, case: Case) -> Runner:
        s, t = case.shape, case.table
        ws = self.workspace(case.device)
        if s.qo_len == 1:
            w = _api(self.lib, "decode", "BatchDecodeWithPagedKVCacheWrapper")(ws, kv_layout=s.layout, use_tensor_cores=True)
            impl = "no cascade: decode (use_tensor_cores=True) over the full page tables"

            def plan():
                w.plan(t.kv_indptr_h, t.kv_indices, t.kv_last_page_len_h, s.num_qo_heads, s.num_kv_heads,
                       s.head_dim, s.page_size, q_data_type=s.q_dtype, kv_data_type=s.kv_dtype)
        else:
            w = _api(self.lib, "prefill", "BatchPrefillWithPagedKVCacheWrapper")(ws, kv_layout=s.layout, backend="fa2")
            impl = "no cascade: prefill fa2 over the full page tables"

            def plan():
                w.plan(case.qo_indptr_h, t.kv_indptr_h, t.kv_indices, t.kv_last_page_len_h, s.num_qo_heads,
                       s.num_kv_heads, s.head_dim, s.page_size, causal=s.causal, q_data_type=s.q_dtype,
                       kv_data_type=s.kv_dtype)

        plan()

        def run(i):
            return w.run(case.pick(case.q, i), case.pick(case.cache, i))

        return Runner(run, lambda: run(0), plan, impl=impl)


def _appended_slots(case: Case):
    """Page ids and slots of the appended tokens (for poisoning and reading back)."""
    s, t = case.shape, case.table
    b = case.batch_indices.long()
    pos = case.positions.long()
    pages = t.physical[b, pos // s.page_size]
    return pages, pos % s.page_size


def _poison(view: torch.Tensor, pages, slots) -> None:
    if view.dtype in FP8:
        view.view(torch.uint8)[pages, slots] = 0x7F  # NaN in both e4m3fn and e5m2
    else:
        view[pages, slots] = float("nan")


def read_appended(case: Case, cache: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The appended slots of ``cache`` (default: copy 0) as float32 ``[tokens, 2, H_kv, D]``."""
    k, v = case.kv_views(0, cache)
    pages, slots = _appended_slots(case)
    return torch.stack([k[pages, slots].float(), v[pages, slots].float()], dim=1)


class ApiAppend(_ApiProvider):
    workloads = ("append",)

    def __init__(self, name: str, lib: str) -> None:
        super().__init__(name, lib, "append_paged_kv_cache")

    def setup(self, case: Case) -> Runner:
        s, t = case.shape, case.table
        fn = _api(self.lib, "page", "append_paged_kv_cache")

        def run(i):
            return fn(case.pick(case.append_key, i), case.pick(case.append_value, i), case.batch_indices,
                      case.positions, case.cache[0], t.kv_indices, t.kv_indptr, t.kv_last_page_len,
                      kv_layout=s.layout)

        def check():
            pages, slots = _appended_slots(case)
            for view in case.kv_views(0):
                _poison(view, pages, slots)
            run(0)
            return read_appended(case)

        return Runner(run, check, None)


# --------------------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------------------


class Reference(Provider):
    name = "reference"
    impl = "tritoninfer.reference (pure PyTorch, float32)"
    workloads = ("decode", "prefill", "append", "cascade")

    def __init__(self, max_tokens: int = 65536, max_scores: int = 1 << 30) -> None:
        self.max_tokens = max_tokens
        self.max_scores = max_scores

    def too_large(self, s: Shape) -> Optional[str]:
        if s.kv_tokens > self.max_tokens:
            return f"{s.kv_tokens} KV tokens > --ref-max-tokens {self.max_tokens}"
        kv = s.kv_len + s.shared_len
        if s.qo_len * kv * s.num_qo_heads > self.max_scores:
            return f"{s.qo_len}×{kv}×{s.num_qo_heads} float32 scores per request are too many"
        return None

    def setup(self, case: Case) -> Runner:
        from .. import reference as ref

        s = case.shape
        reason = self.too_large(s)
        if reason:
            raise Skipped(f"too large for the reference ({reason})")
        if s.workload == "append":
            t = case.table

            def run(i):
                return ref.append_paged_kv_cache(
                    case.pick(case.append_key, i), case.pick(case.append_value, i), case.batch_indices,
                    case.positions, case.cache[0], t.kv_indices, t.kv_indptr, t.kv_last_page_len, s.layout)

            return Runner(run, lambda: read_appended(case, run(0)), None, graphable=False,
                          impl="tritoninfer.reference.append_paged_kv_cache (returns an updated copy)")

        def attend(i, table=None):
            q = case.pick(case.q, i)
            if s.kv_form == "ragged":
                return ref.batch_prefill_with_ragged_kv_cache(q, case.pick(case.k, i), case.pick(case.v, i),
                                                              case.qo_indptr, case.kv_indptr, causal=s.causal)[0]
            t = case.table  # for cascade: the flat table
            cache = case.pick(case.cache, i)
            if s.qo_len == 1 and not s.causal:
                return ref.batch_decode_with_paged_kv_cache(q, cache, t.kv_indptr, t.kv_indices,
                                                            t.kv_last_page_len, s.layout)[0]
            return ref.batch_prefill_with_paged_kv_cache(q, case.qo_indptr, cache, t.kv_indptr, t.kv_indices,
                                                         t.kv_last_page_len, s.layout, causal=s.causal)[0]

        impl = self.impl + (" over the full page tables" if s.workload == "cascade" else "")
        return Runner(attend, lambda: attend(0), None, graphable=False, impl=impl)


# --------------------------------------------------------------------------------------------------
# PyTorch peers: SDPA and FlexAttention
# --------------------------------------------------------------------------------------------------


def _ensure_room(device: torch.device, nbytes: int, what: str) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.9 * free:
        raise Refused(f"{what} needs {nbytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")


def _from_bhsd(out: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[B*S, H, D]`` (FlashInfer's ragged layout)."""
    B, H, S, D = out.shape
    return out.transpose(1, 2).reshape(B * S, H, D)


class Sdpa(Provider):
    name = "sdpa"
    impl = "F.scaled_dot_product_attention, contiguous K/V"
    workloads = ("decode", "prefill")

    def setup(self, case: Case) -> Runner:
        import torch.nn.functional as F

        s = case.shape
        if s.kv_dtype in FP8:
            raise Refused("SDPA takes no fp8 K/V")
        if s.kv_dtype != s.q_dtype:
            raise Refused("SDPA needs K/V in the q dtype")
        _ensure_room(case.device, case.ncopies * cache_bytes(s) * 3 // 2, "gathering contiguous K/V")
        qs = [case.q_bhsd(i) for i in range(case.ncopies)]
        kvs = [case.contiguous_kv(i) for i in range(case.ncopies)]
        kw: Dict[str, object] = {}
        if s.causal:
            if s.qo_len == s.kv_len:
                kw["is_causal"] = True
            else:
                from torch.nn.attention.bias import causal_lower_right

                kw["attn_mask"] = causal_lower_right(s.qo_len, s.kv_len)
        impl = self.impl + (", gathered from the pages" if s.kv_form == "paged" else "")
        gqa = s.num_qo_heads != s.num_kv_heads
        if gqa:
            kw["enable_gqa"] = True
            if case.device.type == "cuda" and not _sdpa_fused_ok(F, qs[0], *kvs[0], kw):
                # No fused kernel takes GQA here: repeat the KV heads (as the peers table did).
                kw.pop("enable_gqa")
                _ensure_room(case.device, case.ncopies * cache_bytes(s) * s.group, "repeating KV heads")
                kvs = [(k.repeat_interleave(s.group, dim=1), v.repeat_interleave(s.group, dim=1)) for k, v in kvs]
                impl += f", KV heads repeated to {s.num_qo_heads}"
            else:
                impl += ", enable_gqa=True"

        def run(i):
            k, v = kvs[i % len(kvs)]
            return F.scaled_dot_product_attention(qs[i % len(qs)], k, v, **kw)

        return Runner(run, lambda: _from_bhsd(run(0)), None, impl=impl)


def _sdpa_fused_ok(F, q, k, v, kw) -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, **kw)
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def _flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    import torch._dynamo

    # One compiled variant per shape: lift the recompile limit (past it torch silently runs eager).
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 4096))
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1 << 16)
    return torch.compile(flex_attention, dynamic=False)


def _from_kv_blocks(*args, **kwargs):
    from torch.nn.attention.flex_attention import BlockMask

    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        kwargs["compute_q_blocks"] = False  # forward only; avoids densifying the physical indices
    return BlockMask.from_kv_blocks(*args, **kwargs)


Q_BLOCK = 128  # FlexAttention's default sparse query block


def paged_block_mask(case: Case):
    """A FlexAttention ``BlockMask`` whose KV blocks are the cache's pages.

    The whole 5-D cache is viewed as one token sequence of ``2*P`` pages (K page ``p`` at block
    ``2p``, its V page at block ``2p+1``); the value tensor is the same view shifted by one page,
    so block ``2p`` of both is page ``p``'s K and V. Each request's rows list its pages' blocks;
    pages every query of a row block sees completely are "full" blocks (no mask_mod), the rest
    are partial and go through ``mask_mod``, which maps a physical position back to the request's
    logical position (as ``torch.nn.attention.experimental._paged_attention`` does).

    Returns ``(block_mask, physical_tokens)``.
    """
    s, t = case.shape, case.table
    dev = case.device
    page, qo, kv = s.page_size, s.qo_len, s.kv_len
    B, n = t.physical.shape
    rows = -(-qo // Q_BLOCK)
    j = torch.arange(n, device=dev)
    first_tok = j * page
    page_end = torch.clamp((j + 1) * page, max=kv)  # one past the page's last valid token
    whole = ((j + 1) * page <= kv)[None, :]
    r = torch.arange(rows, device=dev)
    offset = kv - qo
    q_lo = r * Q_BLOCK + offset
    q_hi = torch.clamp((r + 1) * Q_BLOCK, max=qo) - 1 + offset
    if s.causal:
        visible = first_tok[None, :] <= q_hi[:, None]
        full = visible & whole & (page_end[None, :] - 1 <= q_lo[:, None])
    else:
        visible = torch.ones((rows, n), dtype=torch.bool, device=dev)
        full = whole.expand(rows, n)
    partial = visible & ~full
    blocks = (2 * t.physical).to(torch.int32)  # [B, n]
    nblocks = 2 * case.cache[0].shape[0]
    tokens = (nblocks - 1) * page  # the K view's length (the V view is shifted by one page)
    # As torch's own paged attention does, the index lists are as wide as the physical sequence has
    # blocks (the CPU lowering asserts it); only the first ``num`` entries of a row are read.
    width = max(n, nblocks - 1)
    _ensure_room(dev, 2 * B * rows * width * 4, "the paged block mask")

    def pack(sel):
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True)  # selected pages first
        idx = torch.zeros((B, 1, rows, width), dtype=torch.int32, device=dev)
        idx[:, 0, :, :n] = blocks[:, order]
        num = sel.sum(dim=1).to(torch.int32).view(1, 1, rows).expand(B, 1, rows).contiguous()
        return num, idx

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)

    owner = torch.full((nblocks,), -1, dtype=torch.int32, device=dev)
    logical = torch.zeros((nblocks,), dtype=torch.int32, device=dev)
    flat_blocks = blocks.reshape(-1).long()
    owner[flat_blocks] = torch.arange(B, device=dev, dtype=torch.int32).repeat_interleave(n)
    logical[flat_blocks] = j.to(torch.int32).repeat(B)
    causal = s.causal

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // page
        pos = logical[blk] * page + kv_idx % page
        keep = (owner[blk] == b) & (pos < kv)
        if causal:
            keep = keep & (pos <= q_idx + offset)
        return keep

    bm = _from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, page), mask_mod=mask_mod,
                         seq_lengths=(qo, tokens))
    return bm, tokens


class Flex(Provider):
    """FlexAttention, compiled on the GPU (eager on the CPU, where compiling takes minutes).

    ``paged=True`` reads the paged cache in place through :func:`paged_block_mask`; where that is
    impossible (page size not a multiple of 16) or fails, it runs on gathered contiguous K/V and
    the row's impl says so.
    """

    workloads = ("decode", "prefill")

    def __init__(self, name: str, paged: bool) -> None:
        self.name = name
        self.paged = paged
        self.impl = "flex_attention, paged block mask" if paged else "flex_attention, contiguous K/V"
        self._paged_failed: Dict[str, str] = {}

    def setup(self, case: Case) -> Runner:
        s = case.shape
        if s.kv_dtype in FP8 or s.kv_dtype != s.q_dtype:
            raise Refused("FlexAttention needs K/V in the q dtype (no fp8)")
        compiled = case.device.type == "cuda"
        fn = _flex_fn(compiled)
        suffix = "" if compiled else " (eager: CPU)"
        if self.paged and s.kv_form == "paged":
            why = self._paged_failed.get(s.workload)
            if s.page_size % 16:
                why = f"page size {s.page_size} is not a multiple of 16"
            if why is None:
                try:
                    runner = self._paged_runner(case, fn)
                    runner.check()  # compiles: a failure here falls back to contiguous
                    runner.impl += suffix
                    return runner
                except Refused:
                    raise
                except Exception as exc:
                    why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
                    self._paged_failed[s.workload] = why
                    if case.device.type == "cuda":
                        torch.cuda.synchronize()
            runner = self._contiguous_runner(case, fn)
            runner.impl = f"flex_attention, contiguous K/V (paged block mask not used: {why})" + suffix
            return runner
        runner = self._contiguous_runner(case, fn)
        if s.kv_form == "ragged":
            runner.impl = "flex_attention, ragged K/V (contiguous)"
        runner.impl += suffix
        return runner

    def _paged_runner(self, case: Case, fn) -> Runner:
        s = case.shape
        bm, tokens = paged_block_mask(case)
        kvs = []
        for i in range(len(case.cache)):
            cache = case.cache[i]
            if s.layout == "HND":  # token-major copy: [P, 2, page, H, D]
                _ensure_room(case.device, cache.numel() * cache.element_size(), "an NHD copy of the HND cache")
                cache = cache.permute(0, 1, 3, 2, 4).contiguous()
            flat = cache.view(-1, s.num_kv_heads, s.head_dim)  # [2*P*page, H, D]: K and V pages alternate
            k = flat[:tokens].permute(1, 0, 2).unsqueeze(0)  # [1, H, tokens, D]
            v = flat[s.page_size: s.page_size + tokens].permute(1, 0, 2).unsqueeze(0)
            kvs.append((k, v))
        qs = [case.q_bhsd(i) for i in range(case.ncopies)]
        kw = dict(block_mask=bm, enable_gqa=s.num_qo_heads != s.num_kv_heads)
        if s.qo_len >= 128 and s.page_size < 128 and case.device.type == "cuda":
            kw["kernel_options"] = {"BLOCK_N": s.page_size}  # the prefill kernel's KV tile must divide a page

        def run(i):
            k, v = kvs[i % len(kvs)]
            return fn(qs[i % len(qs)], k, v, **kw)

        impl = self.impl + (", HND cache copied token-major" if s.layout == "HND" else "")
        return Runner(run, lambda: _from_bhsd(run(0)), None, impl=impl)

    def _contiguous_runner(self, case: Case, fn) -> Runner:
        s = case.shape
        _ensure_room(case.device, case.ncopies * cache_bytes(s) * 3 // 2, "gathering contiguous K/V")
        qs = [case.q_bhsd(i) for i in range(case.ncopies)]
        kvs = [case.contiguous_kv(i) for i in range(case.ncopies)]
        kw: Dict[str, object] = dict(enable_gqa=s.num_qo_heads != s.num_kv_heads)
        if s.causal:
            from torch.nn.attention.flex_attention import create_block_mask

            offset = s.kv_len - s.qo_len

            def causal_mod(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

            kw["block_mask"] = create_block_mask(causal_mod, None, None, s.qo_len, s.kv_len, device=case.device)

        def run(i):
            k, v = kvs[i % len(kvs)]
            return fn(qs[i % len(qs)], k, v, **kw)

        return Runner(run, lambda: _from_bhsd(run(0)), None, impl="flex_attention, contiguous K/V")


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------

DEFAULT_OFF = ("flex-contig",)


def registry(workload: str, ref_max_tokens: int = 65536) -> List[Provider]:
    """Every provider of a workload, tritoninfer first."""
    if workload == "decode":
        return [
            ApiDecode("tritoninfer", "tritoninfer", use_tensor_cores=False),
            ApiDecode("flashinfer-tc", "flashinfer", use_tensor_cores=True),
            ApiDecode("flashinfer-cc", "flashinfer", use_tensor_cores=False),
            Flex("flex", paged=True),
            Flex("flex-contig", paged=False),
            Sdpa(),
            Reference(ref_max_tokens),
        ]
    if workload == "prefill":
        return [
            ApiPrefill("tritoninfer", "tritoninfer", backend=None),
            ApiPrefill("flashinfer-fa2", "flashinfer", backend="fa2"),
            ApiPrefill("flashinfer-fa3", "flashinfer", backend="fa3"),
            Flex("flex", paged=True),
            Flex("flex-contig", paged=False),
            Sdpa(),
            Reference(ref_max_tokens),
        ]
    if workload == "append":
        return [ApiAppend("tritoninfer", "tritoninfer"), ApiAppend("flashinfer", "flashinfer"), Reference(ref_max_tokens)]
    if workload == "cascade":
        return [
            ApiCascade("tritoninfer", "tritoninfer"),
            ApiCascade("flashinfer", "flashinfer"),
            ApiCascadeFlat("flashinfer-flat", "flashinfer"),
            Reference(ref_max_tokens),
        ]
    raise ValueError(f"unknown workload {workload!r}")


def all_names() -> List[str]:
    names: List[str] = []
    for w in ("decode", "prefill", "append", "cascade"):
        for p in registry(w):
            if p.name not in names:
                names.append(p.name)
    return names


def select(workload: str, names: Optional[List[str]], ref_max_tokens: int = 65536) -> List[Provider]:
    """The providers of ``workload`` that ``names`` asks for (``None``: the default set;
    ``"flashinfer"`` means every FlashInfer variant; ``"all"`` everything)."""
    providers = registry(workload, ref_max_tokens)
    if names is None:
        return [p for p in providers if p.name not in DEFAULT_OFF]
    if "all" in names:
        return providers
    chosen = []
    for p in providers:
        if p.name in names or (p.name.startswith("flashinfer") and "flashinfer" in names):
            chosen.append(p)
    return chosen
