"""From processors to the ops a pipeline runs: legalisation, validity checks, fusion.

- *Legalisation* turns each processor into ops for the type it receives, in order.
- *Validity checks* are callables that raise :class:`CompileError` on a bad op list (defaults: at
  most one softmax; nothing after an op that outputs indices).
- *Fusion rules* replace a run of ops matching a pattern (and a guard) by one fused op, highest
  priority first, retrying from the op before each replacement.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

from . import operators as ops
from .op import Op
from .processors import LogitsProcessor
from .types import TensorType

__all__ = [
    "CompileError", "LegalizationError", "ValidityCheck", "FusionRule", "Compiler", "compile_pipeline",
    "legalize_processors", "infer_initial_type", "get_default_fusion_rules", "get_default_validity_checks",
]


class CompileError(Exception):
    """An op list that fails a validity check or the type check."""


class LegalizationError(Exception):
    """A processor that cannot take the tensor type it would receive."""


ValidityCheck = Callable[[List[Op]], None]


class FusionRule(NamedTuple):
    """``pattern`` (op classes in order), ``guard(window) -> bool``, ``build(window) -> Op``,
    ``prio`` (higher first)."""

    pattern: Tuple[type, ...]
    guard: Callable[[List[Op]], bool]
    build: Callable[[List[Op]], Op]
    prio: int = 0


# --------------------------------------------------------------------------------------------------
# legalisation
# --------------------------------------------------------------------------------------------------


def legalize_processors(processors: List[LogitsProcessor], initial_type: TensorType = TensorType.LOGITS) -> List[Op]:
    """The ops of ``processors`` applied in order to a tensor of ``initial_type``."""
    if not processors:
        raise LegalizationError("cannot legalize an empty processor list")
    result: List[Op] = []
    current = initial_type
    for i, processor in enumerate(processors):
        try:
            legal = processor.legalize(current)
        except Exception as exc:
            raise LegalizationError(f"processor {i} ({type(processor).__name__}): {exc}") from exc
        if not legal:
            raise LegalizationError(f"processor {i} ({type(processor).__name__}) produced no ops")
        result.extend(legal)
        current = legal[-1].OUT
    return result


def infer_initial_type(processors: List[LogitsProcessor]) -> TensorType:
    """LOGITS or PROBS, whichever the first processor accepts; an error when it accepts both."""
    if not processors:
        return TensorType.LOGITS
    first = processors[0]
    accepted = []
    for t in (TensorType.LOGITS, TensorType.PROBS):
        try:
            first.legalize(t)
        except (ValueError, LegalizationError):
            continue
        accepted.append(t)
    if len(accepted) == 1:
        return accepted[0]
    if accepted:
        raise LegalizationError(f"{type(first).__name__} accepts both LOGITS and PROBS: pass input_type to LogitsPipe")
    raise LegalizationError(f"{type(first).__name__} accepts neither LOGITS nor PROBS")


# --------------------------------------------------------------------------------------------------
# validity checks and fusion rules
# --------------------------------------------------------------------------------------------------


def single_softmax_rule(op_list: List[Op]) -> None:
    if sum(isinstance(op, ops.SoftmaxOp) for op in op_list) > 1:
        raise CompileError("more than one Softmax in the pipeline")


def indices_terminal_rule(op_list: List[Op]) -> None:
    for op, nxt in zip(op_list, op_list[1:]):
        if op.OUT == TensorType.INDICES:
            raise CompileError(f"{type(nxt).__name__} follows {type(op).__name__}, which outputs indices")


def get_default_validity_checks() -> List[ValidityCheck]:
    return [single_softmax_rule, indices_terminal_rule]


def _deterministic(window: List[Op]) -> bool:
    return window[-1].default_params.get("deterministic", True)


def get_default_fusion_rules() -> List[FusionRule]:
    return [
        FusionRule((ops.TemperatureOp, ops.SoftmaxOp), lambda w: True,
                   lambda w: ops.FusedTemperatureSoftmaxOp(enable_pdl=w[1].default_params.get("enable_pdl")), 100),
        FusionRule((ops.ProbsTopKOp, ops.TopPOp, ops.ProbsSampleOp),
                   lambda w: bool(w[0].default_params.get("joint_topk_topp", False)),
                   lambda w: ops.FusedProbsTopKTopPSampleOp(deterministic=_deterministic(w)), 100),
        FusionRule((ops.ProbsTopKOp, ops.ProbsSampleOp), lambda w: True,
                   lambda w: ops.FusedProbsTopKSampleOp(deterministic=_deterministic(w)), 10),
        FusionRule((ops.TopPOp, ops.ProbsSampleOp), lambda w: True,
                   lambda w: ops.FusedProbsTopPSampleOp(deterministic=_deterministic(w)), 10),
        FusionRule((ops.MinPOp, ops.ProbsSampleOp), lambda w: True,
                   lambda w: ops.FusedProbsMinPSampleOp(deterministic=_deterministic(w)), 10),
    ]


# --------------------------------------------------------------------------------------------------
# the compiler
# --------------------------------------------------------------------------------------------------


class Compiler:
    """Type-checks, validates and fuses an op list (the default rules and checks installed)."""

    def __init__(self) -> None:
        self.fusion_rules: List[FusionRule] = []
        self.validity_checks: List[ValidityCheck] = list(get_default_validity_checks())
        for rule in get_default_fusion_rules():
            self.register_fusion_rule(rule)

    def register_fusion_rule(self, rule: FusionRule) -> None:
        self.fusion_rules.append(rule)
        self.fusion_rules.sort(key=lambda r: -r.prio)

    def register_validity_check(self, check: ValidityCheck) -> None:
        self.validity_checks.append(check)

    def compile(self, op_list: List[Op]) -> List[Op]:
        if not op_list:
            raise CompileError("cannot compile an empty operator list")
        result = list(op_list)
        self._type_check(result)
        for check in self.validity_checks:
            check(result)
        return self._fuse(result)

    @staticmethod
    def _type_check(op_list: List[Op]) -> None:
        current = op_list[0].IN
        if current not in (TensorType.LOGITS, TensorType.PROBS):
            raise CompileError(f"the first operator ({type(op_list[0]).__name__}) takes {current}, "
                               "not LOGITS or PROBS")
        for i, op in enumerate(op_list):
            if op.IN != current:
                raise CompileError(f"operator {i} ({type(op).__name__}) takes {op.IN}, the one before outputs {current}")
            current = op.OUT

    def _fuse(self, op_list: List[Op]) -> List[Op]:
        i = 0
        while i < len(op_list):
            for rule in self.fusion_rules:
                window = op_list[i:i + len(rule.pattern)]
                if (len(window) == len(rule.pattern) and all(isinstance(op, cls) for op, cls in zip(window, rule.pattern))
                        and rule.guard(window)):
                    op_list[i:i + len(rule.pattern)] = [rule.build(window)]
                    # the fused op may start a pattern with the op before it
                    i = max(i - 1, 0)
                    break
            else:
                i += 1
        return op_list


def compile_pipeline(op_list: List[Op], custom_fusion_rules: Optional[List[FusionRule]] = None,
                     custom_validity_checks: Optional[List[ValidityCheck]] = None) -> List[Op]:
    """``op_list`` type-checked, validated and fused, with extra rules and checks if given."""
    compiler = Compiler()
    for rule in custom_fusion_rules or ():
        compiler.register_fusion_rule(rule)
    for check in custom_validity_checks or ():
        compiler.register_validity_check(check)
    return compiler.compile(op_list)
