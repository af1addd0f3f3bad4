"""``tritoninfer bench`` on the CPU: byte/FLOP accounting, option parsing, the report files, failure
handling, and ``--quick`` end to end through the Triton interpreter."""

import csv
import dataclasses
import os
import re
import subprocess
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tritoninfer.bench import cli, main, report, runner


@pytest.fixture(autouse=True)
def _nan_poison():
    """The bench's FlexAttention provider runs torch.compile; Dynamo builds its tables of torch functions
    once per process, so compiling under conftest's NaN-poisoning torch.empty_like wrapper made a
    later compile in the same worker (tests/test_compile.py) refuse the real torch.empty_like."""
    yield
from tritoninfer.bench.cases import num_copies
from tritoninfer.bench.providers import Provider, Refused, Runner, Sdpa
from tritoninfer.bench.results import COLUMNS, Result, WorkloadResults
from tritoninfer.bench.runner import Sweep, classify
from tritoninfer.bench.shapes import Shape, SweepSpec, bytes_moved, flops, input_bytes, make_shapes
from tritoninfer.bench.timing import Timing, TimingConfig, quantile

REPO = Path(__file__).resolve().parents[1]
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


# --------------------------------------------------------------------------------------------------
# accounting against hand counts
# --------------------------------------------------------------------------------------------------


def test_decode_bytes_hand_count():
    s = Shape("decode", 16, 4096, 1, 32, 8, 128, 16)
    kv = 16 * 4096 * 8 * 128 * 2 * 2  # tokens × H_kv × D × (K, V) × bf16
    q_and_o = 2 * 16 * 32 * 128 * 2
    assert bytes_moved(s) == kv + q_and_o == 268_697_600
    assert flops(s) == 4 * 16 * 32 * 128 * 4096
    # The anchor table: FlashInfer tensor cores, 32/8, 16×4096, 71.9 µs -> 3.74 TB/s.
    r = Result(shape=s, provider="x", bytes=bytes_moved(s), timing=Timing("t", time_us=71.9))
    assert r.tb_per_s == pytest.approx(3.737, abs=1e-3)


def test_decode_bytes_whole_pages_and_fp8():
    s = Shape("decode", 3, 20, 1, 4, 2, 8, 16)  # 20 tokens occupy 2 pages = 32 slots
    assert bytes_moved(s) == 3 * 32 * 2 * 8 * 2 * 2 + 2 * 3 * 4 * 8 * 2
    f8 = Shape("decode", 3, 20, 1, 4, 2, 8, 16, kv_dtype=E4M3)
    assert bytes_moved(f8) == 3 * 32 * 2 * 8 * 2 * 1 + 2 * 3 * 4 * 8 * 2


def test_prefill_flops_and_bytes_hand_count():
    full = Shape("prefill", 2, 4, 4, 2, 1, 8, 16, causal=False)
    assert flops(full) == 2 * (4 * 4) * 2 * 4 * 8  # batch × pairs × H_qo × 4·D
    causal = Shape("prefill", 2, 4, 4, 2, 1, 8, 16, causal=True)
    assert flops(causal) == 2 * (1 + 2 + 3 + 4) * 2 * 4 * 8  # bottom-right mask: 10 pairs per request
    # kv longer than qo: query i sees i + kv - qo + 1 keys -> 3 + 4 = 7 pairs
    assert flops(Shape("prefill", 1, 4, 2, 1, 1, 8, 16, causal=True)) == 7 * 4 * 8
    # bytes: paged counts whole pages, ragged the tokens
    assert bytes_moved(full) == 2 * 16 * 1 * 8 * 2 * 2 + 2 * 8 * 2 * 8 * 2
    ragged = Shape("prefill", 2, 4, 4, 2, 1, 8, 1, kv_form="ragged")
    assert bytes_moved(ragged) == 2 * 4 * 1 * 8 * 2 * 2 + 2 * 8 * 2 * 8 * 2
    r = Result(shape=full, provider="x", flops=10**12, timing=Timing("t", time_us=1e6))
    assert r.tflop_per_s == pytest.approx(1.0)


def test_cascade_and_append_hand_count():
    c = Shape("cascade", 2, 20, 1, 4, 2, 8, 16, shared_len=32)
    kv = (32 + 2 * 32) * 2 * 8 * 2 * 2  # shared pages once + two requests' 2 unique pages each
    assert bytes_moved(c) == kv + 2 * 2 * 4 * 8 * 2
    assert flops(c) == 4 * 2 * 4 * 8 * (32 + 20)
    a = Shape("append", 3, 40, 1, 4, 2, 8, 16)
    assert bytes_moved(a) == 2 * (2 * 3 * 2 * 8 * 2) + 8 * 3  # K,V read and written + int32 indices
    assert flops(a) == 0


def test_quantile():
    assert quantile([5.0], 0.2) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.2) == pytest.approx(1.8)
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.8) == pytest.approx(4.2)


# --------------------------------------------------------------------------------------------------
# sweeps and memory budget
# --------------------------------------------------------------------------------------------------


def test_default_gpu_sweeps():
    dec = make_shapes("decode", SweepSpec(), quick=False, gpu=True)
    main_grid = [s for s in dec if not s.tag]
    assert len(main_grid) == 2 * 4 * 4
    assert {s.heads for s in main_grid} == {"32/8", "32/32"}
    assert {s.tag for s in dec if s.tag} == {"page 1", "HND", "head_dim 64"}
    # 256×32768 at 32/32 (137 GB) is over the default budget (45 % of an H200) and gets skipped.
    big = next(s for s in dec if s.batch == 256 and s.kv_len == 32768 and s.heads == "32/32")
    assert input_bytes(big) > 0.45 * 141e9
    pre = make_shapes("prefill", SweepSpec(), quick=False, gpu=True)
    assert {(s.batch, s.kv_len) for s in pre} == {(16, 1024), (4, 4096), (1, 16384)}
    assert {s.causal for s in pre} == {True, False} and {s.kv_form for s in pre} == {"paged", "ragged"}
    # overrides replace the axes; no extra rows when the layout axes are given
    s = make_shapes("decode", SweepSpec(heads=[(64, 8)], head_dims=[256], batches=[16, 64], kv_lens=[4096],
                                        kv_dtypes=[E4M3]), quick=False, gpu=True)
    assert [(x.batch, x.kv_len, x.num_qo_heads, x.head_dim, x.kv_dtype) for x in s] == [
        (16, 4096, 64, 256, E4M3), (64, 4096, 64, 256, E4M3)]


def test_copies_rotate_small_inputs_only():
    small = Shape("decode", 1, 1024, 1, 32, 8, 128, 16)  # 4 MB per call
    big = Shape("decode", 64, 4096, 1, 32, 8, 128, 16)  # 1 GB per call
    assert num_copies(small, 60 << 20, gpu=True) * bytes_moved(small) >= 3 * (60 << 20)
    assert num_copies(big, 60 << 20, gpu=True) == 1
    assert num_copies(small, 60 << 20, gpu=False) == 1


def test_memory_budget_skips_and_says_so(tmp_path):
    shapes = [Shape("decode", 1, 20, 1, 4, 2, 64, 16), Shape("decode", 2, 50, 1, 4, 2, 64, 16)]
    budget = input_bytes(shapes[0]) + 1
    sweep = Sweep("decode", torch.device("cpu"), TimingConfig.for_cpu(TimingConfig()), budget, 60 << 20,
                  progress=False)
    wr = sweep.run(shapes, [Sdpa()])
    first, second = wr.results
    assert first.ok and second.status == "skipped"
    assert "memory budget" in second.detail and any("memory budget" in n for n in wr.notes)


# --------------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------------


def test_parse_overrides():
    cfg = cli.parse_args(["prefill", "--heads", "64/8,32", "--head-dim", "256", "--page-size", "1",
                          "--kv-dtype", "e4m3", "--q-dtype", "bf16", "--layout", "hnd", "--batch", "16,64",
                          "--kv-len", "4K,16k", "--providers", "tritoninfer,flashinfer", "--out", "somewhere",
                          "--mask", "causal"])
    assert cfg.workloads == ["prefill"]
    s = cfg.spec
    assert s.heads == [(64, 8), (32, 32)] and s.head_dims == [256] and s.page_sizes == [1]
    assert s.kv_dtypes == [E4M3] and s.q_dtypes == [BF16] and s.layouts == ["HND"]
    assert s.batches == [16, 64] and s.kv_lens == [4096, 16384] and s.causal == [True]
    assert cfg.providers == ["tritoninfer", "flashinfer"] and cfg.out == Path("somewhere")
    assert cli.parse_args([]).workloads == ["decode"]
    assert cli.parse_args(["--workload", "append"]).workloads == ["append"]
    assert cli.parse_args(["all"]).workloads == ["decode", "prefill", "append", "cascade"]


@pytest.mark.parametrize("argv, message", [
    (["--heads", "30/8"], "30 query heads are not a multiple of 8 KV heads"),
    (["--heads", "32:8"], "expected QO/KV head counts like 32/8"),
    (["--head-dim", "100"], "head_dim must be a multiple of 8 up to 256"),
    (["--head-dim", "512"], "head_dim must be a multiple of 8 up to 256"),
    (["--kv-dtype", "fp9"], "unknown or unsupported dtype 'fp9'"),
    (["--q-dtype", "e4m3"], "unknown or unsupported dtype 'e4m3'"),
    (["--layout", "NCHW"], "unknown layout 'NCHW'"),
    (["--batch", "0"], "expected a batch size >= 1"),
    (["--kv-len", "four"], "expected a KV length (an integer"),
    (["--providers", "tritoninfer,vllm"], "unknown provider 'vllm'"),
    (["decode", "--workload", "prefill"], "workload given twice"),
    (["cascade", "--page-size", "16", "--shared-len", "100"], "not a multiple of the page size 16"),
    (["append", "--qo-len", "64", "--kv-len", "32"], "cannot append 64 tokens"),
    (["--mem-budget-gb", "-1"], "expected a positive number"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "tritoninfer bench: error:" in err and message in err, err
    assert main(argv) == 2  # main returns the status instead of raising


def test_cli_entry_point_bad_option():
    """``python -m tritoninfer bench`` with no GPU and TRITON_INTERPRET unset: a bad option gives
    argparse's message, in this process (options are parsed before the interpreter switch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tritoninfer", "bench", "--heads", "30/8"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "30 query heads are not a multiple of 8 KV heads" in out.stderr and "re-running" not in out.stderr


# --------------------------------------------------------------------------------------------------
# failures are caught and reported, the sweep goes on
# --------------------------------------------------------------------------------------------------


def test_classify():
    assert classify(NotImplementedError("x"))[0] == "not implemented"
    assert classify(Refused("no fp8")) == ("refused", "no fp8")
    assert classify(RuntimeError("Unsupported group_size: 7"))[0] == "refused"
    assert classify(ValueError("head_dim: bad"))[0] == "refused"
    status, detail = classify(KeyError("boom"))
    assert status == "error" and "KeyError" in detail
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate"))[0] == "error"


class _Fake(Provider):
    workloads = ("decode",)

    def __init__(self, name, behaviour):
        self.name, self.impl, self.behaviour = name, "fake", behaviour

    def setup(self, case):
        if self.behaviour == "refuse":
            raise RuntimeError("Unsupported group_size: 7")
        if self.behaviour == "crash":
            raise KeyError("boom")
        if self.behaviour == "missing":
            raise NotImplementedError("tritoninfer.decode.Nothing does not exist yet")
        good = Sdpa().setup(case)
        if self.behaviour == "wrong":
            return Runner(good.run, lambda: good.check() * 1.5)
        return good


def test_sweep_survives_failures_and_flags_mismatch(capsys):
    shape = Shape("decode", 2, 20, 1, 4, 2, 64, 16)
    providers = [_Fake("tritoninfer", "missing"), _Fake("peer-refuses", "refuse"), _Fake("peer-crashes", "crash"),
                 _Fake("peer-wrong", "wrong"), _Fake("peer-good", "ok"), Sdpa()]
    sweep = Sweep("decode", torch.device("cpu"), TimingConfig.for_cpu(TimingConfig()), 1e9, 60 << 20,
                  progress=False)
    wr = sweep.run([shape], providers)
    by = {r.provider: r for r in wr.results}
    assert by["tritoninfer"].status == "not implemented"
    assert by["peer-refuses"].status_text() == "refused: RuntimeError: Unsupported group_size: 7"
    assert by["peer-crashes"].status == "error" and sweep.tracebacks
    assert by["peer-good"].ok and by["sdpa"].ok
    assert by["peer-wrong"].ok and by["peer-wrong"].mismatch and by["peer-wrong"].check_text() == "MISMATCH"
    assert by["peer-good"].match is True
    assert "MISMATCH" in capsys.readouterr().err
    assert "refused" in report.cell(by["peer-refuses"]) and "MISMATCH" in report.cell(by["peer-wrong"])


def test_sweep_gives_up_on_a_provider_failing_the_same_way():
    shapes = [Shape("decode", 1, n, 1, 4, 2, 64, 16) for n in (16, 20, 24, 28)]
    sweep = Sweep("decode", torch.device("cpu"), TimingConfig.for_cpu(TimingConfig()), 1e9, 60 << 20,
                  progress=False)
    wr = sweep.run(shapes, [_Fake("peer-crashes", "crash"), Sdpa()])
    crashes = [r for r in wr.results if r.provider == "peer-crashes"]
    assert [r.status for r in crashes] == ["error"] * Sweep.GIVE_UP + ["skipped"]
    assert "in a row" in crashes[-1].detail
    assert all(r.ok for r in wr.results if r.provider == "sdpa")


# --------------------------------------------------------------------------------------------------
# files: CSV, markdown, PNG
# --------------------------------------------------------------------------------------------------


def _synthetic(workload):
    shapes = {
        "decode": [Shape("decode", b, n, 1, 32, 8, 128, 16) for b in (1, 16) for n in (1024, 4096)],
        "prefill": [Shape("prefill", 4, 4096, 4096, 32, 8, 128, 16, causal=c) for c in (True, False)],
    }[workload]
    wr = WorkloadResults(workload)
    for s in shapes:
        ti = Result(s, "tritoninfer", "ti", timing=Timing("CUDA graph", 10.0, 9.0, 11.0, 30.0, 20.0, 50.0),
                    bytes=bytes_moved(s), flops=flops(s), rel_err=3e-3, tol=1.6e-2, match=True,
                    check_against="reference")
        fi = Result(s, "flashinfer-tc", "fi", timing=Timing("CUDA graph", 12.0, 11.0, 13.0, 40.0, 25.0, 60.0),
                    bytes=bytes_moved(s), flops=flops(s), speedup=1.2, speedup_eager=1.33)
        cc = Result(s, "flashinfer-cc", "fc", status="refused", detail="RuntimeError: Unsupported group_size: 7")
        wr.results += [ti, fi, cc]
    return wr


@pytest.mark.parametrize("workload", ["decode", "prefill"])
def test_report_files(tmp_path, workload):
    wr = _synthetic(workload)
    env = report.environment(torch.device("cpu"), 0.5, None)
    for key in ("device", "driver", "torch", "triton", "flashinfer", "git commit", "date (UTC)"):
        assert key in env
    csv_path = report.write_csv(wr, tmp_path / f"{workload}.csv")
    png = report.plot(wr, tmp_path / f"{workload}.png", env, 4.3, cpu_only=False)
    md = report.write_markdown(wr, tmp_path / f"{workload}.md", env, "tritoninfer bench", False, [png])

    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert len(rows) == len(wr.results)
    ti = next(r for r in rows if r["provider"] == "tritoninfer")
    assert float(ti["time_us"]) == 10.0 and ti["check"] == "ok" and float(ti["bytes"]) == ti_bytes(wr)
    fi = next(r for r in rows if r["provider"] == "flashinfer-tc")
    assert float(fi["speedup"]) == pytest.approx(1.2)
    assert next(r for r in rows if r["provider"] == "flashinfer-cc")["status"] == "refused"

    text = md.read_text()
    assert text.startswith(f"# tritoninfer bench: {workload}")
    for needle in ("| device |", "| git commit |", "| torch |", "| flashinfer |", "## Summary", "## All rows",
                   "tritoninfer", "flashinfer-tc", "refused", "×1.20", f"![{workload}]({workload}.png)"):
        assert needle in text, needle
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 100


def ti_bytes(wr):
    return next(r for r in wr.results if r.provider == "tritoninfer").bytes


def test_git_commit_reads_dot_git(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / ".git" / "refs" / "heads").mkdir(parents=True)
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".git" / "refs" / "heads" / "main").write_text(sha + "\n")
    (tmp_path / "pkg").mkdir()
    assert report.git_commit(tmp_path / "pkg") == sha
    (tmp_path / ".git" / "refs" / "heads" / "main").unlink()
    (tmp_path / ".git" / "packed-refs").write_text(f"# pack-refs\n{sha} refs/heads/main\n")
    assert report.git_commit(tmp_path / "pkg") == sha


def test_working_tree_modified_sees_changed_tracked_files(tmp_path):
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run([git, *cmd], cwd=tmp_path, check=True, env=env)
    assert report.working_tree_modified(tmp_path / "pkg" / "m.py") is False
    (tmp_path / "pkg" / "m.py").write_text("x = 2\n")
    assert report.working_tree_modified(tmp_path / "pkg" / "m.py") is True
    assert report.working_tree_modified(Path("/")) is None


# --------------------------------------------------------------------------------------------------
# end to end through the interpreter
# --------------------------------------------------------------------------------------------------


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _check_rows(rows, compared=("reference", "sdpa", "flex")):
    assert rows
    for r in rows:
        p = r["provider"]
        if p.startswith("flashinfer"):
            assert r["status"] == "not installed"  # no GPU here
        elif p == "tritoninfer":
            # Until a wrapper lands its rows say "not implemented"; once it has a result it must match.
            assert r["status"] in ("ok", "not implemented"), (r["shape"], r["status"], r["detail"])
            if r["status"] == "ok":
                assert r["check"] == "ok" and r["check_against"] in ("reference", "appended values"), (r["shape"], r["rel_err"])
                assert float(r["rel_err"]) <= float(r["tol"])
        elif p in compared:
            assert r["status"] == "ok", (p, r["shape"], r["detail"])
            assert r["check"] in ("ok", "baseline"), (p, r["shape"], r["rel_err"])
            assert float(r["time_us"]) > 0


def _untimed(text):
    """No timing, ratio or bandwidth in a CPU run's report (shape labels hold "1×20", a speed-up " ×0.66")."""
    for needle in ("µs", "TB/s", "TFLOP/s", "speed-up", "roofline"):
        assert needle not in text, needle
    assert not re.search(r" ×\d", text)


def test_quick_decode_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["decode", "--quick", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "CPU ONLY" in printed and "say nothing about GPU speed" in printed
    rows = _read(out / "decode.csv")
    assert len({r["shape"] for r in rows}) == 4
    _check_rows(rows)
    assert any(r["provider"] == "reference" and r["check"] == "baseline" for r in rows)
    # the CPU run prints the checks only, and ends with the one verdict over every compared output
    _untimed(printed)
    compared = sum(r["check"] in ("ok", "MISMATCH") for r in rows)
    lines = printed.strip().splitlines()
    assert lines[-1] == f"check: all {compared} outputs match the reference: OK"
    assert sum(line.startswith("check:") for line in lines) == 1
    assert all(r["speedup"] == "" for r in rows)
    md = (out / "decode.md").read_text()
    assert "CPU ONLY" in md and "| device | cpu" in md
    _untimed(md)
    assert (out / "decode.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_mismatch_verdict(tmp_path, capsys, monkeypatch):
    """A CPU run where one output is wrong: the last line names it, and the exit status is 1."""
    monkeypatch.setattr(runner, "select", lambda *args: [_Fake("peer-wrong", "wrong"), _Fake("peer-good", "ok"),
                                                         Sdpa()])
    argv = ["decode", "--quick", "--batch", "1", "--kv-len", "20", "--out", str(tmp_path), "--no-progress",
            "--no-plots"]
    assert main(argv) == 1
    printed = capsys.readouterr().out
    _untimed(printed)
    label = Shape("decode", 1, 20, 1, 4, 2, 64, 16).label()
    assert printed.strip().splitlines()[-1] == f"check: 1 of 2 outputs mismatch: peer-wrong on decode {label}"
    assert "MISMATCH (" in printed and sum(line.startswith("check:") for line in printed.splitlines()) == 1
    assert report.verdict([]) == "check: no output was compared with the reference"


def test_quick_other_workloads_end_to_end(tmp_path):
    out = tmp_path / "out"
    argv = ["prefill", "--quick", "--out", str(out), "--no-progress", "--mask", "causal", "--kv-form", "paged",
            "--no-plots"]
    assert main(argv) == 0
    _check_rows(_read(out / "prefill.csv"))
    assert not (out / "prefill.png").exists()
    for workload in ("append", "cascade"):
        assert main([workload, "--quick", "--out", str(out), "--no-progress", "--batch", "2"]) == 0
        rows = _read(out / f"{workload}.csv")
        _check_rows(rows, compared=("reference",))
        assert (out / f"{workload}.md").exists() and (out / f"{workload}.png").exists()


def test_prefill_ws_experiment_smoke():
    """benchmarks/prefill_ws.py (the warp-specialised prefill experiment) agrees with tritoninfer's
    prefill through the interpreter, so the script is ready for a GPU run."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "benchmarks/prefill_ws.py", "--smoke"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if "16-16-ws" in line]
    assert len(rows) == 2 and "MISMATCH" not in out.stdout


# ---- the sampling group --------------------------------------------------------------------------


def test_sampling_group_runs_checks_and_writes_its_table(tmp_path, capsys):
    from tritoninfer.bench import sampling as bs

    status = main(["sampling", "--functions", "top_k_top_p_sampling_from_probs,top_p_renorm_probs",
                   "--providers", "tritoninfer,torch", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    table = (tmp_path / "sampling.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| top_")]
    assert len(rows) == 2 and all(ln.rstrip(" |").endswith("ok") for ln in rows), table
    assert bs.bytes_moved("top_p_renorm_probs", 2, 10) == 2 * 2 * 10 * 4
    assert bs.bytes_moved("top_p_sampling_from_probs", 2, 10) == 2 * 10 * 4 + 2 * 4


def test_sampling_group_check_catches_a_token_outside_the_set():
    from tritoninfer.bench import sampling as bs

    probs = torch.softmax(torch.randn(4, 200) * 3, -1)
    smallest = probs.argmin(-1).to(torch.int32)
    want = bs.torch_way("top_k_sampling_from_probs")
    assert bs._check("top_k_sampling_from_probs", probs, smallest, want) != "ok"
    largest = probs.argmax(-1).to(torch.int32)
    assert bs._check("top_k_sampling_from_probs", probs, largest, want) == "ok"
    renorm = bs.torch_way("top_k_renorm_probs")
    assert bs._check("top_k_renorm_probs", probs, renorm(probs) * 1.01, renorm) != "ok"


def test_sampling_group_bad_function(capsys):
    assert main(["sampling", "--functions", "top_q_sampling"]) == 2
    assert "top_q_sampling" in capsys.readouterr().err


# ---- the groups that share bench.groups: mla, pod, sparse, rope-append ----------------------------


def _md_rows(path: Path):
    """The rows of the markdown table in ``path`` as dicts (header -> cell)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|") and not ln.startswith("| |")]
    lines = [ln for ln in lines if not set(ln) <= set("|-: ") and not ln.startswith("| device")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    table = [c for c in cells if len(c) == len(cells[-1])]
    return [dict(zip(table[0], c)) for c in table[1:]]


def _no_times(rows):
    """A CPU run leaves every time, bandwidth, ratio and roofline cell empty."""
    for r in rows:
        for k, v in r.items():
            if any(w in k for w in ("µs", "TB/s", "TFLOP", "roofline", "/ours", "of copy", "p20")):
                assert v == "", (k, v)


def test_bench_help_lists_every_group(capsys):
    from tritoninfer.bench.groups import GROUPS

    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"tritoninfer bench {name}" in text for name in GROUPS)
    for name in GROUPS:
        assert main([name, "--help"]) == 0
        assert f"usage: tritoninfer bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["mla", "--shapes", "1:2:3"], ["pod", "--providers", "flashinfer"],
                                  ["sparse", "--sparsity", "1.5"], ["rope-append", "--kind", "verify"]])
def test_group_bad_option(argv, capsys):
    assert main(argv) == 2
    assert "error: argument" in capsys.readouterr().err


def test_group_counts_by_hand():
    from tritoninfer.bench import mla as bm, rope_append as br

    nbytes, flops = bm.counts((128, 64, 64, 8192, 1))
    assert nbytes == 64 * 8192 * 576 * 2 + 64 * 128 * (576 + 512) * 2
    assert flops == 2 * 128 * 8192 * (576 + 512) * 64
    # memory-bound: 1 TB at 2 TB/s takes 0.5 s; 1 s measured is half the roofline
    assert bm.roofline_fraction(1e12, 1.0, 1e6, 2.0, 790.0) == pytest.approx(0.5)
    assert bm.roofline_fraction(1.0, 790e12, 2e6, 4.0, 790.0) == pytest.approx(0.5)  # compute-bound
    llama = br.Config(32, 8, 128, 128, 16, torch.bfloat16, torch.float8_e4m3fn, "NHD", 4096)
    # q/k/v read in bf16, written in fp8; the cos/sin row in float32; five int32 indices
    per_token = (4096 + 2 * 1024) * 2 + 128 * 4 + 5 * 4 + (4096 + 2 * 1024)
    assert br.bytes_moved(llama, 4096) == 4096 * per_token == 4096 * 18964


@pytest.mark.parametrize("group,rows", [("mla", 2), ("pod", 3), ("sparse", 4), ("rope-append", 12)])
def test_group_runs_end_to_end(group, rows, tmp_path, capsys):
    """Each group on the CPU: tiny shapes through the interpreter, every tritoninfer output checked
    and passing, FlashInfer's rows saying it is absent (rope-append's same-size copy rows: a reference),
    the table written to DIR/GROUP.md."""
    status = main([group, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert status == 0, out
    md = tmp_path / f"{group}.md"
    text = md.read_text()
    assert "CPU ONLY" in text and "| device | cpu" in text and f"tritoninfer bench {group}" in text
    table = _md_rows(md)
    assert len(table) == rows, text
    for r in table:
        who = r.get("provider") or r.get("implementation") or "tritoninfer"
        want = "not installed" if "FlashInfer" in who or who == "flashinfer" else \
            "reference row" if who == "copy" else "ok ("
        assert r["check"].startswith(want), (who, r["check"])
    _no_times(table)


def _perturb(result):
    """The same output(s) with every value doubled: a wrong answer of the right shape."""
    if isinstance(result, tuple):
        return tuple(_perturb(r) for r in result)
    return result * 2


@pytest.mark.parametrize("group", ["mla", "pod", "sparse", "rope-append"])
def test_group_check_catches_a_wrong_output(group, tmp_path, monkeypatch, capsys):
    import tritoninfer.mla, tritoninfer.pod, tritoninfer.rope, tritoninfer.sparse

    if group == "rope-append":
        real = tritoninfer.rope.rope_quantize_fp8_append_paged_kv_cache

        def wrong(*args, **kwargs):  # drops the last token's K/V
            args = list(args)
            args[10] = args[10].clone()
            args[10][-1] = -1
            return real(*args, **kwargs)

        monkeypatch.setattr(tritoninfer.rope, "rope_quantize_fp8_append_paged_kv_cache", wrong)
        argv = ["rope-append", "--tokens", "3", "--kind", "prefill"]
    else:
        cls = {"mla": tritoninfer.mla.BatchMLAPagedAttentionWrapper, "pod": tritoninfer.pod.PODWithPagedKVCacheWrapper,
               "sparse": tritoninfer.sparse.BlockSparseAttentionWrapper}[group]
        real_run = cls.run

        def wrong_run(self, *args, **kwargs):
            result = real_run(self, *args, **kwargs)
            out = kwargs.get("out")
            if out is not None:
                out.mul_(2)
                return out
            return _perturb(result)

        monkeypatch.setattr(cls, "run", wrong_run)
        argv = [group] + (["--quick"] if group == "mla" else [])
    assert main(argv + ["--out", str(tmp_path)]) == 1
    assert "MISMATCH" in (tmp_path / f"{group}.md").read_text()
    capsys.readouterr()


def test_group_peer_rows_and_ratio(tmp_path, monkeypatch, capsys):
    """A peer that answers like FlashInfer (here tritoninfer's own module standing in) gets its own
    checked row; past --ref-max-tokens the MLA check compares ours with the peer's output."""
    import types

    import tritoninfer.mla, tritoninfer.rope
    from tritoninfer.bench import groups

    fake = {"mla": tritoninfer.mla, "rope": tritoninfer.rope}
    monkeypatch.setattr(groups, "peer_flashinfer", lambda sub: (fake[sub], ""))
    assert main(["mla", "--quick", "--backends", "fa2", "--ref-max-tokens", "1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "mla.md").read_text()
    assert "FI fa2 µs" in text and "ok (" in text and "vs FlashInfer" in text
    assert main(["rope-append", "--tokens", "3", "--kind", "decode", "--out", str(tmp_path)]) == 0
    rows = _md_rows(tmp_path / "rope-append.md")
    assert [r["provider"] for r in rows] == ["tritoninfer", "flashinfer", "copy"]
    assert [r["check"].split(" (")[0] for r in rows] == ["ok", "ok", "reference row"]
    # the real lookup refuses tritoninfer registered as flashinfer: it would time tritoninfer twice
    monkeypatch.undo()
    shim = types.ModuleType("flashinfer")
    shim.__tritoninfer_version__ = "0"
    monkeypatch.setitem(sys.modules, "flashinfer", shim)
    monkeypatch.setitem(sys.modules, "flashinfer.rope", types.ModuleType("flashinfer.rope"))
    mod, why = groups.peer_flashinfer("rope")
    assert mod is None and "install_as_flashinfer" in why
    capsys.readouterr()


def test_group_fp8_code_check():
    from tritoninfer.bench import groups

    want = torch.linspace(-3, 3, 400).to(torch.float8_e4m3fn)
    assert groups.check_fp8_codes(want.clone(), want) == "ok (codes equal)"
    near = want.clone().view(torch.uint8)
    near[7] += 1  # one code away, on 1 of 400 elements: an FMA's rounding
    assert groups.check_fp8_codes(near.view(torch.float8_e4m3fn), want).startswith("ok")
    far = want.clone().view(torch.uint8)
    far[7] += 2
    assert groups.check_fp8_codes(far.view(torch.float8_e4m3fn), want).startswith("MISMATCH")
    x = torch.randn(20, 8)
    assert groups.check_close(x * 1.001, x, 1e-2).startswith("ok")
    assert groups.check_close(x * 1.1, x, 1e-2).startswith("MISMATCH")
    assert groups.check_close(torch.full_like(x, float("nan")), x, 1e-2) == "MISMATCH (NaN)"


def test_group_tables_with_times():
    """What a GPU run prints, from made-up times: ratios are peer / ours, the roofline the larger bound."""
    from tritoninfer.bench import groups, mla as bm, pod as bp

    shape = (128, 64, 64, 8192, 1)
    nbytes, flops = bm.counts(shape)
    row = bm.Row(shape, ours_us=250.0, peers_us={"fa2": 300.0, "fa3": 245.0}, nbytes=nbytes, flops=flops,
                 check="ok (1e-3)")
    line = bm.table([row], ["fa2", "fa3"], 4.0, 790.0).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5:9] == ["250.0", "300.0", "245.0", "0.98"]
    bound_us = max(nbytes / 4e6, flops / 790e6)  # the memory bound: 0.61 TB at 4 TB/s
    assert cells[11] == f"{bound_us / 250:.0%}" and cells[12] == f"{bound_us / 245:.0%}"
    rows = [bp.Row((64, 4096, 4096), "tritoninfer-pod", 100.0), bp.Row((64, 4096, 4096), "flashinfer-pod", 120.0),
            bp.Row((64, 4096, 4096), "tritoninfer-separate", 90.0)]
    assert groups.at_least_as_fast(rows, "tritoninfer-pod", "flashinfer-pod", "x") == "**x: 1 of 1**"
    assert groups.at_least_as_fast(rows, "tritoninfer-pod", "tritoninfer-separate", "y") == "**y: 0 of 1**"
    assert "| 1.20 " in bp.table([dataclasses.replace(r, p20_us=1.0, p80_us=2.0) for r in rows])


# ---- issue 25's grid (--grid) and the goal mark ---------------------------------------------------

from tritoninfer.bench import grid as bg  # noqa: E402


def test_grid_axes_are_the_issues():
    names = lambda axes: {a.name: a.values for a in axes}  # noqa: E731
    d = names(bg.DECODE_AXES)
    assert d["page"] == (1, 16, 64) and d["head_dim"] == (64, 128, 256)
    assert d["heads"] == ((32, 32), (32, 8), (28, 4), (64, 8), (16, 2)) and d["kv_dtype"] == (BF16, E4M3)
    assert d["batch"] == (1, 16, 64, 256) and d["kv_len"] == (1024, 4096, 32768)
    p = names(bg.PREFILL_AXES)
    assert p["page"] == (1, 16, 32) and p["head_dim"] == (64, 128, 256) and p["causal"] == (True, False)
    assert p["lengths"] == ((16, 1024), (4, 4096), (1, 16384)) and p["kv_dtype"] == (BF16, E4M3)
    assert len(bg.grid_rows("decode", "full")) == 3 * 3 * 5 * 2 * 4 * 3
    assert len(bg.grid_rows("prefill", "full")) == 3 * 3 * 2 * 3 * 2


@pytest.mark.parametrize("workload", ["decode", "prefill"])
@pytest.mark.parametrize("gpu", [True, False])
def test_grid_star_has_every_value_with_the_others_at_defaults(workload, gpu):
    axes = bg.axes_of(workload, gpu)
    points = [bg.point_of(workload, axes, r.shape) for r in bg.grid_rows(workload, "pairs", gpu=gpu)]
    assert len(points) == len(set(points))
    defaults = tuple(a.default for a in axes)
    assert defaults in points
    for i, a in enumerate(axes):
        for v in a.values:
            assert defaults[:i] + (v,) + defaults[i + 1:] in points, (a.name, v)
    star = bg.grid_rows(workload, "star", gpu=gpu)
    assert len(star) == 1 + sum(len(a.values) - 1 for a in axes)
    assert all(r.kind == "star" and r.shape.tag.startswith("star: ") for r in star)


@pytest.mark.parametrize("workload", ["decode", "prefill"])
def test_grid_pairs_cover_every_pair_deterministically(workload):
    axes = bg.axes_of(workload, True)
    rows = bg.grid_rows(workload)
    covered = set()
    for r in rows:
        covered |= bg.pairs_of(tuple(a.values.index(v) for a, v in zip(axes, bg.point_of(workload, axes, r.shape))))
    assert bg.all_pairs(axes) <= covered
    # e.g. page 1 with head_dim 256, and fp8 with 28/4 heads
    pts = [bg.point_of(workload, axes, r.shape) for r in rows]
    if workload == "decode":
        assert any(p[0] == 1 and p[1] == 256 for p in pts) and any(p[2] == (28, 4) and p[3] == E4M3 for p in pts)
    # the pairwise rows fit the planning budget; the same call gives the same rows
    for r in rows:
        if r.kind == "pairs":
            assert input_bytes(r.shape) * num_copies(r.shape, bg.H200_L2, True) <= bg.PLAN_BUDGET
    again = bg.grid_rows(workload)
    assert [(r.shape, r.shape.tag) for r in again] == [(r.shape, r.shape.tag) for r in rows]
    assert len(rows) < {"decode": 40, "prefill": 20}[workload]  # a sample, not the product
    # rows sharing a FlashInfer JIT module are adjacent
    keys = [(r.shape.head_dim, r.shape.kv_dtype) for r in rows]
    assert all(k not in keys[:i] or keys[i - 1] == k for i, k in enumerate(keys))


def test_grid_extra_rows_are_seeded():
    base = bg.grid_rows("prefill")
    more = bg.grid_rows("prefill", extra=5)
    again = bg.grid_rows("prefill", extra=5)
    assert [r.shape for r in more] == [r.shape for r in again]
    extra = [r for r in more if r.kind == "random"]
    assert len(extra) == 5 and len({r.shape for r in more}) == len(base) + 5
    assert {r.shape for r in base} <= {r.shape for r in more}


_PROVIDERS = {"decode": ["tritoninfer", "flashinfer-tc", "flashinfer-cc"],
              "prefill": ["tritoninfer", "flashinfer-fa2", "flashinfer-fa3"]}


@pytest.mark.parametrize("mode", ["pairs", "star"])
def test_grid_parts_partition_the_grid(mode):
    whole = bg.plan(["decode", "prefill"], mode, 0, True, TimingConfig(), _PROVIDERS, 1)
    for n in range(1, 8):
        p = bg.plan(["decode", "prefill"], mode, 0, True, TimingConfig(), _PROVIDERS, n)
        parts = [p.part_rows(k) for k in range(n)]
        assert [r.shape for part in parts for r in part] == [r.shape for r in whole.rows]  # in order, once each
        for w in ("decode", "prefill"):
            assert [s for k in range(n) for s in p.shapes(w, k)] == whole.shapes(w, None)
        assert all(p.seconds(part) > 0 for part in parts if part)
    assert bg.split([1, 1, 1, 1], 2) == [0, 0, 1, 1] and bg.split([5, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1, 1]
    assert bg.split([1, 1], 5) == [1, 3] and bg.split([], 3) == []
    text = p.text(2)
    assert "part 3/7" in text and "<- this run" in text and "FlashInfer JIT modules" in text
    assert bg.suggest_parts(whole) >= 1


def test_grid_estimate_counts_compiles_once_per_part():
    p = bg.plan(["decode"], "pairs", 0, True, TimingConfig(), _PROVIDERS, 1)
    rows = p.rows
    keys = set().union(*(bg.compile_keys(r.shape, _PROVIDERS["decode"]) for r in rows))
    modules = {k for k in keys if k[0] == "flashinfer"}
    assert len(modules) == 2 * 3 * 2  # cc and tc × head_dim × KV dtype: the pairs hold every head_dim × dtype
    assert p.counts("decode") == (len(rows), len({(r.shape.head_dim, r.shape.kv_dtype, r.shape.page_size)
                                                  for r in rows}), len(modules))
    assert p.seconds(rows) == pytest.approx(bg.STARTUP_S + bg.compile_seconds(keys)
                                            + sum(p._row_s(r) for r in rows))


def _timed(shape, provider, us, status="ok"):
    t = Timing("CUDA graph", us, us, us) if status == "ok" else None
    return Result(shape, provider, status=status, timing=t, bytes=bytes_moved(shape), flops=flops(shape))


def test_goal_mark_and_summary(tmp_path):
    shapes = [Shape("decode", b, 4096, 1, 32, 8, 128, 16, tag="grid: pairs") for b in (1, 16, 64, 256)]
    wr = WorkloadResults("decode")
    cases = [
        [("tritoninfer", 100.0), ("flashinfer-tc", 94.0), ("flashinfer-cc", 120.0)],  # 0.94: below
        [("tritoninfer", 100.0), ("flashinfer-tc", 130.0), ("flashinfer-cc", 96.0)],  # 0.96: not below
        [("tritoninfer", None), ("flashinfer-tc", 50.0), ("flashinfer-cc", None)],  # no time: below
        [("tritoninfer", 100.0), ("flashinfer-tc", None), ("flashinfer-cc", None)],  # no FlashInfer time
    ]
    for s, case in zip(shapes, cases):
        rows = [_timed(s, p, us) if us else _timed(s, p, 0, "error") for p, us in case]
        Sweep.ratios(rows)
        wr.results += rows
    ti = [r for r in wr.results if r.provider == "tritoninfer"]
    assert (ti[0].best_peer, ti[0].vs_best, ti[0].below_goal) == ("flashinfer-tc", pytest.approx(0.94), True)
    assert (ti[1].best_peer, ti[1].vs_best, ti[1].below_goal) == ("flashinfer-cc", pytest.approx(0.96), False)
    assert (ti[2].best_peer, ti[2].vs_best, ti[2].below_goal) == ("flashinfer-tc", None, True)
    assert (ti[3].best_peer, ti[3].below_goal) == ("", None)
    line = report.goal_line(wr)
    assert line.startswith("goal ≥ 0.95× FlashInfer's best (cc or tc): 2 of 3 rows BELOW; worst 0.940× on ")
    assert shapes[0].label() in line and "against flashinfer-tc" in line
    assert "1 of the rows below have no tritoninfer time" in line and "1 rows have no FlashInfer time" in line

    headers, rows = report.summary_rows(wr)
    col = headers.index("vs FlashInfer best")
    assert [r[col] for r in rows] == ["0.940 (tc) BELOW", "0.960 (cc)", "no time (tc) BELOW", ""]
    rows = _read(report.write_csv(wr, tmp_path / "decode.csv"))
    ti_rows = [r for r in rows if r["provider"] == "tritoninfer"]
    assert [r["best_peer"] for r in ti_rows] == ["flashinfer-tc", "flashinfer-cc", "flashinfer-tc", ""]
    assert [r["below_goal"] for r in ti_rows] == ["True", "False", "True", ""]
    assert float(ti_rows[0]["vs_best"]) == pytest.approx(0.94) and ti_rows[2]["vs_best"] == ""
    assert all(r["best_peer"] == "" for r in rows if r["provider"] != "tritoninfer")
    md = report.write_markdown(wr, tmp_path / "decode.md", {"device": "x"}, "tritoninfer bench", False).read_text()
    assert f"**{line}**" in md and "0.940 (tc) BELOW" in md

    # all met; prefill's best is the faster of fa2 and fa3
    s = Shape("prefill", 4, 4096, 4096, 32, 8, 128, 16, causal=True)
    rows = [_timed(s, "tritoninfer", 100.0), _timed(s, "flashinfer-fa2", 150.0), _timed(s, "flashinfer-fa3", 97.0)]
    Sweep.ratios(rows)
    pre = WorkloadResults("prefill", rows)
    assert report.goal_line(pre) == (f"goal ≥ 0.95× FlashInfer's best (fa2 or fa3): met on all 1 rows; worst "
                                     f"0.970× on {s.label()} against flashinfer-fa3")
    assert report.goal_line(WorkloadResults("decode", [_timed(s, "tritoninfer", 1.0)])) is None


def test_parse_grid():
    cfg = cli.parse_args(["all", "--grid", "--grid-part", "2/3", "--grid-extra", "4"])
    assert cfg.workloads == ["decode", "prefill"] and cfg.grid == "pairs" and cfg.grid_part == (2, 3)
    assert cfg.grid_extra == 4 and not cfg.dry_run
    assert cli.parse_args(["prefill", "--grid", "--grid-mode", "full"]).grid == "full"
    assert cli.parse_args(["decode"]).grid is None


@pytest.mark.parametrize("argv, message", [
    (["--grid", "--grid-part", "0/3"], "expected 1 <= K <= N in K/N, got '0/3'"),
    (["--grid", "--grid-part", "4/3"], "expected 1 <= K <= N in K/N, got '4/3'"),
    (["--grid", "--grid-part", "1/0"], "expected 1 <= K <= N"),
    (["--grid", "--grid-part", "a/b"], "expected K/N (part K of N, e.g. 2/3), got 'a/b'"),
    (["--grid", "--grid-part", "3"], "expected K/N"),
    (["--grid", "--grid-part", "1/2/3"], "expected K/N"),
    (["--grid-part", "1/2"], "argument --grid-part: only with --grid"),
    (["--grid-mode", "star"], "argument --grid-mode: only with --grid"),
    (["--grid-extra", "3"], "argument --grid-extra: only with --grid"),
    (["--grid", "--grid-extra", "-1"], "expected a non-negative integer"),
    (["--grid", "--grid-mode", "half"], "invalid choice: 'half'"),
    (["--grid", "--heads", "32/8", "--quick"], "the grid fixes its shapes; leave out --quick, --heads"),
    (["append", "--grid"], "the grid covers decode and prefill (or all), not append"),
])
def test_bad_grid_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "tritoninfer bench: error:" in err and message in err, err


def test_grid_dry_run_and_one_part_end_to_end(tmp_path, capsys):
    assert main(["all", "--grid", "--dry-run", "--grid-part", "2/3"]) == 0
    out = capsys.readouterr().out
    assert "dry run" in out and "<- this run" in out and "part 2/3" in out and "~" in out
    listed = [ln for ln in out.splitlines() if ln.startswith("  part 2/3  ")]
    plan = bg.plan(["decode", "prefill"], "pairs", 0, True, TimingConfig(), {
        "decode": ["tritoninfer", "flashinfer-tc", "flashinfer-cc"],
        "prefill": ["tritoninfer", "flashinfer-fa2", "flashinfer-fa3"]}, 3)
    assert len(listed) == len(plan.part_rows(1)) > 0

    # the CPU's grid, one part of the star: checked against the reference, no timings, no goal line
    argv = ["decode", "--grid", "--grid-mode", "star", "--grid-part", "1/4", "--out", str(tmp_path),
            "--no-progress", "--no-plots"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "grid decode: 8 rows (8 star)" in printed and "goal" not in printed
    rows = _read(tmp_path / "decode.csv")
    cpu = bg.plan(["decode"], "star", 0, False, TimingConfig(),
                  {"decode": ["tritoninfer", "flashinfer-tc", "flashinfer-cc", "reference"]}, 4)
    assert {r["shape"] for r in rows} == {x.shape.label() for x in cpu.part_rows(0)}
    assert all(r["tag"].startswith("star: ") for r in rows)
    assert {r["provider"] for r in rows} == {"tritoninfer", "flashinfer-tc", "flashinfer-cc", "reference"}
    _check_rows(rows)
    assert all(r["best_peer"] == "" for r in rows)


def test_sampling_table_notes_say_how_a_row_was_timed():
    """A row timed another way than by graph replays (a peer whose calls cannot be captured) says so
    under the table; a table without such rows has no notes."""
    from tritoninfer.bench import sampling as bench_sampling

    plain = bench_sampling.Row("top_p_sampling_from_probs", 64, 128256, "tritoninfer", 40.0)
    noted = bench_sampling.Row("top_p_sampling_from_probs", 64, 128256, "flashinfer", 70.0,
                               note="graph capture failed: RuntimeError; time: the kernels' device time")
    assert bench_sampling.notes([plain]) == ""
    text = bench_sampling.notes([plain, noted])
    assert "top_p_sampling_from_probs 64 × 128256, flashinfer: graph capture failed" in text
    assert "tritoninfer" not in text


def test_bench_set_changes_a_constant_for_the_run(monkeypatch):
    """``tritoninfer bench --set MODULE.NAME=VALUE``: taken out of the argv wherever it stands, the
    constant must exist, the value takes its type, and the report's environment lists it."""
    from tritoninfer import _launch, sampling
    from tritoninfer.bench import report, settings

    monkeypatch.setattr(settings, "APPLIED", [])
    monkeypatch.setattr(sampling, "_CAP", sampling._CAP)
    monkeypatch.setattr(_launch, "CACHED_DRIVER_PATH", _launch.CACHED_DRIVER_PATH)
    rest, sets = settings.split_argv(["sampling", "--set", "sampling._CAP=4096", "--quick",
                                      "--set=_launch.CACHED_DRIVER_PATH=0"])
    assert rest == ["sampling", "--quick"] and sets == ["sampling._CAP=4096", "_launch.CACHED_DRIVER_PATH=0"]
    settings.apply(sets)
    assert sampling._CAP == 4096 and _launch.CACHED_DRIVER_PATH is False
    env = report.environment(torch.device("cpu"), None, None)
    assert env["settings (--set)"] == "tritoninfer.sampling._CAP=4096, tritoninfer._launch.CACHED_DRIVER_PATH=False"
    for bad, match in (("sampling._CAP", "MODULE.NAME=VALUE"), ("nosuchmodule.X=1", "no module"),
                       ("sampling._NO_SUCH=1", "has no"), ("sampling._CAP=four", "expected int"),
                       ("_launch.CACHED_DRIVER_PATH=maybe", "boolean")):
        with pytest.raises(settings.SettingError, match=match):
            settings.apply([bad])
    with pytest.raises(settings.SettingError, match="after it"):
        settings.split_argv(["mla", "--set"])


def test_sampling_table_compares_kernel_times_like_for_like():
    """The kernels column divides FlashInfer's kernel time by ours (not by our graph replay), and is
    left empty where either side has no kernel time."""
    from tritoninfer.bench import sampling as bs

    rows = [bs.Row("top_p_sampling_from_probs", 1, 128, "tritoninfer", time_us=20.0, kernels_us=8.0, check="ok"),
            bs.Row("top_p_sampling_from_probs", 1, 128, "flashinfer", time_us=12.0, kernels_us=12.0, check="ok"),
            bs.Row("top_p_renorm_probs", 1, 128, "tritoninfer", time_us=20.0, check="ok"),
            bs.Row("top_p_renorm_probs", 1, 128, "flashinfer", time_us=10.0, kernels_us=10.0, check="ok")]
    lines = [ln.split("|") for ln in bs.table(rows, None).splitlines() if ln.startswith("| top_")]
    head = [h.strip() for h in bs.table(rows, None).splitlines()[0].split("|")]
    col = head.index("FI/ours kernels")
    assert float(lines[0][col]) == 1.5 and float(lines[0][head.index("FI/ours")]) == 0.6
    assert lines[1][col].strip() == ""


def test_mla_group_prefill_rows(tmp_path, capsys):
    """``bench mla --prefill`` on the CPU: the non-absorbed prefill table (qk and vo dims differ), our
    output checked against the reference, FlashInfer's backends absent."""
    assert main(["mla", "--quick", "--prefill", "--prefill-shapes", "2:2:5,1:1:9", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "mla.md").read_text()
    assert "## Non-absorbed prefill" in text and "head_dim_qk 24 / vo 16" in text
    prefill = text.split("## Non-absorbed prefill", 1)[1]
    rows = [line for line in prefill.splitlines() if line.startswith("| ") and "ok (" in line]
    assert len(rows) == 2 and all("vs reference" in r for r in rows)
    capsys.readouterr()


def test_mla_group_prefill_shapes_option():
    from tritoninfer.bench import mla as bm

    assert bm.parse_args(["--prefill-shapes", "16:1:8192"]).prefill_shapes == [(16, 1, 8192)]
    with pytest.raises(SystemExit):
        bm.parse_args(["--prefill-shapes", "16:8192"])
    assert bm.prefill_flops((2, 3, 4), (192, 128)) == 2 * 2 * 320 * 3 * 4 * 5 / 2
