"""Compile the attention kernel for sm_90 without a GPU and report what the GPU would run:
registers, spills, shared memory, cp.async use and the instruction mix (Triton ships ptxas,
cuobjdump and nvdisasm). Costs no device time; see benchmarks/NOTES.md (v3) for what it found.

    python benchmarks/sass_report.py --kv-dtype fp8e4nv --block-n 128 --warps 4 --stages 3 --prefetch

The integer arguments that the real launch specialises as divisible by 16 (pointers, strides) are
marked so here too; without that Triton emits scalar loads and the report would mislead.
"""

import argparse
import collections
import hashlib
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tritoninfer.kernels.attention import attention_fwd_kernel

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
POINTERS = {"q_ptr": "*bf16", "o_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "alibi_ptr": "*fp32", "sinks_ptr": "*fp32", "scale_q_ptr": "*fp32", "scale_k_ptr": "*fp32",
            "scale_v_ptr": "*fp32", "mask_ptr": "*u8", "err_ptr": "*i64"}
FLOATS = {"sm_scale_log2", "soft_cap", "v_scale", "rope_rcp_scale", "rope_log2_theta"}
DIV16 = {"stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_lse_tok", "stride_k_page",
         "stride_k_slot", "stride_k_head", "stride_v_page", "stride_v_slot", "stride_v_head", "num_qo_heads"}


def merge_constants(args) -> dict:
    """The fused split merge's constexprs, as ``_attention.AttentionVariant.kwargs`` derives them."""
    merge_m = min(args.block_m, 1 << max(0, (args.tile_tokens * args.group - 1).bit_length()))
    merge_dv = args.head_dim if merge_m * args.head_dim <= 4096 else max(16, 4096 // merge_m)
    split = 1 << max(0, min(5, (8192 // (merge_m * merge_dv)).bit_length() - 1))
    return dict(MERGE_M=merge_m, MERGE_DV_CHUNK=merge_dv, MERGE_SPLIT_BLOCK=split)


def compile_kernel(args):
    fn = attention_fwd_kernel
    names = [p.name for p in fn.params]
    const = dict(GROUP=args.group, HEAD_DIM_QK=args.head_dim, HEAD_DIM_VO=args.head_dim, BLOCK_M=args.block_m,
                 BLOCK_N=args.block_n, BLOCK_DQK=args.head_dim, BLOCK_DV=args.head_dim, IS_PAGED=not args.ragged,
                 PAGE_SIZE=args.page_size, HAS_WINDOW=False, HAS_SOFT_CAP=False, HAS_ALIBI=False,
                 HAS_ROPE=False, HAS_CUSTOM_MASK=False, HAS_SINKS=False, HAS_HEAD_SCALES=False, WRITE_LSE=False,
                 DOT_DTYPE=tl.float16 if args.kv_dtype.startswith("fp8") else tl.bfloat16,
                 PREFETCH_PAGES=args.prefetch, KV_AS_M=args.kv_as_m,
                 MASK_FREE_TILES=args.mask_free, IS_CAUSAL=args.causal or args.multi_item, FOLD_SCALE=args.fold,
                 MULTI_ITEM=args.multi_item,
                 LANES=args.lanes, LANE_TOKENS=args.block_n // max(args.lanes, 1), NUM_STAGES=args.stages,
                 **merge_constants(args))
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            sig[name] = "constexpr"
            continue
        if name in ("k_ptr", "v_ptr"):
            sig[name] = "*" + args.kv_dtype
        elif name == "mask_ptr" and args.multi_item:
            sig[name] = "*i32"  # multi-item scoring's token positions within items
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
        if name.endswith("_ptr") or name in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=args.warps, num_stages=args.stages))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp8e4nv", "fp8e5"])
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--tile-tokens", type=int, default=1, help="query tokens per work item (prefill: block-m / group)")
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--prefetch", action="store_true")
    ap.add_argument("--mask-free", action="store_true", help="separate loop without score masks")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--multi-item", action="store_true", help="multi-item scoring (implies --causal)")
    ap.add_argument("--ragged", action="store_true", help="contiguous (ragged) K/V instead of pages")
    ap.add_argument("--fold", action="store_true", help="softmax scale folded into exp2's argument (prefill tiles)")
    ap.add_argument("--kv-as-m", action="store_true", help="KV positions as the M dimension of the dots (wgmma)")
    ap.add_argument("--lanes", type=int, default=0, help="the dot-free single-row path with this many lanes "
                    "(block-m 1, group 1)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--sha", action="store_true", help="print only a SHA-256 of the SASS (compare two checkouts)")
    args = ap.parse_args(argv)
    kernel = compile_kernel(args)
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
    if args.sha:
        print(hashlib.sha256(sass.encode()).hexdigest()[:16], len(sass.splitlines()), "lines of SASS")
        return
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z0-9_.]+)", sass, re.M))
    print(f"shared memory (Triton metadata): {kernel.metadata.shared} bytes")
    print(next((line.strip() for line in usage.splitlines() if "REG:" in line), usage.strip()))
    print(f"cp.async in PTX: {ptx.count('cp.async')}; vector global loads: {ptx.count('ld.global.v4')}; "
          f"scalar 8/16-bit global loads: {len(re.findall(r'ld.global.b(8|16)', ptx))}")
    print(f"SASS instructions: {sum(ops.values())}")
    for op, n in ops.most_common(args.top):
        print(f"  {n:6d} {op}")
    body = main_loop(sass)
    print(f"main loop (largest backward branch): {sum(body.values())} instructions")
    for op, n in body.most_common(args.top):
        print(f"  {n:6d} {op}")


def main_loop(sass: str) -> collections.Counter:
    """Instruction mix between the largest loop's label and its backward branch."""
    labels, ops, best = {}, [], (0, 0)
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z0-9_.]+)(.*)", line)
        if not m:
            continue
        ops.append(m.group(1).split(".")[0])
        target = re.search(r"`\((\.L_x_\d+)\)", m.group(2))
        if m.group(1).startswith("BRA") and target and target.group(1) in labels:
            start = labels[target.group(1)]
            if len(ops) - start > best[1] - best[0]:
                best = (start, len(ops))
    return collections.Counter(ops[best[0]:best[1]])


if __name__ == "__main__":
    main()
