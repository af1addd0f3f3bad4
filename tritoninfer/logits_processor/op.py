"""Low-level pipeline steps: an :class:`Op` maps one :class:`TaggedTensor` type to another."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict

from .types import TaggedTensor, TensorType

__all__ = ["Op", "ParameterizedOp"]


class Op(ABC):
    """A step with a fixed input type ``IN`` and output type ``OUT``."""

    IN: TensorType = None
    OUT: TensorType = None

    def __init__(self) -> None:
        if self.IN is None or self.OUT is None:
            raise ValueError(f"operator {type(self).__name__} must define its IN and OUT tensor types")

    @abstractmethod
    def __call__(self, tensor: TaggedTensor, **kwargs: Any) -> TaggedTensor:
        """Applies the step; ``kwargs`` holds the pipeline call's runtime parameters."""

    def _validate_input_type(self, tensor: TaggedTensor) -> TensorType:
        if tensor.type != self.IN:
            raise ValueError(f"operator {type(self).__name__} takes {self.IN}, got {tensor.type}")
        return self.OUT

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.IN} -> {self.OUT})"


class ParameterizedOp(Op):
    """An op with compile-time parameters (``default_params``) that runtime ones override."""

    def __init__(self, **default_params: Any) -> None:
        super().__init__()
        self.default_params = default_params

    def _get_param(self, name: str, kwargs: Dict[str, Any], required: bool = True) -> Any:
        """The runtime value of ``name`` (consumed from ``kwargs``), else the compile-time one."""
        if name in kwargs:
            return kwargs.pop(name)
        if name in self.default_params:
            return self.default_params[name]
        if required:
            raise ValueError(f"required parameter {name!r} not given to {type(self).__name__}")
        return None
