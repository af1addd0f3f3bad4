"""Experiment for issue "Prefill, part 2": a warp-specialised ragged prefill loop, measured against
tritoninfer's own prefill on the same inputs. Not part of the package: if it wins, its loop moves
into the attention core.

Triton 3.6 warp-specialises an attention loop on sm_90 only when Q, K and V all come from 2-D tensor
descriptors, the kernel has one KV loop and ``num_warps=4`` (``benchmarks/NOTES.md``, prefill v1).
So this kernel: equal-length requests (the bench's shapes), ragged NHD K/V, one query head per
program, one loop that masks every tile (causal or the KV end), the shared core's softmax helpers.

    PYTHONPATH=. python benchmarks/prefill_ws.py                  # GPU: table of µs and TFLOP/s
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/prefill_ws.py --smoke   # CPU: correctness only
"""

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import tritoninfer  # noqa: E402
from tritoninfer import testing  # noqa: E402
from tritoninfer.kernels.attention import LOG2E, finalize, softmax_update  # noqa: E402

sys.path.insert(0, "benchmarks")
from decode_sweep import eager_time  # noqa: E402


@triton.jit
def ragged_prefill_ws_kernel(
    q_desc, k_desc, v_desc, o_ptr, seq_len, sm_scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """One program: BLOCK_M query tokens of query head ``program_id(1)`` (one head per program, as
    FlashAttention does: a 3-D Q box for the core's (token, group head) rows needs a reshape,
    which the warp-specialisation pass does not handle, and a 2-D box of the group's heads side
    by side would exceed TMA's 256 elements).

    q_desc: [tokens, H_qo * D] block [BLOCK_M, D]; k_desc/v_desc: [tokens, H_kv * D] block
    [BLOCK_N, D]; every request has ``seq_len`` query and KV tokens. o: like q."""
    tiles_per_req = tl.cdiv(seq_len, BLOCK_M)
    req = tl.program_id(0) // tiles_per_req
    tile = tl.program_id(0) % tiles_per_req
    if IS_CAUSAL:
        tile = tiles_per_req - 1 - tile  # the longest rows first, so the last wave is short ones
    q_tile_start = tile * BLOCK_M
    head = tl.program_id(1)
    kv_col = (head // GROUP) * HEAD_DIM
    base = req * seq_len

    q = q_desc.load([base + q_tile_start, head * HEAD_DIM])
    tok = q_tile_start + tl.arange(0, BLOCK_M)
    hi = seq_len
    if IS_CAUSAL:
        hi = tl.minimum(seq_len, q_tile_start + BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([base + start, kv_col])
        s = tl.dot(q, tl.trans(k)) * sm_scale_log2
        offs_n = start + tl.arange(0, BLOCK_N)
        keep = offs_n[None, :] < seq_len
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= tok[:, None])
        m_i, l_i, acc, p = softmax_update(m_i, l_i, acc, s, keep, 1.0, False)
        v = v_desc.load([base + start, kv_col])
        acc += tl.dot(p.to(v.dtype), v)

    o, _ = finalize(m_i, l_i, acc, 0.0, 1.0, False)
    rows = (base + tok).to(tl.int64) * (tl.num_programs(1) * HEAD_DIM) + head * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(o_ptr + rows[:, None] + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=(tok < seq_len)[:, None])


def run_ws(q, k, v, batch, seq_len, causal, block_m, block_n, warp_specialize, num_warps, num_stages):
    tokens, hq, d = q.shape
    hk = k.shape[1]
    q_desc = TensorDescriptor(q.view(tokens, hq * d), [tokens, hq * d], [hq * d, 1], [block_m, d])
    k_desc = TensorDescriptor(k.view(tokens, hk * d), [tokens, hk * d], [hk * d, 1], [block_n, d])
    v_desc = TensorDescriptor(v.view(tokens, hk * d), [tokens, hk * d], [hk * d, 1], [block_n, d])
    o = torch.empty_like(q)
    grid = (batch * triton.cdiv(seq_len, block_m), hq)
    ragged_prefill_ws_kernel[grid](
        q_desc, k_desc, v_desc, o, seq_len, d ** -0.5 * LOG2E.value,
        GROUP=hq // hk, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal,
        WARP_SPECIALIZE=warp_specialize, num_warps=num_warps, num_stages=num_stages,
    )
    return o


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    ap.add_argument("--configs", default="128-64-ws-4-3,128-128-ws-4-2,128-64-nows-8-3,128-128-nows-8-3",
                    help="BLOCK_M-BLOCK_N-ws|nows-WARPS-STAGES, comma-separated (BLOCK_M: query tokens)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    shapes = [(2, 40, 4, 2, 16)] if args.smoke else [(16, 1024, 32, 8, 128), (4, 4096, 32, 8, 128),
                                                     (1, 16384, 32, 8, 128)]
    configs = ["16-16-ws-1-1"] if args.smoke else args.configs.split(",")
    ws_buf = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    print("| shape | causal | kernel | µs | TFLOP/s | rel err vs tritoninfer |")
    print("|---|---|---|---|---|---|")
    for batch, n, hq, hk, d in shapes:
        g = torch.Generator().manual_seed(0)
        q, k, v = (testing.randn((batch * n, h, d), torch.bfloat16, device, generator=g) for h in (hq, hk, hk))
        indptr = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=device)
        for causal in (False, True):
            flops = testing.prefill_flops([n] * batch, [n] * batch, hq, d, d, causal)
            w = tritoninfer.BatchPrefillWithRaggedKVCacheWrapper(ws_buf)
            w.plan(indptr, indptr, hq, hk, d, causal=causal, q_data_type=torch.bfloat16)
            ref = w.run(q, k, v)
            rows = [("tritoninfer", lambda: w.run(q, k, v), ref)]
            for c in configs:
                tt, bn, ws, warps, stages = c.split("-")
                # the interpreter's bf16 tl.dot is wrong: it gets the same values in fp32
                qkv = (q, k, v) if not args.smoke else (q.float(), k.float(), v.float())
                fn = (lambda tt=int(tt), bn=int(bn), ws=ws == "ws", warps=int(warps), stages=int(stages), qkv=qkv:
                      run_ws(*qkv, batch, n, causal, tt, bn, ws, warps, stages))
                try:
                    rows.append((c, fn, fn()))
                except Exception as e:  # noqa: BLE001 (a config that does not compile is reported)
                    print(f"| {batch}x{n} | {causal} | {c} | failed: {type(e).__name__}: {str(e)[:120]} | | |")
            for name, fn, out in rows:
                err = testing.rel_error(out.float(), ref.float())
                if args.smoke:
                    us = float("nan")
                else:
                    us = eager_time(fn, reps=10)
                print(f"| {batch}x{n} | {causal} | {name} | {us:.0f} | {flops / us / 1e6:.0f} | {err:.2e} |", flush=True)
                if err > 2e-2:
                    print(f"MISMATCH: {name} differs from tritoninfer by {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
