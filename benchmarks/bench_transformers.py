"""Hugging Face transformers with ``attn_implementation="tritoninfer"`` against its built-in attention
implementations, same process, same random weights (GPU benchmark; not run in CI).

Model: a Llama-3-8B-shaped ``LlamaForCausalLM`` (hidden 4096, 32/8 heads, head_dim 128, MLP 14336,
vocab 128256) with ``--layers`` layers (default 4) and random bf16 weights: the attention shapes
are 8B's, the layer count keeps load time and memory small; attention's share of the time grows
with context length, not with the layer count.

Measured, per implementation (``tritoninfer``, ``sdpa``, and ``flash_attention_2`` /
``flash_attention_3`` / ``kernels-community/flash-attn2`` when they load):

- ``prefill``: latency of one forward over a batch of prompts (CUDA events around
  ``model(ids, attention_mask=...)``, median of ``--repeats``);
- ``generate``: ``model.generate`` of ``--new-tokens`` greedy tokens at batch 1 and 16 (prompt
  ``--prompt-len``, left-padded batches of lengths in [prompt/2, prompt]): generated tokens/s;
- ``generate_batch``: continuous batching of ``--requests`` prompts of lengths in
  [``--cb-min``, ``--cb-max``] (default 64 requests of 512-4096 tokens, 128 new tokens each):
  generated tokens/s end to end (the issue's headline number).

Attention share: ``--profile`` runs one more ``generate_batch`` per implementation under
``torch.profiler`` and reports the fraction of CUDA time spent in attention kernels (tritoninfer's
``attention_fwd_kernel`` / Gluon prefill, SDPA's and flash's kernels).

    python benchmarks/bench_transformers.py                 # everything, defaults above
    python benchmarks/bench_transformers.py --only generate --impls tritoninfer,sdpa
    python benchmarks/bench_transformers.py --out benchmarks/results/h200-transformers.md

Every table row names the GPU, torch, transformers and tritoninfer versions; nothing is written
without ``--out``. Greedy tokens of each implementation are compared with the first one's
(``tokens agree``), a sanity check, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import statistics
import sys
import time


def _model(layers: int, impl: str, dtype, device):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=16384,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
    return model.eval()


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in lens]


def _cuda_ms(fn, repeats: int) -> float:
    import torch

    fn()  # warm-up: compiles kernel variants, allocates
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class _HostTimer:
    """Host seconds spent inside the attention function transformers calls (wall clock around each
    call, the GPU work it queues not waited for): how much of a step is attention's host path."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def note(self, runs: int = 1) -> str:
        if not self.calls:
            return ""
        return (f"attention host {self.seconds / runs * 1e3:,.1f} ms per run, "
                f"{self.seconds / self.calls * 1e6:,.0f} µs per call ({self.calls // runs} calls)")


@contextlib.contextmanager
def _attention_host_time(impl: str):
    """Times transformers' registered attention function for ``impl`` while the block runs."""
    from transformers import AttentionInterface

    timer = _HostTimer()
    mapping = AttentionInterface._global_mapping
    original = mapping.get(impl)
    if original is None:
        yield timer
        return

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1

    mapping[impl] = timed
    try:
        yield timer
    finally:
        mapping[impl] = original


_ATTN_KERNEL_NAMES = ("attention_fwd", "prefill_hopper", "flash", "fmha", "sdpa", "scaled_dot_product", "attention")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="tritoninfer,sdpa,flash_attention_2,flash_attention_3,kernels-community/flash-attn2")
    p.add_argument("--only", choices=["prefill", "generate", "generate_batch"], action="append")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--cb-min", type=int, default=512)
    p.add_argument("--cb-max", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import torch
    import transformers

    import tritoninfer
    import tritoninfer.integrations.transformers  # noqa: F401  registers "tritoninfer"
    from tritoninfer.demo.hf_transformers import left_pad

    if not torch.cuda.is_available():
        print("bench_transformers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device, dtype = "cuda", torch.bfloat16
    parts = args.only or ["prefill", "generate", "generate_batch"]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    first_tokens = {}

    def emit(*row):
        # printed as it is measured: a run cut by a time limit keeps what it measured
        rows.append(row)
        print("| " + " | ".join(row) + " |", flush=True)

    for impl in args.impls.split(","):
        try:
            model = _model(args.layers, impl, dtype, device)
        except Exception as exc:  # an implementation that is not installed is skipped, not failed
            print(f"{impl}: skipped ({type(exc).__name__}: {exc})".splitlines()[0], file=sys.stderr)
            continue
        vocab = model.config.vocab_size
        with torch.no_grad():
            if "prefill" in parts:
                for b in batches:
                    prompts = _prompts(b, args.prompt_len // 2, args.prompt_len, vocab, seed=b)
                    ids, mask = left_pad(prompts, device)
                    with _attention_host_time(impl) as host:
                        ms = _cuda_ms(lambda: model(ids, attention_mask=mask, logits_to_keep=1), args.repeats)
                    emit(impl, "prefill", f"batch {b} x <= {args.prompt_len}", f"{ms:.2f} ms",
                         f"{int(mask.sum()) / ms * 1e3:,.0f} prompt tok/s", host.note(args.repeats + 1))
            if "generate" in parts:
                for b in batches:
                    prompts = _prompts(b, args.prompt_len // 2, args.prompt_len, vocab, seed=100 + b)
                    ids, mask = left_pad(prompts, device)
                    kw = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=0)
                    model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
                    out = None

                    def run():
                        nonlocal out
                        out = model.generate(ids, **kw)

                    secs = _wall(run)
                    tokens = out[:, ids.shape[1]:]
                    key = ("generate", b)
                    agree = ""
                    if key in first_tokens:
                        agree = f"tokens agree {float((tokens == first_tokens[key]).float().mean()):.0%}"
                    else:
                        first_tokens[key] = tokens
                    emit(impl, "generate", f"batch {b}, prompt <= {args.prompt_len}, {args.new_tokens} new",
                                 f"{secs:.2f} s", f"{tokens.numel() / secs:,.1f} tok/s", agree)
            if "generate_batch" in parts:
                prompts = _prompts(args.requests, args.cb_min, args.cb_max, vocab, seed=7)
                gen = transformers.GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                                                    pad_token_id=0)
                try:
                    # warm-up with the whole workload: every kernel variant its steps need is compiled
                    # before the timed run (a short warm-up left compiles inside it); its time is the
                    # first run's, compilation included, reported as such
                    what = f"{args.requests} requests, prompts {args.cb_min}-{args.cb_max}, {args.new_tokens} new"
                    cold = _wall(lambda: model.generate_batch(prompts, generation_config=gen))
                    emit(impl, "generate_batch, first run (compiles included)", what, f"{cold:.2f} s", "", "")
                    result = None

                    def run_cb():
                        nonlocal result
                        result = model.generate_batch(prompts, generation_config=gen)

                    with _attention_host_time(impl) as host:
                        secs = _wall(run_cb)
                    generated = sum(len(r.generated_tokens) for r in result.values())
                    emit(impl, "generate_batch", what, f"{secs:.2f} s", f"{generated / secs:,.1f} tok/s", host.note())
                    if args.profile:
                        from torch.profiler import ProfilerActivity, profile

                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            model.generate_batch(prompts, generation_config=gen)
                        total = attn = 0.0
                        for ev in prof.key_averages():
                            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                            total += t
                            if any(n in ev.key.lower() for n in _ATTN_KERNEL_NAMES):
                                attn += t
                        if total:
                            emit(impl, "generate_batch, profiled", what, f"{total / 1e6:.2f} s of CUDA time", "",
                                 f"attention {attn / total:.0%} of CUDA time")
                except Exception as exc:
                    emit(impl, "generate_batch", "", "failed", f"{type(exc).__name__}: {exc}"[:80], "")
        model = None  # free the weights before the next implementation loads
        torch.cuda.empty_cache()

    header = (f"# transformers attention implementations ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}, tritoninfer {tritoninfer.__version__}, "
              f"{datetime.date.today()}, Llama-3-8B shapes, {args.layers} layers, bf16)\n")
    table = ["| implementation | what | shape | time | throughput | notes |", "|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    text = header + "\n" + "\n".join(table) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
