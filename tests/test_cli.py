"""The ``tritoninfer`` command line and the lazy package: ``--version``, an instant ``--help`` that
imports neither torch nor Triton, subcommands that parse their options before switching to the
interpreter (``--help`` and bad options never re-run), and ``import tritoninfer`` re-exporting every
public name without importing a kernel module."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tritoninfer
from tritoninfer import _version, cli

REPO = Path(__file__).resolve().parents[1]
API_MODULES = ("activation", "cascade", "decode", "norm", "page", "prefill", "quantization", "rope", "sampling",
               "sparse", "attention", "pod", "mla")
EXTRAS = {"MaskMode", "PosEncodingMode", "TensorLayout", "__version__", "install_as_flashinfer", "check_errors"}


def _python(code: str, env_drop=(), timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    assert cli.main([flag]) == 0
    assert capsys.readouterr().out == f"tritoninfer {_version.__version__}\n"
    assert tritoninfer.__version__ == _version.__version__


def test_version_matches_the_package_metadata():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1) == _version.__version__


def test_help_and_version_import_nothing_heavy():
    """``tritoninfer --help`` and ``--version`` answer without importing torch, Triton or a kernel."""
    out = _python("import sys\nfrom tritoninfer.cli import main\n"
                  "assert main(['--help']) == 0 and main(['-V']) == 0\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')"
                  " or m.startswith('tritoninfer.kernels')))")
    assert out.returncode == 0, out.stderr
    assert "usage: tritoninfer" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout


def test_entry_point_version_and_bad_command():
    out = subprocess.run([sys.executable, "-m", "tritoninfer", "--version"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"tritoninfer {_version.__version__}\n"
    out = subprocess.run([sys.executable, "-m", "tritoninfer", "bogus"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "unknown command 'bogus'" in out.stderr
    assert cli.main([]) == 2


def test_subcommand_help_and_bad_options_never_rerun():
    """Kernels imported for the GPU before the command runs (TRITON_INTERPRET unset) force a re-run
    under the interpreter, but only once the options parsed: --help and a bad option answer here."""
    code = """
import sys
import tritoninfer.decode  # kernels decorated without the interpreter
from tritoninfer.cli import main
assert main(["bench", "--help"]) == 0
assert main(["demo", "--help"]) == 0
assert main(["bench", "--heads", "30/8"]) == 2
assert main(["demo", "--bogus"]) == 2
"""
    out = _python(code, env_drop=("TRITON_INTERPRET",))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "re-running" not in out.stderr, out.stderr
    assert "usage: tritoninfer bench" in out.stdout and "usage: tritoninfer demo" in out.stdout
    assert "30 query heads are not a multiple of 8 KV heads" in out.stderr
    assert "unrecognized arguments: --bogus" in out.stderr


def test_subcommands_import_no_kernel_before_the_switch():
    """From the command line nothing imports a kernel module before the interpreter switch, so a
    CPU run never needs the re-run; and bench/demo do not import the command line (no loop)."""
    code = """
import sys
import tritoninfer.bench, tritoninfer.demo
from tritoninfer.bench.cli import parse_args as bench_args
from tritoninfer.demo.cli import parse_args as demo_args
bench_args(["--quick"])
demo_args(["--check"])
print(sorted(m for m in sys.modules if m == "triton" or m.startswith(("tritoninfer.kernels", "tritoninfer.cli"))))
"""
    out = _python(code, env_drop=("TRITON_INTERPRET",))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_rerun_under_the_interpreter_when_kernels_were_imported():
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU there is nothing to switch")
    code = """
import tritoninfer.decode  # kernels decorated without the interpreter: this process cannot run them
from tritoninfer.demo import main
raise SystemExit(main(["--num-requests", "1", "--prompt-len", "3", "--gen-len", "1", "--quiet"]))
"""
    out = _python(code, env_drop=("TRITON_INTERPRET",), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "re-running `tritoninfer demo` under TRITON_INTERPRET=1" in out.stderr
    assert "generated tokens" in out.stdout


def test_interpreter_warnings_are_not_shown():
    """The interpreter's numpy warnings (log2 of 0 on the discarded side of a mask) are attributed
    to Triton's interpreter module, which the commands' filter names."""
    import warnings

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from tritoninfer._interpreter_switch import interpreter_warnings_ignored

    zeros = interpreter.TensorHandle(np.zeros(4, np.float32), tl.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        interpreter.interpreter_builder.create_log2(zeros)
        assert [str(w.message) for w in caught] == ["divide by zero encountered in log2"]
        caught.clear()
        with interpreter_warnings_ignored():
            interpreter.interpreter_builder.create_log2(zeros)
        assert caught == []


def test_commands_as_a_user_runs_them(tmp_path):
    """``tritoninfer demo --check`` and ``tritoninfer bench --quick`` from a shell without a GPU:
    they switch to the interpreter themselves, pass, and print no warning."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for argv, last in ((["demo", "--check", "--quiet"], "tolerance 8.0 %: OK"),
                       (["bench", "--quick", "--no-progress", "--no-plots", "--out", str(tmp_path)],
                        "outputs match the reference: OK")):
        out = subprocess.run([sys.executable, "-m", "tritoninfer", *argv], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1].endswith(last), out.stdout[-1000:]
        assert "Warning" not in out.stderr and "re-running" not in out.stderr, out.stderr[-2000:]


# --------------------------------------------------------------------------------------------------
# the lazy package
# --------------------------------------------------------------------------------------------------


def test_all_is_the_api_modules_names_plus_the_extras():
    import importlib

    expected = set(EXTRAS)
    for name in API_MODULES:
        module = importlib.import_module(f"tritoninfer.{name}")
        assert not expected & set(module.__all__), name  # no name exported twice
        expected |= set(module.__all__)
    assert len(tritoninfer.__all__) == len(set(tritoninfer.__all__))
    assert set(tritoninfer.__all__) == expected
    for name in tritoninfer.__all__:
        value = getattr(tritoninfer, name)
        home = tritoninfer._EXPORTS.get(name)
        if home is not None:
            assert value is getattr(importlib.import_module(f"tritoninfer.{home}"), name), name
    assert set(dir(tritoninfer)) >= expected | set(API_MODULES) | {"reference", "testing"}
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        tritoninfer.not_a_name


def test_import_is_lazy_and_everything_resolves_in_a_fresh_process():
    code = """
import sys
import tritoninfer
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton") or m.startswith("tritoninfer.kernels"))
assert loaded == [], loaded
assert tritoninfer.decode.BatchDecodeWithPagedKVCacheWrapper is tritoninfer.BatchDecodeWithPagedKVCacheWrapper
assert tritoninfer.reference.merge_state is not None and tritoninfer.testing.make_paged_kv is not None
assert tritoninfer.kernels.__name__ == "tritoninfer.kernels"
from tritoninfer import page, rmsnorm
namespace = {}
exec("from tritoninfer import *", namespace)
missing = set(tritoninfer.__all__) - set(namespace)
assert not missing, missing
print("ok")
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
