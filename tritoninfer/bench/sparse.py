"""``tritoninfer bench sparse``: block-sparse attention, tritoninfer's ``BlockSparseAttentionWrapper``
against FlashInfer's (``flashinfer.sparse``, backend ``auto``), same process, same inputs.

Per shape (M = N query rows and keys, R x C blocks, a random BSR pattern in which each block is kept
with probability 1 - sparsity) both plan ``q_data_type = kv_data_type = o_data_type``. Default: M = N
8K and 16K, blocks 64 and 16, 50 % and 90 % sparse, 32/32 heads, head_dim 128, bf16. Timing: CUDA
events around eager ``run()`` calls (``timing.measure``, mode ``events``: the calls are hundreds of
µs), median µs per call with p20–p80; ``plan()`` host time beside it. TFLOP/s counts the non-zero
blocks only: ``4 * nnz * R * C * head_dim * num_qo_heads``. Checks: each provider's output on
``--check-rows`` sampled block rows against the float32 reference (``tritoninfer.reference.attention``
over each row's blocks).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import groups
from .timing import measure

PROVIDERS = ("tritoninfer", "flashinfer")


@dataclass
class Row:
    shape: Tuple[int, int, float]
    provider: str
    nnz: int = 0
    time_us: Optional[float] = None
    p20_us: Optional[float] = None
    p80_us: Optional[float] = None
    plan_us: Optional[float] = None
    tflops: Optional[float] = None
    check: str = ""
    note: str = ""


class Inputs:
    """One shape's tensors and BSR pattern (int32, on the device)."""

    def __init__(self, a, seq: int, block: int, sparsity: float, device):
        from .. import testing

        g = torch.Generator(device="cpu").manual_seed(a.seed + seq * 31 + block * 7 + int(sparsity * 100))
        self.M = self.N = seq
        self.R = self.C = block
        self.dtype = a.dtype
        mb, nb = -(-seq // block), seq // block
        keep = torch.rand(mb, nb, generator=g) >= sparsity
        self.indptr = torch.zeros(mb + 1, dtype=torch.int32)
        self.indptr[1:] = torch.cumsum(keep.sum(1), 0)
        self.indices = torch.nonzero(keep)[:, 1].to(torch.int32)
        self.nnz = int(self.indptr[-1])
        hq, hk, d = a.num_qo_heads, a.num_kv_heads, a.head_dim
        self.q = testing.randn((seq, hq, d), self.dtype, device, g)
        self.k = testing.randn((seq, hk, d), self.dtype, device, g)
        self.v = testing.randn((seq, hk, d), self.dtype, device, g)
        self.indptr_d, self.indices_d = self.indptr.to(device), self.indices.to(device)
        self.rows = sorted(set(torch.randint(0, mb, (a.check_rows,), generator=g).tolist()))

    def plan_args(self, a):
        return (self.indptr_d, self.indices_d, self.M, self.N, self.R, self.C, a.num_qo_heads, a.num_kv_heads,
                a.head_dim)

    def check(self, out: torch.Tensor, causal: bool) -> str:
        """The sampled block rows against the float32 attention of each row over its blocks."""
        from .. import reference, testing

        if not self.rows:
            return "unchecked (--check-rows 0)"
        kb = self.k.view(-1, self.C, *self.k.shape[1:])
        vb = self.v.view(-1, self.C, *self.v.shape[1:])
        got, want = [], []
        for i in self.rows:
            rows = slice(i * self.R, min((i + 1) * self.R, self.M))
            cols = self.indices[int(self.indptr[i]):int(self.indptr[i + 1])].long().to(self.k.device)
            ref, _ = reference.attention(self.q[rows], kb[cols].flatten(0, 1), vb[cols].flatten(0, 1), causal=causal)
            got.append(out[rows])
            want.append(ref)
        return groups.check_close(torch.cat(got), torch.cat(want), testing.tolerance(self.dtype))


def setup_provider(lib, x: Inputs, a, workspace):
    wrapper = lib.BlockSparseAttentionWrapper(workspace)

    def plan():
        wrapper.plan(*x.plan_args(a), causal=a.causal, q_data_type=x.dtype, kv_data_type=x.dtype, o_data_type=x.dtype)

    plan()
    out = torch.empty_like(x.q)

    def run(i):
        return wrapper.run(x.q, x.k, x.v, out=out)

    return plan, run


def bench_shape(a, setup: groups.Setup, seq: int, block: int, sparsity: float, libs, workspace) -> List[Row]:
    x = Inputs(a, seq, block, sparsity, setup.device)
    flops = 4 * x.nnz * x.R * x.C * a.head_dim * a.num_qo_heads
    rows = []
    for name in a.providers:
        row = Row((seq, block, sparsity), name, x.nnz)
        rows.append(row)
        lib, why = libs[name]
        if lib is None:
            row.check = why
            continue
        try:
            plan, run = setup_provider(lib, x, a, workspace)
            row.check = x.check(run(0), a.causal)
            t = measure(run, device=setup.device, mode="events", ncopies=1, cfg=setup.timing, plan=plan)
        except Exception as exc:  # one provider failing must not stop the run
            row.check = "ERROR " + groups.error_text(exc)
            continue
        row.note = t.note
        if setup.gpu:
            row.time_us, row.p20_us, row.p80_us, row.plan_us = t.time_us, t.p20_us, t.p80_us, t.plan_host_us
            row.tflops = flops / (t.time_us * 1e6)
    del x
    if setup.gpu:
        torch.cuda.empty_cache()
    return rows


def table(rows: List[Row]) -> str:
    ours: Dict[tuple, Row] = {r.shape: r for r in rows if r.provider == "tritoninfer"}
    out = []
    for r in rows:
        mine = ours.get(r.shape)
        seq, block, sparsity = r.shape
        out.append([f"{seq}", f"{block}", f"{sparsity:.0%}", r.provider, str(r.nnz), groups.fmt(r.time_us),
                    f"{r.p20_us:.1f}–{r.p80_us:.1f}" if r.time_us else "", groups.fmt(r.tflops),
                    groups.ratio(r.time_us, mine.time_us if mine else None) if r.provider != "tritoninfer" else "",
                    groups.fmt(r.plan_us, ".0f"), r.check + (f"; {r.note}" if r.note else "")])
    head = ["M = N", "R = C", "sparsity", "provider", "nnz blocks", "µs", "p20–p80", "TFLOP/s", "this/ours",
            "plan µs (host)", "check"]
    return groups.markdown_table(out, head)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from .cli import positive_int

    p = groups.parser("sparse", __doc__, "M = N 8K, blocks of 64, 50 % and 90 % sparse")
    p.add_argument("--seq", type=groups.int_list("a length"), help="M = N (default 8K,16K)")
    p.add_argument("--block", type=groups.int_list("a block size"), help="R = C (default 64,16)")
    p.add_argument("--sparsity", type=groups.float_list("a fraction of zero blocks", 0.0, 1.0), default=[0.5, 0.9],
                   help="fractions of zero blocks (default 0.5,0.9)")
    p.add_argument("--num-qo-heads", type=positive_int, default=None, help="default 32")
    p.add_argument("--num-kv-heads", type=positive_int, default=None, help="default 32")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default 128")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default=None, help="default bfloat16")
    p.add_argument("--causal", action="store_true", help="causal within each block row's request")
    p.add_argument("--providers", type=groups.name_list(PROVIDERS, "provider"), default=list(PROVIDERS))
    p.add_argument("--check-rows", type=int, default=8, help="block rows checked against the reference (0: none)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """Runs the block-sparse group; returns 1 when a tritoninfer output failed its check, else 0."""
    from .. import sparse as ours

    a = parse_args(argv)
    setup = groups.start("sparse", argv, a, eager_timed=True)
    gpu = setup.gpu
    a.num_qo_heads = a.num_qo_heads or (32 if gpu else 2)
    a.num_kv_heads = a.num_kv_heads or (32 if gpu else 1)
    a.head_dim = a.head_dim or (128 if gpu else 16)
    a.dtype = getattr(torch, a.dtype or ("bfloat16" if gpu else "float16"))
    seqs = a.seq or ([8192] if a.quick else [8192, 16384]) if gpu else (a.seq or [32])
    blocks = a.block or ([64] if a.quick else [64, 16]) if gpu else (a.block or [8])
    libs = {"tritoninfer": (ours, ""), "flashinfer": groups.peer_flashinfer("sparse")}
    workspace = torch.empty((128 << 20) if gpu else (8 << 20), dtype=torch.uint8, device=setup.device)
    rows: List[Row] = []
    for seq in seqs:
        for block in blocks:
            for sparsity in a.sparsity:
                rows += bench_shape(a, setup, seq, block, sparsity, libs, workspace)
                groups.progress(f"sparse {seq} {block} {sparsity:.0%}: " + ", ".join(
                    f"{r.provider} {groups.fmt(r.time_us) or r.check}" for r in rows[-len(a.providers):]))
    tail = [groups.at_least_as_fast(rows, "tritoninfer", "flashinfer",
                                    "shapes where tritoninfer is at least as fast as FlashInfer")] if gpu else []
    dtype = str(a.dtype).replace("torch.", "")
    head = groups.header(setup, "block-sparse attention", [
        f"heads {a.num_qo_heads}/{a.num_kv_heads}, head_dim {a.head_dim}, {dtype}, "
        f"{'causal within block rows' if a.causal else 'no causal mask'}; q, k, v [M, H, D]; a random BSR "
        "pattern per shape, each block kept with probability 1 - sparsity.",
        "µs: median per eager call (CUDA events), p20–p80; TFLOP/s over the non-zero blocks only; "
        "this/ours = this provider's time / tritoninfer's (> 1: tritoninfer faster).",
        f"check: {a.check_rows} sampled block rows against the float32 reference."])
    groups.finish(setup, a.out, head, table(rows), tail)
    return 1 if any(groups.failed(r.check) for r in rows if r.provider == "tritoninfer") else 0
