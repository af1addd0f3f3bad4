"""``attn_implementation="tritoninfer"`` in Hugging Face transformers
(``tritoninfer/integrations/transformers.py``).

Random-weight models built from the configs of Llama 3, Qwen 3, Mistral (sliding window), Gemma 2
(soft cap, alternating sliding layers, head_dim 256), Gemma 3 and gpt-oss (attention sinks),
checked against transformers' own attention on the same weights: "sdpa", or "eager" where
transformers' SDPA path lacks the feature (soft cap, sinks). Teacher-forced logits agree within the
attention dtype's tolerance (``tritoninfer.testing``); greedy ``generate()`` agrees wherever the
reference's top-2 margin is clear of that tolerance; ``generate_batch`` (continuous batching over
transformers' paged cache) gives the tokens ``generate()`` gives.

On the CPU the models are tiny (2 layers, hidden 64, sequences of ~10 tokens) so that the Triton
interpreter runs the file in well under a minute; ``gpu`` tests use realistic shapes in bf16.
"""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5.24.0",
    reason="the transformers integration needs Hugging Face transformers >= 5.24 (pip install 'tritoninfer[transformers]')")

import tritoninfer.integrations.transformers as ti  # noqa: E402
from tritoninfer.demo.hf_transformers import model_configs, model_pair  # noqa: E402
from tritoninfer.testing import rel_error, tolerance  # noqa: E402

# float32 models run attention on float16 copies (tritoninfer's kernels take fp16/bf16 queries),
# so their logits are held to float16's tolerance; bf16 models to bf16's. The logits pass through
# two attention layers and a final projection, a few more roundings than one attention output:
# twice the table's value.
LOGIT_TOL = {torch.float32: 2 * tolerance(torch.float16), torch.bfloat16: 2 * tolerance(torch.bfloat16)}

# Models whose bf16 reference is itself about a tolerance away from the exact result: gpt-oss's
# "eager" attention rounds the scores, the max-subtracted logits and the probabilities to bf16 (its
# logits are 0.038 from float32 at the GPU test's shapes with every expert routed; an exact
# float32-softmax bf16 attention is 0.027 from float32 and 0.031 from eager's bf16 run). Their bf16
# logits are compared with the reference run in float32 on the same weights; at the GPU test's
# shapes within the tolerance or the reference's own bf16 error, whichever is larger.
F32_REFERENCE = {"gpt_oss"}


def _configs(big: bool = False):
    """name -> (config, model class, reference attention implementation): the demo's models."""
    return model_configs(big)


MODELS = list(_configs())


def _pair(name, dtype=torch.float32, device="cpu", big=False):
    """(tritoninfer model, reference model) with the same random weights."""
    ours, ref, _ = model_pair(name, dtype, torch.device(device), big)
    assert ours.config._attn_implementation == "tritoninfer"
    assert ref.config._attn_implementation == _configs(big)[name][2]
    return ours, ref


def _batch(vocab, lengths, device, seed=1):
    """Left-padded prompts of the given lengths: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
        ids[i, : width - n] = 0
    return ids.to(device), mask.to(device)


def _check_logits(ours, ref, ids, mask, tol, f32_reference=False, or_reference_error=False):
    """Teacher-forced logits of ``ours`` against ``ref``'s, within ``tol``. With ``f32_reference``
    against ``ref`` converted to float32 (in place: the same weights, float32 arithmetic); with
    ``or_reference_error`` too, within ``tol`` or the error of ``ref``'s own low-precision run,
    whichever is larger."""
    keep = mask.bool()  # padded positions are garbage for every implementation
    note = ""
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
        if f32_reference and b.dtype != torch.float32:
            low = b
            b = ref.float()(ids, attention_mask=mask).logits
            low_err = rel_error(low[keep], b[keep])
            note = f" (float32 reference; the {low.dtype} reference is {low_err:.3g} from it)"
            if or_reference_error:
                tol = max(tol, low_err)
    err = rel_error(a[keep], b[keep])
    assert err <= tol, f"teacher-forced logits: relative error {err:.3g} > {tol:.3g}{note}"
    return err


def _check_greedy(ours, ref, ids, mask, new_tokens, tol):
    """Greedy tokens agree until the reference's top-2 logit margin at a step is within the
    tolerance (then either token is a correct answer and the sequences may part)."""
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(ids, **kw)[:, ids.shape[1]:]
        want = ref.generate(ids, output_logits=True, return_dict_in_generate=True, **kw)
    for row in range(ids.shape[0]):
        for step in range(new_tokens):
            if got[row, step] == want.sequences[row, ids.shape[1] + step]:
                continue
            logits = want.logits[step][row].float()
            top2 = logits.topk(2).values
            margin = float(top2[0] - top2[1]) / float(logits.abs().max())
            assert margin <= 4 * tol, f"row {row} step {step}: greedy token differs with a clear margin {margin:.3g}"
            break


# --------------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------------


def test_registered_and_lazy():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["tritoninfer"] is ti.attention_forward
    assert AttentionMaskInterface._global_mapping["tritoninfer"] is ti.attention_mask
    # other implementations are untouched
    assert AttentionInterface._global_mapping["sdpa"].__module__ == "transformers.integrations.sdpa_attention"
    # `import tritoninfer` does not import transformers
    code = "import sys, tritoninfer; tritoninfer.single_prefill_with_kv_cache; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_errors(monkeypatch):
    # transformers' lazy module replaces itself in sys.modules on first use of some names: patch the live one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.3.0")
    with pytest.raises(ImportError, match=r"transformers >= 5\.24\.0.*found 5\.3\.0"):
        ti._import_transformers()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs Hugging Face transformers"):
        ti._import_transformers()


def test_unregister_and_register_again():
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    ti.unregister()
    try:
        assert "tritoninfer" not in AttentionInterface._global_mapping
        assert not hasattr(ContinuousBatchingManager.switch_to_cb_friendly_attn, "_tritoninfer_original")
    finally:
        ti.register()
    assert AttentionInterface._global_mapping["tritoninfer"] is ti.attention_forward


# --------------------------------------------------------------------------------------------------
# the models, on the CPU (interpreter)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forced_logits(name, device):
    """Batch of two, the second left-padded: prefill of every position (paged prefill over a
    page-size-1 view of transformers' cache, padding as a key range)."""
    ours, ref = _pair(name, device=device)
    ids, mask = _batch(ours.config.vocab_size, [11, 8], device)
    _check_logits(ours, ref, ids, mask, LOGIT_TOL[torch.float32])


@pytest.mark.parametrize("name", ["llama3", "mistral", "gemma2", "gpt_oss"])
def test_greedy_generate(name, device):
    """Left-padded batch: prefill then decode steps (batch decode wrapper, sliding caches)."""
    ours, ref = _pair(name, device=device)
    ids, mask = _batch(ours.config.vocab_size, [7, 5], device, seed=2)
    _check_greedy(ours, ref, ids, mask, new_tokens=4, tol=LOGIT_TOL[torch.float32])


def test_generate_single_request(device):
    """Batch 1, no padding: the single-request kernels (single_prefill / single_decode)."""
    ours, ref = _pair("qwen3", device=device)
    ids, mask = _batch(ours.config.vocab_size, [9], device, seed=3)
    _check_greedy(ours, ref, ids, mask, new_tokens=4, tol=LOGIT_TOL[torch.float32])


def test_static_cache(device):
    """StaticCache: the keys after the current position are unwritten slots (a range mask)."""
    ours, ref = _pair("llama3", device=device)
    ids, mask = _batch(ours.config.vocab_size, [6, 4], device, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        got = ours.generate(ids, **kw)
        want = ref.generate(ids, **kw)
    assert torch.equal(got, want)


def test_bf16_logits(device):
    ours, ref = _pair("llama3", dtype=torch.bfloat16, device=device)
    ids, mask = _batch(ours.config.vocab_size, [10, 7], device, seed=5)
    _check_logits(ours, ref, ids, mask, LOGIT_TOL[torch.bfloat16])


def test_bf16_logits_gpt_oss(device):
    """bf16 gpt-oss (sinks, a sliding layer, left padding) against eager in float32. With top-2
    routing this batch has tokens whose experts differ between bf16 and float32 runs, and the
    logits were 0.2 from float32 for tritoninfer's bf16 run and eager's alike (0.09 between the
    two): see _configs."""
    ours, ref = _pair("gpt_oss", dtype=torch.bfloat16, device=device)
    ids, mask = _batch(ours.config.vocab_size, [11, 8], device, seed=1)
    _check_logits(ours, ref, ids, mask, LOGIT_TOL[torch.bfloat16], f32_reference=True)


def test_custom_4d_masks(device):
    """A user's 4-D mask (boolean, or additive 0/min) runs as a custom mask; a bias mask raises."""
    ours, ref = _pair("llama3", device=device)
    ids, _ = _batch(ours.config.vocab_size, [8, 8], device, seed=6)
    n = ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    keep = causal[None, None].repeat(2, 1, 1, 1)
    keep[1, 0, 4:, :3] = False  # row 1: the second half does not see the first three tokens
    with torch.no_grad():
        a = ours(ids, attention_mask=keep).logits
        b = ref(ids, attention_mask=keep).logits
    assert rel_error(a, b) <= LOGIT_TOL[torch.float32]
    additive = torch.zeros(keep.shape, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        c = ours(ids, attention_mask=additive).logits
    assert rel_error(c, b) <= LOGIT_TOL[torch.float32]
    with pytest.raises(ValueError, match="values other than 0"):
        with torch.no_grad():
            ours(ids, attention_mask=additive + 0.5 * keep)


def test_padding_with_holes(device):
    """A 2-D mask with a hole in the middle is not a key range: it runs as a custom mask."""
    ours, ref = _pair("mistral", device=device)
    ids, mask = _batch(ours.config.vocab_size, [10, 10], device, seed=7)
    mask[1, 3] = 0
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = ref(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert rel_error(a[keep], b[keep]) <= LOGIT_TOL[torch.float32]


def test_rejects_dropout():
    q = torch.zeros(1, 2, 3, 16)
    k = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="dropout"):
        ti.attention_forward(torch.nn.Module(), q, k, k, None, dropout=0.1)


@pytest.mark.parametrize("name", ["llama3", "gpt_oss"])
def test_generate_batch(name, device):
    """Continuous batching (generate_batch) keeps "tritoninfer" and gives generate()'s tokens:
    prefill through the ragged wrapper (the paged one with sinks), decode through the batch decode
    wrapper, over the K/V transformers gathers from its paged cache."""
    from transformers import GenerationConfig

    ours, _ = _pair(name, device=device)
    prompts = [[5, 9, 3, 7, 11, 2], [8, 1, 4], [6, 6, 2, 9, 13]]
    new = 3
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        out = ours.generate_batch(prompts, generation_config=gen, progress_bar=False)
    assert ours.config._attn_implementation == "tritoninfer"
    results = list(out.values())
    assert len(results) == len(prompts) and all(r.error is None for r in results)
    for prompt, r in zip(prompts, results):
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            want = ours.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert list(r.generated_tokens) == want.tolist(), f"prompt {prompt}"


# --------------------------------------------------------------------------------------------------
# GPU: realistic shapes (bf16, head_dim 128 / 256)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_gpu_teacher_forced_logits(name):
    ours, ref = _pair(name, dtype=torch.bfloat16, device="cuda", big=True)
    ids, mask = _batch(ours.config.vocab_size, [1024, 700, 333, 1024], "cuda")
    _check_logits(ours, ref, ids, mask, LOGIT_TOL[torch.bfloat16], f32_reference=name in F32_REFERENCE,
                  or_reference_error=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama3", "mistral", "gemma2", "gpt_oss"])
def test_gpu_greedy_generate_fp32(name):
    """32 greedy tokens in float32 against transformers' attention, batch 1 and a padded batch."""
    ours, ref = _pair(name, dtype=torch.float32, device="cuda", big=True)
    for lengths in ([300], [300, 120, 513]):
        ids, mask = _batch(ours.config.vocab_size, lengths, "cuda", seed=len(lengths))
        _check_greedy(ours, ref, ids, mask, new_tokens=32, tol=LOGIT_TOL[torch.float32])


@pytest.mark.gpu
def test_gpu_static_cache_compiled():
    """A static cache on the GPU makes generate() compile the forward (reduce-overhead): the
    attention is a graph break and still gives the reference's tokens."""
    ours, ref = _pair("llama3", dtype=torch.float32, device="cuda", big=True)
    ids, mask = _batch(ours.config.vocab_size, [200, 64], "cuda", seed=9)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        got = ours.generate(ids, **kw)
        want = ref.generate(ids, **kw)
    assert (got == want).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_gpu_generate_batch(name):
    from transformers import GenerationConfig

    ours, _ = _pair(name, dtype=torch.bfloat16, device="cuda", big=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in (512, 77, 1500, 900, 3, 2048)]
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        # transformers' defaults: no CUDA graphs for a non-flash implementation
        out = ours.generate_batch(prompts, generation_config=gen, progress_bar=False)
    results = list(out.values())
    assert len(results) == len(prompts) and all(r.error is None for r in results)
    agree = 0
    for prompt, r in zip(prompts, results):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            want = ours.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(prompt):]
        # bf16: the ragged and the contiguous routes round differently, so allow a late parting
        agree += int(list(r.generated_tokens)[:4] == want.tolist()[:4])
    assert agree >= len(prompts) - 1
