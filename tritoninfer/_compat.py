"""Run unmodified FlashInfer-importing code (SGLang, vLLM, ...) on tritoninfer.

:func:`install_as_flashinfer` registers a ``flashinfer`` package and its submodules in
``sys.modules`` before the engine imports them. Every name they hold is one of three kinds:

- **implemented**: tritoninfer's function or wrapper class (the wrapper classes are thin
  subclasses, below, that add the private attributes engines read and write, see
  ``docs/engines.md``);
- **helpers and probes** with an obvious meaning, implemented truthfully (``get_compute_capability``,
  ``is_sm90a_supported``, ``_get_range_buf``, ``autotune``...);
- **unsupported**: importable, but calling it (a class: constructing it) raises
  ``NotImplementedError`` naming the FlashInfer feature, so an engine imports fine and only a code
  path tritoninfer cannot run fails, loudly.

Submodules that are not registered (``flashinfer.comm``, ``flashinfer.fused_moe``, ``flashinfer.cute_dsl``,
...) stay absent, so ``importlib.util.find_spec`` probes and ``try: import`` fallbacks in engines
see them as missing, which is the truth.

This module imports the public tritoninfer modules only. The wrapper subclasses serve FlashInfer's
private attributes from the core wrappers' planned step (``_step``, see ``tritoninfer/_step.py``) and
their construction-time attributes (``_use_cuda_graph``, ``_paged_kv_indptr_buf``,
``_paged_kv_indices_buf``, ``_paged_kv_last_page_len_buf``, ``_float_workspace_buffer``);
``tests/test_compat.py`` checks them.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from . import _device, _variants
from . import activation as _activation
from . import attention as _attention_api
from . import cascade as _cascade
from . import decode as _decode
from . import logits_processor as _logits_processor
from . import norm as _norm
from . import page as _page
from . import pod as _pod
from . import prefill as _prefill
from . import quantization as _quantization
from . import rope as _rope
from . import sampling as _sampling
from . import sparse as _sparse
from ._options import MaskMode, PosEncodingMode, TensorLayout, canonicalize_dtype
from ._plan import alibi_slopes as _alibi_slopes

__all__ = ["install_as_flashinfer", "uninstall_flashinfer", "FLASHINFER_API_VERSION", "UNSUPPORTED"]

#: The FlashInfer release whose API the registered ``flashinfer`` package reports (``__version__``).
FLASHINFER_API_VERSION = "0.5.3"

_MARK = "__tritoninfer_compat__"


# --------------------------------------------------------------------------------------------------
# unsupported names
# --------------------------------------------------------------------------------------------------


def _message(qualname: str, feature: str) -> str:
    return (
        f"{qualname}: {feature} is not implemented by tritoninfer. tritoninfer.install_as_flashinfer() "
        "registers this name only so that imports succeed; choose an engine option that does not "
        "need it (see tritoninfer's docs/engines.md)."
    )


def _unsupported_function(qualname: str, feature: str) -> Callable[..., Any]:
    def unsupported(*args, **kwargs):
        raise NotImplementedError(_message(qualname, feature))

    module, _, name = qualname.rpartition(".")
    unsupported.__name__ = unsupported.__qualname__ = name
    unsupported.__module__ = module
    unsupported.__doc__ = f"Not implemented by tritoninfer ({feature}): calling it raises NotImplementedError."
    unsupported.__tritoninfer_unsupported__ = feature
    return unsupported


def _unsupported_class(qualname: str, feature: str) -> type:
    module, _, name = qualname.rpartition(".")

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_message(qualname, feature))

    return type(name, (), {
        "__init__": __init__,
        "__module__": module,
        "__doc__": f"Not implemented by tritoninfer ({feature}): constructing it raises NotImplementedError.",
        "__tritoninfer_unsupported__": feature,
    })


# FlashInfer's short dtype names in its JIT module names (flashinfer.jit.utils.filename_safe_dtype_map)
FILENAME_SAFE_DTYPES = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2", torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.uint32: "u32",
    torch.int64: "i64", torch.uint64: "u64",
}

# (module, name, feature, is_class). The home module is where FlashInfer 0.5.3 defines the name;
# names it re-exports at the top level are listed under "flashinfer" too (same object).
_TRTLLM_ATTN = "TensorRT-LLM (trtllm-gen) attention kernels"
_FP4 = "FP4 / MXFP8 quantization"
_GEMM = "FlashInfer's GEMM kernels"
_MOE = "FlashInfer's fused MoE kernels"
UNSUPPORTED: Tuple[Tuple[str, str, str, bool], ...] = (
    # decode / prefill entry points of other backends
    ("flashinfer.decode", "trtllm_batch_decode_with_kv_cache", _TRTLLM_ATTN, False),
    ("flashinfer.decode", "trtllm_batch_decode_with_kv_cache_mla", _TRTLLM_ATTN + " for MLA", False),
    ("flashinfer.decode", "xqa_batch_decode_with_kv_cache", "XQA decode kernels", False),
    ("flashinfer.decode", "cudnn_batch_decode_with_kv_cache", "cuDNN decode attention", False),
    ("flashinfer.prefill", "trtllm_batch_context_with_kv_cache", _TRTLLM_ATTN, False),
    ("flashinfer.prefill", "trtllm_ragged_attention_deepseek", _TRTLLM_ATTN + " for DeepSeek ragged prefill", False),
    ("flashinfer.prefill", "cudnn_batch_prefill_with_kv_cache", "cuDNN prefill attention", False),
    ("flashinfer.prefill", "fmha_varlen", "the CUTLASS (SM100) variable-length FMHA entry point", False),
    ("flashinfer.xqa", "xqa", "XQA decode kernels", False),
    ("flashinfer.xqa", "xqa_mla", "XQA MLA decode kernels", False),
    ("flashinfer.activation", "silu_and_mul_scaled_nvfp4_experts_quantize", _FP4, False),
    # quantization / gemm / moe (top level in FlashInfer)
    *((("flashinfer", n, _FP4, False)) for n in (
        "fp4_quantize", "nvfp4_quantize", "nvfp4_batched_quantize", "nvfp4_block_scale_interleave",
        "block_scale_interleave", "e2m1_and_ufp8sf_scale_to_float", "shuffle_matrix_a", "shuffle_matrix_sf_a",
        "scaled_fp4_grouped_quantize", "mxfp8_quantize", "mxfp4_quantize")),
    ("flashinfer.gemm", "SegmentGEMMWrapper", _GEMM, True),
    *((("flashinfer.gemm", n, _GEMM, False)) for n in (
        "bmm_fp8", "mm_fp4", "mm_fp8", "gemm_fp8_nt_groupwise", "group_gemm_fp8_nt_groupwise")),
    *((("flashinfer", n, _MOE, False)) for n in (
        "cutlass_fused_moe", "trtllm_fp4_block_scale_moe", "trtllm_fp8_block_scale_moe",
        "trtllm_fp8_per_tensor_scale_moe")),
    # utils / jit
    ("flashinfer.utils", "FP4Tensor", "FP4 tensors (NVFP4 outputs of trtllm-gen attention)", True),
    ("flashinfer.jit", "JitSpec", "FlashInfer's CUDA JIT specs (tritoninfer has no CUDA sources)", True),
    ("flashinfer.jit", "build_jit_specs", "building FlashInfer's CUDA JIT modules", False),
    ("flashinfer.jit", "parallel_load_modules", "loading FlashInfer's CUDA JIT modules", False),
    ("flashinfer.jit", "gen_customize_batch_decode_module", "custom CUDA attention variants (jit_args)", False),
    ("flashinfer.jit", "gen_customize_batch_prefill_module", "custom CUDA attention variants (jit_args)", False),
    *((("flashinfer.jit.attention", n, "building FlashInfer's CUDA JIT modules", False)) for n in (
        "gen_batch_prefill_attention_sink_module", "gen_batch_prefill_module", "gen_single_prefill_module",
        "gen_batch_mla_module", "gen_pod_module", "gen_batch_decode_module", "gen_single_decode_module",
        "gen_batch_attention_module")),
)

# flashinfer.sampling's names that FlashInfer also has at its top level (not the *_renorm_prob aliases)
_SAMPLING_TOP_LEVEL = (
    "sampling_from_probs", "sampling_from_logits", "top_p_sampling_from_probs", "top_k_sampling_from_probs",
    "min_p_sampling_from_probs", "top_k_top_p_sampling_from_probs", "top_k_top_p_sampling_from_logits",
    "top_p_renorm_probs", "top_k_renorm_probs", "top_k_mask_logits", "softmax", "chain_speculative_sampling")

# FlashInfer re-exports these at the top level as well.
_TOP_LEVEL_REEXPORTS = (
    ("flashinfer.decode", "BatchDecodeMlaWithPagedKVCacheWrapper"),
    ("flashinfer.decode", "cudnn_batch_decode_with_kv_cache"),
    ("flashinfer.mla", "BatchMLAPagedAttentionWrapper"),
    ("flashinfer.attention", "BatchAttention"),
    ("flashinfer.attention", "BatchAttentionWithAttentionSinkWrapper"),
    ("flashinfer.pod", "PODWithPagedKVCacheWrapper"),
    ("flashinfer.pod", "BatchPODWithPagedKVCacheWrapper"),
    ("flashinfer.sparse", "BlockSparseAttentionWrapper"),
    ("flashinfer.sparse", "VariableBlockSparseAttentionWrapper"),
    ("flashinfer.xqa", "xqa"),
    ("flashinfer.xqa", "xqa_mla"),
    ("flashinfer.page", "append_paged_mla_kv_cache"),
    ("flashinfer.gemm", "SegmentGEMMWrapper"),
    ("flashinfer.gemm", "bmm_fp8"),
    ("flashinfer.gemm", "mm_fp4"),
    ("flashinfer.gemm", "mm_fp8"),
    ("flashinfer.activation", "silu_and_mul_scaled_nvfp4_experts_quantize"),
) + tuple(("flashinfer.sampling", n) for n in _SAMPLING_TOP_LEVEL)


# --------------------------------------------------------------------------------------------------
# helpers and probes implemented for real
# --------------------------------------------------------------------------------------------------


def get_compute_capability(device: torch.device) -> Tuple[int, int]:
    """``(major, minor)`` of a CUDA device (FlashInfer raises for other devices; so does this)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a cuda device, got {device}")
    return torch.cuda.get_device_capability(device.index)


def _cuda_at_least(version: str) -> bool:
    cuda = torch.version.cuda
    if not cuda:
        return False

    def key(v: str) -> Tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    return key(cuda) >= key(version)


def _sm_probe(name: str, ok: Callable[[int, int], bool], cuda: str) -> Callable[[torch.device], bool]:
    def probe(device: torch.device) -> bool:
        major, minor = get_compute_capability(device)
        return ok(major, minor) and _cuda_at_least(cuda)

    probe.__name__ = probe.__qualname__ = name
    probe.__module__ = "flashinfer.utils"
    probe.__doc__ = (f"True when ``device`` has the architecture of {name[3:-10]} and torch's CUDA is at least "
                     f"{cuda}: the same test as FlashInfer's (it describes the device, not tritoninfer).")
    return probe


is_sm90a_supported = _sm_probe("is_sm90a_supported", lambda M, m: M == 9, "12.3")
is_sm100a_supported = _sm_probe("is_sm100a_supported", lambda M, m: M == 10, "12.8")
is_sm110a_supported = _sm_probe("is_sm110a_supported", lambda M, m: M == 11, "13.0")
is_sm120a_supported = _sm_probe("is_sm120a_supported", lambda M, m: (M, m) == (12, 0), "12.8")
is_sm121a_supported = _sm_probe("is_sm121a_supported", lambda M, m: (M, m) == (12, 1), "12.9")


def device_support_pdl(device: torch.device) -> bool:
    """Whether the device supports programmatic dependent launch (compute capability >= 9.0).
    tritoninfer accepts ``enable_pdl`` and ignores it; this only describes the device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return get_compute_capability(device)[0] >= 9


def get_alibi_slopes(n_heads: int) -> torch.Tensor:
    """FlashInfer's ALiBi slopes, float32 ``[n_heads]`` on the CPU."""
    return torch.from_numpy(_alibi_slopes(n_heads).copy())


def next_positive_power_of_2(x: int) -> int:
    """Smallest power of two ``>= x`` (1 for ``x < 1``)."""
    if x < 1:
        return 1
    return 1 << (int(x) - 1).bit_length()


def canonicalize_torch_dtype(dtype) -> torch.dtype:
    """``torch.dtype`` or its name -> ``torch.dtype``."""
    return canonicalize_dtype(dtype, "dtype")


def is_float8(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def has_flashinfer_jit_cache() -> bool:
    """False: FlashInfer's prebuilt ``flashinfer-jit-cache`` kernels are not part of tritoninfer."""
    return False


def _get_range_buf(seq_len: int, device) -> torch.Tensor:
    """Cached ``torch.arange(seq_len, dtype=int32, device=device)`` (FlashInfer's private helper;
    vLLM builds its ``qo_indptr`` with it). Treat the result as read-only."""
    return _device.per_device("range_buf", device,
                              lambda: torch.arange(int(seq_len), dtype=torch.int32, device=device), int(seq_len))


@contextlib.contextmanager
def autotune(tune_mode: bool = True, cache: Optional[str] = None):
    """FlashInfer's autotuner scope. tritoninfer has no autotuned FlashInfer ops, so there is nothing
    to tune: the scope only runs its body."""
    yield


class MissingJITCacheError(RuntimeError):
    """FlashInfer raises it when a kernel is missing from the JIT cache; tritoninfer never does."""


# --------------------------------------------------------------------------------------------------
# wrapper subclasses: the private attributes engines use
# --------------------------------------------------------------------------------------------------

class _CompatAttributes:
    """Private attributes of FlashInfer's wrappers that engines read or write, as properties over the
    wrapper's planned step (``_step``, ``tritoninfer/_step.py``) and its construction-time buffers.

    - ``_int_workspace_buffer`` / ``_pin_memory_int_workspace_buffer``: tritoninfer needs no int
      workspace; they are empty uint8 tensors (on the wrapper's device / the CPU), or whatever
      ``reset_workspace_buffer`` or the engine last stored.
    - ``_kv_lens_buffer``: ``None`` (FlashInfer only allocates it for the trtllm-gen backend).
    - ``_plan_info``: what an engine stored since the last plan, otherwise the plan's device plan.
    - ``_cached_q_data_type``, ``_cached_kv_data_type``: the planned dtypes.
    - ``_pos_encoding_mode``, ``_window_left``, ``_logits_soft_cap``, ``_sm_scale``, ``_rope_scale``,
      ``_rope_theta`` (and prefill's ``_causal``): the planned settings (``_logits_soft_cap`` is ``0.0``
      when planned with ``None``, as FlashInfer stores it; vLLM asserts it). FlashInfer's ``run`` reads
      them, so engines that re-plan through ``_cached_module.plan`` write them afterwards: writing the
      planned value is accepted, another value raises ``ValueError`` at once (tritoninfer fixes them
      at plan time and would otherwise ignore it).
    """

    _kv_lens_buffer = None

    @property
    def _int_workspace_buffer(self) -> torch.Tensor:
        buf = self.__dict__.get("_compat_int_ws")
        if buf is None:
            buf = self.__dict__["_compat_int_ws"] = torch.empty(0, dtype=torch.uint8, device=self.device)
        return buf

    @_int_workspace_buffer.setter
    def _int_workspace_buffer(self, value) -> None:
        self.__dict__["_compat_int_ws"] = value

    @property
    def _pin_memory_int_workspace_buffer(self) -> torch.Tensor:
        buf = self.__dict__.get("_compat_pin_ws")
        if buf is None:
            buf = self.__dict__["_compat_pin_ws"] = torch.empty(0, dtype=torch.uint8)
        return buf

    @_pin_memory_int_workspace_buffer.setter
    def _pin_memory_int_workspace_buffer(self, value) -> None:
        self.__dict__["_compat_pin_ws"] = value

    def _planned(self, name: str):
        step = self.__dict__.get("_step")
        if step is None:
            raise AttributeError(f"{name}: plan() has not been called")
        return step

    @property
    def _plan_info(self):
        step = self._planned("_plan_info")
        stored = self.__dict__.get("_compat_plan_info")
        if stored is not None and stored[0] is step:  # stored since the last plan
            return stored[1]
        return step.device_plan

    @_plan_info.setter
    def _plan_info(self, value) -> None:
        self.__dict__["_compat_plan_info"] = (self.__dict__.get("_step"), value)

    @property
    def _cached_q_data_type(self) -> torch.dtype:
        return self._planned("_cached_q_data_type").q_dtype

    @_cached_q_data_type.setter
    def _cached_q_data_type(self, value) -> None:
        self._check_planned("_cached_q_data_type", self._cached_q_data_type, canonicalize_dtype(value, "dtype"))

    @property
    def _cached_kv_data_type(self) -> torch.dtype:
        return self._planned("_cached_kv_data_type").kv_dtype

    @_cached_kv_data_type.setter
    def _cached_kv_data_type(self, value) -> None:
        self._check_planned("_cached_kv_data_type", self._cached_kv_data_type, canonicalize_dtype(value, "dtype"))

    def _check_planned(self, name: str, planned, value) -> None:
        if value != planned:
            raise ValueError(
                f"{name}: tritoninfer fixes the attention settings at plan() time (planned {planned!r}); "
                f"setting it to {value!r} afterwards would be ignored. Pass it to plan() instead."
            )

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        super().reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)
        self._int_workspace_buffer = int_workspace_buffer


def _setting(name: str, field: str, to_flashinfer=lambda v: v) -> property:
    """A planned setting under FlashInfer's attribute name (see ``_CompatAttributes``)."""

    def get(self):
        return to_flashinfer(getattr(self._planned(name).settings, field))

    def set(self, value) -> None:
        self._check_planned(name, get(self), to_flashinfer(value))

    return property(get, set, doc=f"The planned ``{field}`` (FlashInfer's ``{name}``).")


for _name, _field, _convert in (
        ("_pos_encoding_mode", "pos_encoding_mode", lambda v: v), ("_window_left", "window_left", lambda v: v),
        ("_logits_soft_cap", "logits_soft_cap", lambda v: 0.0 if v is None else v),
        ("_sm_scale", "sm_scale", lambda v: v), ("_rope_scale", "rope_scale", lambda v: v),
        ("_rope_theta", "rope_theta", lambda v: v), ("_causal", "causal", bool)):
    setattr(_CompatAttributes, _name, _setting(_name, _field, _convert))


class _CachedModule:
    """FlashInfer's ``wrapper._cached_module``, the compiled module engines call to re-plan without the
    wrapper's ``plan()``: subclasses give its ``plan``. Holds the wrapper weakly (the wrapper keeps it)."""

    def __init__(self, wrapper) -> None:
        self._wrapper = weakref.ref(wrapper)

    def _target(self):
        w = self._wrapper()
        if w is None:
            raise ReferenceError("the wrapper of this _cached_module no longer exists")
        return w

    def run(self, *args, **kwargs):
        raise NotImplementedError(_message("_cached_module.run", "FlashInfer's compiled-module entry point") +
                                  " Call the wrapper's run() instead.")

    @classmethod
    def of(cls, wrapper) -> "_CachedModule":
        """The wrapper's module, made at the first use after a plan (FlashInfer creates it in plan())."""
        if wrapper.__dict__.get("_step") is None:
            raise AttributeError("_cached_module: FlashInfer creates it in plan(); call plan() first")
        module = wrapper.__dict__.get("_compat_cached_module")
        if module is None:
            module = wrapper.__dict__["_compat_cached_module"] = cls(wrapper)
        return module


class _DecodeModule(_CachedModule):
    """What ``BatchDecodeWithPagedKVCacheWrapper._cached_module`` stands for in FlashInfer: the
    compiled module whose ``plan`` engines call directly to re-plan without copying the page table
    (vLLM's ``fast_plan_decode``, SGLang's former in-tree ``fast_decode_plan``).

    ``plan`` takes FlashInfer's positional argument lists:

    - tensor-core decode (the batch-prefill module): ``(float_ws, int_ws, pinned_ws, qo_indptr_host,
      kv_indptr_host, kv_lens_host, total_num_rows, batch_size, num_qo_heads, num_kv_heads,
      page_size, enable_cuda_graph, head_dim_qk, head_dim_vo, causal[, window_left,
      fixed_split_size, disable_split_kv, ...])``;
    - CUDA-core decode: ``(float_ws, int_ws, pinned_ws, kv_indptr_host, batch_size, num_qo_heads,
      num_kv_heads, page_size, enable_cuda_graph, window_left, logits_soft_cap, head_dim_qk,
      head_dim_vo, empty_q_data, empty_kv_cache[, ...])``.

    The page table is read from the wrapper's ``_paged_kv_indptr_buf`` / ``_paged_kv_indices_buf``
    (the CUDA-graph buffers, or what the engine assigned), exactly as FlashInfer's kernels read
    it; the other settings (pos encoding, sm_scale, rope, dtypes) are those of the previous plan.
    It re-plans through :func:`tritoninfer.decode.fast_decode_plan` and returns the plan, which
    engines store as ``_plan_info``.
    """

    def plan(self, *args):
        w = self._target()
        if w.use_tensor_cores:
            if len(args) < 15:
                raise TypeError(f"_cached_module.plan (tensor-core decode): expected at least 15 arguments, got {len(args)}")
            (_, indptr_host, kv_lens_host, total_rows, batch, num_qo_heads, num_kv_heads, page_size, _,
             head_dim, head_dim_vo, causal) = args[3:15]
            window_left = args[15] if len(args) > 15 else w._window_left
            fixed_split_size = args[16] if len(args) > 16 else None
            disable_split_kv = bool(args[17]) if len(args) > 17 else False
            if int(total_rows) != int(batch):
                raise NotImplementedError("_cached_module.plan with several query tokens per request: use plan(q_len_per_req=...)")
            if causal:
                raise NotImplementedError("_cached_module.plan: causal decode is planned by run(q_len_per_req=...)")
            logits_soft_cap = w._logits_soft_cap
            q_dtype, kv_dtype = w._cached_q_data_type, w._cached_kv_data_type
        else:
            if len(args) < 15:
                raise TypeError(f"_cached_module.plan (decode): expected at least 15 arguments, got {len(args)}")
            (indptr_host, batch, num_qo_heads, num_kv_heads, page_size, _, window_left, logits_soft_cap,
             head_dim, head_dim_vo) = args[3:13]
            q_dtype, kv_dtype = args[13].dtype, args[14].dtype
            kv_lens_host = None
            fixed_split_size, disable_split_kv = None, False
        if head_dim_vo != head_dim:
            raise ValueError(f"_cached_module.plan: decode needs head_dim_qk == head_dim_vo, got {head_dim}/{head_dim_vo}")
        indptr_dev, indices_dev = w._paged_kv_indptr_buf, w._paged_kv_indices_buf
        if indptr_dev is None or indices_dev is None:
            raise ValueError(
                "_cached_module.plan reads the page table from _paged_kv_indptr_buf/_paged_kv_indices_buf: "
                "create the wrapper with use_cuda_graph=True and its buffers, or assign them first"
            )
        batch = int(batch)
        indptr_host = indptr_host.to("cpu", torch.int64)[: batch + 1]
        pages = indptr_host[1:] - indptr_host[:-1]
        if kv_lens_host is not None:
            kv_lens = kv_lens_host.to("cpu", torch.int64)[:batch]
            last = torch.where(pages > 0, kv_lens - (pages - 1) * int(page_size), torch.zeros_like(kv_lens))
        elif int(page_size) == 1:
            last = (pages > 0).to(torch.int64)
        else:
            last = w._paged_kv_last_page_len_buf[:batch].to("cpu", torch.int64)
        if fixed_split_size is not None and int(fixed_split_size) <= 0:
            fixed_split_size = None  # FlashInfer's module encodes "no fixed split" as -1
        _decode.fast_decode_plan(
            w, indptr_dev[: batch + 1], indices_dev, last.to(torch.int32), int(num_qo_heads), int(num_kv_heads),
            int(head_dim), int(page_size), pos_encoding_mode=w._pos_encoding_mode, window_left=int(window_left),
            logits_soft_cap=logits_soft_cap, q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=w._sm_scale,
            rope_scale=w._rope_scale, rope_theta=w._rope_theta, non_blocking=True,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            global_override_indptr_cpu=indptr_host.to(torch.int32),
        )
        return w._step.device_plan

    paged_run = ragged_run = _CachedModule.run


def _subclass(core: type, module: str, extra: Optional[Dict[str, Any]] = None, bases: tuple = ()) -> type:
    namespace = {
        "__module__": module,
        "__qualname__": core.__name__,
        "__doc__": (core.__doc__ or "") + "\n\n(Registered by tritoninfer.install_as_flashinfer(): adds the private "
                   "attributes FlashInfer engines use, see tritoninfer._compat._CompatAttributes.)",
        **(extra or {}),
    }
    return type(core.__name__, bases + (_CompatAttributes, core), namespace)


BatchDecodeWithPagedKVCacheWrapper = _subclass(_decode.BatchDecodeWithPagedKVCacheWrapper, "flashinfer.decode",
                                               {"_cached_module": property(_DecodeModule.of)})
# a subclass of the compat BatchDecodeWithPagedKVCacheWrapper, as in FlashInfer
CUDAGraphBatchDecodeWithPagedKVCacheWrapper = _subclass(_decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                                                        "flashinfer.decode", bases=(BatchDecodeWithPagedKVCacheWrapper,))
BatchPrefillWithPagedKVCacheWrapper = _subclass(_prefill.BatchPrefillWithPagedKVCacheWrapper, "flashinfer.prefill")
BatchPrefillWithRaggedKVCacheWrapper = _subclass(_prefill.BatchPrefillWithRaggedKVCacheWrapper, "flashinfer.prefill")
fast_decode_plan = _decode.fast_decode_plan


# --------------------------------------------------------------------------------------------------
# the module tree
# --------------------------------------------------------------------------------------------------

_PACKAGES = ("flashinfer", "flashinfer.jit", "flashinfer.jit.attention")

# FlashInfer 0.5.3's names implemented by tritoninfer, per home module.
_IMPLEMENTED = {
    "flashinfer.activation": (_activation, ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")),
    "flashinfer.norm": (_norm, ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
                                "layernorm")),
    "flashinfer.page": (_page, ("append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens")),
    "flashinfer.quantization": (_quantization, ("packbits", "segment_packbits")),
    "flashinfer.rope": (_rope, tuple(_rope.__all__)),
    "flashinfer.cascade": (_cascade, ("merge_state", "merge_state_in_place", "merge_states")),
    "flashinfer.decode": (_decode, ("single_decode_with_kv_cache",)),
    "flashinfer.prefill": (_prefill, ("single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse")),
    "flashinfer.sampling": (_sampling, _SAMPLING_TOP_LEVEL),
    "flashinfer.sparse": (_sparse, ("BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper")),
    "flashinfer.attention": (_attention_api, tuple(_attention_api.__all__)),
    "flashinfer.pod": (_pod, tuple(_pod.__all__)),
}

_CASCADE_WRAPPERS = ("MultiLevelCascadeAttentionWrapper", "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
                     "BatchPrefillWithSharedPrefixPagedKVCacheWrapper")

_SUBMODULES = ("decode", "prefill", "cascade", "page", "rope", "norm", "activation", "quantization", "sampling",
               "logits_processor", "jit", "jit.attention", "jit.attention.variants", "jit.utils", "utils", "mla", "gemm",
               "autotuner", "xqa", "attention", "pod", "sparse")

_DOCS = {
    "flashinfer": "tritoninfer registered as ``flashinfer`` (FlashInfer {v} API) by tritoninfer.install_as_flashinfer().",
}


def _module_contents() -> Dict[str, Dict[str, Any]]:
    contents: Dict[str, Dict[str, Any]] = {f"flashinfer.{s}": {} for s in _SUBMODULES}
    contents["flashinfer"] = {}
    for module, (src, names) in _IMPLEMENTED.items():
        for name in names:
            contents[module][name] = getattr(src, name)
    contents["flashinfer.decode"].update(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        CUDAGraphBatchDecodeWithPagedKVCacheWrapper=CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
        fast_decode_plan=fast_decode_plan,
        _get_range_buf=_get_range_buf,
    )
    contents["flashinfer.sampling"].update(
        top_k_renorm_prob=_sampling.top_k_renorm_prob, top_p_renorm_prob=_sampling.top_p_renorm_prob,
    )
    # not re-exported at FlashInfer's top level: engines import them from the submodule
    contents["flashinfer.logits_processor"].update(
        {name: getattr(_logits_processor, name) for name in _logits_processor.__all__})
    # not at FlashInfer's top level
    contents["flashinfer.sparse"]["convert_bsr_mask_layout"] = _sparse.convert_bsr_mask_layout
    contents["flashinfer.prefill"].update(
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
    )
    for name in _CASCADE_WRAPPERS:
        # the cascade wrappers are tritoninfer's when it has them, else importable stubs
        obj = getattr(_cascade, name, None)
        contents["flashinfer.cascade"][name] = obj if obj is not None else _unsupported_class(
            f"flashinfer.cascade.{name}", "this cascade wrapper (not yet in this tritoninfer build)")
    contents["flashinfer.utils"].update(
        PosEncodingMode=PosEncodingMode, MaskMode=MaskMode, TensorLayout=TensorLayout,
        get_compute_capability=get_compute_capability, is_sm90a_supported=is_sm90a_supported,
        is_sm100a_supported=is_sm100a_supported, is_sm110a_supported=is_sm110a_supported,
        is_sm120a_supported=is_sm120a_supported, is_sm121a_supported=is_sm121a_supported,
        device_support_pdl=device_support_pdl, get_alibi_slopes=get_alibi_slopes,
        next_positive_power_of_2=next_positive_power_of_2, canonicalize_torch_dtype=canonicalize_torch_dtype,
        is_float8=is_float8, has_flashinfer_jit_cache=has_flashinfer_jit_cache,
    )
    contents["flashinfer.jit"].update(has_prebuilt_ops=True, MissingJITCacheError=MissingJITCacheError)
    # what a caller needs to declare FlashInfer's AttentionSink variant in a wrapper's jit_args (as
    # FlashInfer's own tests and BatchAttentionWithAttentionSinkWrapper do); the declaration is
    # tritoninfer's, recognised by _variants.sink_variant as FlashInfer's source is
    contents["flashinfer.jit.utils"]["filename_safe_dtype_map"] = dict(FILENAME_SAFE_DTYPES)
    contents["flashinfer.jit.attention.variants"]["attention_sink_decl"] = {
        backend: _variants.SINK_DECL for backend in ("fa2", "fa3")}
    contents["flashinfer.autotuner"]["autotune"] = autotune
    from . import _compat_mla  # imports this module: only once it is complete

    for module, names in _compat_mla.contents().items():
        contents[module].update(names)
    for module, name, feature, is_class in UNSUPPORTED:
        make = _unsupported_class if is_class else _unsupported_function
        contents[module][name] = make(f"{module}.{name}", feature)
    # the top level: every implemented public name, then FlashInfer's re-exports of the rest
    top = contents["flashinfer"]
    for module in ("flashinfer.activation", "flashinfer.norm", "flashinfer.page", "flashinfer.quantization",
                   "flashinfer.rope", "flashinfer.cascade", "flashinfer.decode", "flashinfer.prefill"):
        top.update({k: v for k, v in contents[module].items() if not k.startswith("_")})
    for module, name in _TOP_LEVEL_REEXPORTS:
        top[name] = contents[module][name]
    top.update(autotune=autotune, next_positive_power_of_2=next_positive_power_of_2,
               PosEncodingMode=PosEncodingMode, MaskMode=MaskMode, TensorLayout=TensorLayout)
    return contents


def _build_modules() -> Dict[str, types.ModuleType]:
    from ._version import __version__ as tritoninfer_version

    modules: Dict[str, types.ModuleType] = {}
    for name, names in _module_contents().items():
        package = name in _PACKAGES
        doc = _DOCS.get(name, "tritoninfer's stand-in for FlashInfer's {n} (see tritoninfer._compat).")
        module = types.ModuleType(name, doc.format(v=FLASHINFER_API_VERSION, n=name))
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        if package:
            module.__path__ = []  # submodules exist only as registered here
        module.__file__ = __file__
        module.__package__ = name if package else name.rpartition(".")[0]
        setattr(module, _MARK, True)
        module.__dict__.update(names)
        module.__all__ = sorted(k for k in names if not k.startswith("_"))
        modules[name] = module
    top = modules["flashinfer"]
    top.__version__ = FLASHINFER_API_VERSION
    top.__tritoninfer_version__ = tritoninfer_version
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent and child not in modules[parent].__dict__:  # flashinfer.xqa is the function, as in FlashInfer
            setattr(modules[parent], child, module)
    return modules


# --------------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------------

_replaced: Dict[str, types.ModuleType] = {}


def _is_flashinfer_name(name: str) -> bool:
    return name == "flashinfer" or name.startswith("flashinfer.")


def install_as_flashinfer(force: bool = False) -> types.ModuleType:
    """Register tritoninfer as the ``flashinfer`` package (and its submodules) in ``sys.modules``.

    Call it before the engine imports ``flashinfer``; afterwards ``import flashinfer``,
    ``from flashinfer.decode import fast_decode_plan`` and the like resolve to tritoninfer. The
    registered package reports ``__version__ == "0.5.3"`` (the FlashInfer API it implements).

    Parameters
    ----------
    force : bool
        When a real ``flashinfer`` (or any ``flashinfer.*`` module) is already imported, this raises
        ``RuntimeError`` unless ``force=True``, which removes those modules from ``sys.modules``
        (objects and names already taken from them keep using the real FlashInfer);
        :func:`uninstall_flashinfer` puts them back.

    Returns
    -------
    The registered ``flashinfer`` module. Calling it again while installed returns the same module.
    """
    current = sys.modules.get("flashinfer")
    if current is not None and getattr(current, _MARK, False):
        return current
    foreign = {k: m for k, m in list(sys.modules.items())
               if _is_flashinfer_name(k) and m is not None and not getattr(m, _MARK, False)}
    if foreign and not force:
        where = getattr(sys.modules.get("flashinfer"), "__file__", None) or sorted(foreign)[0]
        raise RuntimeError(
            f"install_as_flashinfer(): a real flashinfer is already imported ({where}). Call "
            "tritoninfer.install_as_flashinfer() before anything imports flashinfer, or pass force=True "
            "to replace it (objects already created from the real flashinfer keep using it)."
        )
    for name in list(sys.modules):
        if _is_flashinfer_name(name):
            module = sys.modules.pop(name)
            if name in foreign:
                _replaced[name] = module
    modules = _build_modules()
    sys.modules.update(modules)
    return modules["flashinfer"]


def uninstall_flashinfer() -> None:
    """Remove what :func:`install_as_flashinfer` registered and restore any real ``flashinfer``
    modules it replaced with ``force=True``. Engine modules that already hold names taken from the
    registered package keep them."""
    for name in list(sys.modules):
        if _is_flashinfer_name(name) and getattr(sys.modules[name], _MARK, False):
            del sys.modules[name]
    for name, module in _replaced.items():
        sys.modules.setdefault(name, module)
    _replaced.clear()

