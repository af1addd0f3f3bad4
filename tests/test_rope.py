"""tritoninfer.rope against tritoninfer.reference (float32 torch), on CPU through the interpreter.

Parameters are covered pairwise (dtype x head_dim x rotary_dim x interleave x heads x scale/theta x
index dtype), not as a full product: each interpreted launch costs ~0.1 s.
"""

import inspect

import pytest
import torch
from conftest import ON_GPU

import tritoninfer
from tritoninfer import reference, testing
from tritoninfer import rope

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


def make_qk(nnz, hq, hk, d, dtype, device):
    q = torch.randn(nnz, hq, d, dtype=torch.float32, device=device).to(dtype)
    k = torch.randn(nnz, hk, d, dtype=torch.float32, device=device).to(dtype)
    return q, k


def make_indptr(lens, device, dtype=torch.int32):
    ind = [0]
    for n in lens:
        ind.append(ind[-1] + n)
    return torch.tensor(ind, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------------
# pos_ids forms
# ------------------------------------------------------------------------------------------------

# (dtype, head_dim, rotary_dim, interleave, hq, hk, rope_scale, rope_theta, pos_dtype)
POS_IDS_CASES = [
    (torch.float16, 16, None, False, 4, 2, 1.0, 1e4, torch.int32),
    (torch.bfloat16, 16, 8, True, 2, 2, 2.0, 1e4, torch.int64),
    (torch.float32, 32, None, True, 3, 1, 1.0, 5e5, torch.int32),
    (torch.float16, 24, 12, False, 1, 3, 4.0, 1e6, torch.int64),
    (torch.float32, 16, 10, False, 2, 2, 0.5, 100.0, torch.int64),
    (torch.bfloat16, 40, None, False, 5, 1, 1.0, 1e4, torch.int32),
    (torch.float16, 8, 2, True, 1, 1, 1.0, 1e4, torch.int32),
]


@pytest.mark.parametrize("dtype,d,rot,inter,hq,hk,scale,theta,pos_dtype", POS_IDS_CASES)
def test_apply_rope_pos_ids(device, dtype, d, rot, inter, hq, hk, scale, theta, pos_dtype):
    nnz = 7
    q, k = make_qk(nnz, hq, hk, d, dtype, device)
    pos = torch.randint(0, 60, (nnz,), dtype=pos_dtype, device=device)
    q0, k0 = q.clone(), k.clone()
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos, rot, inter, scale, theta)
    ref_q, ref_k = reference.apply_rope_pos_ids(q, k, pos, rot, inter, scale, theta)
    assert q_rope.shape == q.shape and k_rope.shape == k.shape
    assert q_rope.dtype == dtype and k_rope.dtype == dtype
    assert_close(q_rope, ref_q, dtype, "q")
    assert_close(k_rope, ref_k, dtype, "k")
    # inputs untouched
    assert torch.equal(q, q0) and torch.equal(k, k0)
    if rot is not None and rot < d:
        # pass-through dims are copied bit for bit
        assert torch.equal(q_rope[..., rot:], q[..., rot:])
        assert torch.equal(k_rope[..., rot:], k[..., rot:])


@pytest.mark.parametrize("dtype,inter", [(torch.float16, False), (torch.bfloat16, True)])
def test_apply_rope_pos_ids_inplace(device, dtype, inter):
    q, k = make_qk(6, 3, 1, 16, dtype, device)
    pos = torch.tensor([0, 5, 9, 33, 2, 17], dtype=torch.int32, device=device)
    ref_q, ref_k = reference.apply_rope_pos_ids(q, k, pos, 12, inter, 1.0, 1e4)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    assert tritoninfer.apply_rope_pos_ids_inplace(q, k, pos, 12, inter) is None
    assert q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    assert_close(q, ref_q, dtype, "q")
    assert_close(k, ref_k, dtype, "k")


def test_position_zero_is_identity(device):
    q, k = make_qk(3, 2, 2, 16, torch.float16, device)
    pos = torch.zeros(3, dtype=torch.int32, device=device)
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos)
    assert torch.equal(q_rope, q) and torch.equal(k_rope, k)


# ------------------------------------------------------------------------------------------------
# ragged (indptr, offsets) forms
# ------------------------------------------------------------------------------------------------

# (dtype, lens, interleave, rotary_dim, index dtype)
RAGGED_CASES = [
    (torch.float16, [3, 0, 5, 1], False, None, torch.int32),
    (torch.bfloat16, [9], True, 8, torch.int64),
    (torch.float32, [1, 1, 1, 4, 0], True, None, torch.int32),
    (torch.float16, [0, 2, 7], False, 6, torch.int64),
]


@pytest.mark.parametrize("dtype,lens,inter,rot,idx_dtype", RAGGED_CASES)
def test_apply_rope_ragged(device, dtype, lens, inter, rot, idx_dtype):
    nnz = sum(lens)
    q, k = make_qk(nnz, 3, 2, 16, dtype, device)
    indptr = make_indptr(lens, device, idx_dtype)
    offsets = torch.randint(0, 40, (len(lens),), dtype=idx_dtype, device=device)
    q_rope, k_rope = tritoninfer.apply_rope(q, k, indptr, offsets, rot, inter, 2.0, 1e4)
    ref_q, ref_k = reference.apply_rope(q, k, indptr, offsets, rot, inter, 2.0, 1e4)
    assert_close(q_rope, ref_q, dtype, "q")
    assert_close(k_rope, ref_k, dtype, "k")


def test_apply_rope_ragged_positions_match_pos_ids(device):
    """Row indptr[i] + j is at position offsets[i] + j: same result as the pos_ids form."""
    lens = [2, 0, 4, 3]
    q, k = make_qk(sum(lens), 2, 2, 16, torch.float32, device)
    indptr = make_indptr(lens, device)
    offsets = torch.tensor([7, 3, 0, 20], dtype=torch.int32, device=device)
    pos = torch.tensor([7, 8, 0, 1, 2, 3, 20, 21, 22], dtype=torch.int32, device=device)
    a = tritoninfer.apply_rope(q, k, indptr, offsets)
    b = tritoninfer.apply_rope_pos_ids(q, k, pos)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_apply_rope_inplace(device):
    lens = [4, 3]
    q, k = make_qk(7, 2, 2, 16, torch.float16, device)
    indptr = make_indptr(lens, device)
    offsets = torch.tensor([5, 11], dtype=torch.int32, device=device)
    ref_q, ref_k = reference.apply_rope(q, k, indptr, offsets, None, True)
    q_ptr = q.data_ptr()
    assert tritoninfer.apply_rope_inplace(q, k, indptr, offsets, interleave=True) is None
    assert q.data_ptr() == q_ptr
    assert_close(q, ref_q, torch.float16, "q")
    assert_close(k, ref_k, torch.float16, "k")


def test_rows_outside_indptr_unrotated(device):
    """tritoninfer leaves rows past indptr[-1] unrotated (FlashInfer leaves them unwritten)."""
    q, k = make_qk(6, 1, 1, 8, torch.float32, device)
    indptr = make_indptr([4], device)
    offsets = torch.tensor([3], dtype=torch.int32, device=device)
    q_rope, k_rope = tritoninfer.apply_rope(q, k, indptr, offsets)
    ref_q, _ = reference.apply_rope(q[:4], k[:4], indptr, offsets)
    assert_close(q_rope[:4], ref_q, torch.float32, "q")
    assert torch.equal(q_rope[4:], q[4:]) and torch.equal(k_rope[4:], k[4:])


# ------------------------------------------------------------------------------------------------
# Llama 3.1
# ------------------------------------------------------------------------------------------------

# rope_theta 1e4, head_dim 16, old_context_len 64: pair 0 is kept (wavelength 6.3 < 16), pairs 1-2
# are interpolated (19.9, 62.8 in [16, 64]), pairs 3+ divided by rope_scale: all three regimes.
# The defaults (theta 5e5, old_context_len 8192) also hit all three at head_dim 16.
LLAMA_CASES = [
    # (dtype, interleave, rotary_dim, kwargs)
    (torch.float32, False, None, dict(rope_scale=4.0, rope_theta=1e4, old_context_len=64)),
    (torch.float16, True, None, dict()),
    (torch.bfloat16, False, 12, dict(rope_scale=8.0, rope_theta=1e4, low_freq_factor=2.0,
                                      high_freq_factor=8.0, old_context_len=128)),
    (torch.float32, True, 8, dict(rope_theta=1e4, old_context_len=64)),
]


@pytest.mark.parametrize("dtype,inter,rot,kw", LLAMA_CASES)
def test_apply_llama31_rope_pos_ids(device, dtype, inter, rot, kw):
    q, k = make_qk(6, 2, 2, 16, dtype, device)
    pos = torch.tensor([0, 1, 9, 40, 77, 13], dtype=torch.int64, device=device)
    q_rope, k_rope = tritoninfer.apply_llama31_rope_pos_ids(q, k, pos, rot, inter, **kw)
    ref_q, ref_k = reference.apply_llama31_rope_pos_ids(q, k, pos, rot, inter, **kw)
    assert_close(q_rope, ref_q, dtype, "q")
    assert_close(k_rope, ref_k, dtype, "k")


def test_apply_llama31_rope_ragged(device):
    lens = [3, 0, 4]
    q, k = make_qk(7, 2, 1, 16, torch.float16, device)
    indptr = make_indptr(lens, device)
    offsets = torch.tensor([30, 0, 2], dtype=torch.int32, device=device)
    kw = dict(rope_scale=4.0, rope_theta=1e4, old_context_len=64)
    q_rope, k_rope = tritoninfer.apply_llama31_rope(q, k, indptr, offsets, **kw)
    ref_q, ref_k = reference.apply_llama31_rope(q, k, indptr, offsets, **kw)
    assert_close(q_rope, ref_q, torch.float16, "q")
    assert_close(k_rope, ref_k, torch.float16, "k")


@pytest.mark.parametrize("form", ["ragged", "pos_ids"])
def test_apply_llama31_rope_inplace(device, form):
    q, k = make_qk(5, 2, 2, 16, torch.bfloat16, device)
    kw = dict(rope_theta=1e4, old_context_len=64)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    if form == "ragged":
        indptr = make_indptr([2, 3], device)
        offsets = torch.tensor([4, 50], dtype=torch.int32, device=device)
        ref_q, ref_k = reference.apply_llama31_rope(q, k, indptr, offsets, **kw)
        assert tritoninfer.apply_llama31_rope_inplace(q, k, indptr, offsets, **kw) is None
    else:
        pos = torch.tensor([4, 5, 50, 51, 52], dtype=torch.int32, device=device)
        ref_q, ref_k = reference.apply_llama31_rope_pos_ids(q, k, pos, **kw)
        assert tritoninfer.apply_llama31_rope_pos_ids_inplace(q, k, pos, **kw) is None
    assert q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    assert_close(q, ref_q, torch.bfloat16, "q")
    assert_close(k, ref_k, torch.bfloat16, "k")


def test_llama31_reference_regimes():
    """The reference's smoothing: high frequencies kept, low ones divided, a ramp in between."""
    f = reference.llama31_rope_inv_freq(16, 4.0, 1e4, 1.0, 4.0, 64)
    plain = reference.rope_inv_freq(16, 1.0, 1e4)
    assert torch.allclose(f[0], plain[0])
    assert torch.allclose(f[3:], plain[3:] / 4.0)
    assert bool(((f[1:3] < plain[1:3]) & (f[1:3] > plain[1:3] / 4.0)).all())


# ------------------------------------------------------------------------------------------------
# cos/sin cache form
# ------------------------------------------------------------------------------------------------


def make_cos_sin_cache(max_pos, rotary_dim, theta=1e4, device="cpu"):
    inv = reference.rope_inv_freq(rotary_dim, 1.0, theta)
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(device)


# (dtype, is_neox, head_size, rotary_dim, 3-D input, positions dtype)
CACHE_CASES = [
    (torch.float16, True, 16, 16, False, torch.int64),
    (torch.bfloat16, False, 16, 8, False, torch.int32),
    (torch.float32, True, 24, 12, True, torch.int64),
    (torch.float16, False, 32, 32, True, torch.int64),
]


@pytest.mark.parametrize("dtype,neox,hs,rot,three_d,pos_dtype", CACHE_CASES)
def test_apply_rope_with_cos_sin_cache(device, dtype, neox, hs, rot, three_d, pos_dtype):
    nnz, hq, hk = 6, 3, 2
    cache = make_cos_sin_cache(64, rot, device=device)
    shape_q = (nnz, hq, hs) if three_d else (nnz, hq * hs)
    shape_k = (nnz, hk, hs) if three_d else (nnz, hk * hs)
    query = torch.randn(shape_q, device=device).to(dtype)
    key = torch.randn(shape_k, device=device).to(dtype)
    positions = torch.randint(0, 64, (nnz,), dtype=pos_dtype, device=device)
    q_out, k_out = tritoninfer.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, neox)
    assert q_out.shape == query.shape and k_out.shape == key.shape
    ref_q, ref_k = reference.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, neox)
    assert_close(q_out, ref_q, dtype, "query")
    assert_close(k_out, ref_k, dtype, "key")


def test_cos_sin_cache_matches_on_the_fly(device):
    """A cache built from theta^(-2j/rotary_dim) gives apply_rope_pos_ids' result."""
    q, k = make_qk(5, 2, 2, 16, torch.float32, device)
    pos = torch.tensor([0, 3, 17, 60, 2], dtype=torch.int64, device=device)
    cache = make_cos_sin_cache(64, 16, device=device)
    q_a, k_a = tritoninfer.apply_rope_with_cos_sin_cache(
        pos, q.reshape(5, -1), k.reshape(5, -1), 16, cache, is_neox=False
    )
    q_b, k_b = tritoninfer.apply_rope_pos_ids(q, k, pos, interleave=True)
    assert rel_err(q_a.view_as(q), q_b) < 1e-5 and rel_err(k_a.view_as(k), k_b) < 1e-5


def test_apply_rope_with_cos_sin_cache_inplace_strided(device):
    """In place on q/k that are column slices of one packed qkv tensor; v is untouched."""
    nnz, hq, hk, hs = 5, 2, 1, 16
    qkv = torch.randn(nnz, (hq + 2 * hk) * hs, device=device).to(torch.float16)
    query = qkv[:, : hq * hs]
    key = qkv[:, hq * hs: (hq + hk) * hs]
    v_before = qkv[:, (hq + hk) * hs:].clone()
    cache = make_cos_sin_cache(32, 16, device=device)
    positions = torch.tensor([1, 2, 3, 30, 31], device=device)
    ref_q, ref_k = reference.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache)
    assert tritoninfer.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache) is None
    assert_close(qkv[:, : hq * hs], ref_q, torch.float16, "query")
    assert_close(qkv[:, hq * hs: (hq + hk) * hs], ref_k, torch.float16, "key")
    assert torch.equal(qkv[:, (hq + hk) * hs:], v_before)


def test_cos_sin_cache_position_out_of_range_unrotated(device):
    cache = make_cos_sin_cache(8, 8, device=device)
    query = torch.randn(3, 8, device=device)
    key = torch.randn(3, 8, device=device)
    positions = torch.tensor([2, 8, -1], device=device)
    q_out, _ = tritoninfer.apply_rope_with_cos_sin_cache(positions, query, key, 8, cache)
    assert torch.equal(q_out[1:], query[1:])


# ------------------------------------------------------------------------------------------------
# strided inputs, empty inputs
# ------------------------------------------------------------------------------------------------


def test_strided_qk_out_of_place(device):
    """q and k as head slices of one packed [nnz, Hq + 2 Hk, D] tensor (FlashInfer's example)."""
    nnz, hq, hk, d = 6, 2, 2, 16
    qkv = torch.randn(nnz, hq + 2 * hk, d, device=device).to(torch.bfloat16)
    q, k = qkv[:, :hq], qkv[:, hq: hq + hk]
    assert not q.is_contiguous()
    before = qkv.clone()
    pos = torch.arange(nnz, device=device) * 7
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos, interleave=True)
    ref_q, ref_k = reference.apply_rope_pos_ids(q, k, pos, interleave=True)
    assert_close(q_rope, ref_q, torch.bfloat16, "q")
    assert_close(k_rope, ref_k, torch.bfloat16, "k")
    assert torch.equal(qkv, before)
    tritoninfer.apply_rope_pos_ids_inplace(q, k, pos, interleave=True)
    assert_close(qkv[:, :hq], ref_q, torch.bfloat16, "q in place")
    assert torch.equal(qkv[:, hq + hk:], before[:, hq + hk:])


def test_empty(device):
    q, k = make_qk(0, 2, 2, 16, torch.float16, device)
    pos = torch.zeros(0, dtype=torch.int32, device=device)
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos)
    assert q_rope.shape == q.shape and k_rope.shape == k.shape
    indptr = torch.zeros(1, dtype=torch.int32, device=device)
    offsets = torch.zeros(0, dtype=torch.int32, device=device)
    tritoninfer.apply_rope_inplace(q, k, indptr, offsets)


# ------------------------------------------------------------------------------------------------
# agreement with the attention reference's ROPE_LLAMA rotation
# ------------------------------------------------------------------------------------------------


def test_matches_reference_apply_rotary_llama(device):
    apply_rotary_llama = getattr(reference, "apply_rotary_llama", None)
    if apply_rotary_llama is None:
        pytest.skip("tritoninfer.reference.apply_rotary_llama is not available yet")
    q, k = make_qk(6, 2, 2, 16, torch.float32, device)
    pos = torch.tensor([0, 1, 5, 17, 40, 63], dtype=torch.int64, device=device)
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos, None, False, 2.0, 1e4)
    assert rel_err(q_rope, apply_rotary_llama(q, pos, 2.0, 1e4)) < 1e-5
    assert rel_err(k_rope, apply_rotary_llama(k, pos, 2.0, 1e4)) < 1e-5


# ------------------------------------------------------------------------------------------------
# errors and signatures
# ------------------------------------------------------------------------------------------------


def test_errors(device):
    q, k = make_qk(4, 2, 2, 16, torch.float16, device)
    pos = torch.arange(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="q"):
        tritoninfer.apply_rope_pos_ids(q.reshape(4, 32), k, pos)
    with pytest.raises(ValueError, match="k"):
        tritoninfer.apply_rope_pos_ids(q, k[..., :8], pos)
    with pytest.raises(ValueError, match="k"):
        tritoninfer.apply_rope_pos_ids(q, k[:3], pos)
    with pytest.raises(ValueError, match="rotary_dim"):
        tritoninfer.apply_rope_pos_ids(q, k, pos, rotary_dim=7)
    with pytest.raises(ValueError, match="rotary_dim"):
        tritoninfer.apply_rope_pos_ids(q, k, pos, rotary_dim=32)
    with pytest.raises(ValueError, match="pos_ids"):
        tritoninfer.apply_rope_pos_ids(q, k, pos[:3])
    with pytest.raises(ValueError, match="pos_ids"):
        tritoninfer.apply_rope_pos_ids(q, k, pos.float())
    with pytest.raises(ValueError, match="q"):
        tritoninfer.apply_rope_pos_ids(q.to(torch.int32), k, pos)
    with pytest.raises(ValueError, match="rope_scale"):
        tritoninfer.apply_rope_pos_ids(q, k, pos, rope_scale=0.0)
    with pytest.raises(ValueError, match="rope_theta"):
        tritoninfer.apply_rope_pos_ids(q, k, pos, rope_theta=-1.0)
    indptr = make_indptr([2, 2], device)
    with pytest.raises(ValueError, match="offsets"):
        tritoninfer.apply_rope(q, k, indptr, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="indptr"):
        tritoninfer.apply_rope(q, k, indptr.reshape(1, 3), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="high_freq_factor"):
        tritoninfer.apply_llama31_rope_pos_ids(q, k, pos, low_freq_factor=4, high_freq_factor=4)
    cache = make_cos_sin_cache(8, 16, device=device)
    flat_q, flat_k = q.reshape(4, 32), k.reshape(4, 32)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        tritoninfer.apply_rope_with_cos_sin_cache(pos, flat_q, flat_k, 16, cache.half())
    with pytest.raises(ValueError, match="query"):
        tritoninfer.apply_rope_with_cos_sin_cache(pos, flat_q[:, :24], flat_k, 16, cache)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        tritoninfer.apply_rope_with_cos_sin_cache(pos, flat_q, flat_k, 8, cache)
    with pytest.raises(ValueError, match="positions"):
        tritoninfer.apply_rope_with_cos_sin_cache(pos[:2], flat_q, flat_k, 16, cache)


_RAGGED = ["q", "k", "indptr", "offsets", "rotary_dim", "interleave", "rope_scale", "rope_theta"]
_IDS = ["q", "k", "pos_ids", "rotary_dim", "interleave", "rope_scale", "rope_theta"]
_LLAMA = ["low_freq_factor", "high_freq_factor", "old_context_len"]
_PLAIN_DEFAULTS = {"rotary_dim": None, "interleave": False, "rope_scale": 1, "rope_theta": 1e4}
_LLAMA_DEFAULTS = {"rotary_dim": None, "interleave": False, "rope_scale": 8, "rope_theta": 5e5,
                   "low_freq_factor": 1, "high_freq_factor": 4, "old_context_len": 8192}
_CACHE = ["positions", "query", "key", "head_size", "cos_sin_cache", "is_neox"]

SIGNATURES = {
    "apply_rope": (_RAGGED, _PLAIN_DEFAULTS),
    "apply_rope_inplace": (_RAGGED, _PLAIN_DEFAULTS),
    "apply_rope_pos_ids": (_IDS, _PLAIN_DEFAULTS),
    "apply_rope_pos_ids_inplace": (_IDS, _PLAIN_DEFAULTS),
    "apply_llama31_rope": (_RAGGED + _LLAMA, _LLAMA_DEFAULTS),
    "apply_llama31_rope_inplace": (_RAGGED + _LLAMA, _LLAMA_DEFAULTS),
    "apply_llama31_rope_pos_ids": (_IDS + _LLAMA, _LLAMA_DEFAULTS),
    "apply_llama31_rope_pos_ids_inplace": (_IDS + _LLAMA, _LLAMA_DEFAULTS),
    "apply_rope_with_cos_sin_cache": (_CACHE, {"is_neox": True}),
    "apply_rope_with_cos_sin_cache_inplace": (_CACHE, {"is_neox": True}),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature(name):
    names, defaults = SIGNATURES[name]
    assert name in rope.__all__ and getattr(tritoninfer, name) is getattr(rope, name)
    params = inspect.signature(getattr(rope, name)).parameters
    assert list(params) == names
    for p, v in params.items():
        if p in defaults:
            assert params[p].default == defaults[p] and type(params[p].default) is type(defaults[p])
        else:
            assert params[p].default is inspect.Parameter.empty


# ------------------------------------------------------------------------------------------------
# GPU: realistic shapes
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inter", [False, True])
def test_gpu_pos_ids_large(dtype, inter):
    q, k = make_qk(4096, 32, 8, 128, dtype, "cuda")
    pos = torch.randint(0, 4096, (4096,), device="cuda")
    q_rope, k_rope = tritoninfer.apply_rope_pos_ids(q, k, pos, interleave=inter, rope_theta=5e5)
    ref_q, ref_k = reference.apply_rope_pos_ids(q, k, pos, None, inter, 1.0, 5e5)
    assert_close(q_rope, ref_q, dtype, "q")
    assert_close(k_rope, ref_k, dtype, "k")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_ragged_llama31_large(dtype):
    lens = [1000, 1, 0, 3095]
    q, k = make_qk(sum(lens), 32, 8, 128, dtype, "cuda")
    indptr = make_indptr(lens, "cuda")
    offsets = torch.tensor([0, 5000, 7, 100], dtype=torch.int32, device="cuda")
    q_ref, k_ref = reference.apply_llama31_rope(q, k, indptr, offsets)
    tritoninfer.apply_llama31_rope_inplace(q, k, indptr, offsets)
    assert_close(q, q_ref, dtype, "q")
    assert_close(k, k_ref, dtype, "k")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_batch_head_parallel(batch):
    """Few tokens: the launcher splits the heads over programs."""
    q, k = make_qk(batch, 32, 8, 128, torch.bfloat16, "cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    offsets = torch.randint(0, 8000, (batch,), dtype=torch.int32, device="cuda")
    q_rope, k_rope = tritoninfer.apply_rope(q, k, indptr, offsets, rotary_dim=64)
    ref_q, ref_k = reference.apply_rope(q, k, indptr, offsets, rotary_dim=64)
    assert_close(q_rope, ref_q, torch.bfloat16, "q")
    assert_close(k_rope, ref_k, torch.bfloat16, "k")


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False])
def test_gpu_cos_sin_cache_large(neox):
    nnz, hq, hk, hs = 4096, 32, 8, 128
    cache = make_cos_sin_cache(8192, hs, theta=5e5, device="cuda")
    query = torch.randn(nnz, hq * hs, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(nnz, hk * hs, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 8192, (nnz,), device="cuda")
    ref_q, ref_k = reference.apply_rope_with_cos_sin_cache(positions, query, key, hs, cache, neox)
    tritoninfer.apply_rope_with_cos_sin_cache_inplace(positions, query, key, hs, cache, neox)
    assert_close(query, ref_q, torch.bfloat16, "query")
    assert_close(key, ref_k, torch.bfloat16, "key")


# ------------------------------------------------------------------------------------------------
# RoPE + fp8 quantisation: rope_quantize_fp8, mla_rope_quantize_fp8 and the paged-append variant
# ------------------------------------------------------------------------------------------------

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def assert_fp8_matches(out, ref, unquantized, what=""):
    """fp8 ``out`` against the reference's fp8 ``ref``: the same codes, except that an element may be
    one code away (the GPU may contract ``x1 cos - x2 sin`` into an FMA, moving a value across a
    rounding boundary) on at most 1 % of the elements; and against the float32 values before the cast,
    the relative error of the format (``testing.FP8_VS_UNQUANTIZED``)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)}"
    o = out.detach().cpu().contiguous().view(torch.uint8).to(torch.int32)
    r = ref.detach().cpu().contiguous().view(torch.uint8).to(torch.int32)
    differ = o != r
    if differ.any():
        same_sign = (o & 0x80) == (r & 0x80)
        one_code = same_sign & ((o & 0x7F) - (r & 0x7F)).abs().le(1)
        assert bool(one_code[differ].all()), f"{what}: {int(differ.sum())} codes differ, some by more than one"
        assert differ.float().mean().item() <= 1e-2, f"{what}: {int(differ.sum())} of {differ.numel()} codes differ"
    if unquantized is not None and unquantized.numel():
        testing.assert_close(out.float(), unquantized, name=what, tol=testing.FP8_VS_UNQUANTIZED[out.dtype])


def unquantized_rope(x, cos_sin_cache, pos, is_neox, scale):
    """float32 rotated values times ``scale`` (before the fp8 cast), from the reference's rotation."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache.float()[pos.long()]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    return (reference.rotate_pairs(x3, rows[:, :half], rows[:, half:], not is_neox) * scale).reshape(x.shape)


def random_parts(nnz, hq, hk, rot, nope, dtype, device, mla, scale=3.0):
    """(q_rope, k_rope, q_nope, k_nope); nope parts None when ``nope`` is 0."""
    k_shape = (nnz,) if mla else (nnz, hk)
    q_rope = torch.randn(nnz, hq, rot, device=device).mul(scale).to(dtype)
    k_rope = torch.randn(*k_shape, rot, device=device).mul(scale).to(dtype)
    if nope == 0:
        return q_rope, k_rope, None, None
    q_nope = torch.randn(nnz, hq, nope, device=device).mul(scale).to(dtype)
    k_nope = torch.randn(*k_shape, nope, device=device).mul(scale).to(dtype)
    return q_rope, k_rope, q_nope, k_nope


# (kind, hq, hk, rope_dim, no_rope_dim, input dtype, quantize dtype, is_neox, scale_q, scale_kv, pos dtype,
#  output buffers given as slices of one [nnz, H, head_dim] tensor)
RQ_CASES = [
    ("gqa", 4, 2, 16, 16, torch.float16, torch.float8_e4m3fn, True, 1.0, 1.0, torch.int64, False),
    ("mla", 4, 1, 8, 24, torch.bfloat16, torch.float8_e5m2, False, 0.5, 2.0, torch.int32, True),
    ("mha", 2, 2, 12, 0, torch.float16, torch.float8_e4m3fn, False, 2.0, 0.25, torch.int32, False),
    ("gqa", 3, 1, 32, 8, torch.float32, torch.float8_e5m2, True, 1.0, 1.0, torch.int64, True),
    ("mla", 2, 1, 16, 0, torch.bfloat16, torch.float8_e4m3fn, True, 8.0, 1.0, torch.int64, False),
]


@pytest.mark.parametrize("kind,hq,hk,rot,nope,dtype,qdt,neox,sq,skv,pos_dtype,given", RQ_CASES)
def test_rope_quantize_fp8(device, kind, hq, hk, rot, nope, dtype, qdt, neox, sq, skv, pos_dtype, given):
    nnz, mla = 7, kind == "mla"
    q_rope, k_rope, q_nope, k_nope = random_parts(nnz, hq, hk, rot, nope, dtype, device, mla)
    inputs = [t.clone() if t is not None else None for t in (q_rope, k_rope, q_nope, k_nope)]
    cache = make_cos_sin_cache(64, rot, device=device)
    pos = torch.randint(0, 64, (nnz,), dtype=pos_dtype, device=device)
    outs = {}
    if given:
        q_all = torch.full((nnz, hq, rot + nope), float("nan"), device=device).to(qdt)
        k_all = torch.full(tuple(k_rope.shape[:-1]) + (rot + nope,), float("nan"), device=device).to(qdt)
        outs = dict(q_rope_out=q_all[..., :rot], k_rope_out=k_all[..., :rot],
                    q_nope_out=q_all[..., rot:], k_nope_out=k_all[..., rot:])
    fn = rope.mla_rope_quantize_fp8 if mla and nope else rope.rope_quantize_fp8
    got = fn(q_rope, k_rope, q_nope, k_nope, cache, pos, is_neox=neox, quantize_dtype=None if given else qdt,
             quant_scale_q=sq, quant_scale_kv=skv, **outs)
    want = reference.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, neox, qdt, sq, skv)
    if given:
        for name, t in zip(("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"), got):
            assert t is outs[name]
    unq = [unquantized_rope(q_rope, cache, pos, neox, sq), unquantized_rope(k_rope, cache, pos, neox, skv),
           None if q_nope is None else q_nope.float() * sq, None if k_nope is None else k_nope.float() * skv]
    for name, g, w, u in zip(("q_rope", "k_rope", "q_nope", "k_nope"), got, want, unq):
        assert_fp8_matches(g, w, u, name)
    if nope == 0:
        assert got[2].shape == (nnz, hq, 0) and got[3].shape == tuple(k_rope.shape[:-1]) + (0,)
    for before, after in zip(inputs, (q_rope, k_rope, q_nope, k_nope)):
        assert before is None or torch.equal(before, after)


@pytest.mark.parametrize("qdt", FP8)
def test_rope_quantize_fp8_saturates_and_keeps_nan(device, qdt):
    """Values beyond the format's largest finite one become it (no inf, no NaN from overflow), as
    FlashInfer's saturating conversion; a NaN input stays NaN; subnormal fp8 values are kept."""
    q_rope, k_rope, q_nope, k_nope = random_parts(6, 2, 1, 8, 8, torch.float16, device, False, scale=300.0)
    q_nope[0, 0, :4] = torch.tensor([1e-3, -2e-3, 6e-5, 3e-6], dtype=torch.float16)
    k_nope[1, 0, 0] = float("nan")
    cache = make_cos_sin_cache(16, 8, device=device)
    pos = torch.arange(6, device=device)
    got = rope.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, quantize_dtype=qdt,
                                 quant_scale_q=200.0, quant_scale_kv=1.0)
    want = reference.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, True, qdt, 200.0, 1.0)
    mx = testing.fp8_max(qdt)
    assert (got[0].float().abs() == mx).any(), "the test needs saturated values"
    assert not torch.isinf(got[0].float()).any() and not torch.isnan(got[0].float()).any()
    assert torch.isnan(got[3].float()[1, 0, 0]) and torch.isfinite(got[3].float()[1, 0, 1:]).all()
    for g, w in zip(got, want):
        o, r = g.cpu().view(torch.uint8), w.cpu().view(torch.uint8)
        assert torch.equal(o, r) or ON_GPU  # on the GPU, FMA contraction may move a code (assert_fp8_matches)


def test_rope_quantize_fp8_positions_outside_cache_unrotated(device):
    q_rope, k_rope, _, _ = random_parts(3, 1, 1, 8, 0, torch.float16, device, False)
    cache = make_cos_sin_cache(8, 8, device=device)
    pos = torch.tensor([2, 8, -1], device=device)
    q_out, k_out, _, _ = rope.rope_quantize_fp8(q_rope, k_rope, None, None, cache, pos)
    plain = reference.quantize_fp8_saturating(q_rope.float(), torch.float8_e4m3fn)
    assert torch.equal(q_out[1:].view(torch.uint8), plain[1:].view(torch.uint8))


def test_mla_rope_quantize_fp8_deepseek_dims(device):
    """DeepSeek's MLA dims (rope 64, kv_lora_rank 512), FlashInfer's call: slices of 576-wide q/k and outputs."""
    nnz, heads = 3, 2
    q = torch.randn(nnz, heads, 576, device=device).to(torch.bfloat16)
    k = torch.randn(nnz, 576, device=device).to(torch.bfloat16)
    cache = make_cos_sin_cache(32, 64, device=device)
    pos = torch.tensor([0, 7, 31], device=device)
    q_out = torch.full((nnz, heads, 576), float("nan"), device=device).to(torch.float8_e4m3fn)
    k_out = torch.full((nnz, 576), float("nan"), device=device).to(torch.float8_e4m3fn)
    rope.mla_rope_quantize_fp8(q[..., :64], k[..., :64], q[..., 64:], k[..., 64:], cache, pos, is_neox=False,
                               q_rope_out=q_out[..., :64], k_rope_out=k_out[..., :64],
                               q_nope_out=q_out[..., 64:], k_nope_out=k_out[..., 64:])
    want = reference.mla_rope_quantize_fp8(q[..., :64], k[..., :64], q[..., 64:], k[..., 64:], cache, pos, False)
    assert_fp8_matches(q_out[..., :64], want[0], None, "q_rope")
    assert_fp8_matches(k_out[..., :64], want[1], None, "k_rope")
    assert_fp8_matches(q_out[..., 64:], want[2], None, "q_nope")
    assert_fp8_matches(k_out[..., 64:], want[3], None, "k_nope")


def test_rope_quantize_fp8_dtype_inference(device):
    q_rope, k_rope, q_nope, k_nope = random_parts(2, 1, 1, 8, 4, torch.float16, device, False)
    cache = make_cos_sin_cache(4, 8, device=device)
    pos = torch.tensor([0, 3], device=device)
    outs = rope.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos)
    assert all(t.dtype == torch.float8_e4m3fn for t in outs)
    k_nope_out = torch.empty_like(k_nope, dtype=torch.float8_e5m2)
    outs = rope.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, k_nope_out=k_nope_out)
    assert all(t.dtype == torch.float8_e5m2 for t in outs) and outs[3] is k_nope_out


def test_rope_quantize_fp8_empty(device):
    q_rope, k_rope, q_nope, k_nope = random_parts(0, 2, 1, 8, 4, torch.float16, device, False)
    cache = make_cos_sin_cache(4, 8, device=device)
    pos = torch.zeros(0, dtype=torch.int32, device=device)
    outs = rope.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos)
    assert [tuple(t.shape) for t in outs] == [(0, 2, 8), (0, 1, 8), (0, 2, 4), (0, 1, 4)]
    kc = nan_cache((2, 4, 1, 12), torch.float8_e4m3fn, device)
    v = torch.zeros(0, 1, 12, dtype=torch.float16, device=device)
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=device)
    q_out = rope.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cache, pos, (kc, kc),
                                                         indptr[:1], indptr, pos, pos, page_size=4)
    assert tuple(q_out[0].shape) == (0, 2, 8) and torch.isnan(kc.float()).all()


def test_rope_quantize_fp8_errors(device):
    q_rope, k_rope, q_nope, k_nope = random_parts(4, 2, 1, 8, 4, torch.float16, device, False)
    cache = make_cos_sin_cache(8, 8, device=device)
    pos = torch.arange(4, device=device)
    call = rope.rope_quantize_fp8
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(q_rope, k_rope, q_nope, k_nope, cache.half(), pos)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(q_rope, k_rope, q_nope, k_nope, make_cos_sin_cache(8, 16, device=device), pos)
    with pytest.raises(ValueError, match="q_rope"):
        call(q_rope[0], k_rope, q_nope, k_nope, cache, pos)
    with pytest.raises(ValueError, match="k_rope"):
        call(q_rope, k_rope[:3], q_nope, k_nope, cache, pos)
    with pytest.raises(ValueError, match="k_nope"):
        call(q_rope, k_rope, None, k_nope, cache, pos)
    with pytest.raises(ValueError, match="k_nope"):
        call(q_rope, k_rope, q_nope, k_nope.float(), cache, pos)
    with pytest.raises(ValueError, match="pos_ids"):
        call(q_rope, k_rope, q_nope, k_nope, cache, pos[:3])
    with pytest.raises(ValueError, match="quantize_dtype"):
        call(q_rope, k_rope, q_nope, k_nope, cache, pos, quantize_dtype=torch.float16)
    with pytest.raises(ValueError, match="q_rope_out"):
        call(q_rope, k_rope, q_nope, k_nope, cache, pos, quantize_dtype=torch.float8_e5m2,
             q_rope_out=torch.empty_like(q_rope, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="k_rope_out"):
        call(q_rope, k_rope, q_nope, k_nope, cache, pos, k_rope_out=torch.empty(4, 8, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="q_rope"):
        call(q_rope.to(torch.int32), k_rope, q_nope, k_nope, cache, pos)
    with pytest.raises(ValueError, match="last dimension"):
        wide = torch.randn(4, 2, 16, device=device).half()
        call(wide[..., ::2], k_rope, q_nope, k_nope, cache, pos)


# --- the paged-append variant ---


def make_append_batch(lens_before, appends, page_size, device, idx_dtype=torch.int32, spare_pages=2, padding=0):
    """Page table after appending ``appends[i]`` tokens to request ``i`` of ``lens_before[i]`` tokens,
    pages in random order among ``spare_pages`` unused ones; ``padding`` extra tokens with batch index -1."""
    after = [a + b for a, b in zip(lens_before, appends)]
    pages = [-(-n // page_size) for n in after]
    kv_indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=idx_dtype)
    num_pages = int(kv_indptr[-1]) + spare_pages
    kv_indices = torch.randperm(num_pages)[: int(kv_indptr[-1])].to(idx_dtype)
    append_indptr = torch.tensor([0] + torch.tensor(appends).cumsum(0).tolist(), dtype=torch.int32)
    nnz = sum(appends) + padding
    bi, pos = reference.get_batch_indices_positions(append_indptr, torch.tensor(after, dtype=torch.int32), nnz)
    return (kv_indices.to(device), kv_indptr.to(device), bi.to(idx_dtype).to(device), pos.to(idx_dtype).to(device),
            num_pages)


def nan_cache(shape, dtype, device):
    """fp8 cache filled with NaN: a slot the kernel should have written but did not shows up."""
    return torch.full(shape, float("nan"), device=device).to(dtype)


# (kind, kv_layout, page_size, input dtype, quantize dtype, is_neox, no_rope_dim, index dtype, padding tokens)
APPEND_CASES = [
    ("gqa", "NHD", 4, torch.float16, torch.float8_e4m3fn, False, 8, torch.int32, 0),
    ("gqa", "HND", 1, torch.bfloat16, torch.float8_e5m2, True, 0, torch.int64, 2),
    ("mha", "NHD", 3, torch.float32, torch.float8_e4m3fn, True, 4, torch.int32, 0),
    ("mla", "NHD", 4, torch.bfloat16, torch.float8_e4m3fn, False, 16, torch.int32, 1),
    ("mla", "HND", 2, torch.float16, torch.float8_e5m2, True, 0, torch.int64, 0),
]


def run_append(device, kind, layout, ps, dtype, qdt, neox, nope, idx_dtype, padding, scales=(1.5, 0.75),
               lens_before=(3, 0, 6, 2), appends=(2, 5, 1, 0)):
    hq, hk, rot = 3, 2, 8
    mla = kind == "mla"
    hk = 1 if mla else (hq if kind == "mha" else hk)
    kv_indices, kv_indptr, bi, pos, num_pages = make_append_batch(list(lens_before), list(appends), ps, device,
                                                                   idx_dtype, padding=padding)
    nnz = bi.numel()
    q_rope, k_rope, q_nope, k_nope = random_parts(nnz, hq, hk, rot, nope, dtype, device, mla)
    v = None if mla else torch.randn(nnz, hk, rot + nope, device=device).mul(3).to(dtype)
    if mla:
        cache = (nan_cache((num_pages, ps, nope), qdt, device), nan_cache((num_pages, ps, rot), qdt, device))
    else:
        shape = (num_pages, ps, hk, rot + nope) if layout == "NHD" else (num_pages, hk, ps, rot + nope)
        cache = (nan_cache(shape, qdt, device), nan_cache(shape, qdt, device))
    rope_cache = make_cos_sin_cache(32, rot, device=device)
    pos_ids = (pos.long() + 5).clamp_min(0)  # RoPE positions need not be the KV positions
    want = reference.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos_ids, cache, kv_indices, kv_indptr, bi, pos, neox,
        *scales, layout)
    got = rope.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos_ids, cache, kv_indices, kv_indptr, bi, pos,
        is_neox=neox, quantize_dtype=qdt, quant_scale_q=scales[0], quant_scale_kv=scales[1], page_size=ps,
        kv_layout=layout)
    return got, want, cache, (q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos_ids, neox)


@pytest.mark.parametrize("kind,layout,ps,dtype,qdt,neox,nope,idx_dtype,padding", APPEND_CASES)
def test_rope_quantize_fp8_append_paged_kv_cache(device, kind, layout, ps, dtype, qdt, neox, nope, idx_dtype,
                                                 padding):
    got, want, cache, (q_rope, _, q_nope, _, _, rope_cache, pos_ids, _) = run_append(
        device, kind, layout, ps, dtype, qdt, neox, nope, idx_dtype, padding)
    assert_fp8_matches(got[0], want[0], unquantized_rope(q_rope, rope_cache, pos_ids, neox, 1.5), "q_rope_out")
    assert_fp8_matches(got[1], want[1], None if q_nope is None else q_nope.float() * 1.5, "q_nope_out")
    # unwritten slots stay NaN in both; written ones hold the reference's codes
    assert_fp8_matches(cache[0], want[2][0], None, "paged_kv_cache[0]")
    assert_fp8_matches(cache[1], want[2][1], None, "paged_kv_cache[1]")
    written = ~torch.isnan(want[2][1].float())  # V, or MLA's kpe cache (never size 0)
    assert written.any() and (~written).any()


@pytest.mark.parametrize("bad", ["page_id", "negative_page_id", "position", "batch_index"])
def test_rope_quantize_fp8_append_bad_indices_reported_not_written(device, bad):
    """A token whose page id, position or request is outside the page table or the cache is not written
    (the cache keeps its NaN there) and is reported: raised on CPU tensors, by check_errors() on the GPU."""
    layout, ps = "HND", 4
    kv_indices, kv_indptr, bi, pos, num_pages = make_append_batch([3, 0, 6], [2, 5, 1], ps, device)
    if bad == "page_id":
        kv_indices = kv_indices.clone()
        kv_indices[int(kv_indptr[1])] = num_pages + 100  # the first page of request 1
    elif bad == "negative_page_id":
        kv_indices = kv_indices.clone()
        kv_indices[int(kv_indptr[3]) - 1] = -3  # the page of request 2's appended token
    elif bad == "position":
        pos = pos.clone()
        pos[0] = 40  # beyond the pages request 0 owns
    else:
        bi = bi.clone()
        bi[3] = 9  # no such request
    nnz = bi.numel()
    q_rope, k_rope, q_nope, k_nope = random_parts(nnz, 2, 1, 8, 8, torch.float16, device, False)
    v = torch.randn(nnz, 1, 16, device=device).half()
    cache = tuple(nan_cache((num_pages, 1, ps, 16), torch.float8_e4m3fn, device) for _ in range(2))
    rope_cache = make_cos_sin_cache(32, 8, device=device)
    want = reference.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos, cache, kv_indices, kv_indptr, bi, pos, True, 1.0, 1.0,
        layout)
    args = (q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos, cache, kv_indices, kv_indptr, bi, pos)
    match = {"page_id": "kv_indices", "negative_page_id": "kv_indices", "position": "positions",
             "batch_index": "batch_indices"}[bad]
    if ON_GPU:
        q_out = rope.rope_quantize_fp8_append_paged_kv_cache(*args, page_size=ps, kv_layout=layout)
        with pytest.raises(ValueError, match=match):
            tritoninfer.check_errors()
    else:
        q_out = tuple(torch.empty_like(t, dtype=torch.float8_e4m3fn) for t in (q_rope, q_nope))
        with pytest.raises(ValueError, match=match):
            rope.rope_quantize_fp8_append_paged_kv_cache(*args, page_size=ps, kv_layout=layout, q_rope_out=q_out[0],
                                                         q_nope_out=q_out[1])
    # the reference drops the same token; everything else was written, q included
    assert_fp8_matches(cache[0], want[2][0], None, "k_cache")
    assert_fp8_matches(cache[1], want[2][1], None, "v_cache")
    assert_fp8_matches(q_out[0], want[0], None, "q_rope_out")
    written_slots = int((~torch.isnan(cache[0].float()[:, 0, :, 0])).sum())
    assert 0 < written_slots < nnz


def test_rope_quantize_fp8_append_two_steps(device):
    """Prefill then decode into the same cache: the second call leaves the first call's tokens alone."""
    ps, rot, nope = 4, 8, 8
    rope_cache = make_cos_sin_cache(32, rot, device=device)
    cache = tuple(nan_cache((4, ps, 1, rot + nope), torch.float8_e4m3fn, device) for _ in range(2))
    kv_indices = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    states = []
    for lens_before, n_new in ((0, 6), (6, 3)):
        kv_indptr = torch.tensor([0, -(-(lens_before + n_new) // ps)], dtype=torch.int32, device=device)
        bi = torch.zeros(n_new, dtype=torch.int32, device=device)
        pos = torch.arange(lens_before, lens_before + n_new, dtype=torch.int32, device=device)
        q_rope, k_rope, q_nope, k_nope = random_parts(n_new, 2, 1, rot, nope, torch.float16, device, False)
        v = torch.randn(n_new, 1, rot + nope, device=device).half()
        want = reference.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos, cache, kv_indices, kv_indptr, bi, pos)
        rope.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, rope_cache, pos, cache,
                                                     kv_indices, kv_indptr, bi, pos, page_size=ps)
        assert_fp8_matches(cache[0], want[2][0], None, "k_cache")
        assert_fp8_matches(cache[1], want[2][1], None, "v_cache")
        states.append(cache[0].clone())
    first = ~torch.isnan(states[0].float())
    assert torch.equal(states[1].view(torch.uint8)[first], states[0].view(torch.uint8)[first])


def test_rope_quantize_fp8_append_errors(device):
    kv_indices, kv_indptr, bi, pos, num_pages = make_append_batch([1], [2], 4, device)
    q_rope, k_rope, q_nope, k_nope = random_parts(2, 2, 1, 8, 8, torch.float16, device, False)
    v = torch.randn(2, 1, 16, device=device).half()
    kc = nan_cache((num_pages, 4, 1, 16), torch.float8_e4m3fn, device)
    rc = make_cos_sin_cache(8, 8, device=device)
    ok = dict(q_rope=q_rope, k_rope=k_rope, q_nope=q_nope, k_nope=k_nope, v=v, cos_sin_cache=rc, pos_ids=pos,
              paged_kv_cache=(kc, kc.clone()), kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=bi,
              positions=pos, page_size=4)
    call = rope.rope_quantize_fp8_append_paged_kv_cache
    call(**ok)
    cases = [
        (dict(v=None), "v"),
        (dict(v=v[..., :8]), "v"),
        (dict(paged_kv_cache=(kc.to(torch.float8_e5m2), kc.to(torch.float8_e5m2))), "paged_kv_cache"),
        (dict(page_size=16), "paged_kv_cache"),
        (dict(paged_kv_cache=(kc[0], kc[0])), "paged_kv_cache"),
        (dict(kv_layout="NDH"), "kv_layout"),
        (dict(kv_indptr=torch.zeros(0, dtype=torch.int32, device=device)), "kv_indptr"),
        (dict(batch_indices=bi[:1]), "batch_indices"),
        (dict(positions=pos.float()), "positions"),
        (dict(page_size=0), "page_size"),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            call(**{**ok, **over})
    with pytest.raises(TypeError, match="paged_kv_cache"):
        call(**{**ok, "paged_kv_cache": kc})
    mla = dict(ok, k_rope=k_rope[:, 0], k_nope=k_nope[:, 0],
               paged_kv_cache=(nan_cache((num_pages, 4, 8), torch.float8_e4m3fn, device),
                               nan_cache((num_pages, 4, 8), torch.float8_e4m3fn, device)))
    with pytest.raises(ValueError, match="v"):
        call(**mla)  # MLA takes no V
    with pytest.raises(ValueError, match="paged_kv_cache"):
        call(**dict(mla, v=None, paged_kv_cache=(kc, kc)))


_RQ = ["q_rope", "k_rope", "q_nope", "k_nope", "cos_sin_cache", "pos_ids", "is_neox", "quantize_dtype",
       "quant_scale_q", "quant_scale_kv", "q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out", "enable_pdl"]
_RQ_DEFAULTS = {"is_neox": True, "quantize_dtype": None, "quant_scale_q": 1.0, "quant_scale_kv": 1.0,
                "q_rope_out": None, "k_rope_out": None, "q_nope_out": None, "k_nope_out": None, "enable_pdl": False}
_RQ_APPEND = ["q_rope", "k_rope", "q_nope", "k_nope", "v", "cos_sin_cache", "pos_ids", "paged_kv_cache",
              "kv_indices", "kv_indptr", "batch_indices", "positions", "is_neox", "quantize_dtype", "quant_scale_q",
              "quant_scale_kv", "page_size", "kv_layout", "q_rope_out", "q_nope_out", "enable_pdl"]
_RQ_APPEND_DEFAULTS = {"is_neox": True, "quantize_dtype": None, "quant_scale_q": 1.0, "quant_scale_kv": 1.0,
                       "page_size": 16, "kv_layout": "NHD", "q_rope_out": None, "q_nope_out": None,
                       "enable_pdl": False}
RQ_SIGNATURES = {
    "rope_quantize_fp8": (_RQ, _RQ_DEFAULTS),
    "mla_rope_quantize_fp8": (_RQ, _RQ_DEFAULTS),
    "rope_quantize_fp8_append_paged_kv_cache": (_RQ_APPEND, _RQ_APPEND_DEFAULTS),
}


@pytest.mark.parametrize("name", sorted(RQ_SIGNATURES))
def test_rope_quantize_signature(name):
    """FlashInfer 0.5.3's parameter names, order and defaults (the top-level export is wired separately)."""
    names, defaults = RQ_SIGNATURES[name]
    params = inspect.signature(getattr(rope, name)).parameters
    assert list(params) == names
    for p in params:
        if p in defaults:
            assert params[p].default == defaults[p] and type(params[p].default) is type(defaults[p])
        else:
            assert params[p].default is inspect.Parameter.empty


@pytest.mark.gpu
@pytest.mark.parametrize("kind,hq,hk,rot,nope", [("gqa", 32, 8, 128, 0), ("mla", 128, 1, 64, 512),
                                                 ("gqa", 64, 16, 128, 128)])
@pytest.mark.parametrize("qdt", FP8)
def test_gpu_rope_quantize_fp8_large(kind, hq, hk, rot, nope, qdt):
    nnz = 2047
    q_rope, k_rope, q_nope, k_nope = random_parts(nnz, hq, hk, rot, nope, torch.bfloat16, "cuda", kind == "mla")
    cache = make_cos_sin_cache(4096, rot, device="cuda")
    pos = torch.randint(0, 4096, (nnz,), device="cuda")
    got = rope.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, is_neox=False, quantize_dtype=qdt,
                                 quant_scale_q=0.5, quant_scale_kv=2.0)
    want = reference.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, False, qdt, 0.5, 2.0)
    for name, g, w in zip(("q_rope", "k_rope", "q_nope", "k_nope"), got, want):
        assert_fp8_matches(g, w, None, name)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,layout", [("gqa", "NHD"), ("gqa", "HND"), ("mla", "NHD")])
def test_gpu_rope_quantize_fp8_append_large(kind, layout):
    """64 requests appending 1..512 tokens onto 0..1000, page 16; no host synchronisation."""
    g = torch.Generator().manual_seed(5)
    lens_before = torch.randint(0, 1000, (64,), generator=g).tolist()
    appends = torch.randint(1, 512, (64,), generator=g).tolist()
    ps, hq, hk, rot, nope = 16, (32 if kind == "gqa" else 128), (8 if kind == "gqa" else 1), 64, 64
    kv_indices, kv_indptr, bi, pos, num_pages = make_append_batch(lens_before, appends, ps, "cuda", spare_pages=50)
    nnz = bi.numel()
    q_rope, k_rope, q_nope, k_nope = random_parts(nnz, hq, hk, rot, nope, torch.bfloat16, "cuda", kind == "mla")
    v = None if kind == "mla" else torch.randn(nnz, hk, rot + nope, device="cuda").to(torch.bfloat16)
    if kind == "mla":
        cache = (nan_cache((num_pages, ps, nope), torch.float8_e4m3fn, "cuda"),
                 nan_cache((num_pages, ps, rot), torch.float8_e4m3fn, "cuda"))
    else:
        shape = (num_pages, ps, hk, rot + nope) if layout == "NHD" else (num_pages, hk, ps, rot + nope)
        cache = (nan_cache(shape, torch.float8_e4m3fn, "cuda"), nan_cache(shape, torch.float8_e4m3fn, "cuda"))
    rc = make_cos_sin_cache(2048, rot, device="cuda")
    want = reference.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, rc, pos, cache,
                                                             kv_indices, kv_indptr, bi, pos, False, 1.0, 0.5, layout)
    args = (q_rope, k_rope, q_nope, k_nope, v, rc, pos, cache, kv_indices, kv_indptr, bi, pos)
    kw = dict(is_neox=False, quant_scale_kv=0.5, page_size=ps, kv_layout=layout)
    rope.rope_quantize_fp8_append_paged_kv_cache(*args, **kw)  # compile first (appending twice is idempotent)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = rope.rope_quantize_fp8_append_paged_kv_cache(*args, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_fp8_matches(got[0], want[0], None, "q_rope_out")
    assert_fp8_matches(got[1], want[1], None, "q_nope_out")
    assert_fp8_matches(cache[0], want[2][0], None, "paged_kv_cache[0]")
    assert_fp8_matches(cache[1], want[2][1], None, "paged_kv_cache[1]")


_SM90_COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tritoninfer.kernels.rope import rope_quantize_kernel
from tritoninfer.rope import _fp8_constexprs

for append, has_v, fp8, interleave, nope in ((False, False, torch.float8_e4m3fn, True, 0),
                                             (True, True, torch.float8_e5m2, False, 64),
                                             (True, False, torch.float8_e4m3fn, False, 512)):
    ce = dict(ROT=64, HALF_PAD=32, NOPE=nope, NOPE_PAD=max(nope, 1), VD=64 + nope,
              VD_PAD=triton.next_power_of_2(64 + nope) if has_v else 1, INTERLEAVE=interleave, APPEND=append,
              HAS_V=has_v, SOFT_FP8=False, BLOCK_T=8, STAGES=1 + 2 * append, **_fp8_constexprs(fp8))
    f8 = "*fp8e4nv" if fp8 == torch.float8_e4m3fn else "*fp8e5"
    sig, attrs = {}, {}
    for i, p in enumerate(rope_quantize_kernel.params):
        n = p.name
        if n in ce:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = ("*bf16" if n in ("q_rope_ptr", "q_nope_ptr", "k_rope_ptr", "k_nope_ptr", "v_ptr") else
                      "*fp32" if n == "cache_ptr" else "*i64" if n in ("pos_ptr", "err_ptr") else
                      f8 if n.endswith("out_ptr") else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32" if n.startswith("quant_scale") else "i32"
    k = triton.compile(ASTSource(rope_quantize_kernel, sig, ce, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    cvt = "cvt.rn.satfinite." + ("e4m3x2" if fp8 == torch.float8_e4m3fn else "e5m2x2")
    print("case", append, has_v, bool(k.asm["cubin"]), cvt in k.asm["ptx"], flush=True)
"""


def test_rope_quantize_kernel_compiles_for_sm90():
    """The interpreter runs the kernel's semantics, not the compiler's type rules, and computes the fp8
    bits itself: compile the GPU variants (hardware cast) for sm_90 on the CPU (Triton ships ptxas) and
    check that the cast is the saturating round-to-nearest one FlashInfer uses."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("case")]
    assert len(lines) == 3 and all(line.endswith("True True") for line in lines), done.stdout
