"""Test harness: interpreter switch, seeds, the ``gpu`` and ``interpreter_plan`` markers and NaN-poisoned allocations.

Without a usable CUDA GPU, ``TRITON_INTERPRET=1`` is set here, before any test module imports a
kernel module: Triton reads it when ``@triton.jit`` decorates a function, so it cannot be switched
on later.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tritoninfer import _device  # noqa: E402

ON_GPU = _device.has_gpu()
DEVICE = "cuda" if ON_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        skip = pytest.mark.skip(reason="plans for the interpreter's tiles and 4 SMs")
        marker = "interpreter_plan"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        marker = "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _nan_poison(monkeypatch):
    """Every floating ``torch.empty``/``empty_like`` made during a test starts as NaN.

    An output element that a kernel never writes then shows up as NaN instead of stale memory.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        if t.is_floating_point() and t.numel() > 0:
            t.fill_(float("nan"))
        return t

    def empty(*args, **kwargs):
        return poisoned(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poisoned(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    yield


@pytest.fixture(autouse=True)
def _no_fault_left():
    """A test that makes a kernel report a bad index (tritoninfer/_errors.py) must consume the report
    (``tritoninfer.check_errors()``); one left behind fails the test, so a spurious report cannot
    hide in a later test's plan()."""
    yield
    from tritoninfer import _errors

    try:
        _errors.check_errors() if ON_GPU else _errors.raise_pending()
    except ValueError as exc:
        pytest.fail(f"a kernel reported a fault that the test did not check: {exc}")
