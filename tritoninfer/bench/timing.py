"""The one timing path every provider goes through.

On a GPU (see ``.library/device/METHOD.md``):

- ``plan_host_us``: host wall time of ``plan()`` (median over ``plan_reps``; the device is
  synchronised before each call; the page table's indptr and last_page_len are CPU tensors, as
  engines pass them). Taken after warm-up, so FlashInfer's JIT compile is not in it.
- ``eager_host_us``: host wall time of one eager ``run()`` call, device synchronised before it:
  the launch overhead a caller sees.
- ``eager_dev_us``: CUDA events around the same eager call (launch gaps included).
- ``time_us`` / ``p20_us`` / ``p80_us``: for ``mode="graph"``, ``calls`` back-to-back calls (rotating
  among the input copies) are captured in one CUDA graph, each replay is timed with events and
  divided by ``calls``: median and 20th/80th percentiles over ``replays`` replays. For
  ``mode="events"``, the eager event samples themselves. For ``mode="loop"``, ``calls`` back-to-back
  eager calls between two events, divided by ``calls`` (for calls long enough that each launch hides
  under the previous call, and for libraries whose launches a graph capture misses: FlashInfer's POD
  replays in 6.8 µs, its kernel not in the graph).

On the CPU (Triton interpreter) the only clock is the host's: every number is wall time, and says
nothing about GPU speed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch


@dataclass
class TimingConfig:
    calls_per_graph: int = 10
    replays: int = 30
    eager_reps: int = 20
    plan_reps: int = 10
    warmup: int = 3

    @classmethod
    def for_cpu(cls, cfg: "TimingConfig") -> "TimingConfig":
        """Interpreter runs take ~1 s per call: one timed call, no separate warm-up."""
        return cls(calls_per_graph=1, replays=1, eager_reps=1, plan_reps=min(cfg.plan_reps, 3), warmup=0)


@dataclass
class Timing:
    method: str
    time_us: Optional[float] = None
    p20_us: Optional[float] = None
    p80_us: Optional[float] = None
    eager_dev_us: Optional[float] = None
    eager_host_us: Optional[float] = None
    plan_host_us: Optional[float] = None
    calls: int = 1
    note: str = ""


def quantile(xs: List[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``xs``."""
    ys = sorted(xs)
    if len(ys) == 1:
        return ys[0]
    pos = q * (len(ys) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def _host_plan_time(plan: Callable[[], None], reps: int, sync: Callable[[], None]) -> float:
    samples = []
    for _ in range(max(1, reps)):
        sync()
        t0 = time.perf_counter()
        plan()
        samples.append(time.perf_counter() - t0)
    sync()
    return statistics.median(samples) * 1e6


def measure(
    run: Callable[[int], object],
    *,
    device: torch.device,
    mode: str,
    ncopies: int,
    cfg: TimingConfig,
    plan: Optional[Callable[[], None]] = None,
    graphable: bool = True,
) -> Timing:
    """Time ``run(i)`` (``i`` selects the input copy) as described in the module docstring.

    ``mode`` is ``"graph"`` (decode-like: CUDA-graph replays), ``"events"`` (prefill: events
    around eager calls) or ``"loop"`` (events around a loop of eager calls). Falls back to an eager loop timed with events when graph capture fails
    (the reason goes to ``Timing.note``).
    """
    if device.type != "cuda":
        return _measure_cpu(run, ncopies=ncopies, cfg=cfg, plan=plan)

    sync = torch.cuda.synchronize
    result = Timing(method="")
    if plan is not None:
        result.plan_host_us = _host_plan_time(plan, cfg.plan_reps, sync)

    for k in range(cfg.warmup):
        run(k % ncopies)
    sync()

    # Eager: host time and event time of each call, from an idle device.
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.eager_reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.eager_reps)]
    host = []
    for k in range(cfg.eager_reps):
        sync()
        starts[k].record()
        t0 = time.perf_counter()
        run(k % ncopies)
        host.append(time.perf_counter() - t0)
        ends[k].record()
    sync()
    dev = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    result.eager_host_us = statistics.median(host) * 1e6
    result.eager_dev_us = statistics.median(dev)

    if mode == "loop":
        calls = max(cfg.calls_per_graph, ncopies)
        samples = _eager_loop_samples(run, calls, ncopies, cfg.replays)
        result.method = f"eager loop of {calls} calls (events)"
        result.calls = calls
    elif mode == "graph" and graphable:
        calls = max(cfg.calls_per_graph, ncopies)
        try:
            samples = _graph_samples(run, calls, ncopies, cfg.replays)
            result.method = f"CUDA graph, {calls} calls/graph"
            result.calls = calls
        except Exception as exc:  # capture failed: time an eager loop instead, and say so
            torch.cuda.synchronize()
            samples = _eager_loop_samples(run, calls, ncopies, cfg.replays)
            result.method = f"eager loop of {calls} calls (events)"
            result.calls = calls
            result.note = f"graph capture failed: {type(exc).__name__}: {_first_line(exc)}"
    else:
        samples = dev
        result.method = "CUDA events, eager"
        if mode == "graph":
            result.note = "not graph-capturable: eager events"
    result.time_us = statistics.median(samples)
    result.p20_us = quantile(samples, 0.2)
    result.p80_us = quantile(samples, 0.8)
    return result


def _graph_samples(run, calls: int, ncopies: int, replays: int) -> List[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch recommends before capture
        for k in range(2):
            run(k % ncopies)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(calls):
            run(k % ncopies)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for k in range(replays):
        starts[k].record()
        graph.replay()
        ends[k].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]
    del graph
    return samples


def _eager_loop_samples(run, calls: int, ncopies: int, replays: int) -> List[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for k in range(replays):
        starts[k].record()
        for c in range(calls):
            run(c % ncopies)
        ends[k].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends)]


def _measure_cpu(run, *, ncopies: int, cfg: TimingConfig, plan) -> Timing:
    result = Timing(method="CPU wall clock (Triton interpreter)")
    if plan is not None:
        result.plan_host_us = _host_plan_time(plan, cfg.plan_reps, lambda: None)
    for k in range(cfg.warmup):
        run(k % ncopies)
    samples = []
    for k in range(max(1, cfg.eager_reps)):
        t0 = time.perf_counter()
        run(k % ncopies)
        samples.append((time.perf_counter() - t0) * 1e6)
    result.time_us = statistics.median(samples)
    result.p20_us = quantile(samples, 0.2)
    result.p80_us = quantile(samples, 0.8)
    result.eager_dev_us = result.time_us
    result.eager_host_us = result.time_us
    return result


def kernel_times(fn: Callable[[], object], calls: int = 20,
                 ndigits: Optional[int] = 1) -> Dict[str, Tuple[int, float]]:
    """``{kernel name: (launches per call, mean µs per launch)}`` of ``fn``'s kernels from
    ``torch.profiler`` (device time only, gaps between kernels excluded), after one untimed call;
    means rounded to ``ndigits`` (None: not rounded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows: Dict[str, List[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            rows.setdefault(e.name[:60], []).append(e.device_time)
    mean = (lambda v: sum(v) / len(v)) if ndigits is None else (lambda v: round(sum(v) / len(v), ndigits))
    return {k: (len(v) // calls, mean(v)) for k, v in rows.items()}


def kernel_device_us(fn: Callable[[], object], calls: int = 20) -> float:
    """The device time of ``fn``'s kernels per call (``kernel_times`` summed)."""
    return sum(n * us for n, us in kernel_times(fn, calls, ndigits=None).values())


def copy_bandwidth(device: torch.device, nbytes: Optional[int] = None) -> float:
    """Device-to-device copy bandwidth in TB/s, bytes read + written (the decode roofline).

    GPU: a 1 GiB copy (less if memory is short) of random bytes, median of 10 event-timed copies.
    CPU: a 32 MiB copy timed with the host clock.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = nbytes or int(min(1 << 30, free // 8))
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        del src, dst
        return 2 * n / statistics.median(times) / 1e12
    n = nbytes or (32 << 20)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times) / 1e12


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"
