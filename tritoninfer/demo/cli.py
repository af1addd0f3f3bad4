"""``tritoninfer demo``: options, the run, the progress line and the summary."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import List, Optional, Tuple

import numpy as np
import torch

__all__ = ["build_parser", "parse_args", "run", "PRESETS", "DEEPSEEK_PRESETS", "default_tolerance"]

# Model shape and workload of each preset; explicit options override them.
_REALISTIC = dict(layers=8, hidden=4096, intermediate=14336, heads="32/8", head_dim=128, vocab=32000)
PRESETS = {
    # the CPU default: every kernel runs through the Triton interpreter
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads="4/2", head_dim=16, vocab=128, num_requests=4,
                 prompt_len="5-12", gen_len="4", max_batch=3, page_size=4, kv_dtype="bf16",
                 max_prefill_tokens=4096),
    # the GPU default: a realistic layer shape, a short run
    "gpu": dict(**_REALISTIC, num_requests=32, prompt_len="256-2048", gen_len="64", max_batch=16, page_size=16,
                kv_dtype="bf16", max_prefill_tokens=16384),
    # the H200 measurement: 64 concurrent requests, prompts 512-4096, bf16 and fp8 KV
    "h200": dict(**_REALISTIC, num_requests=128, prompt_len="512-4096", gen_len="128", max_batch=64,
                 page_size=16, kv_dtype="bf16,fp8", max_prefill_tokens=32768),
}
# --arch deepseek: the same workloads with an MLA model (DeepSeek-V3's attention: 512/64 latent,
# q_lora 1536; dense SwiGLU MLP, plain RoPE); the tiny one has small latent dims for the interpreter
_MLA_REALISTIC = dict(kv_lora_rank=512, rope_dim=64, q_lora_rank=1536, head_dim=128, vocab=32000)
_WORKLOAD_KEYS = ("num_requests", "prompt_len", "gen_len", "max_batch", "page_size", "max_prefill_tokens")
DEEPSEEK_PRESETS = {
    "tiny": dict(layers=2, hidden=64, intermediate=128, heads="4", head_dim=16, rope_dim=16, kv_lora_rank=32,
                 q_lora_rank=32, vocab=128, kv_dtype="bf16", **{k: PRESETS["tiny"][k] for k in _WORKLOAD_KEYS}),
    # 16 heads: DeepSeek-V3's attention sharded over 8 GPUs (tensor parallel), hidden 2048
    "gpu": dict(layers=4, hidden=2048, intermediate=5632, heads="16", **_MLA_REALISTIC, kv_dtype="bf16",
                **{k: PRESETS["gpu"][k] for k in _WORKLOAD_KEYS}),
    # 128 heads: DeepSeek-V3's attention layer on one GPU (hidden 7168), 4 layers with dense MLPs
    "h200": dict(layers=4, hidden=7168, intermediate=18432, heads="128", **_MLA_REALISTIC, kv_dtype="bf16",
                 **{k: PRESETS["h200"][k] for k in _WORKLOAD_KEYS}),
}
_MLA_ONLY = ("kv_lora_rank", "rope_dim", "q_lora_rank")
_KV_CHOICES = ("bf16", "fp16", "fp8")


def default_tolerance(dtype: str, kv_dtype: str) -> float:
    """Largest allowed ``max |logit - reference| / max |reference logit|`` (per row) for ``--check``.

    The reference is float32; the serving path rounds activations to ``dtype`` (bf16 keeps 8
    significant bits, fp16 11) and runs attention on fp16/bf16 queries. A wrong page, position or
    mask moves logits by O(1) of their range, far above these."""
    base = {"fp32": 0.01, "fp16": 0.02, "bf16": 0.08}[dtype]
    return base + (0.04 if kv_dtype == "fp8" else 0.0)


# ---------------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------------


def _range(text: str) -> Tuple[int, int]:
    try:
        parts = [int(p) for p in text.split("-")] if "-" in text.strip("-") else [int(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI (positive ints), got {text!r}") from None
    lo, hi = parts[0], parts[-1]
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _heads(text: str) -> Tuple[int, int]:
    try:
        parts = [int(p) for p in text.split("/")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Q/KV (e.g. 32/8), got {text!r}") from None
    if len(parts) == 1:
        parts = parts * 2
    q, kv = parts
    if len(parts) != 2 or q < 1 or kv < 1 or q % kv:
        raise argparse.ArgumentTypeError(f"expected Q/KV with Q a multiple of KV, got {text!r}")
    return q, kv


def _kv_dtypes(text: str) -> List[str]:
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in _KV_CHOICES]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(_KV_CHOICES)} (comma separated), got {text!r}")
    return out


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative int, got {text!r}")
    return v


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tritoninfer demo",
        description="Generation (greedy, or sampled with --sampling) with continuous batching over a paged KV "
                    "cache: a Llama-architecture decoder on tritoninfer's kernels (random weights by default, or "
                    "--model). Without a GPU it runs a tiny model through the Triton interpreter.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="model shape and workload: 'tiny' (the default without a GPU), 'gpu' (the default with "
                        "one), 'h200' (8 layers of a 32/8-head, hidden-4096 model, 128 requests, 64 at a time, "
                        "prompts 512-4096, bf16 and fp8 KV); options below override it")
    p.add_argument("--arch", choices=("llama", "deepseek"), default="llama",
                   help="the random model: 'llama' (GQA, the default) or 'deepseek' (multi-head latent attention "
                        "served by BatchMLAPagedAttentionWrapper; per preset tiny: small latent dims, gpu: 16 heads, "
                        "h200: 128 heads, both with DeepSeek's 512/64 latent and q_lora 1536)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=_positive, metavar="N", help="requests to serve")
    g.add_argument("--prompt-len", type=_range, metavar="N|LO-HI", help="prompt length in tokens: N or LO-HI (uniform, seeded)")
    g.add_argument("--gen-len", type=_range, metavar="N|LO-HI", help="tokens to generate per request: N or LO-HI")
    g.add_argument("--max-batch", type=_positive, metavar="N", help="most requests running at once")
    g.add_argument("--max-prefill-tokens", type=_positive, metavar="N", help="prompt tokens admitted per prefill step")
    g.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the weights and the prompts (default 0)")
    g = p.add_argument_group("KV cache and kernels")
    g.add_argument("--page-size", type=_positive, metavar="N", help="tokens per KV page")
    g.add_argument("--num-pages", type=_positive, metavar="N", help="KV pages (default: enough for max-batch of the longest requests)")
    g.add_argument("--kv-dtype", type=_kv_dtypes, metavar="{bf16,fp16,fp8}[,...]",
                   help="KV cache dtype: bf16, fp16 or fp8 (e4m3 with per-layer K/V scales passed as k_scale/"
                        "v_scale); a comma list runs each in turn (e.g. bf16,fp8)")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="weights and activations (default bf16); with fp32, attention takes fp16 queries")
    g.add_argument("--use-tensor-cores", action="store_true", help="decode wrapper's use_tensor_cores=True")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="decode with a plain wrapper, eagerly (default: per-bucket CUDA graphs on a GPU; padded fixed "
                        "buffers, the graph path run eagerly, on the CPU)")
    g.add_argument("--no-overlap", action="store_true",
                   help="read each decode step's tokens before scheduling the next (default: the next step is "
                        "scheduled, planned and launched while the device runs the current one, and tokens are "
                        "read one step late; --check always reads them at once)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up (kernel compilation and graph capture then count in the timings)")
    g = p.add_argument_group("random model (the shape options are an error with --model)")
    g.add_argument("--layers", type=_positive, metavar="N", help="decoder layers")
    g.add_argument("--hidden", type=_positive, metavar="N", help="hidden size")
    g.add_argument("--intermediate", type=_positive, metavar="N", help="MLP size (default: the preset's, or 3.5 x hidden)")
    g.add_argument("--heads", type=_heads, metavar="Q/KV", help="query/KV heads, e.g. 32/8 (GQA); deepseek: Q")
    g.add_argument("--head-dim", type=_positive, metavar="N",
                   help="a multiple of 8 up to 256; deepseek: qk_nope_head_dim and v_head_dim")
    g.add_argument("--kv-lora-rank", type=_positive, metavar="N", help="deepseek: latent width (head_dim_ckv)")
    g.add_argument("--rope-dim", type=_positive, metavar="N", help="deepseek: qk_rope_head_dim (head_dim_kpe), even")
    g.add_argument("--q-lora-rank", type=_non_negative, metavar="N", help="deepseek: query LoRA rank (0: none)")
    g.add_argument("--vocab", type=_positive, metavar="N", help="vocabulary size")
    g.add_argument("--model", metavar="PATH",
                   help="a local Hugging Face Llama/Qwen2/Mistral checkpoint folder (config.json + *.safetensors); "
                        "prompts are random token ids")
    g.add_argument("--hf", metavar="CONFIG_OR_PATH",
                   help="serve a Hugging Face transformers model with attn_implementation='tritoninfer' through its "
                        "generate_batch (continuous batching): llama3, qwen3, mistral, gemma2, gemma3 or gpt_oss "
                        "(random weights; tiny without a GPU, 32/8-head 2-layer shapes with one) or a local "
                        "checkpoint folder; --check compares with transformers' own attention on the same weights "
                        "(needs pip install 'tritoninfer[transformers]')")
    g = p.add_argument_group("sampling (default: greedy argmax; any option below turns --sampling on)")
    g.add_argument("--sampling", action="store_true",
                   help="sample each token with tritoninfer's sampling kernels (softmax with temperature, then "
                        "joint top-k/top-p sampling, or top-k/top-p renorm and min-p sampling with --min-p), inside "
                        "the decode step's CUDA graph; without other options: temperature 1, no filter")
    g.add_argument("--temperature", type=float, metavar="T", help="softmax temperature (default 1; 0: greedy)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (default 0: off)")
    g.add_argument("--top-p", type=float, metavar="P", help="keep the smallest set of most likely tokens whose "
                   "probability reaches P, in (0, 1] (default 1: off)")
    g.add_argument("--min-p", type=float, metavar="M", help="keep tokens of probability >= M x the largest, "
                   "M between 0 and 1 (default 0: off)")
    g.add_argument("--sampling-seed", type=int, metavar="N",
                   help="seed of the sampling generator (a torch.Generator on the device; default: --seed)")
    g = p.add_argument_group("checking and output")
    g.add_argument("--check", action="store_true",
                   help="compare every step's logits with a dense float32 reference forward pass (plain torch); "
                        "exit 1 if the largest difference exceeds the tolerance (with --sampling, also if a "
                        "sampled token lies outside the reference's allowed set)")
    g.add_argument("--tolerance", type=float, metavar="X",
                   help="--check: allowed max |logit - ref| / max |ref logit| per row (default by dtype)")
    g.add_argument("--out", metavar="FILE", help="also write the summary as markdown to FILE")
    g.add_argument("--quiet", action="store_true", help="no progress line")
    return p


def parse_args(argv: List[str], on_gpu: Optional[bool] = None) -> argparse.Namespace:
    """Parse and resolve the options against the preset (``on_gpu`` picks the default preset)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if on_gpu is None:
        on_gpu = _on_gpu()
    args.interpreter = not on_gpu
    if args.preset is None:
        args.preset = "gpu" if on_gpu else "tiny"
    deepseek = args.arch == "deepseek"
    preset = (DEEPSEEK_PRESETS if deepseek else PRESETS)[args.preset]
    shape_opts = ("layers", "hidden", "intermediate", "heads", "head_dim", "vocab") + _MLA_ONLY
    if not deepseek:
        given = [o for o in _MLA_ONLY if getattr(args, o) is not None]
        if given:
            parser.error(f"--{given[0].replace('_', '-')}: an MLA option; add --arch deepseek")
    else:
        if args.model is not None:
            parser.error("--model: only Llama/Qwen2/Mistral checkpoints are loaded; --arch deepseek is a random model")
        if args.heads is not None and args.heads[0] != args.heads[1]:
            parser.error("--heads: MLA has no KV heads (one latent row per token serves every head); give Q alone")
        if args.kv_dtype is not None and "fp8" in args.kv_dtype:
            parser.error("--kv-dtype fp8: the MLA latent cache is bf16 or fp16 (BatchMLAPagedAttentionWrapper, as "
                         "FlashInfer 0.5.3)")
        if args.use_tensor_cores:
            parser.error("--use-tensor-cores: a decode-wrapper option; --arch deepseek uses the MLA wrapper")
    if args.hf is not None:
        given = [o for o in shape_opts + ("model", "sampling_seed", "temperature", "top_k", "top_p", "min_p")
                 if getattr(args, o) is not None] + (["arch"] if deepseek else []) + (["sampling"] if args.sampling else [])
        if given:
            parser.error(f"--hf: the model and its greedy generation come from transformers; drop "
                         f"--{given[0].replace('_', '-')}")
    if args.model is not None:
        given = [o for o in shape_opts if getattr(args, o) is not None]
        if given:
            parser.error(f"--model takes the shape from config.json; drop --{given[0].replace('_', '-')}")
        if not os.path.isdir(args.model):
            parser.error(f"--model {args.model}: not a folder")
    derive_intermediate = args.intermediate is None and args.hidden is not None and args.hidden != preset["hidden"]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            conv = {"prompt_len": _range, "gen_len": _range, "heads": _heads, "kv_dtype": _kv_dtypes}.get(key)
            setattr(args, key, conv(value) if conv else value)
    if derive_intermediate:
        args.intermediate = max(8, int(3.5 * args.hidden) // 8 * 8)
    args.argv = list(argv)
    if args.tolerance is not None and not args.tolerance > 0:
        parser.error("--tolerance: expected a positive number")
    if not deepseek and (args.head_dim % 8 or args.head_dim > 256):
        parser.error(f"--head-dim: expected a multiple of 8 up to 256, got {args.head_dim}")
    if deepseek and args.rope_dim % 2:
        parser.error(f"--rope-dim: expected an even number (rotary pairs), got {args.rope_dim}")
    args.sampling_config = _sampling_config(parser, args)
    return args


def _sampling_config(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The engine's SamplingConfig, or None (greedy) when no sampling option was given."""
    from .sampler import SamplingConfig, SamplingParams  # no kernel module

    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p", "sampling_seed")}
    if not args.sampling and all(v is None for v in given.values()):
        return None
    values = {k: v for k, v in given.items() if v is not None and k != "sampling_seed"}
    try:
        params = SamplingParams(**values)
    except ValueError as exc:
        name, _, rest = str(exc).partition(": ")
        parser.error(f"--{name.replace('_', '-')}: {rest}")
    seed = args.sampling_seed if args.sampling_seed is not None else args.seed
    return SamplingConfig(params, seed)


def _on_gpu() -> bool:
    from tritoninfer import _device

    return _device.has_gpu()


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


class Progress:
    """A carriage-return status line on stderr (only when it is a terminal)."""

    def __init__(self, total_tokens: int, label: str, enabled: bool) -> None:
        self.total, self.label = total_tokens, label
        self.enabled = enabled and sys.stderr.isatty()
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, engine, info) -> None:
        self.done += info.batch
        now = time.perf_counter()
        if not self.enabled or (now - self._last < 0.1 and self.done < self.total):
            return
        self._last = now
        s = engine.scheduler
        alloc = engine.cache.allocator
        frac = self.done / max(1, self.total)
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        line = (f"\r{self.label} [{bar}] {self.done}/{self.total} tokens | {info.kind:<7} batch {info.batch:>3} | "
                f"running {len(s.running):>3} waiting {len(s.waiting):>3} done {len(s.finished):>3} | "
                f"pages {alloc.num_used}/{alloc.num_pages} | {now - self.t0:6.1f} s")
        sys.stderr.write(line)
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def make_workload(args, vocab: int) -> List[Tuple[List[int], int]]:
    """(prompt token ids, tokens to generate) per request; seeded."""
    rng = np.random.default_rng(args.seed + 1)
    lo, hi = args.prompt_len
    glo, ghi = args.gen_len
    lens = rng.integers(lo, hi + 1, size=args.num_requests)
    gens = rng.integers(glo, ghi + 1, size=args.num_requests)
    return [(rng.integers(0, vocab, size=int(n)).tolist(), int(g)) for n, g in zip(lens, gens)]


def run_hf(args) -> int:
    """``--hf``: a transformers model on tritoninfer's attention (``hf_transformers.py``)."""
    from . import hf_transformers

    workload = make_workload(args, vocab=1 << 30)
    try:
        lines, status = hf_transformers.run(args, [p for p, _ in workload], [g for _, g in workload])
    except ImportError as exc:
        print(f"tritoninfer demo --hf: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"tritoninfer demo: {exc}", file=sys.stderr)
        return 2
    print("tritoninfer demo: a Hugging Face transformers model on tritoninfer's attention")
    if args.interpreter:
        print("  NOTE: no CUDA GPU: a tiny model through the Triton interpreter (throughput means nothing here).")
    for line in lines:
        print("  " + line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# tritoninfer demo --hf\n\n" + "".join(f"- {line}\n" for line in lines))
        print(f"summary written to {args.out}")
    return status


def run(args) -> int:
    if args.hf is not None:
        return run_hf(args)
    from .hf import load_checkpoint
    from .model import DTYPES, LlamaModel, ModelConfig, random_weights
    from .reference import DenseReference, MLADenseReference
    from .scheduler import pages_for
    from .variants import KernelVariants

    device = torch.device("cpu" if args.interpreter else "cuda")
    dtype = DTYPES[args.dtype]
    out = []  # lines of the header
    if args.interpreter:
        out.append("NOTE: no CUDA GPU: this is the Triton-interpreter configuration (every kernel interpreted on "
                   "the CPU, a tiny model; throughput numbers mean nothing here).")
        if args.preset != "tiny" or args.hidden * args.layers > 4096:
            out.append("NOTE: a large shape under the interpreter runs for a very long time; the tiny preset takes "
                       "seconds.")
    t0 = time.perf_counter()
    if args.arch == "deepseek":
        from .deepseek import DeepseekModel, MLAConfig, random_mla_weights

        try:
            mcfg = MLAConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                             num_layers=args.layers, num_heads=args.heads[0], q_lora_rank=args.q_lora_rank or None,
                             kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.head_dim,
                             qk_rope_head_dim=args.rope_dim, v_head_dim=args.head_dim)
        except ValueError as exc:
            print(f"tritoninfer demo: error: {exc}", file=sys.stderr)
            return 2
        weights = random_mla_weights(mcfg, args.seed, dtype, device)
        source = f"random DeepSeek-style MLA weights (seed {args.seed})"
    elif args.model:
        try:
            mcfg, weights = load_checkpoint(args.model, dtype, device)
        except (OSError, ValueError, KeyError, NotImplementedError) as exc:
            print(f"tritoninfer demo: error: {exc}", file=sys.stderr)
            return 2
        source = f"{mcfg.name} checkpoint {args.model}"
    else:
        q, kv = args.heads
        try:
            mcfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                               num_layers=args.layers, num_heads=q, num_kv_heads=kv, head_dim=args.head_dim)
        except ValueError as exc:
            print(f"tritoninfer demo: error: {exc}", file=sys.stderr)
            return 2
        weights = random_weights(mcfg, args.seed, dtype, device)
        source = f"random Llama-architecture weights (seed {args.seed})"
    model = DeepseekModel(mcfg, weights, dtype) if args.arch == "deepseek" else LlamaModel(mcfg, weights, dtype)
    load_time = time.perf_counter() - t0
    workload = make_workload(args, mcfg.vocab_size)
    max_kv = max(len(p) + g - 1 for p, g in workload)
    num_pages = args.num_pages or args.max_batch * pages_for(max_kv, args.page_size)
    if num_pages < pages_for(max_kv, args.page_size):
        print(f"tritoninfer demo: error: --num-pages {num_pages} cannot hold the longest request "
              f"({max_kv} tokens = {pages_for(max_kv, args.page_size)} pages)", file=sys.stderr)
        return 2
    reference = None
    if args.check:
        torch.set_float32_matmul_precision("highest")  # a float32 reference: no TF32 on the GPU
        if args.arch == "deepseek":
            reference = MLADenseReference(mcfg, weights, device)
        else:
            reference = DenseReference(mcfg, weights, device)
    from tritoninfer import _device

    out.append(f"device    : {_device.device_name()} | torch {torch.__version__} | triton {_triton_version()}")
    out.append(f"model     : {source}: {mcfg.describe()}; {mcfg.num_parameters() / 1e6:.1f} M parameters, "
               f"{args.dtype} ({load_time:.1f} s to build)")
    plo, phi = args.prompt_len
    glo, ghi = args.gen_len
    sampling = args.sampling_config
    out.append(f"workload  : {args.num_requests} requests, prompts {_span(plo, phi)} tokens, {_span(glo, ghi)} "
               f"generated each ({'sampled' if sampling else 'greedy'}), at most {args.max_batch} running, "
               f"{args.max_prefill_tokens} prefill tokens per step")
    if sampling:
        where = "eagerly" if args.no_cuda_graph or args.interpreter else "in the decode step's CUDA graph"
        out.append(f"sampling  : {sampling.describe()}; decode steps sample {where}")
    if args.no_cuda_graph:
        graph = "eager"
    else:
        if args.interpreter:
            graph = "fixed padded buffers per batch bucket (the CUDA-graph path, run eagerly)"
        else:
            graph = "one CUDA graph per batch bucket, re-planned every step"
        if args.no_overlap or args.check:
            why = "--no-overlap" if args.no_overlap else "--check"
            graph += f", tokens read after each step ({why})"
        else:
            graph += ", the next step prepared while the device runs one (tokens read one step late)"
    if args.arch == "deepseek":
        out.append(f"KV cache  : {num_pages} pages x {args.page_size} tokens, latent [layers, pages, page, "
                   f"{mcfg.kv_lora_rank} + {mcfg.qk_rope_head_dim}] (ckv and kpe slices, one row per token for "
                   f"all heads); BatchMLAPagedAttentionWrapper: prefill causal, decode: {graph}")
    else:
        out.append(f"KV cache  : {num_pages} pages x {args.page_size} tokens, [layers, pages, 2, page, H_kv, D]; "
                   f"decode: {graph}, use_tensor_cores={args.use_tensor_cores}")
    print("tritoninfer demo: continuous batching over a paged KV cache")
    for line in out:
        print("  " + line)
    sys.stdout.flush()

    results, samples = [], []
    with KernelVariants() as variants:  # counts what each warm-up and each timed run launch first
        for kv_name in args.kv_dtype:
            results.append(_serve(args, model, kv_name, workload, num_pages, reference, variants, samples))
    rows = summary_rows(results, args)
    print()
    print(format_text(rows))
    print()
    for line in samples:
        print(f"  {line}")
    status = 0
    verdicts = []
    if args.check:
        for kv_name, st, tol in results:
            ok = st.max_rel_diff <= tol and st.sampled_outside == 0
            sampled = (f"; sampled tokens outside the allowed set: {st.sampled_outside}"
                       if args.sampling_config else "")
            verdicts.append(f"check ({kv_name} KV): largest |logit - reference| = {st.max_abs_diff:.4g} "
                            f"({100 * st.max_rel_diff:.2f} % of the row's largest |logit|) over {st.checked_rows} "
                            f"rows; tolerance {100 * tol:.1f} %{sampled}: {'OK' if ok else 'FAILED'}")
            if not ok:
                status = 1
    for line in verdicts:
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(format_markdown(rows, out, args, samples + verdicts))
        print(f"summary written to {args.out}")
    return status


def _serve(args, model, kv_name: str, workload, num_pages: int, reference, variants, samples: List[str]):
    """One KV dtype's run: warm-up (not timed), then the timed run. Returns ``(kv_name, stats, tol)``
    and appends request 0's tokens to ``samples``."""
    from .engine import Engine, EngineConfig
    from .kv_cache import KV_DTYPES
    from .scheduler import Request

    ecfg = EngineConfig(page_size=args.page_size, max_batch=args.max_batch,
                        max_prefill_tokens=args.max_prefill_tokens, num_pages=num_pages,
                        use_tensor_cores=args.use_tensor_cores, cuda_graph=not args.no_cuda_graph,
                        overlap=not args.no_overlap,
                        sampling=args.sampling_config,
                        workspace_bytes=(32 if args.interpreter else 512) * 1024 * 1024)
    if reference is not None:
        reference.reset()
    engine = Engine(model, KV_DTYPES[kv_name], ecfg, reference)
    before_warmup = len(variants)
    if not args.no_warmup:
        engine.warmup(workload)
    before_run = len(variants)
    reqs = [Request(i, list(p), g) for i, (p, g) in enumerate(workload)]
    total = sum(g for _, g in workload)
    progress = Progress(total, f"kv {kv_name}", enabled=not args.quiet)
    try:
        stats = engine.run(reqs, on_step=progress.update)
    finally:
        progress.close()
    stats.warmup_variants = before_run - before_warmup
    stats.timed_variants = len(variants) - before_run
    tol = args.tolerance if args.tolerance is not None else default_tolerance(args.dtype, kv_name)
    first = min(reqs, key=lambda r: r.rid)
    samples.append(f"{kv_name} KV: request 0 ({len(first.prompt)}-token prompt) generated "
                   f"{' '.join(map(str, first.output[:16]))}{' ...' if len(first.output) > 16 else ''}")
    del engine
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return kv_name, stats, tol


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _triton_version() -> str:
    import triton

    return getattr(triton, "__version__", "?")


def _rate(tokens: int, seconds: float) -> str:
    if not seconds:
        return "-"
    r = tokens / seconds
    return f"{r:,.0f} tok/s" if r >= 100 else f"{r:.2f} tok/s"


def summary_rows(results, args) -> List[Tuple[str, List[str]]]:
    """(label, one value per KV dtype) rows of the summary."""
    rows: List[Tuple[str, List[str]]] = []

    def add(label, fn):
        rows.append((label, [fn(st, tol) for _, st, tol in results]))

    add("requests", lambda s, t: f"{s.requests}")
    add("prompt tokens (prefilled)", lambda s, t: f"{s.prompt_tokens:,}")
    add("generated tokens", lambda s, t: f"{s.generated_tokens:,}")
    add("warm-up (compiles kernels, not timed)", lambda s, t: _warmup_text(s, args))
    add("prefill", lambda s, t: f"{_rate(s.prompt_tokens, s.prefill_time)} ({s.prefill_steps} steps, {s.prefill_time:.2f} s)")
    add("decode", lambda s, t: f"{_rate(s.decode_tokens, s.decode_time)} ({s.decode_steps} steps, {s.decode_time:.2f} s)")
    if not args.no_cuda_graph:
        device = "forward" if args.interpreter else "graph replays"
        add(f"decode, device time only ({device})", lambda s, t: _rate(s.decode_tokens, s.decode_device_time))
        add("decode: host share (device idle)", lambda s, t: f"{100 * s.decode_host_share:.1f} %")
    add("decode batch (mean / max)", lambda s, t: (
        f"{np.mean(s.decode_batch_sizes):.1f} / {max(s.decode_batch_sizes)}" if s.decode_batch_sizes else "-"))
    add("decode step (mean)", lambda s, t: f"{1e3 * s.decode_time / s.decode_steps:.2f} ms" if s.decode_steps else "-")
    add("attention share: prefill / decode / all",
        lambda s, t: f"{100 * s.prefill_attn_share:.0f} % / {100 * s.decode_attn_share:.0f} % / {100 * s.attn_share:.0f} %")
    add("KV pages used (peak)", lambda s, t: f"{s.peak_pages} of {s.num_pages} ({100 * s.peak_pages / s.num_pages:.0f} %)")
    add("new kernel variants while timed", lambda s, t: f"{s.timed_variants}")
    add("total time (timed run)", lambda s, t: f"{s.wall_time:.2f} s")
    if args.check:
        add("check: largest logit difference", lambda s, t: f"{s.max_abs_diff:.3g} ({100 * s.max_rel_diff:.2f} %, tol {100 * t:.1f} %)")
        add("check: argmax differs", lambda s, t: f"{s.argmax_mismatches} of {s.checked_rows} steps")
        if args.sampling_config:
            add("check: sampled tokens in the allowed set", lambda s, t: (
                f"{s.checked_rows - s.sampled_outside} of {s.checked_rows} ({s.sampled_exact} in the reference's "
                f"exact set, {s.sampled_not_argmax} not its argmax)"))
    return [("KV cache dtype", [kv for kv, *_ in results])] + rows


def _warmup_text(s, args) -> str:
    if args.no_warmup:
        return "skipped (--no-warmup)"
    graphs = f", {s.graphs_captured} graphs" if s.graphs_captured else ""
    return f"{s.warmup_time:.1f} s, {s.warmup_variants} kernel variants{graphs}"


def format_text(rows) -> str:
    w0 = max(len(r[0]) for r in rows)
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(rows[0][1]))]
    lines = []
    for i, (label, values) in enumerate(rows):
        lines.append(f"  {label:<{w0}}   " + "   ".join(f"{v:<{w}}" for v, w in zip(values, widths)).rstrip())
        if i == 0:
            lines.append("  " + "-" * (w0 + 3 + sum(widths) + 3 * (len(widths) - 1)))
    return "\n".join(lines)


def format_markdown(rows, header_lines, args, footer_lines) -> str:
    from .._version import __version__

    cols = len(rows[0][1])
    md = ["# tritoninfer demo", ""]
    md += [f"- {' '.join(line.split())}" for line in header_lines]
    md += [f"- command: `tritoninfer demo {' '.join(getattr(args, 'argv', []))}`",
           f"- tritoninfer {__version__}, python {platform.python_version()}, host "
           f"{platform.node() or '?'}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", ""]
    md.append("| " + " | ".join([rows[0][0]] + rows[0][1]) + " |")
    md.append("|" + "---|" * (cols + 1))
    for label, values in rows[1:]:
        md.append("| " + " | ".join([label] + values) + " |")
    md.append("")
    md += [f"- {line}" for line in footer_lines]
    md.append("")
    return "\n".join(md)
