"""The attention kernel compiled for sm_90 on the CPU (Triton ships ptxas): the interpreter runs the
kernels' semantics but not the compiler's type rules (loop-carried types, branch types), so a kernel
that passes every CPU test could still fail to compile on the GPU. The variants are the GPU tile
choices of ``_plan.decode_tiles`` / ``prefill_tiles``, with the constexprs from
``_attention.attention_variant`` (the only source of kernel arguments)."""

import dataclasses
import os
import subprocess
import sys

import triton
import triton.language as tl

from tritoninfer import _plan
from tritoninfer._attention import attention_variant, score_params
from tritoninfer.kernels.attention import attention_fwd_kernel

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

FLOAT_ARGS = {"sm_scale_log2", "soft_cap", "v_scale", "rope_rcp_scale", "rope_log2_theta"}
FP32_POINTERS = {"lse_ptr", "part_o_ptr", "part_lse_ptr", "alibi_ptr", "sinks_ptr", "scale_q_ptr", "scale_k_ptr",
                 "scale_v_ptr"}


def _signature(kv_dtype: str, constexprs: dict, q_dtype: str = "bf16", o_dtype: str = "bf16", mask_dtype: str = "u8"):
    """Argument types as a real launch specialises them (16-byte aligned pointers, strides divisible by 16)."""
    sig, attrs = {}, {}
    for i, p in enumerate(attention_fwd_kernel.params):
        name = p.name
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ("q_ptr", "o_ptr"):
            sig[name] = "*" + (q_dtype if name == "q_ptr" else o_dtype)
        elif name in ("k_ptr", "v_ptr"):
            sig[name] = "*" + kv_dtype
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name == "mask_ptr":
            sig[name] = "*" + mask_dtype
        elif name == "err_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
        if name.endswith("_ptr") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


CASES = {
    # bf16 decode, GQA 4 (KV as the dots' M); with 4 query tokens per request (speculative decoding)
    "decode-bf16": (lambda: _plan.decode_tiles(4, 1, 128, 2), "bf16", 4, False, {}),
    "decode-bf16-q4": (lambda: _plan.decode_tiles(4, 4, 128, 2), "bf16", 4, True, {}),
    # head_dim 64 and 256 (their own one-token tiles)
    "decode-bf16-d64": (lambda: _plan.decode_tiles(4, 1, 64, 2), "bf16", 4, False, dict(head_dim=64)),
    "decode-bf16-d256": (lambda: _plan.decode_tiles(8, 1, 256, 2), "bf16", 8, False, dict(head_dim=256)),
    # fp8 decode (query rows as M), with sinks, soft cap and the LSE written
    "decode-fp8": (lambda: _plan.decode_tiles(4, 1, 128, 1), "fp8e4nv", 4, False,
                   dict(has_sinks=True, write_lse=True, soft_cap=30.0)),
    # a GQA group of one over fp8: the dot-free single-row path
    "decode-lanes": (lambda: _plan.decode_tiles(1, 1, 128, 1, lanes_ok=True), "fp8e4nv", 1, False, {}),
    # prefill tiles, causal, with a custom mask and RoPE
    "prefill": (lambda: _plan.prefill_tiles(4, 128), "bf16", 4, True, dict(rope=True, has_mask=True)),
    # fp8 queries over fp8 K/V with per-head scales and an fp16 output (single_prefill's and the
    # block-sparse wrapper's fp8 path), with a custom mask (block-internal masks)
    "prefill-fp8q": (lambda: _plan.prefill_tiles(4, 128, None, 1), "fp8e4nv", 4, False,
                     dict(q_dtype="fp8e4nv", o_dtype="fp16", head_scales=True, has_mask=True)),
    # the same with e5m2 and 16 query rows per request (block-sparse R=16: decode-sized tiles), fp32 out
    "prefill-fp8q-rows16": (lambda: _plan.prefill_tiles(1, 128, 16, 1), "fp8e5", 1, True,
                            dict(q_dtype="fp8e5", o_dtype="fp32", head_scales=True)),
    # multi-item scoring (its int32 token positions through the mask pointer), with RoPE and a soft cap
    "prefill-multi-item": (lambda: _plan.prefill_tiles(4, 128), "bf16", 4, True,
                           dict(multi_item=True, rope=True, soft_cap=30.0)),
}


def compile_case(name: str):
    """Compiles one case for sm_90; runs without ``TRITON_INTERPRET`` (``@triton.jit`` then gives the
    compiler's function, and the tile choices are the GPU's)."""
    make_tiles, kv_dtype, group, causal, extra = CASES[name]
    tiles = make_tiles()
    head_dim = extra.get("head_dim", 128)
    params = score_params("ROPE_LLAMA" if extra.get("rope") else "NONE", -1, extra.get("soft_cap"), None, None,
                          None, head_dim, causal=causal)
    if extra.get("multi_item"):
        params = dataclasses.replace(params, multi_item=True)
    dot = tl.float16 if kv_dtype.startswith("fp8") else tl.bfloat16
    variant = attention_variant(params, tiles, group=group, head_dim_qk=head_dim, head_dim_vo=head_dim, page_size=16,
                                has_custom_mask=extra.get("has_mask", False), has_sinks=extra.get("has_sinks", False),
                                has_head_scales=extra.get("head_scales", False),
                                write_lse=extra.get("write_lse", False), dot=dot)
    kwargs = variant.kwargs()
    options = dict(num_warps=kwargs.pop("num_warps"), num_stages=kwargs.pop("num_stages"))
    sig, attrs = _signature(kv_dtype, kwargs, extra.get("q_dtype", "bf16"), extra.get("o_dtype", "bf16"),
                            "i32" if extra.get("multi_item") else "u8")
    compiled = triton.compile(ASTSource(attention_fwd_kernel, sig, kwargs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return tiles, compiled


def compile_pair():
    """POD's pair kernel (``attention_pair_kernel``): a causal prefill half (prefill tiles) and a bf16
    decode half (decode tiles, KV as M, paged), compiled for sm_90."""
    from tritoninfer.kernels.attention import attention_pair_kernel

    halves = []
    for prefix, tiles, causal, page_size in (("p_", _plan.prefill_tiles(4, 128), True, 0),
                                             ("d_", _plan.prefill_tiles(4, 128, 4.0), False, 16)):
        params = score_params("NONE", -1, None, None, None, None, 128, causal=causal)
        variant = attention_variant(params, tiles, group=4, head_dim_qk=128, head_dim_vo=128, page_size=page_size,
                                    has_custom_mask=False, has_sinks=False, has_head_scales=False, write_lse=True,
                                    dot=tl.bfloat16)
        halves.append((prefix, variant.kwargs()))
    half_sig, half_attrs = _signature("bf16", halves[0][1])
    names = [p.name for p in attention_fwd_kernel.params]
    sig, attrs, constexprs = {}, {}, {}
    for i, p in enumerate(attention_pair_kernel.params):
        name = p.name
        if name == "num_items_p":
            sig[name] = "i32"
            continue
        prefix, base = name[:2], name[2:]
        kw = dict(halves)[prefix.lower()]
        if base in kw:
            sig[name] = "constexpr"
            constexprs[name] = kw[base]
            continue
        sig[name] = half_sig[base]
        if (names.index(base),) in half_attrs:
            attrs[(i,)] = half_attrs[(names.index(base),)]
    options = dict(num_warps=max(k["num_warps"] for _, k in halves), num_stages=max(k["num_stages"] for _, k in halves))
    return triton.compile(ASTSource(attention_pair_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _compile_in_subprocess(*mode: str) -> subprocess.CompletedProcess:
    """This file run as a script (``mode`` its argument) without the interpreter, from the repository
    root: the compiles happen in a process whose Triton was never switched to interpreting. Asserts it
    succeeded."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, __file__, *mode], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def _report(done: subprocess.CompletedProcess) -> dict:
    """The script's ``case-NAME facts`` lines, by ``case-NAME``."""
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith("case-"))


def _check_resources(report: dict, stack_allowed=lambda case: 0) -> None:
    """No case spills (no local-memory stack; ``stack_allowed(case)`` bytes where a case is known to) or
    needs more than an H200 SM's 227 KB of shared memory."""
    for case, line in report.items():
        facts = dict(f.split("=") for f in line.split() if "=" in f)
        assert int(facts["stack"]) <= stack_allowed(case), f"{case} spills: {line}"
        assert int(facts["shared"]) <= 227 * 1024, f"{case}: {line}"


def test_attention_kernel_compiles_for_sm90():
    """Every case compiles to a cubin (one subprocess without the interpreter, all cases), and the
    cases cover the GPU's tile families: KV as M, the dot-free lanes, 64+ row prefill tiles."""
    done = _compile_in_subprocess()
    report = _report(done)
    assert set(report) == {f"case-{n}" for n in CASES} | {"case-pod-pair"}, done.stdout
    assert "kv_as_m" in report["case-decode-bf16"] and "lanes" in report["case-decode-lanes"]
    assert "block_m=128" in report["case-prefill"] or "block_m=64" in report["case-prefill"]
    # the core's 128-row prefill tile with RoPE on the fly and a mask (or multi-item positions) and a soft
    # cap spills ~440 bytes (session 25: the registers are the 8 warps' 255); every decode tile fits
    _check_resources(report, lambda case: 512 if case in ("case-prefill", "case-prefill-multi-item") else 0)


# the MLA kernel (kernels/mla.py) at DeepSeek's dims: (heads, mean query tokens, causal, page size, lse
# [, cache dtype: bf16 unless given; an fp8 cache is converted to fp16 for the dots, q bf16 with it])
MLA_CASES = {
    "mla-128h-decode": (128, 1, False, 1, False),  # 64 rows, one masked loop
    "mla-128h-decode-p64-lse": (128, 1, False, 64, True),
    "mla-16h-decode": (16, 1, False, 64, True),  # 16 rows: KV as the dots' M
    "mla-32h-decode": (32, 1, False, 1, False),  # 32 rows
    "mla-32h-q2-causal": (32, 2, True, 64, False),  # 64 rows
    "mla-16h-q4-causal": (16, 4, True, 64, True),  # 64 rows
    "mla-128h-decode-e4m3": (128, 1, False, 64, True, "fp8e4nv"),  # 32 rows (fp8 blocks stop there)
    "mla-16h-decode-e4m3": (16, 1, False, 64, True, "fp8e4nv"),  # 16 rows
    "mla-32h-decode-e4m3": (32, 1, False, 1, False, "fp8e4nv"),  # 32 rows
    "mla-16h-q4-causal-e4m3": (16, 4, True, 64, True, "fp8e4nv"),  # 32 rows, causal
    "mla-16h-decode-e5m2": (16, 1, False, 1, False, "fp8e5"),
    # the split-KV merge: fused in the attention launch (0), and the merge pass (2) after a launch
    # that only writes the states (1, every case above)
    "mla-128h-decode-fused-merge": (128, 1, False, 1, False, "bf16", 0),
    "mla-128h-merge-pass": (128, 1, False, 64, True, "bf16", 2),
    "mla-16h-merge-pass": (16, 1, False, 64, True, "bf16", 2),
    "mla-128h-merge-pass-e4m3": (128, 1, False, 64, True, "fp8e4nv", 2),
}


def compile_mla_case(name: str):
    """Compiles one MLA case for sm_90 with the GPU tiles of ``mla.mla_tiles`` and the constexprs its
    launcher binds."""
    from tritoninfer.kernels.mla import mla_fwd_kernel
    from tritoninfer.mla import launch_constexprs, mla_tiles

    heads, q_len, causal, page_size, write_lse, *rest = MLA_CASES[name]
    kv = rest[0] if rest else "bf16"
    merge_mode = rest[1] if len(rest) > 1 else 1
    tiles = mla_tiles(heads, q_len, kv != "bf16")
    constexprs = launch_constexprs(heads, 512, 64, tiles, page_size, causal, write_lse,
                                   tl.bfloat16 if kv == "bf16" else tl.float16, True, kv != "bf16", merge_mode)
    del constexprs["num_warps"], constexprs["num_stages"]
    sig, attrs = {}, {}
    for i, p in enumerate(mla_fwd_kernel.params):
        n = p.name
        if n in constexprs:
            sig[n] = "constexpr"
            continue
        if n in ("q_nope_ptr", "q_pe_ptr", "o_ptr"):
            sig[n] = "*bf16"
        elif n in ("ckv_ptr", "kpe_ptr"):
            sig[n] = f"*{kv}"
        elif n in ("lse_ptr", "part_o_ptr", "part_lse_ptr"):
            sig[n] = "*fp32"
        elif n == "err_ptr":
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        else:
            sig[n] = "fp32" if n in ("sm_scale_log2", "lse_scale", "q_pe_scale", "v_scale") else "i32"
        if n.endswith("_ptr") or (n.startswith("stride_") and n != "stride_lse_head"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(mla_fwd_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    return tiles, compiled


def resource_usage(compiled) -> dict:
    """Registers and stack (spill) bytes of a cubin, from Triton's cuobjdump (``CompiledKernel.n_regs``
    and ``n_spills`` are only filled in by a driver)."""
    import re
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}


def shared_stores(compiled) -> int:
    """The shared-memory store instructions (``STS``) in a cubin's SASS, from Triton's nvdisasm."""
    import tempfile

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    return sum(1 for line in sass.splitlines() if "*/" in line and " STS" in line.split("*/", 1)[1])


def test_mla_kernel_compiles_for_sm90():
    """The MLA kernel's GPU variants compile to a cubin (one subprocess without the interpreter) without
    spills (no local-memory stack) and within an H200 SM's shared memory."""
    done = _compile_in_subprocess("mla")
    report = _report(done)
    assert set(report) == {f"case-{n}" for n in MLA_CASES}, done.stdout
    assert "kv_as_m" in report["case-mla-16h-decode"]
    _check_resources(report)
    for case in ("mla-128h-decode", "mla-32h-q2-causal", "mla-16h-q4-causal"):
        assert "block_m=64" in report[f"case-{case}"], report
    for case in ("mla-128h-decode-e4m3", "mla-16h-q4-causal-e4m3"):
        assert "block_m=32" in report[f"case-{case}"], report


# the Gluon prefill for Hopper (kernels/prefill_hopper.py) as _hopper.py launches it: (page size (0:
# contiguous K/V), causal, GQA group)
HOPPER_CASES = {"ragged-causal": (0, True, 4), "ragged": (0, False, 1), "paged16-causal": (16, True, 4),
                "paged64": (64, False, 8),
                # pages gathered by cp.async (_hopper.gather_pages: page 1, SGLang's; at head_dim 64, and 128-token
                # pages at head_dim 256, which its 64-position tiles cannot box)
                "paged1-gather-causal": (1, True, 4), "paged4-gather": (4, False, 8),
                "d64-paged1-gather-causal": (1, True, 4), "d256-paged128-gather-causal": (128, True, 2),
                # e4m3 K/V converted by the producer warpgroup (_hopper.fp8_config)
                "fp8-ragged-causal": (0, True, 4), "fp8-paged16-causal": (16, True, 4), "fp8-paged64": (64, False, 8),
                # DeepSeek's non-absorbed prefill: head_dim_qk 192 (three 64-column chunks) / head_dim_vo 128
                "ragged-192-128-causal": (0, True, 1), "ragged-192-128": (0, False, 1),
                # head_dim 64: three consumer warpgroups (_hopper.consumers)
                "d64-ragged-causal": (0, True, 4), "d64-paged16": (16, False, 4),
                # head_dim 256: 64-position K/V stages (_hopper.kv_tile)
                "d256-ragged-causal": (0, True, 2), "d256-paged16": (16, False, 8),
                # _hopper.IDLE_SKIP's other side (every consumer reads the item's tiles)
                "d64-ragged-causal-no-idle-skip": (0, True, 4), "ragged-causal-no-idle-skip": (0, True, 4),
                # work items in sections of a few heads (_hopper.HEAD_SECTIONS; on by default from head_dim 192)
                "d64-ragged-causal-head-sections": (0, True, 4), "paged16-causal-head-sections": (16, True, 4),
                "fp8-paged16-causal-head-sections": (16, True, 4)}


def compile_hopper_case(name: str):
    """One variant of the Gluon prefill kernel for sm_90: its TMA descriptors' types as
    ``_hopper.ragged_descriptors`` / ``paged_descriptors`` build them, bf16, head_dim 128 (192 / 128 for the
    ``192-128`` cases: Q and K boxes of ``_hopper.qk_chunk`` columns; 64 and 256 for the ``d64`` and ``d256`` ones)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from tritoninfer import _hopper
    from tritoninfer.kernels.prefill_hopper import prefill_hopper_kernel

    page, causal, group = HOPPER_CASES[name]
    fp8 = name.startswith("fp8")
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    d, d_vo = ((192, 128) if "192-128" in name else (64, 64) if name.startswith("d64") else
               (256, 256) if name.startswith("d256") else (128, 128))

    def desc(box_rows, dtype, width=d, box_cols=_hopper.qk_chunk(d)):
        rows = torch.empty(1024, 8 * width, dtype=dtype)
        return mangle_type(TensorDescriptor(rows, [1024, 8 * width], [8 * width, 1], [box_rows, box_cols],
                                            _hopper.smem_layout(box_rows, box_cols, dtype)))

    gather = _hopper.gather_pages(page, d)
    config = _hopper.kernel_config(fp8, d)
    constexprs = dict(GROUP=group, IS_CAUSAL=causal, PAGE_SIZE=page, GATHER=gather, num_warps=4,
                      **{k: v for k, v in config.items() if k != "maxnreg"})
    constexprs["IDLE_SKIP"] = _hopper.IDLE_SKIP and not name.endswith("no-idle-skip")
    constexprs["HEAD_SECTIONS"] = config["HEAD_SECTIONS"] or name.endswith("head-sections")
    sig = {}
    for p in prefill_hopper_kernel.params:
        n = p.name
        sig[n] = ("constexpr" if n in constexprs else desc(64, torch.bfloat16) if n == "q_desc" else
                  desc(_hopper.kv_tile(d) if gather or not page else page, kv_dtype) if n == "k_desc" else
                  desc(_hopper.kv_tile(d) if gather or not page else page, kv_dtype, d_vo, d_vo) if n == "v_desc" else
                  "*bf16" if n == "o_ptr" else "*fp8e4nv" if fp8 and n in ("k_ptr", "v_ptr") else
                  "*bf16" if n in ("k_ptr", "v_ptr") else
                  "*fp32" if n == "lse_ptr" else "*i32" if n.endswith("_ptr") else
                  "fp32" if n in ("sm_scale_log2", "k_mult", "v_mult") else "i32")
    # the caches and their row stride as a launch specialises them (16-byte aligned), for 16-byte copies
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(prefill_hopper_kernel.params)
             if p.name in ("k_ptr", "v_ptr", "stride_kv_row")}
    return triton.compile(GluonASTSource(prefill_hopper_kernel, sig, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=config["maxnreg"]))


def test_hopper_prefill_kernel_compiles_for_sm90():
    """The Gluon prefill kernel (which the interpreter cannot run) compiles for sm_90 on the CPU in
    each mode, without spills and within an H200 SM's 227 KB of shared memory."""
    done = _compile_in_subprocess("hopper")
    report = _report(done)
    assert set(report) == {f"case-{n}" for n in HOPPER_CASES}, done.stdout
    # the gathering producer warpgroup keeps the TMA warp's 24 registers a thread (the consumers need
    # the rest) and spills 32 bytes in it (sm_90 compile, session 18; 24 before the fp8 multipliers
    # joined the partitions' arguments); the fp8 mode's converting warpgroup (32 registers) spills 8; the
    # three consumers at head_dim 64 (160 registers a thread) spill up to 56 outside their KV loops: the first
    # tile's masked softmax, the epilogue's stores and the producer's per-item values (SASS, session 24); at
    # head_dim 256 (O takes 128 of the 240) 24 bytes of per-item values, reloaded once an item. Head sections
    # (their item arithmetic in the producers' 24 / 32 registers) add 8 and 16 bytes there (session 25); on by
    # default from head_dim 192, they add none to the d256 and 192 / 128 variants (session 26). The gather at
    # head_dim 256 spills its 32 on top of the 24, at 64 within the 56 (session 27)
    def allowed(case: str) -> int:
        gather = 32 if "gather" in case else 0
        if case.startswith("case-d64"):
            stack = 56
        elif case.startswith("case-d256"):
            stack = 24 + gather
        else:
            stack = gather or (8 if "fp8" in case else 0)
        if case.endswith("head-sections"):
            stack += 16 if "fp8" in case else 8
        return stack

    _check_resources(report, allowed)


# the Gluon fp8 decode (kernels/decode_hopper.py) as _hopper.decode_launch launches it: (page size, GQA group)
DECODE_HOPPER_CASES = {"p16-g4": (16, 4), "p64-g8": (64, 8), "p8-g16": (8, 16)}


def compile_decode_hopper_case(name: str):
    """One variant of the Gluon fp8 decode for sm_90: e4m3 pages as ``_hopper.paged_descriptors`` boxes
    them, bf16 queries, head_dim 128."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from tritoninfer import _hopper
    from tritoninfer.kernels.decode_hopper import decode_hopper_kernel

    page, group = DECODE_HOPPER_CASES[name]
    d = 128

    def desc(box_rows, dtype):
        rows = torch.empty(1024, 8 * d, dtype=dtype)
        return mangle_type(TensorDescriptor(rows, [1024, 8 * d], [8 * d, 1], [box_rows, d],
                                            _hopper.smem_layout(box_rows, d, dtype)))

    config = _hopper.decode_config()
    constexprs = dict(GROUP=group, num_warps=4, **{k: v for k, v in config.items() if k != "maxnreg"})
    sig = {}
    for p in decode_hopper_kernel.params:
        n = p.name
        sig[n] = ("constexpr" if n in constexprs else desc(_hopper.decode_q_rows(group), torch.bfloat16)
                  if n == "q_desc" else desc(page, torch.float8_e4m3fn) if n in ("k_desc", "v_desc") else
                  "*bf16" if n == "o_ptr" else "*fp32" if n in ("lse_ptr", "part_o_ptr", "part_lse_ptr") else
                  "*i32" if n.endswith("_ptr") else "fp32" if n in ("sm_scale_log2", "k_mult", "v_mult") else "i32")
    return triton.compile(GluonASTSource(decode_hopper_kernel, sig, constexprs, {}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=config["maxnreg"]))


def test_decode_hopper_kernel_compiles_for_sm90():
    """The Gluon fp8 decode (which the interpreter cannot run) compiles for sm_90 on the CPU, without spills
    and within an H200 SM's shared memory."""
    done = _compile_in_subprocess("decode-hopper")
    report = _report(done)
    assert set(report) == {f"case-{n}" for n in DECODE_HOPPER_CASES}, done.stdout
    _check_resources(report)


# the Gluon MLA kernel (kernels/mla_hopper.py) as mla.py launches it: (page size, causal, heads, how the
# consumers split a tile's work: mla._HOPPER_MODE)
MLA_HOPPER_CASES = {"p64-128h-both": (64, False, 128, "both"), "p64-128h-share-p": (64, False, 128, "share-p"),
                    "p16-16h-causal-both": (16, True, 16, "both"), "p8-64h-share-p-causal": (8, True, 64, "share-p"),
                    # pages gathered by cp.async (_hopper.mla_gather_pages)
                    "p1-128h-share-p": (1, False, 128, "share-p"), "p1-16h-causal-share-p": (1, True, 16, "share-p"),
                    "p4-64h-causal-share-p": (4, True, 64, "share-p")}


def compile_mla_hopper_case(name: str):
    """One variant of the Gluon MLA kernel for sm_90: bf16, DeepSeek's 512 / 64 latent, q and the cache
    as slices of 576-wide buffers (SGLang's form), its descriptors' types as ``MLALaunch`` builds them."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from tritoninfer import _hopper, mla
    from tritoninfer.kernels.mla_hopper import mla_hopper_kernel

    page, causal, heads, mode = MLA_HOPPER_CASES[name]
    buf = torch.empty(4096, 576, dtype=torch.bfloat16)
    gather = _hopper.mla_gather_pages(page)
    box = mla._HOPPER_BLOCK_N if gather else min(page, mla._HOPPER_BLOCK_N)
    regs = mla.hopper_regs(mla._HOPPER_MODES[mode], gather)

    def desc(rows, width):
        return mangle_type(TensorDescriptor(buf, [4096, width], [576, 1], [rows, 64],
                                            _hopper.smem_layout(rows, 64, torch.bfloat16)))

    constexprs = dict(NUM_HEADS=heads, HEAD_DIM_CKV=512, PAGE_SIZE=page, BLOCK_N=mla._HOPPER_BLOCK_N,
                      STAGES=mla._HOPPER_STAGES, IS_CAUSAL=causal, WRITE_LSE=True, MODE=mla._HOPPER_MODES[mode],
                      GATHER=gather, CONSUMER_REGS=regs["CONSUMER_REGS"], PRODUCER_REGS=regs["PRODUCER_REGS"],
                      num_warps=4)
    sig = {}
    for p in mla_hopper_kernel.params:
        n = p.name
        sig[n] = ("constexpr" if n in constexprs else desc(64, 512) if n == "q_desc" else
                  desc(64, 64) if n == "qpe_desc" else desc(box, 512) if n == "ckv_desc" else desc(box, 64) if n == "kpe_desc" else
                  "*bf16" if n in ("o_ptr", "ckv_ptr", "kpe_ptr") else
                  "*fp32" if n in ("lse_ptr", "part_o_ptr", "part_lse_ptr") else
                  "*i32" if n.endswith("_ptr") else "fp32" if n in ("sm_scale_log2", "lse_scale") else "i32")
    # the caches as a launch specialises them (16-byte aligned); their row strides not divisible by 16 (the
    # route takes rows 16 bytes apart, e.g. SGLang-style slices of a 584-wide buffer: Triton marks no
    # divisibility on 584, and without the kernel's own hint its 16-byte copies failed to compile on the H200)
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(mla_hopper_kernel.params)
             if p.name in ("ckv_ptr", "kpe_ptr")}
    return triton.compile(GluonASTSource(mla_hopper_kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=regs["maxnreg"]))


def test_mla_hopper_kernel_compiles_for_sm90():
    """The Gluon MLA kernel compiles for sm_90 on the CPU at pages of 8-64 positions, causal or not,
    without spills and within an H200 SM's 227 KB of shared memory."""
    done = _compile_in_subprocess("mla-hopper")
    report = _report(done)
    assert set(report) == {f"case-{n}" for n in MLA_HOPPER_CASES}, done.stdout
    _check_resources(report)


# the sampling kernels (kernels/sampling.py) with the GPU tiles of sampling._Split / _tiles
SAMPLING_FLOATS = {"x_ptr", "u_ptr", "p_ptr", "t_ptr", "draft_ptr", "target_ptr", "p_val", "t_val", "p_part",
                   "max_part", "z_part", "sum_part", "cval_ptr", "fin_inv_ptr", "seed_ptr", "rinv_ptr"}


def sampling_cases():
    """name -> (kernel, constexprs): every sampling kernel with its feature flags on and off, with the
    GPU tiles of ``sampling._Split`` (a row in 32 segments) and ``sampling._tiles``."""
    from tritoninfer.kernels import sampling as ks

    seg = dict(ROWS=1, SEGS_P2=32)
    stream, search = dict(seg, BLOCK=2048, NUM_TILES=2), dict(seg, BLOCK=512, NUM_TILES=8)
    row_stream = dict(ROWS=1, BLOCK=2048, NUM_TILES=64)
    plain = dict(HAS_INDICES=False, IS_LOGITS=False, USE_K=False, USE_P=False, USE_MIN_P=False, K_ARR=False,
                 P_ARR=False, PARAM_BY_SOURCE=False)
    joint = dict(HAS_INDICES=True, IS_LOGITS=True, USE_K=True, USE_P=True, USE_MIN_P=False, K_ARR=True,
                 P_ARR=True, PARAM_BY_SOURCE=True)
    minp = dict(plain, USE_MIN_P=True, P_ARR=True)
    cases = {}
    for name, flags in (("plain", plain), ("topk-topp", joint), ("minp", minp)):
        gate = dict(flags, GATE=name != "plain")
        cases[f"sample-mass-{name}"] = (ks.sample_mass_kernel, dict(gate, **stream))
        cases[f"sample-pick-{name}"] = (ks.sample_pick_kernel, dict(gate, PER_SOURCE=False, TILES_P2=8, **stream))
    # plain sampling's pick: a 4,096-entry segment in one tile (sampling._Split.pick); a long segment
    cases["sample-pick-plain-one-tile"] = (ks.sample_pick_kernel, dict(plain, GATE=False, PER_SOURCE=False, ROWS=1,
                                                                       SEGS_P2=64, BLOCK=4096, NUM_TILES=1,
                                                                       TILES_P2=8))
    cases["sample-pick-minp-13-tiles"] = (ks.sample_pick_kernel, dict(minp, GATE=True, PER_SOURCE=False, ROWS=1,
                                                                      SEGS_P2=8, BLOCK=2048, NUM_TILES=13,
                                                                      TILES_P2=16))
    cases["sample-pick-per-source"] = (ks.sample_pick_kernel, dict(joint, GATE=False, PER_SOURCE=True, TILES_P2=8,
                                                                   **stream))
    cases["max-pass"] = (ks.max_pass_kernel, dict(HAS_INDICES=True, ROWS=1, BLOCK=2048, NUM_TILES=2))
    radix = {k: joint[k] for k in ("HAS_INDICES", "USE_K", "USE_P", "K_ARR", "P_ARR", "PARAM_BY_SOURCE")}
    radix["GATE"] = True
    for d in (0, 1, 3, 4, 7):
        cases[f"radix-pass-joint-{d}"] = (ks.radix_pass_kernel, dict(radix, PASS=d, **search))
    cases["radix-pass-topk-2"] = (ks.radix_pass_kernel, dict(radix, USE_P=False, P_ARR=False, HAS_INDICES=False,
                                                            K_ARR=False, PASS=2, **stream))
    cases["radix-pass-topp-5"] = (ks.radix_pass_kernel, dict(radix, USE_K=False, K_ARR=False, PASS=5, **search))
    for name, use_k, mask in (("topk", True, True), ("topp", False, False), ("topk-probs", True, False)):
        flags = dict(USE_K=use_k, USE_P=not use_k, K_ARR=use_k, P_ARR=not use_k)
        if not mask:
            cases[f"renorm-mass-{name}"] = (ks.renorm_mass_kernel, dict(flags, GATE=True, **stream))
        cases[f"renorm-write-{name}"] = (ks.renorm_write_kernel, dict(flags, FIN=True, MASK_LOGITS=mask,
                                                                      PARAMS_ONLY=False, **stream))
    cases["renorm-write-all-rows"] = (ks.renorm_write_kernel, dict(USE_K=True, USE_P=False, K_ARR=True, P_ARR=False,
                                                                   FIN=False, MASK_LOGITS=False, PARAMS_ONLY=False,
                                                                   **stream))
    cases["renorm-params"] = (ks.renorm_write_kernel, dict(USE_K=True, USE_P=False, K_ARR=True, P_ARR=False, FIN=True,
                                                           MASK_LOGITS=False, PARAMS_ONLY=True, **stream))
    # the compaction: bound pass, copy, finish (sampling and renorm) for each bound rule
    for bins in (True, False):
        cases[f"bound-pass-{'probs' if bins else 'floats'}"] = (ks.bound_pass_kernel, dict(
            HAS_INDICES=True, NEED_SUM=True, PROB_BINS=bins, RENORMED=False, ROWS=1, BLOCK=2048, NUM_TILES=2))
    # the widest bound tile `bench --set sampling._GPU_BLOCK_BOUND=8192` would launch
    cases["bound-pass-probs-8192"] = (ks.bound_pass_kernel, dict(
        HAS_INDICES=False, NEED_SUM=True, PROB_BINS=True, RENORMED=False, ROWS=1, BLOCK=8192, NUM_TILES=4))
    cases["bound-pass-renormed"] = (ks.bound_pass_kernel, dict(HAS_INDICES=True, NEED_SUM=True, PROB_BINS=True,
                                                               RENORMED=True, ROWS=1, BLOCK=2048, NUM_TILES=2))
    rules = {"topk": dict(USE_K=True, USE_P=False, K_ARR=True, P_ARR=False),
             "topp": dict(USE_K=False, USE_P=True, K_ARR=False, P_ARR=True),
             "joint": dict(USE_K=True, USE_P=True, K_ARR=True, P_ARR=True)}
    for name, rule in rules.items():
        cases[f"compact-{name}"] = (ks.compact_kernel, dict(rule, HAS_INDICES=True, PARAM_BY_SOURCE=True,
                                                            PROB_BINS=True, RENORMED=False, OPAQUE=True, **stream))
        cases[f"compact-finish-{name}"] = (ks.compact_finish_kernel, dict(rule, HAS_INDICES=True, RENORM=False,
                                                                          PARAM_BY_SOURCE=True, ROWS=1, CBLOCK=512))
    cases["compact-topk-logits"] = (ks.compact_kernel, dict(rules["topk"], HAS_INDICES=False, PARAM_BY_SOURCE=True,
                                                           PROB_BINS=False, RENORMED=False, OPAQUE=True, **stream))
    cases["compact-topp-renormed"] = (ks.compact_kernel, dict(rules["topp"], HAS_INDICES=True, PARAM_BY_SOURCE=True,
                                                             PROB_BINS=True, RENORMED=True, OPAQUE=True, **stream))
    cases["compact-finish-renorm"] = (ks.compact_finish_kernel, dict(rules["joint"], HAS_INDICES=False, RENORM=True,
                                                                     PARAM_BY_SOURCE=True, ROWS=1, CBLOCK=512))
    # the rejection sampler with its GPU tile and warps (sampling._rejection_tiles at 128K)
    from tritoninfer import sampling as sm
    for name, use_k, use_p in (("topk", True, False), ("topp", False, True), ("joint", True, True)):
        rows, block, tiles, warps = sm._rejection_tiles(131072, 64, use_k)
        cases[f"rejection-{name}"] = (ks.rejection_sample_kernel, dict(
            HAS_INDICES=True, GATE=True, USE_K=use_k, USE_P=use_p, K_ARR=use_k, P_ARR=use_p, PARAM_BY_SOURCE=False,
            RENORMED=False, MAX_ROUNDS=64, TILES_P2=64, ROWS=rows, BLOCK=block, NUM_TILES=tiles, num_warps=warps))
    rows, block, tiles, warps = sm._rejection_tiles(131072, 64, False)
    cases["rejection-topp-renormed"] = (ks.rejection_sample_kernel, dict(
        HAS_INDICES=True, GATE=True, USE_K=False, USE_P=True, K_ARR=False, P_ARR=True, PARAM_BY_SOURCE=False,
        RENORMED=True, MAX_ROUNDS=64, TILES_P2=64, ROWS=rows, BLOCK=block, NUM_TILES=tiles, num_warps=warps))
    cases["softmax-partial"] = (ks.softmax_partial_kernel, dict(T_ARR=True, ROWS=1, BLOCK=2048, NUM_TILES=2))
    cases["softmax-write"] = (ks.softmax_write_kernel, dict(T_ARR=True, **stream))
    row = dict(BLOCK=int(sm._WHOLE_ROW_MAX_VOCAB), CHUNK=int(sm._SAMPLE_ROW_CHUNK),
               num_warps=int(sm._GPU_WHOLE_ROW_WARPS), PARAM_BY_SOURCE=True)
    for name, logits, minp in (("plain", False, False), ("logits", True, False), ("minp", False, True)):
        cases[f"sample-row-{name}"] = (ks.sample_row_kernel, dict(row, HAS_INDICES=True, IS_LOGITS=logits,
                                                                  USE_MIN_P=minp, P_ARR=minp))
    for name, mask, params, k_arr in (("renorm", False, False, True), ("mask", True, False, False),
                                      ("params", False, True, True)):
        cases[f"top-k-row-{name}"] = (ks.top_k_row_kernel, dict(
            K_ARR=k_arr, MASK_LOGITS=mask, PARAMS_ONLY=params, BLOCK=int(sm._WHOLE_ROW_MAX_VOCAB),
            CHUNK=int(sm._SAMPLE_ROW_CHUNK), num_warps=int(sm._GPU_WHOLE_ROW_WARPS)))
    cases["sample-row-minp-scalar"] = (ks.sample_row_kernel, dict(row, HAS_INDICES=False, IS_LOGITS=False,
                                                                  USE_MIN_P=True, P_ARR=False))
    cases["softmax-row"] = (ks.softmax_row_kernel, dict(T_ARR=True, BLOCK=int(sm._WHOLE_ROW_MAX_VOCAB),
                                                        num_warps=int(sm._GPU_WHOLE_ROW_WARPS)))
    cases["chain-speculative"] = (ks.chain_speculative_kernel, dict(N=4, **row_stream))
    return cases


def compile_sampling_cases():
    """Compiles each sampling kernel for sm_90 with its feature flags on and off; yields case names."""
    for name, (kernel, constexprs) in sampling_cases().items():
        constexprs = dict(constexprs)
        warps = constexprs.pop("num_warps", 8)
        floats = SAMPLING_FLOATS | ({"out_ptr"} if name.startswith("softmax") else set())
        sig, attrs = {}, {}
        for i, p in enumerate(kernel.params):
            n = p.name
            if n in constexprs:
                sig[n] = "constexpr"
                continue
            if n.endswith(("_ptr", "_part", "_state")):
                sig[n] = "*fp32" if n in floats else "*i32"
            else:
                sig[n] = "fp32" if n in floats else "i32"
            # what Triton specialises real launches on (16-byte aligned tensors, 128K-152K vocabularies
            # and row strides divisible by 16): 16-byte loads, whose layouts change the registers
            if n.endswith(("_ptr", "_part", "_state")) or n.startswith("stride") or n == "V":
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps))
        assert compiled.asm["cubin"], name
        yield name, dict(resource_usage(compiled), sts=shared_stores(compiled))


def test_sampling_kernels_compile_for_sm90():
    """The interpreter accepts what the GPU compiler refuses (a global read without ``tl.constexpr(...)``
    cost a GPU run): every sampling kernel variant compiles to a cubin in a subprocess."""
    done = _compile_in_subprocess("sampling")
    assert done.stdout.count("case-") == len(sampling_cases()), done.stdout
    # no spills beyond a word outside the loops: tl.cumsum(reverse=True) once put 2.3 KB a thread on
    # the compaction prologue's stack, which only these launch specialisations showed. And no tile
    # converted through shared memory: a per-row value compared across a [1, BLOCK] tile as a column
    # was broadcast in another layout and converted, 1,042 shared stores a thread in the one-row pick
    # (its 19.5 us on the H200) and 560 in the top-p compaction (kernels/sampling.py, _row_column)
    for line in done.stdout.splitlines():
        if line.startswith("case-"):
            facts = dict(f.split("=") for f in line.split()[1:] if "=" in f)
            assert int(facts["stack"]) <= 8, f"spills: {line}"
            assert int(facts["sts"]) <= 128, f"tile through shared memory: {line}"
            if line.startswith("case-compact-") and "finish" not in line:
                # the copy's scattered stores in the loads' layout (kernels/sampling.py, _scatter_tile):
                # 46-47 shared stores a thread when every store converted its tile, 16-32 without
                assert int(facts["sts"]) <= 32, f"the copy converts its tiles: {line}"


if __name__ == "__main__" and sys.argv[1:] == ["sampling"]:
    for case, usage in compile_sampling_cases():
        print(f"case-{case} regs={usage.get('reg')} stack={usage.get('stack')} sts={usage['sts']}", flush=True)
elif __name__ == "__main__" and sys.argv[1:] == ["mla-hopper"]:
    for case in MLA_HOPPER_CASES:
        kernel = compile_mla_hopper_case(case)
        use = resource_usage(kernel)
        print(f"case-{case} regs={use['reg']} stack={use['stack']} shared={kernel.metadata.shared}", flush=True)
elif __name__ == "__main__" and sys.argv[1:] == ["decode-hopper"]:
    for case in DECODE_HOPPER_CASES:
        kernel = compile_decode_hopper_case(case)
        use = resource_usage(kernel)
        print(f"case-{case} regs={use['reg']} stack={use['stack']} shared={kernel.metadata.shared}", flush=True)
elif __name__ == "__main__" and sys.argv[1:] == ["hopper"]:
    for case in HOPPER_CASES:
        kernel = compile_hopper_case(case)
        use = resource_usage(kernel)
        print(f"case-{case} regs={use['reg']} stack={use['stack']} shared={kernel.metadata.shared}", flush=True)
elif __name__ == "__main__" and sys.argv[1:] == ["mla"]:
    for case in MLA_CASES:
        tiles, kernel = compile_mla_case(case)
        assert kernel.asm["cubin"], case
        use = resource_usage(kernel)
        facts = [f"block_m={tiles.block_m}", f"block_n={tiles.block_n}", f"warps={tiles.num_warps}",
                 f"stages={tiles.num_stages}"] + ["kv_as_m"] * tiles.kv_as_m + ["mask_free"] * tiles.mask_free_tiles
        print(f"case-{case} {' '.join(facts)} regs={use['reg']} stack={use['stack']} shared={kernel.metadata.shared}",
              flush=True)
elif __name__ == "__main__":
    for case in CASES:
        tiles, kernel = compile_case(case)
        assert kernel.asm["cubin"], case
        facts = [f"block_m={tiles.block_m}"] + [k for k in ("kv_as_m", "lanes") if getattr(tiles, k)]
        use = resource_usage(kernel)
        print(f"case-{case} {' '.join(facts)} regs={use['reg']} stack={use['stack']} shared={kernel.metadata.shared}",
              flush=True)
    pair = compile_pair()
    assert pair.asm["cubin"]
    use = resource_usage(pair)
    print(f"case-pod-pair regs={use['reg']} stack={use['stack']} shared={pair.metadata.shared}", flush=True)
