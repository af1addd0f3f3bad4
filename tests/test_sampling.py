"""tritoninfer.sampling against tritoninfer.reference.sampling, on CPU through the interpreter.

Renorms, masks and softmax are compared value by value. Sampling is checked statistically: one
kernel call draws thousands of samples (outputs mapped onto a few distributions with ``indices``),
no sample may fall outside the reference's kept set, and the frequencies must pass a Pearson
chi-square test against the reference distribution at a 1e-6 false-alarm rate. The rows are built
so that a wrong filter moves a lot of mass: ties at the k-th largest entry, an entry that carries
the top-p mass across the threshold, an entry exactly at ``min_p * max``; top-k off by one or an
exclusive top-p makes a kept entry of probability >= 0.1 vanish (a chi-square term of thousands).
"""

import math

import pytest
import torch

import tritoninfer
from tritoninfer import reference, sampling
from tritoninfer.testing import assert_close

N_DRAWS = 2000  # per distribution


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def chi2_bound(df: int, z: float = 4.75) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 4.75 is a one-sided 1e-6 tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def check_frequencies(samples: torch.Tensor, dist: torch.Tensor, what: str = "") -> None:
    """``samples`` (int) drawn from ``dist`` (a probability vector): none outside its support, and a
    chi-square statistic (entries with an expected count below 5 pooled) under the 1e-6 bound."""
    samples = samples.long().cpu()
    dist = dist.double().cpu()
    n = samples.numel()
    counts = torch.bincount(samples, minlength=dist.numel()).double()
    assert counts.numel() == dist.numel(), f"{what}: a sample >= vocab_size"
    outside = (dist == 0) & (counts > 0)
    assert not outside.any(), f"{what}: samples outside the kept set at {outside.nonzero().flatten().tolist()}"
    expected = dist * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(1, obs.numel() - 1)
    assert stat < chi2_bound(df), f"{what}: chi-square {stat:.1f} over {df} dof (bound {chi2_bound(df):.1f})"


def draws(rows: int, per_row: int = N_DRAWS, device="cpu") -> torch.Tensor:
    """indices mapping ``rows * per_row`` outputs onto ``rows`` distributions."""
    return torch.arange(rows, device=device, dtype=torch.int32).repeat_interleave(per_row)


def check_rows(samples: torch.Tensor, dists: torch.Tensor, per_row: int = N_DRAWS, what: str = "") -> None:
    for r in range(dists.shape[0]):
        check_frequencies(samples[r * per_row:(r + 1) * per_row], dists[r], f"{what} row {r}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


def crafted_probs(vocab: int, device) -> torch.Tensor:
    """Three rows with most mass on a few entries spread through the vocabulary, the rest tiny:
    row 0: ties at 0.2 (top-k boundary), row 1: distinct values, row 2: a zero block."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.rand(3, vocab, generator=g) * 1e-3
    spots = torch.randperm(vocab, generator=g)[:5]
    x[0, spots] = torch.tensor([0.3, 0.2, 0.2, 0.2, 0.05])
    x[1, spots] = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.05])
    x[2, spots] = torch.tensor([0.4, 0.3, 0.12, 0.08, 0.02])
    x[2, torch.randperm(vocab, generator=g)[: vocab // 3]] = 0.0
    x[2, spots] = torch.tensor([0.4, 0.3, 0.12, 0.08, 0.02])
    return normalize(x).to(device)


@pytest.fixture
def tiles(monkeypatch, request):
    """Parametrise a test over whole-row tiles, 64-wide tiles (the multi-tile loops) and rows split
    into segments of 64 walked in tiles of 16 (the segmented searches: partial histograms combined
    across programs, the owner segment of a sample)."""
    if request.param == "tiles64":
        monkeypatch.setattr(sampling, "_INTERP_MAX_BLOCK", 64)
    elif request.param == "segs64":
        monkeypatch.setattr(sampling, "_INTERP_MAX_BLOCK", 16)
        monkeypatch.setattr(sampling, "_INTERP_MAX_SEGMENT", 64)
    elif request.param == "segs64x2":
        # two tiles a segment: the loops that load four tiles a step must not read the next segment
        monkeypatch.setattr(sampling, "_INTERP_MAX_BLOCK", 32)
        monkeypatch.setattr(sampling, "_INTERP_MAX_SEGMENT", 64)
    elif request.param == "whole_rows":
        # one program a whole row (the GPU's path for many short rows) from one row on, in chunks of 32
        # (the segmented renorm write made to fail)
        for name in ("_TOP_K_ROW_MIN_ROWS", "_SAMPLE_ROW_MIN_ROWS", "_SOFTMAX_ROW_MIN_ROWS"):
            monkeypatch.setattr(sampling, name, 1)
        monkeypatch.setattr(sampling, "_INTERP_WHOLE_ROWS", ",".join(sampling._WHOLE_ROW_KINDS))
        monkeypatch.setattr(sampling, "_SAMPLE_ROW_CHUNK", 32)
        monkeypatch.setattr(sampling, "_RENORM_WRITE", None)
    return request.param


TILES = pytest.mark.parametrize("tiles", ["one_tile", "tiles64", "segs64"], indirect=True)


# --------------------------------------------------------------------------------------------------
# the reference's own semantics
# --------------------------------------------------------------------------------------------------


def test_reference_boundaries():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    # top-p includes the entry that carries the mass across: 0.4 < 0.5 <= 0.4 + 0.3
    assert reference.top_p_keep_mask(p, 0.5).tolist() == [[False, True, False, True]]
    assert reference.top_p_keep_mask(p, 0.4).tolist() == [[False, True, False, False]]
    assert reference.top_p_keep_mask(p, 1.0).all()
    ties = torch.tensor([[0.3, 0.3, 0.3, 0.1]])
    # ties with the k-th largest are all kept
    assert reference.top_k_keep_mask(ties, 1).tolist() == [[True, True, True, False]]
    assert reference.top_k_keep_mask(ties, 4).all()
    # min-p is relative to the max and inclusive
    assert reference.min_p_keep_mask(p, 0.5).tolist() == [[False, True, True, True]]
    d = reference.top_k_top_p_sampling_distribution(p, 2, 0.5, "joint")
    assert torch.allclose(d, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    # top_k_first: top-p on the renormalised top-2 {0.4, 0.3}: 4/7 < 0.6, so both stay
    d = reference.top_k_top_p_sampling_distribution(p, 2, 0.6, "top_k_first")
    assert torch.allclose(d, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))
    d = reference.top_k_top_p_sampling_distribution(p, 3, 0.6, "joint")
    assert torch.allclose(d, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7]]))


# --------------------------------------------------------------------------------------------------
# renorm, mask, softmax
# --------------------------------------------------------------------------------------------------


TOP_K_TILES = pytest.mark.parametrize("tiles", ["one_tile", "tiles64", "segs64", "whole_rows"], indirect=True)


@TOP_K_TILES
@pytest.mark.parametrize("vocab", [8, 100, 300])
def test_top_k_renorm_probs(device, tiles, vocab):
    probs = crafted_probs(vocab, device)
    for k in (1, 2, 4, vocab - 1, vocab):
        out = sampling.top_k_renorm_probs(probs, k)
        assert out.dtype == torch.float32 and out.shape == probs.shape
        assert_close(out, reference.top_k_renorm_probs(probs, k), torch.float32, name=f"k={k}")
    k = torch.tensor([2, vocab, 1], device=device)
    assert_close(sampling.top_k_renorm_prob(probs, k), reference.top_k_renorm_probs(probs, k), torch.float32)


@TILES
@pytest.mark.parametrize("vocab", [8, 100, 300])
def test_top_p_renorm_probs(device, tiles, vocab):
    probs = crafted_probs(vocab, device)
    for p in (0.05, 0.3, 0.55, 0.7, 0.9, 1.0):
        out = sampling.top_p_renorm_probs(probs, p)
        assert out.dtype == torch.float32
        assert_close(out, reference.top_p_renorm_probs(probs, p), torch.float32, name=f"p={p}")
    p = torch.tensor([0.3, 1.0, 0.6], device=device)
    assert_close(sampling.top_p_renorm_prob(probs, p), reference.top_p_renorm_probs(probs, p), torch.float32)


@TOP_K_TILES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_top_k_mask_logits(device, tiles, dtype):
    logits = (torch.randn(4, 150, device=device) * 3).to(dtype)
    logits[1, :40] = float("-inf")
    logits[2, 10:20] = logits[2, 5]  # ties
    logits[3, :] = float("-inf")
    logits[3, 7] = 1.0
    for k in (1, 5, 11, 149, 150):
        out = sampling.top_k_mask_logits(logits, k)
        assert out.dtype == torch.float32
        assert torch.equal(out, reference.top_k_mask_logits(logits, k)), f"k={k}"
    k = torch.tensor([3, 200, 1, 2], device=device, dtype=torch.int64)
    assert torch.equal(sampling.top_k_mask_logits(logits, k), reference.top_k_mask_logits(logits, k))
    # softmax(mask) == top_k_renorm(softmax), FlashInfer's identity
    probs = torch.softmax(logits.float(), -1)
    assert_close(torch.softmax(sampling.top_k_mask_logits(logits, 5), -1),
                 sampling.top_k_renorm_probs(probs, 5), torch.float32)


@pytest.mark.parametrize("tiles", ["one_tile", "tiles64", "segs64", "segs64x2"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole_rows", [False, True], ids=["segmented", "whole-rows"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the all -inf row's NaN
def test_softmax(monkeypatch, device, tiles, dtype, whole_rows):
    """Both softmax paths (the segmented passes, and one program a whole row for many short rows),
    each with the other's launcher made to fail."""
    unused = "_SOFTMAX_PARTIAL" if whole_rows else "_SOFTMAX_ROW"
    monkeypatch.setattr(sampling, unused, None)
    monkeypatch.setattr(sampling, "_SOFTMAX_ROW_MIN_ROWS", 1 if whole_rows else 1 << 30)
    monkeypatch.setattr(sampling, "_INTERP_WHOLE_ROWS", ",".join(sampling._WHOLE_ROW_KINDS))
    logits = (torch.randn(5, 200, device=device) * 4).to(dtype)
    logits[0, ::3] = float("-inf")
    # a whole first segment of -inf (segs64: the combine must skip its empty partial)
    logits[2, :70] = float("-inf")
    for t in (None, 1.0, 0.5, 2.0):
        out = sampling.softmax(logits, t)
        assert out.dtype == torch.float32 and out.shape == logits.shape
        assert_close(out, reference.softmax(logits, t), torch.float32, name=f"t={t}")
    t = torch.tensor([0.3, 1.0, 2.0, 0.7, 5.0], device=device)
    assert_close(sampling.softmax(logits, temperature=t), reference.softmax(logits, t), torch.float32)
    # temperature 0 scales by 0 (FlashInfer): a uniform row where the logits are finite
    finite = logits[3:]
    assert_close(sampling.softmax(finite, 0.0), torch.full(finite.shape, 1 / 200, device=device), torch.float32)
    # a row of only -inf is NaN, as torch.softmax gives; its neighbours are untouched
    logits[1] = float("-inf")
    out = sampling.softmax(logits)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3, 4]]).all()


# --------------------------------------------------------------------------------------------------
# sampling: frequencies against the exact distributions
# --------------------------------------------------------------------------------------------------


@TILES
@pytest.mark.parametrize("vocab", [8, 300])
def test_sampling_from_probs_freq(device, tiles, vocab):
    probs = crafted_probs(vocab, device)
    samples = sampling.sampling_from_probs(probs, indices=draws(3, device=device))
    assert samples.dtype == torch.int32 and samples.shape == (3 * N_DRAWS,)
    check_rows(samples, reference.sampling_distribution(probs), what="sampling_from_probs")


@TILES
def test_sampling_from_logits_freq(device, tiles):
    logits = torch.randn(2, 120, device=device) * 2
    logits[1, ::2] = float("-inf")
    samples = sampling.sampling_from_logits(logits, indices=draws(2, device=device))
    check_rows(samples, torch.softmax(logits, -1), what="sampling_from_logits")


@TILES
@pytest.mark.parametrize("vocab", [8, 200])
def test_top_k_sampling_freq(device, tiles, vocab):
    probs = crafted_probs(vocab, device)
    # k=2 on row 0 falls inside the 0.2 ties: all three are kept
    for k in (2, 3, torch.tensor([2, 3, 4], device=device)):
        samples = sampling.top_k_sampling_from_probs(probs, k, indices=draws(3, device=device))
        check_rows(samples, reference.top_k_sampling_distribution(probs, k), what=f"top_k={k}")


@TILES
@pytest.mark.parametrize("vocab", [8, 200])
def test_top_p_sampling_freq(device, tiles, vocab):
    probs = crafted_probs(vocab, device)
    # 0.5 and 0.62 fall strictly inside an entry's crossing on every row (inclusive boundary)
    for p in (0.5, 0.62, torch.tensor([0.5, 0.62, 0.8], device=device)):
        samples = sampling.top_p_sampling_from_probs(probs, p, indices=draws(3, device=device))
        check_rows(samples, reference.top_p_sampling_distribution(probs, p), what=f"top_p={p}")


@TILES
def test_min_p_sampling_freq(device, tiles):
    # powers of two: min_p * max equals an entry exactly in float32, and min_p is inclusive
    g = torch.Generator().manual_seed(5)
    probs = torch.zeros(3, 100)
    for r, values in enumerate(([0.5, 0.25, 0.125, 0.0625, 0.0625], [0.25] * 4, [0.375, 0.25, 0.25, 0.125])):
        probs[r, torch.randperm(100, generator=g)[:len(values)]] = torch.tensor(values)
    probs = probs.to(device)
    min_p = torch.tensor([0.5, 1.0, 2 / 3], device=device)
    keep = reference.min_p_keep_mask(probs, min_p) & (probs > 0)
    assert keep.sum(1).tolist() == [2, 4, 3]
    for mp in (min_p, 0.25):
        samples = sampling.min_p_sampling_from_probs(probs, mp, indices=draws(3, device=device))
        check_rows(samples, reference.min_p_sampling_distribution(probs, mp), what=f"min_p={mp}")


@TILES
@pytest.mark.parametrize("order", ["joint", "top_k_first"])
def test_top_k_top_p_sampling_freq(device, tiles, order):
    probs = crafted_probs(100, device)
    k = torch.tensor([3, 4, 3], device=device)
    p = torch.tensor([0.5, 0.75, 0.8], device=device)
    dists = reference.top_k_top_p_sampling_distribution(probs, k, p, order)
    # the two orders differ on these rows (top_k_first renormalises before top-p)
    other = reference.top_k_top_p_sampling_distribution(
        probs, k, p, "joint" if order == "top_k_first" else "top_k_first")
    assert (dists != other).any()
    samples = sampling.top_k_top_p_sampling_from_probs(probs, k, p, indices=draws(3, device=device),
                                                       filter_apply_order=order)
    check_rows(samples, dists, what=f"from_probs {order}")
    logits = torch.log(probs)
    samples = sampling.top_k_top_p_sampling_from_logits(logits, k, p, indices=draws(3, device=device),
                                                        filter_apply_order=order)
    check_rows(samples, dists, what=f"from_logits {order}")


@TILES
def test_per_source_passes_freq(monkeypatch, device, tiles):
    """Many draws of few rows without the compaction (FlashInfer's 5M-draw tests): the searches, the
    max and the masses run once per source row (their scratch has one row per source) and each draw
    scans its owner segment; the frequencies still follow each filter's distribution."""
    monkeypatch.setattr(sampling, "_CAP", 0)
    scratch_rows = []
    search_scratch = sampling._search_scratch
    monkeypatch.setattr(sampling, "_search_scratch",
                        lambda batch, *a: scratch_rows.append(batch) or search_scratch(batch, *a))
    probs = crafted_probs(200, device)
    k, p = torch.tensor([3, 4, 3], device=device), torch.tensor([0.5, 0.75, 0.8], device=device)
    calls = {
        "top_k": (lambda i: sampling.top_k_sampling_from_probs(probs, k, indices=i),
                  reference.top_k_sampling_distribution(probs, k)),
        "top_p": (lambda i: sampling.top_p_sampling_from_probs(probs, 0.62, indices=i),
                  reference.top_p_sampling_distribution(probs, 0.62)),
        "joint_logits": (lambda i: sampling.top_k_top_p_sampling_from_logits(torch.log(probs), k, p, indices=i,
                                                                             filter_apply_order="joint"),
                         reference.top_k_top_p_sampling_distribution(probs, k, p, "joint")),
        "top_k_first": (lambda i: sampling.top_k_top_p_sampling_from_probs(probs, 3, 0.5, indices=i),
                        reference.top_k_top_p_sampling_distribution(probs, 3, 0.5, "top_k_first")),
        "min_p": (lambda i: sampling.min_p_sampling_from_probs(probs, 0.3, indices=i),
                  reference.min_p_sampling_distribution(probs, 0.3)),
    }
    for name, (call, dist) in calls.items():
        scratch_rows.clear()
        check_rows(call(draws(3, device=device)), dist, what=name)
        assert scratch_rows[-1] == 3, f"{name}: the searches ran over {scratch_rows} rows, not the 3 sources"


def test_segments_split_rows(monkeypatch, device):
    """A row in many segments: the searches and the sampler agree with one whole-row program, and the
    owner-segment rule still returns the row's last kept entry when nothing exceeds ``u * Z``."""
    probs = crafted_probs(300, device)
    split = sampling._Split(300, 3, probs.device)
    assert split.segs == 1
    whole = [sampling.top_k_renorm_probs(probs, 4), sampling.top_p_renorm_probs(probs, 0.62)]
    monkeypatch.setattr(sampling, "_INTERP_MAX_BLOCK", 8)
    monkeypatch.setattr(sampling, "_INTERP_MAX_SEGMENT", 32)
    assert sampling._Split(300, 3, probs.device).segs == 10
    assert_close(sampling.top_k_renorm_probs(probs, 4), whole[0], torch.float32)
    assert_close(sampling.top_p_renorm_probs(probs, 0.62), whole[1], torch.float32)
    # u just below 1: the sample is the last kept entry, in whichever segment it lies
    keep = reference.top_k_keep_mask(probs, 3) & (probs > 0)
    last = torch.stack([r.nonzero().max() for r in keep])
    monkeypatch.setattr(sampling, "_uniforms", lambda n, device, generator: torch.full((n,), 1 - 2**-24,
                                                                                       device=device))
    assert torch.equal(sampling.top_k_sampling_from_probs(probs, 3).long(), last)
    zero = torch.zeros(2, 300, device=device)
    assert sampling.sampling_from_probs(zero).tolist() == [0, 0]


def compaction_rows(device) -> torch.Tensor:
    """Rows for the compacted path: peaked (a few candidates), flat (every entry a candidate), ties at
    the top-k threshold, a long tail of tiny entries and zeros, a row of only zeros."""
    g = torch.Generator().manual_seed(21)
    vocab = 200
    rows = [torch.softmax(torch.randn(vocab, generator=g) * 4, -1),
            torch.full((vocab,), 1.0 / vocab),
            crafted_probs(vocab, "cpu")[0],
            crafted_probs(vocab, "cpu")[2],
            normalize(torch.rand(vocab, generator=g) ** 8),
            torch.zeros(vocab)]
    return torch.stack(rows).to(device)


def spy_compaction(monkeypatch) -> list:
    """Records each compaction's ``ncand`` (candidates per row; ``> cap``: the row took the full passes)."""
    seen = []
    real = sampling._compact

    def spy(*args, **kwargs):
        done = real(*args, **kwargs)
        seen.append((done.ncand.clone(), done.cap))
        return done

    monkeypatch.setattr(sampling, "_compact", spy)
    return seen


@pytest.mark.parametrize("tiles", ["one_tile", "segs64", "segs64x2"], indirect=True)
def test_compacted_path_matches_full_path(monkeypatch, device, tiles):
    """The compacted finish (``_CAP`` large), the full passes (``_CAP = 0``) and a mix (a small cap:
    peaked rows compacted, flat rows overflowing, in one batch) give the same samples for the same
    uniforms and the same renormalised rows, for every filter, both orders, per-row parameters and
    ``indices``."""
    probs = compaction_rows(device)
    n_rows = probs.shape[0]
    idx = torch.arange(n_rows, device=device, dtype=torch.int32).repeat(40)
    g = torch.Generator().manual_seed(3)
    u = torch.rand(idx.numel(), generator=g).to(device)
    # a uniform just below 1 on some outputs: the last kept entry
    u[:n_rows] = 1 - 2**-24
    monkeypatch.setattr(sampling, "_uniforms", lambda n, device, generator: u[:n].clone())
    k_rows = torch.tensor([3, 50, 2, 4, 0, 7], device=device)
    p_rows = torch.tensor([0.62, 0.3, 0.5, 0.9, 1.0, 0.5], device=device)
    calls = {
        "top_k": lambda: sampling.top_k_sampling_from_probs(probs, 5, indices=idx),
        "top_k_rows": lambda: sampling.top_k_sampling_from_probs(probs, k_rows, indices=idx),
        "top_p": lambda: sampling.top_p_sampling_from_probs(probs, 0.62, indices=idx),
        "top_p_rows": lambda: sampling.top_p_sampling_from_probs(probs, p_rows, indices=idx),
        "min_p": lambda: sampling.min_p_sampling_from_probs(probs, 0.2, indices=idx),
        "joint": lambda: sampling.top_k_top_p_sampling_from_probs(probs, k_rows, p_rows, indices=idx,
                                                                  filter_apply_order="joint"),
        "top_k_first": lambda: sampling.top_k_top_p_sampling_from_probs(probs, k_rows, p_rows, indices=idx),
        "top_k_first_scalar": lambda: sampling.top_k_top_p_sampling_from_probs(probs, 4, 0.7, indices=idx),
        "top_k_first_per_output": lambda: sampling.top_k_top_p_sampling_from_probs(
            probs, k_rows[idx.long()], p_rows[idx.long()], indices=idx),
        "logits_top_k_first": lambda: sampling.top_k_top_p_sampling_from_logits(torch.log(probs[:5]), 6, 0.8),
        "top_k_renorm": lambda: sampling.top_k_renorm_probs(probs, k_rows),
        "top_p_renorm": lambda: sampling.top_p_renorm_probs(probs, p_rows),
        "mask_logits": lambda: sampling.top_k_mask_logits(torch.log(probs), k_rows),
    }
    # overflowing top-k/top-p rows take the rejection sampler (test_rejection_sampler): the passes here
    monkeypatch.setattr(sampling, "_REJECTION", False)
    seen = spy_compaction(monkeypatch)
    results = {}
    for cap in (4096, 0, 12):
        monkeypatch.setattr(sampling, "_CAP", cap)
        results[cap] = {name: fn() for name, fn in calls.items()}
    mixed = [(n <= c).any() and (n > c).any() for n, c in seen if c == 12]
    assert sum(mixed) >= 8, "the small cap must leave some rows compacted and overflow others"
    assert all((n <= c).all() for n, c in seen if c == 4096)
    for name in calls:
        full = results[0][name]
        for cap in (4096, 12):
            got = results[cap][name]
            if got.dtype == torch.float32:
                torch.testing.assert_close(got, full, atol=1e-6, rtol=1e-5, equal_nan=True, msg=f"{name} cap={cap}")
            else:
                assert torch.equal(got, full), f"{name} cap={cap}: {(got != full).nonzero().flatten().tolist()}"
    # and the compacted samples lie in the reference's kept sets
    keep = reference.top_k_keep_mask(probs, 5) & (probs > 0)
    s = results[4096]["top_k"].long()
    has_mass = probs[idx.long()].sum(1) > 0
    assert keep[idx.long(), s][has_mass].all() and (s[~has_mass] == 0).all()


@pytest.mark.parametrize("cap,block,only_rows", [(0, None, None), (12, None, 1 << 30), (0, 16, None), (4096, None, 1)],
                         ids=["all-rows", "overflow", "3-tiles", "no-compaction"])
def test_rejection_sampler(monkeypatch, device, cap, block, only_rows):
    """Top-k, top-p and joint rows the compaction does not finish (all with ``_CAP = 0``; the flat ones
    with a small cap) are sampled by rejection: frequencies follow the renormalised kept set for scalar
    and per-row parameters, ``top_p = 1``, ``k >= vocab`` and ties at the k-th value; ``indices`` that
    do not repeat rows; a tiny ``top_p`` is greedy; an all-zero row samples 0; the same generator
    state gives the same samples. (It fails with one round: samples outside the kept set.) Rows of
    48 entries: one masked tile, or three tiles of 16 (the lane gather across tiles). "overflow": the
    compaction first, whatever the batch; "no-compaction": every row straight to the rejection sampler
    (``_REJECTION_ONLY_ROWS``; top-p alone by default), the compaction never called for these functions
    (top_k_first aside)."""
    monkeypatch.setattr(sampling, "_CAP", cap)
    if only_rows is not None:
        monkeypatch.setattr(sampling, "_REJECTION_ONLY_ROWS", only_rows)
        monkeypatch.setattr(sampling, "_TOP_P_REJECTION_ONLY_ROWS", only_rows)
    compacted = spy_compaction(monkeypatch)
    if block:
        monkeypatch.setattr(sampling, "_INTERP_MAX_BLOCK", block)
    launched = []
    launcher = sampling._REJECTION_SAMPLE
    monkeypatch.setattr(sampling, "_REJECTION_SAMPLE",
                        type("Spy", (), {"__getitem__": lambda self, g: launched.append(g) or launcher[g]})())
    g = torch.Generator().manual_seed(4)
    flat = normalize(torch.rand(2, 48, generator=g) + 0.5)  # ~every entry a candidate: overflows cap 12
    probs = torch.cat([crafted_probs(48, "cpu"), flat]).to(device)
    n = probs.shape[0]
    rows = probs.repeat(N_DRAWS, 1)
    p_rows = torch.tensor([0.5, 0.62, 0.8, 0.3, 0.9], device=device)
    k_rows = torch.tensor([2, 3, 48, 5, 9], device=device)
    cases = {
        "top_p": (lambda: sampling.top_p_sampling_from_probs(rows, 0.62),
                  reference.top_p_sampling_distribution(probs, 0.62)),
        "top_p_rows": (lambda: sampling.top_p_sampling_from_probs(rows, p_rows.repeat(N_DRAWS)),
                       reference.top_p_sampling_distribution(probs, p_rows)),
        "top_p_1": (lambda: sampling.top_p_sampling_from_probs(rows, 1.0),
                    reference.top_p_sampling_distribution(probs, 1.0)),
        "top_k_rows": (lambda: sampling.top_k_sampling_from_probs(rows, k_rows.repeat(N_DRAWS)),
                       reference.top_k_sampling_distribution(probs, k_rows)),
        "joint": (lambda: sampling.top_k_top_p_sampling_from_probs(rows, 4, 0.7, filter_apply_order="joint"),
                  reference.top_k_top_p_sampling_distribution(probs, 4, 0.7, "joint")),
        # top_k_first: the top-k renorm, then top-p of the renormalised rows by rejection
        "top_k_first": (lambda: sampling.top_k_top_p_sampling_from_probs(rows, 4, 0.7),
                        reference.top_k_top_p_sampling_distribution(probs, 4, 0.7, "top_k_first")),
    }
    for name, (call, dists) in cases.items():
        launched.clear()
        samples = call()
        assert launched, f"{name}: the rejection sampler did not run"
        if only_rows == 1 and name != "top_k_first":
            assert not compacted, f"{name}: compacted although every row goes to the rejection sampler"
        compacted.clear()
        for r in range(n):
            check_frequencies(samples[r::n], dists[r], what=f"{name} row {r}")
    perm = torch.randperm(n, generator=g).to(device=device, dtype=torch.int32)
    samples = sampling.top_p_sampling_from_probs(probs, 1e-7, indices=perm)
    assert torch.equal(samples.long(), probs[perm.long()].argmax(-1))
    zero = torch.zeros(3, 48, device=device)
    assert sampling.top_p_sampling_from_probs(zero, 0.7).tolist() == [0, 0, 0]
    assert sampling.top_k_sampling_from_probs(zero, 5).tolist() == [0, 0, 0]
    a = sampling.top_p_sampling_from_probs(rows, 0.5, generator=torch.Generator(device=device).manual_seed(9))
    b = sampling.top_p_sampling_from_probs(rows, 0.5, generator=torch.Generator(device=device).manual_seed(9))
    assert torch.equal(a, b)


def test_compaction_copy_stays_under_its_byte_budget(monkeypatch):
    """FlashInfer's frequency tests draw 5M samples of one row through ``indices``: a [5M, 4096] copy
    would take 164 GB, so large batches get a smaller cap and, below ``_MIN_CAP``, no compaction (the
    ``_CAP = 0`` route of the test above)."""
    assert sampling._compact_cap(1024) == sampling._CAP
    assert sampling._compact_cap(5_000_000) == 0
    for batch in (1, 1024, 65536, 200_000, 5_000_000):
        cap = sampling._compact_cap(batch)
        assert cap * batch * 8 <= sampling._COMPACT_BYTES and (cap == 0 or cap >= sampling._MIN_CAP)
    monkeypatch.setattr(sampling, "_CAP", 12)
    assert sampling._compact_cap(4) == 12


def test_compaction_bounds_keep_flat_rows_exact(monkeypatch, device):
    """A flat row (every entry a candidate) and a row of ties at the threshold: the bound never
    drops a kept entry, so the compacted renorm equals the reference even where every candidate is a
    tie."""
    probs = compaction_rows(device)
    for k in (1, 3, 50, 199):
        assert_close(sampling.top_k_renorm_probs(probs, k), reference.top_k_renorm_probs(probs, k), torch.float32)
    for p in (0.05, 0.5, 0.62, 0.95):
        assert_close(sampling.top_p_renorm_probs(probs, p), reference.top_p_renorm_probs(probs, p), torch.float32)


def _bin_edge_rows(device) -> torch.Tensor:
    """Rows at the edges of the bound pass's probability bins (kernels/sampling.py): each bin's
    smallest float and the float just below it, 1.0 and above (an unnormalised row), values under
    the smallest bin, zeros, in random order."""
    g = torch.Generator().manual_seed(8)
    base, shift, bins = int(sampling._k.PROB_BIN_BASE), int(sampling._k.PROB_BIN_SHIFT), int(sampling._k.PROB_BOUND_BINS)
    edges = torch.tensor([(b + base) << shift for b in range(1, bins, 2)], dtype=torch.int32).view(torch.float32)
    below = (edges.view(torch.int32) - 1).view(torch.float32)
    tiny = torch.tensor([1e-12, 2e-10, 0.0, 0.0, 3e-38])
    big = torch.tensor([1.0, 1.0, 1.5, 3.0])
    row = torch.cat([edges, below, tiny, edges[-6:], below[-6:]])
    rows = [row[torch.randperm(row.numel(), generator=g)] / row.sum(),
            torch.cat([row, big])[torch.randperm(row.numel() + 4, generator=g)],
            torch.cat([row, torch.tensor([0.5])])[torch.randperm(row.numel() + 1, generator=g)]]
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]).to(device)


def test_probability_bins_keep_thresholds_exact(monkeypatch, device):
    """Rows whose entries sit on and just below the probability bins' edges, with values of 1 and
    more, and zeros: the compacted renorms (every row finished on its candidates) equal the
    reference for every k and p, and the samples lie in the kept sets."""
    probs = _bin_edge_rows(device)
    seen = spy_compaction(monkeypatch)
    for k in (1, 2, 5, 17, 40):
        assert_close(sampling.top_k_renorm_probs(probs, k), reference.top_k_renorm_probs(probs, k), torch.float32)
    for p in (0.01, 0.3, 0.5, 0.77, 0.99):
        assert_close(sampling.top_p_renorm_probs(probs, p), reference.top_p_renorm_probs(probs, p), torch.float32)
    assert seen and all((n <= c).all() for n, c in seen), "every row must be finished on its candidates"
    keep = reference.top_p_keep_mask(probs, 0.5)
    for _ in range(20):
        s = sampling.top_p_sampling_from_probs(probs, 0.5).long()
        assert keep[torch.arange(probs.shape[0], device=device), s].all()


def test_probability_bins_make_flat_top_p_rows_fit(monkeypatch, device):
    """The bench's flat rows (softmax(randn * 3)): the probability bins (a factor 4/3 or 3/2 wide)
    make a top-p row's candidates at most ~1.6x its kept entries; the float bins (a factor 4) made
    them ~3x as many, which overflowed the cap (kept ~6K of 128K: 20K candidates)."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 8192, device=device) * 3, -1)
    seen = spy_compaction(monkeypatch)
    assert_close(sampling.top_p_renorm_probs(probs, 0.9), reference.top_p_renorm_probs(probs, 0.9), torch.float32)
    kept = reference.top_p_keep_mask(probs, 0.9).sum(-1)
    (ncand, _), = seen
    assert (ncand.cpu() >= kept.cpu()).all() and (ncand.cpu() <= kept.cpu() * 1.8).all(), (ncand, kept)


def test_whole_row_sampling(monkeypatch, device):
    """Plain, logits and min-p sampling of many short rows by one program a whole row, in chunks
    (``sample_row_kernel``; here from one row on, in chunks of 32 of 128 lanes), with the passes' pick
    made to fail: frequencies, one and per-row ``min_p``; ``indices`` (no more outputs than rows) with
    ``min_p`` by source and by output row, ids outside the rows and an all-zero row sampling 0."""
    monkeypatch.setattr(sampling, "_SAMPLE_ROW_MIN_ROWS", 1)
    monkeypatch.setattr(sampling, "_INTERP_WHOLE_ROWS", ",".join(sampling._WHOLE_ROW_KINDS))
    monkeypatch.setattr(sampling, "_SAMPLE_ROW_CHUNK", 32)
    monkeypatch.setattr(sampling, "_SAMPLE_PICK", None)
    n = 400
    probs = crafted_probs(100, device)
    rows = probs.repeat_interleave(n, 0)
    check_rows(sampling.sampling_from_probs(rows), reference.sampling_distribution(probs), per_row=n, what="plain")
    logits = torch.randn(2, 100, device=device) * 2
    logits[1, ::2] = float("-inf")
    check_rows(sampling.sampling_from_logits(logits.repeat_interleave(n, 0)), torch.softmax(logits, -1), per_row=n,
               what="logits")
    min_p = torch.tensor([0.5, 0.3, 0.1], device=device)
    for mp, per_output in ((min_p, min_p.repeat_interleave(n)), (0.2, 0.2)):
        check_rows(sampling.min_p_sampling_from_probs(rows, per_output), reference.min_p_sampling_distribution(probs, mp),
                   per_row=n, what=f"min_p={mp}")
    src = torch.cat([probs, torch.zeros(1, 100, device=device), probs[:2]])  # 6 rows, row 3 all zero
    idx = torch.tensor([2, 0, 2**30, 3, -1], dtype=torch.int32, device=device)
    by_source = torch.tensor([0.6, 0.2, 0.9, 0.5, 0.1, 0.1], device=device)
    by_output = by_source[[2, 0, 1, 3, 4]]
    valid = torch.tensor([0, 1])
    for mp in (by_source, by_output):
        s = sampling.min_p_sampling_from_probs(src, mp, indices=idx).long().cpu()
        assert (s[2:] == 0).all()
        keep = reference.min_p_keep_mask(probs, by_source[:3]).cpu()
        assert keep[idx[valid].long().cpu(), s[valid]].all()
    s = sampling.sampling_from_probs(src, indices=idx).long().cpu()
    assert (s[2:] == 0).all() and (src.cpu()[idx[valid].long().cpu(), s[valid]] > 0).all()


def test_per_output_parameters(device):
    """With ``indices``, a parameter tensor of length ``len(indices)`` belongs to the outputs."""
    probs = crafted_probs(50, device)[:1]
    idx = torch.zeros(2 * N_DRAWS, dtype=torch.int32, device=device)
    k = torch.tensor([1] * N_DRAWS + [3] * N_DRAWS, device=device)
    samples = sampling.top_k_sampling_from_probs(probs, k, indices=idx)
    check_frequencies(samples[:N_DRAWS], reference.top_k_sampling_distribution(probs, 1)[0], "k=1")
    check_frequencies(samples[N_DRAWS:], reference.top_k_sampling_distribution(probs, 3)[0], "k=3")
    p = torch.tensor([0.9] * N_DRAWS + [0.3] * N_DRAWS, device=device)
    samples = sampling.top_k_top_p_sampling_from_probs(probs, k, p, indices=idx)
    check_frequencies(samples[N_DRAWS:], reference.top_k_top_p_sampling_distribution(probs, 3, 0.3)[0], "k=3 p=.3")


def test_chain_speculative_sampling(device):
    torch.manual_seed(1)
    b, n, vocab = 3, 4, 40
    draft = normalize(torch.rand(b, n, vocab, device=device) ** 3)
    target = normalize(torch.rand(b, n + 1, vocab, device=device) ** 3)
    ids = torch.randint(vocab, (b, n), device=device)
    acc = torch.full((b,), 5, dtype=torch.int32, device=device)
    emit = torch.zeros(b, dtype=torch.int64, device=device)
    out, acc2, emit2 = sampling.chain_speculative_sampling(draft, ids, target, acc, emit)
    assert out.shape == (b, n + 1) and out.dtype == torch.int32
    assert acc2 is acc and emit2 is emit
    assert torch.equal(emit + 1, (out != -1).sum(1).to(emit.dtype))
    assert (acc >= 5 + emit.int()).all() and (acc <= 5 + n).all()
    for r in range(b):
        e = int(emit[r])
        assert torch.equal(out[r, :e], ids[r, :e].int()) and (out[r, e + 1:] == -1).all()

    # the first output token over many requests sharing one draft/target pair
    reps = 4000
    d1 = draft[:1].expand(reps, n, vocab)
    t1 = target[:1].expand(reps, n + 1, vocab)
    i1 = ids[:1].expand(reps, n)
    out, acc, emit = sampling.chain_speculative_sampling(d1, i1, t1)
    check_frequencies(out[:, 0], reference.chain_speculative_first_token_distribution(draft, ids, target)[0],
                      "first token")
    # one-hot targets equal to the drafts: everything accepted, the bonus token drawn from the last row
    onehot = torch.zeros(b, n + 1, vocab, device=device)
    tokens = torch.cat([ids, torch.randint(vocab, (b, 1), device=device)], 1)
    onehot.scatter_(2, tokens[..., None], 1.0)
    out, acc, emit = sampling.chain_speculative_sampling(draft, ids, onehot)
    assert torch.equal(out, tokens.int()) and (emit == n).all() and (acc == n).all()


# --------------------------------------------------------------------------------------------------
# randomness, shapes, edge cases
# --------------------------------------------------------------------------------------------------


def test_reproducible_with_generator(device):
    probs = crafted_probs(64, device)
    idx = draws(3, 200, device=device)

    def run(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return [sampling.top_p_sampling_from_probs(probs, 0.7, idx, generator=g),
                sampling.top_k_top_p_sampling_from_probs(probs, 3, 0.7, idx, filter_apply_order="joint", generator=g),
                sampling.sampling_from_logits(torch.log(probs), idx, generator=g)]

    a, b, c = run(7), run(7), run(8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    torch.manual_seed(3)
    x = sampling.sampling_from_probs(probs, idx)
    torch.manual_seed(3)
    assert torch.equal(x, sampling.sampling_from_probs(probs, idx))


def test_logits_and_probs_paths_agree(device):
    """FlashInfer's check: for one generator state, the logits functions return what the probs
    functions return on ``torch.softmax(logits)`` (joint: exactly; top_k_first: almost always)."""
    logits = torch.randn(64, 111, device=device) * 5
    for order, min_match in (("joint", 1.0), ("top_k_first", 0.95)):
        g1 = torch.Generator(device=device).manual_seed(11)
        g2 = torch.Generator(device=device).manual_seed(11)
        a = sampling.top_k_top_p_sampling_from_logits(logits, 10, 0.5, filter_apply_order=order, generator=g1)
        b = sampling.top_k_top_p_sampling_from_probs(torch.softmax(logits, -1), 10, 0.5, filter_apply_order=order,
                                                     generator=g2)
        assert (a == b).float().mean() >= min_match, order


@pytest.mark.parametrize("batch,whole_rows", [(8, False), (64, False), (8, True)],
                         ids=["compacted", "rejection-only", "whole-rows"])
def test_top_k_first_is_top_p_of_the_top_k_renorm(monkeypatch, device, batch, whole_rows):
    """FlashInfer's logits-processor tests compare, for one generator state and exactly: probs
    ``top_k_first`` with ``top_p_sampling_from_probs(top_k_renorm_probs(probs))``, and logits
    ``top_k_first`` with ``top_p_sampling_from_probs(softmax(top_k_mask_logits(logits)))``; below and
    above ``_REJECTION_ONLY_ROWS`` (where top-p sampling takes the rejection sampler's order). The
    probs function never writes the renormalised rows: the sampler reads them renormalised (scalar
    and per-row parameters, ``k`` off on some rows, draws sharing rows through ``indices``)."""
    if whole_rows:
        # the top-k renorm and its parameters by one program a whole row (the GPU's path from 128 rows
        # of at most 32K entries), in chunks of 32
        monkeypatch.setattr(sampling, "_TOP_K_ROW_MIN_ROWS", 1)
        monkeypatch.setattr(sampling, "_INTERP_WHOLE_ROWS", ",".join(sampling._WHOLE_ROW_KINDS))
        monkeypatch.setattr(sampling, "_SAMPLE_ROW_CHUNK", 32)
        monkeypatch.setattr(sampling, "_RENORM_WRITE", None)
    logits = torch.randn(batch, 111, device=device) * 5
    probs = torch.softmax(logits, -1)
    written = []
    renorm = sampling._renorm
    monkeypatch.setattr(sampling, "_renorm", lambda *a, **kw: written.append(1) or renorm(*a, **kw))

    def gen():
        return torch.Generator(device=device).manual_seed(5)

    g = torch.Generator().manual_seed(1)
    k_rows = torch.randint(0, 30, (batch,), generator=g).to(device)
    k_rows[:2] = torch.tensor([0, 111])
    p_rows = torch.rand(batch, generator=g).to(device)
    idx = torch.randint(0, batch, (2 * batch,), generator=g).to(device=device, dtype=torch.int32)
    for k, p, i in ((10, 0.6, None), (k_rows, p_rows, None), (k_rows, p_rows, idx)):
        written.clear()
        fused = sampling.top_k_top_p_sampling_from_probs(probs, k, p, indices=i, generator=gen())
        assert not written, "top_k_first wrote the renormalised rows"
        composed = sampling.top_p_sampling_from_probs(sampling.top_k_renorm_probs(probs, k), p, indices=i,
                                                      generator=gen())
        assert torch.equal(fused, composed)
    fused = sampling.top_k_top_p_sampling_from_logits(logits, 10, 0.6, generator=gen())
    composed = sampling.top_p_sampling_from_probs(torch.softmax(sampling.top_k_mask_logits(logits, 10), -1), 0.6,
                                                  generator=gen())
    assert torch.equal(fused, composed)


def test_edge_cases(device):
    probs = crafted_probs(16, device)
    # one-entry vocabulary, empty batch
    one = torch.ones(3, 1, device=device)
    assert sampling.sampling_from_probs(one).tolist() == [0, 0, 0]
    assert sampling.top_k_top_p_sampling_from_probs(one, 1, 0.5, filter_apply_order="joint").tolist() == [0, 0, 0]
    assert sampling.sampling_from_probs(probs[:0]).shape == (0,)
    assert sampling.top_k_renorm_probs(probs[:0], 2).shape == (0, 16)
    # a row with no mass gives entry 0 rather than reading outside the row
    zero = torch.zeros(2, 16, device=device)
    assert sampling.top_p_sampling_from_probs(zero, 0.5).tolist() == [0, 0]
    # top_k >= vocab: no filter; tensor top_p <= 0 keeps the largest entries only
    assert torch.equal(sampling.top_k_renorm_probs(probs, 100), probs)
    s = sampling.top_p_sampling_from_probs(probs, torch.zeros(3, device=device), indices=draws(3, 50, device=device))
    assert torch.equal(s, probs.argmax(-1).int().repeat_interleave(50))
    # a strided view of the rows
    wide = torch.zeros(3, 40, device=device)
    wide[:, 4:20] = probs
    out = sampling.top_k_renorm_probs(wide[:, 4:20], 3)
    assert_close(out, reference.top_k_renorm_probs(probs, 3), torch.float32)


def test_indices_outside_the_rows_read_nothing(device):
    """Source ids outside ``[0, num_rows)`` (not checked without ``check_nan``) read no input row and
    no entry of a per-source parameter tensor (an id of 2**30 used to index the parameter arrays: a
    segmentation fault under the interpreter): those outputs are 0, the others sample their rows."""
    probs = crafted_probs(50, device)
    idx = torch.tensor([0, 2, 2**30, -5, 1], dtype=torch.int32, device=device)
    k = torch.tensor([3, 4, 5], dtype=torch.int32, device=device)
    p = torch.tensor([0.5, 0.6, 0.7], device=device)
    t = torch.tensor([0.5, 1.0, 2.0], device=device)
    valid = torch.tensor([0, 2, 1])
    for cap in (4096, 0):
        sampling._CAP, saved = cap, sampling._CAP
        try:
            for name, s, keep in (
                    ("top_k", sampling.top_k_sampling_from_probs(probs, k, indices=idx),
                     reference.top_k_keep_mask(probs, k)),
                    ("joint", sampling.top_k_top_p_sampling_from_probs(probs, k, p, indices=idx,
                                                                       filter_apply_order="joint"),
                     reference.top_k_keep_mask(probs, k) & reference.top_p_keep_mask(probs, p)),
                    ("min_p", sampling.min_p_sampling_from_probs(probs, p, indices=idx),
                     reference.min_p_keep_mask(probs, p))):
                s = s.long().cpu()
                assert (s[2:4] == 0).all(), name
                assert keep.cpu()[valid, s[[0, 1, 4]]].all(), name
        finally:
            sampling._CAP = saved
    logits = torch.log(probs)
    s = sampling.sampling_from_logits(logits / t[:, None], indices=idx).long().cpu()
    assert (s[2:4] == 0).all() and (probs.cpu()[valid, s[[0, 1, 4]]] > 0).all()
    with pytest.raises(ValueError, match="no rows"):
        sampling.top_k_sampling_from_probs(probs[:0], 3, indices=idx[:1])


def test_bad_input(device):
    probs = crafted_probs(16, device)
    with pytest.raises(ValueError, match="probs: expected dtype"):
        sampling.sampling_from_probs(probs.double())
    with pytest.raises(ValueError, match="probs: expected a 2-D tensor"):
        sampling.sampling_from_probs(probs[0])
    with pytest.raises(TypeError, match="probs: expected a torch.Tensor"):
        sampling.sampling_from_probs(probs.tolist())
    with pytest.raises(ValueError, match=r"top_k: Expected a 1D tensor or scalar.*got a 2D tensor"):
        sampling.top_k_renorm_probs(probs, torch.ones(3, 2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"top_p: Expected a 1D tensor of shape \(batch_size,\) or scalar.*"
                                         r"got a 0-dimensional tensor"):
        sampling.top_p_sampling_from_probs(probs, torch.tensor(0.5, device=device))
    with pytest.raises(ValueError, match="min_p: Sampling parameter tensor batch size mismatch"):
        sampling.min_p_sampling_from_probs(probs, torch.tensor([0.1], device=device))
    with pytest.raises(ValueError, match="top_k: expected an integer >= 1"):
        sampling.top_k_sampling_from_probs(probs, 0)
    with pytest.raises(ValueError, match=r"top_p: expected a value in \(0, 1\]"):
        sampling.top_p_sampling_from_probs(probs, 1.5)
    with pytest.raises(ValueError, match=r"top_p: expected a value in \(0, 1\]"):
        sampling.top_k_top_p_sampling_from_logits(probs, 3, 0.0)
    with pytest.raises(ValueError, match=r"min_p: expected a value in \[0, 1\]"):
        sampling.min_p_sampling_from_probs(probs, -0.1)
    with pytest.raises(ValueError, match="temperature: expected a value >= 0"):
        sampling.softmax(probs, -1.0)
    with pytest.raises(ValueError, match="filter_apply_order"):
        sampling.top_k_top_p_sampling_from_probs(probs, 3, 0.5, filter_apply_order="top_p_first")
    with pytest.raises(ValueError, match="indices: expected dtype int32 or int64"):
        sampling.sampling_from_probs(probs, indices=torch.zeros(4, device=device))
    with pytest.raises(TypeError, match="generator"):
        sampling.sampling_from_probs(probs, generator=3)
    nan = probs.clone()
    nan[1, 3] = float("nan")
    with pytest.raises(ValueError, match="probs: contains NaN"):
        sampling.top_p_sampling_from_probs(nan, 0.5, check_nan=True)
    with pytest.raises(ValueError, match="logits: contains NaN"):
        sampling.top_k_top_p_sampling_from_logits(nan, 3, 0.5, check_nan=True)
    with pytest.raises(ValueError, match=r"indices: values must lie in \[0, 3\)"):
        sampling.sampling_from_probs(probs, indices=torch.tensor([0, 3], device=device), check_nan=True)
    with pytest.raises(ValueError, match="target_probs: expected shape"):
        sampling.chain_speculative_sampling(probs[:, None].expand(3, 2, 16), torch.zeros(3, 2, dtype=torch.int32),
                                            probs[:, None].expand(3, 2, 16))


def test_exports():
    from tritoninfer import _compat

    for name in _compat._SAMPLING_TOP_LEVEL:
        assert getattr(tritoninfer, name) is getattr(sampling, name)
    assert set(_compat._SAMPLING_TOP_LEVEL) | {"top_k_renorm_prob", "top_p_renorm_prob"} == set(sampling.__all__)
    assert sampling.top_k_renorm_prob is sampling.top_k_renorm_probs
    assert sampling.top_p_renorm_prob is sampling.top_p_renorm_probs


def test_installed_as_flashinfer():
    from tritoninfer._compat import uninstall_flashinfer

    tritoninfer.install_as_flashinfer(force=True)
    try:
        import flashinfer
        from flashinfer.sampling import top_k_renorm_prob, top_k_top_p_sampling_from_probs

        assert top_k_top_p_sampling_from_probs is sampling.top_k_top_p_sampling_from_probs
        assert top_k_renorm_prob is sampling.top_k_renorm_probs
        assert flashinfer.top_p_sampling_from_probs is sampling.top_p_sampling_from_probs
        assert not hasattr(flashinfer, "top_k_renorm_prob")  # a flashinfer.sampling alias only
    finally:
        uninstall_flashinfer()


# --------------------------------------------------------------------------------------------------
# GPU: realistic shapes, CUDA graphs (skipped without a GPU)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_realistic_vocab():
    torch.manual_seed(0)
    batch, vocab = 64, 128256
    logits = torch.randn(batch, vocab, device="cuda") * 4
    probs = torch.softmax(logits, -1)
    for k in (1, 50, 1000):
        assert_close(sampling.top_k_renorm_probs(probs, k), reference.top_k_renorm_probs(probs, k), torch.float32)
        assert torch.equal(sampling.top_k_mask_logits(logits, k), reference.top_k_mask_logits(logits, k))
    assert_close(sampling.softmax(logits, 0.7), reference.softmax(logits, 0.7), torch.float32)
    keep_k = reference.top_k_keep_mask(probs, 50)
    for p in (0.3, 0.9):
        # float32 sums over 128K entries may settle an entry within ~1e-6 of the threshold either
        # way: FlashInfer's own tolerance
        torch.testing.assert_close(sampling.top_p_renorm_probs(probs, p), reference.top_p_renorm_probs(probs, p),
                                   atol=1e-3, rtol=1e-3)
    rows = torch.arange(batch, device="cuda")
    for _ in range(20):
        s = sampling.top_k_top_p_sampling_from_probs(probs, 50, 0.9, filter_apply_order="joint").long()
        assert keep_k[rows, s].all()
        s = sampling.min_p_sampling_from_probs(probs, 0.1).long()
        assert (probs[rows, s] >= 0.1 * probs.max(-1).values).all()


@pytest.mark.gpu
def test_gpu_whole_rows(monkeypatch):
    """The whole-row paths (every kind switched on: the GPU takes some by default) at their shapes, 256 rows of
    32,000: softmax, the top-k renorm and mask equal the reference; plain and
    min-p draws stay in their sets and follow the row (a 4-entry row: frequencies); the fused
    ``top_k_first`` equals top-p sampling of the top-k renorm draw for draw."""
    monkeypatch.setattr(sampling, "_GPU_WHOLE_ROWS", ",".join(sampling._WHOLE_ROW_KINDS))
    torch.manual_seed(0)
    batch, vocab = 256, 32000
    assert batch >= max(sampling._SOFTMAX_ROW_MIN_ROWS, sampling._SAMPLE_ROW_MIN_ROWS, sampling._TOP_K_ROW_MIN_ROWS)
    logits = torch.randn(batch, vocab, device="cuda") * 4
    logits[1, :1000] = float("-inf")
    probs = torch.softmax(logits, -1)
    assert_close(sampling.softmax(logits, 0.7), reference.softmax(logits, 0.7), torch.float32)
    for k in (1, 50, 1000, vocab):
        assert_close(sampling.top_k_renorm_probs(probs, k), reference.top_k_renorm_probs(probs, k), torch.float32)
        assert torch.equal(sampling.top_k_mask_logits(logits, k), reference.top_k_mask_logits(logits, k))
    rows = torch.arange(batch, device="cuda")
    for _ in range(10):
        s = sampling.min_p_sampling_from_probs(probs, 0.1).long()
        assert (probs[rows, s] >= 0.1 * probs.max(-1).values).all()
        assert (probs[rows, sampling.sampling_from_probs(probs).long()] > 0).all()
        assert torch.isfinite(logits[rows, sampling.sampling_from_logits(logits).long()]).all()
    # a row with four entries, drawn in 256 rows a call: frequencies
    few = torch.zeros(vocab, device="cuda")
    few[[3, 9000, 17000, 31999]] = torch.tensor([0.1, 0.2, 0.3, 0.4], device="cuda")
    draws_ = torch.cat([sampling.sampling_from_probs(few.expand(batch, vocab).contiguous()) for _ in range(40)])
    check_frequencies(draws_, few, "whole-row sampling")

    def gen():
        return torch.Generator(device="cuda").manual_seed(3)

    for k, p in ((50, 0.9), (1000, 0.5)):
        fused = sampling.top_k_top_p_sampling_from_probs(probs, k, p, generator=gen())
        composed = sampling.top_p_sampling_from_probs(sampling.top_k_renorm_probs(probs, k), p, generator=gen())
        assert torch.equal(fused, composed)


@pytest.mark.gpu
def test_gpu_millions_of_draws_stay_in_the_kept_set():
    """FlashInfer's frequency tests' shape: millions of draws of one row through ``indices``, with a
    few kept entries in different segments (min-p 0.7 over a std-1 normal row keeps ~4 of 128K).
    Every draw is a kept entry: the pick once took a segment without mass when the GPU's parallel
    scan rounded a running total over empty segments above its predecessor's (1 draw in millions).
    The first case is FlashInfer's ``test_probs_min_p_sample_freq[0.7-normal_distribution(std=1)-128256]``
    draw for draw (seed 42, the default generator, the pipeline fused and not), where that happened."""
    from tritoninfer.logits_processor import LogitsPipe, MinP, Sample

    vocab, draws = 128256, 5_000_000
    idx = torch.zeros(draws, dtype=torch.int32, device="cuda")
    torch.manual_seed(42)
    probs = torch.softmax(torch.randn((1, vocab), device="cuda"), -1)
    keep = probs[0] >= 0.7 * probs.max()
    for compile in (True, False):
        s = LogitsPipe([MinP(), Sample()], compile=compile)(probs, indices=idx, min_p=0.7).long()
        assert keep[s].all(), f"compile={compile}: {int((~keep[s]).sum())} draws outside the min-p set"
    gen = torch.Generator(device="cuda")
    for seed in range(4):
        gen.manual_seed(seed)
        probs = torch.softmax(torch.randn(1, vocab, device="cuda", generator=gen), -1)
        keep = probs[0] >= 0.7 * probs.max()
        s = sampling.min_p_sampling_from_probs(probs, 0.7, indices=idx, generator=gen).long()
        assert keep[s].all(), f"seed {seed}: {int((~keep[s]).sum())} draws outside the min-p set"
        kept = torch.where(keep, probs[0], 0.0)[None]
        s = sampling.sampling_from_probs(kept, indices=idx, generator=gen).long()
        assert keep[s].all(), f"seed {seed}: {int((~keep[s]).sum())} draws of zero probability"


@pytest.mark.gpu
def test_gpu_rejection_sampler_flat_rows(monkeypatch):
    """On the GPU, the bench's flat rows at 256 rows (top-p 0.9 keeps 5-7K entries): every row goes
    through the rejection sampler without the compaction (``_REJECTION_ONLY_ROWS``), eagerly and
    captured in a CUDA graph; every sample lies in the kept set (torch's sort-based masks); the
    graph's replays draw new samples."""
    torch.manual_seed(0)
    batch, vocab = 256, 128256
    assert batch >= sampling._REJECTION_ONLY_ROWS
    probs = torch.softmax(torch.randn(batch, vocab, device="cuda") * 3, -1)
    rows = torch.arange(batch, device="cuda")
    keep_p = reference.top_p_keep_mask(probs, 0.9)
    keep_joint = keep_p & reference.top_k_keep_mask(probs, 6000)
    seen = spy_compaction(monkeypatch)
    for _ in range(5):
        assert keep_p[rows, sampling.top_p_sampling_from_probs(probs, 0.9).long()].all()
        s = sampling.top_k_top_p_sampling_from_probs(probs, 6000, 0.9, filter_apply_order="joint").long()
        assert keep_joint[rows, s].all()
    assert not seen, "rows past _REJECTION_ONLY_ROWS must not be compacted"
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sampling.top_p_sampling_from_probs(probs, 0.9)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = sampling.top_p_sampling_from_probs(probs, 0.9)
    seen = []
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert keep_p[rows, out.long()].all()
        seen.append(out.clone())
    assert any(not torch.equal(seen[0], x) for x in seen[1:])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    """A sampling step (softmax with temperature, joint top-k/top-p) captured in a CUDA graph: no
    host synchronisation inside, and each replay draws new numbers from the default generator."""
    torch.manual_seed(0)
    batch, vocab = 64, 128256
    logits = torch.randn(batch, vocab, device="cuda") * 4
    temperature = torch.full((batch,), 0.8, device="cuda")
    top_k = torch.full((batch,), 50, device="cuda", dtype=torch.int32)
    top_p = torch.full((batch,), 0.9, device="cuda")

    def step():
        probs = sampling.softmax(logits, temperature)
        return sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, filter_apply_order="joint")

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    keep = reference.top_k_keep_mask(reference.softmax(logits, temperature), 50)
    seen = []
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert keep[torch.arange(batch, device="cuda"), out.long()].all()
        seen.append(out.clone())
    assert any(not torch.equal(seen[0], s) for s in seen[1:])


def test_whole_row_kinds_named():
    """The GPU's whole-row switch names only kinds the launchers ask for (a misspelt kind would
    silently keep the segmented passes)."""
    assert set(filter(None, sampling._GPU_WHOLE_ROWS.split(","))) <= set(sampling._WHOLE_ROW_KINDS)
    assert sampling._whole_rows("softmax", 32000, 256, 128) == ("softmax" in sampling._INTERP_WHOLE_ROWS.split(","))
