"""``tritoninfer bench rope-append``: the fused RoPE + fp8 quantize + paged-cache append
(``rope_quantize_fp8_append_paged_kv_cache``, FlashInfer 0.5.3's signature) of tritoninfer against
FlashInfer's ``flashinfer.rope`` one, same process, same inputs.

Default: Llama-3-8B (32/8 heads, head_dim 128, all of it rotary, neox style), bf16 q/k/v, an e4m3 cache
of 16-token pages (NHD), 1 to 4096 tokens appended in one call, two ways: ``decode`` (every token its
own request, at a random position below ``--context``, each into a different page) and ``prefill``
(one request, positions 0..tokens-1). Only the page that receives a token is written; in ``decode``
the earlier page-table entries of a request point at random pool pages, which keeps the cache at
one page per request. Timing: ``timing.measure`` in graph mode over input copies (inputs, outputs and
cache per copy, enough to keep twice the 50 MB L2 in flight), median per call.

Bytes per token: q, k, v read in the input dtype; q written in fp8; k and v written in fp8 into the
cache; the token's cos/sin row (rope_dim float32; the cache is small enough to stay in L2, so this
is an upper bound on DRAM traffic); five int32 index reads (pos_ids, batch_indices, positions, the
request's kv_indptr entry and page id). TB/s over those bytes, "of copy" against the copy bandwidth
measured in the run (issue 23's target: >= 80 %). Checks: the fp8 codes of q and of the whole cache
(unwritten slots hold NaN before the call) against ``tritoninfer.reference``, one code of slack on
at most 1 % of the elements (a fused multiply-add on the GPU).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import groups
from .timing import measure

# "copy": a torch copy_ moving the same bytes (half read, half written), timed the same way: what
# the copy bandwidth allows at this size, where launch and ramp weigh on a ~20 µs call
PROVIDERS = ("tritoninfer", "flashinfer", "copy")
KINDS = ("decode", "prefill")
TOKENS, QUICK_TOKENS, CPU_TOKENS = (1, 16, 64, 256, 1024, 4096), (1, 256, 4096), (3, 9)
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NAN_BYTE = 0x7F  # a NaN in both e4m3fn and e5m2


@dataclass
class Row:
    kind: str
    tokens: int
    provider: str
    nbytes: int = 0
    time_us: Optional[float] = None
    tb_s: Optional[float] = None
    check: str = ""
    note: str = ""


@dataclass
class Config:
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    page: int
    dtype: torch.dtype
    fp8: torch.dtype
    layout: str
    context: int


def bytes_moved(cfg: Config, tokens: int) -> int:
    """Bytes of one call for ``tokens`` tokens (see the module docstring)."""
    e = torch.empty((), dtype=cfg.dtype).element_size()
    q_el, kv_el = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    read = (q_el + 2 * kv_el) * e + cfg.rope_dim * 4 + 5 * 4
    written = q_el + 2 * kv_el
    return tokens * (read + written)


class Copy:
    """One set of inputs, outputs and cache."""

    def __init__(self, cfg: Config, tokens: int, num_pages: int, device, g: torch.Generator):
        from .. import testing

        nope = cfg.head_dim - cfg.rope_dim
        self.q_rope = testing.randn((tokens, cfg.heads, cfg.rope_dim), cfg.dtype, device, g)
        self.k_rope = testing.randn((tokens, cfg.kv_heads, cfg.rope_dim), cfg.dtype, device, g)
        self.q_nope = testing.randn((tokens, cfg.heads, nope), cfg.dtype, device, g) if nope else None
        self.k_nope = testing.randn((tokens, cfg.kv_heads, nope), cfg.dtype, device, g) if nope else None
        self.v = testing.randn((tokens, cfg.kv_heads, cfg.head_dim), cfg.dtype, device, g)
        shape = (num_pages, cfg.page, cfg.kv_heads, cfg.head_dim) if cfg.layout == "NHD" else \
            (num_pages, cfg.kv_heads, cfg.page, cfg.head_dim)
        self.cache = tuple(torch.empty(shape, dtype=cfg.fp8, device=device) for _ in range(2))
        self.q_rope_out = torch.empty(self.q_rope.shape, dtype=cfg.fp8, device=device)
        self.q_nope_out = torch.empty((tokens, cfg.heads, nope), dtype=cfg.fp8, device=device) if nope else None
        self.reset()

    def reset(self) -> None:
        for t in (*self.cache, self.q_rope_out, self.q_nope_out):
            if t is not None:
                t.view(torch.uint8).fill_(NAN_BYTE)


class Case:
    """The page table and positions of one (kind, tokens), and its input copies."""

    def __init__(self, cfg: Config, kind: str, tokens: int, ncopies: int, device, seed: int):
        from .. import reference

        g = torch.Generator().manual_seed(seed + tokens * 7 + (kind == "prefill"))
        self.cfg = cfg
        if kind == "decode":
            lens = torch.randint(1, cfg.context + 1, (tokens,), generator=g)
            pages_per = (lens + cfg.page - 1) // cfg.page
            num_pages = tokens + 2
            last = torch.randperm(num_pages, generator=g)[:tokens]
            indices = torch.randint(0, num_pages, (int(pages_per.sum()),), generator=g)
            indptr = torch.zeros(tokens + 1, dtype=torch.long)
            indptr[1:] = pages_per.cumsum(0)
            indices[indptr[1:] - 1] = last  # the page each token lands in: one per request, all different
            append_indptr = torch.arange(tokens + 1)
        else:
            lens = torch.tensor([tokens])
            pages = (tokens + cfg.page - 1) // cfg.page
            num_pages = pages + 2
            indices = torch.randperm(num_pages, generator=g)[:pages]
            indptr = torch.tensor([0, pages])
            append_indptr = torch.tensor([0, tokens])
        batch_indices, positions = reference.get_batch_indices_positions(append_indptr.int(), lens.int(), tokens)
        self.kv_indices = indices.to(torch.int32).to(device)
        self.kv_indptr = indptr.to(torch.int32).to(device)
        self.batch_indices, self.positions = batch_indices.to(device), positions.to(device)
        max_pos = max(cfg.context, tokens) if kind == "decode" else tokens
        self.cos_sin = _cos_sin_cache(max_pos, cfg.rope_dim).to(device)
        self.copies = [Copy(cfg, tokens, num_pages, device, g) for _ in range(ncopies)]

    def call(self, fn, i: int):
        c, cfg = self.copies[i], self.cfg
        return fn(c.q_rope, c.k_rope, c.q_nope, c.k_nope, c.v, self.cos_sin, self.positions, c.cache,
                  self.kv_indices, self.kv_indptr, self.batch_indices, self.positions, is_neox=True,
                  quantize_dtype=cfg.fp8, page_size=cfg.page, kv_layout=cfg.layout, q_rope_out=c.q_rope_out,
                  q_nope_out=c.q_nope_out)

    def reference(self):
        """(q_rope_out, q_nope_out, (k_cache, v_cache)) from the float32 reference on copy 0."""
        from .. import reference

        c = self.copies[0]
        c.reset()
        return reference.rope_quantize_fp8_append_paged_kv_cache(
            c.q_rope, c.k_rope, c.q_nope, c.k_nope, c.v, self.cos_sin, self.positions, c.cache, self.kv_indices,
            self.kv_indptr, self.batch_indices, self.positions, True, 1.0, 1.0, self.cfg.layout)

    def check(self, fn, want) -> str:
        """Copy 0 reset to NaN, one call, then its q and both caches against the reference."""
        c = self.copies[0]
        c.reset()
        self.call(fn, 0)
        if c.v.is_cuda:
            torch.cuda.synchronize()
        checks = [groups.check_fp8_codes(c.q_rope_out, want[0]), groups.check_fp8_codes(c.cache[0], want[2][0]),
                  groups.check_fp8_codes(c.cache[1], want[2][1])]
        if c.q_nope_out is not None:
            checks.append(groups.check_fp8_codes(c.q_nope_out, want[1]))
        return groups.merge_checks(*checks)


def _cos_sin_cache(max_pos: int, rope_dim: int, theta: float = 5e5) -> torch.Tensor:
    """float32 [max_pos, rope_dim] of [cos | sin] (Llama-3's rope_theta)."""
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


def bench_case(cfg: Config, kind: str, tokens: int, a, setup: groups.Setup, libs) -> List[Row]:
    nbytes = bytes_moved(cfg, tokens)
    ncopies = max(1, min(8, math.ceil(100e6 / nbytes))) if setup.gpu else 1
    case = Case(cfg, kind, tokens, ncopies, setup.device, a.seed)
    want = case.reference()
    rows = []
    for name in a.providers:
        row = Row(kind, tokens, name, nbytes)
        rows.append(row)
        fn, why = libs[name]
        if fn is None:
            row.check = why
            continue
        try:
            if name == "copy":
                row.check = "reference row"
                src = [torch.empty(nbytes // 2, dtype=torch.uint8, device=setup.device) for _ in range(ncopies)]
                dst = [torch.empty_like(x) for x in src]
                call = lambda i: dst[i].copy_(src[i])  # noqa: E731
            else:
                row.check = case.check(fn, want)
                call = functools.partial(case.call, fn)
            t = measure(call, device=setup.device, mode="graph", ncopies=ncopies, cfg=setup.timing)
        except Exception as exc:  # one provider failing must not stop the run
            row.check = "ERROR " + groups.error_text(exc)
            continue
        row.note = t.note
        if setup.gpu:
            row.time_us = t.time_us
            row.tb_s = nbytes / (t.time_us * 1e6)
    del case
    if setup.gpu:
        torch.cuda.empty_cache()
    return rows


def table(rows: List[Row], copy_tb_s: Optional[float]) -> str:
    ours: Dict[tuple, Row] = {(r.kind, r.tokens): r for r in rows if r.provider == "tritoninfer"}
    out = []
    for r in rows:
        mine = ours.get((r.kind, r.tokens))
        out.append([r.kind, str(r.tokens), r.provider, f"{r.nbytes / 1e6:.3f}", groups.fmt(r.time_us, ".2f"),
                    groups.fmt(r.tb_s, ".2f"), groups.fmt(r.tb_s / copy_tb_s if r.tb_s and copy_tb_s else None, ".0%"),
                    groups.ratio(r.time_us, mine.time_us if mine else None) if r.provider != "tritoninfer" else "",
                    r.check + (f"; {r.note}" if r.note else "")])
    head = ["kind", "tokens", "provider", "MB moved", "µs", "TB/s", "of copy", "this/ours", "check"]
    return groups.markdown_table(out, head)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from .cli import heads_list, positive_int

    p = groups.parser("rope-append", __doc__, f"{', '.join(map(str, QUICK_TOKENS))} tokens, decode and prefill")
    p.add_argument("--tokens", type=groups.int_list("a token count"),
                   help=f"tokens appended per call (default {','.join(map(str, TOKENS))})")
    p.add_argument("--kind", type=groups.name_list(KINDS, "kind"), default=list(KINDS),
                   help="decode (a token per request) and/or prefill (one request); default both")
    p.add_argument("--heads", type=lambda t: heads_list(t)[0], default=None, metavar="QO/KV", help="default 32/8")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default 128")
    p.add_argument("--rope-dim", type=positive_int, default=None, help="rotary part of the head (default: all of it)")
    p.add_argument("--page-size", type=positive_int, default=None, help="default 16")
    p.add_argument("--context", type=positive_int, default=4096, help="decode: request lengths drawn in [1, N]")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="q/k/v dtype (default bf16)")
    p.add_argument("--fp8", choices=sorted(FP8), default="e4m3", help="cache and q output dtype (default e4m3)")
    p.add_argument("--layout", choices=["NHD", "HND"], default="NHD")
    p.add_argument("--providers", type=groups.name_list(PROVIDERS, "provider"), default=list(PROVIDERS))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """Runs the fused RoPE-quantize-append group; returns 1 when a tritoninfer output failed its check."""
    from .. import rope as ours

    a = parse_args(argv)
    setup = groups.start("rope-append", argv, a)
    gpu = setup.gpu
    h, hk = a.heads or ((32, 8) if gpu else (4, 2))
    head_dim = a.head_dim or (128 if gpu else 16)
    rope_dim = a.rope_dim or (head_dim if gpu or a.head_dim else 8)
    if rope_dim > head_dim or rope_dim % 2:
        print(f"tritoninfer bench rope-append: --rope-dim {rope_dim} must be even and at most head_dim {head_dim}",
              file=sys.stderr)
        return 2
    cfg = Config(h, hk, head_dim, rope_dim, a.page_size or (16 if gpu else 4),
                 torch.bfloat16 if a.dtype == "bf16" else torch.float16, FP8[a.fp8], a.layout,
                 a.context if gpu else min(a.context, 40))
    tokens = a.tokens or ((QUICK_TOKENS if a.quick else TOKENS) if gpu else CPU_TOKENS)
    fi_rope, why = groups.peer_flashinfer("rope")
    libs = {"tritoninfer": (ours.rope_quantize_fp8_append_paged_kv_cache, ""),
            "flashinfer": (getattr(fi_rope, "rope_quantize_fp8_append_paged_kv_cache", None),
                           why or "flashinfer.rope has no rope_quantize_fp8_append_paged_kv_cache"),
            "copy": (torch.Tensor.copy_, "")}
    rows: List[Row] = []
    for kind, n in itertools.product(a.kind, tokens):
        rows += bench_case(cfg, kind, n, a, setup, libs)
        groups.progress(f"rope-append {kind} {n}: " + ", ".join(
            f"{r.provider} {groups.fmt(r.time_us, '.2f') or r.check}" for r in rows[-len(a.providers):]))
    tail = []
    if gpu:
        big = [r for r in rows if r.provider == "tritoninfer" and r.tokens >= 1024 and r.tb_s]
        tail.append(groups.goal_line("tritoninfer rows of >= 1024 tokens at >= 80 % of the copy bandwidth",
                                     sum(r.tb_s >= 0.8 * setup.copy_tb_s for r in big), len(big)))
    nope = head_dim - rope_dim
    head = groups.header(setup, "fused RoPE + fp8 quantize + paged append", [
        f"heads {h}/{hk}, head_dim {head_dim} (rope {rope_dim}, nope {nope}), neox style, {a.dtype} in, "
        f"{a.fp8} out, page {cfg.page}, {a.layout}; decode: a token per request at a random position "
        f"below {cfg.context}; prefill: one request from position 0.",
        "µs: median per call over CUDA-graph replays; TB/s over q/k/v read, q/k/v written in fp8, the cos/sin "
        "row and the indices of each token; of copy: against the copy bandwidth above; this/ours > 1: "
        "tritoninfer faster; copy: a device copy of the same bytes (half read, half written), the size's ceiling.",
        "check: fp8 codes of q and of both caches (unwritten slots NaN) against tritoninfer.reference, one code "
        "of slack on at most 1 % of the elements."])
    groups.finish(setup, a.out, head, table(rows, setup.copy_tb_s), tail)
    return 1 if any(groups.failed(r.check) for r in rows if r.provider == "tritoninfer") else 0
