"""Helpers shared by the tests and the benchmarks: tolerances, input builders, byte/FLOP counts.

Imports no kernel and no wrapper at import time (only :mod:`tritoninfer.reference` and
:mod:`tritoninfer._options`), so that it can judge them.

- Tolerances: :data:`TOLERANCES`, :data:`FP8_VS_UNQUANTIZED`, :data:`LSE_TOLERANCES`,
  :func:`rel_error`, :func:`assert_close`, :func:`assert_lse_close`.
- Inputs: :func:`make_paged_kv` (every cache form and layout, shuffled pages, garbage in unused
  slots, strided views, fp8), :func:`make_ragged`, :func:`random_qo`, :func:`randn`,
  :func:`make_workspace`, :func:`nan_like`, :func:`quantize_fp8`.
- Accounting: :func:`decode_bytes`, :func:`prefill_flops`, :func:`tb_per_s`, :func:`tflop_per_s`.
  Units: bytes and FLOPs are plain counts; ``TB = 1e12`` bytes and ``TFLOP = 1e12`` FLOPs (decimal).
- Host path without a GPU: :func:`fake_driver_launches` runs the GPU launch path (bound launches,
  driver launches) on CPU tensors with the compiler and ``cuLaunchKernel`` faked.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _options as _opts

__all__ = [
    "TOLERANCES",
    "FP8_VS_UNQUANTIZED",
    "LSE_TOLERANCES",
    "tolerance",
    "rel_error",
    "assert_close",
    "assert_lse_close",
    "PagedKV",
    "make_paged_kv",
    "make_ragged",
    "random_qo",
    "randn",
    "make_workspace",
    "nan_like",
    "quantize_fp8",
    "fp8_max",
    "fake_driver_launches",
    "decode_bytes",
    "prefill_flops",
    "tb_per_s",
    "tflop_per_s",
]

# --------------------------------------------------------------------------------------------------
# tolerances
# --------------------------------------------------------------------------------------------------

# Max relative error ||out - ref||_F / ||ref||_F, keyed by the dtype of the output (= the q dtype).
# The reference runs in float32 on the same (upcast) inputs, so only the kernel's own rounding counts.
TOLERANCES = {
    # fp32 accumulation over a few thousand terms, exp2 vs exp and a different summation order:
    # a few units of 2**-24 (6e-8) growing with the reduction length.
    torch.float32: 1e-5,
    # fp16 unit roundoff 2**-11 = 4.9e-4: P is rounded to fp16 before the P@V dot and the output
    # is rounded on store; ~4 roundings in the worst element, less in the Frobenius norm.
    torch.float16: 2e-3,
    # bf16 unit roundoff 2**-8 = 3.9e-3; the Triton interpreter stores fp32 -> bf16 by truncation
    # (error up to 1 ulp = 2**-7 = 7.8e-3 instead of half an ulp), so allow about 2 ulp.
    torch.bfloat16: 1.6e-2,
}
# fp8 KV caches: compared against the reference on the *dequantised* data (the same fp8 values times
# their scales), the only extra error is the kernel's arithmetic, so the output (q) dtype's tolerance
# applies: use ``tolerance(q.dtype)``. Against the unquantised data (before the fp8 cast), the
# quantisation error dominates; these looser bounds are for that comparison only.
FP8_VS_UNQUANTIZED = {
    # e4m3: 3 mantissa bits, relative rounding error up to 2**-4 = 6.25e-2 (rms ~3.6e-2 on K and V).
    torch.float8_e4m3fn: 6e-2,
    # e5m2: 2 mantissa bits, up to 2**-3 = 1.25e-1 (rms ~7e-2).
    torch.float8_e5m2: 1.2e-1,
}
# LSE (float32, base 2): |lse - ref| <= atol + rtol*|ref| on finite entries, keyed by the q dtype.
# The LSE comes from fp32 logits of the same operands; what differs is rounding of operands a
# kernel makes itself (e.g. rotated q/k rounded back to the input dtype before the dot).
LSE_TOLERANCES = {
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 8e-3),
}


def tolerance(dtype: Union[str, torch.dtype]) -> float:
    """Relative tolerance for an output of ``dtype`` (str names accepted; float64 uses float32's)."""
    dtype = _opts.canonicalize_dtype(dtype, "dtype")
    if dtype == torch.float64:
        dtype = torch.float32
    if dtype not in TOLERANCES:
        raise ValueError(
            f"dtype: no tolerance for {dtype}; fp8 KV outputs are in the q dtype (use tolerance(q.dtype)), "
            "or FP8_VS_UNQUANTIZED against unquantised data"
        )
    return TOLERANCES[dtype]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` in float64, over the entries where ``ref`` is finite.

    When ``ref`` is all zeros (e.g. every row empty) it returns the absolute ``||out||_F``.
    """
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(r)
    diff = torch.where(finite, o - r, torch.zeros_like(r))
    norm = torch.where(finite, r, torch.zeros_like(r)).norm().item()
    err = diff.norm().item()
    return err / norm if norm > 0 else err


def _idx(flat_index: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape))) if len(shape) else ()


def _check_nonfinite(o: torch.Tensor, r: torch.Tensor, name: str) -> torch.Tensor:
    """Fail on NaN in ``out``/``ref`` and on any inf mismatch; return the mask of finite ``ref``."""
    if o.shape != r.shape:
        raise AssertionError(f"{name}: shape {tuple(o.shape)} != reference shape {tuple(r.shape)}")
    if torch.isnan(r).any():
        i = int(torch.isnan(r).reshape(-1).nonzero()[0])
        raise AssertionError(f"{name}: the reference has NaN at {_idx(i, r.shape)} (a reference bug)")
    if torch.isnan(o).any():
        bad = torch.isnan(o)
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} NaN element(s), first at {_idx(i, o.shape)}")
    inf_mismatch = (torch.isinf(r) | torch.isinf(o)) & (o != r)
    if inf_mismatch.any():
        i = int(inf_mismatch.reshape(-1).nonzero()[0])
        at = _idx(i, o.shape)
        raise AssertionError(
            f"{name}: {int(inf_mismatch.sum())} inf mismatch(es), first at {at}: got {o[at].item()}, "
            f"expected {r[at].item()}"
        )
    return torch.isfinite(r)


def assert_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    dtype: Union[str, torch.dtype, None] = None,
    name: str = "out",
    tol: Optional[float] = None,
) -> float:
    """Assert ``rel_error(out, ref) <= tol`` (default ``tolerance(dtype)``, ``dtype`` defaulting to
    ``out.dtype``), after checking that ``out`` has no NaN and that infinities match exactly.

    Returns the relative error. The failure message names the worst element (largest |out - ref|).
    """
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    finite = _check_nonfinite(o, r, name)
    if tol is None:
        tol = tolerance(out.dtype if dtype is None else dtype)
    err = rel_error(o, r)
    if not err <= tol:
        diff = torch.where(finite, (o - r).abs(), torch.zeros_like(r))
        i = int(diff.reshape(-1).argmax())
        at = _idx(i, o.shape)
        raise AssertionError(
            f"{name}: relative error {err:.3e} > tolerance {tol:.1e}; worst element {at}: got "
            f"{o[at].item():.6g}, expected {r[at].item():.6g} (|diff| {diff[at].item():.3e})"
        )
    return err


def assert_lse_close(
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    atol: Optional[float] = None,
    *,
    dtype: Union[str, torch.dtype] = torch.float16,
    rtol: Optional[float] = None,
    name: str = "lse",
) -> float:
    """Assert an LSE matches: ``-inf`` entries (rows that see no key) exactly, finite ones within
    ``atol + rtol*|ref|`` (defaults from :data:`LSE_TOLERANCES` for the q ``dtype``).

    Returns the largest absolute error over the finite entries.
    """
    o = lse.detach().to("cpu", torch.float64)
    r = ref_lse.detach().to("cpu", torch.float64)
    finite = _check_nonfinite(o, r, name)
    d = _opts.canonicalize_dtype(dtype, "dtype")
    d_atol, d_rtol = LSE_TOLERANCES[torch.float32 if d == torch.float64 else d]
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    diff = torch.where(finite, (o - r).abs(), torch.zeros_like(r))
    bound = atol + rtol * torch.where(finite, r.abs(), torch.zeros_like(r))
    excess = diff - bound
    if diff.numel() and (excess > 0).any():
        i = int(excess.reshape(-1).argmax())
        at = _idx(i, o.shape)
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} element(s) off by more than atol={atol:.1e} + rtol={rtol:.1e}*|ref|; "
            f"worst {at}: got {o[at].item():.6g}, expected {r[at].item():.6g}"
        )
    return float(diff.max()) if diff.numel() else 0.0


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def randn(
    shape: Sequence[int],
    dtype: Union[str, torch.dtype] = torch.float16,
    device: Union[str, torch.device] = "cpu",
    generator: Optional[torch.Generator] = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Standard normal times ``scale``, generated in float32 on the CPU (reproducible whatever the
    device), then cast to ``dtype`` and moved to ``device``."""
    dtype = _opts.canonicalize_dtype(dtype, "dtype")
    x = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return x.to(dtype).to(device)


def make_ragged(
    lens: Sequence[int],
    num_heads: int,
    head_dim: int,
    dtype: Union[str, torch.dtype] = torch.float16,
    device: Union[str, torch.device] = "cpu",
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random ragged tensor ``[sum(lens), num_heads, head_dim]`` and its int32 ``indptr [len(lens)+1]``."""
    lens = [int(n) for n in lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"lens: expected non-negative lengths, got {lens}")
    indptr = torch.tensor([0] + list(_cumsum(lens)), dtype=torch.int32, device=device)
    return randn((sum(lens), num_heads, head_dim), dtype, device, generator), indptr


def random_qo(
    qo_lens: Sequence[int],
    num_qo_heads: int,
    head_dim: int,
    dtype: Union[str, torch.dtype] = torch.float16,
    device: Union[str, torch.device] = "cpu",
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random queries ``q [sum(qo_lens), num_qo_heads, head_dim]`` and ``qo_indptr`` (int32)."""
    return make_ragged(qo_lens, num_qo_heads, head_dim, dtype, device, generator)


def make_workspace(nbytes: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """A uint8 workspace of ``nbytes`` filled with 0xFF: read as float32 every element is NaN, so a
    kernel that reads workspace it never wrote shows up."""
    return torch.full((int(nbytes),), 0xFF, dtype=torch.uint8, device=device)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like ``t`` (shape, dtype, device) filled with NaN; ``t`` must be floating."""
    if not t.is_floating_point():
        raise TypeError(f"t: expected a floating tensor, got {t.dtype}")
    return torch.full_like(t, float("nan"))


def quantize_fp8(x: torch.Tensor, dtype: Union[str, torch.dtype] = torch.float8_e4m3fn) -> Tuple[torch.Tensor, float]:
    """Per-tensor fp8 quantisation: ``scale = amax / fp8_max``; returns ``((x/scale).to(dtype), scale)``
    so that ``x ≈ x_fp8.float() * scale`` (the ``k_scale``/``v_scale`` FlashInfer expects).
    An all-zero ``x`` gets scale 1."""
    dtype = _opts.canonicalize_dtype(dtype, "dtype")
    if dtype not in _opts.FP8_DTYPES:
        raise ValueError(f"dtype: expected an fp8 dtype {list(_opts.FP8_DTYPES)}, got {dtype}")
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    scale = amax / fp8_max(dtype) if amax > 0 else 1.0
    return (x.to(torch.float32) / scale).to(dtype), scale


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


_FORMS = ("5d", "tuple", "tuple3d", "4d")


@dataclass
class PagedKV:
    """A paged KV cache and its page table, as :func:`make_paged_kv` builds them.

    Attributes
    ----------
    cache : torch.Tensor or tuple
        What ``run()`` takes: 5-D ``[P, 2, page, H, D]`` / ``[P, 2, H, page, D]``, a tuple of 4-D
        ``[P, page, H, D]`` / ``[P, H, page, D]``, a tuple of 3-D ``[P, H, D]``, or 4-D ``[P, 2, H, D]``.
    kv_indptr, kv_indices, kv_last_page_len : torch.Tensor
        int32 CSR page table (``[B+1]``, ``[sum pages]``, ``[B]``); an empty request has no pages and
        ``last_page_len`` 0.
    kv_lens : list of int
    page_size : int
    layout : str
        ``"NHD"`` or ``"HND"``.
    block_tables : torch.Tensor
        int32 ``[B, max_pages]`` (0.5.3's alternative form), rows padded with 0.
    seq_lens : torch.Tensor
        int32 ``[B]``.
    k_list, v_list : list of torch.Tensor
        Per request, the dense ``[kv_len, H, D]`` data as stored (cache dtype): what
        ``reference.gather_paged_kv`` must return.
    k_float, v_float : list of torch.Tensor
        Per request, the float32 data before the cast to the cache dtype (for fp8:
        ``k_float ≈ k_list.float() * k_scale``): the unquantised data.
    k_scale, v_scale : float or None
        The fp8 scales the data was divided by (pass them to ``run``).
    """

    cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: List[int]
    page_size: int
    layout: str
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    num_kv_heads: int = 0
    head_dim: int = 0
    head_dim_vo: int = 0
    dtype: torch.dtype = torch.float16
    form: str = "5d"
    num_pages: int = 0
    k_list: List[torch.Tensor] = field(default_factory=list)
    v_list: List[torch.Tensor] = field(default_factory=list)
    k_float: List[torch.Tensor] = field(default_factory=list)
    v_float: List[torch.Tensor] = field(default_factory=list)
    k_scale: Optional[float] = None
    v_scale: Optional[float] = None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    def page_table(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kv_indptr, kv_indices, kv_last_page_len)``."""
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len


def make_paged_kv(
    kv_lens: Sequence[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    head_dim_vo: Optional[int] = None,
    layout: str = "NHD",
    form: str = "5d",
    dtype: Union[str, torch.dtype] = torch.float16,
    device: Union[str, torch.device] = "cpu",
    generator: Optional[torch.Generator] = None,
    shuffle_pages: bool = True,
    extra_pages: int = 2,
    strided: bool = False,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    garbage: str = "random",
) -> PagedKV:
    """Build a random paged KV cache in any of FlashInfer's forms.

    Parameters
    ----------
    kv_lens : sequence of int
        KV length per request; 0 makes an empty request (no pages, ``last_page_len`` 0).
    page_size : int
        Must be 1 for ``form="tuple3d"`` and ``form="4d"``.
    num_kv_heads, head_dim : int
    head_dim_vo : int, optional
        V head dim (default ``head_dim``); must equal ``head_dim`` for the single-tensor forms.
    layout : str
        ``"NHD"`` or ``"HND"`` (no effect on the page-size-1 forms, whose shape is the same).
    form : str
        ``"5d"`` (one ``[P, 2, ...]`` tensor), ``"tuple"`` (``(k, v)`` 4-D), ``"tuple3d"`` (``(k, v)``
        ``[tokens, H, D]``, page size 1, SGLang's form) or ``"4d"`` (``[P, 2, H, D]``, page size 1).
    dtype : torch.dtype or str
        Cache dtype; for fp8 the float32 data is divided by ``k_scale``/``v_scale`` (default 1)
        before the cast.
    device : str or torch.device
    generator : torch.Generator, optional
        A CPU generator; all random data is drawn on the CPU, so results do not depend on device.
    shuffle_pages : bool
        Assign pages in a random order (else in order).
    extra_pages : int
        Unused pages added to the pool; they, and the unused tail of each last page, hold garbage.
    strided : bool
        Make the cache a non-contiguous view: sliced from a tensor with one more head and 8 more
        elements in the last dim.
    garbage : str
        What unused slots hold: ``"random"`` (large finite values, the default), ``"nan"``
        or ``"zero"``.

    Returns
    -------
    PagedKV
    """
    kv_lens = [int(n) for n in kv_lens]
    if any(n < 0 for n in kv_lens):
        raise ValueError(f"kv_lens: expected non-negative lengths, got {kv_lens}")
    page_size = _opts.check_positive_int(page_size, "page_size")
    _opts.check_positive_int(num_kv_heads, "num_kv_heads")
    _opts.check_positive_int(head_dim, "head_dim")
    head_dim_vo = head_dim if head_dim_vo is None else _opts.check_positive_int(head_dim_vo, "head_dim_vo")
    layout = _opts.parse_layout(layout).name
    dtype = _opts.canonicalize_dtype(dtype, "dtype")
    if form not in _FORMS:
        raise ValueError(f"form: expected one of {list(_FORMS)}, got {form!r}")
    if form in ("tuple3d", "4d") and page_size != 1:
        raise ValueError(f"page_size: form {form!r} means page_size 1, got {page_size}")
    if form in ("5d", "4d") and head_dim_vo != head_dim:
        raise ValueError(f"head_dim_vo: form {form!r} stores K and V in one tensor, so it needs head_dim_vo == head_dim")
    if garbage not in ("random", "nan", "zero"):
        raise ValueError(f"garbage: expected 'random', 'nan' or 'zero', got {garbage!r}")
    if extra_pages < 0:
        raise ValueError(f"extra_pages: expected a non-negative int, got {extra_pages}")
    is_fp8 = dtype in _opts.FP8_DTYPES
    if (k_scale is not None or v_scale is not None) and not is_fp8:
        raise ValueError("k_scale, v_scale: only meaningful for an fp8 dtype")
    gen = generator

    pages_per_req = [-(-n // page_size) for n in kv_lens]
    used = sum(pages_per_req)
    num_pages = used + extra_pages
    order = torch.randperm(num_pages, generator=gen).tolist() if shuffle_pages else list(range(num_pages))
    indptr = [0] + list(_cumsum(pages_per_req))
    indices = order[:used]
    last = [((n - 1) % page_size) + 1 if n > 0 else 0 for n in kv_lens]

    # Storage: the physical tensors, garbage-filled, then the views that are the cache.
    H, D, Dv = num_kv_heads, head_dim, head_dim_vo
    pad_h, pad_d = (1, 8) if strided else (0, 0)

    def filled(shape):
        if garbage == "nan":
            return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)
        if garbage == "zero":
            return torch.zeros(shape, dtype=dtype)
        return (torch.randn(shape, generator=gen) * 16.0 + 8.0).to(dtype)

    if form == "5d":
        inner = (page_size, H + pad_h) if layout == "NHD" else (H + pad_h, page_size)
        phys = filled((num_pages, 2) + inner + (D + pad_d,))
        if layout == "NHD":
            cache = phys[:, :, :, :H, :D]
            k_view, v_view = cache[:, 0], cache[:, 1]  # [P, page, H, D]
        else:
            cache = phys[:, :, :H, :, :D]
            k_view, v_view = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    elif form == "4d":
        phys = filled((num_pages, 2, H + pad_h, D + pad_d))
        cache = phys[:, :, :H, :D]
        k_view, v_view = cache[:, 0].unsqueeze(1), cache[:, 1].unsqueeze(1)  # [P, 1, H, D]
    elif form == "tuple":
        inner = (page_size, H + pad_h) if layout == "NHD" else (H + pad_h, page_size)
        k_phys = filled((num_pages,) + inner + (D + pad_d,))
        v_phys = filled((num_pages,) + inner + (Dv + pad_d,))
        if layout == "NHD":
            k_c, v_c = k_phys[:, :, :H, :D], v_phys[:, :, :H, :Dv]
            k_view, v_view = k_c, v_c
        else:
            k_c, v_c = k_phys[:, :H, :, :D], v_phys[:, :H, :, :Dv]
            k_view, v_view = k_c.transpose(1, 2), v_c.transpose(1, 2)
        cache = (k_c, v_c)
    else:  # tuple3d
        k_phys = filled((num_pages, H + pad_h, D + pad_d))
        v_phys = filled((num_pages, H + pad_h, Dv + pad_d))
        k_c, v_c = k_phys[:, :H, :D], v_phys[:, :H, :Dv]
        k_view, v_view = k_c.unsqueeze(1), v_c.unsqueeze(1)
        cache = (k_c, v_c)

    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)
    k_list, v_list, k_float, v_float = [], [], [], []
    for i, n in enumerate(kv_lens):
        kf = torch.randn((n, H, D), generator=gen)
        vf = torch.randn((n, H, Dv), generator=gen)
        k_st = (kf / ks).to(dtype) if is_fp8 else kf.to(dtype)
        v_st = (vf / vs).to(dtype) if is_fp8 else vf.to(dtype)
        if n:
            t = torch.arange(n)
            pages = torch.tensor(indices[indptr[i]:indptr[i + 1]], dtype=torch.long)[t // page_size]
            slots = t % page_size
            k_view[pages, slots] = k_st
            v_view[pages, slots] = v_st
        k_list.append(k_st.to(device))
        v_list.append(v_st.to(device))
        k_float.append(kf.to(device))
        v_float.append(vf.to(device))

    if device is not None and torch.device(device) != torch.device("cpu"):
        # Move the physical storage once and re-derive the same views on the device.
        if isinstance(cache, tuple):
            cache = tuple(_move_view(c, device) for c in cache)
        else:
            cache = _move_view(cache, device)

    max_pages = max(pages_per_req, default=0)
    block_tables = torch.zeros((len(kv_lens), max_pages), dtype=torch.int32)
    for i in range(len(kv_lens)):
        row = indices[indptr[i]:indptr[i + 1]]
        if row:
            block_tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)

    i32 = dict(dtype=torch.int32, device=device)
    return PagedKV(
        cache=cache,
        kv_indptr=torch.tensor(indptr, **i32),
        kv_indices=torch.tensor(indices, **i32),
        kv_last_page_len=torch.tensor(last, **i32),
        kv_lens=kv_lens,
        page_size=page_size,
        layout=layout,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(kv_lens, **i32),
        num_kv_heads=H,
        head_dim=D,
        head_dim_vo=Dv,
        dtype=dtype,
        form=form,
        num_pages=num_pages,
        k_list=k_list,
        v_list=v_list,
        k_float=k_float,
        v_float=v_float,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def _move_view(view: torch.Tensor, device) -> torch.Tensor:
    """The same (possibly strided) view, over a copy of its whole storage on ``device``."""
    base = view if view._base is None else view._base
    moved = base.to(device)
    return moved.as_strided(view.shape, view.stride(), view.storage_offset())


# --------------------------------------------------------------------------------------------------
# accounting for benchmarks (units: bytes, FLOPs; TB = 1e12 bytes, TFLOP = 1e12 FLOPs)
# --------------------------------------------------------------------------------------------------


def _elem_size(dtype) -> int:
    return _opts.canonicalize_dtype(dtype, "dtype").itemsize


def decode_bytes(
    kv_lens: Sequence[int],
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_dtype: Union[str, torch.dtype],
    kv_dtype: Union[str, torch.dtype],
    head_dim_vo: Optional[int] = None,
    q_len_per_req: int = 1,
    o_dtype: Union[str, torch.dtype, None] = None,
) -> int:
    """Bytes a batch decode must move, in bytes (divide by 1e12 for TB).

    Live KV pages, whole pages: ``ceil(kv_len/page_size)*page_size`` tokens × ``H_kv`` ×
    ``(D_qk + D_vo)`` × KV element size, summed over requests; plus q (``B*q_len_per_req*H_qo*D_qk``
    elements of ``q_dtype``) and o (``B*q_len_per_req*H_qo*D_vo`` of ``o_dtype``, default
    ``q_dtype``). The page table and LSE are not counted.
    """
    head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo
    o_dtype = q_dtype if o_dtype is None else o_dtype
    tokens = sum(-(-int(n) // page_size) * page_size for n in kv_lens)
    kv = tokens * num_kv_heads * (head_dim + head_dim_vo) * _elem_size(kv_dtype)
    rows = len(kv_lens) * q_len_per_req * num_qo_heads
    return kv + rows * head_dim * _elem_size(q_dtype) + rows * head_dim_vo * _elem_size(o_dtype)


def _visible_pairs(qo_len: int, kv_len: int, causal: bool) -> int:
    """(query, key) pairs attended; causal is bottom-right: query i sees ``max(0, i+kv-qo+1)`` keys."""
    if not causal:
        return qo_len * kv_len
    # Row i sees a = i + kv - qo + 1 keys (never more than kv); sum max(a, 0) over i in [0, qo).
    hi = kv_len  # last row sees every key
    lo = max(kv_len - qo_len + 1, 1)
    if hi < lo:
        return 0
    return (hi * (hi + 1) - (lo - 1) * lo) // 2


def prefill_flops(
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    num_qo_heads: int,
    head_dim_qk: int,
    head_dim_vo: int,
    causal: bool,
) -> int:
    """FLOPs of a batch prefill (a count; divide by 1e12 for TFLOP).

    ``sum_i 2 * pairs_i * H_qo * (D_qk + D_vo)`` (QK^T and PV, a multiply-add = 2 FLOPs), with
    ``pairs_i = qo_i*kv_i``, or, causal, exactly the visible (query, key) pairs of the bottom-right
    aligned mask. Softmax is not counted.
    """
    if len(qo_lens) != len(kv_lens):
        raise ValueError(f"qo_lens, kv_lens: expected the same length, got {len(qo_lens)} and {len(kv_lens)}")
    pairs = sum(_visible_pairs(int(q), int(k), causal) for q, k in zip(qo_lens, kv_lens))
    return 2 * pairs * num_qo_heads * (head_dim_qk + head_dim_vo)


def tb_per_s(nbytes: float, seconds: float) -> float:
    """Bandwidth in TB/s (1 TB = 1e12 bytes)."""
    return nbytes / seconds / 1e12


def tflop_per_s(flops: float, seconds: float) -> float:
    """Throughput in TFLOP/s (1 TFLOP = 1e12 FLOPs)."""
    return flops / seconds / 1e12


@dataclass
class DriverRecord:
    """What :func:`fake_driver_launches` saw: the grids compiled (each a ``kernel[grid]`` call through
    Triton's path) and, per driver launch, its grid and the first ``params_read`` parameter slots
    read as 64-bit values (pointers are there as addresses)."""

    compiles: list = field(default_factory=list)
    launches: list = field(default_factory=list)


def _fake_compiled(kernel, args: tuple, kwargs: dict):
    """A compiled kernel as ``CachedLauncher.compile_and_launch`` returns it, with the signature Triton
    would give ``args`` (``None``: a constexpr) and the kernel's remaining parameters as constexprs."""
    from types import SimpleNamespace

    signature, boxes = {}, []
    for i, a in enumerate(args):
        if hasattr(a, "block_shape"):  # a Gluon TensorDescriptor (a bound launch's TmaBox)
            signature[f"arg{i}"] = f"tensordesc<bf16{list(a.block_shape)}>"
            boxes.append(dict(elem_type=10, block_size=list(a.block_shape), elem_size=2, swizzle=3))
            continue
        signature[f"arg{i}"] = ("constexpr" if a is None else "*bf16" if isinstance(a, torch.Tensor) else
                                "i1" if isinstance(a, bool) else "fp32" if isinstance(a, float) else "i32")
    fn = getattr(kernel, "fn", kernel)
    rest = list(inspect.signature(fn).parameters.values())[len(args):]
    signature.update({p.name: "constexpr" for p in rest})
    constexprs = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in rest)
    meta = SimpleNamespace(num_ctas=1, launch_pdl=False, launch_cooperative_grid=False, global_scratch_size=0,
                           profile_scratch_size=0, num_warps=4, shared=1024, tensordesc_meta=boxes)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=meta, function=0xF00), constexprs


_FAKE_LAUNCH_INTO: list = [None]  # (the open fake_driver_launches block's record, its params_read)


def _fake_launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
    """``cuLaunchKernel`` as ``fake_driver_launches`` fakes it: the grid and the first parameters recorded.
    The arguments are checked as the real call (no ctypes argument types) needs them."""
    if type(function) is not ctypes.c_void_p or type(stream) is not ctypes.c_void_p or extra is not None:
        raise TypeError("cuLaunchKernel: function and stream must be ctypes.c_void_p, extra None")
    for x in (gx, gy, gz, bx, by, bz, shared):  # (ctypes converts nothing else, a numpy int included)
        if type(x) is not int or not 0 <= x < 2 ** 31:
            raise TypeError(f"cuLaunchKernel: grid, block and shared memory must be Python ints, got {x!r}")
    into = _FAKE_LAUNCH_INTO[0]
    if into is not None:
        record, params_read = into
        record.launches.append(((gx, gy, gz), [ctypes.c_uint64.from_address(params[k]).value
                                               for k in range(min(params_read, len(params)))]))
    return 0


@contextlib.contextmanager
def fake_driver_launches(params_read: int = 0, hopper: bool = False) -> Iterator[DriverRecord]:
    """Within the block, kernels launch as on a GPU, but on CPU tensors and without running: the
    interpreter is off for tritoninfer, ``kernel[grid]`` returns a fake compiled kernel (signature
    from the call's arguments), Triton's launcher does nothing and ``cuLaunchKernel`` records its
    grid and its first ``params_read`` parameters (TMA maps are not encoded). For the host cost and the launch bookkeeping of
    ``plan()``/``run()`` on a machine without a GPU (the CPU tensors' device, -1, plays the current
    CUDA device). ``hopper``: the routes see an sm_90 GPU, so plans they send to the Gluon kernels
    launch those. The planner's cached choices made inside (GPU tiles) are dropped at exit."""
    from . import _device, _driver, _hopper, _launch, _route, decode, prefill

    record = DriverRecord()
    # driver launches built in an earlier block (the single-request functions' launches live on) keep the
    # function they got; it records into the block open now
    _FAKE_LAUNCH_INTO[0] = (record, params_read)

    def compile_and_launch(self, grid, args, kwargs):
        record.compiles.append(grid)
        return _fake_compiled(self.kernel, args, kwargs)

    patches = [(_device, "is_interpreter", lambda: False), (_device, "check_launchable", lambda *a: None),
               (_launch, "_current_device", lambda: -1), (_launch, "_current_index", lambda: -1),
               (_launch, "_run", lambda *a: None), (_driver, "available", lambda: True),
               (_driver, "launch_kernel", lambda: _fake_launch_kernel),
               (torch._C, "_cuda_getCurrentRawStream", lambda device: 77),
               (_launch.CachedLauncher, "compile_and_launch", compile_and_launch),
               (_driver, "encode_tiled", lambda *a: None)]
    if hopper:
        patches += [(_route, "is_sm90", lambda device: True), (_hopper, "gluon_available", lambda: True)]
    saved = [(owner, name, owner.__dict__.get(name, None), name in owner.__dict__) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    # the single-request functions' replays hold launches of the launch path they were made on
    decode._SINGLE_REPLAY[0] = prefill._SINGLE_REPLAY[0] = None
    try:
        yield record
    finally:
        for owner, name, value, present in saved:
            if present:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        decode._SINGLE_REPLAY[0] = prefill._SINGLE_REPLAY[0] = None
        _FAKE_LAUNCH_INTO[0] = None
        decode._decode_config.cache_clear()
        decode._decode_tiles.cache_clear()
