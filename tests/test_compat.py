"""tritoninfer.install_as_flashinfer(): the registered module tree, unsupported names, probes and
helpers, and the private wrapper attributes engines use."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types

import pytest
import torch

import tritoninfer
from tritoninfer import _compat, reference, testing
from tritoninfer._compat import UNSUPPORTED, uninstall_flashinfer

from conftest import DEVICE

SUBMODULES = ("decode", "prefill", "cascade", "page", "rope", "norm", "activation", "quantization", "sampling",
              "jit", "utils", "mla", "gemm", "autotuner", "xqa", "attention", "pod", "sparse")


@pytest.fixture
def fi():
    module = tritoninfer.install_as_flashinfer(force=True)
    try:
        yield module
    finally:
        uninstall_flashinfer()


def _flashinfer_modules():
    return {k: m for k, m in sys.modules.items() if k == "flashinfer" or k.startswith("flashinfer.")}


# --------------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------------


def test_install_registers_the_module_tree(fi):
    import flashinfer

    assert flashinfer is fi and flashinfer.__version__ == _compat.FLASHINFER_API_VERSION == "0.5.3"
    assert flashinfer.__tritoninfer_version__ == tritoninfer.__version__
    for name in SUBMODULES:
        module = importlib.import_module(f"flashinfer.{name}")
        assert module is sys.modules[f"flashinfer.{name}"]
        # as in FlashInfer, `from .xqa import xqa` makes flashinfer.xqa the function
        assert getattr(flashinfer, name) is (module.xqa if name == "xqa" else module)
        assert importlib.util.find_spec(f"flashinfer.{name}") is not None
    assert importlib.util.find_spec("flashinfer") is not None  # vLLM's has_flashinfer()
    from flashinfer.decode import fast_decode_plan  # noqa: F401
    from flashinfer.cascade import merge_state  # noqa: F401


@pytest.mark.parametrize("name", ["flashinfer.comm", "flashinfer.fused_moe", "flashinfer.cute_dsl",
                                  "flashinfer.comm.mnnvl"])
def test_unregistered_submodules_are_absent(fi, name):
    """Engines probe these with find_spec or try/except ImportError and fall back."""
    assert importlib.util.find_spec(name.rpartition(".")[0] if name.count(".") > 1 else name) is None
    with pytest.raises(ImportError):
        importlib.import_module(name)


def test_install_is_idempotent(fi):
    before = dict(_flashinfer_modules())
    assert tritoninfer.install_as_flashinfer() is fi
    assert _flashinfer_modules() == before


def test_refuses_a_real_flashinfer_unless_forced(monkeypatch):
    real = types.ModuleType("flashinfer")
    real.__file__ = "/site-packages/flashinfer/__init__.py"
    real_decode = types.ModuleType("flashinfer.decode")
    for k in list(_flashinfer_modules()):
        monkeypatch.delitem(sys.modules, k)
    monkeypatch.setitem(sys.modules, "flashinfer", real)
    monkeypatch.setitem(sys.modules, "flashinfer.decode", real_decode)
    with pytest.raises(RuntimeError, match="real flashinfer is already imported"):
        tritoninfer.install_as_flashinfer()
    assert sys.modules["flashinfer"] is real
    try:
        ours = tritoninfer.install_as_flashinfer(force=True)
        assert sys.modules["flashinfer"] is ours is not real
        assert getattr(sys.modules["flashinfer.decode"], "__tritoninfer_compat__", False)
    finally:
        uninstall_flashinfer()
    assert sys.modules["flashinfer"] is real and sys.modules["flashinfer.decode"] is real_decode


def test_uninstall_removes_only_what_was_registered():
    tritoninfer.install_as_flashinfer(force=True)
    uninstall_flashinfer()
    assert not any(getattr(m, "__tritoninfer_compat__", False) for m in _flashinfer_modules().values())
    uninstall_flashinfer()  # a second call is harmless


def test_wrapper_classes_are_tritoninfers_with_flashinfer_names(fi):
    import flashinfer

    pairs = [
        (flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper, tritoninfer.decode.BatchDecodeWithPagedKVCacheWrapper),
        (flashinfer.decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
         tritoninfer.decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper),
        (flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper, tritoninfer.prefill.BatchPrefillWithPagedKVCacheWrapper),
        (flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper,
         tritoninfer.prefill.BatchPrefillWithRaggedKVCacheWrapper),
    ]
    for compat, core in pairs:
        assert issubclass(compat, core) and compat.__name__ == core.__name__
        assert compat.__module__ in ("flashinfer.decode", "flashinfer.prefill")
        assert getattr(flashinfer, compat.__name__) is compat
        for method in ("__init__", "plan", "begin_forward", "run", "forward", "forward_return_lse"):
            assert inspect.signature(getattr(compat, method)) == inspect.signature(getattr(core, method)), method
    assert issubclass(flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper, flashinfer.BatchDecodeWithPagedKVCacheWrapper)
    assert inspect.signature(flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.run_return_lse) == \
        inspect.signature(tritoninfer.decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.run_return_lse)
    assert flashinfer.fast_decode_plan is flashinfer.decode.fast_decode_plan
    assert inspect.signature(flashinfer.fast_decode_plan) == inspect.signature(tritoninfer.decode.fast_decode_plan)


def test_implemented_functions_are_tritoninfers(fi):
    import flashinfer

    for module, (src, names) in _compat._IMPLEMENTED.items():
        mod = sys.modules[module]
        for name in names:
            assert getattr(mod, name) is getattr(src, name), f"{module}.{name}"
            assert getattr(flashinfer, name) is getattr(src, name), f"flashinfer.{name}"
    assert "quantize_fp8" not in dir(flashinfer.quantization)  # a tritoninfer name, not FlashInfer's


def test_cascade_wrappers(fi):
    import flashinfer

    for name in _compat._CASCADE_WRAPPERS:
        obj = getattr(flashinfer.cascade, name)
        core = getattr(tritoninfer.cascade, name, None)
        if core is not None:
            assert obj is core
        else:
            with pytest.raises(NotImplementedError, match=name):
                obj(torch.empty(8, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------------
# unsupported names
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module,name,feature,is_class", UNSUPPORTED, ids=[f"{m}.{n}" for m, n, _, _ in UNSUPPORTED])
def test_unsupported_names_import_and_raise(fi, module, name, feature, is_class):
    mod = importlib.import_module(module)
    obj = getattr(mod, name)
    assert isinstance(obj, type) == is_class
    with pytest.raises(NotImplementedError) as err:
        obj(torch.empty(1), k=2)
    assert f"{module}.{name}" in str(err.value) and feature in str(err.value)


def test_top_level_reexports_are_the_same_objects(fi):
    import flashinfer

    for module, name in _compat._TOP_LEVEL_REEXPORTS:
        assert getattr(flashinfer, name) is getattr(sys.modules[module], name)


def test_legacy_probe_is_absent(fi):
    """SGLang's should_use_tensor_core tries this FlashInfer <= 0.1.6 helper and falls back on ImportError."""
    with pytest.raises(ImportError):
        from flashinfer.decode import _grouped_size_compiled_for_decode_kernels  # noqa: F401


# --------------------------------------------------------------------------------------------------
# probes and helpers
# --------------------------------------------------------------------------------------------------


def test_get_compute_capability_needs_a_cuda_device(fi):
    from flashinfer.utils import get_compute_capability, is_sm90a_supported

    with pytest.raises(ValueError, match="cuda"):
        get_compute_capability(torch.device("cpu"))
    with pytest.raises(ValueError):
        is_sm90a_supported(torch.device("cpu"))


@pytest.mark.parametrize("cap,cuda,expected", [
    ((9, 0), "12.4", {"is_sm90a_supported"}),
    ((9, 0), "12.2", set()),
    ((10, 0), "12.8", {"is_sm100a_supported"}),
    ((10, 0), "12.6", set()),
    ((12, 0), "12.8", {"is_sm120a_supported"}),
    ((12, 1), "12.9", {"is_sm121a_supported"}),
    ((8, 0), "12.8", set()),
    ((9, 0), None, set()),
])
def test_sm_probes_describe_the_device(fi, monkeypatch, cap, cuda, expected):
    from flashinfer import utils

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    dev = torch.device("cuda", 0)
    assert utils.get_compute_capability(dev) == cap
    for probe in ("is_sm90a_supported", "is_sm100a_supported", "is_sm120a_supported", "is_sm121a_supported"):
        assert getattr(utils, probe)(dev) == (probe in expected), probe
    assert utils.device_support_pdl(dev) == (cap[0] >= 9)
    assert utils.device_support_pdl(torch.device("cpu")) is False


def test_helpers(fi):
    import flashinfer
    from flashinfer import jit, utils
    from flashinfer.decode import _get_range_buf

    buf = _get_range_buf(5, DEVICE)
    assert buf.dtype == torch.int32 and buf.tolist() == [0, 1, 2, 3, 4] and _get_range_buf(5, DEVICE) is buf
    for n in (1, 5, 8, 12):
        torch.testing.assert_close(utils.get_alibi_slopes(n), reference.alibi_slopes(n).float().cpu())
    assert [utils.next_positive_power_of_2(x) for x in (0, 1, 3, 4, 5, 1000)] == [1, 1, 4, 4, 8, 1024]
    assert utils.canonicalize_torch_dtype("bfloat16") is torch.bfloat16
    assert utils.is_float8(torch.empty(1, dtype=torch.float8_e5m2)) and not utils.is_float8(torch.empty(1))
    assert utils.has_flashinfer_jit_cache() is False
    assert jit.has_prebuilt_ops is True and issubclass(jit.MissingJITCacheError, RuntimeError)
    assert utils.PosEncodingMode.ROPE_LLAMA.value == 1 and utils.TensorLayout.HND.value == 1
    with flashinfer.autotune(True):
        pass


# --------------------------------------------------------------------------------------------------
# private attributes
# --------------------------------------------------------------------------------------------------


def _decode_setup(fi, use_tensor_cores, use_cuda_graph, page_size=4, lens=(9, 1, 14)):
    g = torch.Generator().manual_seed(0)
    kv = testing.make_paged_kv(lens, page_size, 2, 32, device=DEVICE, generator=g)
    q = testing.randn((len(lens), 4, 32), torch.float16, DEVICE, generator=g)
    ws = testing.make_workspace(1 << 20, DEVICE)
    kw = {}
    if use_cuda_graph:
        kw = dict(use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEVICE),
                  paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32, device=DEVICE),
                  paged_kv_last_page_len_buffer=torch.zeros(len(lens), dtype=torch.int32, device=DEVICE))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=use_tensor_cores, **kw)
    return w, kv, q


def _ref(kv, q, **kw):
    return reference.batch_decode_with_paged_kv_cache(q, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len,
                                                      **kw)[0]


def test_private_attributes_before_and_after_plan(fi):
    w, kv, q = _decode_setup(fi, True, True)
    for name in ("_cached_module", "_plan_info", "_logits_soft_cap"):
        with pytest.raises(AttributeError):
            getattr(w, name)
    assert w._int_workspace_buffer.numel() == 0 and w._int_workspace_buffer.device == w.device
    assert w._pin_memory_int_workspace_buffer.device.type == "cpu"
    assert w._kv_lens_buffer is None
    assert w._fixed_batch_size == 3 and w._use_tensor_cores is True and w.is_cuda_graph_enabled
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    assert w._logits_soft_cap == 0.0  # FlashInfer stores 0.0 for None (vLLM asserts it)
    assert w._plan_info is not None and w._window_left == -1 and w._sm_scale is None
    w._plan_info = "engine's"
    assert w._plan_info == "engine's"
    testing.assert_close(w.run(q, kv.cache), _ref(kv, q))
    int_ws = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    w.reset_workspace_buffer(testing.make_workspace(1 << 20, DEVICE), int_ws)
    assert w._int_workspace_buffer is int_ws


def test_core_attributes_compat_relies_on(fi):
    """The compat subclasses serve FlashInfer's private attributes from the planned step and the core
    wrappers' construction-time attributes (tritoninfer/_compat.py's docstring names them)."""
    w, kv, q = _decode_setup(fi, False, True)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, sm_scale=0.25, q_data_type=torch.float16)
    for name in ("_step", "_use_cuda_graph", "_paged_kv_indptr_buf", "_paged_kv_indices_buf",
                 "_paged_kv_last_page_len_buf", "_float_workspace_buffer"):
        assert name in vars(w), name
    assert (w._cached_q_data_type, w._cached_kv_data_type) == (torch.float16, torch.float16)
    assert (w._pos_encoding_mode, w._window_left, w._sm_scale, w._rope_scale, w._rope_theta) == ("NONE", -1, 0.25,
                                                                                                None, None)
    assert w._plan_info is w._step.device_plan
    p = fi.BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    p.plan(torch.tensor([0, 1, 2, 3], dtype=torch.int32), kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4,
           causal=True, logits_soft_cap=None)
    assert p._causal is True and p._logits_soft_cap == 0.0 and p._window_left == -1 and p._sm_scale is None


def test_settings_changed_after_plan_raise(fi):
    """FlashInfer's run reads _sm_scale & co.; tritoninfer fixes them at plan time, so writing another
    value after plan raises at once instead of being silently ignored. Writing the planned value is fine."""
    w, kv, q = _decode_setup(fi, True, False)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4, sm_scale=0.2)
    w._sm_scale, w._logits_soft_cap, w._window_left = 0.2, 0.0, -1
    w._logits_soft_cap = None  # FlashInfer's None is its 0.0
    w._cached_q_data_type = "float16"
    testing.assert_close(w.run(q, kv.cache), _ref(kv, q, sm_scale=0.2))
    for name, value in (("_sm_scale", 0.3), ("_window_left", 5), ("_logits_soft_cap", 30.0),
                        ("_pos_encoding_mode", "ROPE_LLAMA"), ("_cached_kv_data_type", torch.bfloat16)):
        with pytest.raises(ValueError, match=f"{name}: tritoninfer fixes the attention settings at plan"):
            setattr(w, name, value)
    assert w._sm_scale == 0.2
    # the deprecated forward() sets the settings itself
    testing.assert_close(w.forward(q, kv.cache, sm_scale=0.3), _ref(kv, q, sm_scale=0.3))
    assert w._sm_scale == 0.3
    tritoninfer.decode.fast_decode_plan(w, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    testing.assert_close(w.run(q, kv.cache), _ref(kv, q))


@pytest.mark.parametrize("form", ["tensor-core-18", "tensor-core-15", "cuda-core-15"])
def test_cached_module_plan_replans_from_the_graph_buffers(fi, form):
    """wrapper._cached_module.plan with FlashInfer's positional module arguments (vLLM's
    fast_plan_decode: 18, SGLang's former in-tree fast_decode_plan: 15) re-plans from the page
    table the engine wrote into the CUDA-graph buffers."""
    use_tc = form.startswith("tensor")
    w, kv, q = _decode_setup(fi, use_tc, True, lens=(3, 6, 2))
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    g = torch.Generator().manual_seed(1)
    kv2 = testing.make_paged_kv((30, 1, 17), 4, 2, 32, device=DEVICE, generator=g)
    q2 = testing.randn(q.shape, torch.float16, DEVICE, generator=g)
    w._paged_kv_indptr_buf.copy_(kv2.kv_indptr)
    w._paged_kv_indices_buf[: kv2.kv_indices.numel()].copy_(kv2.kv_indices)
    w._paged_kv_last_page_len_buf.copy_(kv2.kv_last_page_len)
    ws = (w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer)
    indptr_cpu = kv2.kv_indptr.cpu()
    if use_tc:
        args = ws + (torch.arange(4, dtype=torch.int32), indptr_cpu, kv2.seq_lens.cpu(), 3, 3, 4, 2, 4, True, 32, 32,
                     False)
        if form.endswith("18"):
            args += (-1, -1, False)
    else:
        args = ws + (indptr_cpu, 3, 4, 2, 4, True, -1, 0.0, 32, 32, torch.empty(0, dtype=torch.float16),
                     torch.empty(0, dtype=torch.float16))
    w._plan_info = w._cached_module.plan(*args)
    w._pos_encoding_mode, w._window_left, w._logits_soft_cap = "NONE", -1, 0.0
    w._sm_scale, w._rope_scale, w._rope_theta = None, None, None
    testing.assert_close(w.run(q2, kv2.cache), _ref(kv2, q2))
    with pytest.raises(NotImplementedError):
        w._cached_module.run()


def test_cached_module_plan_needs_the_page_table_buffers(fi):
    w, kv, q = _decode_setup(fi, True, False)
    w.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 32, 4)
    with pytest.raises(ValueError, match="_paged_kv_indptr_buf"):
        w._cached_module.plan(None, None, None, None, kv.kv_indptr.cpu(), kv.seq_lens.cpu(), 3, 3, 4, 2, 4, False,
                              32, 32, False)
