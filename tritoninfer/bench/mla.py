"""``tritoninfer bench mla``: MLA decode, tritoninfer's ``BatchMLAPagedAttentionWrapper`` against
FlashInfer's ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (backends fa2 and fa3), same process,
same inputs.

DeepSeek-V3 dims (``head_dim_ckv`` 512, ``head_dim_kpe`` 64, bf16, ``sm_scale = 1/sqrt(192)``); the
latent cache is one 576-wide buffer that every wrapper reads as ``[..., :512]`` / ``[..., 512:]``
slices, as SGLang passes it; requests have equal lengths and randomly permuted pages; four query
tokens per request (speculative verify) are causal. Timing: ``timing.measure`` in graph mode,
``calls`` back-to-back runs in one CUDA graph rotating over input copies (a fresh cache per copy, as
many copies as keep about 2x the 50 MB L2 in flight, within ``--max-gb``), median per call.

``--kv-dtype e4m3`` adds rows with an fp8 e4m3 latent cache (tritoninfer only: FlashInfer 0.5.3's MLA
refuses fp8; bf16 queries, ``ckv_scale = kpe_scale = 0.5``): their ``ours fp8/bf16`` column is our
fp8 time over our bf16 time of the same shape (the issue expects about 0.5 where memory bounds
it). Past --ref-max-tokens they are checked against our bf16 run on the dequantised cache.

``--prefill`` adds DeepSeek's non-absorbed prefill (what an engine runs for the prompt): ragged causal
attention with ``head_dim_qk`` 192 and ``head_dim_vo`` 128 through ``BatchPrefillWithRaggedKVCacheWrapper``,
ours against FlashInfer's same wrapper (fa2, fa3), timed with events around eager calls, in a second
table; FLOPs = 2 x heads x (192 + 128) x the causal (query, key) pairs.

Counted per call: bytes = the live latent rows once per request (576 x 2 bytes per KV position, 1 for fp8) plus
q and o; FLOPs = 2 x heads x qlen x kv x (576 + 512) per request (the causal mask of the 4-token
steps is not subtracted). Roofline fraction = max(bytes / copy bandwidth, FLOPs / --peak-tflops) /
time. Checks: tritoninfer's output against ``tritoninfer.reference.mla_paged_attention`` (float32)
where batch x kv_len <= --ref-max-tokens, else against FlashInfer's output. Without a GPU: latent
dims 32/16 and tiny shapes through the Triton interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import groups
from .timing import measure

D_CKV, D_KPE = 512, 64
CPU_DIMS = (32, 16)
SM_SCALE = 1 / math.sqrt(192)
BACKENDS = ("fa2", "fa3")
HEADS, PAGES, BATCHES, KV_LENS, QO_LENS = (128, 16), (1, 64), (1, 16, 64, 128), (1024, 8192, 32768), (1, 4)
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
FP8_SCALE = 0.5  # a power of two: the dequantised cache is exact in bf16
# (heads, page, batch, kv_len, qo_len): the rows issue 22 quotes FlashInfer's times for, and one 16-head one
QUICK = ((128, 64, 1, 8192, 1), (128, 64, 64, 8192, 1), (16, 64, 64, 8192, 1), (128, 1, 64, 4096, 1),
         (128, 64, 64, 4096, 4))
CPU_SHAPES = ((4, 1, 2, 9, 1), (4, 4, 2, 9, 2))
# non-absorbed prefill: (heads, requests, tokens a request); 128 heads on one GPU, 16 a TP-8 shard
PREFILL = ((128, 1, 4096), (16, 1, 8192), (16, 8, 2048))
PREFILL_DIMS, CPU_PREFILL_DIMS = (192, 128), (24, 16)
CPU_PREFILL = ((2, 2, 7),)

Shape = Tuple[int, int, int, int, int]  # heads, page_size, batch, kv_len, qo_len


@dataclass
class Row:
    shape: Shape
    ours_us: Optional[float] = None
    peers_us: Dict[str, Optional[float]] = field(default_factory=dict)
    peer_status: Dict[str, str] = field(default_factory=dict)
    nbytes: float = 0.0
    flops: float = 0.0
    check: str = ""
    note: str = ""
    kv: str = "bf16"
    bf16_us: Optional[float] = None  # ours with a bf16 cache, same shape (fp8 rows)

    def best_peer(self) -> Optional[float]:
        times = [t for t in self.peers_us.values() if t]
        return min(times) if times else None


def counts(shape: Shape, dims: Tuple[int, int] = (D_CKV, D_KPE), kv_bytes: int = 2) -> Tuple[float, float]:
    """(bytes, FLOPs) of one call, bf16 q/o and a cache of ``kv_bytes`` per element (see the module
    docstring)."""
    heads, _, batch, kv, ql = shape
    ckv, kpe = dims
    nbytes = batch * kv * (ckv + kpe) * kv_bytes + batch * ql * heads * (ckv + kpe + ckv) * 2
    flops = 2.0 * heads * ql * kv * (ckv + kpe + ckv) * batch
    return nbytes, flops


def roofline_fraction(nbytes: float, flops: float, time_us: Optional[float], copy_tb_s: Optional[float],
                      peak_tflops: float) -> Optional[float]:
    """max(bytes / copy bandwidth, FLOPs / peak) / time: 1.0 is the roofline."""
    if not time_us or not copy_tb_s:
        return None
    bound_us = max(nbytes / (copy_tb_s * 1e6), flops / (peak_tflops * 1e6))
    return bound_us / time_us


def make_inputs(shape: Shape, dims: Tuple[int, int], ncopies: int, device: torch.device, seed: int,
                kv_dtype: torch.dtype = torch.bfloat16):
    heads, ps, batch, kv, ql = shape
    ckv_d, kpe_d = dims
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = math.ceil(kv / ps)
    num_pages = batch * pages_per
    copies = []
    for _ in range(ncopies):
        q = torch.randn(batch * ql, heads, ckv_d + kpe_d, dtype=torch.bfloat16, device=device, generator=g)
        cache = torch.randn(num_pages, ps, ckv_d + kpe_d, dtype=torch.bfloat16, device=device,
                            generator=g).to(kv_dtype)
        copies.append((q[..., :ckv_d], q[..., ckv_d:], cache[..., :ckv_d], cache[..., ckv_d:]))
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * ql
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages_per
    kv_indices = torch.randperm(num_pages, device=device, generator=g).to(torch.int32)
    kv_len = torch.full((batch,), kv, dtype=torch.int32, device=device)
    return copies, (qo_indptr, kv_indptr, kv_indices, kv_len)


def setup_wrapper(wrapper, table, shape: Shape, dims: Tuple[int, int], copies):
    """(plan, run) of one wrapper: FlashInfer's MLA API, the same for both libraries; an fp8 cache
    (tritoninfer only) runs with ``ckv_scale``/``kpe_scale``, as later FlashInfer releases."""
    heads, ps, _, _, ql = shape
    qo_indptr, kv_indptr, kv_indices, kv_len = table
    kv_dtype = copies[0][2].dtype
    scales = dict(ckv_scale=FP8_SCALE, kpe_scale=FP8_SCALE) if kv_dtype != torch.bfloat16 else {}

    def plan():
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, dims[0], dims[1], ps, ql > 1, SM_SCALE,
                     torch.bfloat16, kv_dtype)

    plan()
    outs = [torch.empty_like(c[0]) for c in copies]

    def run(i):
        q_nope, q_pe, ckv, kpe = copies[i]
        wrapper.run(q_nope, q_pe, ckv, kpe, out=outs[i], **scales)
        return outs[i]

    return plan, run


def reference_out(shape: Shape, copies, table) -> torch.Tensor:
    from .. import reference

    q_nope, q_pe, ckv, kpe = copies[0]
    scale = FP8_SCALE if ckv.dtype != torch.bfloat16 else 1.0
    out, _ = reference.mla_paged_attention(q_nope, q_pe, ckv, kpe, *table, SM_SCALE, causal=shape[4] > 1,
                                           ckv_scale=scale, kpe_scale=scale)
    return out


def dequantised_out(shape: Shape, dims, copies, table, workspace) -> torch.Tensor:
    """Our bf16 run on the fp8 cache's values times its scale (exact in bf16): an fp8 row's check
    past --ref-max-tokens."""
    from ..mla import BatchMLAPagedAttentionWrapper

    q_nope, q_pe, ckv, kpe = copies[0]
    width = ckv.shape[-1] + kpe.shape[-1]
    full = torch.empty(*ckv.shape[:2], width, dtype=torch.bfloat16, device=ckv.device)
    full[..., :ckv.shape[-1]] = ckv.to(torch.bfloat16) * FP8_SCALE
    full[..., ckv.shape[-1]:] = kpe.to(torch.bfloat16) * FP8_SCALE
    bf16 = [(q_nope, q_pe, full[..., :ckv.shape[-1]], full[..., ckv.shape[-1]:])]
    _, run = setup_wrapper(BatchMLAPagedAttentionWrapper(workspace), table, shape, dims, bf16)
    return run(0).clone()


def bench_shape(shape: Shape, a: argparse.Namespace, setup: groups.Setup, dims, fi_mla, workspaces,
                kv: str = "bf16") -> Row:
    from .. import testing
    from ..mla import BatchMLAPagedAttentionWrapper

    kv_dtype = KV_DTYPES[kv]
    row = Row(shape, kv=kv)
    row.nbytes, row.flops = counts(shape, dims, kv_dtype.itemsize)
    heads, ps, batch, kv_len, _ = shape
    cache_bytes = batch * math.ceil(kv_len / ps) * ps * (dims[0] + dims[1]) * kv_dtype.itemsize
    if cache_bytes > a.max_gb * 1e9:
        row.check = f"skipped: {cache_bytes / 1e9:.1f} GB of cache > --max-gb"
        return row
    ncopies = max(1, min(8, math.ceil(100e6 / row.nbytes), int(a.max_gb * 1e9 // cache_bytes))) if setup.gpu else 1
    copies, table = make_inputs(shape, dims, ncopies, setup.device, a.seed, kv_dtype)
    tol = testing.tolerance(torch.bfloat16)
    outs: Dict[str, torch.Tensor] = {}
    try:
        plan, run = setup_wrapper(BatchMLAPagedAttentionWrapper(workspaces[0]), table, shape, dims, copies)
        outs["ours"] = run(0).clone()
        t = measure(run, device=setup.device, mode="graph", ncopies=ncopies, cfg=setup.timing, plan=plan)
        row.ours_us, row.note = (t.time_us if setup.gpu else None), t.note
    except Exception as exc:  # our failure is this row's status, the sweep goes on
        row.check = "ERROR " + groups.error_text(exc)
        return row
    for b in a.backends:
        if fi_mla is None:
            continue
        if kv != "bf16":
            row.peer_status[b] = "refuses fp8"  # FlashInfer 0.5.3's MLA plan()
            continue
        try:
            wrapper = fi_mla.BatchMLAPagedAttentionWrapper(workspaces[1], backend=b)
            plan, run = setup_wrapper(wrapper, table, shape, dims, copies)
            outs.setdefault("flashinfer", run(0).clone())
            t = measure(run, device=setup.device, mode="graph", ncopies=ncopies, cfg=setup.timing, plan=plan)
            row.peers_us[b] = t.time_us
        except Exception as exc:  # a backend this GPU or shape lacks: its cell says so
            row.peers_us[b] = None
            row.peer_status[b] = groups.error_text(exc)
    if batch * kv_len <= a.ref_max_tokens:
        row.check = groups.check_close(outs["ours"], reference_out(shape, copies, table), tol) + " vs reference"
    elif kv != "bf16":
        row.check = groups.check_close(outs["ours"], dequantised_out(shape, dims, copies, table, workspaces[1]),
                                       tol) + " vs ours bf16 dequantised"
    elif "flashinfer" in outs:
        row.check = groups.check_close(outs["ours"], outs["flashinfer"], tol) + " vs FlashInfer"
    else:
        row.check = "unchecked (no FlashInfer, beyond --ref-max-tokens)"
    del copies, outs
    if setup.gpu:
        torch.cuda.empty_cache()
    return row


@dataclass
class PrefillRow:
    shape: Tuple[int, int, int]  # heads, requests, tokens a request
    ours_us: Optional[float] = None
    peers_us: Dict[str, Optional[float]] = field(default_factory=dict)
    peer_status: Dict[str, str] = field(default_factory=dict)
    flops: float = 0.0
    check: str = ""


def prefill_flops(shape: Tuple[int, int, int], dims: Tuple[int, int]) -> float:
    """2 x heads x (qk + vo) x the causal (query, key) pairs of every request."""
    heads, batch, tokens = shape
    return 2.0 * heads * (dims[0] + dims[1]) * batch * tokens * (tokens + 1) / 2


def bench_prefill(shape: Tuple[int, int, int], a: argparse.Namespace, setup: groups.Setup, dims, fi_prefill,
                  workspaces) -> PrefillRow:
    """One non-absorbed prefill row: q/k [n, heads, qk], v [n, heads, vo] (k's rope part shared by the
    heads in DeepSeek, materialised per head as SGLang passes it), causal, one wrapper per library."""
    from .. import reference, testing
    from ..prefill import BatchPrefillWithRaggedKVCacheWrapper

    heads, batch, tokens = shape
    row = PrefillRow(shape, flops=prefill_flops(shape, dims))
    dev = setup.device
    g = torch.Generator(device=dev).manual_seed(a.seed)
    n = batch * tokens
    q = torch.randn(n, heads, dims[0], dtype=torch.bfloat16, device=dev, generator=g)
    k = torch.randn(n, heads, dims[0], dtype=torch.bfloat16, device=dev, generator=g)
    v = torch.randn(n, heads, dims[1], dtype=torch.bfloat16, device=dev, generator=g)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * tokens
    scale = 1 / math.sqrt(dims[0])
    outs: Dict[str, torch.Tensor] = {}

    def timed(wrapper, name):
        wrapper.plan(indptr, indptr, heads, heads, dims[0], head_dim_vo=dims[1], causal=True, sm_scale=scale,
                     q_data_type=torch.bfloat16)
        outs.setdefault(name, wrapper.run(q, k, v).clone())
        t = measure(lambda i: wrapper.run(q, k, v), device=dev, mode="events", ncopies=1, cfg=setup.timing)
        return t.time_us if setup.gpu else None

    try:
        row.ours_us = timed(BatchPrefillWithRaggedKVCacheWrapper(workspaces[0], "NHD"), "ours")
    except Exception as exc:  # our failure is this row's status, the sweep goes on
        row.check = "ERROR " + groups.error_text(exc)
        return row
    for b in a.backends if fi_prefill is not None else []:
        try:
            row.peers_us[b] = timed(fi_prefill.BatchPrefillWithRaggedKVCacheWrapper(workspaces[1], "NHD", backend=b),
                                    "flashinfer")
        except Exception as exc:  # a backend this GPU or shape lacks: its cell says so
            row.peers_us[b] = None
            row.peer_status[b] = groups.error_text(exc)
    tol = testing.tolerance(torch.bfloat16)
    if n * tokens * heads <= a.ref_max_tokens * 64:
        want, _ = reference.batch_prefill_with_ragged_kv_cache(q, k, v, indptr, indptr, causal=True,
                                                               sm_scale=scale)
        row.check = groups.check_close(outs["ours"], want, tol) + " vs reference"
    elif "flashinfer" in outs:
        row.check = groups.check_close(outs["ours"], outs["flashinfer"], tol) + " vs FlashInfer"
    else:
        row.check = "unchecked (no FlashInfer, beyond the reference's size)"
    if setup.gpu:
        torch.cuda.empty_cache()
    return row


def prefill_table(rows: List[PrefillRow], backends: Sequence[str], peak_tflops: float) -> str:
    out = []
    for r in rows:
        best = min([t for t in r.peers_us.values() if t], default=None)
        t = r.ours_us
        out.append([str(x) for x in r.shape] + [groups.fmt(t)]
                   + [groups.fmt(r.peers_us.get(b)) or r.peer_status.get(b, "") for b in backends]
                   + [groups.ratio(best, t), groups.fmt(r.flops / (t * 1e6) if t else None, ".1f"),
                      groups.fmt(r.flops / (t * 1e6) / peak_tflops if t else None, ".0%"), r.check])
    head = ["heads", "requests", "tokens", "ours µs"] + [f"FI {b} µs" for b in backends] + \
        ["best FI/ours", "ours TFLOP/s", "of peak", "check"]
    return groups.markdown_table(out, head)


def table(rows: List[Row], backends: Sequence[str], copy_tb_s: Optional[float], peak_tflops: float) -> str:
    out = []
    for r in rows:
        line = [str(x) for x in r.shape] + [groups.fmt(r.ours_us)]
        for b in backends:
            line.append(groups.fmt(r.peers_us.get(b)) or r.peer_status.get(b, ""))
        best = r.best_peer()
        t = r.ours_us
        line += [groups.ratio(best, t),
                 groups.fmt(r.nbytes / (t * 1e6) if t else None, ".2f"),
                 groups.fmt(r.flops / (t * 1e6) if t else None, ".1f"),
                 groups.fmt(roofline_fraction(r.nbytes, r.flops, t, copy_tb_s, peak_tflops), ".0%"),
                 groups.fmt(roofline_fraction(r.nbytes, r.flops, best, copy_tb_s, peak_tflops), ".0%"),
                 r.kv, groups.fmt(t / r.bf16_us if t and r.bf16_us else None, ".2f"),
                 r.check + (f"; {r.note}" if r.note else "")]
        out.append(line)
    head = ["heads", "page", "batch", "kv", "qlen", "ours µs"] + [f"FI {b} µs" for b in backends] + \
        ["best FI/ours", "ours TB/s", "ours TFLOP/s", "ours of roofline", "best FI of roofline", "cache",
         "ours fp8/bf16", "check"]
    return groups.markdown_table(out, head)


def grid(a: argparse.Namespace, gpu: bool) -> List[Shape]:
    if a.shapes:
        return list(a.shapes)
    if not gpu and not any((a.heads, a.page, a.batch, a.kv_len, a.qo_len)):
        return list(CPU_SHAPES[:1] if a.quick else CPU_SHAPES)
    if a.quick and not any((a.heads, a.page, a.batch, a.kv_len, a.qo_len)):
        return list(QUICK)
    return list(itertools.product(a.heads or HEADS, a.page or PAGES, a.batch or BATCHES, a.kv_len or KV_LENS,
                                  a.qo_len or QO_LENS))


def _int_tuples(text: str, n: int, form: str) -> list:
    """Comma-separated items of ``n`` colon-separated integers (``form`` names them in the error)."""
    out = []
    for item in text.split(","):
        try:
            values = tuple(groups.int_list("a shape field")(p)[0] for p in item.split(":"))
        except argparse.ArgumentTypeError:
            values = ()
        if len(values) != n:
            raise argparse.ArgumentTypeError(f"expected {form} items, got {item!r}")
        out.append(values)
    return out


def _shapes(text: str) -> List[Shape]:
    return _int_tuples(text, 5, "heads:page:batch:kv_len:qo_len")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from .cli import positive_float, positive_int

    p = groups.parser("mla", __doc__, "five shapes (the issue's anchor rows): 128 heads 1x8K, 64x8K, page 1 "
                      "64x4K, 64x4K with 4 query tokens; 16 heads 64x8K")
    p.add_argument("--heads", type=groups.int_list("a head count"), help="default 128,16")
    p.add_argument("--page", type=groups.int_list("a page size"), help="default 1,64")
    p.add_argument("--batch", type=groups.int_list("a batch size"), help="default 1,16,64,128")
    p.add_argument("--kv-len", type=groups.int_list("a KV length"), help="default 1K,8K,32K")
    p.add_argument("--qo-len", type=groups.int_list("a query length"), help="query tokens per request; default 1,4")
    p.add_argument("--shapes", type=_shapes, help="heads:page:batch:kv_len:qo_len,... (replaces the grid)")
    p.add_argument("--backends", type=lambda t: groups.name_list(BACKENDS, "backend")(t) if t else [],
                   default=list(BACKENDS), help="FlashInfer backends to time (default fa2,fa3; '' for none)")
    p.add_argument("--max-gb", type=positive_float, default=40.0, help="largest input copies per shape (GB)")
    p.add_argument("--peak-tflops", type=positive_float, default=790.0,
                   help="dense bf16 tensor-core peak for the roofline (default 790, the H200's)")
    p.add_argument("--ref-max-tokens", type=positive_int, default=65536,
                   help="largest batch*kv_len checked against the float32 reference (default 64K); larger "
                        "shapes are checked against FlashInfer")
    p.add_argument("--kv-dtype", type=groups.name_list(tuple(KV_DTYPES), "cache dtype"), default=["bf16"],
                   help="latent cache dtypes, bf16,e4m3 (default bf16): e4m3 rows are tritoninfer only "
                        "(FlashInfer 0.5.3's MLA refuses fp8), compared with our bf16 row of the shape")
    p.add_argument("--prefill", action="store_true",
                   help="also DeepSeek's non-absorbed prefill (ragged, causal, head_dim_qk 192 / vo 128), "
                        "FlashInfer's ragged wrapper beside")
    p.add_argument("--prefill-shapes", type=_prefill_shapes, default=None,
                   help="heads:requests:tokens,... for --prefill (default 128:1:4096,16:1:8192,16:8:2048)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def _prefill_shapes(text: str) -> List[Tuple[int, int, int]]:
    return _int_tuples(text, 3, "heads:requests:tokens")


def main(argv: Sequence[str]) -> int:
    """Runs the MLA group; returns 1 when a tritoninfer output failed its check, else 0."""
    a = parse_args(argv)
    setup = groups.start("mla", argv, a)
    dims = (D_CKV, D_KPE) if setup.gpu else CPU_DIMS
    fi_mla, why = groups.peer_flashinfer("mla")
    if fi_mla is None:
        groups.progress(f"FlashInfer: {why}; tritoninfer only")
    dev = setup.device
    workspaces = [torch.empty((128 << 20) if setup.gpu else (8 << 20), dtype=torch.uint8, device=dev)
                  for _ in range(2)]
    rows = []
    for shape, kv in itertools.product(grid(a, setup.gpu), a.kv_dtype):
        rows.append(bench_shape(shape, a, setup, dims, fi_mla, workspaces, kv))
        r = rows[-1]
        if kv != "bf16":
            r.bf16_us = next((o.ours_us for o in rows if o.shape == shape and o.kv == "bf16"), None)
        times = [f"ours {groups.fmt(r.ours_us) or '-'} us"] + [
            f"{b} {groups.fmt(t) + ' us' if t else r.peer_status.get(b, '')}" for b, t in r.peers_us.items()]
        groups.progress(f"mla {shape} {kv}: {', '.join(times)}; {r.check}")
    backends = a.backends if fi_mla is not None else []
    faster = [r for r in rows if r.ours_us and r.best_peer()]
    big = [r for r in rows if r.ours_us and r.shape[2] >= 64 and r.kv == "bf16"]
    tail = []
    if setup.gpu:
        tail = [groups.goal_line("rows at or above FlashInfer's best backend",
                                 sum(r.ours_us <= r.best_peer() for r in faster), len(faster)),
                groups.goal_line("rows at batch >= 64 at >= 80 % of the roofline",
                                 sum((roofline_fraction(r.nbytes, r.flops, r.ours_us, setup.copy_tb_s,
                                                        a.peak_tflops) or 0) >= 0.8 for r in big), len(big))]
        fp8 = [r for r in rows if r.ours_us and r.bf16_us]
        if fp8:
            tail.append(groups.goal_line("fp8 rows at most 0.6x our bf16 time (memory-bound: 0.5 expected)",
                                         sum(r.ours_us <= 0.6 * r.bf16_us for r in fp8), len(fp8)))
    head = groups.header(setup, "MLA decode (DeepSeek-V3 dims)", [
        f"latent dims ckv {dims[0]} / kpe {dims[1]}, bf16, sm_scale 1/sqrt(192); one 576-wide buffer sliced "
        "into ckv/kpe (SGLang's form); pages randomly permuted; qlen 4 is causal."
        if setup.gpu else f"latent dims ckv {dims[0]} / kpe {dims[1]} (small, for the interpreter), bf16.",
        "µs: median per call over CUDA-graph replays; FlashInfer: fa2 and fa3 backends of its MLA wrapper; "
        "best FI/ours > 1: tritoninfer faster than FlashInfer's best backend.",
        "bytes: latent rows once per request + q + o; FLOPs: 2 x heads x qlen x kv x (ckv + kpe + ckv); "
        f"roofline: max(bytes / copy bandwidth, FLOPs / {a.peak_tflops:g} TFLOP/s) / time.",
        f"check: ours against the float32 reference where batch x kv <= {a.ref_max_tokens}, else against "
        "FlashInfer (bf16 tolerance, relative Frobenius error)."] + ([
        f"cache e4m3: an fp8 latent cache (ckv_scale = kpe_scale = {FP8_SCALE}), tritoninfer only (FlashInfer "
        "0.5.3's MLA refuses fp8); ours fp8/bf16: our fp8 time over our bf16 time of the shape; checked "
        "against the dequantised reference (or our bf16 run on the dequantised cache)."]
        if "e4m3" in a.kv_dtype else []))
    body = table(rows, backends, setup.copy_tb_s, a.peak_tflops)
    prefill_rows: List[PrefillRow] = []
    if a.prefill:
        fi_prefill, why = groups.peer_flashinfer("prefill")
        pdims = PREFILL_DIMS if setup.gpu else CPU_PREFILL_DIMS
        for shape in a.prefill_shapes or (PREFILL if setup.gpu else CPU_PREFILL):
            prefill_rows.append(bench_prefill(shape, a, setup, pdims, fi_prefill, workspaces))
            r = prefill_rows[-1]
            groups.progress(f"mla prefill {shape}: ours {groups.fmt(r.ours_us) or '-'} us, "
                            + ", ".join(f"{b} {groups.fmt(t) or r.peer_status.get(b, '')}" for b, t in r.peers_us.items())
                            + f"; {r.check}")
        body += (f"\n\n## Non-absorbed prefill (ragged, causal, head_dim_qk {pdims[0]} / vo {pdims[1]})\n\n"
                 "µs: median of event-timed eager calls; FlashInfer: its BatchPrefillWithRaggedKVCacheWrapper "
                 f"(fa2, fa3){'' if fi_prefill is not None else ' (' + why + ')'}; of peak: against "
                 f"{a.peak_tflops:g} TFLOP/s.\n\n"
                 + prefill_table(prefill_rows, a.backends if fi_prefill is not None else [], a.peak_tflops))
    groups.finish(setup, a.out, head, body, tail)
    return 1 if any(groups.failed(r.check) for r in rows + prefill_rows) else 0
