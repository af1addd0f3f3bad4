"""``tritoninfer bench sampling``: the sampling functions against FlashInfer's and the plain PyTorch
way (``torch.sort`` + ``cumsum`` + ``multinomial``, or ``topk`` where that is the plain way), on the
same probabilities in the same process.

Every function reads its ``[batch, vocab]`` float32 input at least once, so the table gives each
time as TB/s over those bytes (plus the output it writes, for the functions that return a
distribution) next to the device copy bandwidth measured in the run. Sampled tokens are checked to
lie in the set the function allows (computed with torch from the same input); the functions that
return a tensor are compared with the PyTorch way. Timing: ``timing.measure`` (CUDA-graph replays,
falling back to eager events when a provider cannot be captured; the note says so). Without a GPU,
tiny shapes run through the Triton interpreter: the checks mean something, the times do not.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .timing import TimingConfig, kernel_device_us, measure

TOP_K, TOP_P, MIN_P = 50, 0.9, 0.05
LOGIT_SCALE = 3.0  # the sessions' measurements so far (flat rows: top-p 0.9 keeps ~5K of 128K)
FUNCTIONS = (
    "top_k_top_p_sampling_from_probs", "top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs",
    "top_k_sampling_from_probs", "min_p_sampling_from_probs", "sampling_from_probs", "sampling_from_logits",
    "top_k_renorm_probs", "top_p_renorm_probs", "top_k_mask_logits", "softmax",
)
JOINT = FUNCTIONS[:2]
# the headline functions, and top_p_renorm_probs (flat rows take its 8 radix passes: the
# slowest function in session 11's profile)
QUICK = ("top_k_top_p_sampling_from_probs", "top_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs",
         "sampling_from_probs")
PROVIDERS = ("tritoninfer", "flashinfer", "torch")
BATCHES, VOCABS = (1, 64, 256, 1024), (32000, 128256, 151936, 262144)


# ---- the plain PyTorch way --------------------------------------------------------------------


def _top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Kept entries of top-p: those whose mass above them (in descending order) is below ``p``."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    above = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = above < p
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def _top_k_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.topk(x, k, dim=-1).values[:, -1:]
    return x >= kth


def _sample(probs: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    if keep is not None:
        probs = probs * keep
    return torch.multinomial(probs, 1).squeeze(-1).to(torch.int32)


def torch_way(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The plain PyTorch version of ``name`` (input: probabilities, or logits for the logits functions)."""
    return {
        "top_k_top_p_sampling_from_probs": lambda x: _sample(x, _top_k_mask(x, TOP_K) & _top_p_mask(x, TOP_P)),
        "top_k_top_p_sampling_from_logits": lambda x: _joint_logits(x),
        "top_p_sampling_from_probs": lambda x: _sample(x, _top_p_mask(x, TOP_P)),
        "top_k_sampling_from_probs": lambda x: _sample(x, _top_k_mask(x, TOP_K)),
        "min_p_sampling_from_probs": lambda x: _sample(x, x >= MIN_P * x.amax(-1, keepdim=True)),
        "sampling_from_probs": lambda x: _sample(x),
        "sampling_from_logits": lambda x: _sample(torch.softmax(x, -1)),
        "top_k_renorm_probs": lambda x: _renorm(x, _top_k_mask(x, TOP_K)),
        "top_p_renorm_probs": lambda x: _renorm(x, _top_p_mask(x, TOP_P)),
        "top_k_mask_logits": lambda x: x.masked_fill(~_top_k_mask(x, TOP_K), float("-inf")),
        "softmax": lambda x: torch.softmax(x, -1),
    }[name]


def _joint_logits(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, -1)
    return _sample(probs, _top_k_mask(probs, TOP_K) & _top_p_mask(probs, TOP_P))


def _renorm(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = x * keep
    return kept / kept.sum(-1, keepdim=True)


def allowed(name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
    """[batch, vocab] bool: the tokens ``name`` may sample from input ``x`` (None: not a sampler)."""
    if name.endswith("logits") and "sampling" in name:
        x = torch.softmax(x, -1)
    if name.startswith("top_k_top_p_sampling"):
        return _top_k_mask(x, TOP_K) & _top_p_mask(x, TOP_P)
    if name == "top_p_sampling_from_probs":
        return _top_p_mask(x, TOP_P)
    if name == "top_k_sampling_from_probs":
        return _top_k_mask(x, TOP_K)
    if name == "min_p_sampling_from_probs":
        return x >= MIN_P * x.amax(-1, keepdim=True)
    if name in ("sampling_from_probs", "sampling_from_logits"):
        return x > 0
    return None


def library_call(lib, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``name`` of the FlashInfer API module ``lib.sampling`` with the benchmark's parameters."""
    fn = getattr(lib.sampling, name)
    if name.startswith("top_k_top_p"):
        return lambda x: fn(x, TOP_K, TOP_P)
    if name in ("top_p_sampling_from_probs", "top_p_renorm_probs"):
        return lambda x: fn(x, TOP_P)
    if name in ("top_k_sampling_from_probs", "top_k_renorm_probs", "top_k_mask_logits"):
        return lambda x: fn(x, TOP_K)
    if name == "min_p_sampling_from_probs":
        return lambda x: fn(x, MIN_P)
    if name == "softmax":
        return lambda x: fn(x, temperature=1.0)
    return fn


# ---- the sweep ---------------------------------------------------------------------------------


@dataclass
class Row:
    function: str
    batch: int
    vocab: int
    provider: str
    time_us: Optional[float] = None
    tb_s: Optional[float] = None
    host_us: Optional[float] = None  # host time of one eager call (launches included): engines sample eagerly
    # the kernels' device time of one call (torch.profiler), for both providers: the one method that
    # times FlashInfer's uncapturable calls, so the like-for-like ratio (launch gaps left out on both sides)
    kernels_us: Optional[float] = None
    check: str = ""
    note: str = ""


def bytes_moved(name: str, batch: int, vocab: int) -> int:
    """The input read once, plus a float32 output of the same size for the distribution-returning
    functions (samplers write one int32 per row: counted, though negligible)."""
    n = batch * vocab * 4
    return n + (batch * 4 if "sampling" in name else n)


def make_input(name: str, batch: int, vocab: int, device: torch.device, copies: int,
               logit_scale: float = LOGIT_SCALE) -> List[torch.Tensor]:
    """``copies`` inputs of one shape (rotated through so the timed calls do not all hit L2): logits
    ``randn * logit_scale``. At 128K entries top-p 0.9 keeps ~5,000-6,000 tokens at scale 3 (flat),
    ~500-650 at 4, ~10-100 at 5 (peakier, as next-token distributions often are), counted with torch."""
    out = []
    for _ in range(copies):
        logits = torch.randn(batch, vocab, device=device) * logit_scale
        out.append(logits if name.endswith("logits") else torch.softmax(logits, -1))
    return out


def _check(name: str, x: torch.Tensor, got: torch.Tensor, want: Callable[[torch.Tensor], torch.Tensor]) -> str:
    keep = allowed(name, x)
    if keep is not None:
        ids = got.long()
        if ids.shape != (x.shape[0],) or bool(((ids < 0) | (ids >= x.shape[1])).any()):
            return "bad ids"
        inside = keep.gather(1, ids[:, None]).float().mean().item()
        return "ok" if inside == 1.0 else f"{inside:.3f} in set"
    ref = want(x)
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(got)):
        return "mask differs"
    err = ((got[finite] - ref[finite]).abs().max() / ref[finite].abs().max().clamp_min(1e-30)).item()
    return "ok" if err <= 1e-4 else f"rel err {err:.1e}"


def run_sweep(functions: Sequence[str], batches: Sequence[int], vocabs: Sequence[int], providers: Sequence[str],
              timing: TimingConfig, device: torch.device, progress: Callable[[str], None] = print,
              logit_scale: float = LOGIT_SCALE) -> List[Row]:
    libs: Dict[str, object] = {}
    for p in providers:
        if p == "torch":
            continue
        try:
            libs[p] = importlib.import_module(p)
        except Exception as exc:  # an absent peer is a row status, not a failure
            progress(f"{p}: not installed ({type(exc).__name__})")
    rows: List[Row] = []
    gpu = device.type == "cuda"
    copies = 4 if gpu else 1
    for name in functions:
        want = torch_way(name)
        for batch in batches:
            for vocab in vocabs:
                xs = make_input(name, batch, vocab, device, copies, logit_scale)
                nbytes = bytes_moved(name, batch, vocab)
                for p in providers:
                    row = Row(name, batch, vocab, p)
                    rows.append(row)
                    if p != "torch" and p not in libs:
                        row.check = "not installed"
                        continue
                    call = want if p == "torch" else library_call(libs[p], name)
                    try:
                        row.check = _check(name, xs[0], call(xs[0]), want) if p != "torch" else "peer"
                        t = measure(lambda i, xs=xs: call(xs[i]), device=device, mode="graph", ncopies=copies,
                                    cfg=timing)
                    except Exception as exc:  # one provider's failure is its row's, the sweep goes on
                        row.check = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                        continue
                    row.note = t.note
                    if gpu and p != "torch":
                        row.kernels_us = kernel_device_us(lambda: call(xs[0]))
                    if gpu and t.time_us and t.method.startswith("eager loop"):
                        # an eager loop's time is the host's whenever a call's host time exceeds its
                        # device time (FlashInfer's calls without a generator make one per call,
                        # which capture refuses): its kernels' device time instead
                        t.time_us = row.kernels_us
                        row.note += "; time: the kernels' device time (torch.profiler), not an eager loop"
                    if gpu and t.time_us:
                        row.time_us = t.time_us
                        row.tb_s = nbytes / (t.time_us * 1e-6) / 1e12
                        row.host_us = t.eager_host_us
                progress(f"{name} {batch}x{vocab}: " + ", ".join(
                    f"{r.provider} {r.time_us:.1f} us" if r.time_us else f"{r.provider} {r.check}"
                    for r in rows[-len(providers):]))
                del xs
    return rows


def notes(rows: List[Row]) -> str:
    """One line per row whose timing or check needs a word (capture failures and their fallback)."""
    lines = [f"- {r.function} {r.batch} × {r.vocab}, {r.provider}: {r.note}" for r in rows if r.note]
    return "\n".join(["", "Notes:", *lines]) if lines else ""


def table(rows: List[Row], copy_tb_s: Optional[float]) -> str:
    """Markdown: one line per (function, batch, vocab); each provider's µs, our TB/s and the ratios
    (peer time / ours: > 1 means tritoninfer is faster)."""
    from tabulate import tabulate

    by_key: Dict[tuple, Dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.function, r.batch, r.vocab), {})[r.provider] = r
    lines = []
    for (fn, b, v), got in by_key.items():
        ours = got.get("tritoninfer")
        line = [fn, b, v]
        for p in PROVIDERS:
            r = got.get(p)
            line.append(f"{r.time_us:.1f}" if r and r.time_us else (r.check if r else ""))
        line.append(f"{ours.tb_s:.2f}" if ours and ours.tb_s else "")
        line.append(f"{ours.tb_s / copy_tb_s:.0%}" if ours and ours.tb_s and copy_tb_s else "")
        for p in ("flashinfer", "torch"):
            r = got.get(p)
            ok = ours and ours.time_us and r and r.time_us
            line.append(f"{r.time_us / ours.time_us:.2f}" if ok else "")
        fi = got.get("flashinfer")
        line.append(f"{ours.kernels_us:.1f}" if ours and ours.kernels_us else "")
        ok = ours and ours.kernels_us and fi and fi.kernels_us
        line.append(f"{fi.kernels_us / ours.kernels_us:.2f}" if ok else "")
        for p in ("tritoninfer", "flashinfer"):
            r = got.get(p)
            line.append(f"{r.host_us:.0f}" if r and r.host_us else "")
        line.append(ours.check if ours else "")
        lines.append(line)
    head = ["function", "batch", "vocab", "ours µs", "FlashInfer µs", "torch µs", "ours TB/s", "of copy",
            "FI/ours", "torch/ours", "ours kernels µs", "FI/ours kernels", "ours eager host µs", "FI eager host µs",
            "check"]
    return tabulate(lines, headers=head, tablefmt="github")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from .groups import int_list, parser

    p = parser("sampling", __doc__, f"only {', '.join(QUICK)} at batch 1/64/256 × vocab 128,256/151,936",
               replays=20, calls_per_graph=5)
    p.add_argument("--functions", type=lambda t: t.split(","), help=f"any of {', '.join(FUNCTIONS)}")
    p.add_argument("--batch", type=int_list("a batch size"), help="default 1,64,256,1024")
    p.add_argument("--vocab", type=int_list("a vocabulary size"), help="default 32000,128256,151936,262144")
    p.add_argument("--providers", type=lambda t: t.split(","), default=list(PROVIDERS))
    p.add_argument("--logit-scale", type=float, default=LOGIT_SCALE,
                   help="inputs are softmax(randn * this): 3 flat rows (top-p 0.9 keeps ~5K of 128K), 5 peaky (~10-100)")
    a = p.parse_args(list(argv))
    bad = [f for f in (a.functions or []) if f not in FUNCTIONS]
    if bad:
        p.error(f"argument --functions: unknown {', '.join(bad)} (expected any of {', '.join(FUNCTIONS)})")
    bad = [x for x in a.providers if x not in PROVIDERS]
    if bad:
        p.error(f"argument --providers: unknown {', '.join(bad)} (expected any of {', '.join(PROVIDERS)})")
    return a


def main(argv: Sequence[str]) -> int:
    """Runs the sampling group; returns 1 when a tritoninfer row failed its check, else 0."""
    from . import groups

    a = parse_args(argv)
    setup = groups.start("sampling", argv, a)
    functions = a.functions or (QUICK if a.quick else FUNCTIONS)
    if setup.gpu:
        batches = a.batch or ((1, 64, 256) if a.quick else BATCHES)
        vocabs = a.vocab or ((128256, 151936) if a.quick else VOCABS)
    else:
        batches, vocabs = a.batch or (3,), a.vocab or (1000,)
    rows = run_sweep(functions, batches, vocabs, a.providers, setup.timing, setup.device, progress=groups.progress,
                     logit_scale=a.logit_scale)
    head = groups.header(setup, "sampling functions", [
        f"top_k={TOP_K}, top_p={TOP_P}, min_p={MIN_P}; float32 input, softmax(randn * {a.logit_scale:g}) (logits: "
        "randn * scale); times: CUDA-graph replays (timing.measure); a call that cannot be captured "
        "(FlashInfer's without a generator) is timed by its kernels' device time (torch.profiler; see the notes).",
        "TB/s: the input read once plus the output for the distribution-returning functions; "
        "\"of copy\": against the copy bandwidth above.",
        "Ratios are peer time / ours (> 1: tritoninfer faster). \"kernels\": each call's kernels' device time "
        "(torch.profiler, launch gaps left out), measured the same way for both; FI/ours compares our graph "
        "replays with FlashInfer's kernel time wherever its call cannot be captured (in FlashInfer's favour)."])
    groups.finish(setup, a.out, head, table(rows, setup.copy_tb_s) + notes(rows))
    failed = [r for r in rows if r.provider == "tritoninfer" and r.check != "ok"]
    return 1 if failed else 0
