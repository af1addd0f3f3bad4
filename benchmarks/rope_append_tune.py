"""Program-shape sweep for the fused RoPE + fp8 quantize + paged append (issue 23's >= 80 % of the copy
bandwidth): times tritoninfer's ``rope_quantize_fp8_append_paged_kv_cache`` on ``tritoninfer bench
rope-append``'s inputs under each setting of ``rope._STEP_ELEMENTS``, ``_PROGRAMS_PER_SM``,
``_WIDE_WARPS`` and ``_HEAD_STAGES``, one process, after checking each setting's codes against the reference.

    PYTHONPATH=. python benchmarks/rope_append_tune.py --configs 4096-8-8,8192-4-8 --out tune.md

A config is ``STEP-PROGRAMS_PER_SM-WARPS[-STAGES]`` (STAGES: the head loops' software pipeline,
default 1). Bytes per call as the bench counts them. (Two heads a loop
step, both loaded before either is stored, measured 24.2 -> 27.8 µs at 4,096 decode tokens in session 16:
removed.)
"""

import argparse
import functools
import math

import torch
from tabulate import tabulate

from tritoninfer import rope
from tritoninfer.bench import rope_append
from tritoninfer.bench.timing import TimingConfig, copy_bandwidth, measure


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="4096-8-8,4096-8-8-2,4096-8-8-3,2048-16-4-2,2048-16-4-3,4096-4-8-3,"
                                         "2048-8-4-3")
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    cfg = rope_append.Config(32, 8, 128, 128, 16, torch.bfloat16, torch.float8_e4m3fn, "NHD", 4096)
    timing = TimingConfig(calls_per_graph=10, replays=30)
    copy_tb_s = copy_bandwidth(dev)
    rows = []
    for kind in rope_append.KINDS:
        for tokens in (int(t) for t in a.tokens.split(",")):
            nbytes = rope_append.bytes_moved(cfg, tokens)
            ncopies = max(1, min(8, math.ceil(100e6 / nbytes)))
            case = rope_append.Case(cfg, kind, tokens, ncopies, dev, 0)
            want = case.reference()
            fn = rope.rope_quantize_fp8_append_paged_kv_cache
            for text in a.configs.split(","):
                step, per_sm, warps, *stages = (int(x) for x in text.split("-"))
                rope._STEP_ELEMENTS, rope._PROGRAMS_PER_SM, rope._WIDE_WARPS = step, per_sm, warps
                rope._HEAD_STAGES = stages[0] if stages else 1
                check = case.check(fn, want)
                t = measure(functools.partial(case.call, fn), device=dev, mode="graph", ncopies=ncopies,
                            cfg=timing)
                tb_s = nbytes / (t.time_us * 1e6)
                rows.append([kind, tokens, text, f"{t.time_us:.2f}", f"{tb_s:.2f}", f"{tb_s / copy_tb_s:.1%}", check])
                print(rows[-1], flush=True)
            del case
            torch.cuda.empty_cache()
    text = (f"copy bandwidth {copy_tb_s:.3f} TB/s (same process)\n\n"
            + tabulate(rows, headers=["kind", "tokens", "step-per_sm-warps[-stages]", "µs", "TB/s", "of copy", "check"],
                       tablefmt="github"))
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
