"""What a benchmark row measures: the :class:`Shape`, the default sweeps, and byte/FLOP counts.

Byte and FLOP counts come from :mod:`tritoninfer.testing` (``decode_bytes``, ``prefill_flops``), so
the tests and the benchmark count alike. Units: plain bytes and FLOPs; ``TB = 1e12`` bytes and
``TFLOP = 1e12`` FLOPs.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import testing

WORKLOADS = ("decode", "prefill", "append", "cascade")

SHORT_DTYPE = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Shape:
    """One benchmarked problem.

    ``kv_len`` is per request and means: decode/prefill, the KV length; append, the KV length
    after the append; cascade, the unique (per-request) suffix after a ``shared_len`` prefix that
    all requests share. ``qo_len`` is the queries per request (1 for decode), or for append the
    tokens appended per request. All requests of a shape have the same lengths.
    """

    workload: str
    batch: int
    kv_len: int
    qo_len: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16
    layout: str = "NHD"
    q_dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    kv_form: str = "paged"  # "paged" or "ragged" (prefill only)
    shared_len: int = 0  # cascade only
    tag: str = ""  # why the row is there, e.g. "page 1" for the extra rows

    # ---- derived -------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def heads(self) -> str:
        return f"{self.num_qo_heads}/{self.num_kv_heads}"

    @property
    def dtypes(self) -> str:
        return f"{SHORT_DTYPE[self.q_dtype]}/{SHORT_DTYPE[self.kv_dtype]}"

    @property
    def total_q(self) -> int:
        return self.batch * self.qo_len

    @property
    def kv_tokens(self) -> int:
        """KV tokens the attention reads (shared prefix counted once)."""
        return self.batch * self.kv_len + self.shared_len

    @property
    def pages_per_request(self) -> int:
        return -(-self.kv_len // self.page_size)

    @property
    def num_pages(self) -> int:
        """Pages of the paged cache the bench allocates (ragged: 0)."""
        if self.kv_form == "ragged":
            return 0
        return self.batch * self.pages_per_request + -(-self.shared_len // self.page_size)

    def lengths(self) -> str:
        """Compact batch × length description, e.g. ``16×4096``, ``64×(4096+256)``, ``16×1024/1024``."""
        if self.workload == "cascade":
            core = f"{self.batch}×({self.shared_len}+{self.kv_len})"
            return core if self.qo_len == 1 else f"{core} q{self.qo_len}"
        if self.workload == "append":
            return f"{self.batch}×{self.qo_len}→{self.kv_len}"
        if self.workload == "prefill" and self.qo_len != self.kv_len:
            return f"{self.batch}×{self.qo_len}/{self.kv_len}"
        return f"{self.batch}×{self.kv_len}"

    def label(self) -> str:
        """One-line description used in tables and messages."""
        parts = [self.heads, f"d{self.head_dim}", self.lengths()]
        if self.workload == "prefill":
            parts.append("causal" if self.causal else "full")
        if self.kv_form == "ragged":
            parts.append("ragged")
        else:
            parts.append(f"p{self.page_size}")
            parts.append(self.layout)
        parts.append(self.dtypes)
        return " ".join(parts)

    def as_dict(self) -> Dict[str, object]:
        return {
            "workload": self.workload,
            "shape": self.label(),
            "kv_form": self.kv_form,
            "batch": self.batch,
            "qo_len": self.qo_len,
            "kv_len": self.kv_len,
            "shared_len": self.shared_len,
            "num_qo_heads": self.num_qo_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "page_size": self.page_size if self.kv_form == "paged" else "",
            "layout": self.layout if self.kv_form == "paged" else "NHD",
            "q_dtype": SHORT_DTYPE[self.q_dtype],
            "kv_dtype": SHORT_DTYPE[self.kv_dtype],
            "causal": self.causal,
            "tag": self.tag,
        }


# --------------------------------------------------------------------------------------------------
# accounting
# --------------------------------------------------------------------------------------------------


def _kv_only_bytes(lens: Sequence[int], page_size: int, s: Shape) -> int:
    # decode_bytes with no query heads counts the live KV pages alone.
    return testing.decode_bytes(lens, page_size, 0, s.num_kv_heads, s.head_dim, s.q_dtype, s.kv_dtype)


def bytes_moved(s: Shape) -> int:
    """Fewest bytes one call must move through device memory.

    - decode / prefill (paged): the live KV pages (whole pages) + q + o (``testing.decode_bytes``).
    - prefill (ragged): K and V exactly (page size 1) + q + o.
    - cascade: the shared prefix's pages once, each request's unique pages, q and o.
    - append: the appended K and V read, the same written into the cache, and the int32
      ``batch_indices`` and ``positions`` (4 bytes each per token).
    """
    if s.workload == "append":
        kv_elt = s.kv_dtype.itemsize
        nnz = s.batch * s.qo_len
        return 2 * (2 * nnz * s.num_kv_heads * s.head_dim * kv_elt) + 2 * 4 * nnz
    page = 1 if s.kv_form == "ragged" else s.page_size
    per_req = testing.decode_bytes(
        [s.kv_len] * s.batch, page, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.q_dtype, s.kv_dtype,
        q_len_per_req=s.qo_len,
    )
    if s.workload == "cascade" and s.shared_len:
        per_req += _kv_only_bytes([s.shared_len], page, s)
    return per_req


def flops(s: Shape) -> int:
    """FLOPs of one call (``testing.prefill_flops``: 2 per multiply-add, QK^T and PV, causal pairs
    counted exactly with the bottom-right mask). Append: 0.

    Cascade: queries see the whole shared prefix plus their unique suffix (causal applies to the
    suffix only, as FlashInfer's ``MultiLevelCascadeAttentionWrapper`` does).
    """
    if s.workload == "append":
        return 0
    d = s.head_dim
    total = testing.prefill_flops([s.qo_len] * s.batch, [s.kv_len] * s.batch, s.num_qo_heads, d, d, s.causal)
    if s.workload == "cascade" and s.shared_len:
        total += testing.prefill_flops([s.qo_len] * s.batch, [s.shared_len] * s.batch, s.num_qo_heads, d, d, False)
    return total


def cache_bytes(s: Shape) -> int:
    """Bytes of the KV storage the bench allocates for one copy of the inputs."""
    kv_elt = s.kv_dtype.itemsize
    if s.kv_form == "ragged":
        return 2 * s.batch * s.kv_len * s.num_kv_heads * s.head_dim * kv_elt
    return s.num_pages * 2 * s.page_size * s.num_kv_heads * s.head_dim * kv_elt


def input_bytes(s: Shape) -> int:
    """Bytes of one copy of every input (KV storage, q, appended K/V)."""
    q = s.total_q * s.num_qo_heads * s.head_dim * s.q_dtype.itemsize if s.workload != "append" else 0
    extra = 0
    if s.workload == "append":
        extra = 2 * s.batch * s.qo_len * s.num_kv_heads * s.head_dim * s.kv_dtype.itemsize
    return cache_bytes(s) + q + extra


# --------------------------------------------------------------------------------------------------
# sweeps
# --------------------------------------------------------------------------------------------------


@dataclass
class SweepSpec:
    """The axes a user may override (``None``: the workload's default)."""

    heads: Optional[List[Tuple[int, int]]] = None
    head_dims: Optional[List[int]] = None
    page_sizes: Optional[List[int]] = None
    layouts: Optional[List[str]] = None
    q_dtypes: Optional[List[torch.dtype]] = None
    kv_dtypes: Optional[List[torch.dtype]] = None
    batches: Optional[List[int]] = None
    kv_lens: Optional[List[int]] = None
    qo_lens: Optional[List[int]] = None
    shared_lens: Optional[List[int]] = None
    causal: Optional[List[bool]] = None
    kv_forms: Optional[List[str]] = None
    extras: Optional[bool] = None  # page-1 / HND / head_dim-64 rows; default: only in the full default sweep

    def layout_axes_given(self) -> bool:
        return any(x is not None for x in (self.head_dims, self.page_sizes, self.layouts))


@dataclass
class Defaults:
    """A workload's default sweep for one size class (GPU full, GPU quick, CPU)."""

    heads: List[Tuple[int, int]]
    head_dim: int
    page_size: int
    # (batch, kv_len, qo_len, shared_len) tuples: the base grid, used when neither --batch nor
    # --kv-len is given.
    pairs: List[Tuple[int, int, int, int]]
    causal: List[bool] = field(default_factory=lambda: [False])
    kv_forms: List[str] = field(default_factory=lambda: ["paged"])
    ragged_heads: Optional[List[Tuple[int, int]]] = None  # ragged rows only for these heads
    # Extra rows: (base pair, heads) with page 1, with HND, with head_dim `extra_head_dim`.
    extra_pair: Optional[Tuple[int, int, int, int]] = None
    extra_head_dim: int = 64
    extra_causal: bool = False


def _grid(batches, kv_lens, qo=None, shared=0):
    return [(b, n, (n if qo == "same" else (qo or 1)), shared) for b, n in itertools.product(batches, kv_lens)]


def default_sweep(workload: str, quick: bool, gpu: bool) -> Defaults:
    """The default shapes: on a GPU those of ``shared/anchors/h200-peers.md``; on the CPU tiny ones
    that the Triton interpreter runs in seconds."""
    if gpu:
        if workload == "decode":
            if quick:
                return Defaults([(32, 8)], 128, 16, _grid([1, 16, 64], [4096]))
            return Defaults(
                [(32, 8), (32, 32)], 128, 16, _grid([1, 16, 64, 256], [1024, 4096, 16384, 32768]),
                extra_pair=(64, 4096, 1, 0),
            )
        if workload == "prefill":
            pairs = [(16, 1024, 1024, 0), (4, 4096, 4096, 0), (1, 16384, 16384, 0)]
            if quick:
                return Defaults([(32, 8)], 128, 16, [(4, 4096, 4096, 0)], causal=[True, False],
                                kv_forms=["paged", "ragged"], ragged_heads=[(32, 8)])
            return Defaults([(32, 8), (32, 32)], 128, 16, pairs, causal=[True, False],
                            kv_forms=["paged", "ragged"], ragged_heads=[(32, 8)],
                            extra_pair=(4, 4096, 4096, 0), extra_causal=True)
        if workload == "append":
            if quick:
                return Defaults([(32, 8)], 128, 16, [(64, 4096, 1, 0), (4, 4096, 4096, 0)])
            return Defaults(
                [(32, 8), (32, 32)], 128, 16,
                [(16, 4096, 1, 0), (64, 4096, 1, 0), (256, 4096, 1, 0), (16, 1024, 1024, 0), (4, 4096, 4096, 0)],
                extra_pair=(64, 4096, 1, 0),
            )
        if workload == "cascade":
            if quick:
                return Defaults([(32, 8)], 128, 16, [(64, 256, 1, 4096)])
            pairs = [(b, u, 1, s) for b in (16, 64) for s in (4096, 32768) for u in (128, 1024)]
            return Defaults([(32, 8), (32, 32)], 128, 16, pairs)
    else:
        # CPU: everything runs through the Triton interpreter (~1 s per tiny decode call).
        if workload == "decode":
            if quick:
                return Defaults([(4, 2)], 64, 16, _grid([1, 2], [20, 50]))
            return Defaults([(4, 2), (4, 4)], 64, 16, _grid([1, 3], [20, 50, 130]), extra_pair=(3, 50, 1, 0),
                            extra_head_dim=32)
        if workload == "prefill":
            if quick:
                return Defaults([(4, 2)], 64, 16, [(2, 24, 24, 0)], causal=[True, False],
                                kv_forms=["paged", "ragged"], ragged_heads=[(4, 2)])
            return Defaults([(4, 2), (4, 4)], 64, 16, [(2, 24, 24, 0), (1, 40, 40, 0)], causal=[True, False],
                            kv_forms=["paged", "ragged"], ragged_heads=[(4, 2)], extra_pair=(2, 24, 24, 0),
                            extra_head_dim=32, extra_causal=True)
        if workload == "append":
            pairs = [(3, 40, 1, 0), (2, 24, 24, 0)]
            return Defaults([(4, 2)], 64, 16, pairs, extra_pair=None if quick else (3, 40, 1, 0), extra_head_dim=32)
        if workload == "cascade":
            pairs = [(3, 20, 1, 32)] if quick else [(3, 20, 1, 32), (2, 40, 1, 48)]
            return Defaults([(4, 2)], 64, 16, pairs)
    raise ValueError(f"unknown workload {workload!r}")


def make_shapes(workload: str, spec: SweepSpec, *, quick: bool, gpu: bool) -> List[Shape]:
    """Every shape of one workload's sweep, defaults overridden by ``spec``."""
    d = default_sweep(workload, quick, gpu)
    heads = spec.heads or d.heads
    head_dims = spec.head_dims or [d.head_dim]
    pages = spec.page_sizes or [d.page_size]
    layouts = spec.layouts or ["NHD"]
    q_dtypes = spec.q_dtypes or [torch.bfloat16]
    kv_dtypes = spec.kv_dtypes or [None]  # None: same as q
    causals = spec.causal or d.causal
    kv_forms = spec.kv_forms or d.kv_forms
    if workload != "prefill":
        kv_forms = ["paged"]
    if workload not in ("prefill", "cascade"):
        causals = [False]

    # Lengths: the default list of tuples, or the product of what was given (with defaults for the
    # axes that were not).
    if any(x is not None for x in (spec.batches, spec.kv_lens, spec.qo_lens, spec.shared_lens)):
        batches = spec.batches or sorted({p[0] for p in d.pairs})
        kv_lens = spec.kv_lens or sorted({p[1] for p in d.pairs})
        shared = spec.shared_lens or sorted({p[3] for p in d.pairs})
        if workload == "decode":
            qos = [1]
        elif spec.qo_lens is not None:
            qos = spec.qo_lens
        elif workload == "prefill":
            qos = [None]  # = kv_len
        else:
            qos = sorted({p[2] for p in d.pairs})
        pairs = []
        for b, n, q, s in itertools.product(batches, kv_lens, qos, shared):
            pairs.append((b, n, n if q is None else q, s))
    else:
        pairs = d.pairs

    shapes: List[Shape] = []
    seen = set()

    def add(shape: Shape) -> None:
        key = dataclasses.replace(shape, tag="")
        if key not in seen:
            seen.add(key)
            shapes.append(shape)

    for form in kv_forms:
        form_heads = heads
        if form == "ragged" and spec.heads is None and d.ragged_heads:
            form_heads = d.ragged_heads
        for (hq, hkv), hd, page, layout, qd, kd, causal, (b, n, qo, sh) in itertools.product(
            form_heads, head_dims, pages, layouts, q_dtypes, kv_dtypes, causals, pairs
        ):
            if form == "ragged":
                page, layout = 1, "NHD"
                if kd in FP8:
                    continue  # ragged prefill takes K/V in the q dtype
            if workload == "cascade" and sh % page:
                continue  # the shared prefix must fill whole pages
            if workload == "append" and qo > n:
                continue  # cannot append more tokens than the request ends up with
            add(Shape(workload, b, n, qo, hq, hkv, hd, page, layout, qd, kd or qd, causal, form, sh))

    extras = spec.extras if spec.extras is not None else (not quick and not spec.layout_axes_given())
    if extras and d.extra_pair is not None:
        b, n, qo, sh = d.extra_pair
        hq, hkv = heads[0]
        qd = q_dtypes[0]
        kd = kv_dtypes[0] or qd
        causal = d.extra_causal if workload in ("prefill", "cascade") else False
        base = Shape(workload, b, n, qo, hq, hkv, d.head_dim, d.page_size, "NHD", qd, kd, causal, "paged", sh)
        add(dataclasses.replace(base, page_size=1, tag="page 1"))
        add(dataclasses.replace(base, layout="HND", tag="HND"))
        add(dataclasses.replace(base, head_dim=d.extra_head_dim, tag=f"head_dim {d.extra_head_dim}"))
    return shapes
