"""tritoninfer: FlashInfer's Python API implemented in Triton.

Engines import from the same submodules as FlashInfer's (``tritoninfer.decode``,
``tritoninfer.prefill``, ``tritoninfer.cascade``, ``tritoninfer.page``, ``tritoninfer.rope``,
``tritoninfer.norm``, ``tritoninfer.activation``, ``tritoninfer.quantization``,
``tritoninfer.sampling``, ``tritoninfer.sparse``, ``tritoninfer.mla``); the public names are re-exported here as FlashInfer
does at its top level.

The re-exports are lazy (PEP 562): ``import tritoninfer`` imports neither torch nor Triton nor any
kernel module, and a name's submodule is imported when the name is first used, so the command line
starts at once and a program pays only for the kernels it calls. Submodules are attributes as
usual (``tritoninfer.decode`` imports it on first access).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Dict, List

from ._version import __version__

# Public name -> the submodule that defines it: every name of the API modules' __all__, the
# option enums, and the FlashInfer stand-in installer (tests/test_cli.py checks it against them).
_EXPORTS: Dict[str, str] = {
    **dict.fromkeys(["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"], "activation"),
    **dict.fromkeys([
        "merge_state", "merge_state_in_place", "merge_states", "MultiLevelCascadeAttentionWrapper",
        "BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    ], "cascade"),
    **dict.fromkeys([
        "single_decode_with_kv_cache", "BatchDecodeWithPagedKVCacheWrapper",
        "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
    ], "decode"),
    **dict.fromkeys(["rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "layernorm"], "norm"),
    **dict.fromkeys(["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"], "page"),
    **dict.fromkeys([
        "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
        "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
    ], "prefill"),
    **dict.fromkeys(["packbits", "segment_packbits", "quantize_fp8"], "quantization"),
    **dict.fromkeys([
        "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids", "apply_rope_pos_ids_inplace",
        "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
        "apply_llama31_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
        "apply_rope_with_cos_sin_cache_inplace", "rope_quantize_fp8", "mla_rope_quantize_fp8",
        "rope_quantize_fp8_append_paged_kv_cache",
    ], "rope"),
    **dict.fromkeys([
        "softmax", "sampling_from_probs", "sampling_from_logits", "top_p_sampling_from_probs",
        "top_k_sampling_from_probs", "min_p_sampling_from_probs", "top_k_top_p_sampling_from_probs",
        "top_k_top_p_sampling_from_logits", "top_p_renorm_probs", "top_p_renorm_prob", "top_k_renorm_probs",
        "top_k_renorm_prob", "top_k_mask_logits", "chain_speculative_sampling",
    ], "sampling"),
    **dict.fromkeys(["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"],
                    "sparse"),
    **dict.fromkeys(["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"], "attention"),
    **dict.fromkeys(["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"], "pod"),
    **dict.fromkeys([
        "BatchMLAPagedAttentionWrapper", "BatchDecodeMlaWithPagedKVCacheWrapper", "append_paged_mla_kv_cache",
    ], "mla"),
    **dict.fromkeys(["MaskMode", "PosEncodingMode", "TensorLayout"], "_options"),
    "install_as_flashinfer": "_compat",
    "check_errors": "_errors",
}

# The submodules a user reaches as attributes; listed by dir(). Any other submodule
# (tritoninfer.kernels, tritoninfer.bench, ...) is imported on attribute access as well.
_SUBMODULES = ("activation", "cascade", "decode", "norm", "page", "prefill", "quantization", "rope",
               "sampling", "sparse", "attention", "pod", "mla", "reference", "testing")

__all__ = ["MaskMode", "PosEncodingMode", "TensorLayout", "__version__", "install_as_flashinfer", "check_errors"] + [
    name for name, module in _EXPORTS.items() if not module.startswith("_")
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups do not come back here
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # the import binds it as an attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
