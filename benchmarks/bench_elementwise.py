"""Bandwidth of tritoninfer's elementwise kernels (RoPE, RMSNorm, gated activations) vs FlashInfer.

Each case's device time is its kernels' own duration (CUPTI, through ``torch.profiler``, L2
flushed before each call), its eager time the median of back-to-back launches from Python (``triton.testing.do_bench``, host
launch cost included). GB/s counts the bytes the operation must read and write (inputs once,
outputs once, index and cos/sin-cache bytes included); "% copy" compares with a torch copy moving
the same bytes, timed the same way (copy bandwidth depends on size: 67 MB copy at ~2.8 TB/s, 1 GB
at ~4.2 TB/s on the H200). When ``flashinfer`` is importable its function of the same name runs on
the same inputs and the table gives the ratio of device times ``flashinfer / tritoninfer``
(> 1: tritoninfer is faster). A large ``torch`` copy gives the device's peak copy bandwidth.

    python benchmarks/bench_elementwise.py --out benchmarks/results/elementwise-h200.md

Without a GPU, ``--smoke`` runs every case once on tiny shapes through the Triton interpreter to
check the plumbing; its times are not measurements.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tritoninfer  # noqa: E402

try:  # FlashInfer is optional: its columns read "n/a" without it
    import flashinfer  # noqa: E402
    import flashinfer.activation  # noqa: E402,F401
    import flashinfer.norm  # noqa: E402,F401
    import flashinfer.rope  # noqa: E402,F401
except Exception as exc:  # ImportError, or a CUDA/JIT set-up failure at import time
    flashinfer = None
    FLASHINFER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    FLASHINFER_IMPORT_ERROR = ""


@dataclass
class Case:
    name: str  # the public function, same name in tritoninfer and flashinfer
    shape: str
    nbytes: int  # bytes read + written
    ours: Callable[[], object]
    theirs: Optional[Callable[[], object]]


def _fi(module: str, name: str):
    """FlashInfer's ``flashinfer.<module>.<name>``, or None."""
    if flashinfer is None:
        return None
    mod = getattr(flashinfer, module, None)
    return getattr(mod, name, None) if mod is not None else None


def _bind(fn, *args) -> Optional[Callable[[], object]]:
    """``lambda: fn(*args)`` with the arguments bound now (not at call time), or None without fn."""
    if fn is None:
        return None
    return lambda: fn(*args)


def _nb(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build_cases(device: str, dtype: torch.dtype, smoke: bool) -> List[Case]:
    cases: List[Case] = []
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    # ---- RoPE: Llama-3-8B-like heads (32 q / 8 kv, head_dim 128)
    hq, hk, d = (4, 2, 16) if smoke else (32, 8, 128)
    for nnz in ([8] if smoke else [64, 4096, 16384]):
        q, k = randn(nnz, hq, d), randn(nnz, hk, d)
        pos = torch.randint(0, 8192 if not smoke else 64, (nnz,), generator=g).to(device, torch.int32)
        shape = f"nnz={nnz} Hq={hq} Hk={hk} D={d}"
        io = 2 * _nb(q, k) + _nb(pos)
        for name in ("apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
                     "apply_llama31_rope_pos_ids"):
            ours_fn = getattr(tritoninfer, name)
            fi_fn = _fi("rope", name)
            cases.append(Case(
                name, shape, io,
                _bind(ours_fn, q, k, pos), _bind(fi_fn, q, k, pos),
            ))
        # ragged: requests of 256 tokens (or one request when nnz is small)
        req = min(nnz, 8 if smoke else 256)
        batch = nnz // req
        indptr = (torch.arange(batch + 1) * req).to(device, torch.int32)
        offsets = torch.randint(0, 4096, (batch,), generator=g).to(device, torch.int32)
        io_r = 2 * _nb(q, k) + _nb(indptr, offsets)
        for name in ("apply_rope", "apply_llama31_rope_inplace"):
            ours_fn, fi_fn = getattr(tritoninfer, name), _fi("rope", name)
            cases.append(Case(
                name, shape + f" reqs={batch}", io_r,
                _bind(ours_fn, q, k, indptr, offsets), _bind(fi_fn, q, k, indptr, offsets),
            ))
        # cos/sin cache (SGLang/vLLM convention): flattened heads, int64 positions
        max_pos = 64 if smoke else 8192
        cache = randn(max_pos, d, dt=torch.float32)
        query, key = q.reshape(nnz, -1).clone(), k.reshape(nnz, -1).clone()
        pos64 = pos.long()
        io_c = 2 * _nb(query, key) + _nb(pos64) + nnz * d * 4
        for name in ("apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace"):
            ours_fn, fi_fn = getattr(tritoninfer, name), _fi("rope", name)
            cases.append(Case(
                name, f"nnz={nnz} Hq={hq} Hk={hk} D={d}", io_c,
                _bind(ours_fn, pos64, query, key, d, cache, True),
                _bind(fi_fn, pos64, query, key, d, cache, True),
            ))

    # ---- RMSNorm
    norm_shapes = [(8, 24)] if smoke else [(4096, 4096), (4096, 8192), (128, 4096), (4096 * 32, 128)]
    for m, n in norm_shapes:
        x, w, r = randn(m, n), randn(n), randn(m, n)
        out = torch.empty_like(x)
        shape = f"{m}x{n}"
        for name in ("rmsnorm", "gemma_rmsnorm"):
            ours_fn, fi_fn = getattr(tritoninfer, name), _fi("norm", name)
            cases.append(Case(
                name, shape, 2 * _nb(x) + _nb(w),
                _bind(ours_fn, x, w, 1e-6, out), _bind(fi_fn, x, w, 1e-6, out),
            ))
        for name in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
            ours_fn, fi_fn = getattr(tritoninfer, name), _fi("norm", name)
            cases.append(Case(
                name, shape, 4 * _nb(x) + _nb(w),
                _bind(ours_fn, x, r, w, 1e-6), _bind(fi_fn, x, r, w, 1e-6),
            ))
    # per-head q norm on a 3-D [tokens, heads, head_dim] tensor
    t3, h3, d3 = (4, 2, 16) if smoke else (4096, 32, 128)
    x3, w3 = randn(t3, h3, d3), randn(d3)
    out3 = torch.empty_like(x3)
    fi_fn = _fi("norm", "rmsnorm")
    cases.append(Case(
        "rmsnorm", f"{t3}x{h3}x{d3} (3-D)", 2 * _nb(x3) + _nb(w3),
        _bind(tritoninfer.rmsnorm, x3, w3, 1e-6, out3), _bind(fi_fn, x3, w3, 1e-6, out3),
    ))

    # ---- gated activations (Llama-3-8B MLP: intermediate 14336)
    act_shapes = [(8, 24)] if smoke else [(4096, 14336), (64, 14336)]
    for m, dd in act_shapes:
        x, out = randn(m, 2 * dd), torch.empty(m, dd, device=device, dtype=dtype)
        for name in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):
            ours_fn, fi_fn = getattr(tritoninfer, name), _fi("activation", name)
            cases.append(Case(
                name, f"{m}x{2 * dd}", _nb(x) + _nb(out),
                _bind(ours_fn, x, out), _bind(fi_fn, x, out),
            ))

    # ---- the copy bandwidth of the device
    n_copy = 1 << 10 if smoke else 1 << 28  # 512 MiB in bf16
    src = torch.empty(n_copy, device=device, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    cases.append(Case("torch copy_", f"{n_copy} elems", 2 * _nb(src), _bind(dst.copy_, src), None))
    return cases


def _err(exc: Exception) -> str:
    msg = str(exc).splitlines()[0][:60] if str(exc) else ""
    return f"error: {type(exc).__name__} {msg}".replace("|", "/").strip()


_FLUSH: list = []


def device_ms(fn: Callable[[], object], smoke: bool, calls: int = 30) -> float:
    """Device time per call: the kernels' own durations (CUPTI, through ``torch.profiler``), L2
    flushed before every call, so neither host launch cost nor data left in L2 counts."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    flush = _FLUSH[0]
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = [e.device_time for e in prof.events()
               if e.device_type.name == "CUDA" and "FillFunctor" not in e.name]
    if not kernels:
        raise RuntimeError("the profiler recorded no kernel")
    return sum(kernels) / calls / 1e3


def eager_ms(fn: Callable[[], object], smoke: bool) -> float:
    """Time per call launched from Python, back to back: the larger of device and host time."""
    if smoke:
        return device_ms(fn, smoke)
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


_COPY_MS: dict = {}


def copy_ms(nbytes: int, device: str, smoke: bool) -> float:
    """A torch copy that reads and writes ``nbytes`` in total: the bandwidth bar at this size."""
    if nbytes not in _COPY_MS:
        src = torch.empty(max(1, nbytes // 4), device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        _COPY_MS[nbytes] = device_ms(lambda: dst.copy_(src), smoke)
    return _COPY_MS[nbytes]


def _timed(fn, nbytes: int, smoke: bool):
    """(device µs, GB/s, eager µs) as table strings; an error message on failure."""
    try:
        t = device_ms(fn, smoke)
        return t, f"{t * 1e3:.1f}", f"{nbytes / (t * 1e-3) / 1e9:.0f}", f"{eager_ms(fn, smoke) * 1e3:.1f}"
    except Exception as exc:  # keep going: one failing case must not hide the others
        return None, _err(exc), "", ""


def run(args) -> str:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    cases = build_cases(device, dtype, args.smoke)
    if args.filter:
        cases = [c for c in cases if args.filter in c.name]

    rows = []
    for c in cases:
        t_ours, ours, ours_bw, ours_eager = _timed(c.ours, c.nbytes, args.smoke)
        of_copy = f"{copy_ms(c.nbytes, device, args.smoke) / t_ours * 100:.0f}%" if t_ours else ""
        theirs, theirs_bw, theirs_eager, ratio = "n/a", "", "", ""
        if c.theirs is not None:
            t_fi, theirs, theirs_bw, theirs_eager = _timed(c.theirs, c.nbytes, args.smoke)
            if t_fi and t_ours:
                ratio = f"{t_fi / t_ours:.2f}"
        rows.append((c.name, c.shape, ours, ours_bw, of_copy, ours_eager, theirs, theirs_bw, theirs_eager, ratio))
        print(" | ".join(rows[-1]), flush=True)

    if device == "cuda":
        gpu = torch.cuda.get_device_name()
    else:
        gpu = "cpu (Triton interpreter; smoke run, not a measurement)"
    fi_version = getattr(flashinfer, "__version__", "?") if flashinfer is not None else (
        f"not importable ({FLASHINFER_IMPORT_ERROR})")
    header = [
        "# tritoninfer elementwise kernels" + (" (smoke run)" if args.smoke else ""),
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- device: {gpu}",
        f"- torch {torch.__version__}, triton {triton.__version__}, tritoninfer "
        f"{tritoninfer.__version__}, flashinfer {fi_version}, python {platform.python_version()}",
        f"- dtype: {args.dtype}; µs: device time, the kernels' own durations (CUPTI via torch.profiler), "
        "mean of 30 calls with L2 flushed before each; GB/s = bytes read + written / time (1 GB = 1e9 B); "
        "% copy = a torch copy moving the same bytes (read + write), timed the same way, over this time; "
        "eager µs: median of back-to-back calls from Python (`triton.testing.do_bench`), which includes "
        "the host's launch cost when that exceeds the device time; ratio = flashinfer device time / "
        "tritoninfer device time (> 1: tritoninfer faster)",
        "",
        "| function | shape | tritoninfer µs | GB/s | % copy | eager µs | flashinfer µs | GB/s | eager µs | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = "\n".join(header + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the markdown table to this path")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--filter", default="", help="only functions whose name contains this")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, one run each (works without a GPU); not a measurement")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("bench_elementwise: no CUDA GPU; use --smoke to check the script on the CPU",
              file=sys.stderr)
        return 2
    table = run(args)
    print()
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
