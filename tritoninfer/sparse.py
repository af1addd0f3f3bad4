"""Block-sparse attention: ``BlockSparseAttentionWrapper`` and ``VariableBlockSparseAttentionWrapper``
(FlashInfer 0.5.3's ``flashinfer.sparse``), as paged prefill plans of the attention core.

As in FlashInfer, block-sparse attention is a batch of paged prefills with no copy of K or V:

- ``BlockSparseAttentionWrapper`` (a BSR mask of ``R x C`` blocks): block row ``i`` is a request
  whose query rows are ``q[i*R : min((i+1)*R, M)]`` and whose KV pages are its non-zero column
  blocks, ``k`` and ``v`` ``[N, H_kv, D]`` seen as caches of ``N / C`` pages of ``C`` tokens. The
  block-internal ``mask`` becomes the requests' packed custom mask. fp8 (e4m3/e5m2) queries and
  K/V take per-head float32 scales (``run(q, k, v, scale_q, scale_k, scale_v)``) and write
  ``o_data_type``.
- ``VariableBlockSparseAttentionWrapper`` (per-KV-head block masks with per-head row and column
  block sizes): each (query head, block row) is a request of one head whose keys are its KV head's
  selected column blocks, gathered token by token (pages of one token into ``k`` and ``v``
  ``[H_kv, kv_len, D]``). Query heads of a GQA group share their KV head's page list.

Masks and positions are per request (FlashInfer's semantics, ``reference/sparse.py``): a causal mask
is bottom-right aligned on the request's concatenated keys, RoPE places key ``j`` of the request at
``j``. ``plan()`` builds the page tables on the host with numpy (no per-row Python loop) and uploads
them with the work list in one copy; ``run()`` checks its tensors and launches once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import numpy as np
import torch

from . import _device, _errors, _hopper, _ops, _route
from ._attention import KVSource, PlanUploader
from ._kvcache import PagedKV
from ._options import (
    FP8_DTYPES,
    INDEX_DTYPES,
    PosEncodingMode,
    TensorLayout,
    canonicalize_dtype,
    check_dtype_in,
    check_head_dim,
    check_heads,
    check_indptr_host,
    check_out,
    check_positive_int,
    check_query,
    check_tensor,
    host_index,
    parse_pos_encoding_mode,
)
from ._plan import prefill_tiles
from ._route import PlanFacts
from ._step import PlannedStep, Settings, run_step, upload_plan
from .prefill import (_check_packed_mask, _head_scales, _mask_layout, _pack_mask, _plan_dtypes, _reject_unsupported,
                      _route_and_work, _scores, _step_fields)

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"]

# FlashInfer 0.5.3's sparse backends; each selects tritoninfer's attention core.
SPARSE_BACKENDS = ("auto", "fa2", "fa3")
Q_DTYPES = (torch.float16, torch.bfloat16) + FP8_DTYPES
O_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# mask elements handled per vectorised step of the BSR mask conversion (bounds its index tensors)
_MASK_CHUNK = 1 << 22


def convert_bsr_mask_layout(mask: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """A BSR block mask in FlashInfer's flattened per-request layout.

    Parameters
    ----------
    mask : torch.Tensor
        ``[nnz, R, C]``: the elements kept inside each non-zero block (any dtype; FlashInfer's is bool).
    indptr : torch.Tensor
        int32/int64 ``[MB + 1]``: the BSR row pointer (``indptr[-1] == nnz``).

    Returns
    -------
    torch.Tensor
        ``[nnz * R * C]``, ``mask``'s dtype and device: block row ``i``'s blocks side by side, row
        by row (its ``[R, blocks_i * C]`` mask, row-major), the block rows one after another.
    """
    check_tensor(mask, "mask", ndim=3)
    ptr = host_index(indptr, "indptr").numpy().astype(np.int64)
    nnz, R, C = mask.shape
    if ptr.size < 1 or ptr[0] != 0 or (np.diff(ptr) < 0).any() or ptr[-1] != nnz:
        raise ValueError(f"indptr: expected a non-decreasing array from 0 to nnz = mask.shape[0] = {nnz}")
    out = torch.empty(nnz * R * C, dtype=mask.dtype, device=mask.device)
    if nnz == 0:
        return out
    counts = np.diff(ptr)
    row = np.repeat(np.arange(counts.size), counts)  # block -> its block row
    # element (b, r, c) goes to ptr[row]*R*C + r*(blocks of the row)*C + (b - ptr[row])*C + c
    base = torch.from_numpy(ptr[row] * R * C + (np.arange(nnz) - ptr[row]) * C).to(mask.device)
    stride = torch.from_numpy(counts[row] * C).to(mask.device)
    r = torch.arange(R, device=mask.device)[None, :, None]
    c = torch.arange(C, device=mask.device)[None, None, :]
    step = max(1, _MASK_CHUNK // (R * C))
    for b0 in range(0, nnz, step):
        b1 = min(nnz, b0 + step)
        dest = base[b0:b1, None, None] + r * stride[b0:b1, None, None] + c
        out[dest.reshape(-1)] = mask[b0:b1].reshape(-1)
    return out


def _sparse_core_reason(head_dim: int, q_dtype: torch.dtype, o_dtype: torch.dtype) -> Optional[str]:
    """Why a block-sparse plan keeps the attention core before the prefill route is asked (None: ask it). The
    Gluon kernel's block-sparse route (block rows as requests, column blocks as pages) was measured at head_dim
    128 only; its other head_dims' query tiles (192 rows at 64) would mostly idle over 64-row block rows."""
    if o_dtype != q_dtype:
        return "the output dtype is not q's"
    if head_dim != 128:
        return f"head_dim {head_dim} (the block-sparse route was measured at 128)"
    return None


@dataclasses.dataclass(frozen=True)
class _SparsePlan:
    """What a sparse ``plan()`` fixed: the attention step and the shapes ``run()`` checks."""

    step: PlannedStep
    o_dtype: torch.dtype
    q_shape: Tuple[int, int, int]
    kv_shape: Tuple[int, int, int]
    num_pages: int  # pages of the K/V view (BSR: N / C column blocks; variable: H_kv * kv_len tokens)


class _SparseBase:
    """Construction, workspace, step planning and the score overrides shared by both wrappers."""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        if backend not in SPARSE_BACKENDS:
            raise ValueError(f"backend: expected one of {SPARSE_BACKENDS}, got {backend!r}")
        self._backend = backend
        self.device = float_workspace_buffer.device
        self._set_workspace(float_workspace_buffer)
        self._uploader = PlanUploader(self.device, reuse=True)
        self._faults = _errors.FaultWatch(self.device)
        self._plan: Optional[_SparsePlan] = None  # what the last plan() fixed; all run() reads
        self._handle = _ops.register_wrapper(self)  # for run() under torch.compile (_sparse_run_op)

    def _set_workspace(self, buf: torch.Tensor) -> None:
        self._float_workspace_buffer = buf
        # the split-KV states are laid out in bytes; FlashInfer's own tests pass float32 workspaces
        self._workspace = buf.view(torch.uint8) if buf.is_contiguous() and buf.dtype != torch.uint8 else buf

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor,
                               vector_sparse_indices_buffer: Optional[torch.Tensor] = None,
                               vector_sparse_indptr_buffer: Optional[torch.Tensor] = None) -> None:
        """Replace the float workspace. The int and vector-sparse buffers are accepted for
        compatibility: tritoninfer keeps its plan in buffers the wrapper owns."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._set_workspace(float_workspace_buffer)

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""

    @property
    def _o_dtype(self) -> Optional[torch.dtype]:
        return None if self._plan is None else self._plan.o_dtype

    def _begin_plan(self, use_fp16_qk_reduction: bool) -> None:
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        _reject_unsupported(use_fp16_qk_reduction)

    def _checked_scores(self, pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim, causal,
                        masked: bool, q_dtype):
        """The prefill wrappers' settings and scores (no window), with what this wrapper cannot compute
        rejected."""
        mode = parse_pos_encoding_mode(pos_encoding_mode)
        if q_dtype in FP8_DTYPES and mode == PosEncodingMode.ROPE_LLAMA:
            raise NotImplementedError("pos_encoding_mode='ROPE_LLAMA' with fp8 queries: the rotated q would be "
                                      "rounded back to fp8 (FlashInfer's fp8 path has no RoPE either)")
        if mode == PosEncodingMode.ALIBI and isinstance(self, VariableBlockSparseAttentionWrapper):
            raise NotImplementedError("pos_encoding_mode='ALIBI' in VariableBlockSparseAttentionWrapper "
                                      "(FlashInfer 0.5.3 passes it no ALiBi slopes)")
        return _scores(pos_encoding_mode, -1, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim, causal,
                       masked)

    def _plan_step(self, *, qo: np.ndarray, kv_lens: np.ndarray, kv_starts: np.ndarray, kv_indices: np.ndarray,
                   page_size: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, settings: Settings, params,
                   q_dtype, kv_dtype, o_dtype, packed_mask: Optional[torch.Tensor],
                   mask_byte_indptr: Optional[np.ndarray], non_blocking: bool) -> PlannedStep:
        """A paged prefill step: requests with query rows ``qo`` (int64 indptr ``[batch + 1]``), KV
        lengths ``kv_lens`` and page lists starting at ``kv_starts[req]`` in ``kv_indices`` (page
        ids already checked against the K/V view)."""
        group = num_qo_heads // num_kv_heads
        batch = qo.size - 1
        total_rows = int(qo[-1])
        tiles = prefill_tiles(group, head_dim, total_rows * group / max(batch, 1), kv_dtype.itemsize)
        facts = PlanFacts(
            device=self.device, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim_qk=head_dim, head_dim_vo=head_dim,
            layout=TensorLayout.NHD, use_cuda_graph=False, has_mask=packed_mask is not None, params=params,
            qo_lens=qo[1:] - qo[:-1], kv_lens=kv_lens, page_size=page_size, min_len=_route.BLOCK_SPARSE_MIN_LEN)
        route, work = _route_and_work(facts, tiles, num_qo_heads, num_kv_heads,
                                      workspace_bytes=self._workspace.numel() * self._workspace.element_size(),
                                      num_sms=_device.num_sms(self.device),
                                      core_reason=_sparse_core_reason(head_dim, q_dtype, o_dtype))
        # an empty page list still gets one (unread) entry: the kernel is handed a real allocation
        indices = kv_indices if kv_indices.size else np.zeros(1, np.int64)
        extra = [kv_starts, indices] + ([mask_byte_indptr] if packed_mask is not None else []) + (
            [] if route.is_core else [_hopper.padded_tiles(route.work)])
        plan, views = upload_plan(self._uploader, None, work, kv_lens, qo, extra, non_blocking)
        return PlannedStep(**_step_fields(facts, settings, tiles, num_qo_heads, num_kv_heads, total_rows, plan,
                                          packed_mask, views[2] if packed_mask is not None else None, route, views[-1]),
                           total_kv=0, kv_indptr=views[0], kv_indices=views[1])

    def _override(self, pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, sm_scale, rope_scale,
                  rope_theta) -> None:
        """The deprecated ``forward()``: its arguments, defaults included, replace the planned scores."""
        plan = self._plan
        if plan is None:
            raise ValueError("forward() was called before plan()")
        _reject_unsupported(use_fp16_qk_reduction)
        step = plan.step
        # the planned mask stays: a custom mask replaces causal
        settings, params = self._checked_scores(pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                                step.head_dim_qk, step.settings.causal, step.packed_mask is not None,
                                                step.q_dtype)
        self._plan = dataclasses.replace(plan, step=step.with_scores(settings, params))

    def _run_args(self, q, k, v, out, lse, return_lse, q_doc: str, kv_doc: str):
        """``run()``'s checks of its tensors against the plan: the plan, ``out`` (allocated when None)
        and ``lse`` (None unless given or returned)."""
        plan = self._plan
        if plan is None:
            raise ValueError("run() was called before plan()")
        check_query(q, plan.step.q_dtype, plan.q_shape, q_doc)
        self._check_kv(k, "k", plan, q, kv_doc)
        self._check_kv(v, "v", plan, q, kv_doc)
        out = check_out(out, plan.q_shape, plan.o_dtype, q.device, "out")
        # a caller's lse buffer is written whether or not it is returned, as in the prefill wrappers
        if lse is not None or return_lse:
            lse = check_out(lse, plan.q_shape[:2], torch.float32, q.device, "lse")
        return plan, out, lse

    def _check_kv(self, t: torch.Tensor, name: str, plan: _SparsePlan, q: torch.Tensor, shape_doc: str) -> None:
        check_tensor(t, name, ndim=3)
        if t.dtype != plan.step.kv_dtype:
            raise ValueError(f"The dtype of {name} {t.dtype} does not match the kv_data_type "
                             f"{plan.step.kv_dtype} specified in plan function.")
        if tuple(t.shape) != plan.kv_shape:
            raise ValueError(f"{name}: expected shape {plan.kv_shape} {shape_doc}, got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} (q's device), got one on {t.device}")


def _dtypes(q_data_type, kv_data_type, q_allowed) -> Tuple[torch.dtype, torch.dtype]:
    q_dtype, kv_dtype = _plan_dtypes(q_data_type, kv_data_type, q_allowed)
    if q_dtype in FP8_DTYPES and kv_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_data_type: fp8 queries need fp8 K/V (as FlashInfer's fp8 path), got {kv_dtype}")
    return q_dtype, kv_dtype


class BlockSparseAttentionWrapper(_SparseBase):
    """Attention under a block-sparse (BSR) mask of ``R x C`` blocks over ``q [M, H_qo, D]`` and
    ``k, v [N, H_kv, D]`` (scipy's ``bsr_matrix`` definition), any block size.

    Each block row is a paged prefill request over its non-zero column blocks, read in place from
    ``k`` and ``v``; a GQA group's query heads share each K/V tile.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.sparse.BlockSparseAttentionWrapper(ws)
    >>> indptr = torch.tensor([0, 1, 3, 5], dtype=torch.int32)  # block rows of [[0,0,1],[1,0,1],[0,1,1]]
    >>> indices = torch.tensor([2, 0, 2, 1, 2], dtype=torch.int32)
    >>> wrapper.plan(indptr, indices, 3 * 16, 3 * 16, 16, 16, 32, 8, 128)
    >>> o = wrapper.run(q, k, v)  # q [48, 32, 128] fp16, k/v [48, 8, 128] -> o [48, 32, 128] fp16

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Split-KV partial states (128 MB recommended); its size is checked against each plan.
    backend : str
        ``"auto"``, ``"fa2"`` or ``"fa3"``: every value runs tritoninfer's attention core.
    """

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        M: int,
        N: int,
        R: int,
        C: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mask: Optional[torch.Tensor] = None,
        packed_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        o_data_type: Union[str, torch.dtype] = "float16",
        non_blocking: bool = True,
    ) -> None:
        """Plan block-sparse attention.

        Parameters
        ----------
        indptr : torch.Tensor
            int32/int64 ``[MB + 1]``, ``MB = ceil(M / R)``: block row ``i``'s non-zero blocks are
            ``indices[indptr[i]:indptr[i+1]]``.
        indices : torch.Tensor
            int32/int64 ``[nnz]``: block columns, each in ``[0, N / C)``.
        M, N : int
            Query rows and key columns; ``N`` must be a multiple of ``C`` (``M`` need not be one of
            ``R``: the last block row is then shorter).
        R, C : int
            Block rows and columns.
        num_qo_heads, num_kv_heads, head_dim : int
        mask : Optional[torch.Tensor]
            bool ``[nnz, R, C]``: the elements kept inside each non-zero block (all when None).
        packed_mask : Optional[torch.Tensor]
            uint8: ``mask`` in the layout of :func:`convert_bsr_mask_layout`, bit-packed little-endian
            per block row, each row's ``rows_i * blocks_i * C`` bits padded to whole bytes (the
            paged prefill wrapper's ``packed_custom_mask``). Takes precedence over ``mask``.
        causal : bool
            Causal mask within each block row's request (bottom-right aligned on its concatenated
            key blocks); ignored with a mask, as in FlashInfer.
        pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta
            As the prefill wrappers'; positions are per block-row request.
        use_fp16_qk_reduction : bool
            Only False (``NotImplementedError`` otherwise).
        q_data_type, kv_data_type : str or torch.dtype
            fp16/bf16 queries over fp16/bf16/fp8 K/V, or fp8 (e4m3/e5m2) queries over fp8 K/V
            (then ``run`` takes per-head scales). ``kv_data_type`` defaults to ``q_data_type``.
        o_data_type : str or torch.dtype
            Output dtype: fp16 (FlashInfer's default, whatever the query dtype), bf16 or fp32.
        non_blocking : bool
            Asynchronous host-to-device copy of the plan.
        """
        self._begin_plan(use_fp16_qk_reduction)
        for value, name in ((M, "M"), (N, "N"), (R, "R"), (C, "C")):
            check_positive_int(value, name)
        if N % C:
            raise ValueError(f"N: expected a multiple of C ({C}), got {N} (k and v are read as N / C blocks)")
        check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim, "head_dim")
        q_dtype, kv_dtype = _dtypes(q_data_type, kv_data_type, Q_DTYPES)
        o_dtype = check_dtype_in(canonicalize_dtype(o_data_type, "o_data_type"), O_DTYPES, "o_data_type")
        ptr_host = host_index(indptr, "indptr")
        check_indptr_host(ptr_host, "indptr")
        num_rows = -(-M // R)
        if ptr_host.numel() != num_rows + 1:
            raise ValueError(f"indptr: expected ceil(M / R) + 1 = {num_rows + 1} elements, got {ptr_host.numel()}")
        ptr = ptr_host.numpy().astype(np.int64)
        nnz = int(ptr[-1])
        ind_host = host_index(indices, "indices")
        if ind_host.numel() < nnz:
            raise ValueError(f"indices: indptr[-1] is {nnz} but indices has only {ind_host.numel()} elements")
        ids = ind_host.numpy()[:nnz].astype(np.int64)
        num_blocks_col = N // C
        if nnz and (ids.min() < 0 or ids.max() >= num_blocks_col):
            bad = int(np.argmax((ids < 0) | (ids >= num_blocks_col)))
            raise ValueError(f"indices: block column {int(ids[bad])} at position {bad} is outside [0, N / C = "
                             f"{num_blocks_col})")
        qo = np.minimum(np.arange(num_rows + 1, dtype=np.int64) * R, M)
        kv_lens = (ptr[1:] - ptr[:-1]) * C

        packed = byte_indptr = None
        if mask is not None or packed_mask is not None:
            bit_indptr, byte_indptr = _mask_layout(qo[1:] - qo[:-1], kv_lens)
            if packed_mask is not None:
                packed = _check_packed_mask(packed_mask, byte_indptr, "packed_mask",
                                            "each block row's rows*blocks*C bits padded to whole bytes").to(self.device)
            else:
                check_tensor(mask, "mask", ndim=3)
                if tuple(mask.shape) != (nnz, R, C):
                    raise ValueError(f"mask: expected shape (nnz, R, C) = {(nnz, R, C)}, got {tuple(mask.shape)}")
                # the rows of a short last block row past M are dropped: its segment ends first
                flat = convert_bsr_mask_layout(mask, ptr_host)[:int(bit_indptr[-1])]
                packed = _pack_mask(flat, bit_indptr).to(self.device)
        settings, params = self._checked_scores(pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                                head_dim, causal, packed is not None, q_dtype)
        step = self._plan_step(qo=qo, kv_lens=kv_lens, kv_starts=ptr, kv_indices=ids, page_size=C,
                               num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               settings=settings, params=params, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                               packed_mask=packed, mask_byte_indptr=byte_indptr, non_blocking=non_blocking)
        self._plan = _SparsePlan(step=step, o_dtype=o_dtype, q_shape=(M, num_qo_heads, head_dim),
                                 kv_shape=(N, num_kv_heads, head_dim), num_pages=num_blocks_col)
        self.M, self.N, self.R, self.C = M, N, R, C
        self._use_tensor_cores = True

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale_q: Optional[torch.Tensor] = None,
        scale_k: Optional[torch.Tensor] = None,
        scale_v: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Block-sparse attention for the planned mask.

        Parameters
        ----------
        q : torch.Tensor
            ``[M, num_qo_heads, head_dim]`` in ``q_data_type``.
        k, v : torch.Tensor
            ``[N, num_kv_heads, head_dim]`` in ``kv_data_type`` (read in place as ``N / C`` blocks).
        scale_q, scale_k, scale_v : Optional[torch.Tensor]
            float32 per-head scales ``[num_qo_heads]``, ``[num_kv_heads]``, ``[num_kv_heads]``: logits
            times ``scale_q[h] * scale_k[kv_head(h)]``, output times ``scale_v[kv_head(h)]`` (ones for
            those not given). FlashInfer reads them only for fp8 queries; tritoninfer applies them
            whenever given.
        out : Optional[torch.Tensor]
            ``[M, num_qo_heads, head_dim]`` in ``o_data_type``.
        lse : Optional[torch.Tensor]
            float32 ``[M, num_qo_heads]``; written whenever given.
        return_lse : bool
            Also return the base-2 LSE. Rows that see no key: output 0, LSE -inf.
        enable_pdl : Optional[bool]
            Accepted; no effect on results.
        """
        if _ops.compiling():
            return _traced_run(self, q, k, v, scale_q, scale_k, scale_v, out, lse, return_lse)
        return self._run(q, k, v, scale_q, scale_k, scale_v, out, lse, return_lse)

    def _run(self, q, k, v, scale_q, scale_k, scale_v, out, lse, return_lse):
        """``run()``'s work (the torch.compile op calls this, never ``run``, which a caller may have
        wrapped in ``torch.compile``)."""
        plan, out, lse = self._run_args(q, k, v, out, lse, return_lse, "(M, num_qo_heads, head_dim)",
                                        "(N, num_kv_heads, head_dim)")
        step = plan.step
        C = step.page_size
        # [N, H, D] as N / C pages of C tokens: strides over (page, slot, head)
        k_strides = (k.stride(0) * C, k.stride(0), k.stride(1))
        v_strides = (v.stride(0) * C, v.stride(0), v.stride(1))
        source = KVSource(k, v, k_strides, v_strides, C, step.kv_indptr, step.kv_indices, plan.num_pages)
        route_kv = None
        if not step.route.is_core:
            n, h, d = plan.kv_shape
            route_kv = PagedKV(k.view(n // C, C, h, d), v.view(n // C, C, h, d), C, h, d, d, k_strides, v_strides)
        run_step(step, q=q, kv=source, out=out, lse=lse, workspace=self._workspace, route_kv=route_kv,
                 head_scales=_head_scales(scale_q, scale_k, scale_v, step.num_qo_heads, step.num_kv_heads, q.device))
        return (out, lse) if return_lse else out

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale_q: Optional[torch.Tensor] = None,
        scale_k: Optional[torch.Tensor] = None,
        scale_v: Optional[torch.Tensor] = None,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments, defaults included, replace the planned
        scores; then runs."""
        self._override(pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, k, v, scale_q, scale_k, scale_v)


class VariableBlockSparseAttentionWrapper(_SparseBase):
    """Block-sparse attention with per-KV-head block masks and per-head variable block sizes, over
    ``q [H_qo, qo_len, D]`` and ``k, v [H_kv, kv_len, D]`` (HND).

    Each (query head, block row) is one request of a single head; its keys are its KV head's selected
    column blocks, read in place as one-token pages of ``k``/``v`` (a copy only when ``k``/``v``
    cannot be viewed as ``[H_kv * kv_len, D]``).

    Example
    -------
    >>> wrapper = tritoninfer.sparse.VariableBlockSparseAttentionWrapper(ws)
    >>> block_mask_map = torch.tensor([[[0, 0, 1], [1, 0, 1], [0, 1, 1]]], dtype=torch.bool)
    >>> wrapper.plan(block_mask_map, torch.tensor([[1, 2, 3]]), torch.tensor([[3, 1, 2]]), 1, 1, 128)
    >>> o = wrapper.run(q, k, v)  # q [1, 6, 128], k/v [1, 6, 128] fp16 -> o [1, 6, 128] fp16

    Parameters
    ----------
    float_workspace_buffer, backend
        As for :class:`BlockSparseAttentionWrapper`.
    """

    def plan(
        self,
        block_mask_map: torch.Tensor,
        block_row_sz: torch.Tensor,
        block_col_sz: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
    ) -> None:
        """Plan variable block-sparse attention.

        Parameters
        ----------
        block_mask_map : torch.Tensor
            bool (or 0/1 integers) ``[num_kv_heads, MB, NB]``: which blocks each KV head (and its
            group of query heads) attends.
        block_row_sz : torch.Tensor
            int ``[num_kv_heads, MB]``: rows per block row; every head's sum is ``qo_len``.
        block_col_sz : torch.Tensor
            int ``[num_kv_heads, NB]``: columns per block column; every head's sum is ``kv_len``.
        num_qo_heads, num_kv_heads, head_dim : int
        causal : bool
            Causal mask within each (head, block row) request, bottom-right aligned on its
            concatenated key blocks (FlashInfer's semantics).
        pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta
            As the prefill wrappers'; ``"ALIBI"`` raises ``NotImplementedError``.
        use_fp16_qk_reduction : bool
            Only False.
        non_blocking : bool
            Asynchronous host-to-device copy of the plan.
        q_data_type, kv_data_type
            fp16/bf16 queries (also the output dtype) over fp16/bf16/fp8 K/V.
        """
        self._begin_plan(use_fp16_qk_reduction)
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim, "head_dim")
        q_dtype, kv_dtype = _dtypes(q_data_type, kv_data_type, (torch.float16, torch.bfloat16))
        check_tensor(block_mask_map, "block_mask_map", ndim=3)
        check_tensor(block_row_sz, "block_row_sz", ndim=2, dtype=INDEX_DTYPES)
        check_tensor(block_col_sz, "block_col_sz", ndim=2, dtype=INDEX_DTYPES)
        hk, mb, nb = block_mask_map.shape
        if hk != num_kv_heads:
            raise ValueError(f"block_mask_map: expected num_kv_heads = {num_kv_heads} masks, got shape {(hk, mb, nb)}")
        if tuple(block_row_sz.shape) != (hk, mb):
            raise ValueError(f"block_row_sz: expected shape (num_kv_heads, MB) = {(hk, mb)}, got "
                             f"{tuple(block_row_sz.shape)}")
        if tuple(block_col_sz.shape) != (hk, nb):
            raise ValueError(f"block_col_sz: expected shape (num_kv_heads, NB) = {(hk, nb)}, got "
                             f"{tuple(block_col_sz.shape)}")
        sel = block_mask_map.cpu().numpy() != 0  # [H_kv, MB, NB]
        rows = block_row_sz.cpu().numpy().astype(np.int64)  # [H_kv, MB]
        cols = block_col_sz.cpu().numpy().astype(np.int64)  # [H_kv, NB]
        for arr, name in ((rows, "block_row_sz"), (cols, "block_col_sz")):
            if (arr < 0).any():
                raise ValueError(f"{name}: expected non-negative block sizes")
            if not (arr.sum(1) == arr.sum(1)[0]).all():
                raise ValueError(f"{name}: every KV head's sizes must have the same sum, got {arr.sum(1).tolist()}")
        qo_len, kv_len = int(rows.sum(1)[0]), int(cols.sum(1)[0])

        # page ids: token t of KV head h is page h * kv_len + t of k/v viewed as [H_kv * kv_len, D]
        col_start = np.cumsum(cols, 1) - cols + np.arange(hk)[:, None] * kv_len  # [H_kv, NB]
        h_idx, r_idx, c_idx = np.nonzero(sel)  # (head, row) major, columns in order: each request's blocks
        lengths = cols[h_idx, c_idx]
        ends = np.cumsum(lengths)
        tokens = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64)
        kv_indices = np.repeat(col_start[h_idx, c_idx] - (ends - lengths), lengths) + tokens
        row_len = (sel * cols[:, None, :]).sum(-1)  # [H_kv, MB] keys per (head, block row)
        starts = (np.cumsum(row_len) - row_len.reshape(-1)).reshape(hk, mb)
        # requests (query head, block row), query-head major: the query heads of a group share their
        # KV head's page list
        kv_lens = np.repeat(row_len, group, axis=0).reshape(-1)
        kv_starts = np.append(np.repeat(starts, group, axis=0).reshape(-1), kv_indices.size)
        qo = np.concatenate([[0], np.cumsum(np.repeat(rows, group, axis=0).reshape(-1))]).astype(np.int64)

        settings, params = self._checked_scores(pos_encoding_mode, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                                head_dim, causal, False, q_dtype)
        step = self._plan_step(qo=qo, kv_lens=kv_lens, kv_starts=kv_starts, kv_indices=kv_indices, page_size=1,
                               num_qo_heads=1, num_kv_heads=1, head_dim=head_dim, settings=settings, params=params,
                               q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=q_dtype, packed_mask=None,
                               mask_byte_indptr=None, non_blocking=non_blocking)
        self._plan = _SparsePlan(step=step, o_dtype=q_dtype, q_shape=(num_qo_heads, qo_len, head_dim),
                                 kv_shape=(num_kv_heads, kv_len, head_dim), num_pages=num_kv_heads * kv_len)
        self._num_kv_heads = num_kv_heads
        self._gqa_group_size = group

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Variable block-sparse attention for the planned masks.

        Parameters
        ----------
        q : torch.Tensor
            ``[num_qo_heads, qo_len, head_dim]`` in ``q_data_type``.
        k, v : torch.Tensor
            ``[num_kv_heads, kv_len, head_dim]`` in ``kv_data_type``.
        out : Optional[torch.Tensor]
            ``[num_qo_heads, qo_len, head_dim]`` in ``q_data_type`` (the returned layout; FlashInfer
            checks a user buffer against its internal ``[num_kv_heads * qo_len, group, head_dim]``).
        lse : Optional[torch.Tensor]
            float32 ``[num_qo_heads, qo_len]``.
        return_lse : bool
            Also return the base-2 LSE. Rows that see no key: output 0, LSE -inf.
        enable_pdl : Optional[bool]
            Accepted; no effect on results.
        """
        if _ops.compiling():
            return _traced_run(self, q, k, v, None, None, None, out, lse, return_lse)
        return self._run(q, k, v, None, None, None, out, lse, return_lse)

    def _run(self, q, k, v, scale_q, scale_k, scale_v, out, lse, return_lse):
        """``run()``'s work (see :meth:`BlockSparseAttentionWrapper._run`)."""
        plan, out, lse = self._run_args(q, k, v, out, lse, return_lse, "(num_qo_heads, qo_len, head_dim)",
                                        "(num_kv_heads, kv_len, head_dim)")
        step = plan.step
        hq, qo_len, d = plan.q_shape
        # every (head, token) is a row of its own: q [H_qo * qo_len, 1, D], k/v one-token pages
        q_rows = q.reshape(hq * qo_len, 1, d)
        k_rows = k.reshape(plan.num_pages, d)
        v_rows = v.reshape(plan.num_pages, d)
        source = KVSource(k_rows, v_rows, (k_rows.stride(0), k_rows.stride(0), 0),
                          (v_rows.stride(0), v_rows.stride(0), 0), 1, step.kv_indptr, step.kv_indices, plan.num_pages)
        out_rows = out.view(hq * qo_len, 1, d) if out.is_contiguous() else torch.empty(
            (hq * qo_len, 1, d), dtype=out.dtype, device=out.device)
        lse_rows = None
        if lse is not None:
            lse_rows = lse.view(hq * qo_len, 1) if lse.is_contiguous() else torch.empty(
                (hq * qo_len, 1), dtype=lse.dtype, device=lse.device)
        run_step(step, q=q_rows, kv=source, out=out_rows, lse=lse_rows, workspace=self._workspace)
        if out_rows.data_ptr() != out.data_ptr():
            out.copy_(out_rows.view(plan.q_shape))
        if lse is not None and lse_rows.data_ptr() != lse.data_ptr():
            lse.copy_(lse_rows.view(plan.q_shape[:2]))
        return (out, lse) if return_lse else out

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments, defaults included, replace the planned
        scores; then runs."""
        self._override(pos_encoding_mode, use_fp16_qk_reduction, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, k, v)


def _traced_run(wrapper: _SparseBase, q, k, v, scale_q, scale_k, scale_v, out, lse, return_lse):
    """``run()`` while Dynamo traces: outputs allocated in the traced code (shape from ``q`` and ``v``,
    dtype the plan's output dtype), the work done by the ``tritoninfer::sparse_run`` op."""
    if out is None:
        # both layouts put the output's two leading dimensions where q has them
        out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=wrapper._o_dtype or q.dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    _sparse_run_op(wrapper._handle, q, k, v, out, lse, scale_q, scale_k, scale_v)
    return (out, lse) if return_lse else out


@_ops.custom_op("sparse_run", mutates_args=("out", "lse"))
def _sparse_run_op(handle: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: Optional[torch.Tensor], scale_q: Optional[torch.Tensor], scale_k: Optional[torch.Tensor],
                   scale_v: Optional[torch.Tensor]) -> None:
    """A sparse wrapper's ``run()`` into ``out`` (and ``lse``), for torch.compile (``_ops.py``)."""
    wrapper = _ops._WRAPPERS.get(handle)
    if wrapper is None:
        raise ValueError(f"tritoninfer::sparse_run: the wrapper of handle {handle} no longer exists")
    wrapper._run(q, k, v, scale_q, scale_k, scale_v, out, lse, False)
