"""The semantic tensor types a pipeline passes between its steps."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Dict, Optional, Tuple, Type, Union

import torch

__all__ = ["TensorType", "TaggedTensor"]


class TensorType(Enum):
    """What a pipeline tensor holds: ``LOGITS`` (real scores, ``-inf`` for masked entries),
    ``PROBS`` (non-negative probabilities) or ``INDICES`` (sampled token ids; nothing follows)."""

    LOGITS = auto()
    PROBS = auto()
    INDICES = auto()

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"TensorType.{self.name}"


@dataclass(frozen=True)
class TaggedTensor:
    """A tensor with its :class:`TensorType`; torch functions applied to it see the plain tensor.

    Pipelines tag their input themselves; pass a ``TaggedTensor`` to say explicitly what a tensor
    holds.
    """

    data: torch.Tensor
    type: TensorType

    @staticmethod
    def logits(t: torch.Tensor) -> "TaggedTensor":
        return TaggedTensor(t, TensorType.LOGITS)

    @staticmethod
    def probs(t: torch.Tensor) -> "TaggedTensor":
        return TaggedTensor(t, TensorType.PROBS)

    @staticmethod
    def indices(t: torch.Tensor) -> "TaggedTensor":
        return TaggedTensor(t, TensorType.INDICES)

    @classmethod
    def __torch_function__(cls, func: Any, types: Tuple[Type, ...], args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        unwrap = lambda a: a.data if isinstance(a, TaggedTensor) else a  # noqa: E731
        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self.data.size() if dim is None else self.data.size(dim)

    def __repr__(self) -> str:
        return f"TaggedTensor(type={self.type}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"
