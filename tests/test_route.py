"""The kernel route (``tritoninfer/_route.py``): every gate of the Gluon Hopper prefill, checked on the
CPU with the device checks forced; and what a plan stores (the route, its uploaded work list)."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import DEVICE

from tritoninfer import _attention, _hopper, _route, testing
from tritoninfer._kvcache import unpack_paged_kv_cache
from tritoninfer._options import TensorLayout
from tritoninfer.prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper


_REAL_WORK_TILES = _hopper.work_tiles


@pytest.fixture
def hopper_gpu(monkeypatch):
    """The device checks as on an H200 with Triton 3.6."""
    monkeypatch.setattr(_route._device, "has_gpu", lambda: True)
    monkeypatch.setattr(_route._device, "capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_hopper, "gluon_available", lambda: True)
    monkeypatch.setattr(_hopper, "work_tiles", lambda qo, kv, causal, tile=128: np.zeros((2, 1), np.int32))


@pytest.fixture
def hopper_plans(hopper_gpu, monkeypatch):
    """Wrappers on this machine's device planned as on an H200."""
    monkeypatch.setattr(_route, "is_sm90", lambda device: True)


def _facts(**change):
    params = _attention.score_params("NONE", -1, None, None, None, None, 128, causal=change.pop("causal", False))
    base = dict(device=torch.device("cuda", 0), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, head_dim_qk=128,
                head_dim_vo=128, layout=TensorLayout.NHD, use_cuda_graph=False, has_mask=False, params=params,
                qo_lens=np.array([1024, 1024]), kv_lens=np.array([1024, 1024]), page_size=0)
    mean = change.pop("mean", None)
    if mean is not None:
        base["qo_lens"] = np.array([mean, mean])
    score_change = change.pop("scores", None)
    if score_change:
        base["params"] = dataclasses.replace(params, **score_change)
    return _route.PlanFacts(**{**base, **change})


def test_route_takes_the_gluon_kernel_only_where_measured(hopper_gpu, monkeypatch):
    """sm_90, Triton 3.6, bf16, head_dim 128, NHD, no mask, no CUDA graph, plain scores, requests of
    1024 query tokens on average (causal: 4096; paged: 512 and 1024, pages of 8-128 dividing 128, or any
    page with ``_route.HOPPER_GATHER``, off here)."""
    monkeypatch.setattr(_route, "HOPPER_GATHER", False)
    at_plan = _route.PREFILL.at_plan
    assert at_plan(_facts()).kernel == "hopper"
    assert at_plan(_facts(causal=True, mean=4096)).kernel == "hopper"
    assert at_plan(_facts(page_size=16, mean=512)).kernel == "hopper"
    assert at_plan(_facts(page_size=16, causal=True)).kernel == "hopper"
    for change, reason in (
            ({"causal": True}, "below 4096"), ({"mean": 1000}, "below 1024"), ({"causal": True, "mean": 4000}, "below"),
            ({"page_size": 16, "mean": 500}, "below 512"), ({"page_size": 16, "causal": True, "mean": 1000}, "below"),
            ({"q_dtype": torch.float16, "kv_dtype": torch.float16}, "bf16"), ({"kv_dtype": torch.float8_e4m3fn}, "HOPPER_FP8 is off"),
            ({"head_dim_qk": 96, "head_dim_vo": 96}, "head_dim"), ({"head_dim_vo": 64}, "head_dim"),
            ({"layout": TensorLayout.HND}, "HND"), ({"use_cuda_graph": True}, "CUDA-graph"),
            ({"has_mask": True}, "mask"), ({"device": torch.device("cpu")}, "sm_90"),
            ({"page_size": 4}, "page size 4"), ({"page_size": 1}, "page size 1"), ({"page_size": 48}, "page size 48"),
            ({"page_size": 256}, "page size 256"), ({"kv_lens": np.array([60, 60])}, "TMA box"),
            ({"scores": {"logits_soft_cap": 5.0}}, "soft cap"), ({"scores": {"window_left": 3}}, "window"),
            ({"scores": {"rope": True}}, "RoPE"), ({"scores": {"alibi": True}}, "ALiBi"),
            ({"scores": {"sm_scale": -0.1}}, "not positive")):
        route = at_plan(_facts(**change))
        assert route.is_core and reason in route.reason, (change, route)
        assert repr(route).startswith("Route(core: ")


def test_route_gathers_pages_tma_cannot_box(hopper_gpu):
    """``_route.HOPPER_GATHER`` (on by default): paged plans whose pages TMA cannot box (page 1, SGLang's;
    4; 48) take the kernel's gathering producer; the other limits stay."""
    assert _route.HOPPER_GATHER
    for page in (1, 4, 48):
        assert _route.PREFILL.at_plan(_facts(page_size=page, mean=512)).kernel == "hopper"
    assert "below 512" in _route.PREFILL.at_plan(_facts(page_size=1, mean=500)).reason


def test_route_takes_e4m3_kv_when_switched_on(hopper_gpu, monkeypatch):
    """``_route.HOPPER_FP8``: e4m3 K/V with bf16 queries take the kernel's fp8 mode (contiguous or pages
    TMA boxes); other query dtypes, e5m2 and gathered pages stay on the core. At run, the fp8 mode
    takes the call's scales, the 16-bit one does not."""
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    monkeypatch.setattr(_route, "HOPPER_GATHER", True)
    fp8 = torch.float8_e4m3fn
    assert _route.PREFILL.at_plan(_facts(kv_dtype=fp8)).kernel == "hopper"
    assert _route.PREFILL.at_plan(_facts(kv_dtype=fp8, page_size=16, mean=512)).kernel == "hopper"
    for change, reason in (({"page_size": 1, "mean": 512}, "no gather"), ({"q_dtype": torch.float16}, "bf16"),
                           ({"kv_dtype": torch.float8_e5m2}, "bf16")):
        route = _route.PREFILL.at_plan(_facts(**{"kv_dtype": fp8, **change}))
        assert route.is_core and reason in route.reason, (change, route)
    route = _route.Route("hopper", "forced")
    q = torch.randn(256, 4, 128).to(torch.bfloat16)
    k8 = torch.randn(256, 2, 128).to(fp8)
    assert _route.PREFILL.at_run(route, q, (k8, k8), scaled=True, k_mult=0.5) is not None
    assert _route.PREFILL.at_run(route, q, (k8, k8), scaled=True, k_mult=-0.5) is None
    assert _route.PREFILL.at_run(route, q, (k8, k8), sinks=torch.zeros(4)) is None


def test_route_deepseek_dims_switch(hopper_gpu, monkeypatch):
    """``_route.HOPPER_192_128``: DeepSeek's non-absorbed prefill (head_dim_qk 192 / vo 128) takes the kernel
    over contiguous 16-bit K/V only; off, or paged, or e4m3, it stays on the core. At run, K is read in boxes
    of 64 columns (TMA boxes are powers of two: ``_hopper.qk_chunk``), V in boxes of its 128."""
    dims = {"head_dim_qk": 192, "head_dim_vo": 128}
    monkeypatch.setattr(_route, "HOPPER_192_128", False)
    assert "HOPPER_192_128" in _route.PREFILL.at_plan(_facts(**dims)).reason
    monkeypatch.setattr(_route, "HOPPER_192_128", True)
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    assert _route.PREFILL.at_plan(_facts(**dims)).kernel == "hopper"
    assert _route.PREFILL.at_plan(_facts(causal=True, mean=4096, **dims)).kernel == "hopper"
    for change in ({"page_size": 16, "mean": 512}, {"kv_dtype": torch.float8_e4m3fn}, {"head_dim_vo": 192},
                   {"head_dim_qk": 128, "head_dim_vo": 192}):
        route = _route.PREFILL.at_plan(_facts(**{**dims, **change}))
        assert route.is_core and "head_dim" in route.reason, (change, route)
    q = torch.randn(256, 4, 192).to(torch.bfloat16)
    k = torch.randn(256, 2, 192).to(torch.bfloat16)
    v = torch.randn(256, 2, 128).to(torch.bfloat16)
    boxes = _route.PREFILL.at_run(_route.Route("hopper", "forced"), q, (k, v))
    k_box, v_box = boxes.boxes
    assert (k_box.shape, k_box.block, v_box.shape, v_box.block) == ((256, 384), (128, 64), (256, 256), (128, 128))
    assert _hopper.kernel_config(False, 192)["QK_CHUNKS"] == 3 and _hopper.kernel_config(False)["QK_CHUNKS"] == 1


def test_route_head_dim_256_switch(hopper_gpu, monkeypatch):
    """``_route.HOPPER_D256``: head_dim 256 takes the kernel for 16-bit K/V with 64-position K/V stages, pages
    of 8 to 64 by TMA (128 no longer divides a stage: core unless gathered); off, or e4m3, it stays on the core."""
    dims = {"head_dim_qk": 256, "head_dim_vo": 256}
    monkeypatch.setattr(_route, "HOPPER_GATHER", False)
    monkeypatch.setattr(_route, "HOPPER_D256", False)
    assert "HOPPER_D256" in _route.PREFILL.at_plan(_facts(**dims)).reason
    monkeypatch.setattr(_route, "HOPPER_D256", True)
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    for page in (0, 16, 64):
        assert _route.PREFILL.at_plan(_facts(page_size=page, **dims)).kernel == "hopper", page
    assert "page size 128" in _route.PREFILL.at_plan(_facts(page_size=128, **dims)).reason
    assert "head_dim 256" in _route.PREFILL.at_plan(_facts(kv_dtype=torch.float8_e4m3fn, **dims)).reason
    assert (_hopper.kernel_config(False, 256)["BLOCK_N"], _hopper.kernel_config(False)["BLOCK_N"]) == (64, 128)
    q = torch.randn(256, 4, 256).to(torch.bfloat16)
    k = torch.randn(256, 2, 256).to(torch.bfloat16)
    k_box, v_box = _route.PREFILL.at_run(_route.Route("hopper", "forced"), q, (k, k)).boxes
    assert (k_box.block, v_box.block) == ((64, 256), (64, 256))


def test_route_head_dim_64_switch(hopper_gpu, monkeypatch):
    """``_route.HOPPER_D64``: head_dim 64 takes the kernel for 16-bit K/V (ragged or paged), with 192-token query
    tiles (three consumer warpgroups: ``_hopper.consumers``); off, or e4m3, it stays on the core."""
    monkeypatch.setattr(_hopper, "work_tiles", _REAL_WORK_TILES)
    dims = {"head_dim_qk": 64, "head_dim_vo": 64}
    monkeypatch.setattr(_route, "HOPPER_D64", False)
    assert "HOPPER_D64" in _route.PREFILL.at_plan(_facts(**dims)).reason
    monkeypatch.setattr(_route, "HOPPER_D64", True)
    monkeypatch.setattr(_route, "HOPPER_FP8", True)
    for change in ({}, {"page_size": 16, "mean": 512}):
        route = _route.PREFILL.at_plan(_facts(**dims, **change))
        assert route.kernel == "hopper", (change, route)
        # two requests of 1024 or 512 query tokens: 6 or 3 tiles of 192 each
        assert route.work.shape[1] == 2 * -(-int(_facts(**dims, **change).qo_lens[0]) // 192), route.work
    route = _route.PREFILL.at_plan(_facts(kv_dtype=torch.float8_e4m3fn, **dims))
    assert route.is_core and "head_dim 64" in route.reason
    config = _hopper.kernel_config(False, 64)
    assert (config["CONSUMERS"], _hopper.query_tile(64), _hopper.query_tile(128), _hopper.query_tile(64, fp8=True)) == (
        3, 192, 128, 128)
    # registers handed out per warpgroup: three consumers and the producer fill the register file exactly
    assert 16 * 32 * config["maxnreg"] == 3 * 128 * config["CONSUMER_REGS"] + 128 * config["PRODUCER_REGS"] == 65536


def test_route_off_hopper_or_other_triton(hopper_gpu, monkeypatch):
    monkeypatch.setattr(_hopper, "gluon_available", lambda: False)
    assert "Triton 3.6" in _route.PREFILL.at_plan(_facts()).reason
    monkeypatch.setattr(_hopper, "gluon_available", lambda: True)
    monkeypatch.setattr(_route._device, "capability", lambda device=None: (10, 0))
    assert _route.PREFILL.at_plan(_facts()).is_core
    monkeypatch.setattr(_route, "HOPPER_PREFILL", False)
    assert "TRITONINFER_HOPPER_PREFILL=0" in _route.PREFILL.at_plan(_facts()).reason


def test_route_forced_past_the_length_threshold(hopper_gpu, monkeypatch):
    """TRITONINFER_HOPPER_PREFILL=force: short requests take the Gluon kernel; what it cannot compute
    still takes the core."""
    short = dict(qo_lens=np.array([64, 64]), kv_lens=np.array([4096, 4096]))
    assert "below" in _route.PREFILL.at_plan(_facts(**short)).reason
    monkeypatch.setattr(_route, "HOPPER_FORCE", True)
    assert not _route.PREFILL.at_plan(_facts(**short)).is_core
    assert _route.PREFILL.at_plan(_facts(has_mask=True, **short)).is_core


def test_route_at_run(hopper_gpu):
    """At run, the call's tensors: sinks, scales and strides a TMA view cannot read take the core."""
    route = _route.Route("hopper", "forced")
    k = torch.randn(256, 2, 128).to(torch.bfloat16)
    q = torch.randn(256, 4, 128).to(torch.bfloat16)
    assert _route.PREFILL.at_run(route, q, (k, k)) is not None
    assert _route.PREFILL.at_run(route, q, (k, k), sinks=torch.zeros(4)) is None
    assert _route.PREFILL.at_run(route, q, (k, k), head_scales=(q, q, q)) is None
    assert _route.PREFILL.at_run(route, q, (k, k), scaled=True) is None
    padded_q = torch.randn(256, 4, 136).to(torch.bfloat16)[..., :128]
    assert _route.PREFILL.at_run(route, padded_q, (k, k)) is None  # q's heads not packed
    assert _route.PREFILL.at_run(route, q, (k.transpose(0, 1).contiguous().transpose(0, 1), k)) is None
    assert _route.PREFILL.at_run(_route.core("x"), q, (k, k)) is None


def test_plans_store_the_route_and_its_work_list(hopper_plans):
    """A ragged plan the route sends to the Gluon kernel uploads its work list; scores it cannot compute,
    or forward()'s replaced settings that it cannot compute, take the core."""
    qo_indptr = torch.tensor([0, 1100, 2300], dtype=torch.int32)
    wrapper = BatchPrefillWithRaggedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    # head_dim 64 would be refused: the fixture's facts check needs 128
    wrapper.plan(qo_indptr, qo_indptr, 4, 2, 128, q_data_type=torch.bfloat16)
    step = wrapper._step
    assert step.route.kernel == "hopper" and step.route_work is not None and tuple(step.route_work.shape) == (2, 1)
    # both rows 16-byte aligned whatever the tile count (Triton specialises the kernel's pointers on it)
    assert step.route_work[0].data_ptr() % 16 == 0 and step.route_work[1].data_ptr() % 16 == 0
    wrapper._override(False, "NONE", False, -1, None, None, None, None)
    assert wrapper._step.route.kernel == "hopper"
    wrapper._override(False, "NONE", False, -1, 30.0, None, None, None)
    assert wrapper._step.route.is_core and "soft cap" in wrapper._step.route.reason
    wrapper.plan(qo_indptr, qo_indptr, 4, 2, 128, q_data_type=torch.bfloat16, window_left=7)
    assert wrapper._step.route.is_core and wrapper._step.route_work is None


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("page_size,boxed", [(8, True), (16, True), (128, True), (4, False), (1, False), (48, False)])
def test_paged_plan_route(hopper_plans, monkeypatch, page_size, boxed, gather):
    """Past the device checks, a paged plan takes the kernel's paged mode for pages that tile its
    128-token KV tiles (TMA boxes) and, with ``_route.HOPPER_GATHER``, for any other page size; with the
    same work list as a ragged plan; the page table it reads is the plan's."""
    gluon = boxed or gather
    monkeypatch.setattr(_route, "HOPPER_GATHER", gather)
    monkeypatch.setattr(_hopper, "work_tiles", _REAL_WORK_TILES)
    monkeypatch.setattr(_route, "HOPPER_MIN_LEN", dict.fromkeys(_route.HOPPER_MIN_LEN, 0))
    qo_lens, kv_lens = (300, 0, 100), (300, 5, 1000)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    kv = testing.make_paged_kv(kv_lens, page_size, 2, 128, device=DEVICE, generator=torch.Generator().manual_seed(0))
    wrapper = BatchPrefillWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))
    for causal in (False, True):
        wrapper.plan(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 128, page_size,
                     causal=causal, q_data_type=torch.bfloat16)
        step = wrapper._step
        assert (step.route.kernel == "hopper") == gluon, step.route
        if gluon:
            expected = _hopper.work_tiles(np.array(qo_lens), np.array(kv_lens), causal)
            assert step.route_work.cpu().tolist() == expected.tolist()
            assert torch.equal(step.kv_indptr.cpu(), kv.kv_indptr.cpu().int())


def test_work_tiles_cover_every_query_tile_heaviest_first():
    """The Gluon kernel's work list: every 128-token query tile once, the tiles that read the most
    KV first (causal: up to their last row's diagonal, bottom-right aligned)."""
    tiles = _hopper.work_tiles(np.array([300, 0, 100]), np.array([300, 5, 1000]), causal=True)
    # request 0: tiles at 0, 128, 256 read 128, 256, 300 keys; request 2's one tile reads 1000
    assert tiles.tolist() == [[2, 0, 0, 0], [0, 256, 128, 0]]
    full = _hopper.work_tiles(np.array([300, 0, 100]), np.array([300, 5, 1000]), causal=False)
    assert full.tolist() == [[2, 0, 0, 0], [0, 0, 128, 256]]


def test_paged_descriptors():
    """The paged mode's TMA view of a cache: K and V pages as rows of [rows, H * D], page p from row
    p * rows_per_page (5-D: K and V pages alternate); caches that do not fit it (heads not packed,
    page strides that are not whole rows, K and V laid out differently) get None: the core."""
    from tritoninfer._kvcache import unpack_paged_kv_cache

    nhd = TensorLayout.NHD
    cache = torch.randn(5, 2, 16, 4, 64).to(torch.bfloat16)
    boxes = _hopper.paged_descriptors(unpack_paged_kv_cache(cache, nhd))
    (k_desc, v_desc), rows_per_page = boxes.boxes, boxes.rows_per_page
    assert rows_per_page == 32 and k_desc.shape == (4 * 32 + 16, 256) and k_desc.block == (16, 64)
    assert (boxes.page_size, boxes.num_pages) == (16, 5)
    assert k_desc.tensor.data_ptr() == cache.data_ptr() and v_desc.tensor.data_ptr() == cache[:, 1].data_ptr()
    assert k_desc.gluon().block_shape == [16, 64]
    k, v = torch.randn(2, 7, 8, 4, 64).to(torch.bfloat16).unbind(0)
    assert _hopper.paged_descriptors(unpack_paged_kv_cache((k, v), nhd))[1] == 8
    tokens = torch.randn(2, 30, 4, 64).to(torch.bfloat16)
    # page size 1: the kernel gathers its rows; the boxes (a 128-row tile) only give the stages' layout
    one = _hopper.paged_descriptors(unpack_paged_kv_cache((tokens[0], tokens[1]), nhd))
    assert (one.rows_per_page, one.page_size, one.num_pages) == (1, 1, 30)
    assert one.boxes[0].block == (_hopper.TILE, 64) and one.boxes[0].strides == (256, 1)
    assert _hopper.gather_pages(1) and _hopper.gather_pages(4) and _hopper.gather_pages(48)
    assert not _hopper.gather_pages(8) and not _hopper.gather_pages(0)
    padded = torch.randn(5, 2, 16, 4, 72).to(torch.bfloat16)[..., :64]
    heads_apart = torch.randn(5, 2, 4, 16, 64).to(torch.bfloat16).transpose(2, 3)
    mixed = (k, torch.randn(7, 8, 4, 64).to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1))
    for bad in (padded, heads_apart, mixed):
        assert _hopper.paged_descriptors(unpack_paged_kv_cache(bad, nhd)) is None


def test_attention_variant_rejects_what_the_kernel_cannot_run():
    """The kernel variant is built in one place, which refuses the dot-free single-row tiles with
    features that path lacks, and folds the scale only for plain scores."""
    from tritoninfer import _plan

    lanes = _plan.Tiles(1, 16, 1, 1, 1, 1, prefetch_pages=False, lanes=4)
    plain = _attention.score_params("NONE", -1, None, None, None, None, 64)
    kw = dict(group=1, head_dim_qk=64, head_dim_vo=64, page_size=16, has_custom_mask=False, has_sinks=False,
              has_head_scales=False, write_lse=True, dot=None)
    assert _attention.attention_variant(plain, lanes, **kw).lanes == 4
    for change, extra in (({"rope": True}, {}), ({"alibi": True}, {}), ({}, {"has_custom_mask": True}),
                          ({}, {"has_head_scales": True}), ({}, {"group": 2})):
        with pytest.raises(ValueError, match="dot-free single-row"):
            _attention.attention_variant(dataclasses.replace(plain, **change), lanes, **{**kw, **extra})
    folding = _plan.Tiles(128, 64, 8, 3, 32, 1, mask_free_tiles=True, fold_scale=True)
    assert _attention.attention_variant(plain, folding, **{**kw, "group": 4}).fold_scale
    capped = dataclasses.replace(plain, logits_soft_cap=5.0)
    variant = _attention.attention_variant(capped, folding, **{**kw, "group": 4})
    assert not variant.fold_scale and variant.kwargs()["FOLD_SCALE"] is False
    assert variant.unfolded() == variant


def test_block_sparse_plans_take_the_gluon_kernel_from_64_rows(hopper_gpu):
    """Block rows of 64 query rows (its requests; the last may be shorter) take the Gluon kernel
    (measured 2.1x the core there); a paged prefill of requests that short keeps the core; block rows
    of 32 keep it too."""
    facts = dict(page_size=64, qo_lens=np.array([64, 64]), kv_lens=np.array([4096, 4096]))
    assert "below 512" in _route.PREFILL.at_plan(_facts(**facts)).reason
    sparse_min = _route.BLOCK_SPARSE_MIN_LEN
    assert _route.PREFILL.at_plan(_facts(**facts, min_len=sparse_min)).kernel == "hopper"
    last_short = dict(facts, qo_lens=np.array([64, 64, 64, 32]), kv_lens=np.array([4096] * 4))
    assert _route.PREFILL.at_plan(_facts(**last_short, min_len=sparse_min)).kernel == "hopper"
    short = dict(facts, qo_lens=np.array([32, 32]))
    assert _route.PREFILL.at_plan(_facts(**short, min_len=sparse_min)).is_core


def test_block_sparse_wrapper_plans_with_the_block_sparse_threshold(hopper_plans):
    """BlockSparseAttentionWrapper asks the route with BLOCK_SPARSE_MIN_LEN: 64 x 64 blocks of bf16 at
    head_dim 128 go to the Gluon kernel, and the plan uploads its work list; other head_dims (measured for the
    prefill wrappers only) keep the core."""
    from tritoninfer.sparse import BlockSparseAttentionWrapper

    wrapper = BlockSparseAttentionWrapper(testing.make_workspace(4 << 20, DEVICE))
    # 4 block rows x 4 block columns of 64: every block kept
    indptr = torch.arange(0, 17, 4, dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32).repeat(4)
    wrapper.plan(indptr, indices, 256, 256, 64, 64, 4, 4, 128, q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
    step = wrapper._plan.step
    assert step.route.kernel == "hopper" and step.route_work is not None
    for head_dim in (64, 256):
        wrapper.plan(indptr, indices, 256, 256, 64, 64, 4, 4, head_dim, q_data_type=torch.bfloat16,
                     o_data_type=torch.bfloat16)
        route = wrapper._plan.step.route
        assert route.is_core and f"head_dim {head_dim}" in route.reason, route


def test_pod_prefill_half_takes_the_single_prefill_route(hopper_plans, monkeypatch):
    """PODWithPagedKVCacheWrapper's prefill half asks the route as a single prefill of its shape (a
    causal chunk of 4096 tokens takes the Gluon kernel and uploads its work list; a short one, an HND
    chunk or a mask keeps the pair launch); POD_PREFILL_ON_HOPPER off keeps every POD in one launch."""
    from tritoninfer.pod import PODWithPagedKVCacheWrapper

    causal4k = _facts(causal=True, qo_lens=np.array([4096]), kv_lens=np.array([4096]))
    assert _route.PREFILL.for_pod(causal4k).kernel == "hopper"
    assert _route.PREFILL.for_pod(dataclasses.replace(causal4k, qo_lens=np.array([1024]))).is_core
    assert _route.PREFILL.for_pod(dataclasses.replace(causal4k, layout=TensorLayout.HND)).is_core
    assert _route.PREFILL.for_pod(dataclasses.replace(causal4k, has_mask=True)).is_core
    monkeypatch.setattr(_route, "POD_PREFILL_ON_HOPPER", False)
    assert "POD_PREFILL_ON_HOPPER" in _route.PREFILL.for_pod(causal4k).reason
    monkeypatch.setattr(_route, "POD_PREFILL_ON_HOPPER", True)

    kv = testing.make_paged_kv([5, 9], 4, 2, 128, dtype=torch.bfloat16, device=DEVICE)
    pod = PODWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
    pod.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 4, 2, 128, 4, q_data_type=torch.bfloat16)
    params = _attention.score_params("NONE", -1, None, None, None, None, 128, causal=True)
    settings = pod._step_d.settings
    step = pod._prefill_step(4096, 4096, params, settings, torch.bfloat16, TensorLayout.NHD, False)
    assert step.route.kernel == "hopper" and tuple(step.route_work.shape) == (2, 1)
    assert pod._prefill_step(4096, 4096, params, settings, torch.bfloat16, TensorLayout.NHD, True).route.is_core
    assert pod._prefill_step(100, 4096, params, settings, torch.bfloat16, TensorLayout.NHD, False).route.is_core


def test_single_prefill_keeps_its_gluon_step(hopper_plans):
    """The single-request functions keep a step on the Gluon route as on the core (a model's layers
    plan once a step): the same shapes and route give the kept step, with its uploaded work list;
    the core route for the same shapes is another step."""
    from tritoninfer import _plan, _step

    _step._SINGLE_STEPS.clear()
    params = _attention.score_params("NONE", -1, None, None, None, None, 128, causal=True)
    settings = _step.Settings("NONE", -1, None, None, None, None, True)
    tiles = _plan.prefill_tiles(2, 128, 4096 * 2, 2)
    route = _route.PREFILL.at_plan(_facts(causal=True, device=torch.device(DEVICE), qo_lens=np.array([4096]),
                                          kv_lens=np.array([4096])))
    assert route.kernel == "hopper"
    kw = dict(settings=settings, params=params, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, num_qo_heads=4,
              num_kv_heads=2, head_dim_qk=128, head_dim_vo=128, qo_len=4096, kv_len=4096, tiles=tiles,
              q_len_per_req=0)
    first = _step.plan_single(torch.device(DEVICE), route=route, **kw)
    assert first.route_work is not None and _step.plan_single(torch.device(DEVICE), route=route, **kw) is first
    on_core = _step.plan_single(torch.device(DEVICE), route=_route.core("test"), **kw)
    assert on_core is not first and on_core.route.is_core


def test_mla_route_gates(hopper_gpu, monkeypatch):
    """The Gluon MLA kernel only when switched on (MLA_HOPPER), on sm_90, for 16-bit q and cache of one
    dtype, DeepSeek's 512 / 64 latent, pages that are powers of two from 8 and a positive scale; at run,
    q rows evenly spaced (SGLang's slices of one 576-wide query too) and caches of whole aligned rows."""
    cuda = torch.device("cuda", 0)
    ok = dict(device=cuda, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, head_dim_ckv=512, head_dim_kpe=64,
              page_size=64, sm_scale=0.07)
    monkeypatch.setattr(_route, "MLA_HOPPER", False)
    assert "MLA_HOPPER is off" in _route.MLA.at_plan(**ok).reason
    monkeypatch.setattr(_route, "MLA_HOPPER", True)
    assert _route.MLA.at_plan(**ok).kernel == "hopper"
    assert _route.MLA.at_plan(**{**ok, "page_size": 8}).kernel == "hopper"
    monkeypatch.setattr(_route, "MLA_HOPPER_GATHER", False)
    for change, reason in (({"kv_dtype": torch.float8_e4m3fn}, "16-bit"), ({"page_size": 1}, "page size 1"),
                           ({"page_size": 48}, "page size 48"), ({"head_dim_ckv": 256}, "latent dims"),
                           ({"sm_scale": 0.0}, "not positive"), ({"device": torch.device("cpu")}, "sm_90")):
        route = _route.MLA.at_plan(**{**ok, **change})
        assert route.is_core and reason in route.reason, (change, route)
    # pages TMA cannot box: gathered by the kernel's producer, when switched on (the default)
    monkeypatch.setattr(_route, "MLA_HOPPER_GATHER", True)
    for page in (1, 4, 48):
        route = _route.MLA.at_plan(**{**ok, "page_size": page})
        assert route.kernel == "hopper" and "gathered" in route.reason
    monkeypatch.setattr(_route, "MLA_HOPPER_GATHER", False)

    route = _route.MLA.at_plan(**ok)
    q = torch.zeros(3, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(5, 64, 576, dtype=torch.bfloat16)
    assert _route.MLA.at_run(route, q[..., :512], q[..., 512:], cache[..., :512], cache[..., 512:]) == ""
    packed = torch.zeros(3, 4, 512, dtype=torch.bfloat16)
    assert _route.MLA.at_run(route, packed, q[..., 512:], cache[..., :512], cache[..., 512:]) == ""
    heads_apart = torch.zeros(3, 5, 512, dtype=torch.bfloat16)[:, :4]
    assert "q_nope" in _route.MLA.at_run(route, heads_apart, q[..., 512:], cache[..., :512], cache[..., 512:])
    odd = torch.zeros(5, 64, 580, dtype=torch.bfloat16)
    assert "ckv_cache" in _route.MLA.at_run(route, packed, q[..., 512:], odd[..., :512], cache[..., 512:])
    assert _route.MLA.at_run(_route.core("x"), packed, q[..., 512:], cache[..., :512], cache[..., 512:]) == "x"


def test_mla_plan_on_the_gluon_route_uses_its_tiles(hopper_plans, monkeypatch):
    """An MLA plan the route sends to the Gluon kernel stores the route and plans with its tiles (64-row
    blocks, 32-position splits, also kernels/mla.py's 64-row tiles); off, the Triton kernel's own."""
    from tritoninfer import mla

    monkeypatch.setattr(_route, "MLA_HOPPER", True)
    wrapper = mla.BatchMLAPagedAttentionWrapper(testing.make_workspace(4 << 20, DEVICE))
    qo_indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    kv_len = torch.tensor([100, 190], dtype=torch.int32)
    indices = torch.arange(5, dtype=torch.int32)
    wrapper.plan(qo_indptr, kv_indptr, indices, kv_len, 128, 512, 64, 64, False, 0.07, torch.bfloat16, torch.bfloat16)
    step = wrapper._step
    assert step.route.kernel == "hopper" and step.tiles == mla.hopper_tiles(128, 1.0)
    assert (step.tiles.block_m, step.tiles.block_n, step.tiles.row_tiles) == (64, mla._HOPPER_BLOCK_N, 2)
    assert mla.hopper_tiles(16, 4.0).tile_tokens == 4 and mla.hopper_tiles(16, 1.0).row_tiles == 1
    monkeypatch.setattr(_route, "MLA_HOPPER", False)
    wrapper.plan(qo_indptr, kv_indptr, indices, kv_len, 128, 512, 64, 64, False, 0.07, torch.bfloat16, torch.bfloat16)
    assert wrapper._step.route.is_core


def test_batch_pod_prefill_half_route(hopper_plans, monkeypatch):
    """BatchPODWithPagedKVCacheWrapper asks the route for its paged prefill half as for a causal prefill
    (causal_p comes with run()): requests of 1,024+ query tokens on average take the Gluon kernel and
    upload its work list, shorter ones (or POD_PREFILL_ON_HOPPER off) keep the pair launch."""
    from tritoninfer.pod import BatchPODWithPagedKVCacheWrapper

    def plan(qo_len):
        kv = testing.make_paged_kv([qo_len, qo_len], 16, 2, 128, dtype=torch.bfloat16, device=DEVICE)
        kv_d = testing.make_paged_kv([40], 16, 2, 128, dtype=torch.bfloat16, device=DEVICE)
        pod = BatchPODWithPagedKVCacheWrapper(testing.make_workspace(1 << 20, DEVICE))
        pod.plan(torch.tensor([0, qo_len, 2 * qo_len], dtype=torch.int32), kv.kv_indptr, kv.kv_indices,
                 kv.kv_last_page_len, torch.tensor([0, 1], dtype=torch.int32), kv_d.kv_indptr, kv_d.kv_indices,
                 kv_d.kv_last_page_len, 4, 2, 128, 16, q_data_type=torch.bfloat16)
        return pod

    pod = plan(1024)
    assert pod._step_p.route.kernel == "hopper" and pod._step_p.route_work is not None
    assert pod._step_p_causal.route.kernel == "hopper" and pod._step_d.route.is_core
    assert "below 1024" in plan(600)._step_p.route.reason
    monkeypatch.setattr(_route, "POD_PREFILL_ON_HOPPER", False)
    assert plan(1024)._step_p.route.is_core


def _decode_at_plan(**change):
    params = _attention.score_params("NONE", -1, None, None, None, None, 128)
    score_change = change.pop("scores", None)
    if score_change:
        params = dataclasses.replace(params, **score_change)
    args = dict(device=torch.device("cuda", 0), q_dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, num_qo_heads=32,
                num_kv_heads=8, head_dim=128, page_size=16, params=params, use_cuda_graph=False, fixed_split_size=None,
                split_align=128)
    return _route.DECODE.at_plan(**{**args, **change})


def test_decode_route_gates(hopper_gpu, monkeypatch):
    """``_route.DECODE_HOPPER_FP8``: e4m3 paged decode with bf16/fp16 queries, head_dim 128, GQA groups of
    2 to 64, pages TMA boxes (8 to 128 dividing 128), eager plans with tile-aligned splits and plain
    scores take the Gluon fp8 decode; off, and everything else, the core."""
    assert "DECODE_HOPPER_FP8 is off" in _decode_at_plan().reason
    monkeypatch.setattr(_route, "DECODE_HOPPER_FP8", True)
    assert _decode_at_plan().kernel == "decode_hopper"
    for change in ({"q_dtype": torch.float16}, {"num_qo_heads": 16}, {"num_qo_heads": 512}, {"page_size": 8},
                   {"page_size": _hopper.DECODE_BLOCK_N}):
        assert _decode_at_plan(**change).kernel == "decode_hopper", change
    for change, reason in (
            ({"kv_dtype": torch.bfloat16}, "e4m3"), ({"kv_dtype": torch.float8_e5m2}, "e4m3"),
            ({"q_dtype": torch.float8_e4m3fn}, "16-bit"), ({"device": torch.device("cpu")}, "sm_90"),
            ({"head_dim": 64}, "head_dim 64"), ({"num_qo_heads": 8}, "group of 1"), ({"num_qo_heads": 1024}, "group of 128"),
            ({"page_size": 1}, "page size 1"), ({"page_size": 4}, "page size 4"), ({"page_size": 48}, "page size 48"),
            ({"page_size": 256}, "page size 256"), ({"page_size": 2 * _hopper.DECODE_BLOCK_N}, "page size"),
            ({"use_cuda_graph": True}, "CUDA-graph"), ({"fixed_split_size": 8}, "fixed_split_size"), ({"split_align": 8}, "start on a page"),
            ({"scores": {"logits_soft_cap": 5.0}}, "soft cap"), ({"scores": {"window_left": 3}}, "window"),
            ({"scores": {"rope": True}}, "RoPE"), ({"scores": {"alibi": True}}, "ALiBi"),
            ({"scores": {"sm_scale": -0.1}}, "not positive")):
        route = _decode_at_plan(**change)
        assert route.is_core and reason in route.reason, (change, route)
    monkeypatch.setattr(_hopper, "gluon_available", lambda: False)
    assert "Triton 3.6" in _decode_at_plan().reason


def test_decode_route_at_run(hopper_gpu):
    """At run: several query tokens a request, sinks, a scale product that is not positive, a q that is not
    contiguous, or a cache TMA cannot view take the core."""
    route = _route.Route("decode_hopper", "forced")
    kv = testing.make_paged_kv((40, 17), 16, 2, 128, device="cpu", generator=torch.Generator().manual_seed(0))
    cache = kv.cache.to(torch.float8_e4m3fn)
    pkv = unpack_paged_kv_cache(cache, TensorLayout.NHD)
    q = torch.randn(2, 8, 128).to(torch.bfloat16)
    assert _route.DECODE.at_run(route, q, pkv) is not None
    assert _route.DECODE.at_run(route, q, pkv, q_len_per_req=2) is None
    assert _route.DECODE.at_run(route, q, pkv, sinks=torch.zeros(8)) is None
    assert _route.DECODE.at_run(route, q, pkv, k_mult=0.0) is None
    assert _route.DECODE.at_run(route, q, unpack_paged_kv_cache(cache[:0], TensorLayout.NHD)) is None
    assert _route.DECODE.at_run(route, torch.randn(2, 8, 136).to(torch.bfloat16)[..., :128], pkv) is None
    hnd = unpack_paged_kv_cache(cache.transpose(2, 3).contiguous(), TensorLayout.HND)
    assert _route.DECODE.at_run(route, q, hnd) is None
    assert _route.DECODE.at_run(_route.core("x"), q, pkv) is None


def test_decode_plans_store_the_route(hopper_plans, monkeypatch):
    """A decode plan the route takes keeps its route (the run asks it again with the call's tensors); a
    CUDA-graph wrapper, a bf16 cache or forward()'s soft cap take the core."""
    from tritoninfer.decode import BatchDecodeWithPagedKVCacheWrapper

    monkeypatch.setattr(_route, "DECODE_HOPPER_FP8", True)
    kv = testing.make_paged_kv((40, 300), 16, 2, 128, device=DEVICE, generator=torch.Generator().manual_seed(0))
    wrapper = BatchDecodeWithPagedKVCacheWrapper(testing.make_workspace(4 << 20, DEVICE))

    def plan(kv_dtype):
        wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, 8, 2, 128, 16, q_data_type=torch.bfloat16,
                     kv_data_type=kv_dtype)
        return wrapper._step.route

    route = plan(torch.float8_e4m3fn)
    assert route.kernel == "decode_hopper", route
    assert plan(torch.bfloat16).is_core
    plan(torch.float8_e4m3fn)
    wrapper._override("NONE", -1, 30.0, None, None, None)
    assert wrapper._step.route.is_core and "soft cap" in wrapper._step.route.reason


def test_head_sections_from_head_dim_192(monkeypatch):
    """The Gluon prefill runs its items in head sections from head_dim_qk 192 (DeepSeek's 192 / 128, 256: faster
    on the H100, session 26) and in the plain order below (head_dim 128 was slower); the switch turns them off."""
    assert [_hopper.kernel_config(False, d)["HEAD_SECTIONS"] for d in (64, 128, 192, 256)] == [False, False, True, True]
    assert not _hopper.kernel_config(True, 128)["HEAD_SECTIONS"]
    monkeypatch.setattr(_hopper, "HEAD_SECTIONS", False)
    assert not any(_hopper.kernel_config(False, d)["HEAD_SECTIONS"] for d in (64, 128, 192, 256))


def test_section_heads_are_whole_groups_dividing_the_heads(monkeypatch):
    """``_hopper.section_heads``: the largest multiple of the GQA group that divides the query heads and is at
    most ``SECTION_HEADS``; never less than a group (a KV head's query heads stay in one section)."""
    monkeypatch.setattr(_hopper, "SECTION_HEADS", 8)
    assert _hopper.section_heads(128, 1) == 8  # DeepSeek's 128-head MHA prefill: 16 sections
    assert _hopper.section_heads(32, 4) == 8
    assert _hopper.section_heads(28, 7) == 7  # group 7: a section a KV head
    assert _hopper.section_heads(24, 1) == 8
    assert _hopper.section_heads(12, 1) == 6  # 8 does not divide 12
    assert _hopper.section_heads(64, 16) == 16  # a group above the target
    assert _hopper.section_heads(8, 8) == 8  # one section: the plain order
    for hq, group in ((128, 1), (32, 4), (28, 7), (12, 1), (64, 16), (40, 5)):
        n = _hopper.section_heads(hq, group)
        assert n % group == 0 and hq % n == 0
