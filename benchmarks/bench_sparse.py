"""Benchmark block-sparse attention: tritoninfer's ``BlockSparseAttentionWrapper`` against FlashInfer's.

Per shape (M = N query rows and keys, R x C blocks, a random BSR pattern with the given sparsity, i.e.
each block kept with probability 1 - sparsity), the same inputs go to:

- ``tritoninfer``: ``tritoninfer.sparse.BlockSparseAttentionWrapper``;
- ``flashinfer``: ``flashinfer.sparse.BlockSparseAttentionWrapper`` (backend ``auto``), when
  ``flashinfer`` is importable in the same process (skipped, not failed, when it is not).

Both plan ``q_data_type = kv_data_type = o_data_type`` = ``--dtype``. Timing: CUDA events around eager
``run()`` calls (``tritoninfer.bench.timing.measure``, mode ``events``), median µs per call with p20-p80;
``plan()`` host time separately. TFLOP/s counts only the non-zero blocks: ``4 * nnz * R * C * head_dim *
num_qo_heads`` (QK^T and PV, a multiply-add = 2 FLOPs). The ratio is FlashInfer's time over ours
(> 1: tritoninfer is faster).

Correctness: each provider's output on ``--check-rows`` sampled block rows is compared with the float32
reference (``tritoninfer.reference.attention`` over each row's blocks) with the dtype's tolerance; a
mismatch is flagged in the table and makes the exit status 1.

Issue target: at 50 % and 90 % sparsity, tritoninfer at least FlashInfer's speed.

    python benchmarks/bench_sparse.py --out benchmarks/results/sparse-h200.md
    python benchmarks/bench_sparse.py --smoke    # tiny shapes, CPU through the Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys


def _int_list(text: str):
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        mult = 1024 if item.endswith("K") else 1
        out.append(int(item[:-1] if item.endswith("K") else item) * mult)
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive ints (K suffix allowed), got {text!r}")
    return out


def _float_list(text: str):
    return [float(x) for x in text.split(",")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=_int_list, default=[8192, 16384], help="M = N (default 8192,16384)")
    p.add_argument("--block", type=_int_list, default=[64, 16], help="R = C (default 64,16)")
    p.add_argument("--sparsity", type=_float_list, default=[0.5, 0.9], help="fraction of zero blocks")
    p.add_argument("--num-qo-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--causal", action="store_true", help="causal within each block row's request")
    p.add_argument("--replays", type=int, default=30, help="timed eager calls")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check-rows", type=int, default=8, help="block rows checked against the reference (0: none)")
    p.add_argument("--out", help="write the markdown table here too")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.block, args.num_qo_heads, args.num_kv_heads, args.head_dim = [32], [8], 2, 1, 16
        args.dtype = "float16"
    return args


if __name__ == "__main__" and "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402

import tritoninfer  # noqa: E402
from tritoninfer import reference, testing  # noqa: E402
from tritoninfer.bench.timing import TimingConfig, measure  # noqa: E402

try:  # optional peer
    import flashinfer  # noqa: E402
    import flashinfer.sparse  # noqa: E402,F401
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None


class Inputs:
    """One shape's tensors and BSR pattern (int32, on the device)."""

    def __init__(self, args, seq: int, block: int, sparsity: float, device):
        g = torch.Generator(device="cpu").manual_seed(seq * 31 + block * 7 + int(sparsity * 100))
        self.M = self.N = seq
        self.R = self.C = block
        self.dtype = getattr(torch, args.dtype)
        mb, nb = -(-seq // block), seq // block
        keep = torch.rand(mb, nb, generator=g) >= sparsity
        self.indptr = torch.zeros(mb + 1, dtype=torch.int32)
        self.indptr[1:] = torch.cumsum(keep.sum(1), 0)
        self.indices = torch.nonzero(keep)[:, 1].to(torch.int32)
        self.nnz = int(self.indptr[-1])
        hq, hk, d = args.num_qo_heads, args.num_kv_heads, args.head_dim
        self.q = testing.randn((seq, hq, d), self.dtype, device, g)
        self.k = testing.randn((seq, hk, d), self.dtype, device, g)
        self.v = testing.randn((seq, hk, d), self.dtype, device, g)
        self.indptr_d, self.indices_d = self.indptr.to(device), self.indices.to(device)
        # the block rows checked against the reference
        self.rows = sorted(set(torch.randint(0, mb, (args.check_rows,), generator=g).tolist()))

    def plan_args(self, args):
        return (self.indptr_d, self.indices_d, self.M, self.N, self.R, self.C, args.num_qo_heads, args.num_kv_heads,
                args.head_dim)

    def check(self, out: torch.Tensor, causal: bool) -> float:
        """Largest relative error over the sampled block rows (float32 reference of each row's request)."""
        worst = 0.0
        kb = self.k.view(-1, self.C, *self.k.shape[1:])
        vb = self.v.view(-1, self.C, *self.v.shape[1:])
        for i in self.rows:
            rows = slice(i * self.R, min((i + 1) * self.R, self.M))
            cols = self.indices[int(self.indptr[i]):int(self.indptr[i + 1])].long().to(self.k.device)
            want, _ = reference.attention(self.q[rows], kb[cols].flatten(0, 1), vb[cols].flatten(0, 1), causal=causal)
            worst = max(worst, testing.rel_error(out[rows], want))
        return worst


def setup_provider(name: str, x: Inputs, args, workspace):
    lib = {"tritoninfer": tritoninfer, "flashinfer": flashinfer}[name]
    if lib is None:
        raise RuntimeError("not installed")
    wrapper = lib.sparse.BlockSparseAttentionWrapper(workspace)

    def plan():
        wrapper.plan(*x.plan_args(args), causal=args.causal, q_data_type=x.dtype, kv_data_type=x.dtype,
                     o_data_type=x.dtype)

    plan()
    out = torch.empty_like(x.q)

    def run(i):
        return wrapper.run(x.q, x.k, x.v, out=out)

    return plan, run


def main(args) -> int:
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    cfg = TimingConfig(eager_reps=args.replays, warmup=args.warmup)
    if not gpu:
        cfg = TimingConfig.for_cpu(cfg)
    workspace = torch.empty(128 << 20 if gpu else 8 << 20, dtype=torch.uint8, device=device)
    rows, mismatch, verdicts = [], False, []
    for seq in args.seq:
        for block in args.block:
            for sparsity in args.sparsity:
                x = Inputs(args, seq, block, sparsity, device)
                shape = f"M=N={seq}, R=C={block}, {sparsity:.0%} sparse"
                flops = 4 * x.nnz * x.R * x.C * args.head_dim * args.num_qo_heads
                times = {}
                for name in ("tritoninfer", "flashinfer"):
                    row = dict(shape=shape, provider=name, nnz=x.nnz)
                    try:
                        plan, run = setup_provider(name, x, args, workspace)
                        out = run(0)
                        if x.rows:
                            err = x.check(out, args.causal)
                            ok = err <= testing.tolerance(x.dtype) and not torch.isnan(out).any()
                            row["check"] = f"{'ok' if ok else 'MISMATCH'} ({err:.1e})"
                            mismatch |= not ok
                        else:
                            row["check"] = "unchecked"
                        t = measure(run, device=device, mode="events", ncopies=1, cfg=cfg, plan=plan)
                        row.update(time_us=t.time_us, p20=t.p20_us, p80=t.p80_us, plan_us=t.plan_host_us,
                                   tflops=flops / (t.time_us * 1e-6) / 1e12, method=t.method)
                        times[name] = t.time_us
                    except Exception as exc:  # noqa: BLE001 - one provider failing must not stop the run
                        status = "not installed" if str(exc) == "not installed" else \
                            f"error: {type(exc).__name__}: {exc}"
                        row.update(check=status.splitlines()[0][:160])
                    rows.append(row)
                if "tritoninfer" in times and "flashinfer" in times:
                    ratio = times["flashinfer"] / times["tritoninfer"]
                    rows[-2]["ratio"] = ratio
                    verdict = "MET" if ratio >= 0.95 else "NOT MET"
                    verdicts.append(f"{shape}: {verdict} ({ratio:.2f}× FlashInfer's speed)")
                del x
                if gpu:
                    torch.cuda.empty_cache()
    text = render(rows, args, device, verdicts, gpu)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 1 if mismatch else 0


def _f(x, spec):
    return "" if x is None else format(x, spec)


def render(rows, args, device, verdicts, gpu) -> str:
    try:
        from tritoninfer.bench.report import environment

        env = environment(device, None, None)
    except Exception:  # noqa: BLE001 - the header is best effort
        env = {"device": str(device), "torch": torch.__version__, "tritoninfer": tritoninfer.__version__,
               "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")}
    lines = ["# Block-sparse attention: tritoninfer vs FlashInfer", ""]
    if not gpu:
        lines += ["**CPU ONLY (Triton interpreter): these timings say nothing about GPU speed; only the checks "
                  "mean something.**", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- command: `{' '.join(sys.argv)}`",
              f"- heads {args.num_qo_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, {args.dtype}, "
              f"{'causal within block rows' if args.causal else 'no causal mask'}; q, k, v [M, H, D]",
              "- time: median µs per eager call (CUDA events), p20–p80; TFLOP/s over the non-zero blocks only; "
              "ratio = FlashInfer's time / tritoninfer's (≥ 1: tritoninfer at least as fast; ±5 % is a tie)", ""]
    lines += [f"**{v}**" for v in verdicts] + ([""] if verdicts else [])
    head = ["shape", "provider", "nnz blocks", "µs", "p20–p80", "TFLOP/s", "ratio", "plan µs (host)", "check"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], r["provider"], str(r["nnz"]), _f(r.get("time_us"), ".1f"),
                 f"{_f(r.get('p20'), '.1f')}–{_f(r.get('p80'), '.1f')}" if r.get("time_us") else "",
                 _f(r.get("tflops"), ".1f"), _f(r.get("ratio"), ".2f") + ("×" if r.get("ratio") else ""),
                 _f(r.get("plan_us"), ".0f"), r.get("check", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(parse_args()))
