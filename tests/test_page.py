"""tritoninfer.page against tritoninfer.reference.page.

Caches are pre-filled with random garbage (never zeros), so the tests see both that every appended
token lands in its slot and that every other slot is left untouched (the comparison is on the whole
cache, bit for bit: the append is a copy, or a dtype conversion done by both sides).

CPU (Triton interpreter) coverage: fp16/bf16/fp32 caches, and fp8 caches appended with fp8 K/V
(a byte copy). fp8 caches appended with fp16/bf16 K/V (a conversion inside the kernel) are checked
only on the GPU: the interpreter's fp32 -> fp8 cast is wrong, so a CPU run of that path proves
nothing and is skipped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import List

import pytest
import torch

import tritoninfer
from tritoninfer import page
from tritoninfer import reference as ref

from conftest import DEVICE, ON_GPU

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Triton 3.6's interpreter converts a loop bound loaded from memory with int() on a 1-element array.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """A ragged append into a paged cache whose page table already includes the new tokens."""

    page_size: int
    num_pages: int  # pages in the cache (more than the page table uses)
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    append_indptr: torch.Tensor
    seq_lens: torch.Tensor  # after the append
    nnz: int


def make_batch(lens_before: List[int], appends: List[int], page_size: int, spare_pages: int = 3,
               index_dtype=torch.int32, device=DEVICE) -> Batch:
    seq_after = [a + b for a, b in zip(lens_before, appends)]
    pages = [(s + page_size - 1) // page_size for s in seq_after]
    num_pages = sum(pages) + spare_pages
    kv_indices = torch.randperm(num_pages)[: sum(pages)]  # scattered pages; some never used
    kv_indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist())
    last = [s - (n - 1) * page_size if n > 0 else 0 for s, n in zip(seq_after, pages)]
    append_indptr = torch.tensor([0] + torch.tensor(appends).cumsum(0).tolist())
    return Batch(
        page_size=page_size,
        num_pages=num_pages,
        kv_indices=kv_indices.to(index_dtype).to(device),
        kv_indptr=kv_indptr.to(index_dtype).to(device),
        kv_last_page_len=torch.tensor(last).to(index_dtype).to(device),
        append_indptr=append_indptr.to(index_dtype).to(device),
        seq_lens=torch.tensor(seq_after).to(index_dtype).to(device),
        nnz=sum(appends),
    )


def random_of(shape, dtype, device=DEVICE) -> torch.Tensor:
    """Random values (no zeros) representable in ``dtype``."""
    x = torch.randn(shape, device=device) * 2
    x = torch.where(x.abs() < 0.05, torch.full_like(x, 0.5), x)
    return x.to(dtype)


def make_cache(form: str, layout: str, num_pages: int, page_size: int, H: int, D: int, Dv: int,
               dtype, strided: bool, device=DEVICE):
    """The cache in one of FlashInfer's forms, filled with random garbage.

    form: "5d" [P,2,ps,H,D]/[P,2,H,ps,D]; "tuple4"; "4d" [N,2,H,D] (page 1); "tuple3" [N,H,D] (page 1).
    strided: a view with non-standard strides (last dim contiguous), built by slicing/transposing.
    """
    page_dims = (page_size, H) if layout == "NHD" else (H, page_size)
    if form == "5d":
        assert D == Dv
        if strided:  # K/V outermost in memory, then transposed into place
            return random_of((2, num_pages) + page_dims + (D,), dtype, device).transpose(0, 1)
        return random_of((num_pages, 2) + page_dims + (D,), dtype, device)
    if form == "4d":
        assert page_size == 1 and D == Dv
        if strided:
            return random_of((num_pages, 2, H + 1, D), dtype, device)[:, :, 1:]
        return random_of((num_pages, 2, H, D), dtype, device)
    if form == "tuple4":
        shapes = [(num_pages,) + page_dims + (d,) for d in (D, Dv)]
    elif form == "tuple3":
        assert page_size == 1
        shapes = [(num_pages, H, d) for d in (D, Dv)]
    else:
        raise AssertionError(form)
    if strided:  # padded last dim, sliced: every stride but the last is non-standard
        return tuple(random_of(s[:-1] + (s[-1] + 8,), dtype, device)[..., 3:3 + s[-1]] for s in shapes)
    return tuple(random_of(s, dtype, device) for s in shapes)


def clone_cache(cache):
    return cache.clone() if isinstance(cache, torch.Tensor) else tuple(c.clone() for c in cache)


def assert_cache_equal(got, want):
    got = (got,) if isinstance(got, torch.Tensor) else got
    want = (want,) if isinstance(want, torch.Tensor) else want
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        gb = g.view(torch.uint8) if g.element_size() == 1 else g
        wb = w.view(torch.uint8) if w.element_size() == 1 else w
        if g.is_floating_point() and g.element_size() > 1:
            # bit-exact copy (NaN-free inputs, so equal() is a bitwise check here)
            assert torch.equal(gb, wb), f"max |diff| {(g.float() - w.float()).abs().max().item()}"
        else:
            assert torch.equal(gb, wb), f"{(gb != wb).sum().item()} bytes differ"


def run_append_case(form, layout, page_size, dtype, strided, lens_before, appends, H=2, D=16, Dv=None,
                    index_dtype=torch.int32, src_dtype=None, shuffle=False, device=DEVICE):
    Dv = D if Dv is None else Dv
    src_dtype = dtype if src_dtype is None else src_dtype
    batch = make_batch(lens_before, appends, page_size, index_dtype=index_dtype, device=device)
    cache = make_cache(form, layout, batch.num_pages, page_size, H, D, Dv, dtype, strided, device)
    before = clone_cache(cache)
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    k = random_of((batch.nnz, H, D), src_dtype, device)
    v = random_of((batch.nnz, H, Dv), src_dtype, device)
    if shuffle:  # tokens in any order are fine
        perm = torch.randperm(batch.nnz, device=device)
        bi, pos, k, v = bi[perm], pos[perm], k[perm], v[perm]
    bi, pos = bi.to(index_dtype), pos.to(index_dtype)
    want = ref.append_paged_kv_cache(k, v, bi, pos, before, batch.kv_indices, batch.kv_indptr,
                                     batch.kv_last_page_len, layout)
    out = page.append_paged_kv_cache(k, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr,
                                     batch.kv_last_page_len, kv_layout=layout)
    assert out is None
    assert_cache_equal(cache, want)
    return batch, before, cache


# ----------------------------------------------------------------------------------------------
# append_paged_kv_cache: kernel vs reference (pairwise over form x layout x page size x dtype x strides)
# ----------------------------------------------------------------------------------------------

# request shapes: partial last pages, unequal appends, an empty append, an empty request,
# a request whose existing prefix ends exactly on a page boundary
LENS_BEFORE = [5, 0, 7, 0, 3, 33]
APPENDS = [4, 0, 9, 2, 1, 6]

CASES = [
    # form, layout, page_size, dtype, strided, index dtype
    ("5d", "NHD", 3, torch.float16, False, torch.int32),
    ("5d", "HND", 16, torch.bfloat16, True, torch.int32),
    ("5d", "HND", 3, torch.float32, False, torch.int64),
    ("5d", "NHD", 16, torch.float16, True, torch.int64),
    ("5d", "NHD", 1, torch.float8_e4m3fn, False, torch.int32),
    ("tuple4", "NHD", 16, torch.float32, True, torch.int32),
    ("tuple4", "HND", 3, torch.float16, False, torch.int64),
    ("tuple4", "HND", 16, torch.float8_e5m2, True, torch.int32),
    ("tuple4", "NHD", 1, torch.bfloat16, False, torch.int32),
    ("4d", "NHD", 1, torch.float16, False, torch.int32),
    ("4d", "HND", 1, torch.float32, True, torch.int64),
    ("tuple3", "NHD", 1, torch.bfloat16, True, torch.int32),
    ("tuple3", "HND", 1, torch.float16, False, torch.int32),
]


@pytest.mark.parametrize(
    "form,layout,page_size,dtype,strided,index_dtype",
    [pytest.param(*c, id="{}-{}-ps{}-{}-{}-{}".format(c[0], c[1], c[2], str(c[3])[6:],
                                                       "strided" if c[4] else "contig", str(c[5])[6:]))
     for c in CASES],
)
def test_append_matches_reference(form, layout, page_size, dtype, strided, index_dtype):
    batch, before, after = run_append_case(form, layout, page_size, dtype, strided, LENS_BEFORE, APPENDS,
                                           index_dtype=index_dtype)
    # sanity: the test really moved data and really had untouched slots to check
    b = (before,) if isinstance(before, torch.Tensor) else before
    a = (after,) if isinstance(after, torch.Tensor) else after
    changed = sum(int((x.view(torch.uint8) != y.view(torch.uint8)).any(-1).sum()) if x.element_size() == 1
                  else int((x != y).any(-1).sum()) for x, y in zip(b, a))
    assert changed > 0
    if strided:
        assert not all(t.is_contiguous() for t in a)


@pytest.mark.parametrize("form,layout", [("tuple4", "NHD"), ("tuple3", "HND")])
def test_append_value_head_dim_differs(form, layout):
    ps = 1 if form == "tuple3" else 3
    run_append_case(form, layout, ps, torch.float16, form == "tuple4", LENS_BEFORE, APPENDS, D=16, Dv=8)


def test_append_several_token_blocks_and_shuffled_tokens():
    # 71 tokens at head_dim 16: more than one token block per head; tokens in random order.
    run_append_case("5d", "NHD", 3, torch.float16, False, [2, 30, 0, 1], [40, 0, 25, 6], H=1, shuffle=True)


def test_append_decode_step_and_non_power_of_two_head_dim():
    # one token per request (decode); head_dim 24 (not a power of two) and 3 heads
    run_append_case("5d", "HND", 16, torch.float16, False, [15, 16, 1, 40], [1, 1, 1, 1], H=3, D=24)


def test_append_strided_append_tensors():
    batch = make_batch([1, 4], [3, 5], 3)
    cache = make_cache("5d", "NHD", batch.num_pages, 3, 2, 16, 16, torch.float16, False)
    before = cache.clone()
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    v = random_of((batch.nnz, 2, 2, 16), torch.float16)[:, 1]  # strided token dimension
    k_t = random_of((batch.nnz, 16, 2), torch.float16).transpose(1, 2)  # last dim not contiguous either
    want = ref.append_paged_kv_cache(k_t, v, bi, pos, before, batch.kv_indices, batch.kv_indptr,
                                     batch.kv_last_page_len)
    page.append_paged_kv_cache(k_t, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    assert_cache_equal(cache, want)


def test_append_padding_tokens_are_skipped():
    batch = make_batch([2, 5], [3, 2], 3)
    cache = make_cache("5d", "NHD", batch.num_pages, 3, 1, 8, 8, torch.float32, False)
    before = cache.clone()
    nnz = batch.nnz + 4  # padded, as a CUDA-graph engine would
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, nnz)
    assert bi[batch.nnz:].tolist() == [-1] * 4 and pos[batch.nnz:].tolist() == [-1] * 4
    k = random_of((nnz, 1, 8), torch.float32)
    v = random_of((nnz, 1, 8), torch.float32)
    want = ref.append_paged_kv_cache(k, v, bi, pos, before, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    page.append_paged_kv_cache(k, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    assert_cache_equal(cache, want)


def test_append_empty_is_a_no_op():
    batch = make_batch([3], [0], 3)
    cache = make_cache("5d", "NHD", batch.num_pages, 3, 2, 8, 8, torch.float16, False)
    before = cache.clone()
    e = torch.empty(0, dtype=torch.int32, device=DEVICE)
    page.append_paged_kv_cache(random_of((0, 2, 8), torch.float16), random_of((0, 2, 8), torch.float16), e, e,
                               cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    assert torch.equal(cache, before)


def test_full_pipeline_seq_lens_then_positions_then_append():
    """The engine flow: page table -> get_seq_lens -> get_batch_indices_positions -> append."""
    batch = make_batch([4, 0, 9], [5, 3, 0], 4)
    seq_lens = page.get_seq_lens(batch.kv_indptr, batch.kv_last_page_len, 4)
    assert seq_lens.tolist() == batch.seq_lens.tolist()
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, seq_lens, batch.nnz)
    cache = make_cache("tuple4", "HND", batch.num_pages, 4, 2, 8, 8, torch.float16, False)
    before = clone_cache(cache)
    k = random_of((batch.nnz, 2, 8), torch.float16)
    v = random_of((batch.nnz, 2, 8), torch.float16)
    page.append_paged_kv_cache(k, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, "HND")
    # read back token by token in HND: cache[page][head, slot]
    for t, (b, p) in enumerate(zip(bi.tolist(), pos.tolist())):
        pg = int(batch.kv_indices[int(batch.kv_indptr[b]) + p // 4])
        assert torch.equal(cache[0][pg, :, p % 4], k[t]) and torch.equal(cache[1][pg, :, p % 4], v[t])
    # and nothing else moved
    want = ref.append_paged_kv_cache(k, v, bi, pos, before, batch.kv_indices, batch.kv_indptr,
                                     batch.kv_last_page_len, "HND")
    assert_cache_equal(cache, want)


@pytest.mark.skipif(not ON_GPU, reason="the Triton interpreter's fp32->fp8 cast is wrong: fp8 conversion "
                    "is checked on the GPU only (test_gpu_append_realistic)")
@pytest.mark.parametrize("dtype", FP8)
def test_append_fp8_cache_from_fp16(dtype):
    run_append_case("5d", "NHD", 3, dtype, False, LENS_BEFORE, APPENDS, src_dtype=torch.float16)


# ----------------------------------------------------------------------------------------------
# append_paged_kv_cache: errors
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def valid():
    batch = make_batch([2, 1], [3, 2], 3)
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    cache = make_cache("5d", "NHD", batch.num_pages, 3, 2, 8, 8, torch.float16, False)
    k = random_of((batch.nnz, 2, 8), torch.float16)
    v = random_of((batch.nnz, 2, 8), torch.float16)
    return dict(append_key=k, append_value=v, batch_indices=bi, positions=pos, paged_kv_cache=cache,
                kv_indices=batch.kv_indices, kv_indptr=batch.kv_indptr, kv_last_page_len=batch.kv_last_page_len)


def _call(args, **over):
    a = dict(args)
    a.update(over)
    page.append_paged_kv_cache(**a)


@pytest.mark.parametrize(
    "case,match",
    [
        ("value_nnz", "append_value"),
        ("value_heads", "append_value"),
        ("value_dtype", "append_value"),
        ("key_2d", "append_key"),
        ("cache_heads", "paged_kv_cache"),
        ("cache_head_dim", "paged_kv_cache"),
        ("tuple_v_dim", "paged_kv_cache"),
        ("dtype_mismatch", "append_key"),
        ("fp8_into_fp16", "append_key"),
        ("int_cache", "paged_kv_cache"),
        ("bi_len", "batch_indices"),
        ("pos_len", "positions"),
        ("bi_float", "batch_indices"),
        ("pos_int16", "positions"),
        ("indptr_float", "kv_indptr"),
        ("indices_2d", "kv_indices"),
        ("last_len", "kv_last_page_len"),
        ("layout", "kv_layout"),
        ("cache_dim1", "paged_kv_cache"),
        ("cache_3d", "paged_kv_cache"),
        ("last_dim_strided", "contiguous"),
        ("pos_beyond_pages", "positions"),
        ("pos_negative", "positions"),
        ("batch_out_of_range", "batch_indices"),
        ("page_id_out_of_range", "kv_indices"),
    ],
)
def test_append_errors(valid, case, match):
    k, v, cache = valid["append_key"], valid["append_value"], valid["paged_kv_cache"]
    bi, pos = valid["batch_indices"], valid["positions"]
    nnz = k.shape[0]
    over = {
        "value_nnz": dict(append_value=v[:-1]),
        "value_heads": dict(append_value=v[:, :1]),
        "value_dtype": dict(append_value=v.float()),
        "key_2d": dict(append_key=k[:, 0]),
        "cache_heads": dict(append_key=k[:, :1], append_value=v[:, :1]),
        "cache_head_dim": dict(append_key=random_of((nnz, 2, 16), torch.float16),
                               append_value=random_of((nnz, 2, 16), torch.float16)),
        "tuple_v_dim": dict(paged_kv_cache=(cache[:, 0].clone(), cache[:, 1, ..., :4].clone())),
        "dtype_mismatch": dict(append_key=k.bfloat16(), append_value=v.bfloat16()),
        "fp8_into_fp16": dict(append_key=k.to(torch.float8_e4m3fn), append_value=v.to(torch.float8_e4m3fn)),
        "int_cache": dict(paged_kv_cache=cache.view(torch.int16), append_key=k.view(torch.int16),
                          append_value=v.view(torch.int16)),
        "bi_len": dict(batch_indices=bi[:-1]),
        "pos_len": dict(positions=torch.cat([pos, pos[:1]])),
        "bi_float": dict(batch_indices=bi.float()),
        "pos_int16": dict(positions=pos.to(torch.int16)),
        "indptr_float": dict(kv_indptr=valid["kv_indptr"].float()),
        "indices_2d": dict(kv_indices=valid["kv_indices"][None]),
        "last_len": dict(kv_last_page_len=valid["kv_last_page_len"][:1]),
        "layout": dict(kv_layout="NDH"),
        "cache_dim1": dict(paged_kv_cache=torch.cat([cache, cache[:, :1]], dim=1)),
        "cache_3d": dict(paged_kv_cache=cache[:, 0, 0]),
        "last_dim_strided": dict(
            paged_kv_cache=random_of((cache.shape[0], 2, 3, 8, 2), torch.float16).transpose(-1, -2)),
        "pos_beyond_pages": dict(positions=torch.where(torch.arange(nnz, device=pos.device) == 0, pos + 9, pos)),
        "pos_negative": dict(positions=torch.where(torch.arange(nnz, device=pos.device) == 0, -pos - 1, pos)),
        "batch_out_of_range": dict(batch_indices=torch.where(torch.arange(nnz, device=bi.device) == 0, bi + 5, bi)),
        "page_id_out_of_range": dict(kv_indices=valid["kv_indices"] + 100),
    }[case]
    if case in ("pos_beyond_pages", "pos_negative", "batch_out_of_range", "page_id_out_of_range") and ON_GPU:
        # value checks need the data on the host; on the GPU the kernel skips such tokens and reports them
        _call(valid, **over)
        with pytest.raises(ValueError, match=f"{match}: append_paged_kv_cache"):
            tritoninfer.check_errors()
        return
    with pytest.raises(ValueError, match=match):
        _call(valid, **over)


def test_append_cache_of_wrong_type(valid):
    with pytest.raises(TypeError, match="paged_kv_cache"):
        _call(valid, paged_kv_cache=[valid["paged_kv_cache"]])


def test_append_errors_leave_cache_untouched(valid):
    before = valid["paged_kv_cache"].clone()
    with pytest.raises(ValueError):
        _call(valid, positions=valid["positions"] + 100)
    assert torch.equal(valid["paged_kv_cache"], before)


def test_append_on_host_tensors_without_interpreter(valid, monkeypatch):
    if ON_GPU:
        pytest.skip("checks the CPU-tensor message")
    from tritoninfer import _device
    monkeypatch.setattr(_device, "is_interpreter", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _call(valid)


# ----------------------------------------------------------------------------------------------
# get_batch_indices_positions, get_seq_lens
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "appends,seq_after,nnz_extra,dtype",
    [
        ([3, 0, 5, 1], [7, 2, 5, 40], 0, torch.int32),
        ([0], [4], 0, torch.int32),
        ([300, 2], [310, 2], 0, torch.int64),  # a request longer than one kernel block (256)
        ([2, 3], [2, 9], 3, torch.int32),  # padded nnz: extra tokens are -1
        ([4, 4], [4, 9], -3, torch.int64),  # nnz shorter than the append: truncated
    ],
)
def test_batch_indices_positions(appends, seq_after, nnz_extra, dtype):
    append_indptr = torch.tensor([0] + torch.tensor(appends).cumsum(0).tolist(), dtype=dtype, device=DEVICE)
    seq_lens = torch.tensor(seq_after, dtype=dtype, device=DEVICE)
    nnz = sum(appends) + nnz_extra
    bi, pos = page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    rbi, rpos = ref.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    assert bi.dtype == torch.int32 and pos.dtype == torch.int32 and bi.shape == (nnz,) and pos.shape == (nnz,)
    assert torch.equal(bi, rbi) and torch.equal(pos, rpos)


def test_batch_indices_positions_formula_by_hand():
    append_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([10, 3, 3], dtype=torch.int32, device=DEVICE)
    bi, pos = page.get_batch_indices_positions(append_indptr, seq_lens, 5)
    assert bi.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [8, 9, 0, 1, 2]


def test_batch_indices_positions_empty_and_errors():
    bi, pos = page.get_batch_indices_positions(torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                               torch.zeros(2, dtype=torch.int32, device=DEVICE), 0)
    assert bi.shape == (0,) and pos.shape == (0,)
    ind = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_lens"):
        page.get_batch_indices_positions(ind, torch.ones(2, dtype=torch.int32, device=DEVICE), 1)
    with pytest.raises(ValueError, match="append_indptr"):
        page.get_batch_indices_positions(ind.float(), torch.ones(1, dtype=torch.int32, device=DEVICE), 1)
    with pytest.raises(ValueError, match="nnz"):
        page.get_batch_indices_positions(ind, torch.ones(1, dtype=torch.int32, device=DEVICE), -1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_get_seq_lens(dtype):
    kv_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=dtype, device=DEVICE)
    last = torch.tensor([2, 0, 16, 1], dtype=dtype, device=DEVICE)
    got = page.get_seq_lens(kv_indptr, last, 16)
    assert got.dtype == dtype
    assert got.tolist() == ref.get_seq_lens(kv_indptr, last, 16).tolist() == [34, 0, 16, 65]


# ----------------------------------------------------------------------------------------------
# API surface
# ----------------------------------------------------------------------------------------------

SIGNATURES = {
    "append_paged_kv_cache": "(append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor, "
    "positions: torch.Tensor, paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], "
    "kv_indices: torch.Tensor, kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, "
    "kv_layout: str = 'NHD') -> None",
    "get_batch_indices_positions": "(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int) "
    "-> Tuple[torch.Tensor, torch.Tensor]",
    "get_seq_lens": "(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor",
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_flashinfer(name):
    fn = getattr(page, name)
    assert str(inspect.signature(fn, eval_str=True)).replace("typing.", "") == SIGNATURES[name]
    assert name in page.__all__ and getattr(tritoninfer, name) is fn
    assert set(ref.page.__all__) >= {name}


# ----------------------------------------------------------------------------------------------
# GPU: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_append_realistic(layout, cache_dtype):
    """64 requests x 512 appended tokens onto prefixes of 0..1000 tokens, 8 heads x 128, page 16."""
    g = torch.Generator().manual_seed(1)
    lens_before = torch.randint(0, 1000, (64,), generator=g).tolist()
    batch = make_batch(lens_before, [512] * 64, 16, spare_pages=100)
    cache = make_cache("5d", layout, batch.num_pages, 16, 8, 128, 128, cache_dtype, False)
    before = cache.clone()
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    k = random_of((batch.nnz, 8, 128), torch.bfloat16)
    v = random_of((batch.nnz, 8, 128), torch.bfloat16)
    want = ref.append_paged_kv_cache(k, v, bi, pos, before, batch.kv_indices, batch.kv_indptr,
                                     batch.kv_last_page_len, layout)
    args = (k, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len, layout)
    page.append_paged_kv_cache(*args)  # compile first (appending twice is idempotent)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the call must not synchronise with the host
    try:
        page.append_paged_kv_cache(k, v, bi, pos, cache, batch.kv_indices, batch.kv_indptr,
                                   batch.kv_last_page_len, layout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_cache_equal(cache, want)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["tuple4", "tuple3"])
def test_gpu_append_tuple_forms_strided(form):
    ps = 16 if form == "tuple4" else 1
    g = torch.Generator().manual_seed(2)
    lens_before = torch.randint(0, 300, (32,), generator=g).tolist()
    appends = torch.randint(0, 200, (32,), generator=g).tolist()
    run_append_case(form, "HND", ps, torch.float16, True, lens_before, appends, H=8, D=128, Dv=64)


@pytest.mark.gpu
def test_gpu_append_bad_positions_are_masked_not_written():
    batch = make_batch([10, 20], [5, 5], 16, spare_pages=4)
    cache = make_cache("5d", "NHD", batch.num_pages, 16, 8, 128, 128, torch.bfloat16, False)
    before = cache.clone()
    bi, pos = page.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    k = random_of((batch.nnz, 8, 128), torch.bfloat16)
    v = random_of((batch.nnz, 8, 128), torch.bfloat16)
    bad_pos = pos.clone()
    bad_pos[0] = 10_000  # beyond the request's pages: skipped
    bad_bi = bi.clone()
    bad_bi[1] = 7  # no such request: skipped
    page.append_paged_kv_cache(k, v, bad_bi, bad_pos, cache, batch.kv_indices, batch.kv_indptr, batch.kv_last_page_len)
    with pytest.raises(ValueError, match="(positions|batch_indices): append_paged_kv_cache"):
        tritoninfer.check_errors()  # both tokens are reported; one record holds one of them
    keep = torch.ones(batch.nnz, dtype=torch.bool, device=DEVICE)
    keep[:2] = False
    want = ref.append_paged_kv_cache(k[keep], v[keep], bi[keep], pos[keep], before, batch.kv_indices,
                                     batch.kv_indptr, batch.kv_last_page_len)
    assert_cache_equal(cache, want)


@pytest.mark.gpu
def test_gpu_batch_indices_positions_large_no_sync():
    g = torch.Generator().manual_seed(3)
    appends = torch.randint(0, 2000, (300,), generator=g)
    appends[::17] = 0
    seq_after = appends + torch.randint(0, 5000, (300,), generator=g)
    append_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), appends.cumsum(0)]).int().cuda()
    seq_lens = seq_after.int().cuda()
    nnz = int(appends.sum())
    page.get_batch_indices_positions(append_indptr, seq_lens, nnz)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        bi, pos = page.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rbi, rpos = ref.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    assert torch.equal(bi, rbi) and torch.equal(pos, rpos)
