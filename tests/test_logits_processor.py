"""tritoninfer.logits_processor: pipelines against the sampling functions and the reference (CPU)."""

import pytest
import torch

import tritoninfer
from tritoninfer import reference, sampling
from tritoninfer.logits_processor import (
    CompileError,
    FusionRule,
    LogitsPipe,
    MinP,
    Sample,
    Softmax,
    TaggedTensor,
    Temperature,
    TensorType,
    TopK,
    TopP,
)
from tritoninfer.logits_processor import operators as ops
from tritoninfer.testing import assert_close

from test_sampling import check_frequencies, crafted_probs


def generators(device, seed=42):
    return (torch.Generator(device=device).manual_seed(seed), torch.Generator(device=device).manual_seed(seed))


def op_names(op_list):
    return [type(op).__name__ for op in op_list]


@pytest.mark.parametrize("processors,input_type,compiled", [
    ([Temperature(), Softmax()], None, ["FusedTemperatureSoftmaxOp"]),
    ([TopK(), Sample()], TensorType.PROBS, ["FusedProbsTopKSampleOp"]),
    ([TopP(), Sample()], None, ["FusedProbsTopPSampleOp"]),
    ([MinP(), Sample()], None, ["FusedProbsMinPSampleOp"]),
    ([TopK(joint_topk_topp=True), TopP(), Sample()], TensorType.PROBS, ["FusedProbsTopKTopPSampleOp"]),
    ([TopK(), TopP(), Sample()], TensorType.PROBS, ["ProbsTopKOp", "FusedProbsTopPSampleOp"]),
    ([Temperature(), Softmax(), TopK(joint_topk_topp=True), TopP(), Sample()], None,
     ["FusedTemperatureSoftmaxOp", "FusedProbsTopKTopPSampleOp"]),
    ([TopK(), Sample()], TensorType.LOGITS, ["LogitsTopKOp", "LogitsSampleOp"]),
])
def test_legalization_and_fusion(processors, input_type, compiled):
    pipe = LogitsPipe(processors, input_type=input_type)
    assert op_names(pipe.compiled_ops) == compiled
    inferred = TensorType.PROBS if isinstance(processors[0], (TopP, MinP)) else TensorType.LOGITS
    assert pipe.initial_type == (input_type or inferred)
    assert "compiled_ops=[" + " -> ".join(compiled) + "]" in repr(pipe)
    assert LogitsPipe(processors, input_type=input_type, compile=False).compiled_ops is None


def test_pipelines_equal_the_sampling_functions(device):
    """For one generator state a pipeline returns exactly what the function it stands for returns."""
    torch.manual_seed(0)
    logits = torch.randn(6, 90, device=device) * 3
    probs = torch.softmax(logits, -1)
    cases = [
        (LogitsPipe([TopK(), Sample()], input_type=TensorType.PROBS), probs, dict(top_k=5),
         lambda g: sampling.top_k_sampling_from_probs(probs, 5, generator=g)),
        (LogitsPipe([TopP(), Sample()]), probs, dict(top_p=0.6),
         lambda g: sampling.top_p_sampling_from_probs(probs, 0.6, generator=g)),
        (LogitsPipe([MinP(), Sample()]), probs, dict(min_p=0.2),
         lambda g: sampling.min_p_sampling_from_probs(probs, 0.2, generator=g)),
        (LogitsPipe([TopK(joint_topk_topp=True), TopP(), Sample()], input_type=TensorType.PROBS), probs,
         dict(top_k=7, top_p=0.5),
         lambda g: sampling.top_k_top_p_sampling_from_probs(probs, 7, 0.5, filter_apply_order="joint", generator=g)),
        (LogitsPipe([TopK(), TopP(), Sample()], input_type=TensorType.PROBS), probs, dict(top_k=7, top_p=0.5),
         lambda g: sampling.top_k_top_p_sampling_from_probs(probs, 7, 0.5, generator=g)),
        (LogitsPipe([Softmax(), TopK(joint_topk_topp=True), TopP(), Sample()]), logits, dict(top_k=7, top_p=0.5),
         lambda g: sampling.top_k_top_p_sampling_from_logits(logits, 7, 0.5, filter_apply_order="joint", generator=g)),
        (LogitsPipe([Sample()], input_type=TensorType.LOGITS), logits, {},
         lambda g: sampling.sampling_from_logits(logits, generator=g)),
    ]
    for pipe, x, params, direct in cases:
        g1, g2 = generators(device)
        out = pipe(x, generator=g1, **params)
        assert out.dtype == torch.int32 and out.shape == (6,)
        assert torch.equal(out, direct(g2)), repr(pipe)
    # top_k_first from logits: mask the logits with one pipe, then softmax / top-p / sample
    g1, g2 = generators(device)
    masked = LogitsPipe([TopK()], input_type=TensorType.LOGITS)(logits, top_k=7)
    out = LogitsPipe([Softmax(), TopP(), Sample()])(masked, top_p=0.5, generator=g1)
    assert torch.equal(out, sampling.top_k_top_p_sampling_from_logits(logits, 7, 0.5, generator=g2))


def test_discrete_ops_against_the_reference(device):
    torch.manual_seed(1)
    logits = torch.randn(4, 70, device=device) * 2
    probs = torch.softmax(logits, -1)
    t = torch.tensor([0.5, 1.0, 2.0, 0.8], device=device)
    for compile in (True, False):
        out = LogitsPipe([Temperature(), Softmax()], compile=compile)(logits, temperature=t)
        assert_close(out, reference.softmax(logits, t), torch.float32, name=f"compile={compile}")
        out = LogitsPipe([Temperature(), Softmax()], compile=compile)(logits, temperature=0.7)
        assert_close(out, reference.softmax(logits, 0.7), torch.float32, name=f"compile={compile}")
    assert torch.equal(LogitsPipe([TopK()], input_type=TensorType.LOGITS)(logits, top_k=5),
                       reference.top_k_mask_logits(logits, 5))
    assert_close(LogitsPipe([TopK()], input_type=TensorType.PROBS)(probs, top_k=5),
                 reference.top_k_renorm_probs(probs, 5), torch.float32)
    assert_close(LogitsPipe([TopP()])(probs, top_p=0.7), reference.top_p_renorm_probs(probs, 0.7), torch.float32)
    min_p = torch.tensor([0.1, 0.3, 0.5, 0.9], device=device)
    expected = reference.min_p_sampling_distribution(probs, min_p)
    assert_close(LogitsPipe([MinP()])(probs, min_p=min_p), expected, torch.float32)
    # compile-time parameters are defaults for the runtime ones
    pipe = LogitsPipe([TopK(top_k=3)], input_type=TensorType.PROBS)
    assert_close(pipe(TaggedTensor.probs(probs)), reference.top_k_renorm_probs(probs, 3), torch.float32)
    assert_close(pipe(probs, top_k=6), reference.top_k_renorm_probs(probs, 6), torch.float32)
    # a tagged tensor of another type than the pipeline's ops take is refused
    with pytest.raises(ValueError, match="takes PROBS, got LOGITS"):
        pipe(TaggedTensor.logits(logits))


@pytest.mark.parametrize("compile", [True, False])
def test_min_p_sample_frequencies(device, compile):
    probs = crafted_probs(60, device)[1:2]
    pipe = LogitsPipe([MinP(), Sample()], compile=compile)
    samples = pipe(probs, min_p=0.4, indices=torch.zeros(2000, dtype=torch.int32, device=device))
    check_frequencies(samples, reference.min_p_sampling_distribution(probs, 0.4)[0], f"compile={compile}")


def test_errors():
    with pytest.raises(ValueError, match="at least one processor"):
        LogitsPipe([])
    with pytest.raises(ValueError, match="pass input_type"):
        LogitsPipe([TopK(), Sample()])
    with pytest.raises(ValueError, match="TopP can only be applied to PROBS"):
        LogitsPipe([TopP()], input_type=TensorType.LOGITS)
    with pytest.raises(ValueError, match="Softmax"):
        LogitsPipe([Temperature(), Softmax(), Softmax()])
    with pytest.raises(ValueError, match="cannot be applied to INDICES"):
        LogitsPipe([Sample(), TopK()], input_type=TensorType.LOGITS)
    probs = torch.softmax(torch.randn(2, 10), -1)
    with pytest.raises(ValueError, match="required parameter 'top_p'"):
        LogitsPipe([TopP()])(probs)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        LogitsPipe([TopK(), Sample()], input_type=TensorType.PROBS)(probs, top_k=0)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        LogitsPipe([Temperature(), Softmax()])(probs, temperature=0.0)

    def no_sample(op_list):
        if any(op.OUT == TensorType.INDICES for op in op_list):
            raise CompileError("no sampling here")

    with pytest.raises(ValueError, match="no sampling here"):
        LogitsPipe([TopP(), Sample()], custom_validity_checks=[no_sample])


def test_custom_fusion_rule():
    rule = FusionRule((ops.TopPOp, ops.ProbsSampleOp), lambda w: True,
                      lambda w: ops.FusedProbsMinPSampleOp(), prio=1000)
    pipe = LogitsPipe([TopP(), Sample()], custom_fusion_rules=[rule])
    assert op_names(pipe.compiled_ops) == ["FusedProbsMinPSampleOp"]


def test_installed_as_flashinfer():
    from tritoninfer._compat import uninstall_flashinfer
    import tritoninfer.logits_processor as lp

    tritoninfer.install_as_flashinfer(force=True)
    try:
        from flashinfer.logits_processor import LogitsPipe as FiPipe
        from flashinfer.logits_processor import TensorType as FiType

        assert FiPipe is lp.LogitsPipe and FiType is lp.TensorType
    finally:
        uninstall_flashinfer()
