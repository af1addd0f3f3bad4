"""High-level processors: what a user lists in a :class:`~tritoninfer.logits_processor.LogitsPipe`.

Each processor *legalises* into ops for the tensor type it receives (top-k on logits masks them,
on probabilities renormalises them). Runtime parameters (``temperature``, ``top_k``, ``top_p``,
``min_p``, ``indices``, ``generator``) are given to the pipeline call; parameters given to a
processor's constructor are its defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, List, Optional

from . import operators as ops
from .op import Op
from .types import TensorType

__all__ = ["LogitsProcessor", "Temperature", "Softmax", "TopK", "TopP", "MinP", "Sample"]


class LogitsProcessor(ABC):
    """A pipeline step; subclasses implement :meth:`legalize`.

    Parameters
    ----------
    **params : Any
        Compile-time parameters (defaults for the runtime ones of the same name).
    """

    def __init__(self, **params: Any) -> None:
        self.params = params

    @abstractmethod
    def legalize(self, input_type: TensorType) -> List[Op]:
        """The ops this processor becomes for ``input_type``; ``ValueError`` if it cannot take it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.params.items())})"


def _only(processor: LogitsProcessor, input_type: TensorType, allowed: TensorType, op: type) -> List[Op]:
    if input_type != allowed:
        raise ValueError(f"{type(processor).__name__} can only be applied to {allowed}, got {input_type}")
    return [op(**processor.params)]


class Temperature(LogitsProcessor):
    """LOGITS -> LOGITS: divides by ``temperature`` (runtime: a number > 0 or a ``[batch_size]``
    tensor). Followed by :class:`Softmax` it fuses into :func:`tritoninfer.sampling.softmax`."""

    def legalize(self, input_type: TensorType) -> List[Op]:
        return _only(self, input_type, TensorType.LOGITS, ops.TemperatureOp)


class Softmax(LogitsProcessor):
    """LOGITS -> PROBS. At most one per pipeline. ``enable_pdl`` is accepted and has no effect."""

    def __init__(self, enable_pdl: Optional[bool] = None, **params: Any) -> None:
        super().__init__(enable_pdl=enable_pdl, **params)

    def legalize(self, input_type: TensorType) -> List[Op]:
        return _only(self, input_type, TensorType.LOGITS, ops.SoftmaxOp)


class TopK(LogitsProcessor):
    """LOGITS -> LOGITS (other logits set to ``-inf``) or PROBS -> PROBS (others zeroed,
    renormalised); runtime ``top_k``. With ``joint_topk_topp=True``, ``TopK, TopP, Sample`` on
    probabilities fuse into one joint top-k/top-p draw (``filter_apply_order="joint"``); otherwise
    top-p applies to the top-k-renormalised probabilities."""

    def __init__(self, joint_topk_topp: bool = False, **params: Any) -> None:
        super().__init__(joint_topk_topp=joint_topk_topp, **params)

    def legalize(self, input_type: TensorType) -> List[Op]:
        if input_type == TensorType.LOGITS:
            return [ops.LogitsTopKOp(**self.params)]
        if input_type == TensorType.PROBS:
            return [ops.ProbsTopKOp(**self.params)]
        raise ValueError(f"TopK cannot be applied to {input_type}")


class TopP(LogitsProcessor):
    """PROBS -> PROBS: the top-p set kept and renormalised; runtime ``top_p`` in (0, 1]."""

    def legalize(self, input_type: TensorType) -> List[Op]:
        return _only(self, input_type, TensorType.PROBS, ops.TopPOp)


class MinP(LogitsProcessor):
    """PROBS -> PROBS: entries ``>= min_p * max`` kept and renormalised; runtime ``min_p``."""

    def legalize(self, input_type: TensorType) -> List[Op]:
        return _only(self, input_type, TensorType.PROBS, ops.MinPOp)


class Sample(LogitsProcessor):
    """LOGITS or PROBS -> INDICES (int32 ``[batch_size]``); runtime ``indices`` and ``generator``.
    Nothing may follow it."""

    def __init__(self, deterministic: bool = True, **params: Any) -> None:
        super().__init__(deterministic=deterministic, **params)

    def legalize(self, input_type: TensorType) -> List[Op]:
        if input_type == TensorType.LOGITS:
            return [ops.LogitsSampleOp(**self.params)]
        if input_type == TensorType.PROBS:
            return [ops.ProbsSampleOp(**self.params)]
        raise ValueError(f"Sample cannot be applied to {input_type}")
