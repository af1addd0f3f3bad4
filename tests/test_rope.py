"""tritoninfer.rope against tritoninfer.reference (float32 torch), on CPU through the interpreter.

Parameters are covered pairwise (dtype x head_dim x rotary_dim x interleave x heads x scale/theta x
index dtype), not as a full product: each interpreted launch costs ~0.1 s.
"""

import inspect

import pytest
import torch

import tritoninfer
from tritoninfer import reference
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
