"""The attention kernel compiled for sm_90 on the CPU (Triton ships ptxas): the interpreter runs the
kernels' semantics but not the compiler's type rules (loop-carried types, branch types), so a kernel
that passes every CPU test could still fail to compile on the GPU. The variants are the GPU tile
choices of ``_plan.decode_tiles`` / ``prefill_tiles``, with the constexprs from
``_attention.attention_variant`` (the only source of kernel arguments)."""

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


def _signature(kv_dtype: str, constexprs: dict):
    """Argument types as a real launch specialises them (16-byte aligned pointers, strides divisible by 16)."""
    sig, attrs = {}, {}
    for i, p in enumerate(attention_fwd_kernel.params):
        name = p.name
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in ("q_ptr", "o_ptr"):
            sig[name] = "*bf16"
        elif name in ("k_ptr", "v_ptr"):
            sig[name] = "*" + kv_dtype
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name == "mask_ptr":
            sig[name] = "*u8"
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
    # fp8 decode (query rows as M), with sinks, soft cap and the LSE written
    "decode-fp8": (lambda: _plan.decode_tiles(4, 1, 128, 1), "fp8e4nv", 4, False,
                   dict(has_sinks=True, write_lse=True, soft_cap=30.0)),
    # a GQA group of one over fp8: the dot-free single-row path
    "decode-lanes": (lambda: _plan.decode_tiles(1, 1, 128, 1, lanes_ok=True), "fp8e4nv", 1, False, {}),
    # prefill tiles, causal, with a custom mask and RoPE
    "prefill": (lambda: _plan.prefill_tiles(4, 128), "bf16", 4, True, dict(rope=True, has_mask=True)),
}


def compile_case(name: str):
    """Compiles one case for sm_90; runs without ``TRITON_INTERPRET`` (``@triton.jit`` then gives the
    compiler's function, and the tile choices are the GPU's)."""
    make_tiles, kv_dtype, group, causal, extra = CASES[name]
    tiles = make_tiles()
    params = score_params("ROPE_LLAMA" if extra.get("rope") else "NONE", -1, extra.get("soft_cap"), None, None,
                          None, 128, causal=causal)
    dot = tl.float16 if kv_dtype.startswith("fp8") else tl.bfloat16
    variant = attention_variant(params, tiles, group=group, head_dim_qk=128, head_dim_vo=128, page_size=16,
                                has_custom_mask=extra.get("has_mask", False), has_sinks=extra.get("has_sinks", False),
                                has_head_scales=False, write_lse=extra.get("write_lse", False), dot=dot)
    kwargs = variant.kwargs()
    options = dict(num_warps=kwargs.pop("num_warps"), num_stages=kwargs.pop("num_stages"))
    sig, attrs = _signature(kv_dtype, kwargs)
    compiled = triton.compile(ASTSource(attention_fwd_kernel, sig, kwargs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return tiles, compiled


def test_attention_kernel_compiles_for_sm90():
    """Every case compiles to a cubin (one subprocess without the interpreter, all cases), and the
    cases cover the GPU's tile families: KV as M, the dot-free lanes, 64+ row prefill tiles."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith("case-"))
    assert set(report) == {f"case-{n}" for n in CASES}, done.stdout
    assert "kv_as_m" in report["case-decode-bf16"] and "lanes" in report["case-decode-lanes"]
    assert "block_m=128" in report["case-prefill"] or "block_m=64" in report["case-prefill"]


if __name__ == "__main__":
    for case in CASES:
        tiles, kernel = compile_case(case)
        assert kernel.asm["cubin"], case
        facts = [f"block_m={tiles.block_m}"] + [k for k in ("kv_as_m", "lanes") if getattr(tiles, k)]
        print(f"case-{case} {' '.join(facts)} shared={kernel.metadata.shared}", flush=True)
