"""Host-side planning (``tritoninfer._plan``): split-KV choice, work lists, workspace fitting.
Pure numpy; expected values are worked out by hand in the comments."""

import numpy as np
import pytest

from tritoninfer import _plan


def chunk(kv_lens, heads=8, sms=132, block_n=128, page=16, fixed=None, disable=False, per_sm=2, q_tiles=None):
    kv = np.asarray(kv_lens, np.int64)
    tiles = np.ones(kv.size, np.int64) if q_tiles is None else np.asarray(q_tiles, np.int64)
    return _plan.kv_split_chunk(kv, tiles, heads, sms, block_n, page, fixed, disable, per_sm)


def test_split_fills_the_last_wave():
    # 64 x 4096 x 8 heads = 512 programs. On 3 x 132 = 396 slots that is 1.29 waves, i.e. two
    # full-length waves (8192 positions of time); cut in thirds (1792 positions, 1536 programs)
    # it is four waves of a third: 4 * 4096/3 = 5461 (+ a merge), the best candidate.
    assert chunk([4096] * 64, per_sm=3) == 1792
    # On 2 x 132 = 264 slots the 512 programs already make two nearly full waves: no split.
    assert chunk([4096] * 64, per_sm=2) is None


def test_small_batch_splits_to_fill_the_gpu():
    # 1 x 4096 x 8 heads: 8 programs for 264 slots. The smallest chunk (2 tiles = 256 positions)
    # gives 128 programs, one wave of 256 positions.
    assert chunk([4096]) == 256


def test_uneven_batch_cuts_the_long_request():
    # One 32768-token request among 63 of 100 tokens: unsplit, the long one takes 32768 positions
    # of time. Chunk 1280 (one wave's share of the work, rounded to tiles) bounds it.
    c = chunk([32768] + [100] * 63)
    assert c == 1280
    work = _plan.build_work(np.ones(64, np.int64), np.array([32768] + [100] * 63), 1, c)
    assert (work.work[:, 0] == 0).sum() == 26 and (work.work[:, 0] > 0).sum() == 63


def test_fixed_and_disabled_splits():
    assert chunk([4096] * 64, fixed=4) == 64  # pages -> positions
    assert chunk([60, 64], fixed=4) is None  # every request fits in one chunk
    assert chunk([4096], fixed=-1) == 256  # FlashInfer's -1: no fixed split, plan as usual
    assert chunk([4096], disable=True) is None
    assert chunk([], heads=8) is None
    assert chunk([0, 0]) is None


def covered(work, kv_lens, q_lens, tile_tokens):
    """Every (request, query tile) covers [0, kv_len) exactly once, with consistent split fields."""
    for r, (kv, ql) in enumerate(zip(kv_lens, q_lens)):
        rows = work.work[work.work[:, 0] == r]
        tiles = sorted(set(rows[:, 1].tolist()))
        assert tiles == list(range(0, ql, tile_tokens))
        for t in tiles:
            items = rows[rows[:, 1] == t]
            items = items[np.argsort(items[:, 4])]
            assert items[:, 4].tolist() == list(range(len(items)))
            assert (items[:, 5] == len(items)).all()
            assert items[0, 2] == 0 and items[-1, 3] == kv
            assert (items[1:, 2] == items[:-1, 3]).all()


def test_build_work_without_splits_is_one_item_per_request():
    q_lens, kv_lens = np.array([1, 1, 0, 1]), np.array([5, 0, 7, 9])
    work = _plan.build_work(q_lens, kv_lens, 1, None)
    assert work.work[:, 0].tolist() == [0, 1, 3]  # no query rows, no item
    assert not work.has_splits and work.num_states == 0
    covered(work, kv_lens, q_lens, 1)


def test_build_work_with_splits_and_query_tiles():
    q_lens, kv_lens = np.array([3, 1, 5]), np.array([10, 4, 25])
    work = _plan.build_work(q_lens, kv_lens, 2, 8)
    covered(work, kv_lens, q_lens, 2)
    # splits per request: ceil(kv/8) = 2, 1, 4; partial states q_len * splits where split
    assert work.has_splits and work.num_states == 3 * 2 + 5 * 4
    assert work.state_offset.tolist() == [0, 6, 6]


def test_build_work_caps_splits():
    work = _plan.build_work(np.array([1, 1]), np.array([100, 30]), 1, 10, max_splits=3)
    covered(work, [100, 30], [1, 1], 1)
    assert work.work[work.work[:, 0] == 0, 5].tolist() == [3, 3, 3]
    assert work.work[work.work[:, 0] == 0, 3].tolist() == [34, 68, 100]


def test_fit_work_coarsens_automatic_splits_and_rejects_fixed_ones():
    q_lens, kv_lens = np.ones(4, np.int64), np.full(4, 64, np.int64)
    per_state = _plan.state_bytes(1, 8, 128)
    # chunk 8 -> 8 splits x 4 requests = 32 states; room for 8 states -> chunk 32 (2 splits each)
    work = _plan.fit_work(q_lens, kv_lens, 1, 8, 8 * per_state, 8, 128, fixed=False)
    assert work.num_states == 8 and (work.work[:, 5] == 2).all()
    # room for nothing: no split at all
    assert not _plan.fit_work(q_lens, kv_lens, 1, 8, 0, 8, 128, fixed=False).has_splits
    with pytest.raises(ValueError, match="fixed_split_size"):
        _plan.fit_work(q_lens, kv_lens, 1, 8, 8 * per_state, 8, 128, fixed=True)


def test_heaviest_first_orders_items_by_the_kv_they_read():
    """Causal: a query tile reads KV up to its last row's diagonal; the order keeps every item."""
    q_lens, kv_lens = np.array([8, 2]), np.array([8, 10])
    plan = _plan.build_work(q_lens, kv_lens, 4, None)  # request 0: tiles at 0 and 4; request 1: one tile
    ordered = _plan.heaviest_first(plan, q_lens, kv_lens, 4, causal=True)
    reads = {(0, 0): 4, (0, 4): 8, (1, 0): 10}
    assert [reads[(r, t)] for r, t in ordered.work[:, :2]] == [10, 8, 4]
    assert sorted(map(tuple, ordered.work)) == sorted(map(tuple, plan.work))
    # not causal: every tile of a request reads all of it; ties keep their order
    full = _plan.heaviest_first(plan, q_lens, kv_lens, 4, causal=False)
    assert full.work[:, 0].tolist() == [1, 0, 0] and full.work[1:, 1].tolist() == [0, 4]


def test_decode_tiles_take_the_lane_path_only_for_one_fp8_row(monkeypatch):
    """The dot-free path is for one query row per item over fp8 KV, and never when the scores need
    what it lacks (RoPE, ALiBi); every other decode keeps the dot tiles."""
    monkeypatch.setattr(_plan._device, "is_interpreter", lambda: False)
    lane = _plan.decode_tiles(1, 1, 128, 1, lanes_ok=True)
    assert lane.lanes > 0 and lane.block_m == 1 and lane.block_n % lane.lanes == 0
    assert _plan.decode_tiles(1, 1, 128, 1, lanes_ok=False).lanes == 0
    assert _plan.decode_tiles(1, 1, 128, 2, lanes_ok=True).lanes == 0  # 16-bit KV: wgmma tiles
    assert _plan.decode_tiles(4, 1, 128, 1, lanes_ok=True).lanes == 0  # a GQA group: dots
    assert _plan.decode_tiles(1, 2, 128, 1, lanes_ok=True).lanes == 0  # two rows (speculative decode)
    assert _plan.decode_tiles(1, 1, 256, 1, lanes_ok=True).lanes == 0


def test_decode_tiles_by_head_dim_for_one_token(monkeypatch):
    """16-bit decode of one token (16-row tiles) takes the session-25 tiles: 128-position KV-as-M tiles at
    head_dim 64, 32-position KV-as-M tiles with three stages and page ids ahead at 256. More rows (query
    tokens or a group above 16) and fp8 at 256 keep the former tiles, which those measurements did not cover."""
    monkeypatch.setattr(_plan._device, "is_interpreter", lambda: False)
    shape = lambda t: (t.block_m, t.block_n, t.num_stages, t.kv_as_m, t.prefetch_pages)  # noqa: E731
    assert shape(_plan.decode_tiles(4, 1, 64, 2)) == (16, 128, 3, True, True)
    assert shape(_plan.decode_tiles(1, 1, 64, 2)) == (16, 128, 3, True, True)  # a group of one
    assert shape(_plan.decode_tiles(4, 1, 128, 2)) == (16, 64, 3, True, True)
    assert shape(_plan.decode_tiles(8, 1, 256, 2)) == (16, 32, 3, True, True)
    assert shape(_plan.decode_tiles(4, 4, 64, 2)) == (16, 64, 3, True, True)  # four tokens
    assert shape(_plan.decode_tiles(32, 1, 64, 2)) == (32, 64, 3, True, True)
    assert shape(_plan.decode_tiles(4, 4, 256, 2)) == (16, 32, 2, False, False)
    assert shape(_plan.decode_tiles(32, 1, 256, 2)) == (32, 32, 2, False, False)
    assert shape(_plan.decode_tiles(4, 1, 256, 1)) == (16, 32, 2, False, False)  # fp8


def test_build_work_reuses_layouts_without_sharing_them():
    """Consecutive decode plans hit the remembered layout; the result equals a fresh computation and
    writing into one plan's work list cannot change the next plan's."""
    q_lens = np.ones(5, np.int64)
    kv_lens = np.array([700, 90, 1000, 5, 333])
    first = _plan.build_work(q_lens, kv_lens, 1, 128)
    first.work[:] = -7
    for step in range(1, 4):
        grown = kv_lens + step
        cached = _plan.build_work(q_lens, grown, 1, 128)
        _plan._LAYOUTS.clear()
        fresh = _plan.build_work(q_lens, grown, 1, 128)
        np.testing.assert_array_equal(cached.work, fresh.work)
        np.testing.assert_array_equal(cached.state_offset, fresh.state_offset)
        assert (cached.num_states, cached.has_splits) == (fresh.num_states, fresh.has_splits)
        assert (cached.work[:, 3] <= grown[cached.work[:, 0]]).all() and cached.work[:, 3].max() == grown.max()


def test_split_chunk_counts_the_merge_of_wide_states(monkeypatch):
    """MLA's [64, 512] float32 partial states cost a merging program ~26 latent positions each
    (``mla.merge_positions``): merged by one program (the fused merge), one 8K request at 128 heads
    (2 row blocks, one program an SM) takes 16 splits, where the one-tile merge estimate fills the 132
    SMs with 64; with the merge pass (16 programs share a merge's columns) it keeps the 64."""
    import torch

    from tritoninfer import mla

    kv, q_tiles = np.array([8192]), np.array([1])
    monkeypatch.setattr(mla, "_MERGE_PASS", False)
    fused = mla.merge_positions(64, 512, 64, torch.bfloat16)
    monkeypatch.setattr(mla, "_MERGE_PASS", True)
    shared = mla.merge_positions(64, 512, 64, torch.bfloat16)
    assert (fused, shared) == (26, 2)
    splits = {}
    for name, cost in (("plain", 0), ("fused", fused), ("shared", shared)):
        chunk = _plan.kv_split_chunk(kv, q_tiles, 2, 132, 32, 64, None, False, programs_per_sm=1, merge_positions=cost)
        splits[name] = -(-8192 // chunk)
    assert splits == {"plain": 64, "fused": 16, "shared": 64}
    # a batch that fills the SMs without splits keeps none either way
    many = np.full(64, 8192)
    assert _plan.kv_split_chunk(many, np.ones(64, np.int64), 2, 132, 32, 64, None, False, programs_per_sm=1,
                                merge_positions=fused) is None


def test_build_work_capped_splits_start_on_aligned_positions():
    """A chunk grown by the CUDA-graph cap is a multiple of ``align`` (the Gluon MLA kernel's boxes
    must not cross a page), and requests under the cap keep the planned chunk."""
    kv_lens = np.array([9000, 12, 700, 3000, 100])
    work = _plan.build_work(np.ones(5, np.int64), kv_lens, 1, 48, max_splits=16, align=32)
    covered(work, kv_lens.tolist(), [1] * 5, 1)
    w = work.work
    assert (w[:, 5] <= 16).all()
    assert (w[np.isin(w[:, 0], [0, 3]), 2] % 32 == 0).all()
    assert w[w[:, 0] == 2, 3].tolist()[:2] == [48, 96]  # 15 splits of 48: under the cap


@pytest.mark.parametrize("chunk_size", [None, 6])
def test_build_work_of_decode_covers_every_request(chunk_size):
    """Decode (``q_lens`` None: one query row a request) with and without splits, empty requests included."""
    kv_lens = np.array([5, 0, 13, 9, 1])
    work = _plan.build_work(None, kv_lens, 1, chunk_size)
    covered(work, kv_lens, [1] * kv_lens.size, 1)
    assert work.work[:, 1].tolist() == [0] * work.work.shape[0]


def _table(indptr, last, indices_len=None, page=4):
    import torch

    from tritoninfer._kvcache import host_page_table

    indptr = torch.tensor(indptr, dtype=torch.int32)
    n = int(indptr[-1]) if indices_len is None else indices_len
    return host_page_table(indptr, torch.tensor(last, dtype=torch.int32), torch.arange(n, dtype=torch.int32), page)


def test_host_page_table_lengths_match_the_definition():
    """kv_len = (pages - 1) * page_size + last_page_len, 0 for a request without pages (whatever its
    last_page_len holds); an indptr may start past 0 (a slice of a larger table)."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        pages = rng.integers(0, 5, size=rng.integers(1, 9))
        start = int(rng.integers(0, 3))
        indptr = [start, *(start + np.cumsum(pages))]
        last = [int(rng.integers(1, 5)) if p else int(rng.integers(0, 9)) for p in pages]
        table = _table(indptr, last)
        assert table.kv_lens.tolist() == [(p - 1) * 4 + lp if p else 0 for p, lp in zip(pages, last)]
        assert table.num_pages_used == indptr[-1]
        if indptr[-1] > start:
            assert table.max_page_id == indptr[-1] - 1  # (the ids are 0..n-1: the checked ones are the used slice)


@pytest.mark.parametrize("indptr, last, indices_len, message", [
    ([0, 2, 3], [0, 1], None, r"last_page_len: request 0 has 0, expected 1\.\.page_size \(4\)"),
    ([0, 2, 3], [4, 5], None, r"last_page_len: request 1 has 5"),
    ([0, 0, 3], [9, 5], None, r"last_page_len: request 1 has 5"),  # (request 0 has no pages: anything goes)
    ([0, 3, 2], [1, 1], None, "indptr: expected a non-decreasing array"),
    ([-1, 2], [1], None, "indptr: expected a non-decreasing array"),
    ([0, 2, 3], [1, 1], 2, r"indices: indptr\[-1\] is 3 but indices has only 2 elements"),
    ([0, 2], [1, 1], None, r"last_page_len: expected 1 elements \(batch_size\), got 2"),
])
def test_host_page_table_refuses_bad_tables(indptr, last, indices_len, message):
    with pytest.raises(ValueError, match=message):
        _table(indptr, last, indices_len)


def _split_by_every_candidate(kv_lens, q_tiles, heads, sms, block_n, per_sm, merge_positions):
    """``kv_split_chunk``'s choice made the plain way: every candidate, in order, tried in full."""
    slots = per_sm * sms
    kv = np.asarray(kv_lens, np.int64)
    pairs = (np.ones(kv.size, np.int64) if q_tiles is None else np.asarray(q_tiles, np.int64)) * heads
    total, all_pairs, longest = int((kv * pairs).sum()), int(pairs.sum()), int(kv.max())
    if total == 0:
        return None
    equal = total == longest * all_pairs
    best, best_time = None, max(longest, -(-all_pairs // slots) * total / all_pairs)
    chunks = [max(2 * block_n, -(-total // (waves * slots))) for waves in range(1, 9)]
    chunks += [-(-longest // pieces) for pieces in (2, 4, 8, 16, 32, 64)] if merge_positions else []
    for c in chunks:
        c = -(-c // block_n) * block_n
        if c >= longest:
            continue
        items = all_pairs * -(-longest // c) if equal else -(-total // c) + all_pairs
        merge = -(-longest // c) * merge_positions if merge_positions else block_n
        t = max(c, -(-items // slots) * total / items) + merge
        if t < best_time * 0.97:
            best, best_time = c, t
    return best


def test_split_choice_skips_only_candidates_that_cannot_win():
    """The pruned search (waves that cannot cut skipped, repeated candidates tried once) picks what trying
    every candidate picks, over random batches of equal and unequal lengths."""
    rng = np.random.default_rng(1)
    for trial in range(1500):
        b = int(rng.integers(1, 300))
        kv = rng.integers(0, 40000, size=b) if trial % 2 else np.full(b, int(rng.integers(1, 40000)))
        q_tiles = None if trial % 3 else rng.integers(1, 4, size=b)
        heads, block_n, per_sm = int(rng.integers(1, 9)), int(rng.choice([32, 64, 128])), int(rng.integers(1, 4))
        for merge in (0, 114):
            expected = _split_by_every_candidate(kv, q_tiles, heads, 132, block_n, per_sm, merge)
            got = _plan.kv_split_chunk(kv.astype(np.int64), q_tiles, heads, 132, block_n, 16, None, False, per_sm, merge)
            assert got == expected, (trial, merge)
