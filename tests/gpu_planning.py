"""pytest plugin: plan as a GPU run plans, while the interpreter runs the kernels.

    PYTHONPATH=tests python -m pytest -p gpu_planning tests/test_decode.py ...

A test without the ``gpu`` marker also runs on a GPU machine (``DEVICE`` is ``"cuda"`` there), where the
planner picks the GPU's tiles and sees the GPU's SMs; an assertion about its choices that holds only
for the interpreter's 16-position tiles and 4 SMs fails there (session 26: a POD test). Under this plugin
the tile functions of ``_plan`` run as on a GPU and the planner sees 132 SMs (an H100 / H200), so such an
assertion fails on the CPU too, and the kernels' logic (masks, splits, merges) runs at the GPU's tile
sizes. Tests inside ``testing.fake_driver_launches`` keep 4 SMs (their tensors are on the CPU: a GPU
machine plans them the same way), and tests marked ``interpreter_plan`` are skipped, as on a GPU.
"""

import contextlib
import functools

import pytest

GPU_SMS = 132


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="plans for the interpreter's tiles and 4 SMs (gpu_planning)")
    for item in items:
        if "interpreter_plan" in item.keywords:
            item.add_marker(skip)


def _as_on_a_gpu(fn, _device):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        real = _device.is_interpreter
        _device.is_interpreter = lambda: False
        try:
            return fn(*args, **kwargs)
        finally:
            _device.is_interpreter = real
    return wrapped


@pytest.fixture(autouse=True)
def _gpu_planning(monkeypatch):
    from tritoninfer import _device, _plan, decode, mla, testing

    monkeypatch.setattr(_device, "INTERPRETER_NUM_SMS", GPU_SMS)
    for module, name in ((_plan, "decode_tiles"), (_plan, "_prefill_tiles"), (mla, "mla_tiles")):
        monkeypatch.setattr(module, name, _as_on_a_gpu(getattr(module, name), _device))
    decode._decode_config.cache_clear()  # (tiles cached by earlier tests)
    fake = testing.fake_driver_launches

    @contextlib.contextmanager
    def fake_with_cpu_sms(*args, **kwargs):
        monkeypatch.setattr(_device, "INTERPRETER_NUM_SMS", 4)
        try:
            with fake(*args, **kwargs) as record:
                yield record
        finally:
            monkeypatch.setattr(_device, "INTERPRETER_NUM_SMS", GPU_SMS)

    monkeypatch.setattr(testing, "fake_driver_launches", fake_with_cpu_sms)
    yield
    decode._decode_config.cache_clear()
