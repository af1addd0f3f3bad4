"""tritoninfer.logits_processor: FlashInfer 0.5.3's ``flashinfer.logits_processor`` over
:mod:`tritoninfer.sampling`.

A :class:`LogitsPipe` lists processors (:class:`Temperature`, :class:`Softmax`, :class:`TopK`,
:class:`TopP`, :class:`MinP`, :class:`Sample`); they legalise into ops for the tensor type they
receive, and adjacent ops fuse into one sampling call where FlashInfer fuses them (temperature +
softmax; top-k, top-p or min-p + sample; top-k + top-p + sample with ``joint_topk_topp=True``).
"""

from .compiler import CompileError, Compiler, FusionRule, LegalizationError, compile_pipeline, legalize_processors
from .op import Op, ParameterizedOp
from .pipeline import LogitsPipe
from .processors import LogitsProcessor, MinP, Sample, Softmax, Temperature, TopK, TopP
from .types import TaggedTensor, TensorType

__all__ = [
    "CompileError", "Compiler", "compile_pipeline", "FusionRule", "LegalizationError", "legalize_processors",
    "Op", "ParameterizedOp", "LogitsPipe", "LogitsProcessor", "MinP", "Sample", "Softmax", "Temperature", "TopK",
    "TopP", "TaggedTensor", "TensorType",
]
