"""``tritoninfer demo``: the paged serving loop against Hugging Face transformers, the checkpoint
loader, the scheduler, and the command line.

The model is tiny (2 layers, hidden 64, 4/2 heads, head_dim 16, vocab 128, page size 4) so that
every kernel runs through the Triton interpreter in seconds.
"""

import dataclasses
import json
import math
import re

import pytest
import torch

from tritoninfer.demo import main
from tritoninfer.demo.engine import Engine, EngineConfig, batch_buckets
from tritoninfer.demo.hf import config_from_hf, load_checkpoint, read_safetensors
from tritoninfer.demo.kv_cache import PageAllocator
from tritoninfer.demo.model import TINY, LlamaModel, ModelConfig, random_weights
from tritoninfer.demo.reference import DenseReference
from tritoninfer.demo.sampler import Sampler, SamplingConfig, SamplingParams
from tritoninfer.demo.scheduler import Request, Scheduler
from tritoninfer.reference import sampling as ref_sampling
from tritoninfer.demo.variants import KernelVariants

# prompts of different lengths (1 token, exactly one page, partial pages) and generation lengths,
# so requests finish at different steps and waiting ones are admitted mid-run (max_batch 3)
PROMPT_LENS = [7, 1, 12, 4, 9]
GEN_LENS = [4, 3, 1, 5, 2]


def _workload(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (n,), generator=g).tolist(), m) for n, m in zip(PROMPT_LENS, GEN_LENS)]


def _hf_llama(cfg: ModelConfig, weights):
    """``LlamaForCausalLM`` of the same shape (no download) with ``weights`` copied in (float32)."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
    )
    hf_cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    w = weights.to(torch.float32, "cpu")
    hq, hkv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(w.embed)
        for layer, lw in zip(model.model.layers, w.layers):
            layer.self_attn.q_proj.weight.copy_(lw.qkv[:hq])
            layer.self_attn.k_proj.weight.copy_(lw.qkv[hq: hq + hkv])
            layer.self_attn.v_proj.weight.copy_(lw.qkv[hq + hkv:])
            layer.self_attn.o_proj.weight.copy_(lw.o)
            layer.mlp.gate_proj.weight.copy_(lw.gate_up[:i])
            layer.mlp.up_proj.weight.copy_(lw.gate_up[i:])
            layer.mlp.down_proj.weight.copy_(lw.down)
            layer.input_layernorm.weight.copy_(lw.input_norm)
            layer.post_attention_layernorm.weight.copy_(lw.post_norm)
        model.model.norm.weight.copy_(w.final_norm)
        model.lm_head.weight.copy_(w.lm_head)
    return model


def _serve(model, kv_dtype, workload, max_batch=3, warmup=False, **engine_kw):
    ecfg = EngineConfig(page_size=4, max_batch=max_batch, record_logits=True, workspace_bytes=8 << 20, **engine_kw)
    engine = Engine(model, kv_dtype, ecfg, num_pages=3 * 4)
    if warmup:  # what the command does first: rehearses the workload, calibrates the fp8 scales, dirties pages
        engine.warmup(workload)
        assert engine.cache.k_scale is None or len(engine.cache.k_scale) == model.cfg.num_layers
        assert engine.stats.prompt_tokens == 0 and engine.cache.allocator.num_free == engine.cache.num_pages
    reqs = [Request(i, list(p), g) for i, (p, g) in enumerate(workload)]
    stats = engine.run(reqs)
    return engine, reqs, stats


def _compare_with_hf(hf_model, engine, reqs, tol):
    """Teacher-forced logits of every step vs transformers' on the served sequence, within ``tol``
    (relative to the row's largest |logit|); greedy tokens agree wherever transformers' top-2
    margin exceeds that tolerance."""
    worst = 0.0
    decided = 0
    for r in reqs:
        ours = torch.stack(engine.logits[r.rid]).float()  # [generated, vocab]: prefill's last row, then decode steps
        assert ours.shape[0] == len(r.output) == r.max_new_tokens
        seq = torch.tensor([r.prompt + r.output[:-1]])
        with torch.no_grad():
            ref = hf_model(seq).logits[0, len(r.prompt) - 1:].float()
        assert ref.shape == ours.shape
        diff = (ours - ref).abs().amax(-1)
        rel = diff / ref.abs().amax(-1)
        worst = max(worst, float(rel.max()))
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        clear = margin > tol * ref.abs().amax(-1)
        decided += int(clear.sum())
        tokens = torch.tensor(r.output)
        assert torch.equal(tokens[clear], ref.argmax(-1)[clear]), f"request {r.rid}: greedy token differs"
    assert worst <= tol, f"largest relative logit difference {worst:.4g} > {tol}"
    assert decided >= sum(GEN_LENS) // 3, decided  # the greedy comparison is not vacuous
    return worst


@pytest.mark.parametrize(
    "dtype,kv_dtype,engine_kw,tol",
    [
        # fp32 activations (attention on fp16 queries, fp16 KV), decode on fixed padded buffers (the
        # CUDA-graph path; captured on a GPU): buckets 1, 2, 4, so a batch of 3 is padded to 4
        (torch.float32, torch.float16, {"cuda_graph": True, "max_batch": 4}, 1e-2),
        # bf16 activations, fp8 e4m3 KV with per-layer scales, eager decode, tensor-core flag
        (torch.bfloat16, torch.float8_e4m3fn, {"cuda_graph": False, "use_tensor_cores": True, "warmup": True}, 0.12),
    ],
    ids=["fp32-fp16kv-graphpath", "bf16-fp8kv-eager"],
)
def test_serving_loop_matches_transformers(device, dtype, kv_dtype, engine_kw, tol):
    cfg = TINY
    weights = random_weights(cfg, seed=0, dtype=torch.float32)
    hf_model = _hf_llama(cfg, weights)
    model = LlamaModel(cfg, weights.to(dtype, device), dtype)
    engine, reqs, stats = _serve(model, kv_dtype, _workload(cfg.vocab_size), **engine_kw)
    assert all(r.done for r in reqs) and stats.generated_tokens == sum(GEN_LENS)
    assert stats.prefill_steps >= 2  # requests 4 and 5 were admitted after others finished
    assert engine.cache.allocator.num_free == engine.cache.num_pages  # every page went back
    if engine_kw.get("max_batch") == 4:
        assert 3 in stats.decode_batch_sizes  # padded to the bucket of 4
    _compare_with_hf(hf_model, engine, reqs, tol)


def test_dense_reference_matches_transformers():
    """The --check reference itself is right (so --check judges against the right model)."""
    cfg = dataclasses.replace(TINY, sliding_window=None)
    weights = random_weights(cfg, seed=3, dtype=torch.float32)
    hf_model = _hf_llama(cfg, weights)
    ref = DenseReference(cfg, weights, "cpu")
    prompt = list(range(3, 14))
    logits = ref.forward([(0, prompt[:6]), (1, prompt[:2])], all_rows=True)
    more = ref.forward([(0, prompt[6:])], all_rows=True)
    with torch.no_grad():
        hf = hf_model(torch.tensor([prompt])).logits[0]
        hf1 = hf_model(torch.tensor([prompt[:2]])).logits[0]
    torch.testing.assert_close(logits[:6], hf[:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[6:], hf1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(more, hf[6:], atol=1e-4, rtol=1e-4)


def _save_hf_checkpoint(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    if kind == "qwen2":  # q/k/v biases, tied embeddings
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":  # a sliding window shorter than the prompts: window_left in the wrappers
        cfg = transformers.MistralConfig(**common, head_dim=16, sliding_window=5, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(cfg)
    else:  # Llama 3 rope scaling with a short original context, so it matters at these positions
        cfg = transformers.LlamaConfig(**common, head_dim=16, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights that give O(1) activations and spread-out logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.eval().save_pretrained(tmp_path)  # config.json + model.safetensors
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope", "mistral"])
def test_checkpoint_loading_matches_transformers(device, tmp_path, kind):
    hf_model = _save_hf_checkpoint(tmp_path, kind)
    cfg, weights = load_checkpoint(str(tmp_path), torch.float32, device)
    if kind == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings and cfg.rope_theta == 1e6
        assert weights.lm_head is weights.embed and weights.layers[0].qkv_bias is not None
    elif kind == "mistral":
        assert cfg.sliding_window == 5 and cfg.window_left == 4
    else:
        assert cfg.rope_scaling["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    model = LlamaModel(cfg, weights, torch.float32)
    g = torch.Generator().manual_seed(5)
    workload = [(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), 2) for n in (13, 6)]
    ecfg = EngineConfig(page_size=4, max_batch=2, record_logits=True, workspace_bytes=8 << 20)
    engine = Engine(model, torch.float16, ecfg, num_pages=8)
    reqs = [Request(i, p, n) for i, (p, n) in enumerate(workload)]
    engine.run(reqs)
    for r in reqs:
        ours = torch.stack(engine.logits[r.rid])
        with torch.no_grad():
            ref = hf_model(torch.tensor([r.prompt + r.output[:-1]])).logits[0, len(r.prompt) - 1:]
        rel = float(((ours - ref).abs().amax(-1) / ref.abs().amax(-1)).max())
        assert rel < 1e-2, rel


def test_main_with_model_checkpoint(capsys, tmp_path):
    _save_hf_checkpoint(tmp_path, "qwen2")
    status = main(["--model", str(tmp_path), "--check", "--quiet", "--num-requests", "2", "--gen-len", "2",
                   "--dtype", "fp32", "--kv-dtype", "fp16"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "qwen2 checkpoint" in text and "OK" in text


def test_read_safetensors_dtypes(tmp_path):
    """The loader's own safetensors reader against hand-written files."""
    import struct

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
               "c": torch.tensor([[7]], dtype=torch.int64)}
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    got = read_safetensors(str(path))
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)


def test_config_from_hf_errors():
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=32)
    cfg = config_from_hf(base)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_scaling) == (4, 16, None)
    assert config_from_hf({**base, "model_type": "mistral", "sliding_window": 8}).window_left == 7
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(NotImplementedError, match="rope scaling"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(NotImplementedError, match="hidden_act"):
        config_from_hf({**base, "hidden_act": "gelu"})


def test_scheduler_admission_and_pages():
    alloc = PageAllocator(6)
    s = Scheduler(alloc, page_size=4, max_batch=2, max_prefill_tokens=100)
    a, b, c = Request(0, [1] * 5, 4), Request(1, [1] * 3, 2), Request(2, [1] * 2, 1)
    for r in (a, b, c):
        s.add(r)
    kind, batch = s.schedule()  # a needs 2 pages (8 tokens), b 1 page: both fit, c waits for a slot
    assert kind == "prefill" and batch == [a, b] and len(a.pages) == 2 and len(b.pages) == 1
    for r in batch:
        r.kv_len = len(r.prompt)
        r.output.append(0)
    kind, batch = s.schedule()
    assert kind == "decode" and batch == [a, b]
    for r in batch:
        r.kv_len += 1
        r.output.append(0)
    assert s.retire() == [b] and alloc.num_free == 4  # b is done: its page is back
    kind, batch = s.schedule()
    assert kind == "prefill" and batch == [c]
    assert alloc.peak_used == 3
    with pytest.raises(ValueError, match="pages"):
        s.add(Request(3, [1] * 30, 1))
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and batch_buckets(3) == [1, 2, 3]


def _row(text, label):
    """The values of a summary row, one per KV dtype."""
    line = next(line for line in text.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{3,}", line.strip()[len(label):].strip())


def test_main_check_end_to_end(capsys, tmp_path):
    out = tmp_path / "summary.md"
    status = main(["--check", "--quiet", "--kv-dtype", "bf16,fp8", "--num-requests", "3", "--gen-len", "2-3",
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "interpreter configuration" in text.lower() or "interpreter" in text
    assert "decode" in text and "KV pages used (peak)" in text and "check (fp8 KV)" in text and "OK" in text
    # each KV dtype's warm-up ran before its timed run and left it nothing to compile
    assert text.index("warm-up (compiles kernels, not timed)") < text.index("  prefill ")
    warmups = _row(text, "warm-up (compiles kernels, not timed)")
    assert len(warmups) == 2 and all(re.fullmatch(r"\d+\.\d s, \d+ kernel variants", v) for v in warmups), warmups
    assert _row(text, "new kernel variants while timed") == ["0", "0"]
    md = out.read_text()
    assert md.startswith("# tritoninfer demo") and "| KV cache dtype | bf16 | fp8 |" in md


def test_main_without_warmup_compiles_while_timed(capsys):
    assert main(["--quiet", "--no-warmup", "--num-requests", "2", "--gen-len", "2"]) == 0
    text = capsys.readouterr().out
    assert "skipped (--no-warmup)" in text
    assert int(_row(text, "new kernel variants while timed")[0]) > 0


@pytest.mark.parametrize("kv_dtype,cuda_graph,max_batch", [
    (torch.float16, True, 4),
    (torch.float8_e4m3fn, False, 3),
], ids=["fp16-graphpath", "fp8-eager"])
def test_warmup_launches_every_kernel_variant_of_the_timed_run(kv_dtype, cuda_graph, max_batch):
    """The warm-up launches every kernel variant (what Triton compiles once: constexprs and the
    specialisation of the other arguments) that the timed run launches, so no compilation is timed.
    A warm-up of part of the workload misses some, which shows that the count can fail."""
    cfg = TINY
    model = LlamaModel(cfg, random_weights(cfg, seed=0, dtype=torch.bfloat16), torch.bfloat16)
    workload = _workload(cfg.vocab_size)
    for rehearsed, complete in ((workload, True), (workload[1:2], False)):
        ecfg = EngineConfig(page_size=4, max_batch=max_batch, workspace_bytes=8 << 20, cuda_graph=cuda_graph)
        with KernelVariants() as variants:
            engine = Engine(model, kv_dtype, ecfg, num_pages=3 * 4)
            engine.warmup(rehearsed)
            warmed = len(variants)
            engine.run([Request(i, list(p), g) for i, (p, g) in enumerate(workload)])
        assert warmed > 0
        assert (len(variants) == warmed) == complete, (len(variants), warmed)


def test_kernel_variants_keys_and_gpu_hook(monkeypatch):
    """The interpreter's variant key follows Triton's specialisation; on a GPU the recorder chains
    Triton's compile hook and puts the previous one back."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from tritoninfer import _device
    from tritoninfer.demo import variants as mod

    spec = mod._specialisation
    assert len({spec(x, True, True) for x in (1, 16, 17, 32, 2**40)}) == 4  # 16 and 32: same class
    assert spec(1, False, True) == spec(17, False, True) != spec(2**40, False, True)  # do_not_specialize
    t = torch.zeros(8, dtype=torch.float16)
    assert spec(t, True, True) != spec(t[1:], True, True) and spec(t, True, False) == spec(t[1:], True, False)
    assert spec(True, True, True) != spec(False, True, True) and spec(0.5, True, True) == spec(2.0, True, True)

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw["key"]))
    monkeypatch.setattr(_device, "is_interpreter", lambda: False)
    previous = knobs.runtime.jit_post_compile_hook
    with KernelVariants() as variants:
        for key in ("a", "b", "a"):
            knobs.runtime.jit_post_compile_hook(key=key, repr="", fn=JitFunctionInfo(None, "k", None), compile={},
                                                is_manual_warmup=False, already_compiled=False)
    assert len(variants) == 2 and calls == ["a", "b", "a"]
    assert knobs.runtime.jit_post_compile_hook is previous


def test_main_check_fails_on_tight_tolerance(capsys):
    status = main(["--check", "--quiet", "--num-requests", "1", "--gen-len", "1", "--tolerance", "1e-9"])
    assert status == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--prompt-len", "9-3"], "LO <= HI"),
    (["--prompt-len", "abc"], "N or LO-HI"),
    (["--heads", "4/3"], "multiple of KV"),
    (["--kv-dtype", "int4"], "bf16, fp16, fp8"),
    (["--head-dim", "12"], "multiple of 8"),
    (["--num-requests", "0"], "positive int"),
    (["--model", "/nonexistent/dir"], "not a folder"),
    (["--preset", "nope"], "invalid choice"),
    (["--top-p", "0"], "--top-p: expected a value in (0, 1]"),
    (["--temperature", "-1"], "--temperature: expected a finite value >= 0"),
    (["--top-k", "-2"], "--top-k: expected an integer >= 0"),
    (["--min-p", "1.5"], "--min-p: expected a value in [0, 1]"),
    (["--bogus"], "unrecognized arguments"),
    (["--arch", "gpt"], "invalid choice"),
    (["--kv-lora-rank", "16"], "add --arch deepseek"),
    (["--arch", "deepseek", "--kv-dtype", "bf16,fp8"], "--kv-dtype fp8: the MLA latent cache is bf16 or fp16"),
    (["--arch", "deepseek", "--heads", "8/2"], "MLA has no KV heads"),
    (["--arch", "deepseek", "--use-tensor-cores"], "--use-tensor-cores"),
    (["--arch", "deepseek", "--rope-dim", "7"], "--rope-dim: expected an even number"),
    (["--arch", "deepseek", "--model", "/tmp"], "--arch deepseek is a random model"),
])
def test_main_argument_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_main_model_conflicts_with_shape(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path), "--layers", "3"]) == 2
    assert "drop --layers" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--quiet"]) == 2  # model_type missing
    assert "model_type" in capsys.readouterr().err


def test_main_help(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "--kv-dtype" in text and "--top-p" in text and "--sampling-seed" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_gpu_serving_loop_matches_dense_reference(kv, cuda_graph):
    """On the GPU: warm-up, per-bucket CUDA graphs re-planned every step (or eager decode), a
    realistic head shape, and every step's logits against the float32 dense reference."""
    from tritoninfer.demo.cli import default_tolerance
    from tritoninfer.demo.kv_cache import KV_DTYPES

    cfg = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=3, num_heads=16,
                      num_kv_heads=4, head_dim=128)
    weights = random_weights(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    model = LlamaModel(cfg, weights, torch.bfloat16)
    reference = DenseReference(cfg, weights, "cuda")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 400, (24,), generator=g).tolist()
    gens = torch.randint(1, 24, (24,), generator=g).tolist()
    reqs = [Request(i, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), m)
            for i, (n, m) in enumerate(zip(lens, gens))]
    ecfg = EngineConfig(page_size=16, max_batch=12, max_prefill_tokens=2048, cuda_graph=cuda_graph,
                        attn_sample_every=4)
    engine = Engine(model, KV_DTYPES[kv], ecfg, reference, num_pages=12 * 27)
    with KernelVariants() as variants:
        engine.warmup([(r.prompt, r.max_new_tokens) for r in reqs])
        compiled = len(variants)
        stats = engine.run(reqs)
    assert len(variants) == compiled  # nothing compiled while timed
    assert all(r.done for r in reqs) and stats.generated_tokens == sum(gens)
    assert stats.max_rel_diff <= default_tolerance("bf16", kv), stats.max_rel_diff
    assert engine.cache.allocator.num_free == engine.cache.num_pages
    if cuda_graph:
        assert stats.graphs_captured == len(engine.buckets)
        assert 0 < stats.decode_attn_share < 1


@pytest.mark.gpu
def test_gpu_main_h200_shape_smoke(tmp_path):
    """The h200 preset's model shape with a short workload; --out writes the markdown summary."""
    out = tmp_path / "h200.md"
    status = main(["--preset", "h200", "--num-requests", "8", "--max-batch", "4", "--prompt-len", "64-512",
                   "--gen-len", "8", "--check", "--quiet", "--out", str(out)])
    assert status == 0
    assert "| KV cache dtype | bf16 | fp8 |" in out.read_text()


def test_decode_host_share():
    """The demo's host share of the decode steps: 1 - device time of the graph replays / wall time of
    the decode steps (issue "The host path", target 4)."""
    from tritoninfer.demo.engine import Stats

    s = Stats(decode_tokens=160, decode_time=0.0245, decode_device_time=0.0152)
    assert abs(s.decode_host_share - (1 - 0.0152 / 0.0245)) < 1e-9
    assert Stats(decode_tokens=160, decode_time=0.0245).decode_host_share == 0.0  # eager: no device time


# --------------------------------------------------------------------------------------------------
# sampling (--sampling): tritoninfer's sampling kernels in the decode step
# --------------------------------------------------------------------------------------------------


def _sample_run(sampling, cuda_graph=True, reference=False, warmup=False, requests=None, kv_dtype=torch.bfloat16,
                max_batch=4, seed_weights=0, overlap=None, on_step=None):
    """Serve the test workload with ``sampling`` (None: greedy); returns (engine, requests, stats).
    ``overlap`` None: record every step's logits (which keeps the synchronous path); True / False:
    no logits, decode steps overlapped or not."""
    cfg = TINY
    weights = random_weights(cfg, seed=seed_weights, dtype=torch.bfloat16)
    model = LlamaModel(cfg, weights, torch.bfloat16)
    ref = DenseReference(cfg, weights, "cpu") if reference else None
    ecfg = EngineConfig(page_size=4, max_batch=max_batch, record_logits=overlap is None, workspace_bytes=8 << 20,
                        cuda_graph=cuda_graph, sampling=sampling, overlap=bool(overlap))
    engine = Engine(model, kv_dtype, ecfg, ref, num_pages=3 * 4)
    workload = _workload(cfg.vocab_size)
    if warmup:
        engine.warmup(workload)
    reqs = requests if requests is not None else [Request(i, list(p), g) for i, (p, g) in enumerate(workload)]
    stats = engine.run(reqs, on_step=on_step)
    return engine, reqs, stats


def _own_kept_set(engine, r, params, min_p_chain):
    """bool per generated token of ``r``: inside the kept set of the logits the engine sampled it
    from (its own recorded logits, sets from tritoninfer.reference)."""
    logits = torch.stack(engine.logits[r.rid]).float()
    tok = torch.tensor(r.output)
    rows = torch.arange(len(tok))
    if params.temperature == 0:
        return logits[rows, tok] == logits.max(-1).values
    probs = ref_sampling.softmax(logits, params.temperature)
    keep = ref_sampling.top_k_keep_mask(probs, params.top_k)
    if min_p_chain:
        renormed = ref_sampling.top_k_renorm_probs(probs, params.top_k)
        keep &= ref_sampling.top_p_keep_mask(renormed, params.top_p) & ref_sampling.min_p_keep_mask(probs, params.min_p)
    else:
        keep &= ref_sampling.top_p_keep_mask(probs, params.top_p)
    return keep[rows, tok]


@pytest.mark.parametrize("params,cuda_graph,kv_dtype", [
    # the joint top-k/top-p kernel on the padded CUDA-graph path (a batch of 3 padded to 4)
    (SamplingParams(temperature=0.8, top_k=5, top_p=0.9), True, torch.bfloat16),
    # the min-p chain (top-k renorm, top-p renorm, min-p sampling), eager decode, fp16 KV
    (SamplingParams(temperature=1.2, top_k=20, top_p=0.95, min_p=0.1), False, torch.float16),
], ids=["joint-graphpath", "min-p-eager"])
def test_sampled_tokens_lie_in_the_allowed_set(params, cuda_graph, kv_dtype):
    """Every sampled token lies in the kept set of the logits it was drawn from, and --check's
    statistic finds every one inside the float32 reference's set widened by the measured logit
    difference; the tokens are not simply the argmax."""
    sampling = SamplingConfig(params, seed=0)
    engine, reqs, stats = _sample_run(sampling, cuda_graph=cuda_graph, reference=True, kv_dtype=kv_dtype)
    assert all(r.done for r in reqs) and stats.generated_tokens == sum(GEN_LENS)
    if cuda_graph:
        assert 3 in stats.decode_batch_sizes
    for r in reqs:
        assert bool(_own_kept_set(engine, r, params, sampling.min_p_chain).all()), (r.rid, r.output)
    assert stats.checked_rows == sum(GEN_LENS) and stats.sampled_outside == 0
    assert stats.sampled_exact >= stats.checked_rows - 1  # ties at the boundary are rare here
    assert stats.sampled_not_argmax >= 3, stats.sampled_not_argmax  # it sampled: not greedy in disguise


def test_sampling_seed_reproducible():
    """The same seed gives the same tokens (also after a warm-up, which draws from the generator and
    re-seeds it); another seed gives other tokens (temperature 1.5 over 128 tokens: near-certain)."""
    params = SamplingParams(temperature=1.5)
    runs = {}
    for seed, warmup in ((0, False), (0, True), (1, False)):
        _, reqs, _ = _sample_run(SamplingConfig(params, seed=seed), warmup=warmup)
        runs[seed, warmup] = [r.output for r in reqs]
    assert runs[0, False] == runs[0, True]
    assert runs[0, False] != runs[1, False]
    differing = sum(a != b for x, y in zip(runs[0, False], runs[1, False]) for a, b in zip(x, y))
    assert differing >= sum(GEN_LENS) // 2, differing


def test_sampling_greedy_limits_and_default():
    """Without sampling the engine has no sampler and decodes by argmax as before; temperature 0 and
    top-k 1 through the sampling kernels give the greedy tokens."""
    engine, greedy_reqs, _ = _sample_run(None)
    assert engine.sampler is None and not any(r.sampling for r in greedy_reqs)
    greedy = [r.output for r in greedy_reqs]
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)):
        _, reqs, _ = _sample_run(SamplingConfig(params, seed=7))
        assert [r.output for r in reqs] == greedy, params


def test_sampling_per_request_parameters():
    """Requests of one batch sample with their own parameters (per-row tensors in the decode step)."""
    workload = _workload(TINY.vocab_size)
    own = [SamplingParams(temperature=0.0), None, SamplingParams(temperature=0.7, top_k=2),
           SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=0.5)]
    reqs = [Request(i, list(p), g, sampling=s) for i, ((p, g), s) in enumerate(zip(workload, own))]
    default = SamplingParams(temperature=1.0, top_k=10)
    engine, reqs, stats = _sample_run(SamplingConfig(default, seed=0), reference=True, requests=reqs)
    assert stats.sampled_outside == 0
    for r in reqs:
        assert bool(_own_kept_set(engine, r, r.sampling or default, False).all()), (r.rid, r.output)
    # a min-p request needs the min-p chain; a greedy engine takes no sampling parameters
    bad = [Request(0, [1, 2], 1, sampling=SamplingParams(min_p=0.2))]
    with pytest.raises(ValueError, match="min_p"):
        _sample_run(SamplingConfig(default), requests=bad)
    with pytest.raises(ValueError, match="greedy engine"):
        _sample_run(None, requests=[Request(0, [1, 2], 1, sampling=default)])


def test_sampling_check_catches_tokens_outside_the_set(monkeypatch):
    """--check's sampled-token statistic fails tokens outside the set (here the least likely token
    instead of one of the top 3)."""
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, bufs: logits.argmin(-1))
    _, _, stats = _sample_run(SamplingConfig(SamplingParams(top_k=3)), reference=True)
    assert stats.sampled_outside == stats.checked_rows == sum(GEN_LENS)


def test_main_sampling_end_to_end(capsys):
    status = main(["--check", "--quiet", "--sampling", "--temperature", "0.9", "--top-k", "8", "--top-p", "0.9",
                   "--num-requests", "3", "--gen-len", "3", "--sampling-seed", "5"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "generated each (sampled)" in text and "temperature 0.9, top-k 8, top-p 0.9, seed 5" in text
    assert _row(text, "check: sampled tokens in the allowed set")[0].startswith("9 of 9 (")
    assert _row(text, "new kernel variants while timed") == ["0"]  # the warm-up sampled too
    assert "sampled tokens outside the allowed set: 0: OK" in text


@pytest.mark.gpu
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.05),
], ids=["joint", "min-p"])
def test_gpu_sampling_in_cuda_graphs(params):
    """On the GPU: the sampling kernels captured in every decode bucket's CUDA graph with the
    engine's own generator registered; every sampled token in the reference's allowed set, the same
    seed gives the same tokens (the timed replays of every 4th step undo their draws), tokens vary."""
    from tritoninfer.demo.kv_cache import KV_DTYPES

    cfg = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=3, num_heads=16,
                      num_kv_heads=4, head_dim=128)
    weights = random_weights(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    model = LlamaModel(cfg, weights, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 300, (16,), generator=g).tolist()
    gens = torch.randint(4, 16, (16,), generator=g).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    outputs = []
    for run in range(2):
        reqs = [Request(i, list(p), m) for i, (p, m) in enumerate(zip(prompts, gens))]
        ecfg = EngineConfig(page_size=16, max_batch=8, max_prefill_tokens=2048, attn_sample_every=4,
                            sampling=SamplingConfig(params, seed=11))
        engine = Engine(model, KV_DTYPES["bf16"], ecfg, DenseReference(cfg, weights, "cuda"), num_pages=8 * 20)
        engine.warmup([(r.prompt, r.max_new_tokens) for r in reqs])
        stats = engine.run(reqs)
        assert stats.graphs_captured == len(engine.buckets) and stats.decode_tokens > 0
        assert stats.checked_rows == sum(gens) and stats.sampled_outside == 0, stats
        assert stats.sampled_not_argmax > sum(gens) // 4
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
def test_gpu_main_sampling_smoke():
    """The command with --sampling on the GPU preset's shape: decode graphs sample, --check passes."""
    status = main(["--sampling", "--temperature", "0.7", "--top-k", "50", "--top-p", "0.9", "--check", "--quiet",
                   "--num-requests", "8", "--max-batch", "4", "--prompt-len", "64-256", "--gen-len", "8"])
    assert status == 0


# --------------------------------------------------------------------------------------------------
# overlap: the next decode step is prepared and launched before the previous one's tokens are read
# --------------------------------------------------------------------------------------------------


def _lateness(log):
    """An ``on_step`` callback recording, per decode step read, how many decode steps were launched."""
    def on_step(engine, info):
        if info.kind == "decode":
            log.append(engine._launches - engine.stats.decode_steps)
    return on_step


@pytest.mark.parametrize("sampling", [
    None,
    SamplingConfig(SamplingParams(temperature=1.5, top_k=20, top_p=0.95), seed=3),
    SamplingConfig(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05), seed=4),
], ids=["greedy", "joint", "min-p"])
def test_overlap_gives_the_synchronous_tokens(sampling):
    """The overlapped decode (tokens read one step late, input ids passed on the device) produces
    exactly the synchronous path's tokens, greedy and sampled with a fixed seed (the same device work
    in the same order: the same draws), frees every page, and reports its host share."""
    runs = {}
    for overlap in (False, True):
        late = []
        engine, reqs, stats = _sample_run(sampling, overlap=overlap, on_step=_lateness(late))
        assert engine.overlap == overlap
        assert all(r.done for r in reqs) and stats.generated_tokens == sum(GEN_LENS)
        assert stats.decode_discarded == 0 and 3 in stats.decode_batch_sizes
        assert engine.cache.allocator.num_free == engine.cache.num_pages
        assert engine.scheduler.running == [] and sorted(engine._free_slots) == list(range(4))
        # each step read one launch late when overlapped (the last of a run of decode steps is
        # read when the pipeline drains, before a prefill or at the end), at once otherwise
        assert set(late) == ({0, 1} if overlap else {0}), late
        assert stats.decode_device_time > 0 and 0 < stats.decode_host_share < 1
        runs[overlap] = [r.output for r in reqs]
    assert runs[True] == runs[False]


def test_overlap_stop_tokens_are_read_one_step_late():
    """A request that emits a stop token ends there (the token kept). Overlapped, the engine learns it
    one step late, when the request is already in the next step: that step's token for it is
    discarded, not emitted, and its pages are freed. Greedy tokens before the stop are those of the
    run without stop tokens, in both paths."""
    _, plain, _ = _sample_run(None, overlap=False)
    full = [r.output for r in plain]
    # request 0 stops at its 2nd token and request 3 at its 3rd (decode steps), request 1 at its
    # first (the prefill's); the others never meet their stop token
    stops = {0: full[0][1], 1: full[1][0], 3: full[3][2]}
    expected = []
    for i, out in enumerate(full):
        cut = out.index(stops[i]) + 1 if i in stops else len(out)
        expected.append(out[:cut])
    assert expected[0] == full[0][:2] and expected[1] == full[1][:1] and len(expected[3]) == 3
    workload = _workload(TINY.vocab_size)
    outputs, discarded = {}, {}
    for overlap in (False, True):
        reqs = [Request(i, list(p), g, stop_token_ids=(stops[i],) if i in stops else ()) for i, (p, g) in
                enumerate(workload)]
        engine, reqs, stats = _sample_run(None, overlap=overlap, requests=reqs)
        assert all(r.done for r in reqs) and engine.scheduler.running == []
        assert [r.stopped for r in reqs] == [True, True, False, True, False]
        assert engine.cache.allocator.num_free == engine.cache.num_pages  # the late step's pages too
        assert stats.generated_tokens == sum(len(r.output) for r in reqs)
        outputs[overlap], discarded[overlap] = [r.output for r in reqs], stats.decode_discarded
    assert outputs[False] == outputs[True] == expected
    assert discarded[False] == 0
    assert discarded[True] == 2  # requests 0 and 3, one late token each (request 1 stopped at its prefill)


def test_main_overlap_and_no_overlap_agree(capsys):
    """The command: overlapped by default (and the header says so), --no-overlap and --check read
    every step at once; the same tokens, and the host-share row."""
    argv = ["--quiet", "--sampling", "--temperature", "1.3", "--num-requests", "4", "--gen-len", "3-6"]
    texts = {}
    for extra in ([], ["--no-overlap"], ["--check"]):
        assert main(argv + extra) == 0
        texts[tuple(extra)] = capsys.readouterr().out
    assert "tokens read one step late" in texts[()]
    assert "tokens read after each step (--no-overlap)" in texts[("--no-overlap",)]
    assert "tokens read after each step (--check)" in texts[("--check",)]
    generated = {k: re.search(r"request 0 .* generated (.*)", t).group(1) for k, t in texts.items()}
    assert len(set(generated.values())) == 1, generated
    share = _row(texts[()], "decode: host share (device idle)")[0]
    assert re.fullmatch(r"\d+\.\d %", share), share


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_gpu_overlap_host_share_under_ten_percent(sampled):
    """The gpu preset (8 layers of a 32/8-head, hidden-4096 model, 32 requests, 16 at a time, prompts
    256-2048, 64 tokens each): overlapped, the decode steps leave the GPU idle less than 10 % of
    their wall time (issue "The host path", target 4), with the synchronous path's tokens."""
    from tritoninfer.demo.cli import make_workload, parse_args
    from tritoninfer.demo.kv_cache import KV_DTYPES
    from tritoninfer.demo.scheduler import pages_for

    args = parse_args(["--preset", "gpu"] + (["--sampling", "--temperature", "0.8", "--top-k", "50"] if sampled else []),
                      on_gpu=True)
    q, kv = args.heads
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_layers=args.layers, num_heads=q, num_kv_heads=kv, head_dim=args.head_dim)
    model = LlamaModel(cfg, random_weights(cfg, args.seed, torch.bfloat16, "cuda"), torch.bfloat16)
    workload = make_workload(args, cfg.vocab_size)
    max_kv = max(len(p) + g - 1 for p, g in workload)
    results = {}
    for overlap in (False, True):
        ecfg = EngineConfig(page_size=args.page_size, max_batch=args.max_batch,
                            max_prefill_tokens=args.max_prefill_tokens, sampling=args.sampling_config,
                            workspace_bytes=512 << 20, overlap=overlap)
        engine = Engine(model, KV_DTYPES["bf16"], ecfg, num_pages=args.max_batch * pages_for(max_kv, args.page_size))
        engine.warmup(workload)
        reqs = [Request(i, list(p), g) for i, (p, g) in enumerate(workload)]
        stats = engine.run(reqs)
        assert engine.overlap == overlap and stats.decode_discarded == 0
        results[overlap] = ([r.output for r in reqs], stats)
        del engine
        torch.cuda.empty_cache()
    (sync_out, sync), (over_out, over) = results[False], results[True]
    print(f"host share: synchronous {100 * sync.decode_host_share:.1f} %, overlapped "
          f"{100 * over.decode_host_share:.1f} %; decode {sync.decode_tps:,.0f} -> {over.decode_tps:,.0f} tok/s, "
          f"device only {over.decode_tokens / over.decode_device_time:,.0f} tok/s")
    assert over_out == sync_out
    assert over.decode_host_share < 0.10, over.decode_host_share


# ---------------------------------------------------------------------------------------------
# --arch deepseek: multi-head latent attention served by BatchMLAPagedAttentionWrapper
# ---------------------------------------------------------------------------------------------


def _hf_deepseek(cfg, weights):
    """``DeepseekV3ForCausalLM`` of the same shape with ``weights`` copied in (float32): every MLP dense
    (``first_k_dense_replace`` = layers), rotate-half RoPE (``rope_interleave=False``), no YaRN."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, first_k_dense_replace=cfg.num_layers,
        rope_interleave=False, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=256,
        tie_word_embeddings=False, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    hf_cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    w = weights.to(torch.float32, "cpu")
    i = cfg.intermediate_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(w.embed)
        for layer, lw in zip(model.model.layers, w.layers):
            a = layer.self_attn
            if cfg.q_lora_rank is None:
                a.q_proj.weight.copy_(lw.q_b)
            else:
                a.q_a_proj.weight.copy_(lw.q_a)
                a.q_a_layernorm.weight.copy_(lw.q_a_norm)
                a.q_b_proj.weight.copy_(lw.q_b)
            a.kv_a_proj_with_mqa.weight.copy_(lw.kv_a)
            a.kv_a_layernorm.weight.copy_(lw.kv_a_norm)
            a.kv_b_proj.weight.copy_(lw.kv_b)
            a.o_proj.weight.copy_(lw.o)
            layer.mlp.gate_proj.weight.copy_(lw.gate_up[:i])
            layer.mlp.up_proj.weight.copy_(lw.gate_up[i:])
            layer.mlp.down_proj.weight.copy_(lw.down)
            layer.input_layernorm.weight.copy_(lw.input_norm)
            layer.post_attention_layernorm.weight.copy_(lw.post_norm)
        model.model.norm.weight.copy_(w.final_norm)
        model.lm_head.weight.copy_(w.lm_head)
    return model


@pytest.mark.parametrize("q_lora", [True, False], ids=["q-lora", "q-proj"])
def test_mla_reference_matches_transformers(q_lora):
    """The MLA dense reference (non-absorbed, a prefill then token-by-token steps) against
    transformers' DeepSeek-V3 attention with the same weights."""
    from tritoninfer.demo.deepseek import MLA_TINY, random_mla_weights
    from tritoninfer.demo.reference import MLADenseReference

    cfg = MLA_TINY if q_lora else dataclasses.replace(MLA_TINY, q_lora_rank=None)
    weights = random_mla_weights(cfg, seed=0, dtype=torch.float32)
    hf = _hf_deepseek(cfg, weights)
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(cfg.sm_scale)
    tokens = torch.randint(0, cfg.vocab_size, (11,)).tolist()
    ref = MLADenseReference(cfg, weights)
    ours = torch.cat([ref.forward([(0, tokens[:7])], all_rows=True)] + [ref.forward([(0, [t])]) for t in tokens[7:]])
    with torch.no_grad():
        theirs = hf(torch.tensor([tokens])).logits[0]
    assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def _deepseek_run(dtype=torch.bfloat16, kv_dtype=torch.bfloat16, perturb=None, warmup=False, sampling=None,
                  overlap=None, **engine_kw):
    """Serve the test workload through the tiny MLA model with its dense reference (unless
    ``overlap`` is given, which needs no reference). ``perturb(model)`` edits the served model only."""
    from tritoninfer.demo.deepseek import MLA_TINY, DeepseekModel, random_mla_weights
    from tritoninfer.demo.reference import MLADenseReference

    cfg = MLA_TINY
    weights = random_mla_weights(cfg, seed=0, dtype=torch.float32)
    model = DeepseekModel(cfg, weights.to(dtype), dtype)
    if perturb is not None:
        perturb(model)
    reference = MLADenseReference(cfg, weights) if overlap is None else None
    ecfg = EngineConfig(page_size=4, workspace_bytes=8 << 20, sampling=sampling, overlap=bool(overlap),
                        **{"max_batch": 3, **engine_kw})
    engine = Engine(model, kv_dtype, ecfg, reference, num_pages=3 * 4)
    workload = _workload(cfg.vocab_size)
    if warmup:
        engine.warmup(workload)
    reqs = [Request(i, list(p), g) for i, (p, g) in enumerate(workload)]
    stats = engine.run(reqs)
    assert all(r.done for r in reqs) and stats.generated_tokens == sum(GEN_LENS)
    assert engine.cache.allocator.num_free == engine.cache.num_pages
    return engine, reqs, stats


@pytest.mark.parametrize("dtype,kv_dtype,engine_kw,tol", [
    # bf16, decode on the padded fixed-buffer path (the CUDA-graph one; max_batch 4: a batch of 3 is
    # padded to 4), after the warm-up
    (torch.bfloat16, torch.bfloat16, {"cuda_graph": True, "max_batch": 4, "warmup": True}, 0.08),
    # fp32 activations with fp16 queries and latents, eager decode
    (torch.float32, torch.float16, {"cuda_graph": False}, 0.01),
], ids=["bf16-graphpath", "fp32-fp16kv-eager"])
def test_deepseek_serving_loop_matches_dense_reference(dtype, kv_dtype, engine_kw, tol):
    """Every step's logits (prefill through the causal MLA wrapper, decode steps) against the float32
    non-absorbed forward; greedy tokens agree with the reference's argmax."""
    engine, reqs, stats = _deepseek_run(dtype, kv_dtype, **engine_kw)
    assert stats.checked_rows == sum(GEN_LENS) and stats.prefill_steps >= 2
    assert stats.max_rel_diff <= tol, stats.max_rel_diff
    assert stats.argmax_mismatches == 0
    assert engine.cache.data.shape[-1] == engine.cfg_model.kv_lora_rank + engine.cfg_model.qk_rope_head_dim
    if engine_kw.get("max_batch") == 4:
        assert 3 in stats.decode_batch_sizes


@pytest.mark.parametrize("broken", ["w_uk-heads-rolled", "w_uv-for-w_uk"])
def test_deepseek_check_catches_a_broken_absorption(broken):
    """The served model's absorbed W_UK is broken (one layer's heads permuted, or W_UV taken in its
    place); the reference expands kv_b_proj from the definition, so the check fails far above its
    tolerance."""
    def perturb(model):
        if broken == "w_uk-heads-rolled":
            model.w_uk[0] = model.w_uk[0].roll(1, 0)
        else:
            model.w_uk[1] = model.w_uv[1].transpose(1, 2).contiguous()

    _, _, stats = _deepseek_run(perturb=perturb)
    assert stats.max_rel_diff > 0.3, stats.max_rel_diff


def test_main_deepseek_check_end_to_end(capsys, monkeypatch):
    """``--arch deepseek --check``: passes, nothing compiled while timed; and exit status 1 when the
    served model's absorption is broken."""
    status = main(["--arch", "deepseek", "--check", "--quiet", "--num-requests", "3", "--gen-len", "2-3"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "MLA kv_lora_rank 32 + rope 16" in text and "BatchMLAPagedAttentionWrapper" in text
    assert "check (bf16 KV)" in text and ": OK" in text
    assert _row(text, "new kernel variants while timed") == ["0"]

    from tritoninfer.demo import deepseek

    init = deepseek.DeepseekModel.__init__

    def broken_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.w_uk = [w.roll(1, 0) for w in self.w_uk]

    monkeypatch.setattr(deepseek.DeepseekModel, "__init__", broken_init)
    assert main(["--arch", "deepseek", "--check", "--quiet", "--num-requests", "1", "--gen-len", "2",
                 "--no-warmup"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("sampling", [
    None, SamplingConfig(SamplingParams(temperature=1.5, top_k=20, top_p=0.95), seed=3)], ids=["greedy", "joint"])
def test_deepseek_overlap_and_sampling(sampling):
    """The overlapped decode loop gives the synchronous path's tokens with the MLA model too (greedy
    and sampled with a fixed seed); with --check, sampled tokens lie in the reference's allowed set."""
    runs = {}
    for overlap in (False, True):
        engine, reqs, stats = _deepseek_run(sampling=sampling, overlap=overlap, max_batch=4)
        assert engine.overlap == overlap and stats.decode_discarded == 0
        runs[overlap] = [r.output for r in reqs]
    assert runs[True] == runs[False]
    if sampling is not None:
        _, _, stats = _deepseek_run(sampling=sampling, max_batch=4)
        assert stats.sampled_outside == 0 and stats.max_rel_diff <= 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_gpu_deepseek_matches_dense_reference(cuda_graph):
    """On the GPU, the gpu preset's MLA shape (16 heads, DeepSeek's 512/64 latent, q_lora 1536,
    bf16; 2 layers): warm-up, per-bucket CUDA graphs re-planned every step (or eager decode), every
    step's logits against the float32 non-absorbed reference, nothing compiled while timed."""
    from tritoninfer.demo.cli import default_tolerance
    from tritoninfer.demo.deepseek import DeepseekModel, MLAConfig, random_mla_weights
    from tritoninfer.demo.reference import MLADenseReference

    cfg = MLAConfig(vocab_size=4096, hidden_size=2048, intermediate_size=5632, num_layers=2, num_heads=16,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    weights = random_mla_weights(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
    model = DeepseekModel(cfg, weights, torch.bfloat16)
    reference = MLADenseReference(cfg, weights, "cuda")
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 400, (24,), generator=g).tolist()
    gens = torch.randint(1, 24, (24,), generator=g).tolist()
    reqs = [Request(i, torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), m)
            for i, (n, m) in enumerate(zip(lens, gens))]
    ecfg = EngineConfig(page_size=16, max_batch=12, max_prefill_tokens=2048, cuda_graph=cuda_graph,
                        attn_sample_every=4)
    torch.set_float32_matmul_precision("highest")
    engine = Engine(model, torch.bfloat16, ecfg, reference, num_pages=12 * 27)
    with KernelVariants() as variants:
        engine.warmup([(r.prompt, r.max_new_tokens) for r in reqs])
        compiled = len(variants)
        stats = engine.run(reqs)
    assert len(variants) == compiled
    assert all(r.done for r in reqs) and stats.generated_tokens == sum(gens)
    assert stats.max_rel_diff <= default_tolerance("bf16", "bf16"), stats.max_rel_diff
    assert engine.cache.allocator.num_free == engine.cache.num_pages
    if cuda_graph:
        assert stats.graphs_captured == len(engine.buckets)
        assert 0 < stats.decode_attn_share < 1


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["gpu", "h200"])
def test_gpu_main_deepseek_presets(preset, tmp_path):
    """``--arch deepseek`` with the gpu (16 heads) and h200 (128 heads) presets' model, a short
    workload: --check passes; then overlapped (the default without --check) and sampled, the
    synchronous path's tokens."""
    out = tmp_path / "ds.md"
    base = ["--arch", "deepseek", "--preset", preset, "--num-requests", "8", "--max-batch", "4",
            "--prompt-len", "64-512", "--gen-len", "8", "--quiet"]
    assert main(base + ["--check", "--out", str(out)]) == 0
    assert "check (bf16 KV)" in out.read_text()
    sampled = ["--sampling", "--temperature", "0.8", "--top-k", "50", "--out", str(out)]
    generated = []
    for extra in ([], ["--no-overlap"]):
        assert main(base + sampled + extra) == 0
        generated.append(re.search(r"request 0 .* generated (.*)", out.read_text()).group(1))
    assert generated[0] == generated[1]
