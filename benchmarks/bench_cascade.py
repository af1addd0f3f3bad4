"""Benchmark cascade decode (a long prefix shared by the whole batch) against plain batch decode.

Per shape (batch B, shared prefix S tokens, unique suffix U tokens per request, one query per
request), on one paged KV cache whose pages are in random order:

- ``tritoninfer-cascade``: ``tritoninfer.MultiLevelCascadeAttentionWrapper`` with 2 levels (level 0:
  the prefix's pages, one request holding all B queries; level 1: each request's own pages);
- ``tritoninfer-shared``: the legacy ``BatchDecodeWithSharedPrefixPagedKVCacheWrapper`` (prefix as
  contiguous K/V tensors, gathered once from the same pages);
- ``tritoninfer-plain``: the baseline, ``tritoninfer.BatchDecodeWithPagedKVCacheWrapper`` over the
  same pages with the prefix's pages repeated in every request's page list (``S + U`` tokens each);
- ``flashinfer-cascade`` / ``flashinfer-plain``: FlashInfer's ``MultiLevelCascadeAttentionWrapper``
  and ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`` on the same inputs, when
  ``flashinfer`` is importable (skipped, not failed, when it is not).

Timing: ``--calls-per-graph`` back-to-back calls captured in one CUDA graph, each of ``--replays``
replays timed with CUDA events, median per call (eager event timing if capture fails; the table
says which), via ``tritoninfer.bench.timing.measure``. ``plan()`` is timed on the host separately.

L2: with the default 32K prefix the prefix alone is 32768 x 8 heads x 128 x 2 (K,V) x 2 B = 128 MiB,
more than the H200's 60 MiB L2, so no call finds it in L2 left by the previous call. Smaller
shapes rotate among several copies of the cache so that the calls of one graph touch > 3x L2
between two uses of a copy. Within one call, though, the plain decode's programs for different
requests read the same prefix pages at about the same time, so part of its logical traffic
(``B x (S+U)`` tokens) is served by L2: that is the real baseline an engine gets, and its
"per-request TB/s" column can then exceed HBM bandwidth. The "min TB/s" column counts every page
once (prefix once + suffixes + q + o): the bytes an ideal cascade must move.

Correctness: every provider's first output is compared with the float32 reference (attention of
each query over its prefix + suffix K/V, ``tritoninfer.reference.attention``) with the bf16
tolerance; a mismatch is flagged in the table and makes the exit status 1.

Issue target: cascade >= 10x faster than plain batch decode at B=64, S=32K, U=128 (32/8 heads,
head_dim 128, page 16, bf16).

    python benchmarks/bench_cascade.py --out benchmarks/results/cascade-h200.md
    python benchmarks/bench_cascade.py --smoke    # tiny shapes, CPU through the Triton interpreter
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys


def _int_list(text: str):
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        mult = 1024 if item.endswith("K") else 1
        out.append(int(item[:-1] if item.endswith("K") else item) * mult)
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive ints (K suffix allowed), got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--batch", type=_int_list, default=[16, 64], help="requests, comma-separated (default 16,64)")
    p.add_argument("--shared-len", type=_int_list, default=[4096, 32768], help="shared prefix tokens (default 4K,32K)")
    p.add_argument("--unique-len", type=_int_list, default=[128], help="unique suffix tokens per request (default 128)")
    p.add_argument("--heads", default="32/8", help="query/KV heads (default 32/8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layout", default="NHD", choices=["NHD", "HND"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--calls-per-graph", type=int, default=10)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-check", action="store_true", help="skip the float32 reference check")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter: checks the script, measures nothing")
    args = p.parse_args(argv)
    try:
        hq, hk = (int(x) for x in args.heads.split("/"))
        assert hq > 0 and hk > 0 and hq % hk == 0
    except (ValueError, AssertionError):
        p.error(f"--heads: expected Hq/Hkv with Hq a multiple of Hkv, got {args.heads!r}")
    args.num_qo_heads, args.num_kv_heads = hq, hk
    if args.smoke:
        args.batch, args.shared_len, args.unique_len = [3], [16, 40], [5]
        args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size = 4, 2, 32, 4
    bad = [s for s in args.shared_len if s % args.page_size]
    if bad:
        p.error(f"--shared-len: {bad} not a multiple of the page size {args.page_size} (the plain baseline "
                "repeats the prefix's pages in every request's page list, so they must be full)")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import torch  # noqa: E402

import tritoninfer  # noqa: E402
from tritoninfer import reference, testing  # noqa: E402
from tritoninfer.bench.timing import TimingConfig, measure  # noqa: E402

try:  # optional peer
    import flashinfer  # noqa: E402
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None


class Inputs:
    """One shape's tensors: the paged cache (and copies), page tables, queries, shared K/V."""

    def __init__(self, args, batch, shared_len, unique_len, device, copies):
        g = torch.Generator(device=device).manual_seed(batch * 7919 + shared_len + unique_len)
        ps, hk, d = args.page_size, args.num_kv_heads, args.head_dim
        dtype = getattr(torch, args.dtype)
        self.batch, self.shared_len, self.unique_len = batch, shared_len, unique_len
        self.dtype, self.layout, self.device = dtype, args.layout, device
        n_shared, n_unique = shared_len // ps, -(-unique_len // ps)
        num_pages = n_shared + batch * n_unique + 8
        inner = (ps, hk) if args.layout == "NHD" else (hk, ps)
        cache = torch.randn((num_pages, 2) + inner + (d,), generator=g, device=device, dtype=torch.float32).to(dtype)
        self.caches = [cache] + [cache.clone() for _ in range(copies - 1)]
        self.qs = [torch.randn((batch, args.num_qo_heads, d), generator=g, device=device).to(dtype)
                   for _ in range(copies)]
        perm = torch.randperm(num_pages, generator=g, device=device).to(torch.int32)
        shared, unique = perm[:n_shared], perm[n_shared:n_shared + batch * n_unique].view(batch, n_unique)
        i32 = dict(dtype=torch.int32)
        last_unique = unique_len - (n_unique - 1) * ps
        # level 0: the prefix, one request holding every query; level 1: each request's suffix
        self.qo_levels = [torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)]
        self.indptr_levels = [torch.tensor([0, n_shared], **i32), torch.arange(batch + 1, **i32) * n_unique]
        self.indices_levels = [shared.contiguous(), unique.reshape(-1).contiguous()]
        self.last_levels = [torch.tensor([ps], **i32), torch.full((batch,), last_unique, **i32)]
        # plain decode: the prefix's pages repeated in every request's page list
        self.flat_indptr = torch.arange(batch + 1, **i32) * (n_shared + n_unique)
        self.flat_indices = torch.cat([shared.view(1, -1).expand(batch, -1), unique], 1).reshape(-1).contiguous()
        self.flat_last = self.last_levels[1]
        # the prefix as contiguous K/V (legacy wrapper), gathered from its pages
        k, v = self.dense(cache, shared.long(), shared_len)
        self.k_shared, self.v_shared = (k, v) if args.layout == "NHD" else (k.transpose(0, 1).contiguous(),
                                                                           v.transpose(0, 1).contiguous())
        self.unique = unique

    def dense(self, cache, pages, length):
        """``[length, H_kv, D]`` K and V of ``pages`` (NHD whatever the layout)."""
        k, v = cache[pages, 0], cache[pages, 1]  # [n, ps, H, D] or [n, H, ps, D]
        if self.layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return (k.reshape(-1, *k.shape[2:])[:length].contiguous(), v.reshape(-1, *v.shape[2:])[:length].contiguous())

    def reference_output(self):
        """Float32 attention of each query over prefix + its suffix (cache copy 0, q copy 0)."""
        cache, q = self.caches[0], self.qs[0]
        k_s, v_s = self.dense(cache, self.indices_levels[0].long(), self.shared_len)
        outs = []
        for b in range(self.batch):
            k_u, v_u = self.dense(cache, self.unique[b].long(), self.unique_len)
            o, _ = reference.attention(q[b:b + 1], torch.cat([k_s, k_u]), torch.cat([v_s, v_u]))
            outs.append(o)
        return torch.cat(outs)


def _workspace(device):
    return torch.zeros(256 << 20, dtype=torch.uint8, device=device)


def setup_provider(name, lib, x: Inputs, args):
    """-> (plan(), run(i), impl text); raises ``RuntimeError('not installed')`` for a missing peer."""
    if lib is None:
        raise RuntimeError("not installed")
    hq, hk, d, ps = args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size
    dt = dict(q_data_type=x.dtype, kv_data_type=x.dtype)
    if name.endswith("-cascade"):
        w = lib.MultiLevelCascadeAttentionWrapper(2, _workspace(x.device), x.layout)

        def plan():
            w.plan(x.qo_levels, x.indptr_levels, [t.to(x.device) for t in x.indices_levels], x.last_levels,
                   hq, hk, d, ps, **dt)

        impl = "MultiLevelCascadeAttentionWrapper, 2 levels"
    elif name.endswith("-plain"):
        kw = {"use_tensor_cores": True} if lib is not tritoninfer else {}
        w = lib.BatchDecodeWithPagedKVCacheWrapper(_workspace(x.device), x.layout, **kw)
        indices = x.flat_indices.to(x.device)

        def plan():
            w.plan(x.flat_indptr, indices, x.flat_last, hq, hk, d, ps, **dt)

        impl = "BatchDecodeWithPagedKVCacheWrapper over full page lists" + (", use_tensor_cores=True" if kw else "")
    elif name.endswith("-shared"):
        w = lib.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_workspace(x.device), x.layout)
        indices = x.indices_levels[1].to(x.device)

        def plan():
            w.begin_forward(x.indptr_levels[1], indices, x.last_levels[1], hq, hk, d, ps, data_type=x.dtype)

        plan()

        def run(i):
            return w.forward(x.qs[i], x.k_shared, x.v_shared, x.caches[i])

        return plan, run, "BatchDecodeWithSharedPrefixPagedKVCacheWrapper (legacy, prefix as contiguous K/V)"
    else:
        raise ValueError(name)
    plan()

    def run(i):
        return w.run(x.qs[i], x.caches[i])

    return plan, run, impl


PROVIDERS = [
    ("tritoninfer-cascade", "tritoninfer"),
    ("tritoninfer-shared", "tritoninfer"),
    ("tritoninfer-plain", "tritoninfer"),
    ("flashinfer-cascade", "flashinfer"),
    ("flashinfer-plain", "flashinfer"),
]


def bytes_min(batch: int, shared_len: int, unique_len: int, dtype: torch.dtype, args) -> int:
    """Every page once: the prefix once, each suffix (whole pages), q and o."""
    per_token = args.num_kv_heads * args.head_dim * 2 * dtype.itemsize
    ps = args.page_size
    kv = (shared_len + batch * (-(-unique_len // ps)) * ps) * per_token
    return kv + 2 * batch * args.num_qo_heads * args.head_dim * dtype.itemsize


def bytes_per_request(x: Inputs, args) -> int:
    """What a plain decode reads if nothing is shared: each request's prefix + suffix pages."""
    return testing.decode_bytes([x.shared_len + x.unique_len] * x.batch, args.page_size, args.num_qo_heads,
                                args.num_kv_heads, args.head_dim, x.dtype, x.dtype)


def main(args) -> int:
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if gpu else 0
    cfg = TimingConfig(calls_per_graph=args.calls_per_graph, replays=args.replays, warmup=args.warmup)
    if not gpu:
        cfg = TimingConfig.for_cpu(cfg)
    libs = {"tritoninfer": tritoninfer, "flashinfer": flashinfer}
    rows, mismatch, verdicts = [], False, []
    for batch in args.batch:
        for shared_len in args.shared_len:
            for unique_len in args.unique_len:
                nmin = bytes_min(batch, shared_len, unique_len, getattr(torch, args.dtype), args)
                # enough cache copies that one graph's calls touch > 3x L2 between two uses of a copy
                copies = 1 if not gpu or nmin >= 3 * l2 else min(64, -(-3 * l2 // nmin))
                x = Inputs(args, batch, shared_len, unique_len, device, copies)
                shape = f"{batch}×({shared_len}+{unique_len})"
                ref = None if args.no_check else x.reference_output()
                results = {}
                for name, lib_name in PROVIDERS:
                    row = dict(shape=shape, provider=name, copies=copies)
                    try:
                        plan, run, impl = setup_provider(name, libs[lib_name], x, args)
                        out = run(0)
                        if ref is not None:
                            err = testing.rel_error(out, ref)
                            ok = err <= testing.tolerance(x.dtype) and not torch.isnan(out).any()
                            row["check"] = f"{'ok' if ok else 'MISMATCH'} ({err:.1e})"
                            mismatch |= not ok
                        else:
                            row["check"] = "unchecked"
                        t = measure(run, device=device, mode="graph", ncopies=copies, cfg=cfg, plan=plan)
                        row.update(impl=impl, time_us=t.time_us, p20=t.p20_us, p80=t.p80_us, plan_us=t.plan_host_us,
                                   host_us=t.eager_host_us, method=t.method + (f" ({t.note})" if t.note else ""))
                        results[name] = t.time_us
                    except Exception as exc:  # noqa: BLE001 - one provider failing must not stop the run
                        status = "not installed" if str(exc) == "not installed" else f"error: {type(exc).__name__}: {exc}"
                        row.update(impl="", check=status.splitlines()[0][:160])
                    rows.append(row)
                base = results.get("tritoninfer-plain")
                nreq = bytes_per_request(x, args)
                for row in rows:
                    if row["shape"] == shape and row.get("time_us"):
                        row["speedup"] = base / row["time_us"] if base else None
                        row["tbs_min"] = nmin / (row["time_us"] * 1e-6) / 1e12
                        row["tbs_req"] = nreq / (row["time_us"] * 1e-6) / 1e12
                if batch == 64 and shared_len == 32768 and unique_len == 128 and base and results.get("tritoninfer-cascade"):
                    ratio = base / results["tritoninfer-cascade"]
                    verdicts.append(f"issue target (cascade >= 10x plain decode at 64×(32K+128)): "
                                    f"{'MET' if ratio >= 10 else 'NOT MET'}, {ratio:.1f}×")
                del x
                if gpu:
                    torch.cuda.empty_cache()

    text = render(rows, args, device, l2, verdicts, gpu)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return 1 if mismatch else 0


def _f(x, spec):
    return "" if x is None else format(x, spec)


def render(rows, args, device, l2, verdicts, gpu) -> str:
    try:
        from tritoninfer.bench.report import environment

        env = environment(device, None, l2 or None)
    except Exception:  # noqa: BLE001 - the header is best effort
        env = {"device": str(device), "torch": torch.__version__, "tritoninfer": tritoninfer.__version__,
               "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")}
    lines = ["# Cascade decode vs plain batch decode", ""]
    if not gpu:
        lines += ["**CPU ONLY (Triton interpreter): these timings say nothing about GPU speed; only the checks "
                  "mean something.**", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- command: `{' '.join(sys.argv)}`",
              f"- heads {args.num_qo_heads}/{args.num_kv_heads}, head_dim {args.head_dim}, page {args.page_size}, "
              f"{args.layout}, {args.dtype}; one query per request; shape = batch×(shared prefix+unique suffix)",
              "- time: median µs per call (p20–p80); speed-up = tritoninfer-plain time / this time (>1: faster "
              "than plain decode); min TB/s counts every page once, per-request TB/s counts the prefix once per "
              "request (can exceed HBM bandwidth when concurrent requests share it through L2)", ""]
    lines += [f"**{v}**" for v in verdicts] + ([""] if verdicts else [])
    head = ["shape", "provider", "µs", "p20–p80", "speed-up", "min TB/s", "per-request TB/s", "plan µs (host)",
            "eager run µs (host)", "check", "timing", "copies"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["shape"], r["provider"], _f(r.get("time_us"), ".1f"),
                 f"{_f(r.get('p20'), '.1f')}–{_f(r.get('p80'), '.1f')}" if r.get("time_us") else "",
                 _f(r.get("speedup"), ".2f") + ("×" if r.get("speedup") else ""), _f(r.get("tbs_min"), ".2f"),
                 _f(r.get("tbs_req"), ".2f"), _f(r.get("plan_us"), ".0f"), _f(r.get("host_us"), ".0f"),
                 r.get("check", ""), r.get("method", ""), str(r["copies"])]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", "Implementations:", ""]
    seen = set()
    for r in rows:
        if r.get("impl") and r["provider"] not in seen:
            seen.add(r["provider"])
            lines.append(f"- {r['provider']}: {r['impl']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(ARGS))
