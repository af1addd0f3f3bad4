"""FlashInfer's AttentionSink JIT variant, recognised and run as the attention core's sinks path.

FlashInfer's prefill wrappers take ``jit_args``: CUDA source of a custom attention variant, compiled
by nvcc. tritoninfer cannot compile CUDA, but one variant matters to engines (gpt-oss's attention
sinks) and its semantics are the core's: the variant that ``flashinfer.attention.
BatchAttentionWithAttentionSinkWrapper`` builds (``flashinfer/jit/attention/variants.py``), whose
``run(q, kv..., sink, sm_scale)`` takes a float32 ``[num_qo_heads]`` sink logit per head and the
softmax scale. :func:`sink_variant` recognises exactly that variant (its argument lists, its name and
the statements of its source that define its semantics, for FlashInfer's fa2 and fa3 sources) and
refuses every other with ``NotImplementedError``; :func:`run_sink_variant` runs it.

The variant's semantics, from its source: logits ``q.k * sm_scale`` (``run()``'s scale, not the
plan's), the plan's causal mask and sliding window, the sink ``exp(sink[h])`` added to the softmax
denominator, and an LSE that includes the sink.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import torch

from . import _ops
from ._options import canonicalize_dtype

_URI = re.compile(r"batch_prefill_attention_sink_(\w+)_swa_(True|False)_(fa2|fa3|auto)")

# statements (whitespace removed) that define the variant's semantics in FlashInfer's two sources
_FA2 = ("structAttentionSink:AttentionVariantBase",
        "sm_scale_log2=params.sm_scale*math::log2e;",
        "return(kv_idx+qo_len+window_left>=kv_len+qo_idx);",
        "params.sink[qo_head_idx]*math::log2e",
        "floatd_new=math::ptx_exp2(log_sink-m_new)+d*scale;",
        "returnoutput*scale*d_rcp;")
_FA3 = ("structAttentionSink:AttentionVariantBase",
        "structOnlineSoftmaxWithSink",
        "sm_scale_log2=params.additional_params.sm_scale*math::log2e;",
        "log_sink=params.additional_params.sink[qo_head_idx]*math::log2e;",
        "floatd_new=math::ptx_exp2(log_sink-m_new)+d*scale;",
        "returnOnlineSoftmaxWithSink<NUM_ROWS_PER_THREAD>(sm_scale_log2,log_sink);")
# tritoninfer's own declaration of the variant: what flashinfer.jit.attention.variants.attention_sink_decl
# holds under install_as_flashinfer() (there is no CUDA source to hand over), accepted as FlashInfer's is
SINK_DECL = "tritoninfer: FlashInfer's AttentionSink variant (the attention core's sinks path)"
_JIT_KWARGS = {"use_sliding_window", "use_fp16_qk_reduction", "pos_encoding_mode"}


@dataclasses.dataclass(frozen=True)
class SinkVariant:
    """FlashInfer's AttentionSink variant as a wrapper's ``jit_args`` / ``jit_kwargs`` declared it."""

    dtype_q: torch.dtype
    dtype_kv: torch.dtype
    dtype_o: torch.dtype
    head_dim_qk: int
    head_dim_vo: int
    use_sliding_window: bool
    pos_encoding_mode: int


def _unsupported(why: str) -> NotImplementedError:
    return NotImplementedError(
        f"jit_args/jit_kwargs: custom CUDA attention variants cannot run on tritoninfer's Triton kernels ({why}); "
        "only FlashInfer's own AttentionSink variant (flashinfer.jit.attention.variants.attention_sink_decl) is "
        "recognised and runs as the sinks path"
    )


def sink_variant(jit_args, jit_kwargs) -> Optional[SinkVariant]:
    """None without ``jit_args``; the AttentionSink variant they declare; else ``NotImplementedError``."""
    if jit_args is None:
        if jit_kwargs:
            raise _unsupported("jit_kwargs without jit_args")
        return None
    args = list(jit_args)
    if len(args) != 13:
        raise _unsupported(f"expected FlashInfer's 13 jit_args, got {len(args)}")
    uri, dtype_q, dtype_kv, dtype_o, idtype, dqk, dvo, tensors, tensor_dtypes, scalars, scalar_dtypes, name, decl = args
    if not (isinstance(uri, str) and _URI.fullmatch(uri)):
        raise _unsupported(f"module name {uri!r}")
    if name != "AttentionSink" or list(tensors) != ["sink"] or list(tensor_dtypes) != ["float"] \
            or list(scalars) != ["sm_scale"] or list(scalar_dtypes) != ["double"]:
        raise _unsupported(f"variant {name!r} with tensors {tensors!r} and scalars {scalars!r}")
    source = re.sub(r"\s+", "", decl) if isinstance(decl, str) else ""
    if decl != SINK_DECL and not (all(s in source for s in _FA2) or all(s in source for s in _FA3)):
        raise _unsupported("an AttentionSink source other than FlashInfer's")
    if idtype not in (torch.int32, "int32"):
        raise _unsupported(f"index dtype {idtype!r}")
    kwargs = dict(jit_kwargs or {})
    if set(kwargs) - _JIT_KWARGS:
        raise _unsupported(f"jit_kwargs {sorted(set(kwargs) - _JIT_KWARGS)}")
    if kwargs.get("use_fp16_qk_reduction", False):
        raise NotImplementedError("use_fp16_qk_reduction=True: tritoninfer always accumulates q.k in fp32")
    return SinkVariant(
        dtype_q=canonicalize_dtype(dtype_q, "jit_args dtype_q"), dtype_kv=canonicalize_dtype(dtype_kv, "jit_args dtype_kv"),
        dtype_o=canonicalize_dtype(dtype_o, "jit_args dtype_o"), head_dim_qk=int(dqk), head_dim_vo=int(dvo),
        use_sliding_window=bool(kwargs.get("use_sliding_window", False)),
        pos_encoding_mode=int(kwargs.get("pos_encoding_mode", 0)))


def run_sink_variant(wrapper, q: torch.Tensor, kv: tuple, args: tuple, *, q_scale=None, k_scale=None, v_scale=None,
                     out=None, lse=None, return_lse: bool = False, window_left=None, sinks=None):
    """A prefill wrapper's ``run(q, *kv, sink, sm_scale, ...)`` under the AttentionSink variant:
    the attention core with ``sinks=sink`` and the softmax scale ``sm_scale`` (folded in as a
    factor on the planned scale), the LSE with the sink added (as the variant computes it).
    ``kv``: ``(paged_kv_cache,)`` or ``(k, v)``."""
    variant: SinkVariant = wrapper._jit_variant
    if len(args) != 2:
        raise TypeError(f"run(): the AttentionSink variant takes (sink, sm_scale) after the K/V, got {len(args)} "
                        "extra arguments")
    sink, sm_scale = args
    if sinks is not None:
        raise ValueError("sinks: the AttentionSink variant takes its sinks as the positional `sink` argument")
    if q_scale is not None or k_scale is not None:
        raise NotImplementedError("q_scale/k_scale: the AttentionSink variant's logit scale is its sm_scale argument")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale: expected a Python float (the variant's double scalar), got {type(sm_scale).__name__}")
    step = wrapper._step
    if step is None:
        raise ValueError("run() was called before plan()")
    checks = (
        ("q_data_type", step.q_dtype, variant.dtype_q), ("kv_data_type", step.kv_dtype, variant.dtype_kv),
        ("head_dim_qk", step.head_dim_qk, variant.head_dim_qk), ("head_dim_vo", step.head_dim_vo, variant.head_dim_vo),
        ("window_left (use_sliding_window)", step.params.window_left >= 0, variant.use_sliding_window),
        ("pos_encoding_mode", int(step.params.rope), variant.pos_encoding_mode))
    for name, planned, declared in checks:
        if planned != declared:
            raise ValueError(f"{name}: plan() used {planned} but the AttentionSink jit_args declare {declared}")
    if step.params.logits_soft_cap > 0 or step.params.alibi or step.packed_mask is not None:
        raise NotImplementedError("the AttentionSink variant has no logits soft cap, ALiBi or custom mask")
    # the variant's scale replaces the plan's: a factor on it, as q_scale is applied
    factor = float(sm_scale) / step.params.sm_scale
    want_lse = return_lse or lse is not None
    if _ops.compiling():
        result = _ops.traced_run(wrapper, q, kv[0] if len(kv) == 1 else kv, out, lse, want_lse,
                                 zero_out=wrapper._use_cuda_graph, sinks=sink, q_scale=factor, v_scale=v_scale,
                                 window_left=window_left)
    elif wrapper._paged:
        result = wrapper._run(q, kv[0], factor, None, v_scale, out, lse, want_lse, window_left, sink)
    else:
        result = wrapper._run(q, *kv, out, lse, want_lse, sinks=sink, q_scale=factor, v_scale=v_scale)
    if not want_lse:
        return result
    out, lse = result
    # the variant's LSE counts the sink: log2(2^lse + 2^(sink * log2 e)), in place (a caller's buffer)
    lse.copy_(torch.logaddexp2(lse, sink.to(lse.dtype) * (1.0 / math.log(2.0))))
    return (out, lse) if return_lse else out
