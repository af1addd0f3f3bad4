"""tritoninfer.sampling: FlashInfer 0.5.3's ``flashinfer.sampling``, sort-free and graph-safe.

Probabilities and logits are 2-D ``[num_rows, vocab_size]`` float32, float16 or bfloat16 tensors
(read as float32; the vocabulary dim must be contiguous, other strides are free). Samples come back
as int32 ``[batch_size]``; renormalised probabilities, masked logits and softmax outputs as float32
``[num_rows, vocab_size]``, as in FlashInfer.

Semantics (``tritoninfer.reference.sampling`` states them exactly): top-k keeps every entry ``>=``
the k-th largest (ties kept), top-p keeps the largest entries up to and including the one whose
mass crosses ``top_p``, min-p keeps ``p >= min_p * max(p)``; entries of probability 0 are never
sampled. Within the kept set the sample follows the probabilities renormalised, so rows need not sum
to exactly 1.

Randomness: each output row uses uniform numbers drawn with ``torch.rand`` from ``generator`` (the
device's default generator when ``None``) on the device, then read by the kernel (the rejection
sampler's later rounds draw in-kernel Philox numbers seeded from those); the same generator state
gives the same samples, and nothing synchronises with the host (a sampling step can be
captured in a CUDA graph; with the default generator each replay draws new numbers, a generator of
your own must be registered with the graph, ``torch.cuda.CUDAGraph.register_generator_state``). ``check_nan=True`` synchronises: it reads the input on the host to raise
on NaN (and checks ``indices`` bounds). ``deterministic`` is accepted: the kernels are always
deterministic. ``enable_pdl`` is accepted and has no effect (Triton launches do not expose PDL).

Per-row parameters (``top_k``, ``top_p``, ``min_p``, ``temperature``) are a Python number for all
rows or a 1-D tensor: of length ``num_rows`` (one per distribution, indexed through ``indices``), or,
with ``indices``, of length ``batch_size`` (one per output). Scalars are checked on the host
(``top_k >= 1``, ``0 < top_p <= 1``, ``0 <= min_p <= 1``, ``temperature >= 0``); tensor values are
not read on the host: in a tensor, ``top_k <= 0`` or ``>= vocab_size`` means no top-k filter,
``top_p >= 1`` no top-p filter and ``top_p <= 0`` keeps the largest entries only.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

import torch

from . import _device, _ops
from ._launch import CachedLauncher
from ._options import INDEX_DTYPES
from ._plan import cdiv, next_pow2
from .kernels import sampling as _k

__all__ = [
    "softmax",
    "sampling_from_probs",
    "sampling_from_logits",
    "top_p_sampling_from_probs",
    "top_k_sampling_from_probs",
    "min_p_sampling_from_probs",
    "top_k_top_p_sampling_from_probs",
    "top_k_top_p_sampling_from_logits",
    "top_p_renorm_probs",
    "top_p_renorm_prob",
    "top_k_renorm_probs",
    "top_k_renorm_prob",
    "top_k_mask_logits",
    "chain_speculative_sampling",
]

_RADIX_PASS = CachedLauncher(_k.radix_pass_kernel)
_MAX_PASS = CachedLauncher(_k.max_pass_kernel)
_SAMPLE_MASS = CachedLauncher(_k.sample_mass_kernel)
_SAMPLE_PICK = CachedLauncher(_k.sample_pick_kernel)
_RENORM_MASS = CachedLauncher(_k.renorm_mass_kernel)
_RENORM_WRITE = CachedLauncher(_k.renorm_write_kernel)
_BOUND_PASS = CachedLauncher(_k.bound_pass_kernel)
_COMPACT = CachedLauncher(_k.compact_kernel)
_COMPACT_FINISH = CachedLauncher(_k.compact_finish_kernel)
_REJECTION_SAMPLE = CachedLauncher(_k.rejection_sample_kernel)
_SAMPLE_ROW = CachedLauncher(_k.sample_row_kernel)
_TOP_K_ROW = CachedLauncher(_k.top_k_row_kernel)
_SOFTMAX_PARTIAL = CachedLauncher(_k.softmax_partial_kernel)
_SOFTMAX_WRITE = CachedLauncher(_k.softmax_write_kernel)
_SOFTMAX_ROW = CachedLauncher(_k.softmax_row_kernel)
_CHAIN = CachedLauncher(_k.chain_speculative_kernel)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ORDERS = ("top_k_first", "joint")
# Tiles: the top-p digit pass keeps a [BLOCK, 16] per-lane mass accumulator (64 registers a thread at
# 512 with 4 warps), so it gets a smaller tile than the streaming passes; the top-k-only passes and the
# bound pass take the streaming tile (one histogram call, a shared-memory round trip, per tile).
_GPU_BLOCK_SEARCH = 512
_GPU_BLOCK_STREAM = 2048
# Segments: a row is split until rows x segments reaches 8 programs an SM (a program's tile loop is
# load-latency bound: 8 resident programs hide it), but no segment shorter than this (a pass's
# [segments, 256] partials stay small enough to re-read in every program). Not yet tuned on a GPU.
_GPU_PROGRAMS_PER_SM = 8
# the pick's largest single tile (``_Split.pick``)
_GPU_BLOCK_PICK = 4096
# the bound pass's largest tile (``_Split.bound``): 2,048, the streaming tile, measured; 8,192 would make
# a quarter of the histogram calls (three barriers each in the sm_90 SASS), to try with `bench --set`
_GPU_BLOCK_BOUND = 2048
# the rejection sampler's tile and warps (one program streams a whole row, so these set the bytes it
# keeps in flight). Measured on the H200 (bench sampling, top-p 0.9 of 128K / 152K): 2,048 lanes and 8
# warps took 43.7 / 43.7 us at 64 rows and 102.2 / 100.6 at 256; 4,096 and 16 warps 35.3 / 41.1 and
# 91.4 / 108.8 (and 17.7 / 19.8 at one row). With top-k the sampler keeps two more per-lane counts, and
# 16 warps (128 registers a thread at most) spill (ptxas for sm_90): 2,048 and 8 there. Module constants
# for `bench --set` A/Bs.
_GPU_REJECTION_BLOCK = 4096
_GPU_REJECTION_WARPS = 16
_GPU_REJECTION_BLOCK_TOP_K = 2048
_GPU_REJECTION_WARPS_TOP_K = 8
_GPU_MIN_SEGMENT = 4096
# The per-row arrays of segment partials (and the rejection sampler's per-tile gather) are at least
# this wide: Triton 3.6's scan lowering asserts (ScanOpToLLVM, on the GPU; the CPU build compiles it)
# on a [1, n] cumsum whose n is below the elements a thread holds in the layout it inherits from the
# tiles (4), seen on the H200 at n = 1, 2.
_GPU_MIN_SEGS_P2 = 8
# Under the interpreter each op costs about the same whatever its size: whole rows, many rows per
# program (the search's [ROWS, BLOCK, 16] intermediate stays near this many elements).
_INTERP_ELEMS = 1 << 20  # Triton's largest tensor
# the tile and the segment under the interpreter: whole rows, unless a test lowers them to walk the
# multi-tile loops and the multi-segment combine
_INTERP_MAX_BLOCK = 1 << 16
_INTERP_MAX_SEGMENT = 1 << 16
# Compaction (kernels/sampling.py): rows with at most this many candidates (entries at or above the
# filters' bound bin) are finished on a [rows, _CAP] copy, one program a row; the rest take the full
# passes. LLM-like rows have tens to a few hundred candidates for top-k 50 and a few hundred to a
# couple of thousand for top-p 0.9; the bench's flat rows (softmax(randn * 3) over 128-152K) keep
# 4.5-7.7K for top-p 0.9 and have 4.9-8.2K candidates with the probability bins; flatter rows
# (randn * 2) keep and have 30-38K, where one program a row would be slower than the segmented
# passes. The finish only walks a row's own candidates, so a larger cap costs memory (8 bytes an
# entry), not time. 0: every row takes the full passes (tests). 32K, not 16K: the flat rows of 262K
# entries have ~17K candidates for top-p 0.9, and the full passes took top_p_renorm_probs to 1.1 ms at
# 64 x 262K and 3.6 ms at 256 rows on the H200 (FlashInfer 0.62 and 1.45).
_CAP = 32768
# ... and the copy is kept under this many bytes: a batch of millions of rows (FlashInfer's tests draw
# 5M samples of one row through ``indices``) gets a smaller cap, and below _MIN_CAP none (full passes)
_COMPACT_BYTES = 1 << 30
_MIN_CAP = 256
# Top-k, top-p and joint top-k/top-p sampling of probabilities: the rows the compaction does not
# finish are sampled by rejection (``rejection_sample_kernel``, ~1-3 rounds of two reads, one launch)
# instead of the digit passes + mass + pick (6-10 launches); False: the passes (tests compare both).
# Draws sharing a source row keep the passes, which then run once per source row.
_REJECTION = True
_MAX_ROUNDS = 64
# ... and from this many rows every row goes to the rejection sampler, without the compaction first:
# a row then costs 1 + rounds reads either way, but the compaction's bound pass and copy are two
# reads more for rows it cannot finish (flat rows' top-p sets are thousands of entries)
_REJECTION_ONLY_ROWS = 64
# ... and top-p alone at any batch: a row's top-p finish walks its thousands of candidates ~10 times
# (1 x 128K on the H200: 2.8 + 4.8 + ~56 us for bound, copy and finish) where the rejection sampler
# takes ~2-3 reads of the row (17.7 us with the uniform draw, the 4,096-lane 16-warp tile)
_TOP_P_REJECTION_ONLY_ROWS = 1
# Many short rows: one program a whole row (one read, where the segmented passes read twice; on the
# H200 those were 0.85-0.94x FlashInfer at 256-1024 x 32K for softmax, min-p and the top-k mask, whose
# kernels keep such rows on chip): softmax; plain and min-p sampling (the row in chunks); the top-k
# renorm, mask and renorm parameters (the threshold by 32 counts of the row in registers). 32K floats
# are 64 registers a thread at 16 warps. Which kinds take them (comma-separated, of _WHOLE_ROW_KINDS),
# from an A/B on the H200 at 256 / 1024 x 32K, graph replay (benchmarks/NOTES.md, session 15):
# softmax 29.6 / 112.3 -> 23.4 / 71.3 us, min-p 25.0 / 89.7 -> 24.3 / 76.7, the top-k mask 102.3 /
# 366.0 -> 77.3 / 296.2 (compute-bound: ~3x the instruction estimate); slower, so off: plain sampling
# 17.5 / 47.0 -> 20.4 / 61.4 (its passes already read near the copy rate), the top-k renorm 86.5 /
# 306.1 -> 94.4 / 362.3 and the fused top-k-first 107.3 / 352.3 -> 122.8 / 405.6 (its parameters).
# Under the interpreter, whose cost is per program, only when a test asks.
_WHOLE_ROW_KINDS = ("softmax", "sample", "min_p", "top_k_mask", "top_k_renorm")
_GPU_WHOLE_ROWS = "softmax,min_p,top_k_mask"
_INTERP_WHOLE_ROWS = ""
_WHOLE_ROW_MAX_VOCAB = 32768
_GPU_WHOLE_ROW_WARPS = 16
_SOFTMAX_ROW_MIN_ROWS = 128
_SAMPLE_ROW_MIN_ROWS = 128
_TOP_K_ROW_MIN_ROWS = 128
_SAMPLE_ROW_CHUNK = 2048


# The compaction's copy loads its tiles in the layout of its scattered stores (kernels/sampling.py,
# _scatter_tile); False: 16-byte loads and a conversion at every store (the A/B of that change)
_GPU_SCATTER_LAYOUT = True
# the finish's chunk of candidates ([CBLOCK, 16] one-hot in the top-p rounds, as the search tile)
_GPU_BLOCK_FINISH = 512

Param = Union[torch.Tensor, float, int]


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------


def _check_rows(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [num_rows, vocab_size], got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}")
    if t.shape[1] == 0:
        raise ValueError(f"{name}: the vocabulary dim is empty (shape {tuple(t.shape)})")
    if t.shape[1] > 1 and t.stride(1) != 1:
        t = t.contiguous()
    return t


def _check_nan(t: torch.Tensor, name: str, check: bool) -> None:
    if check and bool(torch.isnan(t).any()):
        raise ValueError(f"{name}: contains NaN (check_nan=True)")


def _check_indices(indices, num_rows: int, device: torch.device, check: bool) -> int:
    """The batch size (``len(indices)``, or ``num_rows`` without indices)."""
    if indices is None:
        return num_rows
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a torch.Tensor or None, got {type(indices).__name__}")
    if indices.dim() != 1:
        raise ValueError(f"indices: expected a 1-D tensor [batch_size], got shape {tuple(indices.shape)}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"indices: expected dtype int32 or int64, got {indices.dtype}")
    if indices.device != device:
        raise ValueError(f"indices: expected a tensor on {device}, got one on {indices.device}")
    if num_rows == 0 and indices.numel():
        raise ValueError("indices: the input has no rows to index")
    if check and indices.numel() and (bool((indices < 0).any()) or bool((indices >= num_rows).any())):
        raise ValueError(f"indices: values must lie in [0, {num_rows}) (the rows of the input)")
    return indices.shape[0]


def _check_generator(generator, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    if torch.device(generator.device).type != device.type:
        raise ValueError(f"generator: expected a generator on {device.type}, got one on {generator.device}")


def _sampling_input(x, name: str, indices, generator, check_nan: bool) -> Tuple[torch.Tensor, int]:
    """A sampling function's input rows, checked with its ``indices`` and ``generator``, and the batch
    size (outputs)."""
    x = _check_rows(x, name)
    _check_generator(generator, x.device)
    return x, _check_indices(indices, x.shape[0], x.device, check_nan)


def _tensor_param(param: torch.Tensor, name: str, num_rows: int, batch: int, device, dtype) -> Tuple[torch.Tensor, bool]:
    """(the parameter as a contiguous ``dtype`` tensor, indexed by source row?)"""
    # the phrases after the name are FlashInfer's (its tests match them)
    if param.dim() == 0:
        raise ValueError(
            f"{name}: Expected a 1D tensor of shape (batch_size,) or scalar for the sampling parameter, "
            f"but got a 0-dimensional tensor with shape {tuple(param.shape)}."
        )
    if param.dim() > 1:
        raise ValueError(
            f"{name}: Expected a 1D tensor or scalar for the sampling parameter, "
            f"but got a {param.dim()}D tensor with shape {tuple(param.shape)}."
        )
    n = param.shape[0]
    if n not in (num_rows, batch):
        allowed = f"{num_rows}" if num_rows == batch else f"{num_rows} (one per row) or {batch} (one per output)"
        raise ValueError(
            f"{name}: Sampling parameter tensor batch size mismatch: expected length {allowed}, "
            f"got length {n} with shape {tuple(param.shape)}."
        )
    if param.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {param.device}")
    if param.is_complex() or param.dtype == torch.bool:
        raise ValueError(f"{name}: expected a real-valued tensor, got dtype {param.dtype}")
    return param.to(dtype).contiguous(), n == num_rows


def _scalar(param, name: str, integral: bool):
    if isinstance(param, bool) or not isinstance(param, numbers.Real):
        raise TypeError(f"{name}: expected a number or a 1-D torch.Tensor, got {type(param).__name__}")
    if integral:
        if not float(param).is_integer():
            raise ValueError(f"{name}: expected an integer, got {param!r}")
        return int(param)
    return float(param)


class _Params:
    """A parameter split into (array or None, scalar value, array indexed by source row)."""

    def __init__(self, arr: Optional[torch.Tensor], val, by_source: bool = True):
        self.arr, self.val, self.by_source = arr, val, by_source


def _top_k(top_k, num_rows: int, batch: int, device) -> _Params:
    if isinstance(top_k, torch.Tensor):
        arr, by_source = _tensor_param(top_k, "top_k", num_rows, batch, device, torch.int32)
        return _Params(arr, 0, by_source)
    k = _scalar(top_k, "top_k", integral=True)
    if k <= 0:
        raise ValueError(f"top_k: expected an integer >= 1, got {k}")
    return _Params(None, min(k, 2**31 - 1))


def _top_p(top_p, num_rows: int, batch: int, device) -> _Params:
    if isinstance(top_p, torch.Tensor):
        arr, by_source = _tensor_param(top_p, "top_p", num_rows, batch, device, torch.float32)
        return _Params(arr, 0, by_source)
    p = _scalar(top_p, "top_p", integral=False)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p: expected a value in (0, 1], got {p}")
    return _Params(None, p)


def _min_p(min_p, num_rows: int, batch: int, device) -> _Params:
    if isinstance(min_p, torch.Tensor):
        arr, by_source = _tensor_param(min_p, "min_p", num_rows, batch, device, torch.float32)
        return _Params(arr, 0, by_source)
    p = _scalar(min_p, "min_p", integral=False)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"min_p: expected a value in [0, 1], got {p}")
    return _Params(None, p)


def _by_source(*params: Optional[_Params]) -> bool:
    arrays = [p for p in params if p is not None and p.arr is not None]
    if len({p.by_source for p in arrays}) > 1:
        raise ValueError("top_k, top_p: per-row tensors must both have one entry per input row or both "
                         "one per output (len(indices))")
    return arrays[0].by_source if arrays else True


# --------------------------------------------------------------------------------------------------
# launches
# --------------------------------------------------------------------------------------------------


def _whole_rows(kind: str, vocab: int, rows: int, min_rows: int) -> bool:
    """Whether ``rows`` rows of ``vocab`` entries take the one-program-a-row kernel of ``kind`` (one of
    ``_WHOLE_ROW_KINDS``)."""
    on = _INTERP_WHOLE_ROWS if _device.is_interpreter() else _GPU_WHOLE_ROWS
    return kind in on.split(",") and vocab <= _WHOLE_ROW_MAX_VOCAB and rows >= min_rows


def _tiles(vocab: int, rows: int, search: bool) -> Tuple[int, int, int, int]:
    """(ROWS, BLOCK, NUM_TILES, num_warps) of the one-program-per-row kernels (softmax, chain)."""
    if _device.is_interpreter():
        block = min(next_pow2(vocab), _INTERP_MAX_BLOCK)
        per_row = block * (16 if search else 1)
        return max(1, min(next_pow2(rows), _INTERP_ELEMS // per_row)), block, cdiv(vocab, block), 4
    block = min(next_pow2(vocab), _GPU_BLOCK_SEARCH if search else _GPU_BLOCK_STREAM)
    return 1, block, cdiv(vocab, block), 4 if block <= 512 else 8


def _rejection_tiles(vocab: int, rows: int, use_k: bool) -> Tuple[int, int, int, int]:
    """``_tiles`` of the rejection sampler: on the GPU its tile and warps are ``_GPU_REJECTION_*``
    (``..._TOP_K`` with a top-k filter)."""
    if _device.is_interpreter():
        return _tiles(vocab, rows, search=False)
    block, warps = (_GPU_REJECTION_BLOCK_TOP_K, _GPU_REJECTION_WARPS_TOP_K) if use_k else \
        (_GPU_REJECTION_BLOCK, _GPU_REJECTION_WARPS)
    block = min(next_pow2(vocab), int(block))
    return 1, block, cdiv(vocab, block), int(warps) if block > 512 else 4


class _Split:
    """How the segmented kernels cover ``[rows, vocab]``: ``ROWS`` rows a program, ``segs`` segments
    of ``seg_len`` entries a row (grid ``(cdiv(rows, ROWS), segs)``), and each kind of pass's tile."""

    def __init__(self, vocab: int, rows: int, device: torch.device, short: bool = False):
        """``short``: the shortest segments whatever the batch (plain sampling: its pick scans one
        segment a row in one tile, and the mass pass has no per-segment combine to pay for)."""
        self.short = short
        if _device.is_interpreter():
            self.seg_len = min(next_pow2(vocab), _INTERP_MAX_SEGMENT)
            self.block_stream = self.block_search = min(self.seg_len, _INTERP_MAX_BLOCK)
            self.segs = cdiv(vocab, self.seg_len)
            self.segs_p2 = next_pow2(self.segs)
            # keep the [ROWS, BLOCK, 16] one-hot and the [ROWS, SEGS, 256] partials near the budget
            per_row = max(self.block_search * 16, self.segs_p2 * 256)
            self.rows = max(1, min(next_pow2(rows), _INTERP_ELEMS // per_row))
            self.warps_stream = self.warps_search = 4
        else:
            segs = cdiv(vocab, _GPU_MIN_SEGMENT)
            if not short:
                segs = max(1, min(cdiv(_GPU_PROGRAMS_PER_SM * _device.num_sms(device), rows), segs))
            align = min(_GPU_BLOCK_STREAM, next_pow2(vocab))
            self.seg_len = cdiv(cdiv(vocab, segs), align) * align
            self.segs = cdiv(vocab, self.seg_len)
            self.segs_p2 = max(next_pow2(self.segs), _GPU_MIN_SEGS_P2)
            self.block_stream, self.block_search = align, min(align, _GPU_BLOCK_SEARCH)
            self.rows = 1
            # 8 warps for the search too: its [512, 16] per-lane mass accumulator takes 192 registers
            # a thread at 4 warps (2 programs an SM), ~110 at 8 (ptxas for sm_90)
            self.warps_stream, self.warps_search = 8, 8
        self.grid = (cdiv(rows, self.rows), self.segs)

    def stream(self) -> dict:
        return dict(ROWS=self.rows, SEGS_P2=self.segs_p2, BLOCK=self.block_stream,
                    NUM_TILES=self.seg_len // self.block_stream, num_warps=self.warps_stream)

    def bound(self) -> dict:
        """The bound pass's tiles: the streaming tile, on the GPU widened (up to
        ``_GPU_BLOCK_BOUND`` entries, within a segment) so that fewer ``tl.histogram`` calls, each with
        its shared-memory merge and barriers, cover a segment."""
        tiles = self.stream()
        if not _device.is_interpreter():
            block = tiles["BLOCK"]
            while block * 2 <= int(_GPU_BLOCK_BOUND) and self.seg_len % (block * 2) == 0:
                block *= 2
            tiles.update(BLOCK=block, NUM_TILES=self.seg_len // block)
        return tiles

    def pick(self) -> dict:
        """The pick's tiles (``sample_pick_kernel``): the compaction's (its candidates are in the
        same lane-major order), or for plain sampling (``short``, no compaction) the whole segment
        when it is at most ``_GPU_BLOCK_PICK`` entries: one load, then index order."""
        tiles = self.stream()
        if self.short and not _device.is_interpreter() and self.seg_len <= _GPU_BLOCK_PICK:
            tiles.update(BLOCK=self.seg_len, NUM_TILES=1)
        tiles["TILES_P2"] = max(next_pow2(tiles["NUM_TILES"]), _GPU_MIN_SEGS_P2)
        return tiles

    def search(self) -> dict:
        return dict(ROWS=self.rows, SEGS_P2=self.segs_p2, BLOCK=self.block_search,
                    NUM_TILES=self.seg_len // self.block_search, num_warps=self.warps_search)


def _search_scratch(batch: int, segs: int, device, use_k: bool, use_p: bool):
    """(k_state, k_part, p_state, p_part): per-pass prefixes and the double-buffered per-segment
    histograms of the radix searches (None for a search that does not run)."""
    k_state = k_part = p_state = p_part = None
    if use_k:
        k_state = torch.empty((int(_k.K_PASSES), batch), dtype=torch.int32, device=device)
        k_part = torch.empty((2, batch, segs, int(_k.K_BINS)), dtype=torch.int32, device=device)
    if use_p:
        p_state = torch.empty((int(_k.P_PASSES), batch), dtype=torch.int32, device=device)
        p_part = torch.empty((2, batch, segs, int(_k.P_BINS)), dtype=torch.float32, device=device)
    return k_state, k_part, p_state, p_part


def _radix_passes(split: _Split, x, indices, k_arr, p_arr, k_val, p_val, batch, scratch,
                  use_k: bool, use_p: bool, by_source: bool, gate=None) -> None:
    """The launches of the top-k (4) and top-p (8) digit searches; the joint search shares them.
    ``gate``: (array, min): only rows with ``array[row] > min`` run (the compaction's fallback)."""
    num_rows, vocab = x.shape
    passes = int(_k.P_PASSES) if use_p else int(_k.K_PASSES) if use_k else 0
    gate_arr, gate_min = gate if gate is not None else (None, 0)
    for d in range(passes):
        _RADIX_PASS[split.grid](
            x, indices, k_arr, p_arr, *scratch, gate_arr, k_val, p_val, batch, num_rows, vocab, x.stride(0),
            split.segs, gate_min, PASS=d, HAS_INDICES=indices is not None, GATE=gate is not None, USE_K=use_k,
            USE_P=use_p, K_ARR=k_arr is not None, P_ARR=p_arr is not None, PARAM_BY_SOURCE=by_source,
            **(split.search() if use_p else split.stream()),
        )


class _Compacted:
    """What the compaction leaves for the full passes: ``ncand`` [rows] (``> cap``: overflowed),
    ``fin`` (renorm thresholds, or None)."""

    def __init__(self, ncand, cap, fin):
        self.ncand, self.cap, self.fin = ncand, cap, fin

    def gate(self):
        return self.ncand, self.cap


def _compact_cap(batch: int) -> int:
    """The compaction's candidates a row for a batch of ``batch`` rows; 0: no compaction."""
    cap = min(int(_CAP), _COMPACT_BYTES // (8 * max(batch, 1)))
    return cap if cap >= min(_MIN_CAP, int(_CAP)) else 0


def _compact(split: _Split, x, indices, batch, cap: int, k_arr, p_arr, k_val, p_val, use_k: bool, use_p: bool,
             by_source: bool, u=None, out=None, prob_bins: bool = True,
             renorm: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> _Compacted:
    """The bound pass, the compaction and the finish (the sample into ``out``, or with ``out`` None
    the renorm thresholds) of every row with at most ``cap`` (> 0) candidates. ``prob_bins``: ``x``
    holds probabilities (the bound's bins are finer between 2**-32 and 1); False for logits.
    ``renorm``: the rows read top-k renormalised (``_sample``)."""
    rt, rinv = renorm or (None, None)
    num_rows, vocab = x.shape
    dev = x.device
    segs = split.segs
    has_idx = indices is not None
    cnt_part = torch.empty((batch, segs, _k.bound_bins(prob_bins)), dtype=torch.int32, device=dev)
    sum_part = torch.empty((batch, segs), dtype=torch.float32, device=dev) if use_p else None
    tiles = split.bound()  # a histogram and sums (one histogram call a tile)
    _BOUND_PASS[split.grid](x, indices, cnt_part, sum_part, rt, rinv, batch, num_rows, vocab, x.stride(0),
                            segs, HAS_INDICES=has_idx, NEED_SUM=use_p, PROB_BINS=prob_bins,
                            RENORMED=rt is not None, ROWS=tiles["ROWS"],
                            BLOCK=tiles["BLOCK"], NUM_TILES=tiles["NUM_TILES"], num_warps=tiles["num_warps"])
    ncand = torch.empty(batch, dtype=torch.int32, device=dev)
    cval = torch.empty((batch, cap), dtype=torch.float32, device=dev)
    cid = torch.empty((batch, cap), dtype=torch.int32, device=dev)
    flags = dict(USE_K=use_k, USE_P=use_p, K_ARR=k_arr is not None, P_ARR=p_arr is not None,
                 PARAM_BY_SOURCE=by_source)
    _COMPACT[split.grid](x, indices, k_arr, p_arr, cnt_part, sum_part, ncand, cval, cid, rt, rinv,
                         k_val, p_val, batch, num_rows, vocab, x.stride(0), segs, cap, HAS_INDICES=has_idx,
                         PROB_BINS=prob_bins, RENORMED=rt is not None,
                         OPAQUE=bool(_GPU_SCATTER_LAYOUT) and not _device.is_interpreter(), **flags, **split.stream())
    fin = None
    if out is None:
        fin = (torch.empty(batch, dtype=torch.int32, device=dev), torch.empty(batch, dtype=torch.int32, device=dev),
               torch.empty(batch, dtype=torch.float32, device=dev))
    rows, cblock, warps = _finish_tiles(cap, vocab, batch)
    _COMPACT_FINISH[(cdiv(batch, rows),)](
        indices, u, out, k_arr, p_arr, ncand, cval, cid, *(fin or (None, None, None)),
        k_val, p_val, batch, num_rows, vocab, cap, HAS_INDICES=has_idx, RENORM=out is None, **flags,
        ROWS=rows, CBLOCK=cblock, num_warps=warps)
    return _Compacted(ncand, cap, fin)


def _finish_tiles(cap: int, vocab: int, batch: int) -> Tuple[int, int, int]:
    """(ROWS, CBLOCK, num_warps) of ``compact_finish_kernel``."""
    if _device.is_interpreter():
        cblock = min(next_pow2(max(1, min(cap, vocab))), _INTERP_MAX_BLOCK)
        # the [ROWS, CBLOCK, 16] one-hot and the [ROWS * 256] histogram near the budget
        rows = max(1, min(next_pow2(batch), _INTERP_ELEMS // max(cblock * 16, int(_k.K_BINS))))
        return rows, cblock, 4
    return 1, _GPU_BLOCK_FINISH, 8  # the per-lane top-p accumulator: 200 registers at 4 warps, 80 at 8


def _uniforms(n: int, device: torch.device, generator: Optional[torch.Generator]) -> torch.Tensor:
    if generator is None:
        # without the argument: torch.compile's fake tensors cannot run rand(generator=None) at a
        # symbolic size (a second batch size makes it one)
        return torch.rand(n, device=device, dtype=torch.float32)
    return torch.rand(n, device=device, dtype=torch.float32, generator=generator)


def _sample(x: torch.Tensor, indices, generator, *, is_logits=False, top_k: Optional[_Params] = None,
            top_p: Optional[_Params] = None, min_p: Optional[_Params] = None,
            renorm: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``renorm``: (threshold keys, 1 / Z) of each row's top-k renorm (``_renorm_params``), applied as
    the rows are read (top-p only; ``_renorm_on_load`` says when)."""
    num_rows, vocab = x.shape
    batch = num_rows if indices is None else indices.shape[0]
    out = torch.empty(batch, dtype=torch.int32, device=x.device)
    if batch == 0:
        return out
    u = _uniforms(batch, x.device, generator)
    if indices is not None:
        indices = indices.contiguous()
    p = top_p if top_p is not None else min_p
    (_sample_op if _ops.compiling() else _launch_sample)(
        x, indices, u, out, top_k.arr if top_k is not None else None, p.arr if p is not None else None,
        top_k.val if top_k is not None and top_k.arr is None else 0,
        float(p.val) if p is not None and p.arr is None else 1.0,
        is_logits, top_k is not None, top_p is not None, min_p is not None, _by_source(top_k, p),
        *(renorm or (None, None)))
    return out


def _launch_sample(x: torch.Tensor, indices: Optional[torch.Tensor], u: torch.Tensor, out: torch.Tensor,
                   k_arr: Optional[torch.Tensor], p_arr: Optional[torch.Tensor], k_val: int, p_val: float,
                   is_logits: bool, use_k: bool, use_p: bool, use_min_p: bool, by_source: bool,
                   rt: Optional[torch.Tensor] = None, rinv: Optional[torch.Tensor] = None) -> None:
    """The sampling kernels over checked arguments: ``out[i]`` from row ``indices[i]`` (or ``i``) of ``x``
    with uniform ``u[i]``; ``k_arr``/``p_arr`` per-row parameters or ``k_val``/``p_val`` for all rows
    (``p`` is top-p's or min-p's). With a top-k or top-p filter, rows with at most ``_CAP`` candidates
    are finished on their compacted copy; the rest take the rejection sampler (top-k / top-p of
    probabilities, one launch) or the full passes (gated, every launch still made: fixed shapes, no
    host sync), as min-p does. From ``_REJECTION_ONLY_ROWS`` rows (top-p alone:
    ``_TOP_P_REJECTION_ONLY_ROWS``) the rejection sampler takes every row of the functions it serves.
    ``rt``/``rinv``: the rows are read top-k renormalised (top-p only, where ``_renorm_on_load``)."""
    _device.check_launchable(x.device, "sampling")
    num_rows, vocab = x.shape
    batch = out.shape[0]
    if not (use_k or use_p) and _whole_rows("min_p" if use_min_p else "sample", vocab, batch, _SAMPLE_ROW_MIN_ROWS) \
            and (indices is None or batch <= num_rows):
        # (draws that share rows keep the passes, which run once per source row)
        block = next_pow2(vocab)
        _SAMPLE_ROW[(batch,)](x, indices, p_arr, u, out, p_val, batch, num_rows, vocab, x.stride(0),
                              HAS_INDICES=indices is not None, IS_LOGITS=is_logits, USE_MIN_P=use_min_p,
                              P_ARR=p_arr is not None, PARAM_BY_SOURCE=by_source, BLOCK=block,
                              CHUNK=min(block, _SAMPLE_ROW_CHUNK), num_warps=_GPU_WHOLE_ROW_WARPS)
        return
    split = _Split(vocab, batch, x.device, short=not (use_k or use_p or use_min_p))
    gate = None
    cap = _compact_cap(batch)
    only_rows = _TOP_P_REJECTION_ONLY_ROWS if use_p and not use_k else _REJECTION_ONLY_ROWS
    if _REJECTION and batch >= only_rows and (use_k or use_p) and not (use_min_p or is_logits) \
            and not _per_source(indices, by_source, None, batch, num_rows):
        cap = 0  # enough rows to fill the GPU with one program a row: the compaction's two reads are spent
    # min-p alone: its pivot needs only the row max, so the max pass, the mass and the pick (two
    # reads and a segment) beat the bound pass and the copy (the H200: 256 x 32K 68.9 us compacted
    # against FlashInfer's 22.3)
    if (use_k or use_p) and cap:
        gate = _compact(split, x, indices, batch, cap, k_arr, p_arr, k_val, p_val, use_k, use_p, by_source, u, out,
                        renorm=(rt, rinv) if rt is not None else None).gate()
    if (use_k or use_p) and not (use_min_p or is_logits) and _REJECTION \
            and not _per_source(indices, by_source, gate, batch, num_rows):
        rows, block, tiles, warps = _rejection_tiles(vocab, batch, use_k)
        gate_arr, gate_min = gate if gate is not None else (None, 0)
        # the seed of the later rounds' uniforms: the bits of u[0] (drawn from the caller's generator)
        _REJECTION_SAMPLE[(cdiv(batch, rows),)](
            x, indices, k_arr, p_arr, u, u, out, gate_arr, rt, rinv, k_val, p_val, batch, num_rows, vocab, x.stride(0),
            gate_min, HAS_INDICES=indices is not None, GATE=gate is not None, USE_K=use_k, USE_P=use_p,
            K_ARR=k_arr is not None, P_ARR=p_arr is not None, PARAM_BY_SOURCE=by_source, RENORMED=rt is not None,
            MAX_ROUNDS=_MAX_ROUNDS,
            ROWS=rows, BLOCK=block, NUM_TILES=tiles, TILES_P2=max(next_pow2(tiles), _GPU_MIN_SEGS_P2),
            num_warps=warps)
        return
    if rt is not None:
        raise AssertionError("rows renormalised on load reached the full passes (_renorm_on_load)")
    _sample_passes(split, x, indices, u, out, k_arr, p_arr, k_val, p_val, is_logits, use_k, use_p, use_min_p,
                   by_source, gate)


def _per_source(indices, by_source: bool, gate, batch: int, num_rows: int) -> bool:
    """Whether the full passes run once per source row (draws sharing rows, parameters by source)."""
    return indices is not None and by_source and gate is None and batch > num_rows


def _sample_passes(split: _Split, x, indices, u, out, k_arr, p_arr, k_val, p_val, is_logits, use_k, use_p,
                   use_min_p, by_source, gate) -> None:
    """The full passes: radix searches, row max, segment masses, the owner segment's pick. Where
    ``indices`` send more outputs than there are source rows and the parameters follow the source
    (parallel samples of one prompt; FlashInfer's tests draw 5M samples of one row), the searches,
    the max and the masses run once per source row and each output scans only its owner segment."""
    num_rows, vocab = x.shape
    batch = out.shape[0]
    per_source = _per_source(indices, by_source, gate, batch, num_rows)
    passes = _Split(vocab, num_rows, x.device) if per_source else split
    n, idx = (num_rows, None) if per_source else (batch, indices)
    scratch = _search_scratch(n, passes.segs, x.device, use_k, use_p)
    _radix_passes(passes, x, idx, k_arr, p_arr, k_val, p_val, n, scratch, use_k, use_p, by_source, gate)
    gate_arr, gate_min = gate if gate is not None else (None, 0)
    flags = dict(GATE=gate is not None, IS_LOGITS=is_logits, USE_K=use_k, USE_P=use_p, USE_MIN_P=use_min_p,
                 K_ARR=k_arr is not None, P_ARR=p_arr is not None, PARAM_BY_SOURCE=by_source)
    max_part = None
    if is_logits or use_min_p:
        max_part = torch.empty((n, passes.segs), dtype=torch.float32, device=x.device)
        _MAX_PASS[passes.grid](x, idx, max_part, n, num_rows, vocab, x.stride(0), passes.segs,
                               HAS_INDICES=idx is not None, ROWS=passes.rows, BLOCK=passes.block_stream,
                               NUM_TILES=passes.seg_len // passes.block_stream, num_warps=passes.warps_stream)
    z_part = torch.empty((n, passes.segs), dtype=torch.float32, device=x.device)
    _SAMPLE_MASS[passes.grid](x, idx, k_arr, p_arr, *scratch, max_part, z_part, gate_arr,
                              k_val, p_val, n, num_rows, vocab, x.stride(0), passes.segs, gate_min,
                              HAS_INDICES=idx is not None, **flags, **passes.stream())
    # the pick's rows a program come from the outputs' split, each scanning its owner segment of the
    # passes' split (the same segment length under the interpreter, one row a program on the GPU)
    _SAMPLE_PICK[(cdiv(batch, split.rows), 1)](x, indices, u, out, k_arr, p_arr, *scratch, max_part, z_part, gate_arr,
                       k_val, p_val, batch, num_rows, vocab, x.stride(0), passes.segs, gate_min,
                       HAS_INDICES=indices is not None, PER_SOURCE=per_source, **flags,
                       **dict(passes.pick(), ROWS=split.rows))


@_ops.custom_op("sample", mutates_args=("out",))
def _sample_op(x: torch.Tensor, indices: Optional[torch.Tensor], u: torch.Tensor, out: torch.Tensor,
               k_arr: Optional[torch.Tensor], p_arr: Optional[torch.Tensor], k_val: int, p_val: float,
               is_logits: bool, use_k: bool, use_p: bool, use_min_p: bool, by_source: bool,
               rt: Optional[torch.Tensor], rinv: Optional[torch.Tensor]) -> None:
    """``_launch_sample`` for torch.compile (``_ops.py``)."""
    _launch_sample(x, indices, u, out, k_arr, p_arr, k_val, p_val, is_logits, use_k, use_p, use_min_p, by_source,
                   rt, rinv)


def _renorm(x: torch.Tensor, *, top_k: Optional[_Params] = None, top_p: Optional[_Params] = None,
            mask_logits: bool = False) -> torch.Tensor:
    num_rows, vocab = x.shape
    out = torch.empty((num_rows, vocab), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out
    (_renorm_op if _ops.compiling() else _launch_renorm)(
        x, out, top_k.arr if top_k is not None else None, top_p.arr if top_p is not None else None,
        top_k.val if top_k is not None and top_k.arr is None else 0,
        float(top_p.val) if top_p is not None and top_p.arr is None else 1.0,
        top_k is not None, top_p is not None, mask_logits)
    return out


def _launch_renorm(x: torch.Tensor, out: Optional[torch.Tensor], k_arr: Optional[torch.Tensor],
                   p_arr: Optional[torch.Tensor], k_val: int, p_val: float, use_k: bool, use_p: bool,
                   mask_logits: bool, rt: Optional[torch.Tensor] = None, rinv: Optional[torch.Tensor] = None) -> None:
    """The renorm / mask kernels over checked arguments, into ``out`` [num_rows, vocab] float32: the
    thresholds of rows with at most ``_CAP`` candidates from their compacted copy, the full searches
    (gated) for the rest, then one write of every row. ``out`` None (top-k of probabilities): no row
    is written; ``rt``/``rinv`` [num_rows] get each row's threshold key and ``1 / Z`` instead."""
    _device.check_launchable(x.device, "sampling")
    num_rows, vocab = x.shape
    if use_k and not use_p and _whole_rows("top_k_mask" if mask_logits else "top_k_renorm", vocab, num_rows,
                                           _TOP_K_ROW_MIN_ROWS):
        block = next_pow2(vocab)
        _TOP_K_ROW[(num_rows,)](x, out, k_arr, rt, rinv, k_val, num_rows, vocab, x.stride(0),
                                0 if out is None else out.stride(0), K_ARR=k_arr is not None, MASK_LOGITS=mask_logits,
                                PARAMS_ONLY=out is None, BLOCK=block, CHUNK=min(block, _SAMPLE_ROW_CHUNK),
                                num_warps=_GPU_WHOLE_ROW_WARPS)
        return
    split = _Split(vocab, num_rows, x.device)
    cap = _compact_cap(num_rows)
    done = _compact(split, x, None, num_rows, cap, k_arr, p_arr, k_val, p_val, use_k, use_p, True,
                    prob_bins=not mask_logits) if cap else None
    # the full passes, gated to the rows the compaction left (every row without it); then one write of
    # every row, the compacted ones with the finish's thresholds
    gate, fin = (done.gate(), done.fin) if done else (None, None)
    scratch = _search_scratch(num_rows, split.segs, x.device, use_k, use_p)
    _radix_passes(split, x, None, k_arr, p_arr, k_val, p_val, num_rows, scratch, use_k, use_p, True, gate)
    gate_arr, gate_min = gate if gate is not None else (None, 0)
    flags = dict(USE_K=use_k, USE_P=use_p, K_ARR=k_arr is not None, P_ARR=p_arr is not None)
    z_part = None
    if not mask_logits:
        z_part = torch.empty((num_rows, split.segs), dtype=torch.float32, device=x.device)
        _RENORM_MASS[split.grid](x, k_arr, p_arr, *scratch, z_part, gate_arr, k_val, p_val, num_rows, vocab,
                                 x.stride(0), split.segs, gate_min, GATE=gate is not None, **flags, **split.stream())
    params_only = out is None
    grid = (split.grid[0], 1) if params_only else split.grid
    _RENORM_WRITE[grid](x, out, k_arr, p_arr, *scratch, z_part, gate_arr, *(fin or (None, None, None)), rt, rinv,
                        k_val, p_val, num_rows, vocab, x.stride(0), 0 if params_only else out.stride(0), split.segs,
                        gate_min, FIN=fin is not None, MASK_LOGITS=mask_logits, PARAMS_ONLY=params_only, **flags,
                        **split.stream())


@_ops.custom_op("renorm", mutates_args=("out",))
def _renorm_op(x: torch.Tensor, out: torch.Tensor, k_arr: Optional[torch.Tensor], p_arr: Optional[torch.Tensor],
               k_val: int, p_val: float, use_k: bool, use_p: bool, mask_logits: bool) -> None:
    """``_launch_renorm`` for torch.compile (``_ops.py``)."""
    _launch_renorm(x, out, k_arr, p_arr, k_val, p_val, use_k, use_p, mask_logits)


def _renorm_params(x: torch.Tensor, top_k: _Params) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int32 threshold keys, float32 ``1 / Z``) [num_rows] of ``top_k_renorm_probs(x, top_k)``: what
    ``_sample(renorm=...)`` applies as it reads ``x``, for the values the renorm would have written."""
    num_rows = x.shape[0]
    rt = torch.empty(num_rows, dtype=torch.int32, device=x.device)
    rinv = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    k_val = top_k.val if top_k.arr is None else 0
    (_renorm_params_op if _ops.compiling() else _launch_renorm_params)(x, rt, rinv, top_k.arr, k_val)
    return rt, rinv


def _launch_renorm_params(x: torch.Tensor, rt: torch.Tensor, rinv: torch.Tensor, k_arr: Optional[torch.Tensor],
                          k_val: int) -> None:
    _launch_renorm(x, None, k_arr, None, k_val, 1.0, True, False, False, rt, rinv)


@_ops.custom_op("renorm_params", mutates_args=("rt", "rinv"))
def _renorm_params_op(x: torch.Tensor, rt: torch.Tensor, rinv: torch.Tensor, k_arr: Optional[torch.Tensor],
                      k_val: int) -> None:
    """``_launch_renorm_params`` for torch.compile (``_ops.py``)."""
    _launch_renorm_params(x, rt, rinv, k_arr, k_val)


def _renorm_on_load(batch: int) -> bool:
    """Whether top-p sampling of a top-k renorm of ``batch`` outputs can read the rows renormalised
    rather than written: its routes then are the compaction and the rejection sampler only (the full
    passes, with ``_REJECTION`` off or without a compaction cap, read the written rows)."""
    return bool(_REJECTION) and _compact_cap(batch) > 0


def _launch_softmax(logits: torch.Tensor, out: torch.Tensor, t_arr: Optional[torch.Tensor], t_val: float) -> None:
    """The softmax kernel over checked arguments, into ``out`` [num_rows, vocab] float32."""
    _device.check_launchable(logits.device, "softmax")
    num_rows, vocab = logits.shape
    if _whole_rows("softmax", vocab, num_rows, _SOFTMAX_ROW_MIN_ROWS):
        _SOFTMAX_ROW[(num_rows,)](logits, out, t_arr, t_val, num_rows, vocab, logits.stride(0), out.stride(0),
                                  T_ARR=t_arr is not None, BLOCK=next_pow2(vocab), num_warps=_GPU_WHOLE_ROW_WARPS)
        return
    # rows split into segments as the sampling passes are (a row is one program's work only at large
    # batches): the max and the denominator per segment, then each segment written from its row's
    split = _Split(vocab, num_rows, logits.device)
    tiles = split.stream()
    max_part = torch.empty((num_rows, split.segs), dtype=torch.float32, device=logits.device)
    sum_part = torch.empty_like(max_part)
    _SOFTMAX_PARTIAL[split.grid](logits, t_arr, max_part, sum_part, t_val, num_rows, vocab, logits.stride(0),
                                 split.segs, T_ARR=t_arr is not None, ROWS=tiles["ROWS"], BLOCK=tiles["BLOCK"],
                                 NUM_TILES=tiles["NUM_TILES"], num_warps=tiles["num_warps"])
    _SOFTMAX_WRITE[split.grid](logits, out, t_arr, max_part, sum_part, t_val, num_rows, vocab, logits.stride(0),
                               out.stride(0), split.segs, T_ARR=t_arr is not None, **tiles)


@_ops.custom_op("softmax", mutates_args=("out",))
def _softmax_op(logits: torch.Tensor, out: torch.Tensor, t_arr: Optional[torch.Tensor], t_val: float) -> None:
    """``_launch_softmax`` for torch.compile (``_ops.py``)."""
    _launch_softmax(logits, out, t_arr, t_val)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def softmax(
    logits: torch.Tensor,
    temperature: Optional[Union[torch.Tensor, float]] = None,
    enable_pdl: Optional[bool] = None,
) -> torch.Tensor:
    r"""Softmax with temperature: ``softmax(logits / temperature)`` over the vocabulary, in float32.

    Parameters
    ----------
    logits : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32, float16 or bfloat16. ``-inf`` entries get
        probability 0 (a row of only ``-inf`` gives NaN, as ``torch.softmax`` does).
    temperature : Optional[Union[torch.Tensor, float]]
        A number ``>= 0`` for every row or a tensor of shape ``[batch_size]``; default 1. A
        temperature of 0 multiplies the logits by 0 (FlashInfer's convention), giving a uniform row.
    enable_pdl : Optional[bool]
        Accepted for compatibility; no effect.

    Returns
    -------
    probs : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32.
    """
    logits = _check_rows(logits, "logits")
    num_rows, vocab = logits.shape
    t_arr, t_val = None, 1.0
    if isinstance(temperature, torch.Tensor):
        t_arr, _ = _tensor_param(temperature, "temperature", num_rows, num_rows, logits.device, torch.float32)
    elif temperature is not None:
        t_val = _scalar(temperature, "temperature", integral=False)
        if t_val < 0:
            raise ValueError(f"temperature: expected a value >= 0, got {t_val}")
    out = torch.empty((num_rows, vocab), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    (_softmax_op if _ops.compiling() else _launch_softmax)(logits, out, t_arr, float(t_val))
    return out


_SAMPLING_ARGS = r"""
    indices : Optional[torch.Tensor]
        shape ``[batch_size]``, dtype int32 or int64: output ``i`` is drawn from row ``indices[i]``
        (rows shared by several outputs). Default: output ``i`` from row ``i``.
    deterministic : bool
        Accepted for compatibility: the kernels are always deterministic.
    generator : Optional[torch.Generator]
        Source of the uniform numbers (on the input's device); default: the device's default
        generator. The same generator state gives the same samples.
    check_nan : bool
        Raise ``ValueError`` if the input holds NaN (reads it on the host: synchronises).

    Returns
    -------
    samples : torch.Tensor
        shape ``[batch_size]``, dtype int32.
"""


def _doc(fn):
    fn.__doc__ = fn.__doc__.replace("    {sampling_args}\n", _SAMPLING_ARGS.strip("\n") + "\n")
    return fn


@_doc
def sampling_from_probs(
    probs: torch.Tensor,
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Draws one entry per output row with probability proportional to ``probs``.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16, non-negative.
    {sampling_args}
    """
    probs, _ = _sampling_input(probs, "probs", indices, generator, check_nan)
    _check_nan(probs, "probs", check_nan)
    return _sample(probs, indices, generator)


@_doc
def sampling_from_logits(
    logits: torch.Tensor,
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Draws one entry per output row from ``softmax(logits)`` (the softmax is fused: one pass for
    the max, one for the mass, one to draw).

    Parameters
    ----------
    logits : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    {sampling_args}
    """
    logits, _ = _sampling_input(logits, "logits", indices, generator, check_nan)
    _check_nan(logits, "logits", check_nan)
    return _sample(logits, indices, generator, is_logits=True)


@_doc
def top_p_sampling_from_probs(
    probs: torch.Tensor,
    top_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Top-p (nucleus) sampling: draws from the smallest set of largest entries whose mass reaches
    ``top_p`` (the entry that crosses ``top_p`` included, and its ties), renormalised.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    top_p : Union[torch.Tensor, float]
        A number in ``(0, 1]`` or a float tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    {sampling_args}
    """
    probs, batch = _sampling_input(probs, "probs", indices, generator, check_nan)
    params = _top_p(top_p, probs.shape[0], batch, probs.device)
    _check_nan(probs, "probs", check_nan)
    return _sample(probs, indices, generator, top_p=params)


@_doc
def top_k_sampling_from_probs(
    probs: torch.Tensor,
    top_k: Union[torch.Tensor, int],
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Top-k sampling: draws from the entries ``>=`` the k-th largest (ties with it kept),
    renormalised.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    top_k : Union[torch.Tensor, int]
        An integer ``>= 1`` or an integer tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    {sampling_args}
    """
    probs, batch = _sampling_input(probs, "probs", indices, generator, check_nan)
    params = _top_k(top_k, probs.shape[0], batch, probs.device)
    _check_nan(probs, "probs", check_nan)
    return _sample(probs, indices, generator, top_k=params)


@_doc
def min_p_sampling_from_probs(
    probs: torch.Tensor,
    min_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Min-p sampling: draws from the entries ``>= min_p * max(probs)`` of the row, renormalised.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    min_p : Union[torch.Tensor, float]
        A number in ``[0, 1]`` or a tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    {sampling_args}
    """
    probs, batch = _sampling_input(probs, "probs", indices, generator, check_nan)
    params = _min_p(min_p, probs.shape[0], batch, probs.device)
    _check_nan(probs, "probs", check_nan)
    return _sample(probs, indices, generator, min_p=params)


def _check_order(filter_apply_order) -> None:
    if filter_apply_order not in _ORDERS:
        raise ValueError(f"filter_apply_order: expected 'top_k_first' or 'joint', got {filter_apply_order!r}")


@_doc
def top_k_top_p_sampling_from_probs(
    probs: torch.Tensor,
    top_k: Union[torch.Tensor, int],
    top_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Top-k and top-p sampling.

    ``filter_apply_order="top_k_first"``: top-p sampling of the top-k-renormalised rows
    (``top_p_sampling_from_probs(top_k_renorm_probs(probs, top_k), top_p, ...)``). ``"joint"``: one
    kernel draws from the intersection of the top-k and the top-p sets of ``probs``.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    top_k : Union[torch.Tensor, int]
        An integer ``>= 1`` or an integer tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    top_p : Union[torch.Tensor, float]
        A number in ``(0, 1]`` or a float tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    filter_apply_order : str
        ``"top_k_first"`` (default) or ``"joint"``.
    {sampling_args}
    """
    _check_order(filter_apply_order)
    probs, batch = _sampling_input(probs, "probs", indices, generator, check_nan)
    k = _top_k(top_k, probs.shape[0], batch, probs.device)
    p = _top_p(top_p, probs.shape[0], batch, probs.device)
    by_source = _by_source(k, p)
    _check_nan(probs, "probs", check_nan)
    if filter_apply_order == "joint":
        return _sample(probs, indices, generator, top_k=k, top_p=p)
    if not by_source:
        # per-output top-k: renormalise each output's own copy of its row
        probs, indices = probs.index_select(0, indices), None
        k.by_source = p.by_source = True
    # literally top-p sampling of the top-k renorm (FlashInfer's pipeline tests compare the two for
    # equality), the renormalised rows read as they are computed rather than written and read back
    if _renorm_on_load(batch):
        return _sample(probs, indices, generator, top_p=p, renorm=_renorm_params(probs, k))
    return _sample(_renorm(probs, top_k=k), indices, generator, top_p=p)


@_doc
def top_k_top_p_sampling_from_logits(
    logits: torch.Tensor,
    top_k: Union[torch.Tensor, int],
    top_p: Union[torch.Tensor, float],
    indices: Optional[torch.Tensor] = None,
    filter_apply_order: str = "top_k_first",
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    check_nan: bool = False,
) -> torch.Tensor:
    r"""Top-k and top-p sampling from logits.

    ``"top_k_first"``: ``top_p_sampling_from_probs(torch.softmax(top_k_mask_logits(logits, top_k)),
    top_p, ...)``. ``"joint"``: ``top_k_top_p_sampling_from_probs(torch.softmax(logits), ...,
    filter_apply_order="joint")``, so for one generator state it returns exactly what that call on
    ``torch.softmax(logits, dim=-1)`` returns, as FlashInfer's does.

    Parameters
    ----------
    logits : torch.Tensor
        shape ``[num_rows, vocab_size]``, dtype float32, float16 or bfloat16.
    top_k : Union[torch.Tensor, int]
        An integer ``>= 1`` or an integer tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    top_p : Union[torch.Tensor, float]
        A number in ``(0, 1]`` or a float tensor of shape ``[num_rows]`` (or ``[batch_size]``).
    filter_apply_order : str
        ``"top_k_first"`` (default) or ``"joint"``.
    {sampling_args}
    """
    _check_order(filter_apply_order)
    logits, batch = _sampling_input(logits, "logits", indices, generator, check_nan)
    k = _top_k(top_k, logits.shape[0], batch, logits.device)
    p = _top_p(top_p, logits.shape[0], batch, logits.device)
    by_source = _by_source(k, p)
    _check_nan(logits, "logits", check_nan)
    if filter_apply_order == "joint":
        return _sample(torch.softmax(logits, dim=-1), indices, generator, top_k=k, top_p=p)
    if not by_source:
        logits, indices = logits.index_select(0, indices), None
        k.by_source = p.by_source = True
    probs = torch.softmax(_renorm(logits, top_k=k, mask_logits=True), dim=-1)
    return _sample(probs, indices, generator, top_p=p)


def top_p_renorm_probs(probs: torch.Tensor, top_p: Union[torch.Tensor, float]) -> torch.Tensor:
    r"""Keeps the top-p set of each row (the largest entries up to and including the one whose mass
    crosses ``top_p``) and divides it by its sum; the other entries become 0.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32, float16 or bfloat16.
    top_p : Union[torch.Tensor, float]
        A number in ``(0, 1]`` or a float tensor of shape ``[batch_size]``. ``top_p >= 1`` divides
        the whole row by its sum.

    Returns
    -------
    renorm_probs : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32.
    """
    probs = _check_rows(probs, "probs")
    return _renorm(probs, top_p=_top_p(top_p, probs.shape[0], probs.shape[0], probs.device))


def top_k_renorm_probs(probs: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    r"""Keeps the entries ``>=`` the k-th largest of each row (ties kept, zeros dropped) and divides
    them by their sum; the other entries become 0. A row with ``k >= vocab_size`` (or, in a tensor,
    ``k <= 0``) is returned unchanged, as FlashInfer does.

    Parameters
    ----------
    probs : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32, float16 or bfloat16.
    top_k : Union[torch.Tensor, int]
        An integer ``>= 1`` or an integer tensor of shape ``[batch_size]``.

    Returns
    -------
    renorm_probs : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32.
    """
    probs = _check_rows(probs, "probs")
    return _renorm(probs, top_k=_top_k(top_k, probs.shape[0], probs.shape[0], probs.device))


def top_k_mask_logits(logits: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    r"""Keeps the logits ``>=`` the k-th largest of each row (ties kept) and sets the others to
    ``-inf``; ``softmax`` of the result equals ``top_k_renorm_probs`` of ``softmax(logits)``. A row
    with ``k >= vocab_size`` (or, in a tensor, ``k <= 0``) is returned unchanged.

    Parameters
    ----------
    logits : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32, float16 or bfloat16.
    top_k : Union[torch.Tensor, int]
        An integer ``>= 1`` or an integer tensor of shape ``[batch_size]``.

    Returns
    -------
    masked_logits : torch.Tensor
        shape ``[batch_size, vocab_size]``, dtype float32.
    """
    logits = _check_rows(logits, "logits")
    return _renorm(logits, top_k=_top_k(top_k, logits.shape[0], logits.shape[0], logits.device), mask_logits=True)


top_p_renorm_prob = top_p_renorm_probs
top_k_renorm_prob = top_k_renorm_probs


def _check_counter(t, name: str, batch: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},), got {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")


def chain_speculative_sampling(
    draft_probs,
    draft_token_ids,
    target_probs,
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Speculative sampling of a chain of draft tokens (Chen et al., 2023).

    Draft token ``i`` is accepted with probability ``min(1, q(d_i) / p(d_i))`` (``q`` the target's
    row ``i``, ``p`` the draft's) while all before it were; at the first rejection a token is drawn
    from ``relu(q - p)`` renormalised (from ``q`` if that has no mass), and when all are accepted a
    bonus token is drawn from the target's last row.

    Parameters
    ----------
    draft_probs : torch.Tensor
        shape ``[batch_size, num_speculate_tokens, vocab_size]``, dtype float32, float16 or bfloat16.
    draft_token_ids : torch.Tensor
        shape ``[batch_size, num_speculate_tokens]``, dtype int32 or int64, values in
        ``[0, vocab_size)``.
    target_probs : torch.Tensor
        shape ``[batch_size, num_speculate_tokens + 1, vocab_size]``, dtype like ``draft_probs``'.
    maybe_output_accepted_token_num : Optional[torch.Tensor]
        shape ``[batch_size]``, int32 or int64: the number of draft tokens that pass the acceptance
        test when each is tested on its own (the tokens before the first rejection, plus independent
        re-tests of the rest) is *added* to it in place. Default: a new zero tensor.
    maybe_output_emitted_draft_token_num : Optional[torch.Tensor]
        shape ``[batch_size]``, int32 or int64: the number of draft tokens emitted (accepted before
        the first rejection; the extra token not counted) is added to it in place.
    deterministic : bool
        Accepted for compatibility: the kernel is always deterministic.
    generator : Optional[torch.Generator]
        Source of the uniform numbers; default: the device's default generator.

    Returns
    -------
    output_token_ids : torch.Tensor
        shape ``[batch_size, num_speculate_tokens + 1]``, int32: the accepted draft tokens, then the
        drawn token, then ``-1`` padding.
    output_accepted_token_num : torch.Tensor
        shape ``[batch_size]``: ``maybe_output_accepted_token_num`` (or the new tensor).
    output_emitted_draft_token_num : torch.Tensor
        shape ``[batch_size]``: ``maybe_output_emitted_draft_token_num`` (or the new tensor).
    """
    for t, name in ((draft_probs, "draft_probs"), (target_probs, "target_probs"), (draft_token_ids, "draft_token_ids")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if draft_probs.dim() != 3:
        raise ValueError(f"draft_probs: expected a 3-D tensor [batch_size, num_speculate_tokens, vocab_size], "
                         f"got shape {tuple(draft_probs.shape)}")
    b, n, vocab = draft_probs.shape
    if target_probs.shape != (b, n + 1, vocab):
        raise ValueError(f"target_probs: expected shape {(b, n + 1, vocab)} (one more row than draft_probs), "
                         f"got {tuple(target_probs.shape)}")
    if draft_token_ids.shape != (b, n):
        raise ValueError(f"draft_token_ids: expected shape {(b, n)}, got {tuple(draft_token_ids.shape)}")
    for t, name in ((draft_probs, "draft_probs"), (target_probs, "target_probs")):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: expected dtype float32, float16 or bfloat16, got {t.dtype}")
    if draft_token_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"draft_token_ids: expected dtype int32 or int64, got {draft_token_ids.dtype}")
    device = draft_probs.device
    for t, name in ((target_probs, "target_probs"), (draft_token_ids, "draft_token_ids")):
        if t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if vocab == 0:
        raise ValueError("draft_probs: the vocabulary dim is empty")
    _check_generator(generator, device)
    accepted = maybe_output_accepted_token_num
    emitted = maybe_output_emitted_draft_token_num
    if accepted is None:
        accepted = torch.zeros(b, dtype=torch.int32, device=device)
    else:
        _check_counter(accepted, "maybe_output_accepted_token_num", b, device)
    if emitted is None:
        emitted = torch.zeros(b, dtype=torch.int32, device=device)
    else:
        _check_counter(emitted, "maybe_output_emitted_draft_token_num", b, device)

    out = torch.empty((b, n + 1), dtype=torch.int32, device=device)
    if b == 0:
        return out, accepted, emitted
    draft = draft_probs if draft_probs.stride(2) == 1 else draft_probs.contiguous()
    target = target_probs if target_probs.stride(2) == 1 else target_probs.contiguous()
    ids = draft_token_ids.contiguous()
    u = _uniforms(b * (2 * n + 1), device, generator)
    counts = torch.empty((2, b), dtype=torch.int32, device=device)
    (_chain_op if _ops.compiling() else _launch_chain)(draft, ids, target, u, out, counts)
    accepted.add_(counts[0])
    emitted.add_(counts[1])
    return out, accepted, emitted


def _launch_chain(draft: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, u: torch.Tensor, out: torch.Tensor,
                  counts: torch.Tensor) -> None:
    """The chain speculative sampling kernel over checked arguments: ``out`` [b, n + 1] int32 and
    ``counts`` [2, b] int32 (accepted, emitted)."""
    _device.check_launchable(draft.device, "chain_speculative_sampling")
    b, n, vocab = draft.shape
    rows, block, tiles, warps = _tiles(vocab, b, search=False)
    _CHAIN[(cdiv(b, rows),)](
        draft, ids, target, u, out, counts[0], counts[1],
        b, vocab, draft.stride(0), draft.stride(1), ids.stride(0), target.stride(0), target.stride(1),
        N=n, ROWS=rows, BLOCK=block, NUM_TILES=tiles, num_warps=warps,
    )


@_ops.custom_op("chain_speculative_sampling", mutates_args=("out", "counts"))
def _chain_op(draft: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, u: torch.Tensor, out: torch.Tensor,
              counts: torch.Tensor) -> None:
    """``_launch_chain`` for torch.compile (``_ops.py``)."""
    _launch_chain(draft, ids, target, u, out, counts)
