"""The reference (``tritoninfer.reference``) and ``tritoninfer.testing`` against independent computations.

Every expected value here is computed a different way than the reference does it: float64
``scaled_dot_product_attention`` with an explicit mask and ``repeat_interleave`` for GQA, LSE via
``torch.logsumexp / ln 2``, explicit Python loops for ALiBi and RoPE, slicing for decode windows, a
virtual key column for sinks, ``numpy.packbits`` for packed masks, a per-token reader for paged
caches. Pure torch on the CPU: the whole file runs in seconds.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tritoninfer import reference as R
from tritoninfer import testing as T

LN2 = math.log(2.0)
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# independent helpers
# --------------------------------------------------------------------------------------------------


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, seed=0, dtype=torch.float64, scale=1.0):
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype)


def loop_mask(qo, kv, causal=False, window=-1, custom=None):
    """Keep-mask [qo, kv] by explicit loops over (i, j)."""
    m = torch.zeros(qo, kv, dtype=torch.bool)
    for i in range(qo):
        last_visible = i + kv - qo  # bottom-right diagonal
        for j in range(kv):
            if custom is not None:
                keep = bool(custom[i, j])
            else:
                keep = (j <= last_visible) if causal else True
            if window >= 0 and j < last_visible - window:
                keep = False
            m[i, j] = keep
    return m


def sdpa(q, k, v, keep, scale=None, bias=None):
    """float64 SDPA; q [qo,Hq,D], k [kv,Hk,D], v [kv,Hk,Dv]; keep [qo,kv]; bias [Hq,qo,kv] or None.

    Returns (o [qo,Hq,Dv], lse2 [qo,Hq]) with rows that see no key set to 0 / -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    qo, hq, d = q.shape
    kv, hk, dv = v.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if kv == 0:
        return torch.zeros(qo, hq, dv, dtype=torch.float64), torch.full((qo, hq), NEG_INF, dtype=torch.float64)
    g = hq // hk
    Q = q.permute(1, 0, 2)  # [Hq, qo, D]
    K = k.repeat_interleave(g, dim=1).permute(1, 0, 2)  # [Hq, kv, D]
    V = v.repeat_interleave(g, dim=1).permute(1, 0, 2)  # [Hq, kv, Dv]
    add = torch.zeros(hq, qo, kv, dtype=torch.float64) if bias is None else bias.double()
    add = add.masked_fill(~keep[None], NEG_INF)
    o = F.scaled_dot_product_attention(Q, K, V, attn_mask=add, scale=scale)  # [Hq, qo, Dv]
    scores = Q @ K.transpose(1, 2) * scale + add
    lse = torch.logsumexp(scores, dim=-1) / LN2  # [Hq, qo]
    empty = ~keep.any(dim=1)  # [qo]
    assert torch.isfinite(o[:, ~empty]).all()
    o = torch.where(empty[None, :, None], torch.zeros_like(o), o)
    return o.permute(1, 0, 2), lse.transpose(0, 1)


def check(o, lse, o_ref, lse_ref, tol=1e-10):
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin].double(), lse_ref[fin].double(), atol=tol, rtol=tol)
    torch.testing.assert_close(o.double(), o_ref.double(), atol=tol, rtol=tol)


def loop_rotate(x, positions, scale=1.0, theta=1e4):
    """Rotate-half RoPE by loops with math.cos/sin; x [n, H, D] float64."""
    n, h, d = x.shape
    out = x.clone()
    for t in range(n):
        for j in range(d // 2):
            ang = float(positions[t]) * (theta ** (-2.0 * j / d)) / scale
            c, s = math.cos(ang), math.sin(ang)
            for hh in range(h):
                a, b = float(x[t, hh, j]), float(x[t, hh, j + d // 2])
                out[t, hh, j] = a * c - b * s
                out[t, hh, j + d // 2] = b * c + a * s
    return out


def np_pack_little(mask_bool):
    return torch.from_numpy(np.packbits(mask_bool.reshape(-1).numpy().astype(np.uint8), bitorder="little").copy())


# --------------------------------------------------------------------------------------------------
# alibi, rope
# --------------------------------------------------------------------------------------------------


def paper_alibi(n):
    """The ALiBi paper's get_slopes."""

    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + paper_alibi(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8, 12, 16, 20, 32, 40, 64])
def test_alibi_slopes(n):
    s = R.alibi_slopes(n)
    assert s.dtype == torch.float32 and s.shape == (n,)
    torch.testing.assert_close(s, torch.tensor(paper_alibi(n), dtype=torch.float32), rtol=1e-6, atol=0)


def test_apply_rotary_llama_loops():
    x = rnd(4, 2, 8, seed=1)
    pos = torch.tensor([0, 3, 17, 1000])
    for scale, theta in [(1.0, 1e4), (2.0, 500.0)]:
        got = R.apply_rotary_llama(x, pos, scale, theta)
        torch.testing.assert_close(got, loop_rotate(x, pos, scale, theta), atol=1e-12, rtol=1e-12)
    # defaults, fp16 input -> float32 output
    got = R.apply_rotary_llama(x.half(), pos)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), loop_rotate(x.half().double(), pos), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        R.apply_rotary_llama(rnd(2, 1, 5), torch.arange(2))
    with pytest.raises(ValueError, match="positions"):
        R.apply_rotary_llama(x, torch.arange(3))


# --------------------------------------------------------------------------------------------------
# the core against SDPA
# --------------------------------------------------------------------------------------------------

CORE_CASES = [
    # qo, kv, Hq, Hk, Dqk, Dvo, causal, window
    (1, 1, 4, 4, 64, 64, False, -1),
    (5, 17, 8, 2, 40, 40, True, -1),
    (7, 7, 7, 1, 72, 72, True, 2),  # GQA 7, single KV head
    (3, 9, 14, 2, 192, 128, False, -1),  # D_qk 192 / D_vo 128
    (6, 3, 4, 4, 64, 64, True, -1),  # qo > kv causal: first rows see nothing
    (4, 0, 4, 2, 16, 16, False, -1),  # empty KV
    (4, 11, 6, 3, 16, 24, False, 3),  # window without causal: right side stays visible
    (1, 9, 8, 1, 40, 40, False, 4),  # decode window
    (5, 12, 4, 1, 32, 32, True, 0),  # window 0: only the diagonal key
]


@pytest.mark.parametrize("case", CORE_CASES)
def test_attention_vs_sdpa(case):
    qo, kv, hq, hk, dqk, dvo, causal, window = case
    q, k, v = rnd(qo, hq, dqk, seed=1), rnd(kv, hk, dqk, seed=2), rnd(kv, hk, dvo, seed=3)
    o, lse = R.attention(q, k, v, causal=causal, window_left=window)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    keep = loop_mask(qo, kv, causal, window)
    check(o, lse, *sdpa(q, k, v, keep))
    # low-precision inputs are upcast; float32 results
    o16, lse16 = R.attention(q.half(), k.half(), v.half(), causal=causal, window_left=window, sm_scale=0.3)
    assert o16.dtype == torch.float32 and lse16.dtype == torch.float32
    check(o16, lse16, *sdpa(q.half(), k.half(), v.half(), keep, scale=0.3), tol=2e-5)


def test_empty_rows_are_zero_and_neg_inf():
    q, k, v = rnd(6, 4, 16, seed=1), rnd(3, 2, 16, seed=2), rnd(3, 2, 16, seed=3)
    o, lse = R.attention(q, k, v, causal=True)
    assert torch.equal(o[:3], torch.zeros_like(o[:3]))
    assert torch.equal(lse[:3], torch.full_like(lse[:3], NEG_INF))
    assert torch.isfinite(lse[3:]).all() and o[3:].abs().sum() > 0


@pytest.mark.parametrize("kv_len", [1, 2, 9])
@pytest.mark.parametrize("mode", ["NONE", "ROPE_LLAMA"])
def test_decode_window_equals_slicing(kv_len, mode):
    q, k, v = rnd(8, 40, seed=4), rnd(kv_len, 2, 40, seed=5), rnd(kv_len, 2, 40, seed=6)
    for w in sorted({0, 1, 3, kv_len - 1, kv_len + 3}):
        o, lse = R.single_decode_with_kv_cache(q, k, v, window_left=w, pos_encoding_mode=mode, return_lse=True)
        o2, lse2 = R.single_decode_with_kv_cache(q, k[-(w + 1):], v[-(w + 1):], pos_encoding_mode=mode, return_lse=True)
        torch.testing.assert_close(o, o2, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, lse2, atol=1e-12, rtol=1e-12)


def test_soft_cap_explicit():
    qo, kv, hq, hk, d, cap = 4, 9, 6, 2, 16, 3.0
    q, k, v = rnd(qo, hq, d, seed=7, scale=3.0), rnd(kv, hk, d, seed=8), rnd(kv, hk, d, seed=9)
    scale = 0.37
    o, lse = R.attention(q, k, v, causal=True, logits_soft_cap=cap, sm_scale=scale, k_scale=1.5, q_scale=0.5)
    keep = loop_mask(qo, kv, causal=True)
    eff = scale * 1.5 * 0.5
    for h in range(hq):
        kh, vh = k[:, h // 3], v[:, h // 3]
        logits = torch.matmul(q[:, h], kh.T)
        s = cap * torch.tanh(logits * eff / cap)
        s = s.masked_fill(~keep, NEG_INF)
        torch.testing.assert_close(o[:, h], torch.softmax(s, -1) @ vh, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse[:, h], torch.logsumexp(s, -1) / LN2, atol=1e-12, rtol=1e-12)
    # cap 0 / None mean "off"
    o0 = R.attention(q, k, v, logits_soft_cap=0.0)[0]
    torch.testing.assert_close(o0, R.attention(q, k, v)[0], atol=0, rtol=0)


def loop_scores_alibi(q, k, scale, qo_rows, cap=None):
    """Scores [H, qo, kv] by Python loops; query row i gets bias slope*(j - qo_rows[i])."""
    qo, hq, _ = q.shape
    kv, hk, _ = k.shape
    slopes = paper_alibi(hq)
    s = torch.empty(hq, qo, kv, dtype=torch.float64)
    for h in range(hq):
        for i in range(qo):
            for j in range(kv):
                x = float(torch.dot(q[i, h], k[j, h // (hq // hk)])) * scale
                if cap:
                    x = cap * math.tanh(x / cap)
                s[h, i, j] = x + slopes[h] * (j - qo_rows[i])
    return s


@pytest.mark.parametrize("cap", [None, 2.5])
def test_alibi_prefill_and_decode_loops(cap):
    qo, kv, hq, hk, d = 3, 5, 6, 2, 8
    q, k, v = rnd(qo, hq, d, seed=10), rnd(kv, hk, d, seed=11), rnd(kv, hk, d, seed=12)
    scale = 1 / math.sqrt(d)
    # prefill causal: row index within the request
    o, lse = R.attention(q, k, v, causal=True, pos_encoding_mode="ALIBI", logits_soft_cap=cap)
    s = loop_scores_alibi(q, k, scale, list(range(qo)), cap).masked_fill(~loop_mask(qo, kv, True)[None], NEG_INF)
    vv = v.repeat_interleave(hq // hk, 1).permute(1, 0, 2)
    torch.testing.assert_close(o, (torch.softmax(s, -1) @ vv).permute(1, 0, 2), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, (torch.logsumexp(s, -1) / LN2).T, atol=1e-12, rtol=1e-12)
    # decode: bias slope*kv_idx
    od, lsed = R.single_decode_with_kv_cache(q[0], k, v, pos_encoding_mode="ALIBI", logits_soft_cap=cap, return_lse=True)
    sd = loop_scores_alibi(q[:1], k, scale, [0], cap)[:, 0]  # [H, kv]
    torch.testing.assert_close(od, torch.einsum("hk,hkd->hd", torch.softmax(sd, -1), vv), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lsed, torch.logsumexp(sd, -1) / LN2, atol=1e-12, rtol=1e-12)


def test_rope_llama_loops():
    qo, kv, hq, hk, d = 3, 6, 4, 2, 8
    q, k, v = rnd(qo, hq, d, seed=13), rnd(kv, hk, d, seed=14), rnd(kv, hk, d, seed=15)
    for rs, rt in [(None, None), (2.0, 100.0)]:
        o, lse = R.attention(q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=rs, rope_theta=rt)
        qr = loop_rotate(q, [kv - qo + i for i in range(qo)], rs or 1.0, rt or 1e4)
        kr = loop_rotate(k, list(range(kv)), rs or 1.0, rt or 1e4)
        check(o, lse, *sdpa(qr, kr, v, loop_mask(qo, kv, True)), tol=1e-11)
    # decode: query at kv_len - 1
    od, lsed = R.single_decode_with_kv_cache(q[0], k, v, pos_encoding_mode="ROPE_LLAMA", return_lse=True)
    o_ref, lse_ref = sdpa(loop_rotate(q[:1], [kv - 1]), loop_rotate(k, list(range(kv))), v, loop_mask(1, kv))
    check(od, lsed, o_ref[0], lse_ref[0], tol=1e-11)


@pytest.mark.parametrize("qo,kv,causal", [(3, 7, True), (1, 5, False), (4, 2, True), (2, 0, False)])
def test_sinks_virtual_key(qo, kv, causal):
    hq, hk, d = 4, 2, 16
    q, k, v = rnd(qo, hq, d, seed=16), rnd(kv, hk, d, seed=17), rnd(kv, hk, d, seed=18)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32)
    o, lse = R.attention(q, k, v, causal=causal, sinks=sinks)
    o_nosink, lse_nosink = R.attention(q, k, v, causal=causal)
    torch.testing.assert_close(lse, lse_nosink, atol=0, rtol=0)  # LSE excludes the sink
    keep = loop_mask(qo, kv, causal)
    scale = 1 / math.sqrt(d)
    for h in range(hq):
        logits = (q[:, h] @ k[:, h // 2].T * scale).masked_fill(~keep, NEG_INF)  # [qo, kv]
        with_sink = torch.cat([logits, torch.full((qo, 1), float(sinks[h]), dtype=torch.float64)], 1)
        v_ext = torch.cat([v[:, h // 2], torch.zeros(1, d, dtype=torch.float64)], 0)
        torch.testing.assert_close(o[:, h], torch.softmax(with_sink, -1) @ v_ext, atol=1e-12, rtol=1e-12)
    empty = ~keep.any(1)
    assert torch.equal(o[empty], torch.zeros_like(o[empty]))
    assert (lse[empty] == NEG_INF).all()


def test_fp8_scales_and_per_head_scales():
    hq, hk, d, kv = 8, 2, 32, 10
    q = rnd(hq, d, seed=19, dtype=torch.float16)
    k32, v32 = rnd(kv, hk, d, seed=20, scale=2.0), rnd(kv, hk, d, seed=21, scale=30.0)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        kq, ks = T.quantize_fp8(k32, dt)
        vq, vs = T.quantize_fp8(v32, dt)
        o, lse = R.single_decode_with_kv_cache(q, kq, vq, q_scale=0.5, k_scale=ks, v_scale=vs, return_lse=True)
        o_ref, lse_ref = sdpa(q[None].double() * 0.5, kq.double() * ks, vq.double() * vs, loop_mask(1, kv))
        check(o, lse, o_ref[0], lse_ref[0], tol=2e-5)
        assert T.rel_error(o, R.single_decode_with_kv_cache(q, k32, v32, q_scale=0.5)) < T.FP8_VS_UNQUANTIZED[dt]
    # per-head scale_q / scale_k / scale_v (single prefill)
    qo = 3
    qp, k, v = rnd(qo, hq, d, seed=22), rnd(kv, hk, d, seed=23), rnd(kv, hk, d, seed=24)
    sq = torch.linspace(0.5, 1.5, hq, dtype=torch.float32)
    sk = torch.tensor([0.7, 1.3], dtype=torch.float32)
    sv = torch.tensor([2.0, 0.25], dtype=torch.float32)
    o, lse = R.single_prefill_with_kv_cache(qp, k, v, sq, sk, sv, causal=True, return_lse=True)
    o_ref, lse_ref = sdpa(qp * sq.double()[None, :, None], k * sk.double()[None, :, None], v * sv.double()[None, :, None], loop_mask(qo, kv, True))
    check(o, lse, o_ref, lse_ref, tol=1e-6)


# --------------------------------------------------------------------------------------------------
# single-request entry points
# --------------------------------------------------------------------------------------------------


def test_single_layouts_and_shapes():
    q, k, v = rnd(5, 8, 72, seed=25), rnd(9, 4, 72, seed=26), rnd(9, 4, 72, seed=27)
    o = R.single_prefill_with_kv_cache(q, k, v, causal=True)
    o_h, lse_h = R.single_prefill_with_kv_cache(q, k.transpose(0, 1), v.transpose(0, 1), causal=True, kv_layout="HND", return_lse=True)
    torch.testing.assert_close(o, o_h, atol=0, rtol=0)
    assert lse_h.shape == (5, 8)
    od = R.single_decode_with_kv_cache(q[0], k, v)
    od_h, lse_d = R.single_decode_with_kv_cache(q[0], k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), kv_layout="HND", return_lse=True)
    assert od.shape == (8, 72) and lse_d.shape == (8,)
    torch.testing.assert_close(od, od_h, atol=0, rtol=0)
    check(od[None], lse_d[None], *sdpa(q[:1], k, v, loop_mask(1, 9)))


def test_single_prefill_custom_mask_packed_and_overrides_causal():
    qo, kv = 5, 11
    q, k, v = rnd(qo, 4, 16, seed=28), rnd(kv, 1, 16, seed=29), rnd(kv, 1, 16, seed=30)
    mask = torch.rand(qo, kv, generator=gen(31)) > 0.4
    mask[2] = False  # a row with no key
    o, lse = R.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, causal=True, return_lse=True)
    check(o, lse, *sdpa(q, k, v, mask))
    o_p, lse_p = R.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=np_pack_little(mask), return_lse=True)
    torch.testing.assert_close(o, o_p, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_p, atol=0, rtol=0)
    # the window still applies to a custom mask
    o_w, lse_w = R.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, window_left=3, return_lse=True)
    check(o_w, lse_w, *sdpa(q, k, v, loop_mask(qo, kv, window=3, custom=mask)))


# --------------------------------------------------------------------------------------------------
# paged KV
# --------------------------------------------------------------------------------------------------


def read_token(cache, layout, page, slot):
    """(k [H, D], v [H, D]) of one token, read straight from a cache of any form."""
    if isinstance(cache, tuple):
        kc, vc = cache
        if kc.dim() == 3:
            return kc[page], vc[page]
        return (kc[page, slot], vc[page, slot]) if layout == "NHD" else (kc[page, :, slot], vc[page, :, slot])
    if cache.dim() == 4:
        return cache[page, 0], cache[page, 1]
    return (cache[page, 0, slot], cache[page, 1, slot]) if layout == "NHD" else (cache[page, 0, :, slot], cache[page, 1, :, slot])


FORMS = [("5d", 3), ("tuple", 4), ("tuple3d", 1), ("4d", 1), ("5d", 1)]


@pytest.mark.parametrize("form,page_size", FORMS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("strided", [False, True])
def test_gather_paged_kv_every_form(form, page_size, layout, strided):
    kv_lens = [5, 0, 1, 8, 3]
    dvo = 24 if form in ("tuple", "tuple3d") else 16
    p = T.make_paged_kv(kv_lens, page_size, 2, 16, head_dim_vo=dvo, layout=layout, form=form, generator=gen(32), strided=strided)
    c0 = p.cache if isinstance(p.cache, torch.Tensor) else p.cache[0]
    assert c0.is_contiguous() != strided
    got = R.gather_paged_kv(p.cache, p.kv_indptr, p.kv_indices, p.kv_last_page_len, layout)
    indptr, indices = p.kv_indptr.tolist(), p.kv_indices.tolist()
    for i, n in enumerate(kv_lens):
        k_i, v_i = got[i]
        assert k_i.dtype == torch.float16 and k_i.shape == (n, 2, 16) and v_i.shape == (n, 2, dvo)
        assert torch.equal(k_i, p.k_list[i]) and torch.equal(v_i, p.v_list[i])
        for t in range(n):
            kt, vt = read_token(p.cache, layout, indices[indptr[i] + t // page_size], t % page_size)
            assert torch.equal(k_i[t], kt) and torch.equal(v_i[t], vt)
        assert torch.equal(k_i.float(), p.k_float[i].half().float())


def test_make_paged_kv_page_table():
    kv_lens = [5, 0, 8, 1]
    p = T.make_paged_kv(kv_lens, 4, 2, 8, generator=gen(33), extra_pages=3)
    assert p.kv_indptr.dtype == p.kv_indices.dtype == p.kv_last_page_len.dtype == torch.int32
    assert p.kv_indptr.tolist() == [0, 2, 2, 4, 5]
    assert p.kv_last_page_len.tolist() == [1, 0, 4, 1]
    assert p.num_pages == 8 and len(set(p.kv_indices.tolist())) == 5
    assert p.seq_lens.tolist() == kv_lens and p.seq_lens.dtype == torch.int32
    assert p.block_tables.shape == (4, 2) and p.block_tables.dtype == torch.int32
    for i in range(4):
        row = p.kv_indices[p.kv_indptr[i]:p.kv_indptr[i + 1]].tolist()
        assert p.block_tables[i, : len(row)].tolist() == row
    assert R.get_kv_lens(p.kv_indptr, p.kv_last_page_len, 4).tolist() == kv_lens
    # unused pages hold garbage (not zeros), and NaN garbage on request
    unused = sorted(set(range(8)) - set(p.kv_indices.tolist()))
    assert p.cache[unused].abs().sum() > 0
    pn = T.make_paged_kv([3], 4, 1, 8, garbage="nan", generator=gen(1))
    assert torch.isnan(pn.cache[pn.kv_indices[0], :, 3:]).all()
    assert not torch.isnan(R.gather_paged_kv(pn.cache, pn.kv_indptr, pn.kv_indices, pn.kv_last_page_len)[0][0]).any()
    # fp8 data is divided by the scale before the cast
    p8 = T.make_paged_kv([6], 2, 1, 8, dtype="float8_e4m3fn", k_scale=0.5, v_scale=0.25, generator=gen(2))
    torch.testing.assert_close(p8.k_list[0].float() * 0.5, p8.k_float[0], rtol=0.07, atol=1e-2)
    torch.testing.assert_close(p8.v_list[0].float() * 0.25, p8.v_float[0], rtol=0.07, atol=1e-2)
    with pytest.raises(ValueError, match="page_size"):
        T.make_paged_kv([3], 2, 1, 8, form="tuple3d")
    with pytest.raises(ValueError, match="head_dim_vo"):
        T.make_paged_kv([3], 2, 1, 8, head_dim_vo=16, form="5d")


@pytest.mark.parametrize("q_len_per_req", [1, 3])
@pytest.mark.parametrize("form,layout", [("5d", "NHD"), ("tuple", "HND")])
def test_batch_decode_vs_sdpa(q_len_per_req, form, layout):
    kv_lens, page_size, hq, hk, d = [5, 0, 1, 13], 4, 8, 2, 16
    p = T.make_paged_kv(kv_lens, page_size, hk, d, layout=layout, form=form, generator=gen(34), strided=True)
    q = rnd(len(kv_lens) * q_len_per_req, hq, d, seed=35, dtype=torch.float16)
    o, lse = R.batch_decode_with_paged_kv_cache(q, p.cache, p.kv_indptr, p.kv_indices, p.kv_last_page_len, layout, q_len_per_req=q_len_per_req)
    assert o.dtype == torch.float32 and o.shape == (q.shape[0], hq, d) and lse.shape == (q.shape[0], hq)
    for i, n in enumerate(kv_lens):
        rows = slice(i * q_len_per_req, (i + 1) * q_len_per_req)
        o_ref, lse_ref = sdpa(q[rows], p.k_list[i], p.v_list[i], loop_mask(q_len_per_req, n, causal=True))
        check(o[rows], lse[rows], o_ref, lse_ref, tol=2e-5)
    assert (lse[q_len_per_req:2 * q_len_per_req] == NEG_INF).all()  # the empty request


def test_batch_decode_options_match_single():
    kv_lens, hq, hk, d = [7, 2, 1], 6, 3, 32
    p = T.make_paged_kv(kv_lens, 1, hk, d, form="tuple3d", generator=gen(36))
    q = rnd(3, hq, d, seed=37, dtype=torch.bfloat16)
    sinks = torch.tensor([0.1, -0.2, 0.3, 1.0, -1.0, 0.0])
    kw = dict(pos_encoding_mode="ROPE_LLAMA", window_left=1, logits_soft_cap=4.0, sm_scale=0.2, rope_theta=1e3)
    o, lse = R.batch_decode_with_paged_kv_cache(q, p.cache, p.kv_indptr, p.kv_indices, p.kv_last_page_len, sinks=sinks, **kw)
    for i in range(3):
        o_s, lse_s = R.single_decode_with_kv_cache(q[i], p.k_list[i], p.v_list[i], return_lse=True, sinks=sinks, **kw)
        torch.testing.assert_close(o[i], o_s, atol=0, rtol=0)
        torch.testing.assert_close(lse[i], lse_s, atol=0, rtol=0)


def segment_pack(masks):
    """FlashInfer's segment_packbits(bitorder='little'), written with numpy: (packed, byte indptr)."""
    segs = [np_pack_little(m) for m in masks]
    indptr = [0]
    for s in segs:
        indptr.append(indptr[-1] + s.numel())
    return torch.cat(segs) if segs else torch.zeros(0, dtype=torch.uint8), torch.tensor(indptr, dtype=torch.int32)


def test_batch_prefill_paged_custom_mask_and_ragged():
    qo_lens, kv_lens, hq, hk, d = [3, 0, 4, 2, 5], [5, 3, 0, 9, 2], 4, 2, 16
    p = T.make_paged_kv(kv_lens, 2, hk, d, layout="HND", generator=gen(38))
    q, qo_indptr = T.random_qo(qo_lens, hq, d, dtype=torch.float16, generator=gen(39))
    g = gen(40)
    masks = [torch.rand(a, b, generator=g) > 0.3 for a, b in zip(qo_lens, kv_lens)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    args = (q, qo_indptr, p.cache, p.kv_indptr, p.kv_indices, p.kv_last_page_len, "HND")
    o, lse = R.batch_prefill_with_paged_kv_cache(*args, custom_mask=flat, causal=True)
    packed, mask_indptr = segment_pack(masks)
    o_p, lse_p = R.batch_prefill_with_paged_kv_cache(*args, packed_custom_mask=packed, mask_indptr=mask_indptr)
    o_p2, _ = R.batch_prefill_with_paged_kv_cache(*args, packed_custom_mask=packed)  # default byte offsets
    for other in (o_p, o_p2):
        torch.testing.assert_close(o, other, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_p, atol=0, rtol=0)
    starts = qo_indptr.tolist()
    for i in range(len(qo_lens)):
        rows = slice(starts[i], starts[i + 1])
        check(o[rows], lse[rows], *sdpa(q[rows], p.k_list[i], p.v_list[i], masks[i]), tol=2e-5)
    # ragged with the same KV gives the same answer; causal and window too
    k = torch.cat(p.k_list)
    v = torch.cat(p.v_list)
    kv_indptr = torch.tensor([0] + np.cumsum(kv_lens).tolist(), dtype=torch.int32)
    o_r, lse_r = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, custom_mask=flat)
    torch.testing.assert_close(o, o_r, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_r, atol=0, rtol=0)
    o_c, lse_c = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, causal=True, window_left=2)
    o_cp, lse_cp = R.batch_prefill_with_paged_kv_cache(*args, causal=True, window_left=2)
    torch.testing.assert_close(o_c, o_cp, atol=0, rtol=0)
    for i in range(len(qo_lens)):
        rows = slice(starts[i], starts[i + 1])
        keep = loop_mask(qo_lens[i], kv_lens[i], True, 2)
        check(o_c[rows], lse_c[rows], *sdpa(q[rows], p.k_list[i], p.v_list[i], keep), tol=2e-5)
    # HND ragged
    o_h, _ = R.batch_prefill_with_ragged_kv_cache(q, k.transpose(0, 1), v.transpose(0, 1), qo_indptr, kv_indptr, "HND", causal=True, window_left=2)
    torch.testing.assert_close(o_c, o_h, atol=0, rtol=0)


def test_batch_prefill_asymmetric_head_dims_alibi():
    qo_lens, kv_lens = [2, 3], [4, 3]
    k, kv_indptr = T.make_ragged(kv_lens, 1, 192, torch.float16, generator=gen(41))
    v, _ = T.make_ragged(kv_lens, 1, 128, torch.float16, generator=gen(42))
    q, qo_indptr = T.random_qo(qo_lens, 3, 192, generator=gen(43))
    o, lse = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, causal=True, pos_encoding_mode="ALIBI")
    assert o.shape == (5, 3, 128)
    for i in range(2):
        qs = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
        ks = slice(int(kv_indptr[i]), int(kv_indptr[i + 1]))
        o_s, lse_s = R.single_prefill_with_kv_cache(q[qs], k[ks], v[ks], causal=True, pos_encoding_mode="ALIBI", return_lse=True)
        torch.testing.assert_close(o[qs], o_s, atol=0, rtol=0)
        torch.testing.assert_close(lse[qs], lse_s, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# merging
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1, 6, 13])
def test_merge_state_equals_full_attention(split):
    q, k, v = rnd(4, 6, 16, seed=44), rnd(13, 2, 16, seed=45), rnd(13, 2, 16, seed=46)
    o_full, lse_full = R.attention(q, k, v)
    o_a, s_a = R.attention(q, k[:split], v[:split])
    o_b, s_b = R.attention(q, k[split:], v[split:])
    o_m, s_m = R.merge_state(o_a, s_a, o_b, s_b)
    torch.testing.assert_close(o_m, o_full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s_m, lse_full, atol=1e-12, rtol=1e-12)
    # three pieces through merge_states, one empty
    cuts = [0, split // 2, split, 13]
    parts = [R.attention(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    v3, s3 = R.merge_states(torch.stack([p[0] for p in parts], 1), torch.stack([p[1] for p in parts], 1))
    torch.testing.assert_close(v3, o_full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s3, lse_full, atol=1e-12, rtol=1e-12)


def test_merge_state_empty_states():
    v_a, v_b = rnd(3, 2, 8, seed=47, dtype=torch.float16), rnd(3, 2, 8, seed=48, dtype=torch.float16)
    s_a = torch.tensor([[NEG_INF, 1.0], [NEG_INF, NEG_INF], [0.5, 2.0]])
    s_b = torch.tensor([[NEG_INF, NEG_INF], [2.0, NEG_INF], [NEG_INF, 3.0]])
    v, s = R.merge_state(v_a, s_a, v_b, s_b)
    assert v.dtype == torch.float32 and not torch.isnan(v).any()
    assert torch.equal(v[0, 0], torch.zeros(8)) and s[0, 0] == NEG_INF and s[1, 1] == NEG_INF
    torch.testing.assert_close(v[0, 1], v_a[0, 1].float(), atol=0, rtol=0)
    torch.testing.assert_close(v[1, 0], v_b[1, 0].float(), atol=0, rtol=0)
    assert s[0, 1] == 1.0 and s[1, 0] == 2.0
    torch.testing.assert_close(v[2, 0], v_a[2, 0].float())
    torch.testing.assert_close(v[2, 1], (v_a[2, 1].float() * 2.0**2 + v_b[2, 1].float() * 2.0**3) / (2.0**2 + 2.0**3))
    torch.testing.assert_close(s[2, 1], torch.tensor(math.log2(2.0**2 + 2.0**3), dtype=torch.float32))
    # no states at all
    v0, s0 = R.merge_states(torch.zeros(2, 0, 3, 4), torch.zeros(2, 0, 3))
    assert torch.equal(v0, torch.zeros(2, 3, 4)) and (s0 == NEG_INF).all()


def test_merge_state_in_place_mask():
    v, v_o = rnd(4, 2, 8, seed=49), rnd(4, 2, 8, seed=50)
    s, s_o = rnd(4, 2, seed=51), rnd(4, 2, seed=52)
    mask = torch.tensor([True, False, True, False])
    v_before, s_before = v.clone(), s.clone()
    v_n, s_n = R.merge_state_in_place(v, s, v_o, s_o, mask)
    assert torch.equal(v, v_before) and torch.equal(s, s_before)  # inputs untouched
    v_m, s_m = R.merge_state(v, s, v_o, s_o)
    assert torch.equal(v_n[mask], v_m[mask]) and torch.equal(s_n[mask], s_m[mask])
    assert torch.equal(v_n[~mask], v[~mask]) and torch.equal(s_n[~mask], s[~mask])
    v_all, _ = R.merge_state_in_place(v, s, v_o, s_o)
    assert torch.equal(v_all, v_m)


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def test_argument_errors():
    q, k, v = rnd(2, 6, 16), rnd(3, 4, 16), rnd(3, 4, 16)
    with pytest.raises(ValueError, match="num_qo_heads"):
        R.attention(q, k, v)
    q = rnd(2, 8, 16)
    with pytest.raises(ValueError, match="head_dim"):
        R.attention(q, rnd(3, 4, 8), v)
    with pytest.raises(ValueError, match="v:"):
        R.attention(q, k, rnd(4, 4, 16))
    with pytest.raises(TypeError, match="q"):
        R.attention(q.to(torch.int32), k, v)
    with pytest.raises(ValueError, match="pos_encoding_mode"):
        R.attention(q, k, v, pos_encoding_mode="ROPE")
    with pytest.raises(ValueError, match="kv_layout"):
        R.single_decode_with_kv_cache(q[0], k, v, kv_layout="NDH")
    with pytest.raises(ValueError, match="window_left"):
        R.attention(q, k, v, window_left=-2)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        R.attention(q, k, v, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="custom_mask"):
        R.attention(q, k, v, custom_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="custom_mask"):
        R.attention(q, k, v, custom_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="sinks"):
        R.attention(q, k, v, sinks=torch.zeros(4))
    with pytest.raises(ValueError, match="k_scale"):
        R.attention(q, k, v, k_scale=torch.ones(3))
    with pytest.raises(TypeError, match="causal"):
        R.attention(q, k, v, causal=None)
    with pytest.raises(ValueError, match="backend"):
        R.single_prefill_with_kv_cache(q, k, v, backend="flash")
    with pytest.raises(ValueError, match="o_dtype"):
        R.single_prefill_with_kv_cache(q, k, v, o_dtype="float13")
    with pytest.raises(ValueError, match="packed_custom_mask"):
        R.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rope"):
        R.attention(q, k, v, rope_theta=-1.0)
    p = T.make_paged_kv([3, 5], 2, 4, 16, generator=gen(53))
    args = (p.cache, p.kv_indptr, p.kv_indices)
    with pytest.raises(ValueError, match="kv_last_page_len"):
        R.gather_paged_kv(*args, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_indices"):
        R.gather_paged_kv(p.cache, p.kv_indptr, p.kv_indices + 100, p.kv_last_page_len)
    with pytest.raises(ValueError, match="kv_indptr"):
        R.gather_paged_kv(p.cache, torch.tensor([1, 2, 5], dtype=torch.int32), p.kv_indices, p.kv_last_page_len)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        R.gather_paged_kv(p.cache[:, 0, 0], p.kv_indptr, p.kv_indices, p.kv_last_page_len)
    with pytest.raises(ValueError, match="q:"):
        R.batch_decode_with_paged_kv_cache(rnd(3, 8, 16), *args, p.kv_last_page_len)
    qp, qo_indptr = T.random_qo([1, 2], 8, 16, generator=gen(54))
    with pytest.raises(ValueError, match="custom_mask"):
        R.batch_prefill_with_paged_kv_cache(qp, qo_indptr, *args, p.kv_last_page_len, custom_mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask_indptr"):
        R.batch_prefill_with_paged_kv_cache(
            qp, qo_indptr, *args, p.kv_last_page_len,
            packed_custom_mask=torch.zeros(8, dtype=torch.uint8), mask_indptr=torch.tensor([0, 0, 2], dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="v_b"):
        R.merge_state(rnd(2, 2, 4), rnd(2, 2), rnd(3, 2, 4), rnd(3, 2))
    with pytest.raises(ValueError, match="s_a"):
        R.merge_state(rnd(2, 2, 4), rnd(2, 3), rnd(2, 2, 4), rnd(2, 2))


# --------------------------------------------------------------------------------------------------
# tritoninfer.testing
# --------------------------------------------------------------------------------------------------


def test_tolerance_table_and_asserts():
    assert T.tolerance("float16") == T.TOLERANCES[torch.float16] and T.tolerance(torch.float64) == T.TOLERANCES[torch.float32]
    with pytest.raises(ValueError, match="dtype"):
        T.tolerance(torch.float8_e4m3fn)
    ref = rnd(4, 3, 8, seed=55, dtype=torch.float32)
    out = ref + 1e-4 * rnd(4, 3, 8, seed=56, dtype=torch.float32)
    assert T.assert_close(out.half(), ref, name="o") < 2e-3
    torch.testing.assert_close(T.rel_error(out, ref), ((out - ref).double().norm() / ref.double().norm()).item())
    bad = ref.clone()
    bad[1, 2, 3] += 1.0
    with pytest.raises(AssertionError, match=r"\(1, 2, 3\)"):
        T.assert_close(bad, ref, torch.float16)
    nan = ref.clone()
    nan[2, 0, 1] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        T.assert_close(nan, ref, torch.float16)
    lse_ref = torch.tensor([[NEG_INF, 2.0], [1.0, 3.0]])
    T.assert_lse_close(lse_ref + torch.tensor([[0.0, 1e-4], [-1e-4, 0.0]]), lse_ref)
    with pytest.raises(AssertionError, match="inf"):
        T.assert_lse_close(torch.tensor([[-5e4, 2.0], [1.0, 3.0]]), lse_ref)
    with pytest.raises(AssertionError, match="inf"):
        T.assert_lse_close(torch.tensor([[NEG_INF, NEG_INF], [1.0, 3.0]]), lse_ref)
    with pytest.raises(AssertionError, match="atol"):
        T.assert_lse_close(lse_ref + 0.1, lse_ref, atol=1e-3)
    # an all-empty reference: absolute error
    assert T.rel_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_workspace_nan_quantize_and_counts():
    ws = T.make_workspace(64)
    assert ws.dtype == torch.uint8 and torch.isnan(ws.view(torch.float32)).all()
    x = rnd(5, 4, seed=57, dtype=torch.float16)
    assert torch.isnan(T.nan_like(x)).all() and T.nan_like(x).dtype == torch.float16
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        xq, scale = T.quantize_fp8(x.float() * 10, dt)
        assert xq.dtype == dt and math.isclose(scale, float(x.float().abs().max()) * 10 / T.fp8_max(dt), rel_tol=1e-6)
        assert T.rel_error(xq.float() * scale, x.float() * 10) < T.FP8_VS_UNQUANTIZED[dt]
    # bytes: 2 requests, lens 5 and 8 with page 4 -> 8 + 8 tokens
    nbytes = T.decode_bytes([5, 8], 4, 8, 2, 64, torch.bfloat16, torch.float8_e4m3fn)
    assert nbytes == 16 * 2 * 128 * 1 + 2 * 8 * 64 * 2 + 2 * 8 * 64 * 2
    nbytes = T.decode_bytes([0, 1], 16, 4, 4, 64, "float16", "float16", head_dim_vo=32, q_len_per_req=2)
    assert nbytes == 16 * 4 * 96 * 2 + 4 * 4 * 64 * 2 + 4 * 4 * 32 * 2
    # flops: causal counts exactly the visible pairs of the bottom-right mask
    for qo, kv in [(1, 1), (3, 7), (7, 3), (5, 5), (4, 0), (0, 4), (9, 1)]:
        pairs = int(torch.tril(torch.ones(qo, kv), diagonal=kv - qo).sum()) if qo and kv else 0
        assert T.prefill_flops([qo], [kv], 2, 16, 8, True) == 2 * pairs * 2 * 24
        assert T.prefill_flops([qo], [kv], 2, 16, 8, False) == 2 * qo * kv * 2 * 24
    assert T.tb_per_s(2e12, 0.5) == 4.0 and T.tflop_per_s(1e12, 2.0) == 0.5
