"""Kernel-by-kernel device time of the sampling functions (``torch.profiler``) and their eager time
(``triton.testing.do_bench``: back-to-back calls), for tritoninfer (with a few settings of its routing knobs) and FlashInfer, on rows of
``softmax(randn * scale)``. Used to find what a sampling call spends its time on
(``benchmarks/NOTES.md``, sampling).

    PYTHONPATH=. python benchmarks/sampling_profile.py [--batch 1 64 256] [--scale 3 6] [--knob NAME=VALUE ...]

``--knob`` sets a module constant of ``tritoninfer.sampling`` (e.g. ``_REJECTION_ONLY_ROWS=1000000``)
for a second set of rows; run it with another tree on PYTHONPATH to compare versions.

``--host`` reports the host side of one eager call instead: its wall time from an idle device
(median of 50), with ``_launch.CACHED_DRIVER_PATH`` on and off, the kernel launches it makes and how
many took the driver path, and its heaviest Python functions (``cProfile``, self time).
"""
import argparse
import collections
import cProfile
import pstats
import statistics
import time

import torch
import triton.testing

import tritoninfer
from tritoninfer import sampling
from tritoninfer.bench.timing import kernel_times

try:
    import flashinfer.sampling as fi
except Exception:  # noqa: BLE001
    fi = None

VOCAB = 128256


def calls(lib, probs):
    return {
        "top_k_first k50 p0.9": lambda: lib.top_k_top_p_sampling_from_probs(probs, 50, 0.9),
        "joint k50 p0.9": lambda: lib.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint"),
        "top_p 0.9": lambda: lib.top_p_sampling_from_probs(probs, 0.9),
        "top_k 50": lambda: lib.top_k_sampling_from_probs(probs, 50),
        "top_k_renorm 50": lambda: lib.top_k_renorm_probs(probs, 50),
        "top_p_renorm 0.9": lambda: lib.top_p_renorm_probs(probs, 0.9),
        "from_probs": lambda: lib.sampling_from_probs(probs),
        "min_p 0.05": lambda: lib.min_p_sampling_from_probs(probs, 0.05),
    }


def eager_us(fn):
    return triton.testing.do_bench(fn, rep=30) * 1e3


def host_us(fn, reps: int = 50) -> float:
    """Median host wall time of one call, the device idle before each."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_report(fn) -> str:
    """Host µs with the driver path on and off, launches (driver ones), the top self-time functions."""
    from tritoninfer import _launch

    fn()
    fn()  # the driver path is built at a specialisation's second call
    on = host_us(fn)
    _launch.CACHED_DRIVER_PATH = False
    try:
        off = host_us(fn)
    finally:
        _launch.CACHED_DRIVER_PATH = True
    launches, driver = collections.Counter(), collections.Counter()
    orig_launch, orig_driver = _launch.CachedLauncher._launch, _launch.DriverLaunch.__call__

    def count_launch(self, grid, args, kwargs):
        launches[self.kernel.fn.__name__] += 1
        return orig_launch(self, grid, args, kwargs)

    def count_driver(self, *args):
        driver["driver"] += 1
        return orig_driver(self, *args)

    _launch.CachedLauncher._launch, _launch.DriverLaunch.__call__ = count_launch, count_driver
    try:
        fn()
    finally:
        _launch.CachedLauncher._launch, _launch.DriverLaunch.__call__ = orig_launch, orig_driver
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:6]
    heavy = ", ".join(f"{func[2]}({func[0].rsplit('/', 1)[-1]}:{func[1]}) {tt / 20 * 1e6:.1f}"
                      for func, (cc, nc, tt, ct, callers) in top)
    return (f"host {on:.1f} µs (driver path off: {off:.1f}); {sum(launches.values())} launches "
            f"({driver['driver']} by the driver) {dict(launches)}; self µs a call: {heavy}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--scale", type=float, nargs="+", default=[3.0])
    ap.add_argument("--knob", nargs="*", default=[])
    ap.add_argument("--only", nargs="*", default=None, help="function names (keys of calls())")
    ap.add_argument("--no-fi", action="store_true")
    ap.add_argument("--host", action="store_true", help="the host side of one call (see the module docstring)")
    args = ap.parse_args()
    knobs = [dict(kv.split("=") for kv in [k]) for k in args.knob]
    print(f"tritoninfer from {tritoninfer.__file__}", flush=True)
    for scale in args.scale:
        for batch in args.batch:
            torch.manual_seed(0)
            probs = torch.softmax(torch.randn(batch, VOCAB, device="cuda") * scale, -1)
            ours, peer = calls(sampling, probs), calls(fi, probs) if fi is not None and not args.no_fi else {}
            for name in ours:
                if args.only and name not in args.only:
                    continue
                # eager times (events around back-to-back calls): FlashInfer's calls without a
                # generator make one per call, which graph capture refuses
                line = f"scale {scale} batch {batch} {name}:"
                if args.host:
                    if name in peer:
                        line += f" FI host {host_us(peer[name]):.1f} µs;"
                    print(f"{line} ours {host_report(ours[name])}", flush=True)
                    continue
                if name in peer:
                    line += f" FI {eager_us(peer[name]):.1f} µs;"
                line += f" ours {eager_us(ours[name]):.1f} µs {kernel_times(ours[name])}"
                for knob in knobs:
                    saved = {k: getattr(sampling, k) for k in knob}
                    for k, v in knob.items():
                        setattr(sampling, k, type(saved[k])(int(v) if isinstance(saved[k], (bool, int)) else v))
                    line += f"; {knob}: {eager_us(ours[name]):.1f} µs {kernel_times(ours[name])}"
                    for k, v in saved.items():
                        setattr(sampling, k, v)
                print(line, flush=True)


if __name__ == "__main__":
    main()
