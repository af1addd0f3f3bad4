"""tritoninfer.activation against tritoninfer.reference (float32 torch), on CPU through the
interpreter."""

import inspect

import pytest
import torch

import tritoninfer
from tritoninfer import activation, reference

# relative error ||out - ref|| / ||ref|| allowed per output dtype (bf16 stores truncate under the
# interpreter: 2 ulp)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
NAMES = ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().float().cpu()
    ref = ref.detach().float().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, dtype, what=""):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e}"


def randn(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


# (name, dtype, shape): each activation with each dtype and a 1-D / 2-D / 3-D shape
CASES = [
    ("silu_and_mul", torch.float16, (5, 48)),
    ("silu_and_mul", torch.bfloat16, (2, 3, 20)),
    ("silu_and_mul", torch.float32, (2,)),
    ("gelu_and_mul", torch.float16, (2, 3, 20)),
    ("gelu_and_mul", torch.bfloat16, (7, 2)),
    ("gelu_and_mul", torch.float32, (5, 48)),
    ("gelu_tanh_and_mul", torch.float16, (3, 34)),
    ("gelu_tanh_and_mul", torch.bfloat16, (5, 48)),
    ("gelu_tanh_and_mul", torch.float32, (2, 3, 20)),
]


@pytest.mark.parametrize("name,dtype,shape", CASES)
def test_act_and_mul(device, name, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    x0 = x.clone()
    y = getattr(tritoninfer, name)(x)
    assert y.shape == shape[:-1] + (shape[-1] // 2,) and y.dtype == dtype
    assert_close(y, getattr(reference, name)(x), dtype, name)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("name", NAMES)
def test_out(device, name):
    x = randn(4, 32, dtype=torch.bfloat16, device=device)
    ref = getattr(reference, name)(x)
    out = torch.full((4, 16), float("nan"), dtype=torch.bfloat16, device=device)
    y = getattr(tritoninfer, name)(x, out)
    assert y is out
    assert_close(out, ref, torch.bfloat16, "out")


def test_strided_in_and_out(device):
    # a non-contiguous input (every other row) and an out buffer that is a column slice
    base = randn(8, 40, dtype=torch.float16, device=device)
    x = base[::2]
    big = torch.full((4, 30), float("nan"), dtype=torch.float16, device=device)
    out = big[:, 5:25]
    y = tritoninfer.silu_and_mul(x, out=out)
    assert y is out
    assert_close(big[:, 5:25], reference.silu_and_mul(x), torch.float16, "strided")
    assert torch.isnan(big[:, :5]).all() and torch.isnan(big[:, 25:]).all()
    # a 3-D out buffer that cannot be viewed as 2-D: written through a copy
    x3 = randn(3, 2, 8, dtype=torch.float32, device=device)
    out3 = torch.full((2, 3, 4), float("nan"), device=device).transpose(0, 1)
    y3 = tritoninfer.gelu_and_mul(x3, out=out3)
    assert y3 is out3
    assert_close(out3, reference.gelu_and_mul(x3), torch.float32, "3-D strided out")


def test_extreme_values(device):
    x = torch.tensor([[-100.0, -20.0, 0.5, 30.0, 1.0, 2.0, 3.0, 4.0]], device=device)
    for name in NAMES:
        y = getattr(tritoninfer, name)(x.half())
        assert torch.isfinite(y).all(), name
        assert_close(y, getattr(reference, name)(x.half()), torch.float16, name)


def test_empty(device):
    x = torch.zeros(0, 16, dtype=torch.float16, device=device)
    assert tritoninfer.silu_and_mul(x).shape == (0, 8)


def test_errors(device):
    x = randn(4, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="input"):
        tritoninfer.silu_and_mul(x[:, :15])
    with pytest.raises(ValueError, match="input"):
        tritoninfer.gelu_and_mul(x.to(torch.int32))
    with pytest.raises(ValueError, match="out"):
        tritoninfer.gelu_tanh_and_mul(x, torch.empty(4, 16, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="out"):
        tritoninfer.silu_and_mul(x, torch.empty(4, 8, dtype=torch.float32, device=device))


@pytest.mark.parametrize("name", NAMES)
def test_signature(name):
    assert name in activation.__all__ and getattr(tritoninfer, name) is getattr(activation, name)
    params = inspect.signature(getattr(activation, name)).parameters
    assert list(params) == ["input", "out", "enable_pdl"]
    assert params["input"].default is inspect.Parameter.empty
    assert params["out"].default is None and params["enable_pdl"].default is None


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_large(name, dtype):
    x = randn(4096, 2 * 14336, dtype=dtype, device="cuda", scale=2.0)
    assert_close(getattr(tritoninfer, name)(x), getattr(reference, name)(x), dtype, name)


@pytest.mark.gpu
def test_gpu_odd_width():
    x = randn(333, 2 * 1000, dtype=torch.bfloat16, device="cuda")
    assert_close(tritoninfer.silu_and_mul(x), reference.silu_and_mul(x), torch.bfloat16, "odd")
