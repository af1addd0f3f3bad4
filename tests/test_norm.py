"""tritoninfer.norm against tritoninfer.reference (float32 torch), on CPU through the interpreter."""

import inspect

import pytest
import torch

import tritoninfer
from tritoninfer import norm, reference, testing

# relative error ||out - ref|| / ||ref|| allowed per output dtype (bf16 stores truncate under the
# interpreter: 2 ulp)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


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


# (dtype, shape, weight dtype, eps)
RMSNORM_CASES = [
    (torch.float16, (5, 24), torch.float16, 1e-6),
    (torch.bfloat16, (3, 64), torch.bfloat16, 1e-5),
    (torch.float32, (7, 40), torch.float32, 1e-6),
    (torch.bfloat16, (4, 3, 16), torch.float32, 1e-6),
    (torch.float16, (2, 5, 12), torch.float16, 1e-2),
    (torch.float32, (1, 1), torch.float32, 1e-6),
]


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype,shape,w_dtype,eps", RMSNORM_CASES)
def test_rmsnorm(device, gemma, dtype, shape, w_dtype, eps):
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    w = randn(shape[-1], dtype=w_dtype, device=device)
    fn, ref_fn = (
        (tritoninfer.gemma_rmsnorm, reference.gemma_rmsnorm)
        if gemma
        else (tritoninfer.rmsnorm, reference.rmsnorm)
    )
    x0 = x.clone()
    y = fn(x, w, eps)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, ref_fn(x, w, eps), dtype, "out")
    assert torch.equal(x, x0)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize(
    "dtype,shape", [(torch.float16, (6, 24)), (torch.bfloat16, (3, 2, 32)), (torch.float32, (4, 20))]
)
def test_fused_add_rmsnorm(device, gemma, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device)
    r = randn(*shape, dtype=dtype, device=device, scale=2.0)
    w = randn(shape[-1], dtype=dtype, device=device)
    fn, ref_fn = (
        (tritoninfer.gemma_fused_add_rmsnorm, reference.gemma_fused_add_rmsnorm)
        if gemma
        else (tritoninfer.fused_add_rmsnorm, reference.fused_add_rmsnorm)
    )
    ref_out, ref_res = ref_fn(x, r, w, 1e-6)
    x_ptr, r_ptr = x.data_ptr(), r.data_ptr()
    assert fn(x, r, w, 1e-6) is None
    assert x.data_ptr() == x_ptr and r.data_ptr() == r_ptr
    assert_close(r, ref_res, dtype, "residual")
    assert_close(x, ref_out, dtype, "input")


def test_rmsnorm_out(device):
    x = randn(4, 24, dtype=torch.float16, device=device)
    w = randn(24, dtype=torch.float16, device=device)
    ref = reference.rmsnorm(x, w)
    out = torch.full_like(x, float("nan"))
    y = tritoninfer.rmsnorm(x, w, out=out)
    assert y is out
    assert_close(out, ref, torch.float16, "out")
    # a strided out buffer (columns of a wider tensor)
    big = torch.full((4, 40), float("nan"), dtype=torch.float16, device=device)
    y = tritoninfer.gemma_rmsnorm(x, w, out=big[:, 8:32])
    assert_close(big[:, 8:32], reference.gemma_rmsnorm(x, w), torch.float16, "strided out")
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 32:]).all()
    # out aliasing input
    x2 = x.clone()
    tritoninfer.rmsnorm(x2, w, out=x2)
    assert_close(x2, ref, torch.float16, "out=input")


def test_strided_inputs(device):
    """Per-head q norm on q inside a packed qkv [nnz, H, D] tensor, and a transposed 2-D input."""
    qkv = randn(5, 6, 16, dtype=torch.bfloat16, device=device)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    w = randn(16, dtype=torch.bfloat16, device=device)
    assert_close(tritoninfer.rmsnorm(q, w), reference.rmsnorm(q, w), torch.bfloat16, "3-D view")
    xt = randn(24, 6, dtype=torch.float32, device=device).t()
    w2 = randn(24, dtype=torch.float32, device=device)
    assert_close(tritoninfer.rmsnorm(xt, w2), reference.rmsnorm(xt, w2), torch.float32, "x.T")
    # fused, in place on strided views
    base_x = randn(4, 48, dtype=torch.float16, device=device)
    base_r = randn(48, 4, dtype=torch.float16, device=device)
    x, r = base_x[:, :24], base_r.t()[:, 8:32]
    w3 = randn(24, dtype=torch.float16, device=device)
    ref_out, ref_res = reference.fused_add_rmsnorm(x, r, w3)
    tail = base_x[:, 24:].clone()
    tritoninfer.fused_add_rmsnorm(x, r, w3)
    assert_close(base_x[:, :24], ref_out, torch.float16, "input")
    assert_close(base_r.t()[:, 8:32], ref_res, torch.float16, "residual")
    assert torch.equal(base_x[:, 24:], tail)


def test_chunked_rows(device, monkeypatch):
    """Rows wider than the register tile are walked in chunks (two passes)."""
    monkeypatch.setattr(norm, "_MAX_BLOCK_N", 8)
    x = randn(3, 20, dtype=torch.float16, device=device, scale=2.0)
    r = randn(3, 20, dtype=torch.float16, device=device)
    w = randn(20, dtype=torch.float16, device=device)
    assert_close(tritoninfer.rmsnorm(x, w), reference.rmsnorm(x, w), torch.float16, "rmsnorm")
    ref_out, ref_res = reference.gemma_fused_add_rmsnorm(x, r, w)
    tritoninfer.gemma_fused_add_rmsnorm(x, r, w)
    assert_close(r, ref_res, torch.float16, "residual")
    assert_close(x, ref_out, torch.float16, "input")


def test_empty(device):
    x = torch.zeros(0, 16, dtype=torch.float16, device=device)
    w = torch.ones(16, dtype=torch.float16, device=device)
    assert tritoninfer.rmsnorm(x, w).shape == (0, 16)
    tritoninfer.fused_add_rmsnorm(x, x.clone(), w)


def test_errors(device):
    x = randn(4, 16, dtype=torch.float16, device=device)
    w = randn(16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="input"):
        tritoninfer.rmsnorm(x[0], w)
    with pytest.raises(ValueError, match="input"):
        tritoninfer.rmsnorm(x.reshape(1, 1, 4, 16), w)
    with pytest.raises(ValueError, match="input"):
        tritoninfer.rmsnorm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="weight"):
        tritoninfer.rmsnorm(x, w[:8])
    with pytest.raises(ValueError, match="weight"):
        tritoninfer.gemma_rmsnorm(x, w.reshape(2, 8))
    with pytest.raises(ValueError, match="out"):
        tritoninfer.rmsnorm(x, w, out=torch.empty(4, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="out"):
        tritoninfer.rmsnorm(x, w, out=torch.empty(4, 16, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="residual"):
        tritoninfer.fused_add_rmsnorm(x, x[:3].clone(), w)
    with pytest.raises(ValueError, match="residual"):
        tritoninfer.gemma_fused_add_rmsnorm(x, x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="weight"):
        tritoninfer.fused_add_rmsnorm(x, x.clone(), w[:4])


def test_enable_pdl_accepted(device):
    x = randn(2, 16, dtype=torch.float16, device=device)
    w = randn(16, dtype=torch.float16, device=device)
    for v in (None, True, False):
        assert_close(tritoninfer.rmsnorm(x, w, enable_pdl=v), reference.rmsnorm(x, w),
                     torch.float16, "out")


SIGNATURES = {
    "rmsnorm": ["input", "weight", "eps", "out", "enable_pdl"],
    "gemma_rmsnorm": ["input", "weight", "eps", "out", "enable_pdl"],
    "fused_add_rmsnorm": ["input", "residual", "weight", "eps", "enable_pdl"],
    "gemma_fused_add_rmsnorm": ["input", "residual", "weight", "eps", "enable_pdl"],
}
DEFAULTS = {"eps": 1e-6, "out": None, "enable_pdl": None}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name):
    assert name in norm.__all__ and getattr(tritoninfer, name) is getattr(norm, name)
    params = inspect.signature(getattr(norm, name)).parameters
    assert list(params) == SIGNATURES[name]
    for p in params.values():
        expected = DEFAULTS.get(p.name, inspect.Parameter.empty)
        assert p.default == expected or (p.default is expected)


# ------------------------------------------------------------------------------------------------
# GPU: realistic shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [4096, 5120, 8192])
def test_gpu_rmsnorm_large(dtype, hidden):
    x = randn(4096, hidden, dtype=dtype, device="cuda")
    w = randn(hidden, dtype=dtype, device="cuda")
    assert_close(tritoninfer.rmsnorm(x, w), reference.rmsnorm(x, w), dtype, "rmsnorm")
    assert_close(tritoninfer.gemma_rmsnorm(x, w), reference.gemma_rmsnorm(x, w), dtype, "gemma")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fused_add_rmsnorm_large(dtype):
    x = randn(4096, 4096, dtype=dtype, device="cuda")
    r = randn(4096, 4096, dtype=dtype, device="cuda")
    w = randn(4096, dtype=dtype, device="cuda")
    ref_out, ref_res = reference.fused_add_rmsnorm(x, r, w)
    tritoninfer.fused_add_rmsnorm(x, r, w)
    assert_close(r, ref_res, dtype, "residual")
    assert_close(x, ref_out, dtype, "input")


@pytest.mark.gpu
def test_gpu_qk_norm_3d_and_wide_rows():
    qkv = randn(4096, 48, 128, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, :32]
    w = randn(128, dtype=torch.bfloat16, device="cuda")
    assert_close(tritoninfer.rmsnorm(q, w), reference.rmsnorm(q, w), torch.bfloat16, "3-D")
    x = randn(64, 40000, dtype=torch.bfloat16, device="cuda")  # chunked path
    w2 = randn(40000, dtype=torch.bfloat16, device="cuda")
    assert_close(tritoninfer.rmsnorm(x, w2), reference.rmsnorm(x, w2), torch.bfloat16, "wide")


# ------------------------------------------------------------------------------------------------
# layernorm
# ------------------------------------------------------------------------------------------------

# (input dtype, shape, gemma/beta dtype, eps): FlashInfer 0.5.3 takes bf16 input with fp32 gemma/beta
# (its test: hidden 128, 129, 1024, 16384); tritoninfer also takes fp16/fp32 and 16-bit affine terms.
LAYERNORM_CASES = [
    (torch.bfloat16, (3, 129), torch.float32, 1e-6),
    (torch.bfloat16, (1, 128), torch.float32, 1e-5),
    (torch.float16, (5, 40), torch.float16, 1e-6),
    (torch.float32, (4, 24), torch.bfloat16, 1e-2),
    (torch.float32, (2, 1), torch.float32, 1e-6),
]


@pytest.mark.parametrize("dtype,shape,p_dtype,eps", LAYERNORM_CASES)
def test_layernorm(device, dtype, shape, p_dtype, eps):
    # an offset mean and a spread of row scales: the mean subtraction and the variance both matter
    x = (randn(*shape, dtype=torch.float32, device=device) * torch.rand(shape[0], 1, device=device).mul(4)
         + 3.0).to(dtype)
    gemma = randn(shape[1], dtype=p_dtype, device=device)
    beta = randn(shape[1], dtype=p_dtype, device=device)
    x0 = x.clone()
    out = norm.layernorm(x, gemma, beta, eps)
    assert out.shape == x.shape and out.dtype == dtype
    testing.assert_close(out, reference.layernorm(x, gemma, beta, eps), dtype, "layernorm")
    assert torch.equal(x, x0)


def test_layernorm_strided_and_chunked(device, monkeypatch):
    """A column slice of a wider tensor (row stride != hidden), and rows walked in chunks (three passes)."""
    base = randn(4, 50, dtype=torch.bfloat16, device=device, scale=2.0)
    x = base[:, 5:45]
    gemma, beta = randn(40, dtype=torch.float32, device=device), randn(40, dtype=torch.float32, device=device)
    ref = reference.layernorm(x, gemma, beta)
    testing.assert_close(norm.layernorm(x, gemma, beta), ref, torch.bfloat16, "strided")
    monkeypatch.setattr(norm, "_MAX_BLOCK_N", 16)
    testing.assert_close(norm.layernorm(x, gemma, beta), ref, torch.bfloat16, "chunked")


def test_layernorm_empty_and_errors(device):
    g = torch.ones(16, device=device)
    assert norm.layernorm(torch.zeros(0, 16, dtype=torch.bfloat16, device=device), g, g).shape == (0, 16)
    x = randn(4, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="input"):
        norm.layernorm(x.reshape(2, 2, 16), g, g)
    with pytest.raises(ValueError, match="input"):
        norm.layernorm(x.to(torch.int32), g, g)
    with pytest.raises(ValueError, match="gemma"):
        norm.layernorm(x, g[:8], g)
    with pytest.raises(ValueError, match="beta"):
        norm.layernorm(x, g, g.to(torch.int32))
    with pytest.raises(TypeError, match="beta"):
        norm.layernorm(x, g, None)


def test_layernorm_signature():
    """FlashInfer 0.5.3's ``layernorm(input, gemma, beta, eps=1e-6)`` (the top-level export is wired separately)."""
    params = inspect.signature(norm.layernorm).parameters
    assert list(params) == ["input", "gemma", "beta", "eps"]
    assert params["eps"].default == 1e-6
    assert all(params[p].default is inspect.Parameter.empty for p in ("input", "gemma", "beta"))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,hidden", [(1, 128), (3, 129), (128, 1024), (128, 16384), (7, 20000)])
def test_gpu_layernorm(batch, hidden):
    x = randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
    gemma = randn(hidden, dtype=torch.float32, device="cuda")
    beta = randn(hidden, dtype=torch.float32, device="cuda")
    testing.assert_close(norm.layernorm(x, gemma, beta, 1e-6), reference.layernorm(x, gemma, beta, 1e-6),
                         torch.bfloat16, "layernorm")


def test_layernorm_kernel_compiles_for_sm90():
    """The interpreter does not apply the compiler's type rules: compile both loop forms for sm_90 on
    the CPU (Triton ships ptxas)."""
    import os
    import subprocess
    import sys

    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritoninfer.kernels.norm import layernorm_kernel

for chunks in (1, 3):
    ce = dict(ROWS=2, BLOCK_N=1024, NUM_CHUNKS=chunks)
    sig = {p.name: "constexpr" if p.name in ce else
           {"x_ptr": "*bf16", "out_ptr": "*bf16", "gamma_ptr": "*fp32", "beta_ptr": "*fp32"}.get(p.name,
           "fp32" if p.name == "eps" else "i32") for p in layernorm_kernel.params}
    k = triton.compile(ASTSource(layernorm_kernel, sig, ce), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8))
    print("case", chunks, bool(k.asm["cubin"]), flush=True)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert done.stdout.splitlines() == ["case 1 True", "case 3 True"], done.stdout
