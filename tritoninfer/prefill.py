"""Prefill / append attention: ``single_prefill_with_kv_cache``, ``BatchPrefillWithPagedKVCacheWrapper``
and ``BatchPrefillWithRaggedKVCacheWrapper`` (FlashInfer 0.5.3's API), on the attention core that
decode uses.

Query tokens of a request are cut into tiles of ``block_m // group`` tokens; each tile's rows are
(token, query head of the GQA group) pairs, so every KV byte is read once per group.

On Hopper, ragged and paged (pages of 8-128 tokens, NHD) plans of plain bf16 attention at head_dim 64, 128
or 256 (and DeepSeek's 192 / 128, ragged) with long requests (``_route.PrefillRoute``) run a persistent warp-specialised Gluon kernel instead
(``kernels/prefill_hopper.py``, FlashAttention-3's schedule: 1.25-1.8x the attention core at 4K-16K
tokens); everything else runs the attention core.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from . import _device, _errors, _hopper, _ops, _variants
from ._attention import KVSource, PlanUploader, score_params, scratch_workspace
from ._replay import NO_SCALES, RunReplay, capturing, replayed, scalar_options
from ._route import PREFILL, PlanFacts, core, prefill_switches
from ._step import GraphBuffers, PlannedStep, Settings, plan_single, plan_work, run_step, upload_plan
from ._kvcache import CacheViews, PagedKVCache, host_page_table, page_table_from_block_tables
from ._options import (
    KV_DTYPES,
    Q_DTYPES,
    TensorLayout,
    canonicalize_dtype,
    check_dtype_in,
    check_head_dim,
    check_heads,
    check_indptr_host,
    check_out,
    check_query,
    check_positive_int,
    check_sinks,
    check_tensor,
    copy_into,
    host_index,
    parse_layout,
)
from ._plan import prefill_tiles

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]

# FlashInfer backend names; every one selects tritoninfer's Triton kernels.
PREFILL_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cudnn", "cutlass", "triton")
O_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_backend(backend: str) -> None:
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend: expected one of {PREFILL_BACKENDS}, got {backend!r}")


def _reject_unsupported(use_fp16_qk_reduction: bool) -> None:
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True: tritoninfer always accumulates q.k in fp32")


def _plan_dtypes(q_data_type, kv_data_type, q_allowed=Q_DTYPES) -> Tuple[torch.dtype, torch.dtype]:
    """A plan's query and K/V dtypes (K/V defaults to the query's); also the block-sparse wrappers'."""
    q_dtype = check_dtype_in(canonicalize_dtype(q_data_type, "q_data_type"), q_allowed, "q_data_type")
    kv_dtype = q_dtype if kv_data_type is None else canonicalize_dtype(kv_data_type, "kv_data_type")
    check_dtype_in(kv_dtype, KV_DTYPES, "kv_data_type")
    return q_dtype, kv_dtype


def _scores(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim, causal,
            masked: bool):
    """The settings a plan keeps (as given) and the scores its kernel computes: a custom mask replaces
    the causal mask (FlashInfer 0.5.3's MaskMode.CUSTOM)."""
    params = score_params(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, head_dim,
                          causal=bool(causal) and not masked)
    settings = Settings(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, bool(causal))
    return settings, params


def _route_and_work(facts: PlanFacts, tiles, num_qo_heads: int, num_kv_heads: int, *, workspace_bytes: int,
                    num_sms: int, graph=None, fixed_split_size=None, disable_split_kv=False, core_reason=None):
    """The route and the work list of a prefill-shaped plan (the paged and ragged wrappers, the
    block-sparse ones); ``core_reason`` keeps the attention core without asking the route."""
    route = core(core_reason) if core_reason else PREFILL.at_plan(facts)
    work = plan_work(qo_lens=facts.qo_lens, kv_lens=facts.kv_lens, tiles=tiles, num_qo_heads=num_qo_heads,
                     num_kv_heads=num_kv_heads, head_dim_vo=facts.head_dim_vo, page_size=facts.page_size,
                     fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                     workspace_bytes=workspace_bytes, num_sms=num_sms, graph=graph, heaviest_first=facts.params.causal)
    return route, work


def _step_fields(facts: PlanFacts, settings: Settings, tiles, num_qo_heads: int, num_kv_heads: int, total_rows: int,
                 device_plan, packed_mask, mask_indptr, route, route_view) -> dict:
    """The fields of a prefill-shaped ``PlannedStep`` but its K/V page table (``route_view``: the
    uploaded ``route.work``, unused on the core)."""
    batch = facts.kv_lens.size
    return dict(
        settings=settings, params=facts.params, q_dtype=facts.q_dtype, kv_dtype=facts.kv_dtype,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=facts.head_dim_qk,
        head_dim_vo=facts.head_dim_vo, page_size=facts.page_size, batch=batch, total_rows=total_rows,
        kv_lens=facts.kv_lens, tiles=tiles, device_plan=device_plan,
        packed_mask=packed_mask, mask_indptr=mask_indptr if packed_mask is not None else None, route=route,
        route_work=None if route.is_core else _hopper.tiles_view(route_view, route.work),
    )


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)


@dataclasses.dataclass(frozen=True)
class _MultiItem:
    """Multi-item scoring's plan arguments, type-checked (``_multi_item_args``); checked against the
    batch in ``_plan_common``."""

    prefix_len: np.ndarray  # int64 [batch], host
    token_pos: torch.Tensor  # the caller's 1-D integer tensor
    token_pos_len: int
    max_items: int  # elements of max_item_len_ptr (tritoninfer's kernel needs no item-length hint)


def _multi_item_args(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr):
    """None without multi-item scoring; else its arguments as a ``_MultiItem`` (prefix lengths copied to
    the host: one small device-to-host copy, as the plan's indptrs)."""
    given = [n for n, x in (("prefix_len_ptr", prefix_len_ptr), ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                            ("max_item_len_ptr", max_item_len_ptr)) if x is not None]
    if not given:
        if token_pos_in_items_len:
            raise ValueError("token_pos_in_items_len: given without prefix_len_ptr, token_pos_in_items_ptr and "
                             "max_item_len_ptr (multi-item scoring needs all four)")
        return None
    if len(given) != 3:
        missing = sorted({"prefix_len_ptr", "token_pos_in_items_ptr", "max_item_len_ptr"} - set(given))
        raise ValueError(f"{missing[0]}: multi-item scoring needs prefix_len_ptr, token_pos_in_items_ptr and "
                         f"max_item_len_ptr together")
    if isinstance(token_pos_in_items_len, torch.Tensor) and token_pos_in_items_len.numel() == 1:
        token_pos_in_items_len = token_pos_in_items_len.item()  # FlashInfer's hopper test passes a tensor
    if isinstance(token_pos_in_items_len, bool) or not isinstance(token_pos_in_items_len, (int, np.integer)) \
            or token_pos_in_items_len < 1:
        raise ValueError(f"token_pos_in_items_len: expected a positive int (each request's padded length in "
                         f"token_pos_in_items_ptr), got {token_pos_in_items_len!r}")
    # a one-request batch may pass its prefix length and longest item as 0-d tensors (FlashInfer's
    # tests do: the kernel reads element 0 either way)
    prefix_len_ptr, max_item_len_ptr = (t.reshape(1) if isinstance(t, torch.Tensor) and t.dim() == 0 else t
                                        for t in (prefix_len_ptr, max_item_len_ptr))
    for name, t in (("prefix_len_ptr", prefix_len_ptr), ("token_pos_in_items_ptr", token_pos_in_items_ptr),
                    ("max_item_len_ptr", max_item_len_ptr)):
        check_tensor(t, name, ndim=1, dtype=_INT_DTYPES)
    prefix = prefix_len_ptr.to("cpu").to(torch.int64).numpy()
    if (prefix < 0).any():
        raise ValueError(f"prefix_len_ptr: prefix lengths must be >= 0, got {int(prefix.min())}")
    return _MultiItem(prefix, token_pos_in_items_ptr, int(token_pos_in_items_len), max_item_len_ptr.numel())


def _multi_item_scores(params, multi_item: bool):
    """The scores with multi-item scoring's mask, which is causal whatever ``causal`` says (FlashInfer's
    ``MaskMode::kMultiItemScoring``)."""
    return dataclasses.replace(params, causal=True, multi_item=True) if multi_item else params


def _multi_item_arrays(mi: _MultiItem, qo_lens: np.ndarray, kv_lens: np.ndarray,
                       device) -> Tuple[torch.Tensor, np.ndarray]:
    """The kernel's multi-item arguments (``_attention.launch_attention``): the token positions as int32
    on ``device``, and per request (offset of sequence position 0 in them, prefix length) int64
    ``[batch, 2]``. Raises ``ValueError`` for lengths that do not fit the batch."""
    batch = kv_lens.size
    for name, n in (("prefix_len_ptr", mi.prefix_len.size), ("max_item_len_ptr", mi.max_items)):
        if n != batch:
            raise ValueError(f"{name}: expected {batch} elements (one per request), got {n}")
    # a request's rows at sequence positions prefix_len .. kv_len - 1 read its segment of token positions
    prefix = np.minimum(mi.prefix_len, kv_lens)
    after = np.where(qo_lens > 0, kv_lens - prefix, 0)
    length = mi.token_pos_len
    if (after > length).any():
        i = int(np.argmax(after > length))
        raise ValueError(f"token_pos_in_items_len: request {i} has {int(after[i])} tokens after its prefix "
                         f"(kv_len {int(kv_lens[i])} - prefix_len {int(prefix[i])}), more than "
                         f"token_pos_in_items_len = {length}")
    starts = np.arange(batch, dtype=np.int64) * length
    need = int((starts + after)[after > 0].max(initial=0))
    if need >= 2 ** 31:
        raise ValueError(f"token_pos_in_items_ptr: {need} elements exceed the kernel's int32 offsets")
    token_pos = mi.token_pos.to(device=device, dtype=torch.int32).contiguous()
    if token_pos.numel() < need:
        # FlashInfer reads past the end of a short tensor (its own tests pass one whose last request's
        # segment is a few entries short); here the missing entries are 0, never memory outside it
        token_pos = torch.cat([token_pos, token_pos.new_zeros(need - token_pos.numel())])
    return token_pos, np.stack([starts - prefix, prefix], axis=1)


def _mask_layout(qo_lens: np.ndarray, kv_lens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Bit offsets of each request's [qo, kv] mask in the flat bool mask, and byte offsets of its
    segment in the packed mask (each request's segment is padded to whole bytes)."""
    bits = qo_lens.astype(np.int64) * kv_lens.astype(np.int64)
    bit_indptr = np.concatenate([[0], np.cumsum(bits)])
    byte_indptr = np.concatenate([[0], np.cumsum((bits + 7) // 8)])
    return bit_indptr, byte_indptr


def _check_packed_mask(packed: torch.Tensor, byte_indptr: np.ndarray, name: str, bits_doc: str) -> torch.Tensor:
    """A caller's packed mask, checked against the bytes of the layout (``_mask_layout``)."""
    check_tensor(packed, name, ndim=1, dtype=torch.uint8)
    if packed.numel() != int(byte_indptr[-1]):
        raise ValueError(f"{name}: expected {int(byte_indptr[-1])} bytes ({bits_doc}), got {packed.numel()}")
    return packed


def _pack_mask(custom_mask: torch.Tensor, bit_indptr: np.ndarray) -> torch.Tensor:
    from .quantization import segment_packbits

    indptr = torch.from_numpy(bit_indptr.astype(np.int64)).to(custom_mask.device)
    packed, _ = segment_packbits(custom_mask.contiguous().view(-1), indptr, bitorder="little")
    return packed


class _BatchPrefillBase:
    """Plan and run shared by the paged and the ragged prefill wrappers."""

    _paged: bool

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                     mask_indptr_buf, backend, jit_args, jit_kwargs) -> None:
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        _check_backend(backend)
        # FlashInfer's AttentionSink variant runs as the sinks path (_variants.py); any other raises
        self._jit_variant = _variants.sink_variant(jit_args, jit_kwargs)
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = parse_layout(kv_layout)
        self._caches = CacheViews(self._kv_layout)
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        if use_cuda_graph:
            if not torch.is_tensor(qo_indptr_buf):
                raise ValueError("qo_indptr_buf should be a torch.Tensor in cuda graph mode")
            check_tensor(qo_indptr_buf, "qo_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
            self._fixed_batch_size = len(qo_indptr_buf) - 1
        else:
            self._fixed_batch_size = 0
        for name, buf in (("custom_mask_buf", custom_mask_buf), ("mask_indptr_buf", mask_indptr_buf)):
            if buf is not None and not use_cuda_graph:
                raise ValueError(f"{name}: only used with use_cuda_graph=True")
        if custom_mask_buf is not None:
            check_tensor(custom_mask_buf, "custom_mask_buf", ndim=1, dtype=torch.uint8, device=self.device)
        if mask_indptr_buf is not None:
            check_tensor(mask_indptr_buf, "mask_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
        self._qo_indptr_buf = qo_indptr_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._uploader = PlanUploader(self.device, reuse=True)
        self._graph = GraphBuffers(self.device) if use_cuda_graph else None
        self._step: Optional[PlannedStep] = None  # what the last plan() fixed; all run() reads
        self._replay: Optional[RunReplay] = None  # the last eager run(), for the next one of its kind
        self._faults = _errors.FaultWatch(self.device)
        self._handle = _ops.register_wrapper(self)  # for run() under torch.compile (_ops.wrapper_run)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        """Replace the float workspace. ``int_workspace_buffer`` is accepted for compatibility:
        tritoninfer keeps its plan in buffers the wrapper owns and needs no int workspace."""
        check_tensor(float_workspace_buffer, "float_workspace_buffer")
        self._float_workspace_buffer = float_workspace_buffer

    def end_forward(self) -> None:
        """No-op, kept for compatibility."""

    def _plan_common(
        self, *, qo_indptr_host: torch.Tensor, kv_lens: np.ndarray, kv_extra: list, num_qo_heads, num_kv_heads,
        head_dim_qk, head_dim_vo, page_size, custom_mask, packed_custom_mask, causal, pos_encoding_mode, sm_scale,
        window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type, non_blocking,
        fixed_split_size, disable_split_kv, multi_item: Optional[_MultiItem] = None,
    ) -> Tuple[dict, list]:
        """The plan skeleton of both prefill wrappers: checks, mask, tiles, route, work list, upload.
        ``kv_extra`` are the K/V page table's host arrays to upload with the plan. Returns the fields of
        the ``PlannedStep`` but its K/V tensors, and the device views of ``kv_extra``."""
        group = check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim_qk, "head_dim_qk")
        head_dim_vo = head_dim_qk if head_dim_vo is None else check_head_dim(head_dim_vo, "head_dim_vo")
        q_dtype, kv_dtype = _plan_dtypes(q_data_type, kv_data_type)
        has_mask = custom_mask is not None or packed_custom_mask is not None
        if self._use_cuda_graph and self._custom_mask_buf is not None and not has_mask:
            raise ValueError(
                "custom_mask: this wrapper was created with custom_mask_buf, so (as in FlashInfer) every run "
                "applies the mask buffer; pass this plan's custom_mask or packed_custom_mask"
            )
        if multi_item is not None:
            # FlashInfer's multi-item mode silently replaces a custom mask: refused here instead
            if has_mask:
                raise ValueError("custom_mask: multi-item scoring (prefix_len_ptr) and a custom mask exclude each other")
            if self._use_cuda_graph:
                raise NotImplementedError("multi-item scoring (prefix_len_ptr) in cuda graph mode")
        settings, params = _scores(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                   head_dim_qk, causal, has_mask)
        params = _multi_item_scores(params, multi_item is not None)
        check_indptr_host(qo_indptr_host, "qo_indptr")
        batch = qo_indptr_host.numel() - 1
        if kv_lens.size != batch:
            raise ValueError(f"qo_indptr and the KV page table disagree on the batch size ({batch} vs {kv_lens.size})")
        qo = qo_indptr_host.numpy().astype(np.int64)
        qo_lens = qo[1:] - qo[:-1]
        total_rows = int(qo[-1])

        # custom mask: FlashInfer's flat bool [sum qo_i*kv_i] or its little-endian packing
        packed = None
        byte_indptr = None
        if has_mask:
            bit_indptr, byte_indptr = _mask_layout(qo_lens, kv_lens)
            if packed_custom_mask is not None:
                packed = _check_packed_mask(packed_custom_mask, byte_indptr, "packed_custom_mask",
                                            "each request's qo_len*kv_len bits padded to whole bytes")
            else:
                check_tensor(custom_mask, "custom_mask")
                if custom_mask.numel() != int(bit_indptr[-1]):
                    raise ValueError(
                        f"custom_mask: expected {int(bit_indptr[-1])} elements (sum of qo_len*kv_len), got {custom_mask.numel()}"
                    )
                packed = _pack_mask(custom_mask, bit_indptr)
            packed = packed.to(self.device)
        if multi_item is not None:
            packed, multi_item_rows = _multi_item_arrays(multi_item, qo_lens, kv_lens, self.device)

        graph = self._graph
        workspace_bytes = self._float_workspace_buffer.numel()
        num_sms = _device.num_sms(self.device)
        if graph is not None:
            if batch != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                    f"mismatches the batch size set during initialization {self._fixed_batch_size}"
                )
            if not graph.sized:
                # sized once, from the first plan's total rows (as FlashInfer does); captured graphs
                # keep its tiles, grid and pointers into its buffer
                tiles = prefill_tiles(group, max(head_dim_qk, head_dim_vo), total_rows * group / max(batch, 1),
                                      kv_dtype.itemsize)
                graph.size(rows=total_rows, q_tiles=-(-total_rows // tiles.tile_tokens) + batch, batch=batch,
                           tiles=tiles, num_sms=num_sms, workspace_bytes=workspace_bytes, num_qo_heads=num_qo_heads,
                           head_dim_vo=head_dim_vo)
            if total_rows > graph.max_rows:
                raise ValueError(
                    f"qo_indptr: {total_rows} query rows exceed the {graph.max_rows} of the first plan "
                    "in cuda graph mode"
                )
            tiles = graph.tiles
        else:
            tiles = prefill_tiles(group, max(head_dim_qk, head_dim_vo), total_rows * group / max(batch, 1),
                                  kv_dtype.itemsize)
        facts = PlanFacts(
            device=self.device, q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            layout=self._kv_layout, use_cuda_graph=graph is not None, has_mask=has_mask, params=params,
            qo_lens=qo_lens, kv_lens=kv_lens, page_size=page_size)
        route, work = _route_and_work(facts, tiles, num_qo_heads, num_kv_heads, workspace_bytes=workspace_bytes,
                                      num_sms=num_sms, graph=graph, fixed_split_size=fixed_split_size,
                                      disable_split_kv=disable_split_kv)
        mask_arrays = [byte_indptr] if byte_indptr is not None and graph is None else []
        if multi_item is not None:
            mask_arrays = [multi_item_rows.reshape(-1)]
        route_arrays = [] if route.is_core else [_hopper.padded_tiles(route.work)]
        plan, views = upload_plan(self._uploader, graph, work, kv_lens, qo, mask_arrays + kv_extra + route_arrays,
                                  non_blocking)
        mask_indptr_d = views[0] if mask_arrays else None
        if graph is not None:
            copy_into(self._qo_indptr_buf, plan.qo_indptr, non_blocking)
            plan = dataclasses.replace(plan, qo_indptr=self._qo_indptr_buf)
            if packed is not None:
                if self._custom_mask_buf is None or self._mask_indptr_buf is None:
                    raise ValueError("custom masks in cuda graph mode need custom_mask_buf and mask_indptr_buf")
                if packed.numel() > self._custom_mask_buf.numel():
                    raise ValueError(f"custom_mask_buf: holds {self._custom_mask_buf.numel()} bytes, the mask needs {packed.numel()}")
                copy_into(self._custom_mask_buf[:packed.numel()], packed, non_blocking)
                copy_into(self._mask_indptr_buf[:batch + 1], torch.from_numpy(byte_indptr.astype(np.int32)), non_blocking)
                packed, mask_indptr_d = self._custom_mask_buf, self._mask_indptr_buf
        fields = _step_fields(facts, settings, tiles, num_qo_heads, num_kv_heads, total_rows, plan, packed,
                              mask_indptr_d, route, views[-1])
        return fields, views[len(mask_arrays):len(views) - len(route_arrays)]

    def _run_into(self, q, kv, out, lse, *, sinks, q_scale, k_scale, v_scale, window_left, q_len_per_req) -> None:
        """``run()`` into ``out``/``lse``, eagerly: the implementation of ``_ops.wrapper_run`` (``kv``: the
        paged cache, or the ragged ``(k, v)``)."""
        if self._paged:
            self._run(q, kv, q_scale, k_scale, v_scale, out, lse, False, window_left, sinks)
        else:
            self._run(q, *kv, out, lse, False, sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def _override(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                  rope_scale, rope_theta) -> None:
        """The deprecated forward(): its arguments, defaults included, replace the planned settings."""
        step = self._step
        if step is None:
            raise ValueError("forward() was called before plan()")
        _reject_unsupported(use_fp16_qk_reduction)
        settings, params = _scores(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                                   step.head_dim_qk, causal, step.packed_mask is not None)
        params = _multi_item_scores(params, step.params.multi_item)
        if params is step.params and settings == step.settings:
            return  # (SGLang calls forward() with the same scores every layer: the step, and its replay, stay)
        self._step = step.with_scores(settings, params)

    def _run_common(self, q, kv: KVSource, kv_dtype, head_dim_qk, head_dim_vo, out, lse, return_lse, *,
                    route_kv=None, q_scale=None, k_scale=None, v_scale=None, sinks=None, window_left=None,
                    inputs: Optional[tuple] = None, options: tuple = ()):
        """Checks of ``q``, ``out`` and ``lse`` against the plan, then the step's kernel (``route_kv``:
        the K/V as the route's ``at_run`` takes them). ``inputs``: the call's input tensors, for a call
        without sinks or window and with scales as numbers (``options``), whose launch the next such call
        may replay (``_replay.py``)."""
        step = self._step
        if window_left is not None and window_left != step.settings.window_left:
            raise ValueError(f"window_left: run() got {window_left} but plan() used {step.settings.window_left}")
        graph = self._graph is not None
        # in CUDA-graph mode q may have more rows than the plan (the captured batch)
        rows = q.shape[0] if graph and type(q) is torch.Tensor and q.dim() == 3 and q.shape[0] >= step.total_rows \
            else step.total_rows
        check_query(q, step.q_dtype, (rows, step.num_qo_heads, step.head_dim_qk),
                    "(qo_indptr[-1], num_qo_heads, head_dim_qk)")
        if kv_dtype != step.kv_dtype:
            raise ValueError(
                f"The dtype of k/v {kv_dtype} does not match the kv_data_type {step.kv_dtype} specified in plan function."
            )
        if (head_dim_qk, head_dim_vo) != (step.head_dim_qk, step.head_dim_vo):
            raise ValueError(
                f"k/v head dims {head_dim_qk}/{head_dim_vo} do not match the planned {step.head_dim_qk}/{step.head_dim_vo}"
            )
        if kv.k.device != q.device:
            raise ValueError("k/v and q must be on the same device")
        shape = (q.shape[0], step.num_qo_heads, step.head_dim_vo)
        out_arg, lse_arg = out, lse
        zeroed = out is None and (graph or q.shape[0] > step.total_rows)
        if zeroed:
            # rows beyond the plan are 0; in cuda graph mode a later plan may have fewer rows than
            # the captured one, so the captured zero-fill covers them on every replay
            out = torch.zeros(shape, dtype=q.dtype, device=q.device)
        out = check_out(out, shape, q.dtype, q.device, "out")
        if lse is not None or return_lse:
            # a caller's lse buffer is written whether or not it is returned, as in FlashInfer
            lse = check_out(lse, shape[:2], torch.float32, q.device, "lse")
        sinks = check_sinks(sinks, step.num_qo_heads, q.device)
        call = run_step(step, q=q, kv=kv, out=out, lse=lse, workspace=self._float_workspace_buffer, route_kv=route_kv,
                        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        if inputs is not None:
            self._replay = RunReplay.record(step, inputs, options, out_arg, lse_arg, out, lse, return_lse, zeroed, (call,),
                                            self._replay)
        return (out, lse) if return_lse else out


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill / append attention of ragged queries over a paged KV cache.

    ``plan()`` does the host work once per step (host copies of the page table, query tiles,
    split-KV decision, packed custom masks) and keeps it in device buffers the wrapper owns;
    ``run()`` launches without synchronising and can be captured in a CUDA graph.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = tritoninfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16,
    ...              causal=True, q_data_type=torch.bfloat16)
    >>> o = wrapper.run(q, kv_cache)  # q [qo_indptr[-1], 32, 128] -> o [qo_indptr[-1], 32, 128]

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 buffer for split-KV partial states; its size is checked against each plan.
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_cuda_graph : bool
        Fixed batch size and buffers; the launch grid is fixed by the first plan, so a captured
        graph replays correctly after re-planning (query rows may not exceed the first plan's).
    qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf : torch.Tensor
        int32 fixed buffers ``[batch+1]``, ``[batch+1]``, ``[max_pages]``, ``[batch]``; required
        with ``use_cuda_graph``.
    custom_mask_buf, mask_indptr_buf : torch.Tensor
        uint8 ``[max_mask_bytes]`` and int32 ``[batch+1]`` fixed buffers for custom (tree) masks in
        cuda graph mode.
    backend : str
        ``"auto"``, ``"fa2"``, ``"fa3"``, ``"trtllm-gen"``, ``"cudnn"`` or ``"triton"``: every value
        runs tritoninfer's Triton kernels; other values raise.
    jit_args, jit_kwargs
        FlashInfer's custom CUDA variants: its AttentionSink variant (the one
        ``BatchAttentionWithAttentionSinkWrapper`` builds) runs as the sinks path, ``run(q, kv, sink,
        sm_scale)`` (``_variants.py``); any other raises ``NotImplementedError``.
    """

    _paged = True

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Optional[List[Any]] = None,
        jit_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                          mask_indptr_buf, backend, jit_args, jit_kwargs)
        if use_cuda_graph:
            for name, buf in (("paged_kv_indptr_buf", paged_kv_indptr_buf), ("paged_kv_indices_buf", paged_kv_indices_buf),
                              ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name} should be a torch.Tensor in cuda graph mode")
                check_tensor(buf, name, ndim=1, dtype=torch.int32, device=self.device)
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1 or len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError("paged_kv_indptr_buf/paged_kv_last_page_len_buf: sizes must match qo_indptr_buf's batch")
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        prefix_len_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_q: Optional[torch.Tensor] = None,
        block_tables: Optional[torch.Tensor] = None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan batch prefill for one step (all layers).

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch+1]``: request i's query rows are ``q[qo_indptr[i]:qo_indptr[i+1]]``.
        paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len : torch.Tensor
            int32 page table ``[batch+1]``, ``[paged_kv_indptr[-1]]``, ``[batch]`` (last_page_len
            in 1..page_size; a request with no pages has KV length 0).
        num_qo_heads, num_kv_heads, head_dim_qk, page_size : int
        head_dim_vo : Optional[int]
            V/output head dim (defaults to ``head_dim_qk``), e.g. 192/128.
        custom_mask : Optional[torch.Tensor]
            bool, flattened ``[sum(qo_len[i] * kv_len[i])]``, row-major ``[qo, kv]`` per request;
            True keeps a key. Overrides ``causal``.
        packed_custom_mask : Optional[torch.Tensor]
            uint8: ``custom_mask`` packed little-endian per request, each request's segment padded
            to whole bytes (``segment_packbits(custom_mask, bit_indptr, bitorder="little")``).
        causal : bool
            Bottom-right aligned causal mask (query i sees keys ``j <= i + kv_len - qo_len``).
        pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta
            As in decode; without ``causal``, ``window_left`` limits the left side only.
        use_fp16_qk_reduction : bool
            Only False is supported (raises ``NotImplementedError``).
        q_data_type, kv_data_type
            fp16/bf16 queries; fp16/bf16/e4m3/e5m2 KV (``kv_data_type`` defaults to ``q_data_type``).
        non_blocking : bool
            Asynchronous host-to-device copies of the plan.
        prefix_len_ptr : Optional[torch.Tensor]
            Multi-item scoring (all four arguments together; ``None`` / 0: off). Integer (FlashInfer:
            uint32) ``[batch]`` (0-d for one request), any device: request i's first ``prefix_len_ptr[i]`` sequence positions
            are its shared prefix (often the cached part, ``kv_len - qo_len``), the rest are items,
            each a delimiter followed by its tokens. The mask is then causal whatever ``causal`` says:
            the query at sequence position ``p = kv_len - qo_len + j`` sees key ``k <= p`` iff
            ``p < prefix_len`` (a prefix row: plain causal), or ``k < prefix_len``, or
            ``k > p - token_pos_in_items[p - prefix_len]`` (its own item's tokens up to itself; a
            delimiter, position 0, sees only the prefix). ``window_left`` and soft cap still apply;
            a custom mask cannot be combined with it (``ValueError``; FlashInfer ignores the mask).
        token_pos_in_items_ptr : Optional[torch.Tensor]
            1-D integer tensor (FlashInfer: uint16), ``token_pos_in_items_len`` elements per request,
            concatenated: element ``p - prefix_len`` of request i's segment is the position of sequence
            position ``p`` within its item, 0 at each delimiter (items of 3, 2, 4 tokens:
            ``[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0]``, zero-padded to ``token_pos_in_items_len``). Only
            the segments' first ``kv_len - prefix_len`` elements are read, so the last segment may be
            shorter; a tensor too short for them reads 0 past its end (FlashInfer reads past the
            tensor). Copied by ``plan()`` (later changes to the tensor do not reach ``run()``).
        token_pos_in_items_len : int
            Each request's padded segment length in ``token_pos_in_items_ptr``; at least
            ``kv_len - prefix_len`` of every request (``ValueError`` otherwise).
        max_item_len_ptr : Optional[torch.Tensor]
            Integer (FlashInfer: uint16) ``[batch]``, the longest item of each request: FlashInfer
            skips the KV tiles before ``first query position - max_item_len`` past the prefix (a value
            below the true one drops keys there). tritoninfer checks only its shape: each query tile
            skips the keys none of its rows sees, found from the rows' own ``token_pos_in_items``.
            Not with ``use_cuda_graph`` (``NotImplementedError``).
        seq_lens, block_tables
            The alternative page-table form (``block_tables`` int32 ``[batch, max_pages]`` with KV
            lengths ``seq_lens``); replaces the ``paged_kv_*`` arguments when given.
        seq_lens_q : Optional[torch.Tensor]
            Query lengths; used to build ``qo_indptr`` when that is None.
        max_token_per_sequence, max_sequence_kv : Optional[int]
            cuDNN planning hints; tritoninfer plans from the true lengths and only checks that the
            hints are not below them.
        fixed_split_size : Optional[int]
            Split KV into chunks of this many pages, independently of the batch (batch-invariant).
        disable_split_kv : bool
            Never split KV (batch-invariant).
        """
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        _reject_unsupported(use_fp16_qk_reduction)
        multi_item = _multi_item_args(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        check_positive_int(page_size, "page_size")
        if qo_indptr is None:
            if seq_lens_q is None:
                raise ValueError("qo_indptr: required (or pass seq_lens_q)")
            lens_q = host_index(seq_lens_q, "seq_lens_q").to(torch.int64)
            qo_indptr = torch.zeros(lens_q.numel() + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(lens_q, 0)
        qo_indptr_host = host_index(qo_indptr, "qo_indptr")
        if block_tables is not None:
            indptr_host, paged_kv_indices, last_host = page_table_from_block_tables(block_tables, seq_lens, page_size)
        else:
            indptr_host = host_index(paged_kv_indptr, "paged_kv_indptr")
            last_host = host_index(paged_kv_last_page_len, "paged_kv_last_page_len")
        table = host_page_table(indptr_host, last_host, paged_kv_indices, page_size, prefix="paged_kv_")
        ind, lpl, kv_lens, num_pages_used = table.indptr, table.last_page_len, table.kv_lens, table.num_pages_used
        qo = qo_indptr_host.numpy().astype(np.int64)
        for hint, value, name in ((max_token_per_sequence, (qo[1:] - qo[:-1]).max(initial=0), "max_token_per_sequence"),
                                  (max_sequence_kv, kv_lens.max(initial=0), "max_sequence_kv")):
            if hint is not None and hint < value:
                raise ValueError(f"{name}: {hint} is below the true maximum {int(value)}")

        if self._use_cuda_graph and num_pages_used > len(self._paged_kv_indices_buf):
            raise ValueError(f"paged_kv_indices: {num_pages_used} pages exceed paged_kv_indices_buf ({len(self._paged_kv_indices_buf)})")
        # the plan's own indptr (checked above) is what the kernels read, never the caller's tensor
        kv_extra = [ind, lpl] if self._use_cuda_graph else [ind]
        fields, views = self._plan_common(
            qo_indptr_host=qo_indptr_host, kv_lens=kv_lens, kv_extra=kv_extra,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=page_size, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv, multi_item=multi_item,
        )
        if self._use_cuda_graph:
            copy_into(self._paged_kv_indptr_buf, views[0], non_blocking)
            copy_into(self._paged_kv_last_page_len_buf, views[1], non_blocking)
            copy_into(self._paged_kv_indices_buf[:num_pages_used], paged_kv_indices[:num_pages_used], non_blocking)
            kv_indptr, kv_indices = self._paged_kv_indptr_buf, self._paged_kv_indices_buf
        else:
            kv_indptr = views[0]
            kv_indices = paged_kv_indices.to(self.device, non_blocking=non_blocking).to(torch.int32)
        self._step = PlannedStep(**fields, total_kv=0, kv_indptr=kv_indptr, kv_indices=kv_indices, page_table=table)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        *args,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Prefill attention for the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` in ``q_data_type``.
        paged_kv_cache
            Any of FlashInfer's cache forms (see ``BatchDecodeWithPagedKVCacheWrapper.run``).
        *args
            FlashInfer's custom-JIT extras; tritoninfer has none, so any raises ``TypeError``.
        q_scale, k_scale, v_scale : Optional[float]
            fp8 scales: ``q_scale * k_scale`` multiplies ``sm_scale``, ``v_scale`` the output.
        out, lse : Optional[torch.Tensor]
            Preallocated ``[qo_indptr[-1], num_qo_heads, head_dim_vo]`` (q's dtype) and float32
            ``[qo_indptr[-1], num_qo_heads]``.
        return_lse : bool
            Also return the base-2 LSE (excluding sinks). Rows that see no key: 0 / -inf.
        enable_pdl : Optional[bool]
            A CUDA launch attribute Triton does not expose; accepted, no effect on results.
        window_left : Optional[int]
            Must equal the planned value.
        sinks : Optional[torch.Tensor]
            float32 ``[num_qo_heads]`` attention-sink logits added to the softmax denominator only.
        """
        if self._jit_variant is not None:
            return _variants.run_sink_variant(self, q, (paged_kv_cache,), args, q_scale=q_scale, k_scale=k_scale,
                                              v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                                              window_left=window_left, sinks=sinks)
        if args:
            raise TypeError("run(): options after paged_kv_cache must be passed by keyword")
        if _ops.compiling():
            return _ops.traced_run(self, q, paged_kv_cache, out, lse, return_lse, zero_out=self._use_cuda_graph,
                                   sinks=sinks, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                                   window_left=window_left)
        return self._run(q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks)

    def _run(self, q, paged_kv_cache, q_scale, k_scale, v_scale, out, lse, return_lse, window_left, sinks):
        """``run()``'s work (``_ops.wrapper_run`` calls this, never the ``run`` attribute, which a caller
        may have wrapped in ``torch.compile``)."""
        inputs, options = None, (q_scale, k_scale, v_scale)
        if sinks is None and window_left is None and scalar_options(*options):
            inputs = (q, *paged_kv_cache) if type(paged_kv_cache) is tuple else (q, paged_kv_cache)
            done = replayed(self, inputs, options, out, lse, return_lse)
            if done is not None:
                return done
        step = self._step
        if step is None:
            raise ValueError("run() was called before plan()")
        kv, source = self._caches.source(paged_kv_cache, step, self._kv_source)
        return self._run_common(q, source, kv.dtype, kv.head_dim_qk, kv.head_dim_vo, out, lse, return_lse,
                                route_kv=kv, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                window_left=window_left, inputs=inputs, options=options)

    def _kv_source(self, kv) -> KVSource:
        """The checks of a cache against the plan, and the kernel's view of it (once per cache and
        plan: ``CacheViews``)."""
        step = self._step
        if (kv.page_size, kv.num_heads) != (step.page_size, step.num_kv_heads):
            raise ValueError(
                f"paged_kv_cache: page_size/num_kv_heads are {kv.page_size}/{kv.num_heads}, "
                f"plan() used {step.page_size}/{step.num_kv_heads}"
            )
        step.page_table.check_cache(kv.k.shape[0])
        return KVSource(kv.k, kv.v, kv.k_strides, kv.v_strides, kv.page_size, step.kv_indptr, step.kv_indices,
                        kv.k.shape[0])

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments, defaults included, replace the planned
        settings; then runs."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: PagedKVCache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: as ``forward``, returning ``(o, lse)``."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


def _ragged_kv(k: torch.Tensor, v: torch.Tensor, layout: TensorLayout, kv_indptr: torch.Tensor, name_k="k", name_v="v"):
    """Ragged K/V ``[nnz, H, D]`` (NHD) or ``[H, nnz, D]`` (HND) -> KVSource and (H, D_qk, D_vo)."""
    # run() meets new K/V tensors every layer: the common case costs one comparison chain
    if not (type(k) is torch.Tensor and type(v) is torch.Tensor and k.dim() == 3 and v.dim() == 3
            and k.dtype == v.dtype and k.dtype in KV_DTYPES):
        check_tensor(k, name_k, ndim=3, dtype=KV_DTYPES)
        check_tensor(v, name_v, ndim=3, dtype=KV_DTYPES)
        if k.dtype != v.dtype:
            raise ValueError(f"{name_k} and {name_v} must share a dtype, got {k.dtype} and {v.dtype}")
    tok, head = (0, 1) if layout == TensorLayout.NHD else (1, 0)
    ks, vs, kshape, vshape = k.stride(), v.stride(), k.shape, v.shape
    if kshape[tok] != vshape[tok] or kshape[head] != vshape[head]:
        raise ValueError(f"{name_v}: shape {tuple(vshape)} does not match {name_k}'s {tuple(kshape)}")
    if ks[2] != 1 or vs[2] != 1:
        name = name_k if ks[2] != 1 else name_v
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous")
    source = KVSource(k, v, (ks[tok], 0, ks[head]), (vs[tok], 0, vs[head]), 0, kv_indptr)
    return source, kshape[head], kshape[2], vshape[2], kshape[tok]


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill attention of ragged queries over ragged (contiguous per request) K/V.

    Same plan/run contract as ``BatchPrefillWithPagedKVCacheWrapper``; K/V are
    ``[kv_indptr[-1], num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_indptr[-1], head_dim]`` (HND).

    Parameters
    ----------
    float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf, mask_indptr_buf,
    backend, jit_args, jit_kwargs
        As for the paged wrapper.
    kv_indptr_buf : torch.Tensor
        int32 ``[batch+1]`` fixed buffer for ``kv_indptr`` (cuda graph mode).
    """

    _paged = False

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Optional[List[Any]] = None,
        jit_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, custom_mask_buf,
                          mask_indptr_buf, backend, jit_args, jit_kwargs)
        if use_cuda_graph:
            if not torch.is_tensor(kv_indptr_buf):
                raise ValueError("kv_indptr_buf should be a torch.Tensor in cuda graph mode")
            check_tensor(kv_indptr_buf, "kv_indptr_buf", ndim=1, dtype=torch.int32, device=self.device)
            if len(kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("kv_indptr_buf: size must match qo_indptr_buf's")
        self._kv_indptr_buf = kv_indptr_buf

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        prefix_len_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan ragged prefill for one step. Arguments as the paged wrapper's ``plan``, with
        ``kv_indptr`` (int32 ``[batch+1]``) giving each request's K/V rows. (Note FlashInfer's
        order here: ``window_left, logits_soft_cap, sm_scale``.)

        Multi-item scoring (``prefix_len_ptr``, ``token_pos_in_items_ptr``, ``token_pos_in_items_len``,
        ``max_item_len_ptr``) applies here as in the paged wrapper. FlashInfer 0.5.3's ragged wrapper
        takes the same arguments, but its ``run()`` never selects the multi-item mask mode, so there
        they have no effect."""
        _device.check_launchable(self.device, "plan()")
        self._faults.raise_pending()
        _reject_unsupported(use_fp16_qk_reduction)
        multi_item = _multi_item_args(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        qo_indptr_host = host_index(qo_indptr, "qo_indptr")
        kv_indptr_host = host_index(kv_indptr, "kv_indptr")
        check_indptr_host(kv_indptr_host, "kv_indptr")
        kv = kv_indptr_host.numpy().astype(np.int64)
        fields, views = self._plan_common(
            qo_indptr_host=qo_indptr_host, kv_lens=kv[1:] - kv[:-1], kv_extra=[kv],
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
            page_size=0, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, non_blocking=non_blocking, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv, multi_item=multi_item,
        )
        kv_indptr_d = views[0]
        if self._use_cuda_graph:
            copy_into(self._kv_indptr_buf, kv_indptr_d, non_blocking)
            kv_indptr_d = self._kv_indptr_buf
        self._step = PlannedStep(**fields, total_kv=int(kv[-1]), kv_indptr=kv_indptr_d)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Prefill attention for the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim_qk]``.
        k, v : torch.Tensor
            ``[kv_indptr[-1], num_kv_heads, head_dim_qk / head_dim_vo]`` (NHD) or
            ``[num_kv_heads, kv_indptr[-1], head_dim]`` (HND), in ``kv_data_type``.
        out, lse, return_lse, enable_pdl
            As for the paged wrapper.
        """
        if self._jit_variant is not None:
            return _variants.run_sink_variant(self, q, (k, v), args, out=out, lse=lse, return_lse=return_lse)
        if args:
            raise TypeError("run(): options after v must be passed by keyword")
        if _ops.compiling():
            return _ops.traced_run(self, q, (k, v), out, lse, return_lse, zero_out=self._use_cuda_graph)
        return self._run(q, k, v, out, lse, return_lse)

    def _run(self, q, k, v, out, lse, return_lse, **scores):
        """``run()``'s work (``_ops.wrapper_run`` calls this, never the ``run`` attribute, which a caller
        may have wrapped in ``torch.compile``)."""
        inputs, options = None, NO_SCALES
        if scores:
            options = (scores.get("q_scale"), scores.get("k_scale"), scores.get("v_scale"))
        if not scores or (scores.get("sinks") is None and scalar_options(*options)):
            inputs = (q, k, v)
            done = replayed(self, inputs, options, out, lse, return_lse)
            if done is not None:
                return done
        step = self._step
        if step is None:
            raise ValueError("run() was called before plan()")
        source, heads, dqk, dvo, nnz = _ragged_kv(k, v, self._kv_layout, step.kv_indptr)
        if heads != step.num_kv_heads or (nnz < step.total_kv if self._use_cuda_graph else nnz != step.total_kv):
            raise ValueError(f"k: expected {step.total_kv} rows (kv_indptr[-1]) of {step.num_kv_heads} heads, got {tuple(k.shape)}")
        return self._run_common(q, source, k.dtype, dqk, dvo, out, lse, return_lse, route_kv=(k, v), inputs=inputs,
                                options=options, **scores)

    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        """Deprecated (0.5.3 semantics): these arguments replace the planned settings; then runs."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, k, v)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Deprecated: as ``forward``, returning ``(o, lse)``."""
        self._override(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                       rope_scale, rope_theta)
        return self.run(q, k, v, return_lse=True)


# the last single_prefill_with_kv_cache call's replay (as decode.py's single_decode_with_kv_cache keeps)
_SINGLE_REPLAY: list = [None]
_SINGLE_PREFILL = "single_prefill_with_kv_cache"


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: Optional[torch.Tensor] = None,
    scale_k: Optional[torch.Tensor] = None,
    scale_v: Optional[torch.Tensor] = None,
    o_dtype: Optional[torch.dtype] = None,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    backend: str = "auto",
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Prefill attention of one request's queries over its contiguous K/V.

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim_qk]``, fp16 or bf16; or e4m3/e5m2 (fp8 K/V and ``o_dtype``
        required, no RoPE; the fp8 values go through fp16 dot operands, exact).
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim_qk / head_dim_vo]`` (NHD) or ``[num_kv_heads, kv_len, ...]``
        (HND); fp16, bf16, e4m3 or e5m2.
    scale_q, scale_k, scale_v : Optional[torch.Tensor]
        float32 per-head scales ``[num_qo_heads]``, ``[num_kv_heads]``, ``[num_kv_heads]``: logits
        are multiplied by ``scale_q[h] * scale_k[kv_head(h)]`` and the output by ``scale_v``.
        (FlashInfer reads them only for fp8 queries; tritoninfer applies them whenever given.)
    o_dtype : Optional[torch.dtype]
        Output dtype (fp16, bf16 or fp32); defaults to q's.
    custom_mask, packed_custom_mask : Optional[torch.Tensor]
        bool ``[qo_len, kv_len]`` (True keeps; any shape of ``qo_len * kv_len`` entries, read row-major, as
        FlashInfer flattens it), or its little-endian bit packing (uint8).
        Overrides ``causal``.
    causal : bool
        Bottom-right aligned. Rows that see no key (``qo_len > kv_len``) give 0 / LSE -inf
        (FlashInfer raises there).
    kv_layout, pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta
        As for the batch wrappers.
    use_fp16_qk_reduction : bool
        Only False (``NotImplementedError`` otherwise).
    backend : str
        FlashInfer backend names all select tritoninfer's kernels.
    return_lse : bool
        Also return the float32 base-2 LSE ``[qo_len, num_qo_heads]``.
    """
    if _ops.compiling():
        out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype if o_dtype is None else o_dtype,
                          device=q.device)
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device) if return_lse else None
        _single_prefill_op(q, k, v, out, lse, scale_q, scale_k, scale_v, custom_mask, packed_custom_mask, causal,
                           kv_layout, str(pos_encoding_mode), use_fp16_qk_reduction, sm_scale, window_left,
                           logits_soft_cap, rope_scale, rope_theta, backend)
        return (out, lse) if return_lse else out
    # a model's layers call this with tensors that differ only in their addresses: the last call's launch
    # if this one matches it (_replay.py), never while a CUDA graph is captured (plan_single's rule)
    options = (o_dtype, causal, kv_layout, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
               logits_soft_cap, rope_scale, rope_theta, backend, prefill_switches())
    replayable = (scale_q is None and scale_k is None and scale_v is None and custom_mask is None
                  and packed_custom_mask is None and not capturing(q)
                  and scalar_options(sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta))
    if replayable and _SINGLE_REPLAY[0] is not None:
        done = _SINGLE_REPLAY[0].run(_SINGLE_PREFILL, (q, k, v), options, None, None, return_lse)
        if done is not None:
            return done if return_lse else done[0]
    _check_backend(backend)
    _reject_unsupported(use_fp16_qk_reduction)
    check_tensor(q, "q", ndim=3, dtype=KV_DTYPES)  # fp16/bf16, or fp8 (FlashInfer's fa3 fp8 path)
    layout = parse_layout(kv_layout)
    device = q.device
    qo_len, num_qo_heads = q.shape[0], q.shape[1]
    source, num_kv_heads, head_dim_qk, head_dim_vo, kv_len = _ragged_kv(k, v, layout, None)
    group = check_heads(num_qo_heads, num_kv_heads)
    check_head_dim(head_dim_qk, "head_dim_qk")
    check_head_dim(head_dim_vo, "head_dim_vo")
    if q.shape[2] != head_dim_qk:
        raise ValueError(f"q: head_dim {q.shape[2]} does not match k's head_dim {head_dim_qk}")
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous")
    if q.dtype not in Q_DTYPES:
        _check_fp8_query(k.dtype, o_dtype, pos_encoding_mode)
    o_dtype = q.dtype if o_dtype is None else check_dtype_in(canonicalize_dtype(o_dtype, "o_dtype"), O_DTYPES, "o_dtype")
    _device.check_launchable(device, "single_prefill_with_kv_cache")
    packed = None
    if packed_custom_mask is not None:
        _, byte_indptr = _mask_layout(np.array([qo_len]), np.array([kv_len]))
        packed = _check_packed_mask(packed_custom_mask, byte_indptr, "packed_custom_mask", "qo_len*kv_len bits").to(device)
    elif custom_mask is not None:
        # any shape of qo_len * kv_len entries, read row-major (FlashInfer flattens it too: its multi-item
        # scoring test passes the mask flat)
        check_tensor(custom_mask, "custom_mask")
        if custom_mask.numel() != qo_len * kv_len:
            raise ValueError(f"custom_mask: expected qo_len * kv_len = {qo_len} * {kv_len} entries (e.g. shape "
                             f"({qo_len}, {kv_len})), got shape {tuple(custom_mask.shape)}")
        packed = _pack_mask(custom_mask.reshape(-1), np.array([0, qo_len * kv_len], np.int64)).to(device)
    settings, params = _scores(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                               head_dim_qk, causal, packed is not None)
    tiles = prefill_tiles(group, max(head_dim_qk, head_dim_vo), qo_len * group, k.element_size())
    step = plan_single(device, settings=settings, params=params, q_dtype=q.dtype, kv_dtype=k.dtype,
                       num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
                       head_dim_vo=head_dim_vo, qo_len=qo_len, kv_len=kv_len, tiles=tiles, q_len_per_req=0,
                       packed_mask=packed, layout=(layout, prefill_switches()), route_of=lambda: PREFILL.at_plan(PlanFacts(
                           device=device, q_dtype=q.dtype, kv_dtype=k.dtype, head_dim_qk=head_dim_qk,
                           head_dim_vo=head_dim_vo, layout=layout, use_cuda_graph=False, has_mask=packed is not None,
                           params=params, qo_lens=np.array([qo_len]), kv_lens=np.array([kv_len]), page_size=0)))
    source.kv_indptr = step.kv_indptr
    head_scales = _head_scales(scale_q, scale_k, scale_v, num_qo_heads, num_kv_heads, device)
    out = torch.empty((qo_len, num_qo_heads, head_dim_vo), dtype=o_dtype, device=device)
    lse = torch.empty((qo_len, num_qo_heads), dtype=torch.float32, device=device) if return_lse else None
    call = run_step(step, q=q, kv=source, out=out, lse=lse, workspace=scratch_workspace(device), route_kv=(k, v),
                    head_scales=head_scales)
    if replayable:
        _SINGLE_REPLAY[0] = RunReplay.record(_SINGLE_PREFILL, (q, k, v), options, None, None, out, lse, return_lse,
                                             False, (call,), keep=step)
    return (out, lse) if return_lse else out


@_ops.custom_op("single_prefill", mutates_args=("out", "lse"))
def _single_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: Optional[torch.Tensor],
                       scale_q: Optional[torch.Tensor], scale_k: Optional[torch.Tensor], scale_v: Optional[torch.Tensor],
                       custom_mask: Optional[torch.Tensor], packed_custom_mask: Optional[torch.Tensor], causal: bool,
                       kv_layout: str, pos_encoding_mode: str, use_fp16_qk_reduction: bool, sm_scale: Optional[float],
                       window_left: int, logits_soft_cap: Optional[float], rope_scale: Optional[float],
                       rope_theta: Optional[float], backend: str) -> None:
    """``single_prefill_with_kv_cache`` into ``out`` (and ``lse``), for torch.compile (``_ops.py``)."""
    result = _single_prefill_eager(
        q, k, v, scale_q, scale_k, scale_v, out.dtype, custom_mask, packed_custom_mask, causal, kv_layout,
        pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
        backend, return_lse=lse is not None)
    if lse is not None:
        out.copy_(result[0])
        lse.copy_(result[1])
    else:
        out.copy_(result)


def _check_fp8_query(kv_dtype: torch.dtype, o_dtype, pos_encoding_mode) -> None:
    """fp8 queries: fp8 K/V (the dots take fp16 operands converted from both), an explicit output
    dtype (the kernel writes no fp8), and no RoPE (the rotated q would be rounded back to fp8)."""
    if kv_dtype in Q_DTYPES:
        raise ValueError(f"k: fp8 queries need fp8 K/V (as FlashInfer's fp8 path), got {kv_dtype}")
    if o_dtype is None:
        raise ValueError(f"o_dtype: required with fp8 queries, one of {O_DTYPES}")
    from ._options import PosEncodingMode, parse_pos_encoding_mode

    if parse_pos_encoding_mode(pos_encoding_mode) == PosEncodingMode.ROPE_LLAMA:
        raise NotImplementedError("pos_encoding_mode='ROPE_LLAMA' with fp8 queries")


def _head_scales(scale_q, scale_k, scale_v, num_qo_heads: int, num_kv_heads: int, device):
    """The kernel's per-head scales (ones for those not given), or None when none is given; also the
    block-sparse wrappers' ``run()``."""
    if scale_q is None and scale_k is None and scale_v is None:
        return None
    return (_head_scale(scale_q, num_qo_heads, "scale_q", device), _head_scale(scale_k, num_kv_heads, "scale_k", device),
            _head_scale(scale_v, num_kv_heads, "scale_v", device))


def _head_scale(s: Optional[torch.Tensor], n: int, name: str, device) -> torch.Tensor:
    if s is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    check_tensor(s, name, dtype=torch.float32)
    if s.numel() != n or s.device != device:
        raise ValueError(f"{name}: expected a float32 tensor of {n} per-head scales on {device}, got "
                         f"{tuple(s.shape)} on {s.device}")
    return s.reshape(-1).contiguous()


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


# the eager function itself, for its custom op: the public name may be replaced by its compiled self
_single_prefill_eager = single_prefill_with_kv_cache
