"""Every check in ``tritoninfer._options``: what it accepts, and that its errors name the argument."""

import math

import pytest
import torch

from tritoninfer import _options as O


# --------------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp16", torch.float16),
        ("torch.float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("float", torch.float32),
        ("fp32", torch.float32),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("e4m3", torch.float8_e4m3fn),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("torch.float8_e4m3fn", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
        ("e5m2", torch.float8_e5m2),
        ("fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_canonicalize_dtype_names(name, dtype):
    assert O.canonicalize_dtype(name) is dtype
    assert O.canonicalize_dtype(dtype) is dtype


def test_canonicalize_dtype_errors():
    assert O.canonicalize_dtype(None) is None
    with pytest.raises(ValueError, match="q_data_type.*'float13'"):
        O.canonicalize_dtype("float13", "q_data_type")
    with pytest.raises(ValueError, match="kv_data_type"):
        O.canonicalize_dtype("torch.int8", "kv_data_type")
    with pytest.raises(TypeError, match="o_data_type.*int"):
        O.canonicalize_dtype(16, "o_data_type")
    with pytest.raises(TypeError, match="dtype"):
        O.canonicalize_dtype(torch.zeros(1))


def test_check_dtype_in():
    assert O.check_dtype_in(torch.float16, O.Q_DTYPES, "q") is torch.float16
    for dt in O.KV_DTYPES:
        assert O.check_dtype_in(dt, O.KV_DTYPES, "kv_data_type") is dt
    assert set(O.FP8_DTYPES) == {torch.float8_e4m3fn, torch.float8_e5m2}
    with pytest.raises(ValueError, match="q_data_type.*float8_e4m3fn"):
        O.check_dtype_in(torch.float8_e4m3fn, O.Q_DTYPES, "q_data_type")
    with pytest.raises(ValueError, match="kv_data_type"):
        O.check_dtype_in(torch.float32, O.KV_DTYPES, "kv_data_type")


# --------------------------------------------------------------------------------------------------
# enums
# --------------------------------------------------------------------------------------------------


def test_parse_pos_encoding_mode():
    for mode in O.PosEncodingMode:
        assert O.parse_pos_encoding_mode(mode) is mode
        assert O.parse_pos_encoding_mode(mode.name) is mode
        assert O.parse_pos_encoding_mode(mode.value) is mode
    assert [m.value for m in O.PosEncodingMode] == [0, 1, 2]
    for bad in ("rope_llama", "ROPE", 3, -1, True, None, 1.0):
        with pytest.raises(ValueError, match="pos_encoding_mode"):
            O.parse_pos_encoding_mode(bad)
    with pytest.raises(ValueError, match="mode_arg"):
        O.parse_pos_encoding_mode("X", "mode_arg")


def test_parse_layout():
    assert O.parse_layout("NHD") is O.TensorLayout.NHD
    assert O.parse_layout("HND") is O.TensorLayout.HND
    assert O.parse_layout(1) is O.TensorLayout.HND
    assert O.parse_layout(O.TensorLayout.NHD) is O.TensorLayout.NHD
    for bad in ("nhd", "NDH", 2, False, None):
        with pytest.raises(ValueError, match="kv_layout"):
            O.parse_layout(bad)


def test_mask_mode_values():
    assert {m.name: m.value for m in O.MaskMode} == {"NON_CAUSAL": 0, "CAUSAL": 1, "CUSTOM": 2, "MULTIITEMSCORING": 3}


# --------------------------------------------------------------------------------------------------
# integers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qo,kv,group", [(1, 1, 1), (32, 8, 4), (7, 1, 7), (28, 4, 7), (64, 64, 1)])
def test_check_heads_ok(qo, kv, group):
    assert O.check_heads(qo, kv) == group


def test_check_heads_errors():
    with pytest.raises(ValueError, match=r"num_qo_heads \(6\).*num_kv_heads \(4\)"):
        O.check_heads(6, 4)
    with pytest.raises(ValueError, match=r"num_qo_heads \(2\).*num_kv_heads \(4\)"):
        O.check_heads(2, 4)
    for bad in (0, -8, 8.0, True, "8", None):
        with pytest.raises(ValueError, match="num_qo_heads"):
            O.check_heads(bad, 1)
        with pytest.raises(ValueError, match="num_kv_heads"):
            O.check_heads(8, bad)


def test_check_head_dim():
    for d in (8, 16, 40, 64, 72, 96, 128, 192, 256):
        assert O.check_head_dim(d) == d
    assert O.MAX_HEAD_DIM == 256
    for bad in (4, 12, 65, 264, 512):
        with pytest.raises(ValueError, match="head_dim_vo.*multiple of 8 up to 256"):
            O.check_head_dim(bad, "head_dim_vo")
    for bad in (0, -8, 64.0, True, None):
        with pytest.raises(ValueError, match="head_dim.*positive int"):
            O.check_head_dim(bad)


def test_check_positive_int():
    assert O.check_positive_int(1, "page_size") == 1
    for bad in (0, -1, 1.0, True, None, "4"):
        with pytest.raises(ValueError, match="page_size"):
            O.check_positive_int(bad, "page_size")


def test_check_window_left():
    for w in (-1, 0, 1, 4095):
        assert O.check_window_left(w) == w
    for bad in (-2, 1.5, True, None, "3"):
        with pytest.raises(ValueError, match="window_left"):
            O.check_window_left(bad)


# --------------------------------------------------------------------------------------------------
# floats
# --------------------------------------------------------------------------------------------------


def test_check_soft_cap():
    assert O.check_soft_cap(None) == 0.0
    assert O.check_soft_cap(0) == 0.0
    assert O.check_soft_cap(30) == 30.0 and isinstance(O.check_soft_cap(30), float)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            O.check_soft_cap(bad)


def test_resolve_sm_scale():
    assert O.resolve_sm_scale(None, 128) == pytest.approx(1 / math.sqrt(128))
    assert O.resolve_sm_scale(None, 192) == pytest.approx(1 / math.sqrt(192))
    assert O.resolve_sm_scale(0.25, 128) == 0.25
    assert O.resolve_sm_scale(2, 64) == 2.0
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="sm_scale"):
            O.resolve_sm_scale(bad, 64)


def test_resolve_rope():
    assert O.resolve_rope(None, None) == (1.0, 1e4)
    assert O.resolve_rope(8, 5e5) == (8.0, 5e5)
    for scale, theta in ((0.0, None), (-1.0, None), (None, 0.0), (None, -1e4)):
        with pytest.raises(ValueError, match="rope_scale and rope_theta"):
            O.resolve_rope(scale, theta)


# --------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------


def test_check_tensor():
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert O.check_tensor(t, "q", ndim=2, dtype=torch.float16, device="cpu") is t
    assert O.check_tensor(t, "q", dtype=(torch.bfloat16, torch.float16)) is t
    with pytest.raises(TypeError, match="q: expected a torch.Tensor, got list"):
        O.check_tensor([1, 2], "q")
    with pytest.raises(ValueError, match="q: expected a 3-D tensor, got shape \\(2, 3\\)"):
        O.check_tensor(t, "q", ndim=3)
    with pytest.raises(ValueError, match="lse: expected dtype torch.float32, got torch.float16"):
        O.check_tensor(t, "lse", dtype=torch.float32)
    with pytest.raises(ValueError, match="out: expected dtype torch.float32 or torch.bfloat16"):
        O.check_tensor(t, "out", dtype=(torch.float32, torch.bfloat16))
    with pytest.raises(ValueError, match="k: expected a tensor on meta, got one on cpu"):
        O.check_tensor(t, "k", device="meta")


def test_check_int_index_tensor():
    for dt in (torch.int32, torch.int64):
        t = torch.arange(4, dtype=dt)
        assert O.check_int_index_tensor(t, "kv_indptr", length=4) is t
    with pytest.raises(ValueError, match="kv_indptr: expected dtype"):
        O.check_int_index_tensor(torch.arange(4.0), "kv_indptr")
    with pytest.raises(ValueError, match="kv_indices: expected a 1-D"):
        O.check_int_index_tensor(torch.zeros(2, 2, dtype=torch.int32), "kv_indices")
    with pytest.raises(ValueError, match="kv_last_page_len: expected 3 elements, got 4"):
        O.check_int_index_tensor(torch.arange(4, dtype=torch.int32), "kv_last_page_len", length=3)
    with pytest.raises(TypeError, match="qo_indptr"):
        O.check_int_index_tensor([0, 1], "qo_indptr")


def test_check_indptr_host():
    O.check_indptr_host(torch.tensor([0]), "qo_indptr")
    O.check_indptr_host(torch.tensor([0, 0, 3, 3, 7], dtype=torch.int32), "qo_indptr")
    with pytest.raises(ValueError, match="kv_indptr: expected at least one element"):
        O.check_indptr_host(torch.tensor([], dtype=torch.int32), "kv_indptr")
    with pytest.raises(ValueError, match=r"kv_indptr: expected kv_indptr\[0\] == 0, got 2"):
        O.check_indptr_host(torch.tensor([2, 3]), "kv_indptr")
    with pytest.raises(ValueError, match="qo_indptr: expected a non-decreasing"):
        O.check_indptr_host(torch.tensor([0, 4, 3]), "qo_indptr")


def test_check_same_dtype_as_plan():
    q = torch.zeros(1, dtype=torch.bfloat16)
    O.check_same_dtype_as_plan(q, torch.bfloat16, "q", "q_data_type")
    with pytest.raises(ValueError, match="q torch.bfloat16 does not match the q_data_type torch.float16"):
        O.check_same_dtype_as_plan(q, torch.float16, "q", "q_data_type")
