"""merge_state, merge_state_in_place, merge_states against the reference and against attention
over concatenated KV."""

import pytest
import torch
from conftest import DEVICE

import tritoninfer
from tritoninfer import reference, testing

NEG_INF = float("-inf")


def _states(n, h, d, dtype, seed, num=None):
    g = torch.Generator().manual_seed(seed)
    shape_v = (n, h, d) if num is None else (n, num, h, d)
    v = testing.randn(shape_v, dtype, DEVICE, generator=g)
    s = (torch.randn(shape_v[:-1], generator=g) * 4).to(DEVICE)
    return v, s


@pytest.mark.parametrize("dtype,h,d", [(torch.float16, 3, 24), (torch.bfloat16, 32, 128), (torch.float32, 1, 8)])
def test_merge_state_matches_reference(dtype, h, d):
    v_a, s_a = _states(6, h, d, dtype, 0)
    v_b, s_b = _states(6, h, d, dtype, 1)
    s_a[0] = NEG_INF
    s_b[0] = NEG_INF  # both empty: 0 / -inf, not NaN
    s_b[1] = NEG_INF  # one empty: the other state unchanged
    v, s = tritoninfer.merge_state(v_a, s_a, v_b, s_b)
    ref_v, ref_s = reference.merge_state(v_a, s_a, v_b, s_b)
    testing.assert_close(v, ref_v, dtype)
    testing.assert_lse_close(s, ref_s, dtype=torch.float32)
    assert torch.all(v[0] == 0) and torch.all(s[0] == NEG_INF)
    testing.assert_close(v[1], v_a[1].float(), dtype)


def test_merge_equals_attention_over_concatenated_kv():
    g = torch.Generator().manual_seed(0)
    q = testing.randn((3, 4, 32), torch.float16, DEVICE, generator=g)
    k = testing.randn((50, 2, 32), torch.float16, DEVICE, generator=g)
    v = testing.randn((50, 2, 32), torch.float16, DEVICE, generator=g)
    o_a, s_a = reference.attention(q, k[:20], v[:20])
    o_b, s_b = reference.attention(q, k[20:], v[20:])
    o, s = tritoninfer.merge_state(o_a.half(), s_a, o_b.half(), s_b)
    o_all, s_all = reference.attention(q, k, v)
    testing.assert_close(o, o_all, torch.float16)
    testing.assert_lse_close(s, s_all)


def test_merge_state_in_place_with_mask():
    v, s = _states(5, 4, 40, torch.float16, 2)
    v_o, s_o = _states(5, 4, 40, torch.float16, 3)
    mask = torch.tensor([True, False, True, False, True], device=DEVICE)
    ref_v, ref_s = reference.merge_state_in_place(v, s, v_o, s_o, mask)
    v_before, s_before = v.clone(), s.clone()
    assert tritoninfer.merge_state_in_place(v, s, v_o, s_o, mask) is None
    testing.assert_close(v, ref_v, torch.float16)
    testing.assert_lse_close(s, ref_s)
    assert torch.equal(v[1], v_before[1]) and torch.equal(s[3], s_before[3])


@pytest.mark.parametrize("num,dtype", [(1, torch.float16), (5, torch.bfloat16), (9, torch.float32)])
def test_merge_states(num, dtype):
    v, s = _states(4, 3, 64, dtype, 4, num=num)
    s[0] = NEG_INF
    s[1, 0] = NEG_INF
    out, lse = tritoninfer.merge_states(v, s)
    ref_v, ref_s = reference.merge_states(v, s)
    testing.assert_close(out, ref_v, dtype)
    testing.assert_lse_close(lse, ref_s, dtype=torch.float32)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == NEG_INF)


def test_merge_errors():
    v, s = _states(4, 3, 16, torch.float16, 0)
    with pytest.raises(ValueError, match="s_a"):
        tritoninfer.merge_state(v, s[:2], v, s)
    with pytest.raises(ValueError, match="v_b"):
        tritoninfer.merge_state(v, s, v.float(), s)
    with pytest.raises(ValueError, match="mask"):
        tritoninfer.merge_state_in_place(v, s, v, s, torch.ones(3, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="s:"):
        tritoninfer.merge_states(v[:, None], s)
