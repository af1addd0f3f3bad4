"""The concrete ops, each a thin call into :mod:`tritoninfer.sampling` (or plain torch where
FlashInfer's discrete op is plain torch, so fused and unfused pipelines agree with the direct
functions bit for bit for one generator state)."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .. import sampling
from .op import ParameterizedOp
from .types import TaggedTensor, TensorType

__all__ = [
    "TemperatureOp", "SoftmaxOp", "ProbsTopKOp", "LogitsTopKOp", "TopPOp", "MinPOp", "ProbsSampleOp",
    "LogitsSampleOp", "FusedTemperatureSoftmaxOp", "FusedProbsTopKSampleOp", "FusedProbsTopPSampleOp",
    "FusedProbsMinPSampleOp", "FusedProbsTopKTopPSampleOp",
]


def _positive(value: Any, name: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number or a per-row tensor, got {value!r}")
    return value


def _top_k(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"top_k must be a positive integer or a per-row tensor, got {value!r}")
    return value


def _fraction(value: Any, name: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1] or a per-row tensor, got {value!r}")
    return value


def _sampling_args(op: ParameterizedOp, kwargs: dict) -> dict:
    return dict(indices=op._get_param("indices", kwargs, required=False),
                deterministic=op.default_params.get("deterministic", True),
                generator=op._get_param("generator", kwargs, required=False))


class TemperatureOp(ParameterizedOp):
    """LOGITS -> LOGITS: ``logits / temperature`` (a number > 0 or a ``[batch_size]`` tensor)."""

    IN, OUT = TensorType.LOGITS, TensorType.LOGITS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        t = _positive(self._get_param("temperature", kwargs), "temperature")
        if isinstance(t, torch.Tensor):
            t = t.to(tensor.data.dtype).reshape(-1, 1)
        return TaggedTensor(tensor.data / t, out)


class SoftmaxOp(ParameterizedOp):
    """LOGITS -> PROBS: ``torch.softmax`` over the vocabulary."""

    IN, OUT = TensorType.LOGITS, TensorType.PROBS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        return TaggedTensor(torch.softmax(tensor.data, dim=-1), out)


class ProbsTopKOp(ParameterizedOp):
    """PROBS -> PROBS: :func:`tritoninfer.sampling.top_k_renorm_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.PROBS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        return TaggedTensor(sampling.top_k_renorm_probs(tensor.data, _top_k(self._get_param("top_k", kwargs))), out)


class LogitsTopKOp(ParameterizedOp):
    """LOGITS -> LOGITS: :func:`tritoninfer.sampling.top_k_mask_logits`."""

    IN, OUT = TensorType.LOGITS, TensorType.LOGITS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        return TaggedTensor(sampling.top_k_mask_logits(tensor.data, _top_k(self._get_param("top_k", kwargs))), out)


class TopPOp(ParameterizedOp):
    """PROBS -> PROBS: :func:`tritoninfer.sampling.top_p_renorm_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.PROBS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        top_p = _fraction(self._get_param("top_p", kwargs), "top_p")
        return TaggedTensor(sampling.top_p_renorm_probs(tensor.data, top_p), out)


class MinPOp(ParameterizedOp):
    """PROBS -> PROBS: entries ``>= min_p * max`` kept and renormalised, the rest 0 (torch)."""

    IN, OUT = TensorType.PROBS, TensorType.PROBS

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        min_p = _fraction(self._get_param("min_p", kwargs), "min_p")
        probs = tensor.data
        if isinstance(min_p, torch.Tensor):
            min_p = min_p.to(probs.dtype).reshape(-1, 1)
        kept = torch.where(probs >= min_p * probs.max(dim=-1, keepdim=True).values, probs, torch.zeros_like(probs))
        return TaggedTensor(kept / kept.sum(dim=-1, keepdim=True), out)


class ProbsSampleOp(ParameterizedOp):
    """PROBS -> INDICES: :func:`tritoninfer.sampling.sampling_from_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        return TaggedTensor(sampling.sampling_from_probs(tensor.data, **_sampling_args(self, kwargs)), out)


class LogitsSampleOp(ParameterizedOp):
    """LOGITS -> INDICES: :func:`tritoninfer.sampling.sampling_from_logits`."""

    IN, OUT = TensorType.LOGITS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        return TaggedTensor(sampling.sampling_from_logits(tensor.data, **_sampling_args(self, kwargs)), out)


class FusedTemperatureSoftmaxOp(ParameterizedOp):
    """LOGITS -> PROBS: :func:`tritoninfer.sampling.softmax` with the temperature."""

    IN, OUT = TensorType.LOGITS, TensorType.PROBS

    def __init__(self, enable_pdl=None, **default_params: Any) -> None:
        super().__init__(enable_pdl=enable_pdl, **default_params)

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        t = _positive(self._get_param("temperature", kwargs), "temperature")
        return TaggedTensor(sampling.softmax(tensor.data, t if isinstance(t, torch.Tensor) else float(t)), out)


class _FusedSampleOp(ParameterizedOp):
    """A fused sampling op: ``deterministic`` (default True) is one of its compile-time parameters."""

    def __init__(self, deterministic: bool = True, **default_params: Any) -> None:
        super().__init__(deterministic=deterministic, **default_params)


class FusedProbsTopKSampleOp(_FusedSampleOp):
    """PROBS -> INDICES: :func:`tritoninfer.sampling.top_k_sampling_from_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        top_k = _top_k(self._get_param("top_k", kwargs))
        return TaggedTensor(sampling.top_k_sampling_from_probs(tensor.data, top_k, **_sampling_args(self, kwargs)), out)


class FusedProbsTopPSampleOp(_FusedSampleOp):
    """PROBS -> INDICES: :func:`tritoninfer.sampling.top_p_sampling_from_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        top_p = _fraction(self._get_param("top_p", kwargs), "top_p")
        return TaggedTensor(sampling.top_p_sampling_from_probs(tensor.data, top_p, **_sampling_args(self, kwargs)), out)


class FusedProbsMinPSampleOp(_FusedSampleOp):
    """PROBS -> INDICES: :func:`tritoninfer.sampling.min_p_sampling_from_probs`."""

    IN, OUT = TensorType.PROBS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        min_p = _fraction(self._get_param("min_p", kwargs), "min_p")
        return TaggedTensor(sampling.min_p_sampling_from_probs(tensor.data, min_p, **_sampling_args(self, kwargs)), out)


class FusedProbsTopKTopPSampleOp(_FusedSampleOp):
    """PROBS -> INDICES: :func:`tritoninfer.sampling.top_k_top_p_sampling_from_probs`, joint."""

    IN, OUT = TensorType.PROBS, TensorType.INDICES

    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        out = self._validate_input_type(tensor)
        top_k = _top_k(self._get_param("top_k", kwargs))
        top_p = _fraction(self._get_param("top_p", kwargs), "top_p")
        samples = sampling.top_k_top_p_sampling_from_probs(tensor.data, top_k, top_p, filter_apply_order="joint",
                                                           **_sampling_args(self, kwargs))
        return TaggedTensor(samples, out)
