"""The sweep: for each shape build the inputs once, run every provider on them (each failure caught
and reported), compare the outputs, time, and compute the ratios."""

from __future__ import annotations

import gc
import re
import shlex
import sys
import traceback
from typing import Dict, List, Optional, Tuple

import torch

from .. import _device, testing
from . import grid, report
from .cases import Case, num_copies
from .cli import BenchConfig
from .providers import Provider, Refused, Runner, Skipped, select
from .results import (ERROR, NOT_IMPLEMENTED, NOT_INSTALLED, REFUSED, SKIPPED, Result, WorkloadResults,
                      set_vs_best)
from .shapes import Shape, bytes_moved, flops, input_bytes, make_shapes
from .timing import TimingConfig, copy_bandwidth, measure

DEFAULT_L2 = 60 << 20  # H200
# The output every other row is compared with when the reference is not run, in order of preference.
BASELINES = ("reference", "flashinfer-tc", "flashinfer-fa2", "flashinfer", "flashinfer-cc", "flashinfer-fa3", "sdpa")
_REFUSAL = re.compile(
    r"not supported|unsupported|only support|does not support|not implemented|invalid|must be|cannot|can't",
    re.IGNORECASE,
)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def classify(exc: BaseException) -> Tuple[str, str]:
    """(status, detail) for an exception raised by a provider."""
    if isinstance(exc, NotImplementedError):
        return NOT_IMPLEMENTED, _first_line(exc)
    if isinstance(exc, Skipped):
        return SKIPPED, _first_line(exc)
    if isinstance(exc, Refused):
        return REFUSED, _first_line(exc)
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return ERROR, "out of memory: " + _first_line(exc, 160)
    if isinstance(exc, (ValueError, TypeError)) or _REFUSAL.search(str(exc)):
        return REFUSED, text
    return ERROR, text


def _cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def _say(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


def _loud(msg: str) -> None:
    bar = "!" * min(100, max(40, len(msg)))
    _say(f"\n{bar}\n{msg}\n{bar}")


class Sweep:
    """Runs one workload's shapes × providers."""

    GIVE_UP = 3  # same error on this many shapes in a row: stop running that provider

    def __init__(self, workload: str, device: torch.device, timing: TimingConfig, budget_bytes: float,
                 l2_bytes: int, seed: int = 0, progress: bool = True) -> None:
        self.workload = workload
        self.device = device
        self.gpu = device.type == "cuda"
        self.timing = timing
        self.budget = budget_bytes
        self.l2 = l2_bytes
        self.seed = seed
        self.progress = progress
        self.mode = "events" if workload == "prefill" else "graph"
        self.tracebacks: List[str] = []
        self.dead: Optional[str] = None
        # A provider that fails the same way on GIVE_UP shapes in a row is not run on the rest
        # (e.g. a FlashInfer JIT build that cannot work would otherwise be retried on every shape).
        self.streak: Dict[str, Tuple[str, int]] = {}
        self.given_up: Dict[str, str] = {}

    def _note_outcome(self, r: Result) -> None:
        if r.status != ERROR or r.detail.startswith("out of memory"):
            self.streak.pop(r.provider, None)
            return
        detail, count = self.streak.get(r.provider, ("", 0))
        count = count + 1 if detail == r.detail else 1
        self.streak[r.provider] = (r.detail, count)
        if count >= self.GIVE_UP:
            self.given_up[r.provider] = r.detail
            _loud(f"{r.provider} failed {count} times in a row with the same error; not running it on the "
                  f"remaining {self.workload} shapes: {r.detail}")

    # ---- one provider ------------------------------------------------------------------------
    def run_one(self, p: Provider, case: Case, base: Dict) -> Tuple[Result, Optional[torch.Tensor]]:
        r = Result(shape=case.shape, provider=p.name, impl=p.impl, **base)
        why = p.unavailable(case.device)
        if why:
            status, _, detail = why.partition(": ")
            r.status, r.detail = (NOT_INSTALLED, detail) if status == NOT_INSTALLED else (REFUSED, why)
            return r, None
        out = None
        runner: Optional[Runner] = None
        try:
            runner = p.setup(case)
            if runner.impl:
                r.impl = runner.impl
            out = runner.check().detach().clone()
            if self.gpu:
                torch.cuda.synchronize()
            r.timing = measure(runner.run, device=case.device, mode=self.mode, ncopies=case.ncopies,
                               cfg=self.timing, plan=runner.plan, graphable=runner.graphable)
        except Exception as exc:  # one provider failing on one shape never stops the sweep
            r.status, r.detail = classify(exc)
            r.timing = None
            if r.status == ERROR:
                self.tracebacks.append(f"== {case.shape.label()} / {p.name}\n{traceback.format_exc()}")
            if self.gpu and not _cuda_alive():
                self.dead = f"the CUDA context failed after {p.name} on {case.shape.label()}: {r.detail}"
        finally:
            del runner
        return r, out

    # ---- checks and ratios ---------------------------------------------------------------------
    def compare(self, rows: List[Result], outs: Dict[str, torch.Tensor], case: Case) -> None:
        s = case.shape
        if s.workload == "append":
            base_name = "appended values"
            base = torch.stack([case.append_key[0].float(), case.append_value[0].float()], dim=1)
            tol_exact = tol = 0.0
        else:
            base_name = next((n for n in BASELINES if n in outs), None)
            base = outs.get(base_name) if base_name else None
            tol_exact = testing.tolerance(s.q_dtype)
            tol = tol_exact if base_name == "reference" else 2 * tol_exact  # two approximations
        ti = outs.get("tritoninfer")
        for r in rows:
            out = outs.get(r.provider)
            if out is None:
                continue
            if r.provider == base_name:
                r.is_baseline = True
                r.check_against = "itself (baseline)"
                continue
            if base is None:
                continue
            r.check_against = base_name
            r.tol = tol_exact if base_name in ("reference", "appended values") else tol
            r.rel_err = self._error(out, base)
            r.match = r.rel_err <= r.tol  # NaN compares False: a mismatch
            if ti is not None and r.provider != "tritoninfer":
                r.err_vs_tritoninfer = self._error(out, ti)
            if r.mismatch:
                _loud(f"MISMATCH  {s.workload} {s.label()}: {r.provider} vs {base_name}: relative error "
                      f"{r.rel_err:.3e} > tolerance {r.tol:.1e}")

    @staticmethod
    def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
        if out.shape != ref.shape:
            return float("nan")
        if torch.isnan(out).any():
            return float("nan")
        return testing.rel_error(out, ref)

    @staticmethod
    def ratios(rows: List[Result]) -> None:
        set_vs_best(rows)
        ti = next((r for r in rows if r.provider == "tritoninfer" and r.ok), None)
        if ti is None:
            return
        for r in rows:
            if r is ti or not r.ok:
                continue
            r.speedup = r.time_us / ti.time_us
            if r.timing.eager_dev_us and ti.timing.eager_dev_us:
                r.speedup_eager = r.timing.eager_dev_us / ti.timing.eager_dev_us

    # ---- the sweep -------------------------------------------------------------------------------
    def _need_bytes(self, s: Shape, ncopies: int) -> int:
        if s.workload == "append":
            appended = 2 * s.batch * s.qo_len * s.num_kv_heads * s.head_dim * s.kv_dtype.itemsize
            return input_bytes(s) + (ncopies - 1) * appended
        return input_bytes(s) * ncopies

    def run(self, shapes: List[Shape], providers: List[Provider], on_shape_done=None) -> WorkloadResults:
        """Every shape × provider. ``on_shape_done(results)`` is called after each shape (the command
        rewrites the CSV there, so that a crash of the whole process still leaves the rows so far)."""
        from tqdm import tqdm

        wr = WorkloadResults(self.workload)
        bar = tqdm(total=len(shapes) * len(providers), desc=self.workload, unit="run", file=sys.stderr,
                   disable=None if self.progress else True, dynamic_ncols=True)
        for shape in shapes:
            ncopies = num_copies(shape, self.l2, self.gpu)
            base = dict(bytes=bytes_moved(shape), flops=flops(shape), copies=ncopies)
            rows = [Result(shape=shape, provider=p.name, impl=p.impl, **base) for p in providers]
            skip = None
            need = self._need_bytes(shape, ncopies)
            if self.dead:
                skip = f"not run: {self.dead}"
            elif need > self.budget:
                skip = (f"inputs need {need / 1e9:.1f} GB, over the memory budget of {self.budget / 1e9:.1f} GB "
                        "(--mem-budget-gb)")
                wr.notes.append(f"skipped {shape.label()}: {skip}")
                _say(f"skipping {self.workload} {shape.label()}: {skip}")
            case = None
            if skip is None:
                try:
                    case = Case(shape, self.device, ncopies, self.seed)
                except Exception as exc:
                    status, detail = classify(exc)
                    skip = f"building the inputs failed: {detail}"
                    wr.notes.append(f"{shape.label()}: {skip}")
            if skip is not None:
                for r in rows:
                    r.status, r.detail = SKIPPED, skip
                wr.results.extend(rows)
                bar.update(len(providers))
                if on_shape_done:
                    on_shape_done(wr)
                continue
            outs: Dict[str, torch.Tensor] = {}
            for i, p in enumerate(providers):
                bar.set_postfix_str(f"{shape.label()} · {p.name}", refresh=False)
                if self.dead:
                    rows[i].status, rows[i].detail = SKIPPED, f"not run: {self.dead}"
                elif p.name in self.given_up:
                    rows[i].status = SKIPPED
                    rows[i].detail = f"failed {self.GIVE_UP} shapes in a row with: {self.given_up[p.name]}"
                else:
                    rows[i], out = self.run_one(p, case, base)
                    self._note_outcome(rows[i])
                    if out is not None:
                        outs[p.name] = out
                    if self.dead:
                        _loud(f"STOPPING: {self.dead}")
                bar.update(1)
            if not self.dead:
                self.compare(rows, outs, case)
            if self.gpu:  # the interpreter's timings say nothing about speed
                self.ratios(rows)
            wr.results.extend(rows)
            if on_shape_done:
                on_shape_done(wr)
            del case, outs
            gc.collect()
            if self.gpu and not self.dead:
                torch.cuda.empty_cache()
        bar.close()
        return wr


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_L2
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2)


def provider_names(cfg: BenchConfig, gpu: bool) -> Optional[List[str]]:
    """``--providers``, or for the grid tritoninfer and FlashInfer's paths (the goal's comparison;
    on the CPU, where FlashInfer is absent, the float32 reference too, so the checks still mean
    something)."""
    if cfg.providers is None and cfg.grid:
        return ["tritoninfer", "flashinfer"] + ([] if gpu else ["reference"])
    return cfg.providers


def grid_plan(cfg: BenchConfig, gpu: bool) -> grid.Plan:
    names = provider_names(cfg, gpu)
    providers = {w: [p.name for p in select(w, names, cfg.ref_max_tokens)] for w in cfg.workloads}
    nparts = cfg.grid_part[1] if cfg.grid_part else 1
    return grid.plan(cfg.workloads, cfg.grid, cfg.grid_extra, gpu, cfg.timing, providers, nparts)


def dry_run(cfg: BenchConfig) -> int:
    """``--dry-run``: the rows of the sweep or grid as an H200 would run them (whatever this
    machine has), their parts and the estimated time; nothing runs."""
    if cfg.grid:
        plan = grid_plan(cfg, gpu=True)
    else:
        names = provider_names(cfg, True)
        providers = {w: [p.name for p in select(w, names, cfg.ref_max_tokens)] for w in cfg.workloads}
        rows = [grid.GridRow(w, s, "sweep") for w in cfg.workloads
                for s in make_shapes(w, cfg.spec, quick=cfg.quick, gpu=True)]
        plan = grid.Plan(rows, [0] * len(rows), 1, providers, cfg.timing, splittable=False)
    part = cfg.grid_part[0] - 1 if cfg.grid_part else None
    print("dry run: the H200 shapes; nothing runs\n" + plan.text(part) + "\n")
    for r, k in zip(plan.rows, plan.parts):
        if part is None or k == part:
            tag = f"  [{r.shape.tag}]" if r.shape.tag else ""
            print(f"  part {k + 1}/{plan.nparts}  {r.workload:7s} {r.shape.label()}{tag}")
    return 0


def run_config(cfg: BenchConfig) -> int:
    """Run the workloads of ``cfg``; returns 1 if any output mismatched, else 0. Without a GPU the
    printed tables show the checks only (no timings), and the last line is the verdict of
    :func:`report.verdict`."""
    if cfg.dry_run:
        return dry_run(cfg)
    gpu = _device.has_gpu()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if not gpu:
        print(f"*** {report.CPU_WARNING} ***\n", flush=True)
    timing = cfg.timing if gpu else TimingConfig.for_cpu(cfg.timing)
    l2 = _l2_bytes(device)
    copy_tb_s = copy_bandwidth(device) if gpu else None
    env = report.environment(device, copy_tb_s, l2 if gpu else None)
    if cfg.mem_budget_gb:
        budget = cfg.mem_budget_gb * 1e9
    elif gpu:
        budget = 0.45 * torch.cuda.get_device_properties(device).total_memory
    else:
        budget = 2e9
    command = "tritoninfer bench " + " ".join(shlex.quote(a) for a in cfg.argv)
    print("  ".join(f"{k}: {v}" for k, v in env.items() if k in ("device", "driver", "torch", "triton",
                                                                 "flashinfer", "git commit")))
    roofline = f"copy roofline {copy_tb_s:.3f} TB/s; " if gpu else ""
    print(f"{roofline}memory budget {budget / 1e9:.1f} GB; output in {cfg.out}/\n", flush=True)

    plan, part = None, None
    if cfg.grid:
        plan = grid_plan(cfg, gpu)
        part = cfg.grid_part[0] - 1 if cfg.grid_part else None
        print(plan.text(part, estimates=gpu) + "\n", flush=True)

    done: List[WorkloadResults] = []
    for workload in cfg.workloads:
        if plan is not None:
            shapes = plan.shapes(workload, part)
        else:
            shapes = make_shapes(workload, cfg.spec, quick=cfg.quick, gpu=gpu)
        providers = select(workload, provider_names(cfg, gpu), cfg.ref_max_tokens)
        if not shapes or not providers:
            print(f"{workload}: nothing to run ({len(shapes)} shapes, {len(providers)} providers)\n")
            continue
        sweep = Sweep(workload, device, timing, budget, l2, cfg.seed, cfg.progress)
        cfg.out.mkdir(parents=True, exist_ok=True)
        csv_path = cfg.out / f"{workload}.csv"
        wr = sweep.run(shapes, providers, on_shape_done=lambda partial: report.write_csv(partial, csv_path))
        done.append(wr)

        print(f"== {workload}: {len(shapes)} shapes × {len(providers)} providers")
        print(report.terminal_table(wr, timed=gpu))
        print(report.legend(workload, timed=gpu))
        goal = report.goal_line(wr) if gpu else None
        if goal:
            print(goal)
        for note in report.notes(wr):
            print(f"  - {note}")
        written = [report.write_csv(wr, csv_path)]
        images = []
        if cfg.plots:
            images.append(report.plot(wr, cfg.out / f"{workload}.png", env, copy_tb_s, not gpu, bars=plan is not None))
        written.append(report.write_markdown(wr, cfg.out / f"{workload}.md", env, command, not gpu, images))
        written += images
        if sweep.tracebacks:
            log = cfg.out / f"{workload}-errors.log"
            log.write_text("\n".join(sweep.tracebacks))
            written.append(log)
        print("wrote " + ", ".join(str(p) for p in written) + "\n", flush=True)
        if sweep.dead:
            print(f"stopped early: {sweep.dead}", file=sys.stderr)
            break

    print(report.verdict(done), flush=True)
    return 1 if any(r.mismatch for wr in done for r in wr.results) else 0
