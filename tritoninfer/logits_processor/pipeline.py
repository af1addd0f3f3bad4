"""LogitsPipe: a declared chain of processors, legalised, checked and fused once, run per call."""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Union

import torch

from .compiler import CompileError, FusionRule, LegalizationError, ValidityCheck, compile_pipeline
from .compiler import infer_initial_type, legalize_processors
from .op import Op
from .processors import LogitsProcessor
from .types import TaggedTensor, TensorType

__all__ = ["LogitsPipe"]

logger = logging.getLogger(__name__)


class LogitsPipe:
    """A sampling pipeline over logits or probabilities.

    Parameters
    ----------
    processors : List[LogitsProcessor]
        The steps, in order (e.g. ``[Temperature(), Softmax(), TopK(), Sample()]``).
    compile : bool
        Fuse the ops now (default); :meth:`compile` does it later. An uncompiled pipeline runs
        the discrete ops.
    input_type : Optional[TensorType]
        ``TensorType.LOGITS`` or ``TensorType.PROBS``; needed when the first processor takes both
        (``TopK``, ``Sample``), otherwise inferred.
    custom_fusion_rules : Optional[List[FusionRule]]
        Extra fusion rules.
    custom_validity_checks : Optional[List[ValidityCheck]]
        Extra checks on the op list.

    A call ``pipe(x, **params)`` takes ``x`` of shape ``[batch_size, vocab_size]`` (a tensor, tagged
    as ``input_type``, or a :class:`TaggedTensor`) and the runtime parameters (``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``indices``, ``generator``), and returns a plain tensor:
    float32 probabilities/logits, or int32 token ids ``[batch_size]`` after :class:`Sample`.

    >>> import torch
    >>> from tritoninfer.logits_processor import LogitsPipe, Temperature, Softmax, TopK, Sample
    >>> pipe = LogitsPipe([Temperature(), Softmax(), TopK(), Sample()])
    >>> ids = pipe(torch.randn(4, 32000, device="cuda"), temperature=0.9, top_k=40)
    """

    def __init__(
        self,
        processors: List[LogitsProcessor],
        compile: bool = True,
        input_type: Optional[TensorType] = None,
        custom_fusion_rules: Optional[List[FusionRule]] = None,
        custom_validity_checks: Optional[List[ValidityCheck]] = None,
    ) -> None:
        if not processors:
            raise ValueError("processors: a pipeline needs at least one processor")
        self.processors = list(processors)
        self.compiled_ops: Optional[List[Op]] = None
        try:
            self._initial_type = input_type or infer_initial_type(self.processors)
            self.ops = legalize_processors(self.processors, self._initial_type)
            if compile:
                self.compile(custom_fusion_rules, custom_validity_checks)
        except (LegalizationError, CompileError) as exc:
            raise ValueError(f"pipeline creation failed: {exc}") from exc

    @property
    def initial_type(self) -> TensorType:
        """The type of the pipeline's input: ``TensorType.LOGITS`` or ``TensorType.PROBS``."""
        return self._initial_type

    def compile(self, custom_fusion_rules: Optional[List[FusionRule]] = None,
                custom_validity_checks: Optional[List[ValidityCheck]] = None) -> None:
        """Type-check, validate and fuse the ops (what ``compile=True`` does at construction)."""
        try:
            self.compiled_ops = compile_pipeline(list(self.ops), custom_fusion_rules, custom_validity_checks)
        except CompileError as exc:
            raise ValueError(f"compilation failed: {exc}") from exc

    def __call__(self, x: Union[torch.Tensor, TaggedTensor], **kwargs: Any) -> torch.Tensor:
        if self.compiled_ops is None:
            logger.warning("LogitsPipe is not compiled: running the discrete ops")
        op_list = self.compiled_ops if self.compiled_ops is not None else self.ops
        tensor = x if isinstance(x, TaggedTensor) else TaggedTensor(x, self._initial_type)
        params = dict(kwargs)
        for i, op in enumerate(op_list):
            try:
                tensor = op(tensor, **params)
            except Exception as exc:
                raise ValueError(f"operator {i} ({type(op).__name__}) failed: {exc}") from exc
        return tensor.data

    def __repr__(self) -> str:
        names = lambda items: " -> ".join(type(i).__name__ for i in items or [])  # noqa: E731
        return f"LogitsPipe([{names(self.processors)}], ops=[{names(self.ops)}], compiled_ops=[{names(self.compiled_ops)}])"
