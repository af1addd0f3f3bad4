"""``tritoninfer demo --hf CONFIG_OR_PATH``: a Hugging Face transformers model served by
``generate_batch`` (transformers' continuous batching over its paged cache) with
``attn_implementation="tritoninfer"`` (``tritoninfer/integrations/transformers.py``).

CONFIG_OR_PATH is one of the architectures of :func:`model_configs` (random weights: Llama 3, Qwen 3,
Mistral, Gemma 2, Gemma 3, gpt-oss; tiny on the CPU, realistic attention shapes with two layers on a
GPU) or a local checkpoint folder (``config.json`` + weights, loaded with ``from_pretrained``; nothing
is downloaded). ``--check`` runs transformers' own attention ("sdpa", or "eager" where its SDPA path
lacks the feature: soft cap, sinks) on the same weights: teacher-forced logits within the dtype's
tolerance, and each request's greedy tokens equal to the reference's ``generate()`` until the
reference's top-2 margin falls within that tolerance (then either token is right).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Dict, List, Tuple

import torch

from ..testing import rel_error, tolerance

# float32 models run attention on float16 copies (the kernels take fp16/bf16 queries), bf16 models
# in bf16; logits pass through every layer and the head: twice the table's attention tolerance
LOGIT_TOL = {torch.float32: 2 * tolerance(torch.float16), torch.bfloat16: 2 * tolerance(torch.bfloat16)}


def model_configs(big: bool = False) -> Dict[str, tuple]:
    """name -> (config, model class, reference attention implementation): tiny shapes (2 layers,
    hidden 64) for the interpreter, or Llama-3-8B-like attention shapes (32/8 heads, head_dim 128;
    Gemma 2/3 head_dim 256) with 2 layers."""
    import transformers as t

    if big:
        common = dict(vocab_size=32000, hidden_size=4096, intermediate_size=8192, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
        window = 256
    else:
        common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
        window = 4
    # larger weights than the default init make attention sharp, so masks and windows matter
    common["initializer_range"] = 0.02 if big else 0.1
    alternating = ["sliding_attention", "full_attention"]
    llama3_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64 if not big else 8192}
    gemma2 = dict(common, head_dim=256, num_attention_heads=4 if not big else 16, num_key_value_heads=2 if not big else 8)
    return {
        "llama3": (t.LlamaConfig(**common, rope_parameters=llama3_rope), t.LlamaForCausalLM, "sdpa"),
        "qwen3": (t.Qwen3Config(**common), t.Qwen3ForCausalLM, "sdpa"),
        "mistral": (t.MistralConfig(**common, sliding_window=window), t.MistralForCausalLM, "sdpa"),
        "gemma2": (t.Gemma2Config(**gemma2, query_pre_attn_scalar=64, attn_logit_softcapping=2.0 if not big else 50.0,
                                  final_logit_softcapping=30.0, sliding_window=window, layer_types=alternating),
                   t.Gemma2ForCausalLM, "eager"),
        "gemma3": (t.Gemma3TextConfig(**dict(common, head_dim=32 if not big else 256), query_pre_attn_scalar=32,
                                      sliding_window=window, layer_types=alternating),
                   t.Gemma3ForCausalLM, "sdpa"),
        # every token routed to all 4 experts: top-k routing flips on rounding noise (a comparison of
        # two correct attentions would measure the flips), a softmax over all experts is smooth
        "gpt_oss": (t.GptOssConfig(**dict(common, max_position_embeddings=131072), num_local_experts=4,
                                   num_experts_per_tok=4, sliding_window=window, layer_types=alternating),
                    t.GptOssForCausalLM, "eager"),
    }


def model_pair(source: str, dtype: torch.dtype, device: torch.device, big: bool) -> Tuple[object, object, str]:
    """(tritoninfer model, reference model with the same weights, a description): ``source`` a name
    of :func:`model_configs` or a local checkpoint folder. ``ValueError`` for anything else."""
    import transformers

    from ..integrations import transformers as integration

    if os.path.isdir(source):
        ref = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="sdpa", dtype=dtype)
        what = f"{type(ref).__name__} checkpoint {source}"
        cfg, cls = ref.config, type(ref)
    else:
        configs = model_configs(big)
        if source not in configs:
            raise ValueError(f"--hf {source}: not a folder and not one of {', '.join(configs)}")
        cfg, cls, impl = configs[source]
        torch.manual_seed(0)
        ref = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl)
        if source == "gpt_oss":  # its sinks start as torch.empty: give them values that matter
            with torch.no_grad():
                for layer in ref.model.layers:
                    layer.self_attn.sinks.normal_(0.0, 1.0)
        what = f"{cls.__name__}, random weights ({source} config, {'realistic' if big else 'tiny'} shape)"
    ref = ref.to(device=device, dtype=dtype).eval()
    ours = cls._from_config(copy.deepcopy(ref.config), attn_implementation=integration.ATTN_IMPLEMENTATION)
    ours = ours.to(device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return ours.eval(), ref, what


def left_pad(prompts: List[List[int]], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of left-padded prompts (pad id 0)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def check_logits(ours, ref, prompts: List[List[int]], tol: float) -> float:
    """The relative error of ``ours``' teacher-forced logits against ``ref``'s (left-padded prompts,
    padded positions left out)."""
    ids, mask = left_pad(prompts, next(ours.parameters()).device)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    return rel_error(a[keep], b[keep])


def greedy_mismatch(ref, prompt: List[int], tokens: List[int], tol: float):
    """None when ``tokens`` are ``ref``'s greedy continuation of ``prompt`` up to the first step
    where its top-2 logit margin is within ``4 * tol`` (relative to the largest logit); else the
    first step that differs with a clear margin, and that margin."""
    ids = torch.tensor([prompt], device=next(ref.parameters()).device)
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=len(tokens), do_sample=False, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
    for step, token in enumerate(tokens):
        if token == int(want.sequences[0, len(prompt) + step]):
            continue
        logits = want.logits[step][0].float()
        top2 = logits.topk(2).values
        margin = float(top2[0] - top2[1]) / float(logits.abs().max())
        return None if margin <= 4 * tol else (step, margin)
    return None


def run(args, prompts: List[List[int]], gen_lens: List[int]) -> Tuple[List[str], int]:
    """Serves ``prompts`` with ``generate_batch`` (greedy, ``gen_lens`` new tokens each, the longest
    for all: transformers' generation config is per batch) and, with ``args.check``, checks them.
    Returns (summary lines, exit status)."""
    from transformers import GenerationConfig

    device = torch.device("cpu" if args.interpreter else "cuda")
    dtype = torch.float32 if args.interpreter else torch.bfloat16
    ours, ref, what = model_pair(args.hf, dtype, device, big=not args.interpreter)
    new_tokens = max(gen_lens)
    vocab = ours.config.vocab_size
    prompts = [[1 + t % (vocab - 1) for t in p] for p in prompts]  # ids in this model's vocabulary
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    lines = [f"model: {what}; attention: tritoninfer (transformers {_version()}), {str(dtype)[6:]}",
             f"workload: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
             f"tokens, {new_tokens} new tokens each, generate_batch (continuous batching, paged cache)"]
    with torch.no_grad():
        ours.generate_batch(prompts[:1], generation_config=GenerationConfig(
            max_new_tokens=1, do_sample=False, eos_token_id=-1, pad_token_id=0), progress_bar=False)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = ours.generate_batch(prompts, generation_config=gen, progress_bar=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    results = list(out.values())
    failed = [r for r in results if r.error is not None]
    status = 0
    if failed:
        lines.append(f"FAILED: {len(failed)} requests ended with an error: {failed[0].error}")
        return lines, 1
    produced = sum(len(r.generated_tokens) for r in results)
    lines.append(f"generated {produced} tokens in {seconds:.2f} s: {produced / seconds:.1f} tok/s "
                 f"(prompt tokens {sum(map(len, prompts))}; wall clock, the model's own host work included)")
    if ours.config._attn_implementation != "tritoninfer":
        lines.append("FAILED: generate_batch switched the model away from tritoninfer's attention")
        return lines, 1
    if args.check:
        tol = args.tolerance or LOGIT_TOL[dtype]
        err = check_logits(ours, ref, prompts[:4], tol)
        ok = err <= tol
        lines.append(f"check: teacher-forced logits against transformers' {ref.config._attn_implementation} "
                     f"attention, relative error {err:.3g} (tolerance {tol:.3g}): {'ok' if ok else 'FAILED'}")
        status |= not ok
        by_prompt = {tuple(r.prompt_ids): list(r.generated_tokens) for r in results}
        bad = []
        for p in prompts:
            miss = greedy_mismatch(ref, p, by_prompt[tuple(p)], tol)
            if miss is not None:
                bad.append((p, miss))
        verdict = "ok" if not bad else (f"FAILED ({len(bad)} differ; first at step {bad[0][1][0]} with a top-2 "
                                         f"margin of {bad[0][1][1]:.3g})")
        lines.append(f"check: greedy tokens of {len(prompts)} requests against the reference's generate(): {verdict}")
        status |= bool(bad)
    return lines, int(status)


def _version() -> str:
    import transformers

    return transformers.__version__
