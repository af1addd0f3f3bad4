"""``attn_implementation="tritoninfer"`` in Hugging Face transformers.

.. code-block:: python

    import tritoninfer.integrations.transformers  # registers "tritoninfer"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tritoninfer", dtype=torch.bfloat16)
    model.generate(...)          # transformers' own KV cache (DynamicCache, StaticCache, sliding layers)
    model.generate_batch(...)    # continuous batching over transformers' paged cache

Importing this module does three things, all undone by :func:`unregister`:

1. ``AttentionInterface.register("tritoninfer", attention_forward)``: the attention function.
2. ``AttentionMaskInterface.register("tritoninfer", attention_mask)``: the mask transformers builds
   for it. Without an entry there transformers builds no mask at all for a new name, and padding
   would be lost; this one hands over ``None`` (every key visible up to the query, the fast path),
   a 2-D ``[batch, kv_len]`` range of visible keys per row (left padding, static caches), or, for
   any pattern it does not recognise (packed sequences, chunked attention, image-token overlays,
   bidirectional masks), transformers' own 4-D boolean mask, which runs as a custom mask.
3. ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` keeps "tritoninfer" for models loaded
   with it (transformers 5.24 accepts only "paged|eager", "sdpa" and names containing "flash"
   there, and a "flash" name makes transformers load a flash-attn kernel); every other
   implementation goes through transformers' method unchanged. Continuous batching then calls the
   attention function as it calls flash attention's varlen path: the K/V gathered from its paged
   cache, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and no mask. (Block tables go only to flash-attn's
   ``flash_attn_with_kvcache`` in 5.24, so tritoninfer reads the gathered K/V.)

Routes (one function, :func:`_dense` / :func:`_varlen`, chooses):

- one request, every key visible, no sinks: ``single_decode_with_kv_cache`` (one query token) or
  ``single_prefill_with_kv_cache``, straight on the cache's ``[heads, kv_len, head_dim]`` (HND) rows;
- several requests, left padding, static caches, sinks: the batch decode / paged prefill wrappers
  over a page-size-1 view of the ``[batch, kv_heads, kv_len, head_dim]`` cache (each token row is a
  page, so each request's visible range is a list of page ids and nothing is copied);
- a 4-D mask: the paged prefill wrapper with a custom mask;
- continuous batching: the ragged prefill wrapper over the gathered K/V (the paged one with a
  page-size-1 view when there are sinks), the batch decode wrapper when every request has one
  query token.

A plan is made once per forward pass and layer kind (window, soft cap, scale) and reused by every
layer with the same settings. float32 models run attention on float16 copies of q, k and v
(tritoninfer's kernels take fp16/bf16 queries); the output is float32 again.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

ATTN_IMPLEMENTATION = "tritoninfer"
# The range tested (tests/test_integration_transformers.py): older versions lack pieces this module
# relies on or route continuous batching differently; newer ones may work and get a warning.
MIN_TRANSFORMERS = "5.24.0"
TESTED_BELOW = "5.25"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS",
    "TESTED_BELOW",
    "attention_forward",
    "attention_mask",
    "register",
    "unregister",
]


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "tritoninfer.integrations.transformers needs Hugging Face transformers "
            f">= {MIN_TRANSFORMERS}: pip install 'tritoninfer[transformers]'"
        ) from exc
    from packaging.version import Version

    version = Version(transformers.__version__)
    if version < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"tritoninfer.integrations.transformers needs transformers >= {MIN_TRANSFORMERS} (tested below "
            f"{TESTED_BELOW}); found {transformers.__version__}: pip install 'tritoninfer[transformers]'"
        )
    if version >= Version(TESTED_BELOW):
        warnings.warn(
            f"tritoninfer.integrations.transformers was tested with transformers >= {MIN_TRANSFORMERS}, "
            f"< {TESTED_BELOW}; found {transformers.__version__}",
            stacklevel=3,
        )
    return transformers


_import_transformers()

from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as _masking  # noqa: E402
from transformers.generation.continuous_batching import continuous_api as _cb_api  # noqa: E402

from .. import decode as _decode  # noqa: E402
from .. import prefill as _prefill  # noqa: E402

# ----------------------------------------------------------------------------------------------
# settings of one call
# ----------------------------------------------------------------------------------------------

_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class _Call:
    """What one attention call asks for, read from the module and transformers' keyword arguments."""

    __slots__ = ("batch", "heads", "kv_heads", "q_len", "kv_len", "head_dim", "head_dim_vo", "dtype",
                 "compute_dtype", "causal", "window_left", "soft_cap", "scale", "sinks", "device")

    def __init__(self, module, query, key, value, scaling, is_causal, kwargs):
        self.batch, self.heads, self.q_len, self.head_dim = query.shape
        self.kv_heads, self.kv_len = key.shape[1], key.shape[2]
        self.head_dim_vo = value.shape[-1]
        self.dtype = query.dtype
        self.compute_dtype = query.dtype if query.dtype in _KERNEL_DTYPES else torch.float16
        self.device = query.device
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        self.causal = bool(causal)
        # transformers' window w keeps keys with kv_idx > q_idx - w, i.e. the last w keys: window_left = w - 1
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
        self.window_left = int(window) - 1 if window else -1
        soft_cap = kwargs.get("softcap")
        self.soft_cap = float(soft_cap) if soft_cap else None
        self.scale = float(scaling) if scaling is not None else self.head_dim ** -0.5
        sinks = kwargs.get("s_aux")
        if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
            sinks = module.sinks
        if sinks is not None:
            sinks = sinks.detach().to(device=self.device, dtype=torch.float32).reshape(-1).contiguous()
        self.sinks = sinks

    def score_key(self) -> tuple:
        """The plan-time settings (a layer with other settings needs another plan)."""
        return (self.heads, self.kv_heads, self.head_dim, self.head_dim_vo, self.compute_dtype, self.causal,
                self.window_left, self.soft_cap, self.scale, str(self.device))

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.compute_dtype else t.to(self.compute_dtype)


# ----------------------------------------------------------------------------------------------
# planned wrappers, shared by the layers of a forward pass
# ----------------------------------------------------------------------------------------------

_WORKSPACE_BYTES = {"cuda": 128 << 20}
_WORKSPACE_BYTES_OTHER = 16 << 20  # the interpreter runs tiny shapes only
_PLANS_PER_KIND = 8  # distinct layer settings alive at once (Gemma's two window kinds, sinks, ...)


class _Pool:
    """Wrappers of one kind on one device, each holding the plan of one key, least recently used
    re-planned first. Plans are keyed on everything ``plan()`` fixes, so the layers of a forward
    pass share one plan and a new step (other lengths) re-plans."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._entries: "OrderedDict[tuple, Tuple[Any, Any]]" = OrderedDict()

    def planned(self, key: tuple, plan: Callable[[Any], Any]):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[0]
        if len(self._entries) >= _PLANS_PER_KIND:
            wrapper = self._entries.popitem(last=False)[1][0]
        else:
            wrapper = self._make()
        keepalive = plan(wrapper)  # tensors the plan points into (page ids), kept as long as the plan
        self._entries[key] = (wrapper, keepalive)
        return wrapper


_pools: Dict[tuple, _Pool] = {}
_workspaces: Dict[str, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    ws = _workspaces.get(str(device))
    if ws is None:
        nbytes = _WORKSPACE_BYTES.get(device.type, _WORKSPACE_BYTES_OTHER)
        ws = _workspaces[str(device)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return ws


def _pool(kind: str, device: torch.device) -> _Pool:
    key = (kind, str(device))
    pool = _pools.get(key)
    if pool is None:
        ws = _workspace(device)
        makers = {
            "decode-HND": lambda: _decode.BatchDecodeWithPagedKVCacheWrapper(ws, "HND", use_tensor_cores=True),
            "decode-NHD": lambda: _decode.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True),
            "paged-HND": lambda: _prefill.BatchPrefillWithPagedKVCacheWrapper(ws, "HND"),
            "paged-NHD": lambda: _prefill.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
            "ragged-NHD": lambda: _prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD"),
        }
        pool = _pools[key] = _Pool(makers[kind])
    return pool


class _HostCache:
    """Host-side facts derived from a device tensor (a mask, cu_seq_lens), computed once per tensor
    and content: the layers of a forward pass get the same tensor object, so only the first pays
    the device-to-host copy."""

    def __init__(self, size: int = 8):
        self._size = size
        self._entries: "OrderedDict[int, Tuple[torch.Tensor, int, Any, Any]]" = OrderedDict()

    def get(self, t: torch.Tensor, extra, compute: Callable[[], Any]):
        entry = self._entries.get(id(t))
        if entry is not None and entry[0] is t and entry[1] == t._version and entry[2] == extra:
            return entry[3]
        value = compute()
        self._entries[id(t)] = (t, t._version, extra, value)  # holds t, so its id is not reused meanwhile
        if len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return value


_host_facts = _HostCache()


# ----------------------------------------------------------------------------------------------
# transformers' contiguous cache: [batch, kv_heads, kv_len, head_dim]
# ----------------------------------------------------------------------------------------------


def _token_pages(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``t`` ``[B, H, S, D]`` seen as a paged HND cache with pages of one token:
    ``[num_pages, H, 1, D]``, page ``b * per_batch + s`` holding token ``s`` of row ``b``. Nothing is
    copied for the caches transformers keeps (contiguous rows)."""
    for attempt in (t, None):
        if attempt is None:
            t = t.contiguous()
        s_b, s_h, s_s, s_d = t.stride()
        if s_d != 1 or s_s <= 0 or s_b % s_s != 0:
            continue
        per_batch = s_b // s_s
        num_pages = (t.shape[0] - 1) * per_batch + t.shape[2]
        try:
            return t.as_strided((num_pages, t.shape[1], 1, t.shape[3]), (s_s, s_h, s_s, 1)), per_batch
        except RuntimeError:  # the view would leave the storage (unusual strides): use a contiguous copy
            continue
    raise AssertionError("unreachable: a contiguous tensor always has a page view")


def _kv_pages(k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Page views of K and V with one page numbering (contiguous copies if their layouts differ)."""
    k_pages, per_batch = _token_pages(k)
    v_pages, per_batch_v = _token_pages(v)
    if per_batch_v != per_batch:
        k_pages, per_batch = _token_pages(k.contiguous())
        v_pages, _ = _token_pages(v.contiguous())
    return k_pages, v_pages, per_batch


def _page_table(starts: np.ndarray, end: int, per_batch: int):
    """CSR page table (page size 1) of rows ``b``'s tokens ``starts[b]..end-1``."""
    lens = np.maximum(end - starts, 0).astype(np.int64)
    indptr = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    base = np.arange(len(lens), dtype=np.int64) * per_batch + starts - indptr[:-1]
    indices = np.arange(int(indptr[-1]), dtype=np.int64) + np.repeat(base, lens)
    last = (lens > 0).astype(np.int32)
    return (torch.from_numpy(indptr.astype(np.int32)), torch.from_numpy(indices.astype(np.int32)),
            torch.from_numpy(last))


def _key_ranges(mask: torch.Tensor, kv_len: int):
    """A 2-D mask as per-row key ranges ``(starts, end)``: row ``b`` sees keys ``starts[b]..end-1``,
    the queries being the last keys of that range. ``None`` if the mask is not of that form (holes,
    or rows whose visible keys end at different places)."""

    def compute():
        if mask.shape[-1] < kv_len:
            return None
        m = mask[:, mask.shape[-1] - kv_len:].to("cpu", torch.bool).numpy()
        counts = m.sum(1)
        seen = counts > 0
        first = m.argmax(1)
        last = kv_len - m[:, ::-1].argmax(1)
        if not ((counts == last - first) | ~seen).all():
            return None
        ends = last[seen]
        if ends.size and (ends != ends[0]).any():
            return None
        end = int(ends[0]) if ends.size else kv_len
        return np.where(seen, first, end).astype(np.int64), end

    return _host_facts.get(mask, ("ranges", kv_len), compute)


def _keep_from_2d(mask: torch.Tensor, c: _Call) -> torch.Tensor:
    """A 2-D key mask that is not a range per row, as the full ``[B, q, kv]`` boolean pattern:
    the keys it keeps, causal (queries are the last keys) and windowed like the layer."""
    m = mask[:, mask.shape[-1] - c.kv_len:].to(torch.bool)
    keep = m[:, None, :].expand(c.batch, c.q_len, c.kv_len)
    if c.causal:
        q_pos = torch.arange(c.q_len, device=mask.device)[:, None] + (c.kv_len - c.q_len)
        k_pos = torch.arange(c.kv_len, device=mask.device)[None, :]
        pattern = k_pos <= q_pos
        if c.window_left >= 0:
            pattern = pattern & (k_pos >= q_pos - c.window_left)
        keep = keep & pattern
    return keep


def _keep_from_4d(mask: torch.Tensor, c: _Call) -> torch.Tensor:
    """A 4-D mask ``[B or 1, 1, q, >= kv]`` (boolean, or additive with 0 / the dtype's minimum) as
    booleans ``[B, q, kv]``."""
    if mask.shape[1] != 1:
        raise NotImplementedError(
            f"attention_mask: per-head masks ({tuple(mask.shape)}) are not supported by tritoninfer's kernels")
    if mask.shape[-2] != c.q_len or mask.shape[-1] < c.kv_len or mask.shape[0] not in (1, c.batch):
        raise ValueError(
            f"attention_mask: expected [{c.batch} or 1, 1, {c.q_len}, >= {c.kv_len}], got {tuple(mask.shape)}")
    m = mask[:, 0, :, : c.kv_len]
    if m.dtype == torch.bool:
        keep = m
    elif m.is_floating_point():
        keep = m == 0
        masked = m <= torch.finfo(m.dtype).min / 2
        if not bool((keep | masked).all()):
            raise ValueError(
                "attention_mask: this additive 4-D mask holds values other than 0 and the dtype's minimum "
                "(a bias, e.g. ALiBi or a position bias); tritoninfer's kernels apply only keep/drop masks. "
                "Use attn_implementation='sdpa' or 'eager' for this model")
    else:
        keep = m != 0
    return keep.expand(c.batch, c.q_len, c.kv_len)


def _dense(query, key, value, mask, c: _Call) -> torch.Tensor:
    """Attention over transformers' contiguous cache. Returns ``[B, q, H, Dv]``."""
    starts: Optional[np.ndarray] = None
    end = c.kv_len
    keep = None
    if mask is not None:
        if mask.dim() == 4:
            keep = _keep_from_4d(mask, c)
        elif mask.dim() == 2:
            ranges = _key_ranges(mask, c.kv_len)
            if ranges is None:
                keep = _keep_from_2d(mask, c)
            else:
                starts, end = ranges
                if end == c.kv_len and not starts.any():
                    starts = None
        else:
            raise ValueError(f"attention_mask: expected None, a 2-D or a 4-D tensor, got {mask.dim()}-D")
    q, k, v = c.cast(query), c.cast(key), c.cast(value)
    if keep is not None:
        return _custom(q, k, v, keep, mask, c)
    if starts is None and c.batch == 1 and c.sinks is None:
        # one request seeing every key: the single-request kernels straight on its HND rows, no plan
        common = dict(window_left=c.window_left, logits_soft_cap=c.soft_cap, sm_scale=c.scale)
        if c.q_len == 1 and c.head_dim_vo == c.head_dim:
            o = _decode.single_decode_with_kv_cache(q[0, :, 0], k[0], v[0], kv_layout="HND", **common)
        else:
            o = _prefill.single_prefill_with_kv_cache(q[0].transpose(0, 1), k[0], v[0], causal=c.causal,
                                                      kv_layout="HND", **common)
        return o.view(1, c.q_len, c.heads, c.head_dim_vo)
    if starts is None:
        starts = np.zeros(c.batch, dtype=np.int64)
    k_pages, v_pages, per_batch = _kv_pages(k, v)
    table_key = (c.batch, c.q_len, end, per_batch, starts.tobytes())
    common = dict(window_left=c.window_left, logits_soft_cap=c.soft_cap, sm_scale=c.scale,
                  q_data_type=c.compute_dtype, kv_data_type=c.compute_dtype)
    if c.q_len == 1 and c.head_dim_vo == c.head_dim:
        def plan(w):
            indptr, indices, last = _page_table(starts, end, per_batch)
            indices = indices.to(c.device)
            w.plan(indptr, indices, last, c.heads, c.kv_heads, c.head_dim, 1, **common)
            return indices

        w = _pool("decode-HND", c.device).planned(("decode",) + c.score_key() + table_key, plan)
        o = w.run(q.reshape(c.batch, c.heads, c.head_dim), (k_pages, v_pages), sinks=c.sinks)
        return o.view(c.batch, 1, c.heads, c.head_dim_vo)

    def plan(w):
        indptr, indices, last = _page_table(starts, end, per_batch)
        indices = indices.to(c.device)
        qo_indptr = torch.arange(0, (c.batch + 1) * c.q_len, c.q_len, dtype=torch.int32)
        w.plan(qo_indptr, indptr, indices, last, c.heads, c.kv_heads, c.head_dim, 1, head_dim_vo=c.head_dim_vo,
               causal=c.causal, **common)
        return indices

    w = _pool("paged-HND", c.device).planned(("prefill",) + c.score_key() + table_key, plan)
    q_rows = q.transpose(1, 2).reshape(c.batch * c.q_len, c.heads, c.head_dim)
    o = w.run(q_rows, (k_pages, v_pages), sinks=c.sinks)
    return o.view(c.batch, c.q_len, c.heads, c.head_dim_vo)


def _custom(q, k, v, keep: torch.Tensor, mask: torch.Tensor, c: _Call) -> torch.Tensor:
    """Any keep/drop pattern ``keep`` ``[B, q, kv]``: the paged prefill wrapper with a custom mask
    over every key of every row (the mask carries causality and the window)."""
    k_pages, v_pages, per_batch = _kv_pages(k, v)

    def plan(w):
        indptr, indices, last = _page_table(np.zeros(c.batch, dtype=np.int64), c.kv_len, per_batch)
        indices = indices.to(c.device)
        qo_indptr = torch.arange(0, (c.batch + 1) * c.q_len, c.q_len, dtype=torch.int32)
        w.plan(qo_indptr, indptr, indices, last, c.heads, c.kv_heads, c.head_dim, 1, head_dim_vo=c.head_dim_vo,
               custom_mask=keep.reshape(-1), causal=False, sm_scale=c.scale, window_left=-1,
               logits_soft_cap=c.soft_cap, q_data_type=c.compute_dtype, kv_data_type=c.compute_dtype)
        return indices, mask  # the key below names the mask by identity: keep it alive with the plan

    key = ("custom", id(mask), mask._version, c.batch, c.q_len, c.kv_len, per_batch) + c.score_key()
    w = _pool("paged-HND", c.device).planned(key, plan)
    q_rows = q.transpose(1, 2).reshape(c.batch * c.q_len, c.heads, c.head_dim)
    o = w.run(q_rows, (k_pages, v_pages), sinks=c.sinks)
    return o.view(c.batch, c.q_len, c.heads, c.head_dim_vo)


# ----------------------------------------------------------------------------------------------
# continuous batching and packed sequences: K/V of all requests back to back, cu_seq_lens
# ----------------------------------------------------------------------------------------------


def _host_indptr(t: torch.Tensor, name: str) -> np.ndarray:
    return _host_facts.get(t, (name,), lambda: t.to("cpu", torch.int64).numpy().copy())


def _varlen(query, key, value, cu_q: torch.Tensor, cu_k: torch.Tensor, c: _Call) -> torch.Tensor:
    """Ragged attention over ``[1, H, T, D]`` tensors split by ``cu_seq_lens_q`` / ``cu_seq_lens_k``
    (transformers' continuous batching, or packed sequences). Returns ``[1, Tq, H, Dv]``."""
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q: expected the queries as one packed row [1, H, T, D], got {tuple(query.shape)}")
    qo = _host_indptr(cu_q, "cu_seq_lens_q")
    kv = _host_indptr(cu_k, "cu_seq_lens_k")
    if qo.size != kv.size:
        raise ValueError(f"cu_seq_lens_q and cu_seq_lens_k disagree on the batch ({qo.size - 1} vs {kv.size - 1})")
    rows, total_q, total_k = c.q_len, int(qo[-1]), int(kv[-1])
    if total_q > rows or total_k > c.kv_len:
        raise ValueError(f"cu_seq_lens: {total_q} query / {total_k} key tokens, but the tensors hold {rows} / {c.kv_len}")
    q = c.cast(query[0].transpose(0, 1)[:total_q])  # [Tq, H, D]
    k = c.cast(key[0].transpose(0, 1)[:total_k])  # [Tk, Hkv, D], NHD
    v = c.cast(value[0].transpose(0, 1)[:total_k])
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    qo_indptr = torch.from_numpy(qo.astype(np.int32))
    kv_indptr = torch.from_numpy(kv.astype(np.int32))
    table_key = (qo.tobytes(), kv.tobytes())
    common = dict(window_left=c.window_left, logits_soft_cap=c.soft_cap, sm_scale=c.scale,
                  q_data_type=c.compute_dtype, kv_data_type=c.compute_dtype)
    q_lens = qo[1:] - qo[:-1]
    kv_lens = kv[1:] - kv[:-1]
    if c.sinks is not None or ((q_lens == 1).all() and c.head_dim_vo == c.head_dim):
        # pages of one token: page i is key row i, each request's pages are its rows
        def page_table():
            indices = torch.arange(total_k, dtype=torch.int32, device=c.device)
            return indices, torch.from_numpy((kv_lens > 0).astype(np.int32))

        if (q_lens == 1).all() and c.head_dim_vo == c.head_dim:
            def plan(w):
                indices, last = page_table()
                w.plan(kv_indptr, indices, last, c.heads, c.kv_heads, c.head_dim, 1, **common)
                return indices

            w = _pool("decode-NHD", c.device).planned(("decode",) + c.score_key() + table_key, plan)
        else:
            def plan(w):
                indices, last = page_table()
                w.plan(qo_indptr, kv_indptr, indices, last, c.heads, c.kv_heads, c.head_dim, 1,
                       head_dim_vo=c.head_dim_vo, causal=c.causal, **common)
                return indices

            w = _pool("paged-NHD", c.device).planned(("prefill",) + c.score_key() + table_key, plan)
        o = w.run(q, (k, v), sinks=c.sinks)
    else:
        def plan(w):
            w.plan(qo_indptr, kv_indptr, c.heads, c.kv_heads, c.head_dim, head_dim_vo=c.head_dim_vo,
                   causal=c.causal, **common)

        w = _pool("ragged-NHD", c.device).planned(("ragged",) + c.score_key() + table_key, plan)
        o = w.run(q, k, v)
    if total_q < rows:  # padded query rows (static shapes) read nothing
        full = torch.zeros((rows, c.heads, c.head_dim_vo), dtype=o.dtype, device=o.device)
        full[:total_q] = o
        o = full
    return o.view(1, rows, c.heads, c.head_dim_vo)


# ----------------------------------------------------------------------------------------------
# the functions transformers calls
# ----------------------------------------------------------------------------------------------


# Host work (plans, page tables, mask checks) cannot be traced: under torch.compile (transformers
# compiles generate() with static caches on GPUs) the attention is a graph break and runs eagerly.
@torch.compiler.disable
def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` ``[B, H, q, D]``, ``key`` / ``value``
    ``[B, H_kv, kv, D]`` (as the model's cache returns them) -> ``([B, q, H, Dv], None)``.

    Reads ``scaling``, ``is_causal`` (else ``module.is_causal``), ``sliding_window`` (else
    ``module.sliding_window``), ``softcap`` (Gemma 2), ``s_aux`` (else ``module.sinks``: gpt-oss's
    attention sinks), and for continuous batching or packed sequences ``cu_seq_lens_q`` /
    ``cu_seq_lens_k``. The mask comes from :func:`attention_mask` (or is a user's 4-D boolean or
    0/-inf additive mask); a bias mask, per-head masks, dropout and ``position_bias`` raise.
    Attention weights are not returned (``None``, as with SDPA).
    """
    if dropout:
        raise ValueError(f"dropout: tritoninfer's attention is for inference and takes no dropout (got {dropout}); "
                         "call model.eval()")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias: additive position biases are not supported by tritoninfer's kernels")
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "tritoninfer's transformers attention plans on the host and cannot be captured in a CUDA graph; "
            "with generate_batch pass ContinuousBatchingConfig(use_cuda_graph=False)")
    c = _Call(module, query, key, value, scaling, is_causal, kwargs)
    if c.sinks is not None and c.sinks.numel() != c.heads:
        raise ValueError(f"sinks: expected {c.heads} values (one per query head), got {c.sinks.numel()}")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor):
        if attention_mask is not None:
            raise ValueError("attention_mask: not supported together with cu_seq_lens (the sequences are the mask)")
        out = _varlen(query, key, value, cu_q, cu_k, c)
    else:
        out = _dense(query, key, value, attention_mask, c)
    return (out if out.dtype == c.dtype else out.to(c.dtype)), None


_CAUSAL_CODE = _masking.causal_mask_function.__code__
_AND_CODE = _masking.and_masks(_masking.causal_mask_function).__code__
_WINDOW_CODE = _masking.sliding_window_overlay(1).__code__


def _is_causal_pattern(mask_function) -> bool:
    """True for transformers' causal mask function and its sliding-window causal one
    (``sliding_window_causal_mask_function(w)``, whose window the kernel applies from the layer's
    ``sliding_window``); False for anything else (it then gets the general 4-D mask)."""
    code = getattr(mask_function, "__code__", None)
    if code is _CAUSAL_CODE:
        return True
    if code is not _AND_CODE:
        return False
    parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
    return (len(parts) == 2 and getattr(parts[1], "__code__", None) is _CAUSAL_CODE
            and getattr(parts[0], "__code__", None) is _WINDOW_CODE)


@torch.compiler.disable
def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function: Callable = _masking.causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
) -> Optional[torch.Tensor]:
    """transformers' mask interface for "tritoninfer" (``AttentionMaskInterface``).

    For the causal and sliding-window causal patterns (the window itself is applied by the kernel,
    from the layer's ``sliding_window``) returns ``None`` when every key up to the last query is
    visible in every row, else a boolean ``[batch_size, kv_length]`` mask keeping, per row, one
    contiguous range of keys that ends at the last query (left padding, static caches). Any other
    pattern, or padding with holes, gets transformers' own 4-D boolean mask (``sdpa_mask``), which
    :func:`attention_forward` runs as a custom mask.
    """
    padding = _masking.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if _is_causal_pattern(mask_function) and not use_vmap:
        # local key index one past the last query (keys after it are causally hidden anyway)
        end = int(q_offset) - int(kv_offset) + q_length
        if 0 < end <= kv_length:
            if padding is None:
                if end == kv_length:
                    return None
                keep = torch.zeros((batch_size, kv_length), dtype=torch.bool, device=device)
                keep[:, :end] = True
                return keep
            head = padding[:, kv_offset: kv_offset + end].to(device=device, dtype=torch.bool)
            # one device-to-host read for both facts: the visible keys form a suffix (left padding)
            # in every row, and whether every key is visible
            suffix, full = (torch.stack([(head[:, 1:] >= head[:, :-1]).all(), head.all()]).tolist()
                            if end > 1 else (True, bool(head.all())))
            if suffix:
                if full and end == kv_length:
                    return None
                keep = torch.zeros((batch_size, kv_length), dtype=torch.bool, device=device)
                keep[:, :end] = head.expand(batch_size, -1)
                return keep
    return _masking.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
    )


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------

_registered = False


def _cb_switch(original):
    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
            return  # keep tritoninfer: it runs the varlen contract (gathered K/V, cu_seq_lens, no mask)
        return original(self, model, auto_switch_to_flash)

    switch_to_cb_friendly_attn._tritoninfer_original = original
    return switch_to_cb_friendly_attn


def register() -> None:
    """Register "tritoninfer" with transformers (done on import; idempotent)."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention_mask)
    manager = _cb_api.ContinuousBatchingManager
    if not hasattr(manager.switch_to_cb_friendly_attn, "_tritoninfer_original"):
        manager.switch_to_cb_friendly_attn = _cb_switch(manager.switch_to_cb_friendly_attn)
    _registered = True


def unregister() -> None:
    """Undo :func:`register`: remove "tritoninfer" from transformers' attention and mask
    interfaces and restore the continuous-batching manager's method. Models loaded with it must be
    switched to another implementation (``model.set_attn_implementation("sdpa")``) first."""
    global _registered
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    AttentionMaskInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
    manager = _cb_api.ContinuousBatchingManager
    original = getattr(manager.switch_to_cb_friendly_attn, "_tritoninfer_original", None)
    if original is not None:
        manager.switch_to_cb_friendly_attn = original
    _pools.clear()
    _workspaces.clear()
    _registered = False


register()
