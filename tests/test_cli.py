"""The lazy package: ``import tritoninfer`` re-exports every public name without importing a kernel
module."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tritoninfer

REPO = Path(__file__).resolve().parents[1]
API_MODULES = ("activation", "cascade", "decode", "norm", "page", "prefill", "quantization", "rope")
EXTRAS = {"MaskMode", "PosEncodingMode", "TensorLayout", "__version__", "install_as_flashinfer"}


def _python(code: str, env_drop=(), timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
