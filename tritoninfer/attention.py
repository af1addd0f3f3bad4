"""FlashInfer 0.5.3's ``flashinfer.attention``: ``BatchAttention`` (plan-once attention over a mixed
batch of prefill and decode requests) and ``BatchAttentionWithAttentionSinkWrapper`` (the paged
prefill wrapper with attention sinks).

In FlashInfer, ``BatchAttention`` is a persistent kernel with its own scheduler; here it is the
attention core's work list over the whole mixed batch (every request's query tiles and KV splits,
heaviest first, one launch), planned by the paged prefill wrapper it holds. The sink wrapper is the
paged prefill wrapper running FlashInfer's AttentionSink variant as the core's sinks path
(``_variants.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from ._options import (PosEncodingMode, canonicalize_dtype, check_positive_int, host_index, parse_layout,
                       parse_pos_encoding_mode)
from ._variants import SinkVariant
from .prefill import BatchPrefillWithPagedKVCacheWrapper, _reject_unsupported

__all__ = ["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"]

# FlashInfer's BatchAttention allocates this much float workspace for its partial states
WORKSPACE_BYTES = 384 * 1024 * 1024


class BatchAttention:
    """Attention of a mixed batch (prefill, chunked prefill, decode, speculative rows) over a paged
    KV cache, planned once per step and run for every layer.

    Example
    -------
    >>> attn = tritoninfer.BatchAttention(kv_layout="NHD")
    >>> attn.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, 32, 8, 128, 128, 16, causal=True,
    ...           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    >>> o, lse = attn.run(q, kv_cache)  # q [qo_indptr[-1], 32, 128] -> o [qo_indptr[-1], 32, 128]

    Parameters
    ----------
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    device : str
        Where the workspace (384 MiB, as FlashInfer's) and the plans live.
    """

    def __init__(self, kv_layout: str = "NHD", device: str = "cuda") -> None:
        parse_layout(kv_layout)
        self._kv_layout = kv_layout
        self.float_workspace_buffer = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device(device))
        self._wrapper = BatchPrefillWithPagedKVCacheWrapper(self.float_workspace_buffer, kv_layout)
        self._logits_soft_cap = 0.0
        self._planned = False

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int,
        page_size: int,
        causal: bool = False,
        sm_scale: float = None,
        logits_soft_cap: Optional[float] = None,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_data_type: torch.dtype = torch.bfloat16,
        use_profiler: bool = False,
    ) -> None:
        """Plan one step.

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch+1]``: request i's query rows are ``q[qo_indptr[i]:qo_indptr[i+1]]``.
        kv_indptr, kv_indices : torch.Tensor
            int32 page table: ``[batch+1]`` page offsets and ``[kv_indptr[-1]]`` page ids.
        kv_len_arr : torch.Tensor
            int32 ``[batch]`` KV lengths; request i has ``ceil(kv_len_arr[i] / page_size)`` pages.
        num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size : int
        causal : bool
            Bottom-right aligned causal mask.
        sm_scale : Optional[float]
            Defaults to ``1/sqrt(head_dim_qk)``.
        logits_soft_cap : Optional[float]
            ``cap * tanh(logits / cap)``; None or 0 disables it.
        q_data_type, kv_data_type : torch.dtype
        use_profiler : bool
            FlashInfer's in-kernel profiler: ``True`` raises ``NotImplementedError``.
        """
        if use_profiler:
            raise NotImplementedError("use_profiler=True: FlashInfer's in-kernel profiler has no tritoninfer equivalent")
        kv_lens = host_index(kv_len_arr, "kv_len_arr").numpy().astype(np.int64)
        pages = np.diff(host_index(kv_indptr, "kv_indptr").numpy().astype(np.int64))
        check_positive_int(page_size, "page_size")
        if kv_lens.size != pages.size or (kv_lens < 0).any() or ((kv_lens + page_size - 1) // page_size != pages).any():
            raise ValueError(f"kv_len_arr: expected {pages.size} KV lengths with ceil(kv_len / page_size) equal to "
                             "each request's pages in kv_indptr")
        last_page_len = torch.from_numpy(np.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 0).astype(np.int32))
        self._wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
            head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type, kv_data_type=kv_data_type)
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        self._planned = True

    def run(
        self,
        q: torch.Tensor,
        kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
        logits_soft_cap: float = 0.0,
        profiler_buffer: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned batch.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim_qk]`` (a strided view is fine).
        kv_cache
            Any of FlashInfer's paged cache forms in the planned ``kv_data_type``.
        out, lse : Optional[torch.Tensor]
            ``[qo_indptr[-1], num_qo_heads, head_dim_vo]`` in q's dtype and float32
            ``[qo_indptr[-1], num_qo_heads]``; allocated when None.
        k_scale, v_scale
            fp8 scales (Python floats): ``k_scale`` multiplies the softmax scale, ``v_scale`` the output.
        logits_soft_cap : float
            0 (the default) runs the planned cap; a positive value must equal it (FlashInfer passes
            this value to a kernel compiled for the planned one, and raises when none was planned).
        profiler_buffer : Optional[torch.Tensor]
            Only None (``NotImplementedError`` otherwise).

        Returns
        -------
        ``(out, lse)``: the output and its float32 base-2 LSE (rows that see no key: 0 / -inf).
        """
        if not self._planned:
            raise ValueError("run() was called before plan()")
        if profiler_buffer is not None:
            raise NotImplementedError("profiler_buffer: FlashInfer's in-kernel profiler has no tritoninfer equivalent")
        if logits_soft_cap > 0.0 and self._logits_soft_cap <= 0.0:
            raise ValueError("logits_soft_cap used in kernel run but not provided in plan()")
        if logits_soft_cap > 0.0 and logits_soft_cap != self._logits_soft_cap:
            raise ValueError(f"logits_soft_cap: run() got {logits_soft_cap}, plan() used {self._logits_soft_cap}")
        return self._wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True)


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """The paged prefill/decode wrapper with attention sinks (gpt-oss), as FlashInfer builds it: a
    ``BatchPrefillWithPagedKVCacheWrapper`` running FlashInfer's AttentionSink variant.

    ``plan()`` is the paged prefill wrapper's (its ``window_left`` must agree with the constructor's);
    ``run(q, paged_kv_cache, sink, sm_scale)`` takes the variant's arguments: ``sink`` float32
    ``[num_qo_heads]`` logits added to each head's softmax denominator, and ``sm_scale`` (a Python
    float), which replaces the planned softmax scale. With ``return_lse=True`` the LSE includes the
    sink, as the variant computes it.

    Example
    -------
    >>> ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> w = tritoninfer.BatchAttentionWithAttentionSinkWrapper(ws, "NHD", q_data_type=torch.bfloat16,
    ...     kv_data_type=torch.bfloat16, head_dim_qk=64, head_dim_vo=64, window_left=127)
    >>> w.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, 64, 8, 64, 16, causal=True,
    ...        window_left=127, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    >>> o = w.run(q, kv_cache, sinks, 0.125)

    Parameters
    ----------
    float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf,
    paged_kv_indices_buf, paged_kv_last_page_len_buf, custom_mask_buf, mask_indptr_buf
        As for ``BatchPrefillWithPagedKVCacheWrapper`` (the variant takes no custom mask).
    backend : str
        ``"auto"``, ``"fa2"`` or ``"fa3"``.
    pos_encoding_mode : str
        ``"NONE"`` or ``"ROPE_LLAMA"``; ``plan()`` must use the same.
    use_fp16_qk_reduction : bool
        Only False (``NotImplementedError``).
    q_data_type, kv_data_type, head_dim_qk, head_dim_vo, window_left
        What the variant is built for; ``plan()`` must agree (checked at ``run()``).
    """

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
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_data_type: torch.dtype = torch.bfloat16,
        head_dim_qk: int = 128,
        head_dim_vo: int = 128,
        window_left: int = -1,
    ) -> None:
        if backend not in ("fa2", "fa3", "auto"):
            raise ValueError(f"backend: expected 'fa2', 'fa3' or 'auto', got {backend!r}")
        _reject_unsupported(use_fp16_qk_reduction)
        mode = parse_pos_encoding_mode(pos_encoding_mode)
        if mode == PosEncodingMode.ALIBI:
            raise NotImplementedError("pos_encoding_mode='ALIBI': the AttentionSink variant applies no ALiBi")
        super().__init__(
            float_workspace_buffer, kv_layout=kv_layout, use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo_indptr_buf,
            paged_kv_indptr_buf=paged_kv_indptr_buf, paged_kv_indices_buf=paged_kv_indices_buf,
            paged_kv_last_page_len_buf=paged_kv_last_page_len_buf, custom_mask_buf=custom_mask_buf,
            mask_indptr_buf=mask_indptr_buf, backend=backend)
        # the variant FlashInfer builds from these arguments (its jit_args), run as the sinks path
        q_dtype = canonicalize_dtype(q_data_type, "q_data_type")
        self._jit_variant = SinkVariant(
            dtype_q=q_dtype, dtype_kv=canonicalize_dtype(kv_data_type, "kv_data_type"), dtype_o=q_dtype, head_dim_qk=int(head_dim_qk),
            head_dim_vo=int(head_dim_vo), use_sliding_window=window_left >= 0, pos_encoding_mode=int(mode.value))
