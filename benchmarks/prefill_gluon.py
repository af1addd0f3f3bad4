"""The Gluon prefill for Hopper (``tritoninfer/kernels/prefill_hopper.py``, issue "Prefill, part 2"):
A/B against the attention core on the same inputs, with torch SDPA and FlashInfer's fa3 in the same
process, or compiled for sm_90 without a GPU. benchmarks/NOTES.md (sessions 5 and 6) has the steps
that led to it.

    PYTHONPATH=. python benchmarks/prefill_gluon.py [--fa3] [--configs 3-240,3-240-1]   # GPU: ragged
    PYTHONPATH=. python benchmarks/prefill_gluon.py --paged [--fa3]                      # GPU: paged
    PYTHONPATH=. python benchmarks/prefill_gluon.py --ab [--fa3] [--variants persistent,one-item]
    PYTHONPATH=. python benchmarks/prefill_gluon.py --compile [--page 16]                # no GPU

A config is ``STAGES-CONSUMER_REGS``, with ``-1`` appended for one work item per program (not
persistent). The GPU modes force the Gluon kernel for every length (past ``_route.HOPPER_MIN_LEN``,
to place the thresholds). ``--paged`` runs the paged wrapper on the kernel's paged mode (a TMA box
per page) against the same wrapper on the attention core over one page table, and the ragged
kernel on contiguous copies of the same K/V (paging's cost). ``--ab`` times kernel variants in
interleaved rounds (ragged and paged, with fa3)."""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton

from tritoninfer import _hopper, _route


def compile_only(configs, page=0):
    """Compile the kernel for sm_90 and print registers, shared memory and the wgmma count
    (``page`` > 0: the paged mode, K/V boxes of one page with the 128-row tile's layout)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from tritoninfer.kernels.prefill_hopper import prefill_hopper_kernel

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for d in (128, 64):
        for causal in (False, True):
            for stages, regs, _ in configs:
                host = torch.empty(1024, 32 * d, dtype=torch.bfloat16)

                def desc(rows, box):
                    layout = _hopper.smem_layout(rows, d, torch.bfloat16)
                    return mangle_type(TensorDescriptor(host, list(host.shape), list(host.stride()), [box, d], layout))

                kv_box = page or 128
                sig = {"q_desc": desc(64, 64), "k_desc": desc(128, kv_box), "v_desc": desc(128, kv_box), "o_ptr": "*bf16",
                       "stride_o_tok": "i32", "stride_o_head": "i32", "lse_ptr": "*fp32", "stride_lse_tok": "i32",
                       "qo_indptr_ptr": "*i32", "kv_indptr_ptr": "*i32", "kv_len_ptr": "*i32", "tile_req_ptr": "*i32",
                       "tile_start_ptr": "*i32", "num_qo_heads": "i32", "num_items": "i32", "sm_scale_log2": "fp32",
                       "kv_indices_ptr": "*i32", "rows_per_page": "i32"}
                const = dict(GROUP=4, STAGES=stages, IS_CAUSAL=causal, CONSUMER_REGS=regs, PAGE_SIZE=page, num_warps=4)
                # what a launch specialises: pointers and these integers divisible by 16
                attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name.endswith("_ptr") or
                         name in ("stride_o_tok", "stride_o_head", "stride_lse_tok", "num_qo_heads")}
                sig.update({name: "constexpr" for name in const})
                k = triton.compile(GluonASTSource(prefill_hopper_kernel, sig, const, attrs),
                                   target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=4, maxnreg=_hopper.maxnreg(regs)))
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                                           capture_output=True, text=True).stdout
                    sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", f.name], capture_output=True,
                                          text=True).stdout
                reg = next((line.strip() for line in usage.splitlines() if "REG:" in line), usage.strip())
                print(f"d{d} causal={causal} stages={stages} regs={regs}: {reg}; shared {k.metadata.shared} B; "
                      f"HGMMA {len(re.findall('HGMMA', sass))}")


DEFAULT_MIN_LEN = dict(_route.HOPPER_MIN_LEN)


def _forced(on: bool) -> None:
    """The Gluon kernel on for every length (past the measured thresholds), or off, for the next plans."""
    _route.HOPPER_PREFILL = on
    _route.HOPPER_MIN_LEN = dict.fromkeys(DEFAULT_MIN_LEN, 0) if on else dict(DEFAULT_MIN_LEN)


def _paged_and_ragged(batch, n, hq, hk, d, page):
    """Random bf16 inputs of ``batch`` requests of ``n`` tokens: a paged cache (shuffled pages), q,
    qo_indptr, and the same K/V contiguous per request for the ragged kernel."""
    sys.path.insert(0, "benchmarks")
    from decode_sweep import gpu_paged_kv

    torch.manual_seed(0)
    kv = gpu_paged_kv(batch, n, hk, d, page, torch.bfloat16, "NHD")
    q = torch.randn((batch * n, hq, d), device="cuda").to(torch.bfloat16)
    qo_indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda")
    pages = kv.kv_indices.long().view(batch, -1)
    return kv, q, qo_indptr, kv.cache[pages, 0].reshape(batch * n, hk, d), kv.cache[pages, 1].reshape(batch * n, hk, d)


def main_paged(args):
    """Paged mode: the wrapper on the Gluon kernel against the wrapper on the core over one page
    table, the ragged Gluon kernel on contiguous copies of the same K/V (paging's cost), and fa3."""
    import tritoninfer
    from tritoninfer import testing

    sys.path.insert(0, "benchmarks")
    from decode_sweep import eager_time

    ws_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print("| shape | causal | kernel | µs | TFLOP/s | rel err vs the core |")
    print("|---|---|---|---|---|---|")
    shapes = [(32, 512, 16), (16, 1024, 16), (8, 2048, 16), (4, 4096, 16), (1, 16384, 16), (4, 4096, 8),
              (4, 4096, 64)]
    hq, hk, d = 32, 8, 128
    for batch, n, page in shapes:
        kv, q, qo_indptr, k, v = _paged_and_ragged(batch, n, hq, hk, d, page)
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            rows = []
            for name, on, persistent in (("core, paged", False, True), (f"gluon, paged (page {page})", True, True),
                                         ("gluon, paged, an item per program", True, False)):
                _forced(on)
                w = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws_buf)
                w.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=causal,
                       q_data_type=torch.bfloat16)
                assert (w._step.route_work is not None) == on
                rows.append((name, lambda w=w, p=persistent: _run_with((_hopper.STAGES,
                             _hopper.CONSUMER_REGS, p), w, q, kv.cache)))
            _forced(True)
            rw = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf)
            rw.plan(qo_indptr, qo_indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
            rows.append(("gluon, ragged", lambda rw=rw: _run_with((_hopper.STAGES, _hopper.CONSUMER_REGS,
                                                                   True), rw, q, k, v)))
            if args.fa3:
                import flashinfer

                fw = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_buf, backend="fa3")
                fw.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=causal,
                        q_data_type=torch.bfloat16)
                rows.append(("flashinfer-fa3, paged", lambda fw=fw: fw.run(q, kv.cache)))
            ref = rows[0][1]().float()
            for name, fn in rows:
                err = testing.rel_error(fn().float(), ref)
                us = eager_time(fn, reps=10)
                print(f"| {batch}x{n} p{page} | {causal} | {name} | {us:.0f} | {flops / us / 1e6:.0f} | {err:.2e} |",
                      flush=True)
                if err > 2e-2:
                    print(f"MISMATCH: {name} differs from the core by {err:.3g}", flush=True)
    _forced(False)


def main_ab(args):
    """Kernel variants (``--variants``: persistent, one item per program), ragged and paged
    (page 16) on the same K/V, with fa3 on both: every variant timed in each of ``--rounds`` rounds (interleaved, so clock
    drift hits all alike); the median over rounds and the spread of the round medians."""
    import statistics

    import tritoninfer
    from tritoninfer import testing

    sys.path.insert(0, "benchmarks")
    from decode_sweep import eager_time

    ws_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    hq, hk, d, page = 32, 8, 128, 16
    cfg = (_hopper.STAGES, _hopper.CONSUMER_REGS)
    print(f"| shape | causal | kernel | µs (median of {args.rounds} rounds) | round medians min–max | TFLOP/s | "
          "rel err |")
    print("|---|---|---|---|---|---|---|")
    _forced(True)
    for batch, n in (tuple(map(int, x.split("x"))) for x in args.shapes.split(",")):
        kv, q, indptr, k, v = _paged_and_ragged(batch, n, hq, hk, d, page)
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            rw = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf)
            rw.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
            pw = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws_buf)
            pw.plan(indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=causal,
                    q_data_type=torch.bfloat16)
            assert rw._step.route_work is not None and pw._step.route_work is not None
            rows = []
            for tag in args.variants.split(","):
                v_cfg = cfg + VARIANTS[tag]
                rows.append((f"gluon ragged, {tag}", lambda c=v_cfg: _run_with(c, rw, q, k, v)))
                rows.append((f"gluon paged, {tag}", lambda c=v_cfg: _run_with(c, pw, q, kv.cache)))
            if args.fa3:
                import flashinfer

                fr = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf, backend="fa3")
                fr.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
                fp = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws_buf, backend="fa3")
                fp.plan(indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hq, hk, d, page, causal=causal,
                        q_data_type=torch.bfloat16)
                rows += [("flashinfer-fa3 ragged", lambda: fr.run(q, k, v)),
                         ("flashinfer-fa3 paged", lambda: fp.run(q, kv.cache))]
            ref = rows[0][1]().float()
            errs = {name: testing.rel_error(fn().float(), ref) for name, fn in rows}
            rounds = {name: [] for name, _ in rows}
            for _ in range(args.rounds):
                for name, fn in rows:
                    rounds[name].append(eager_time(fn, reps=10))
            for name, _ in rows:
                us = statistics.median(rounds[name])
                print(f"| {batch}x{n} | {causal} | {name} | {us:.0f} | {min(rounds[name]):.0f}–{max(rounds[name]):.0f} | "
                      f"{flops / us / 1e6:.0f} | {errs[name]:.2e} |", flush=True)
                if errs[name] > 2e-2:
                    print(f"MISMATCH: {name} differs by {errs[name]:.3g}", flush=True)
    _forced(False)


# --ab variants: (persistent,)
VARIANTS = {"persistent": (True,), "one-item": (False,)}


def _run_with(cfg, wrapper, *args):
    """Runs with the Hopper kernel's (stages, consumer registers, persistent) set to ``cfg`` (module
    settings read at launch)."""
    if cfg:
        _hopper.STAGES, _hopper.CONSUMER_REGS, _hopper.PERSISTENT = cfg
    return wrapper.run(*args)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 only (no GPU)")
    ap.add_argument("--configs", default="3-240,3-240-1",
                    help="STAGES-CONSUMER_REGS[-1], comma-separated (-1: an item per program, not persistent)")
    ap.add_argument("--fa3", action="store_true", help="also FlashInfer's fa3 backend (JIT-compiles)")
    ap.add_argument("--paged", action="store_true", help="the kernel's paged mode (see the module docstring)")
    ap.add_argument("--page", type=int, default=0, help="with --compile: the paged mode at this page size")
    ap.add_argument("--ab", action="store_true", help="kernel variants in interleaved rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="persistent,one-item", help=f"with --ab: of {', '.join(VARIANTS)}")
    ap.add_argument("--shapes", default="16x1024,8x2048,4x4096,1x16384", help="with --ab: BATCHxLEN, comma-separated")
    args = ap.parse_args(argv)
    if args.paged:
        main_paged(args)
        return
    if args.ab:
        main_ab(args)
        return
    configs = [tuple(map(int, c.split("-")[:2])) + (not c.endswith("-1"),) for c in args.configs.split(",")]
    if args.compile:
        compile_only(configs, args.page)
        return
    import tritoninfer
    from tritoninfer import testing

    sys.path.insert(0, "benchmarks")
    from decode_sweep import eager_time

    shapes = [(32, 512, 32, 8, 128), (16, 1024, 32, 8, 128), (8, 2048, 32, 8, 128), (4, 4096, 32, 8, 128),
              (1, 16384, 32, 8, 128)]
    ws_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print("| shape | causal | kernel | µs | TFLOP/s | rel err vs the core |")
    print("|---|---|---|---|---|---|")
    for batch, n, hq, hk, d in shapes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (testing.randn((batch * n, h, d), torch.bfloat16, "cuda", generator=g) for h in (hq, hk, hk))
        indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device="cuda")
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            rows = []
            for name, on, cfg in [("core", False, None)] + [(f"gluon {s}-{r}{'' if p else ' 1/program'}", True, (s, r, p))
                                                             for s, r, p in configs]:
                _forced(on)
                w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf)
                w.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
                assert (w._step.route_work is not None) == on
                rows.append((name, lambda w=w, cfg=cfg: _run_with(cfg, w, q, k, v), None))
            # SDPA on [B, H, N, D] copies; its output is brought back to tokens-major outside the timing
            q4, k4, v4 = (x.view(batch, n, -1, d).transpose(1, 2).contiguous() for x in (q, k, v))
            rows.append(("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
                q4, k4, v4, is_causal=causal, enable_gqa=True), lambda o: o.transpose(1, 2).reshape(batch * n, hq, d)))
            if args.fa3:
                import flashinfer

                fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf, backend="fa3")
                fw.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
                rows.append(("flashinfer-fa3", lambda fw=fw: fw.run(q, k, v), None))
            ref = rows[0][1]().float()
            for name, fn, post in rows:
                out = fn()
                err = testing.rel_error((post(out) if post else out).float(), ref)
                us = eager_time(fn, reps=10)
                print(f"| {batch}x{n} d{d} | {causal} | {name} | {us:.0f} | {flops / us / 1e6:.0f} | {err:.2e} |",
                      flush=True)
                if err > 2e-2:
                    print(f"MISMATCH: {name} differs from the core by {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
