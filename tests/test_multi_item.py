"""Multi-item scoring in the prefill wrappers (``prefix_len_ptr``, ``token_pos_in_items_ptr``,
``token_pos_in_items_len``, ``max_item_len_ptr``) against the reference's dense mask: paged and
ragged, several requests with their own prefixes and items, queries that start in the prefix or
inside the items, GPU tile choices (mask-free tiles, skipped KV ranges), split KV, and bad inputs."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import DEVICE

from tritoninfer import _attention, _plan, reference, testing
from tritoninfer._route import PREFILL
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper


def item_positions(items, n):
    """FlashInfer's token positions within items for ``n`` tokens after the prefix: each item a
    delimiter (0) then its tokens 1..len, a closing delimiter, zero-padded to ``n``."""
    pos = []
    for length in items:
        pos += [0] + list(range(1, length + 1))
    pos.append(0)
    assert len(pos) <= n, (items, n)
    return pos + [0] * (n - len(pos))


@dataclasses.dataclass
class Case:
    qo_lens: tuple
    kv_lens: tuple
    prefix: tuple
    items: tuple  # per request: its item lengths
    pad: int = 3  # token_pos_in_items_len beyond the longest request's
    page_size: int = 4
    heads: tuple = (4, 2)
    head_dim: int = 32
    dtype: torch.dtype = torch.float16
    causal: bool = True
    pos: str = "NONE"
    window: int = -1
    soft_cap: float = None
    split: str = "auto"
    gpu_tiles: bool = False  # the GPU's tile choices, run by the interpreter

    def id(self):
        return (f"q{list(self.qo_lens)}-kv{list(self.kv_lens)}-pre{list(self.prefix)}-p{self.page_size}-"
                f"h{self.heads[0]}/{self.heads[1]}-{str(self.dtype)[6:]}-c{int(self.causal)}-{self.pos}-"
                f"w{self.window}-cap{self.soft_cap}-{self.split}-gpu{int(self.gpu_tiles)}")


def _args(case, device=DEVICE):
    """The four plan arguments, in FlashInfer's dtypes (uint32, uint16, int, uint16)."""
    n = [max(kv - p, 0) for kv, p in zip(case.kv_lens, case.prefix)]
    length = max(n) + case.pad
    pos = [item_positions(items, length) for items in case.items]
    flat = torch.tensor(sum(pos, []), dtype=torch.int32)
    return dict(
        prefix_len_ptr=torch.tensor(case.prefix, dtype=torch.int64).to(torch.uint32).to(device),
        token_pos_in_items_ptr=flat.to(torch.uint16).to(device),
        token_pos_in_items_len=length,
        max_item_len_ptr=torch.tensor([max(i, default=0) for i in case.items], dtype=torch.int32)
        .to(torch.uint16).to(device),
    )


def _opts(case):
    opts = dict(causal=case.causal, pos_encoding_mode=case.pos, window_left=case.window,
                logits_soft_cap=case.soft_cap)
    if case.split == "fixed":
        opts["fixed_split_size"] = 2
    elif case.split == "disable":
        opts["disable_split_kv"] = True
    return opts


def _ref_opts(case):
    return dict(pos_encoding_mode=case.pos, window_left=case.window, logits_soft_cap=case.soft_cap)


CASES = [
    # the query is every token after the prefix (FlashInfer's tests: kv_len - qo_len == prefix)
    Case((37,), (54,), (17,), ((16, 18),), page_size=5),
    # three requests: queries starting inside the items, in the prefix, and a prefix-only request
    Case((9, 14, 3), (30, 20, 6), (10, 9, 8), ((3, 5, 2, 4), (2, 3, 2), ()), heads=(8, 2)),
    # no prefix; an empty query; one token per item; GQA group of 1; not causal (the mode is)
    Case((12, 0, 5), (12, 7, 9), (0, 3, 2), ((1, 1, 1, 2, 1), (2,), (2, 2)), heads=(2, 2), causal=False,
         page_size=1),
    # RoPE, soft cap, window, bf16
    Case((20, 11), (26, 40), (6, 25), ((4, 7, 2, 2), (5, 4, 2)), pos="ROPE_LLAMA", soft_cap=5.0, window=12,
         dtype=torch.bfloat16, page_size=3),
    # split KV
    Case((6, 30), (70, 90), (40, 50), ((6, 9, 2, 5, 2), (7, 12, 10, 5)), heads=(4, 1), split="fixed"),
    # the GPU's 128-row tiles (mask-free prefix tiles, 64-key tiles skipped between prefix and items)
    Case((200, 70), (300, 170), (100, 100), ((20, 30, 7, 50, 11, 40, 18, 12), (9, 25, 30)), heads=(4, 1),
         gpu_tiles=True),
    Case((48, 33), (160, 96), (90, 40), ((4, 6, 20, 3, 30), (17, 20, 10, 4)), heads=(8, 2), gpu_tiles=True,
         split="fixed", page_size=16),
]


def _gpu_tiles(case, monkeypatch):
    if case.gpu_tiles and DEVICE == "cpu":
        monkeypatch.setattr(_plan, "_device", SimpleNamespace(is_interpreter=lambda: False))


@pytest.mark.parametrize("case", CASES, ids=Case.id)
def test_paged_multi_item_matches_reference(case, monkeypatch, device=DEVICE):
    _gpu_tiles(case, monkeypatch)
    g = torch.Generator().manual_seed(1)
    q, qo_indptr = testing.random_qo(case.qo_lens, case.heads[0], case.head_dim, dtype=case.dtype, generator=g)
    q = q.to(device)
    kv = testing.make_paged_kv(case.kv_lens, case.page_size, case.heads[1], case.head_dim, dtype=case.dtype,
                               device=device, generator=g)
    args = _args(case, device)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, device))
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, case.heads[0], case.heads[1],
                 case.head_dim, case.page_size, q_data_type=case.dtype, **_opts(case), **args)
    assert wrapper._step.route.is_core
    if case.split == "fixed":
        assert wrapper._step.device_plan.has_splits
    o, lse = wrapper.run(q, kv.cache, return_lse=True)
    mask = reference.multi_item_mask(qo_indptr, case.kv_lens, args["prefix_len_ptr"], args["token_pos_in_items_ptr"],
                                     args["token_pos_in_items_len"])
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr.to(device), kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, custom_mask=mask,
        **_ref_opts(case))
    testing.assert_close(o, ref_o, case.dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.dtype)


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=Case.id)
def test_ragged_multi_item_matches_reference(case, monkeypatch, device=DEVICE):
    """FlashInfer 0.5.3's ragged wrapper takes the arguments but never applies them; tritoninfer does."""
    _gpu_tiles(case, monkeypatch)
    g = torch.Generator().manual_seed(2)
    q, qo_indptr = testing.random_qo(case.qo_lens, case.heads[0], case.head_dim, dtype=case.dtype, generator=g)
    q = q.to(device)
    k, kv_indptr = testing.make_ragged(case.kv_lens, case.heads[1], case.head_dim, dtype=case.dtype, device=device,
                                       generator=g)
    v, _ = testing.make_ragged(case.kv_lens, case.heads[1], case.head_dim, dtype=case.dtype, device=device,
                               generator=g)
    args = _args(case, device)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(8 << 20, device))
    wrapper.plan(qo_indptr, kv_indptr, case.heads[0], case.heads[1], case.head_dim, q_data_type=case.dtype,
                 **_opts(case), **args)
    o, lse = wrapper.run_return_lse(q, k, v)
    mask = reference.multi_item_mask(qo_indptr, case.kv_lens, args["prefix_len_ptr"], args["token_pos_in_items_ptr"],
                                     args["token_pos_in_items_len"])
    ref_o, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, custom_mask=mask,
                                                                  **_ref_opts(case))
    testing.assert_close(o, ref_o, case.dtype)
    testing.assert_lse_close(lse, ref_lse, dtype=case.dtype)


@pytest.mark.parametrize("gpu_tiles", [False, True])
def test_keys_no_row_sees_are_never_read(gpu_tiles, monkeypatch):
    """The KV range between the prefix and the queried item (other items, cached) is skipped, not
    masked: NaN there would reach the output through ``0 * NaN`` if any tile read it."""
    prefix, cached, item = 64, 320, 63
    kv_len = prefix + cached + 1 + item
    case = Case((item + 1,), (kv_len,), (prefix,), ((cached - 1, item),), heads=(4, 1), page_size=16,
                gpu_tiles=gpu_tiles)
    _gpu_tiles(case, monkeypatch)
    g = torch.Generator().manual_seed(3)
    q, qo_indptr = testing.random_qo(case.qo_lens, 4, 32, generator=g)
    k, kv_indptr = testing.make_ragged(case.kv_lens, 1, 32, generator=g)
    v, _ = testing.make_ragged(case.kv_lens, 1, 32, generator=g)
    args = _args(case)
    # the queried item's delimiter (at prefix + cached) sees only the prefix; no row sees the other item
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[prefix:prefix + cached + 1] = float("nan")
    v_nan[prefix:prefix + cached + 1] = float("nan")
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(8 << 20))
    # one KV range per query tile (no splits), so the tiles start at 0 and the 64-token prefix ends on
    # a tile boundary of every tile choice
    wrapper.plan(qo_indptr, kv_indptr, 4, 1, 32, q_data_type=torch.float16, causal=True, disable_split_kv=True,
                 **args)
    o, lse = wrapper.run_return_lse(q.to(DEVICE), k_nan.to(DEVICE), v_nan.to(DEVICE))
    mask = reference.multi_item_mask(qo_indptr, case.kv_lens, args["prefix_len_ptr"], args["token_pos_in_items_ptr"],
                                     args["token_pos_in_items_len"])
    ref_o, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, custom_mask=mask)
    testing.assert_close(o, ref_o, torch.float16)
    testing.assert_lse_close(lse, ref_lse, dtype=torch.float16)


def test_reference_mask_is_flashinfers_item_groups():
    """The reference's mask equals the one FlashInfer's test builds from the delimiters (items as
    groups of tokens after each delimiter, delimiters seen by no row, every row seeing the prefix)."""
    case = Case((40,), (55,), (15,), ((4, 9, 1, 12, 6, 3),))
    args = _args(case, "cpu")
    mask = reference.multi_item_mask(torch.tensor([0, 40]), [55], args["prefix_len_ptr"],
                                     args["token_pos_in_items_ptr"], args["token_pos_in_items_len"]).reshape(40, 55)
    is_delim = args["token_pos_in_items_ptr"][:40].to(torch.int32) == 0
    group = torch.cumsum(is_delim.to(torch.int64), 0)
    pos = torch.arange(40)
    within = (group[:, None] == group[None, :]) & (pos[None, :] <= pos[:, None])
    items = within & ~is_delim[None, :] & ~is_delim[:, None]
    expect = torch.cat([torch.ones(40, 15, dtype=torch.bool), items], 1)
    assert torch.equal(mask, expect)


def test_forward_keeps_multi_item_scoring():
    """The deprecated forward() replaces the scores but keeps the plan's multi-item mask."""
    case = CASES[1]
    g = torch.Generator().manual_seed(4)
    q, qo_indptr = testing.random_qo(case.qo_lens, 8, 32, generator=g)
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE, generator=g)
    args = _args(case)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(8 << 20, DEVICE))
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 32, 4, **args)
    o = wrapper.forward(q.to(DEVICE), kv.cache, causal=False, logits_soft_cap=4.0)
    mask = reference.multi_item_mask(qo_indptr, case.kv_lens, args["prefix_len_ptr"], args["token_pos_in_items_ptr"],
                                     args["token_pos_in_items_len"])
    ref_o, _ = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, custom_mask=mask,
        logits_soft_cap=4.0)
    testing.assert_close(o, ref_o, torch.float16)


def test_the_gluon_route_and_the_dot_free_tiles_refuse_it():
    params = dataclasses.replace(_attention.score_params("NONE", -1, None, None, None, None, 128, causal=True),
                                 multi_item=True)
    assert PREFILL.scores_unsupported(params) == "multi-item scoring"
    kw = dict(group=1, head_dim_qk=128, head_dim_vo=128, page_size=16, has_sinks=False, has_head_scales=False,
              write_lse=False, dot=None)
    lanes = _plan.decode_tiles(1, 1, 128, 1, lanes_ok=True)
    if lanes.lanes:
        with pytest.raises(ValueError, match="multi-item"):
            _attention.attention_variant(params, lanes, has_custom_mask=False, **kw)
    tiles = _plan.prefill_tiles(1, 128)
    with pytest.raises(ValueError, match="exclude each other"):
        _attention.attention_variant(params, tiles, has_custom_mask=True, **kw)
    variant = _attention.attention_variant(dataclasses.replace(params, causal=False), tiles, has_custom_mask=False,
                                           **kw)
    assert variant.multi_item and variant.is_causal and variant.kwargs()["MULTI_ITEM"]


def _plan_paged(**overrides):
    case = CASES[1]
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE)
    _, qo_indptr = testing.random_qo(case.qo_lens, 8, 32)
    args = {**_args(case, "cpu"), **overrides}
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 32, 4, **args)
    return wrapper


BAD = [
    (dict(prefix_len_ptr=torch.tensor([10, 9], dtype=torch.int32)), ValueError, "prefix_len_ptr: expected 3"),
    (dict(prefix_len_ptr=torch.tensor([10, -1, 8])), ValueError, "prefix_len_ptr: prefix lengths must be >= 0"),
    (dict(prefix_len_ptr=torch.tensor([10.0, 9.0, 8.0])), ValueError, "prefix_len_ptr: expected dtype"),
    (dict(max_item_len_ptr=torch.tensor([5, 4], dtype=torch.int16)), ValueError, "max_item_len_ptr: expected 3"),
    (dict(token_pos_in_items_len=19), ValueError, "token_pos_in_items_len: request 0 has 20 tokens"),
    (dict(token_pos_in_items_len=0), ValueError, "token_pos_in_items_len: expected a positive int"),
    (dict(token_pos_in_items_len=True), ValueError, "token_pos_in_items_len: expected a positive int"),
    (dict(token_pos_in_items_ptr=torch.zeros(2, 40, dtype=torch.int32)), ValueError,
     "token_pos_in_items_ptr: expected a 1-D tensor"),
    (dict(max_item_len_ptr=None), ValueError, "max_item_len_ptr: multi-item scoring needs"),
    (dict(prefix_len_ptr=None, token_pos_in_items_ptr=None, max_item_len_ptr=None), ValueError,
     "token_pos_in_items_len: given without"),
    (dict(custom_mask=torch.ones(9 * 30 + 14 * 20 + 3 * 6, dtype=torch.bool)), ValueError,
     "custom_mask: multi-item scoring"),
]


@pytest.mark.parametrize("overrides,error,message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, _, m) in
                                                              enumerate(BAD)])
def test_bad_arguments_are_named(overrides, error, message):
    with pytest.raises(error, match=message):
        _plan_paged(**overrides)


def test_short_token_positions_read_zeros():
    """A ``token_pos_in_items_ptr`` shorter than the last request's segment (FlashInfer's hopper tests
    pass one 4 entries short; FlashInfer reads past it) gives the output of the same tensor padded with
    zeros; a one-request batch may pass 0-d ``prefix_len_ptr`` / ``max_item_len_ptr``."""
    case = CASES[1]
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE)
    q, qo_indptr = testing.random_qo(case.qo_lens, 8, 32, device=DEVICE)
    args = _args(case, "cpu")
    full = args["token_pos_in_items_ptr"]
    # the last element any query reads: the end of the last segment with tokens after its prefix
    end = max(i * args["token_pos_in_items_len"] + kv - p for i, (kv, p) in enumerate(zip(case.kv_lens, case.prefix))
              if kv > p)
    padded = full.clone()
    padded[end - 3:] = 0
    assert (full[end - 3:end] != 0).any()
    outs = []
    for pos in (full[:end - 3], padded):
        wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 32, 4,
                     **{**args, "token_pos_in_items_ptr": pos})
        outs.append(wrapper.run(q, kv.cache))
    assert torch.equal(outs[0], outs[1])
    kv1 = testing.make_paged_kv(case.kv_lens[:1], 4, 2, 32, device=DEVICE)
    q1, qo1 = testing.random_qo(case.qo_lens[:1], 8, 32, device=DEVICE)
    one = dict(prefix_len_ptr=args["prefix_len_ptr"][0], token_pos_in_items_ptr=full[:args["token_pos_in_items_len"]],
               token_pos_in_items_len=args["token_pos_in_items_len"], max_item_len_ptr=args["max_item_len_ptr"][0])
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    wrapper.plan(qo1, kv1.kv_indptr, kv1.kv_indices, kv1.kv_last_page_len, 8, 2, 32, 4, **one)
    out0d = wrapper.run(q1, kv1.cache)
    wrapper.plan(qo1, kv1.kv_indptr, kv1.kv_indices, kv1.kv_last_page_len, 8, 2, 32, 4,
                 **{**one, "prefix_len_ptr": one["prefix_len_ptr"].reshape(1),
                    "max_item_len_ptr": one["max_item_len_ptr"].reshape(1)})
    assert torch.equal(out0d, wrapper.run(q1, kv1.cache))


def test_cuda_graph_mode_is_not_implemented():
    case = CASES[1]
    kv = testing.make_paged_kv(case.kv_lens, 4, 2, 32, device=DEVICE)
    _, qo_indptr = testing.random_qo(case.qo_lens, 8, 32)
    bufs = dict(qo_indptr_buf=torch.zeros(4, dtype=torch.int32, device=DEVICE),
                paged_kv_indptr_buf=torch.zeros(4, dtype=torch.int32, device=DEVICE),
                paged_kv_indices_buf=torch.zeros(64, dtype=torch.int32, device=DEVICE),
                paged_kv_last_page_len_buf=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE), use_cuda_graph=True, **bufs)
    with pytest.raises(NotImplementedError, match="multi-item scoring"):
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 32, 4, **_args(case))


# realistic shapes on the GPU: FlashInfer's two test cases (RoPE, soft cap, page sizes 1/5/16), and
# ranking batches (long shared prefixes, tens of items of 5-200 tokens, GQA 4, bf16, 16-token pages)
def _ranking_case(seed, batch, prefix_range, items_range, item_len_range, **kw):
    rng = np.random.default_rng(seed)
    prefix = tuple(int(rng.integers(*prefix_range)) for _ in range(batch))
    items = tuple(tuple(int(x) for x in rng.integers(*item_len_range, size=int(rng.integers(*items_range))))
                  for _ in range(batch))
    after = [sum(i) + len(i) + 1 for i in items]
    return Case(tuple(after), tuple(p + a for p, a in zip(prefix, after)), prefix, items, **kw)


GPU_CASES = [
    Case((37,), (54,), (17,), ((16, 18),), page_size=ps, heads=(hq, 4), head_dim=128, pos="ROPE_LLAMA",
         soft_cap=cap)
    for ps in (1, 5, 16) for hq in (4, 32) for cap in (None, 30.0)
] + [
    Case((81,), (97,), (16,), ((79,),), page_size=16, heads=(32, 4), head_dim=128, pos="ROPE_LLAMA"),
    _ranking_case(0, 4, (500, 3000), (20, 60), (5, 200), page_size=16, heads=(32, 8), head_dim=128,
                  dtype=torch.bfloat16),
    _ranking_case(1, 16, (100, 800), (5, 30), (3, 40), page_size=16, heads=(16, 4), head_dim=128),
    _ranking_case(2, 2, (4000, 8000), (100, 200), (20, 60), page_size=16, heads=(32, 8), head_dim=128,
                  dtype=torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=Case.id)
def test_gpu_paged_multi_item(case, monkeypatch):
    test_paged_multi_item_matches_reference(case, monkeypatch, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[-3:], ids=Case.id)
def test_gpu_ragged_multi_item(case, monkeypatch):
    test_ragged_multi_item_matches_reference(case, monkeypatch, device="cuda")
