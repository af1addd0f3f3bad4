"""``tritoninfer bench pod``: a decode batch and one prefill chunk together, same process, same inputs:

- ``tritoninfer-pod``: tritoninfer's ``PODWithPagedKVCacheWrapper`` (one pair launch, or the Gluon prefill
  and the decode half where the route takes the prefill half: ``_route.POD_PREFILL_ON_HOPPER``);
- ``flashinfer-pod``: FlashInfer's ``PODWithPagedKVCacheWrapper``;
- ``tritoninfer-separate``: tritoninfer's decode (``BatchDecodeWithPagedKVCacheWrapper``, tensor cores)
  then prefill (``single_prefill_with_kv_cache``), launched one after the other.

Default: issue 23's shape, 64 decode requests x 4K tokens plus one causal 4K-token prefill chunk, and
the same with a 1K chunk; 32/8 heads, head_dim 128, page 16, bf16. Timing: ``timing.measure`` in
loop mode (events around back-to-back eager calls, median per call): a CUDA graph captured around
FlashInfer 0.5.3's POD ``run()`` replays in 6.8 µs on the H200 (its kernel is not in the graph), so
no provider is timed in a graph. Checks: each implementation's
decode half against ``tritoninfer.reference.batch_decode_with_paged_kv_cache`` and the last
``--check-rows`` rows of its prefill half against ``reference.single_prefill_with_kv_cache`` on
those rows (bottom-right aligned causal: the same mask as the full chunk's), float32.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import groups
from .timing import measure

PROVIDERS = ("tritoninfer-pod", "flashinfer-pod", "tritoninfer-separate")
LABELS = {"tritoninfer-pod": "ours POD", "flashinfer-pod": "FlashInfer POD",
          "tritoninfer-separate": "ours decode + prefill (two launches)"}
# (decode batch, decode kv_len, prefill chunk)
DEFAULT = ((64, 4096, 4096), (64, 4096, 1024))
QUICK = ((64, 4096, 4096),)
CPU_SHAPES = ((3, 20, 12),)


@dataclass
class Row:
    shape: Tuple[int, int, int]
    provider: str
    time_us: Optional[float] = None
    p20_us: Optional[float] = None
    p80_us: Optional[float] = None
    check: str = ""
    note: str = ""


class Inputs:
    def __init__(self, shape, a, device, gpu: bool):
        from .. import testing

        batch, kv_len, n = shape
        self.heads, self.kv_heads = a.heads
        self.head_dim, self.page = a.head_dim, a.page_size
        self.dtype = torch.bfloat16 if gpu else torch.float16
        h, hk, d = self.heads, self.kv_heads, self.head_dim
        g = torch.Generator().manual_seed(a.seed)
        self.kv = testing.make_paged_kv([kv_len] * batch, self.page, hk, d, dtype=self.dtype, device=device,
                                        generator=g)
        self.q_d = testing.randn((batch, h, d), self.dtype, device, g)
        self.q_p, self.k_p, self.v_p = (testing.randn(s, self.dtype, device, g) for s in ((n, h, d), (n, hk, d),
                                                                                        (n, hk, d)))

    def plan_args(self):
        kv = self.kv
        return (kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, self.heads, self.kv_heads, self.head_dim, self.page)

    def check(self, out_p: torch.Tensor, out_d: torch.Tensor, rows: int) -> str:
        from .. import reference, testing

        kv = self.kv
        want_d, _ = reference.batch_decode_with_paged_kv_cache(self.q_d, kv.cache, kv.kv_indptr, kv.kv_indices,
                                                                kv.kv_last_page_len, "NHD")
        rows = min(rows, self.q_p.shape[0])
        want_p = reference.single_prefill_with_kv_cache(self.q_p[-rows:], self.k_p, self.v_p, causal=True)
        tol = testing.tolerance(self.dtype)
        return groups.merge_checks(groups.check_close(out_d, want_d, tol),
                                   groups.check_close(out_p[-rows:], want_p, tol))


def _ours_pod(x: Inputs, ws):
    from ..pod import PODWithPagedKVCacheWrapper

    pod = PODWithPagedKVCacheWrapper(ws, "NHD")
    pod.plan(*x.plan_args(), q_data_type=x.dtype, kv_data_type=x.dtype)
    return lambda i: pod.run(x.q_p, x.k_p, x.v_p, x.q_d, x.kv.cache, causal_p=True)


def _fi_pod(x: Inputs, ws, fi):
    pod = fi.PODWithPagedKVCacheWrapper(ws, "NHD")
    pod.plan(*x.plan_args(), q_data_type=x.dtype, kv_data_type=x.dtype)
    return lambda i: pod.run(x.q_p, x.k_p, x.v_p, x.q_d, x.kv.cache, causal_p=True)


def _ours_separate(x: Inputs, ws):
    from ..decode import BatchDecodeWithPagedKVCacheWrapper
    from ..prefill import single_prefill_with_kv_cache

    decode = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    decode.plan(*x.plan_args(), q_data_type=x.dtype, kv_data_type=x.dtype)

    def run(i):
        out_d = decode.run(x.q_d, x.kv.cache)
        return single_prefill_with_kv_cache(x.q_p, x.k_p, x.v_p, causal=True), out_d

    return run


def bench_shape(shape, a, setup: groups.Setup, fi, fi_status: str, workspaces) -> List[Row]:
    x = Inputs(shape, a, setup.device, setup.gpu)
    rows = []
    for name in a.providers:
        row = Row(shape, name)
        rows.append(row)
        if name == "flashinfer-pod" and fi is None:
            row.check = fi_status
            continue
        try:
            if name == "tritoninfer-pod":
                run = _ours_pod(x, workspaces[0])
            elif name == "flashinfer-pod":
                run = _fi_pod(x, workspaces[1], fi)
            else:
                run = _ours_separate(x, workspaces[0])
            out_p, out_d = run(0)
            row.check = x.check(out_p, out_d, a.check_rows)
            t = measure(run, device=setup.device, mode="loop", ncopies=1, cfg=setup.timing)
        except Exception as exc:  # one implementation's failure is its row's status
            row.check = "ERROR " + groups.error_text(exc)
            continue
        row.note = t.note
        if setup.gpu:
            row.time_us, row.p20_us, row.p80_us = t.time_us, t.p20_us, t.p80_us
    del x
    if setup.gpu:
        torch.cuda.empty_cache()
    return rows


def table(rows: List[Row]) -> str:
    by_shape: Dict[tuple, Dict[str, Row]] = {}
    for r in rows:
        by_shape.setdefault(r.shape, {})[r.provider] = r
    out = []
    for shape, got in by_shape.items():
        ours = got.get("tritoninfer-pod")
        for name, r in got.items():
            spread = f"{r.p20_us:.1f}–{r.p80_us:.1f}" if r.time_us else ""
            out.append([*map(str, shape), LABELS[name], groups.fmt(r.time_us), spread,
                        groups.ratio(r.time_us, ours.time_us if ours else None) if name != "tritoninfer-pod" else "",
                        r.check + (f"; {r.note}" if r.note else "")])
    head = ["decode batch", "decode kv", "prefill chunk", "implementation", "µs", "p20–p80", "this/ours POD",
            "check"]
    return groups.markdown_table(out, head)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from .cli import heads_list, positive_int

    p = groups.parser("pod", __doc__, "only issue 23's shape: 64 x 4K decode + a 4K prefill chunk")
    p.add_argument("--decode-batch", type=groups.int_list("a batch size"), help="decode requests (default 64)")
    p.add_argument("--decode-len", type=groups.int_list("a KV length"),
                   help="KV tokens per decode request (default 4K)")
    p.add_argument("--prefill-len", type=groups.int_list("a chunk length"),
                   help="tokens of the causal prefill chunk (default 4K,1K)")
    p.add_argument("--heads", type=lambda t: heads_list(t)[0], default=None, metavar="QO/KV", help="default 32/8")
    p.add_argument("--head-dim", type=positive_int, default=None, help="default 128")
    p.add_argument("--page-size", type=positive_int, default=None, help="default 16")
    p.add_argument("--providers", type=groups.name_list(PROVIDERS, "implementation"), default=list(PROVIDERS),
                   help=f"any of {', '.join(PROVIDERS)} (comma-separated)")
    p.add_argument("--check-rows", type=positive_int, default=256,
                   help="last prefill rows checked against the reference (default 256)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """Runs the POD group; returns 1 when a tritoninfer output failed its check, else 0."""
    a = parse_args(argv)
    setup = groups.start("pod", argv, a)
    gpu = setup.gpu
    a.heads = a.heads or ((32, 8) if gpu else (4, 2))
    a.head_dim = a.head_dim or (128 if gpu else 16)
    a.page_size = a.page_size or (16 if gpu else 4)
    if a.decode_batch or a.decode_len or a.prefill_len:
        shapes = list(itertools.product(a.decode_batch or (64,), a.decode_len or (4096,),
                                        a.prefill_len or (4096, 1024)))
    else:
        shapes = list(CPU_SHAPES if not gpu else (QUICK if a.quick else DEFAULT))
    fi, why = groups.peer_flashinfer("pod")
    workspaces = [torch.empty((256 << 20) if gpu else (8 << 20), dtype=torch.uint8, device=setup.device)
                  for _ in range(2)]
    rows: List[Row] = []
    for shape in shapes:
        rows += bench_shape(shape, a, setup, fi, why, workspaces)
        groups.progress(f"pod {shape}: " + ", ".join(f"{r.provider} {groups.fmt(r.time_us) or r.check}"
                                                     for r in rows[-len(a.providers):]))
    tail = [groups.at_least_as_fast(rows, PROVIDERS[0], peer, f"shapes where our POD is at least as fast as "
                                    f"{LABELS[peer]}") for peer in PROVIDERS[1:]] if gpu else []
    h, hk = a.heads
    head = groups.header(setup, "POD (decode batch + prefill chunk)", [
        f"heads {h}/{hk}, head_dim {a.head_dim}, page {a.page_size}, {'bf16' if gpu else 'fp16'}, NHD; the "
        "prefill chunk is causal over its own keys; decode requests have equal lengths, shuffled pages.",
        "µs: median per call over back-to-back eager calls timed with events (p20–p80 beside it; no graphs: "
        "FlashInfer's POD kernel escapes a capture); this/ours POD > 1: our POD faster.",
        f"check: decode half against the float32 reference, prefill half on its last {a.check_rows} rows."])
    groups.finish(setup, a.out, head, table(rows), tail)
    return 1 if any(groups.failed(r.check) for r in rows if r.provider.startswith("tritoninfer")) else 0
