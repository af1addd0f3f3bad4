"""Pure-PyTorch ground truth for attention: decode, prefill (paged and ragged) and state merging.

Everything here follows FlashInfer 0.5.3 (``shared/reference/flashinfer-api.md`` §2 and its appendix
of GPU-confirmed behaviour), except where FlashInfer has a defect, which is said where it happens.
Nothing here imports a kernel or a wrapper: this module is what they are judged against.

Conventions
-----------
- Inputs of any floating dtype (``float16``, ``bfloat16``, ``float32``, ``float64``,
  ``float8_e4m3fn``, ``float8_e5m2``) are upcast before any arithmetic. The computation runs in
  ``float32``, or in ``float64`` when any of q/k/v is ``float64`` (a float64 ground truth for tests);
  results come back in that dtype on the device of ``q``.
- Logits ``x = q·k``. The score, in natural-log units, is ``s = x*scale`` with
  ``scale = sm_scale * q_scale * k_scale`` (``sm_scale`` defaults to ``1/sqrt(head_dim_qk)``);
  with a soft cap ``s = cap*tanh(x*scale/cap)``; with ALiBi ``s += slope[h]*(kv_idx - i)`` where
  ``i`` is the query's row within its request (0 for decode).
- ``lse`` is base 2: ``log2(sum_j exp(s_j))``. Rows that see no key give output 0 and LSE ``-inf``
  (FlashInfer 0.5.3 returns a finite ≈ -5e4 LSE there; tritoninfer returns ``-inf``).
- Masks: causal is bottom-right aligned (query ``i`` sees keys ``j <= i + kv_len - qo_len``);
  ``window_left=w`` keeps key ``j`` iff ``j >= i + kv_len - qo_len - w``; a custom mask
  (``True`` = keep) replaces causal, the window still applies.
- GQA: query head ``h`` reads KV head ``h // (H_qo // H_kv)``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .. import _options as _opts
from .._options import PosEncodingMode, TensorLayout

__all__ = [
    "alibi_slopes",
    "apply_rotary_llama",
    "attention",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "gather_paged_kv",
    "get_kv_lens",
    "batch_decode_with_paged_kv_cache",
    "batch_prefill_with_paged_kv_cache",
    "batch_prefill_with_ragged_kv_cache",
    "multi_item_mask",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]

_LN2 = math.log(2.0)
_FLOAT_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
# Backend names FlashInfer 0.5.3 accepts somewhere; the reference ignores the choice.
_BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cudnn", "cute-dsl")

Scale = Union[None, float, torch.Tensor]
PagedKVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------


def _check_float_tensor(t, name: str, ndim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (one of {list(_FLOAT_DTYPES)}), got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t


def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _check_same_device(ref: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of q), got one on {t.device}")


def _per_head(value: Scale, name: str, num_heads: int, group: int, dtype, device) -> Optional[torch.Tensor]:
    """A scale given as a float, a 1-element tensor or a per-head tensor -> ``[num_heads*group]``.

    ``num_heads`` is the number of heads the scale is indexed by (``H_qo`` for q, ``H_kv`` for k/v);
    per-KV-head values are repeated over the GQA group so that the result is indexed by query head.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a float or a float tensor, got a bool")
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name}: expected a floating tensor, got dtype {value.dtype}")
        t = value.detach().to(device=device, dtype=dtype)
        if t.numel() == 1:
            return t.reshape(1).expand(num_heads * group)
        if t.dim() == 1 and t.numel() == num_heads:
            return t.repeat_interleave(group) if group > 1 else t
        raise ValueError(
            f"{name}: expected a float, a 1-element tensor or a [{num_heads}] per-head tensor, "
            f"got shape {tuple(value.shape)}"
        )
    if isinstance(value, (int, float)):
        f = float(value)
        if not math.isfinite(f):
            raise ValueError(f"{name}: expected a finite float, got {value!r}")
        return torch.full((num_heads * group,), f, dtype=dtype, device=device)
    raise TypeError(f"{name}: expected None, a float or a tensor, got {type(value).__name__}")


def _kv_to_nhd(t: torch.Tensor, name: str, layout: TensorLayout) -> torch.Tensor:
    """``[kv_len, H, D]`` (NHD) or ``[H, kv_len, D]`` (HND) -> an NHD view."""
    _check_float_tensor(t, name, 3)
    return t if layout is TensorLayout.NHD else t.transpose(0, 1)


def _rotate_half_llama(x: torch.Tensor, positions: torch.Tensor, rope_scale: float, rope_theta: float) -> torch.Tensor:
    """x ``[n, H, D]`` (already in the compute dtype), positions ``[n]`` -> rotated x, same dtype."""
    n, _, d = x.shape
    half = d // 2
    j = torch.arange(half, dtype=torch.float64, device=x.device)
    inv_freq = torch.pow(torch.tensor(rope_theta, dtype=torch.float64), -2.0 * j / d) / rope_scale  # [half]
    angle = positions.to(device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n, half]
    cos = torch.cos(angle).to(x.dtype)[:, None, :]  # [n, 1, half]
    sin = torch.sin(angle).to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _build_mask(qo_len: int, kv_len: int, causal: bool, custom_mask: Optional[torch.Tensor], window_left: int, device) -> torch.Tensor:
    """The keep-mask ``[qo_len, kv_len]`` (bool) shared by every head of one request."""
    i = torch.arange(qo_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    diag = i + (kv_len - qo_len)  # the key aligned with query i (bottom-right)
    if custom_mask is not None:
        mask = custom_mask.to(device=device, dtype=torch.bool)
    elif causal:
        mask = j <= diag
    else:
        mask = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if window_left >= 0:
        mask = mask & (j >= diag - window_left)
    return mask


def _check_custom_mask(custom_mask, qo_len: int, kv_len: int, name: str = "custom_mask") -> torch.Tensor:
    if not isinstance(custom_mask, torch.Tensor):
        raise TypeError(f"{name}: expected a bool torch.Tensor, got {type(custom_mask).__name__}")
    if custom_mask.dtype != torch.bool:
        raise TypeError(f"{name}: expected dtype torch.bool (True = keep), got {custom_mask.dtype}")
    if tuple(custom_mask.shape) != (qo_len, kv_len):
        raise ValueError(f"{name}: expected shape [qo_len, kv_len] = {[qo_len, kv_len]}, got {tuple(custom_mask.shape)}")
    return custom_mask


def _unpack_bits(packed: torch.Tensor, num_bits: int, name: str) -> torch.Tensor:
    """Little-endian bit-unpacking: bit ``b`` of byte ``k`` is element ``8k + b``."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a uint8 torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"{name}: expected dtype torch.uint8 (bit-packed, little-endian), got {packed.dtype}")
    flat = packed.reshape(-1)
    if flat.numel() < (num_bits + 7) // 8:
        raise ValueError(f"{name}: expected at least {(num_bits + 7) // 8} bytes for {num_bits} mask bits, got {flat.numel()}")
    shifts = torch.arange(8, device=flat.device, dtype=torch.int32)
    bits = (flat.to(torch.int32)[:, None] >> shifts[None, :]) & 1  # [bytes, 8]
    return bits.reshape(-1)[:num_bits].to(torch.bool)


def _host_ints(t, name: str) -> List[int]:
    if isinstance(t, torch.Tensor):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(t.shape)}")
        return [int(x) for x in t.detach().cpu().tolist()]
    if isinstance(t, (list, tuple)):
        return [int(x) for x in t]
    raise TypeError(f"{name}: expected a 1-D int tensor, got {type(t).__name__}")


def _check_indptr(t, name: str) -> List[int]:
    vals = _host_ints(t, name)
    _opts.check_indptr_host(torch.tensor(vals, dtype=torch.int64), name)
    return vals


# --------------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes as FlashInfer's ``get_alibi_slopes``.

    ``n2 = 2**floor(log2 n)``; slopes ``(2**(-8/n2))**[1..n2]``, then, when ``n2 < n``, the odd
    powers ``(2**(-4/n2))**[1, 3, 5, ...]`` for the remaining ``n - n2`` heads.

    Parameters
    ----------
    num_heads : int
        Number of query heads, positive.

    Returns
    -------
    torch.Tensor
        shape ``[num_heads]``, dtype ``torch.float32``, on the CPU.
    """
    n = _opts.check_positive_int(num_heads, "num_heads")
    n2 = 2 ** int(math.floor(math.log2(n)))
    base = 2.0 ** (-8.0 / n2)
    slopes = [base ** k for k in range(1, n2 + 1)]
    if n2 < n:
        extra = 2.0 ** (-4.0 / n2)
        slopes += [extra ** k for k in range(1, 1 + 2 * (n - n2), 2)]
    return torch.tensor(slopes, dtype=torch.float64).to(torch.float32)


def apply_rotary_llama(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
) -> torch.Tensor:
    """Rotate-half (NeoX, non-interleaved) RoPE over the full head dim, as ``ROPE_LLAMA`` does.

    For ``j`` in ``[0, D/2)``: ``freq_j = rope_theta**(-2j/D) / rope_scale``,
    ``angle = pos*freq_j``, ``x'[j] = x[j]cos - x[j+D/2]sin``, ``x'[j+D/2] = x[j+D/2]cos + x[j]sin``.
    Angles are computed in float64.

    Parameters
    ----------
    x : torch.Tensor
        shape ``[n, H, D]`` (``D`` even), any floating dtype.
    positions : torch.Tensor
        shape ``[n]``, integer or floating: the position of each of the ``n`` tokens.
    rope_scale : float, optional
        Defaults to 1.
    rope_theta : float, optional
        Defaults to 1e4.

    Returns
    -------
    torch.Tensor
        shape ``[n, H, D]``, dtype ``torch.float32`` (``float64`` for float64 ``x``).
    """
    _check_float_tensor(x, "x", 3)
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"x: rotary embedding needs an even head_dim, got {x.shape[-1]}")
    if not isinstance(positions, torch.Tensor):
        positions = torch.as_tensor(positions)
    if positions.dim() != 1 or positions.numel() != x.shape[0]:
        raise ValueError(f"positions: expected shape [{x.shape[0]}], got {tuple(positions.shape)}")
    scale, theta = _opts.resolve_rope(rope_scale, rope_theta)
    return _rotate_half_llama(x.to(_compute_dtype(x)), positions, scale, theta)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    custom_mask: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: Union[str, int, PosEncodingMode] = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    q_scale: Scale = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request: the core that every other function here calls.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[qo_len, H_qo, D_qk]``, any floating dtype (fp8 included).
    k : torch.Tensor
        shape ``[kv_len, H_kv, D_qk]`` (NHD); ``kv_len`` may be 0.
    v : torch.Tensor
        shape ``[kv_len, H_kv, D_vo]``.
    causal : bool
        Bottom-right aligned causal mask: query ``i`` sees keys ``j <= i + kv_len - qo_len``. A query
        with no visible key gives output 0 and LSE ``-inf``.
    custom_mask : torch.Tensor, optional
        shape ``[qo_len, kv_len]``, dtype ``torch.bool``, ``True`` = keep. Replaces ``causal``.
    sm_scale : float, optional
        Defaults to ``1/sqrt(D_qk)``.
    window_left : int
        ``-1`` for none; ``w >= 0`` keeps key ``j`` iff ``j >= i + kv_len - qo_len - w``. Without
        ``causal`` it limits the left side only (keys to the right stay visible), as FlashInfer.
    logits_soft_cap : float, optional
        ``None`` or 0 for none; ``cap > 0`` gives ``s = cap*tanh(x*scale/cap)``.
    pos_encoding_mode : str
        ``"NONE"``, ``"ROPE_LLAMA"`` (q at position ``kv_len - qo_len + i``, key ``j`` at ``j``,
        both rotated before the dot product) or ``"ALIBI"`` (``s += slope[h]*(j - i)``).
        With ALiBi and a soft cap, the cap applies to ``x*scale`` and the bias is added after it
        (FlashInfer's own combination applies ``sm_scale`` twice, a defect not reproduced).
    rope_scale, rope_theta : float, optional
        RoPE parameters, defaults 1 and 1e4.
    q_scale, k_scale : float or torch.Tensor, optional
        fp8 dequantisation scales folded into the logit scale: ``scale = sm_scale*q_scale*k_scale``.
        A float, a 1-element tensor, or a per-head float tensor (``[H_qo]`` for q, ``[H_kv]`` for k).
    v_scale : float or torch.Tensor, optional
        Multiplies the output; a float or a ``[H_kv]`` per-head tensor.
    sinks : torch.Tensor, optional
        shape ``[H_qo]``, float: a virtual logit per head, in the units of ``s``, added to the
        softmax denominator only: ``o = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h))``. The
        returned LSE excludes the sink (FlashInfer applies sinks as an output transform).

    Returns
    -------
    o : torch.Tensor
        shape ``[qo_len, H_qo, D_vo]``, dtype ``torch.float32`` (``float64`` for float64 inputs).
    lse : torch.Tensor
        shape ``[qo_len, H_qo]``, same dtype: base-2 log-sum-exp of the kept scores, ``-inf`` for a
        row that sees no key.
    """
    _check_float_tensor(q, "q", 3)
    _check_float_tensor(k, "k", 3)
    _check_float_tensor(v, "v", 3)
    _check_same_device(q, k, "k")
    _check_same_device(q, v, "v")
    qo_len, num_qo_heads, head_dim_qk = q.shape
    kv_len, num_kv_heads, _ = k.shape
    if k.shape[2] != head_dim_qk:
        raise ValueError(f"k: head_dim {k.shape[2]} does not match q's head_dim {head_dim_qk}")
    if v.shape[0] != kv_len or v.shape[1] != num_kv_heads:
        raise ValueError(f"v: expected shape [{kv_len}, {num_kv_heads}, D_vo] to match k, got {tuple(v.shape)}")
    group = _opts.check_heads(num_qo_heads, num_kv_heads)
    causal = _check_bool(causal, "causal")
    mode = _opts.parse_pos_encoding_mode(pos_encoding_mode)
    window_left = _opts.check_window_left(window_left)
    cap = _opts.check_soft_cap(logits_soft_cap)
    scale = _opts.resolve_sm_scale(sm_scale, head_dim_qk)
    rope_scale_f, rope_theta_f = _opts.resolve_rope(rope_scale, rope_theta)
    if custom_mask is not None:
        _check_custom_mask(custom_mask, qo_len, kv_len)
    if mode is PosEncodingMode.ROPE_LLAMA and head_dim_qk % 2 != 0:
        raise ValueError(f"pos_encoding_mode: ROPE_LLAMA needs an even head_dim_qk, got {head_dim_qk}")

    device = q.device
    cdtype = _compute_dtype(q, k, v)
    head_scale = torch.full((num_qo_heads,), scale, dtype=cdtype, device=device)  # [H_qo]
    q_vec = _per_head(q_scale, "q_scale", num_qo_heads, 1, cdtype, device)
    k_vec = _per_head(k_scale, "k_scale", num_kv_heads, group, cdtype, device)
    v_vec = _per_head(v_scale, "v_scale", num_kv_heads, group, cdtype, device)
    if q_vec is not None:
        head_scale = head_scale * q_vec
    if k_vec is not None:
        head_scale = head_scale * k_vec
    sink_vec = None
    if sinks is not None:
        _check_float_tensor(sinks, "sinks")
        if sinks.dim() != 1 or sinks.numel() != num_qo_heads:
            raise ValueError(f"sinks: expected shape [num_qo_heads] = [{num_qo_heads}], got {tuple(sinks.shape)}")
        sink_vec = sinks.detach().to(device=device, dtype=cdtype)

    qf = q.to(cdtype)  # [qo_len, H_qo, D_qk]
    kf = k.to(cdtype)  # [kv_len, H_kv, D_qk]
    vf = v.to(cdtype)  # [kv_len, H_kv, D_vo]
    if mode is PosEncodingMode.ROPE_LLAMA:
        q_pos = torch.arange(qo_len, device=device) + (kv_len - qo_len)
        k_pos = torch.arange(kv_len, device=device)
        qf = _rotate_half_llama(qf, q_pos, rope_scale_f, rope_theta_f)
        kf = _rotate_half_llama(kf, k_pos, rope_scale_f, rope_theta_f)
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)  # [kv_len, H_qo, D_qk]
        vf = vf.repeat_interleave(group, dim=1)  # [kv_len, H_qo, D_vo]

    x = torch.einsum("qhd,khd->hqk", qf, kf)  # [H_qo, qo_len, kv_len]
    s = x * head_scale[:, None, None]
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if mode is PosEncodingMode.ALIBI:
        slopes = alibi_slopes(num_qo_heads).to(device=device, dtype=cdtype)  # [H_qo]
        rel = (torch.arange(kv_len, device=device)[None, :] - torch.arange(qo_len, device=device)[:, None]).to(cdtype)
        s = s + slopes[:, None, None] * rel[None, :, :]
    keep = _build_mask(qo_len, kv_len, causal, custom_mask, window_left, device)  # [qo_len, kv_len]
    s = s.masked_fill(~keep[None, :, :], float("-inf"))

    lse = torch.logsumexp(s, dim=-1)  # [H_qo, qo_len], natural log, -inf for rows without keys
    has_key = lse > float("-inf")
    p = torch.exp(s - torch.where(has_key, lse, torch.zeros_like(lse))[..., None])  # 0 on empty rows
    o = torch.einsum("hqk,khd->qhd", p, vf)  # [qo_len, H_qo, D_vo]
    if sink_vec is not None:
        # sum_j e^{s_j} / (sum_j e^{s_j} + e^{sink}) = sigmoid(lse - sink); 0 when lse = -inf.
        o = o * torch.sigmoid(lse - sink_vec[:, None]).transpose(0, 1)[..., None]
    if v_vec is not None:
        o = o * v_vec[None, :, None]
    return o.contiguous(), (lse / _LN2).transpose(0, 1).contiguous()


# --------------------------------------------------------------------------------------------------
# single-request entry points
# --------------------------------------------------------------------------------------------------


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    return_lse: bool = False,
    *,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference of ``flashinfer.decode.single_decode_with_kv_cache`` (same signature, plus ``sinks``).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[H_qo, D]``.
    k : torch.Tensor
        shape ``[kv_len, H_kv, D]`` (NHD) or ``[H_kv, kv_len, D]`` (HND), any floating dtype.
    v : torch.Tensor
        shape ``[kv_len, H_kv, D_vo]`` (NHD) or ``[H_kv, kv_len, D_vo]`` (HND).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    use_tensor_cores : bool
        Validated, no effect (both FlashInfer paths have the same semantics).
    Other parameters
        As :func:`attention`; the query is at row 0 (ALiBi bias ``slope*kv_idx``), RoPE position
        ``kv_len - 1``, and ``window_left=w`` keeps the last ``w+1`` keys.

    Returns
    -------
    o : torch.Tensor
        shape ``[H_qo, D_vo]``, float32.
    lse : torch.Tensor
        shape ``[H_qo]``, float32, base 2; only when ``return_lse``.
    """
    _check_float_tensor(q, "q", 2)
    layout = _opts.parse_layout(kv_layout)
    _check_bool(use_tensor_cores, "use_tensor_cores")
    _check_bool(return_lse, "return_lse")
    o, lse = attention(
        q.unsqueeze(0),
        _kv_to_nhd(k, "k", layout),
        _kv_to_nhd(v, "v", layout),
        causal=False,
        sm_scale=sm_scale,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
    return (o[0], lse[0]) if return_lse else o[0]


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
    *,
    sinks: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Reference of ``flashinfer.prefill.single_prefill_with_kv_cache`` (same signature, plus ``sinks``).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[qo_len, H_qo, D_qk]``.
    k : torch.Tensor
        shape ``[kv_len, H_kv, D_qk]`` (NHD) or ``[H_kv, kv_len, D_qk]`` (HND).
    v : torch.Tensor
        shape ``[kv_len, H_kv, D_vo]`` (NHD) or ``[H_kv, kv_len, D_vo]`` (HND).
    scale_q, scale_k, scale_v : torch.Tensor, optional
        Per-head float32 scales, shapes ``[H_qo]``, ``[H_kv]``, ``[H_kv]`` (0.5.3's fp8 path): the
        logits of head ``h`` are scaled by ``scale_q[h]*scale_k[h // group]`` and its output by
        ``scale_v[h // group]``. Applied whenever given (FlashInfer reads them only for fp8 q).
    o_dtype : torch.dtype or str, optional
        Validated only: the reference returns float32.
    custom_mask : torch.Tensor, optional
        shape ``[qo_len, kv_len]``, bool, ``True`` = keep; replaces ``causal``.
    packed_custom_mask : torch.Tensor, optional
        uint8, ``ceil(qo_len*kv_len/8)`` bytes: the row-major mask bit-packed little-endian (bit ``b``
        of byte ``k`` is element ``8k+b``). Takes precedence over ``custom_mask``, as in FlashInfer.
    causal : bool
        Bottom-right aligned. With ``qo_len > kv_len`` the first rows see no key and give 0 / -inf
        (FlashInfer's single-prefill kernel rejects that case).
    use_fp16_qk_reduction, backend
        Validated, no effect.
    Other parameters
        As :func:`attention`.

    Returns
    -------
    o : torch.Tensor
        shape ``[qo_len, H_qo, D_vo]``, float32.
    lse : torch.Tensor
        shape ``[qo_len, H_qo]``, float32, base 2; only when ``return_lse``.
    """
    _check_float_tensor(q, "q", 3)
    layout = _opts.parse_layout(kv_layout)
    _opts.canonicalize_dtype(o_dtype, "o_dtype")
    _check_bool(use_fp16_qk_reduction, "use_fp16_qk_reduction")
    _check_bool(return_lse, "return_lse")
    if not isinstance(backend, str) or backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {list(_BACKENDS)}, got {backend!r}")
    k = _kv_to_nhd(k, "k", layout)
    v = _kv_to_nhd(v, "v", layout)
    qo_len, kv_len = q.shape[0], k.shape[0]
    mask = None
    if packed_custom_mask is not None:
        n = qo_len * kv_len
        if isinstance(packed_custom_mask, torch.Tensor) and packed_custom_mask.numel() != (n + 7) // 8:
            raise ValueError(
                f"packed_custom_mask: expected ceil(qo_len*kv_len/8) = {(n + 7) // 8} bytes, got {packed_custom_mask.numel()}"
            )
        mask = _unpack_bits(packed_custom_mask, n, "packed_custom_mask").reshape(qo_len, kv_len)
    elif custom_mask is not None:
        mask = _check_custom_mask(custom_mask, qo_len, kv_len)
    o, lse = attention(
        q,
        k,
        v,
        causal=causal,
        custom_mask=mask,
        sm_scale=sm_scale,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=scale_q,
        k_scale=scale_k,
        v_scale=scale_v,
        sinks=sinks,
    )
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------------
# paged KV cache
# --------------------------------------------------------------------------------------------------


def _unpack_paged_kv_cache(paged_kv_cache: PagedKVCache, layout: TensorLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """Any accepted cache form -> (k_pages, v_pages), views ``[P, page_size, H_kv, D]`` (NHD order)."""
    if isinstance(paged_kv_cache, torch.Tensor):
        c = _check_float_tensor(paged_kv_cache, "paged_kv_cache")
        if c.dim() not in (4, 5) or c.shape[1] != 2:
            raise ValueError(
                "paged_kv_cache: expected a 5-D tensor [P, 2, page_size, H, D] (NHD) / [P, 2, H, page_size, D] "
                f"(HND) or a 4-D tensor [P, 2, H, D] (page_size 1), got shape {tuple(c.shape)}"
            )
        k_pages, v_pages = c[:, 0], c[:, 1]
        if c.dim() == 4:  # page_size 1: [P, H, D] -> [P, 1, H, D] whatever the layout
            return k_pages.unsqueeze(1), v_pages.unsqueeze(1)
        if layout is TensorLayout.HND:
            return k_pages.transpose(1, 2), v_pages.transpose(1, 2)
        return k_pages, v_pages
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache: expected a (k_cache, v_cache) pair, got {len(paged_kv_cache)} items")
        k_c = _check_float_tensor(paged_kv_cache[0], "paged_kv_cache[0] (k_cache)")
        v_c = _check_float_tensor(paged_kv_cache[1], "paged_kv_cache[1] (v_cache)")
        if k_c.dim() != v_c.dim() or k_c.dim() not in (3, 4):
            raise ValueError(
                "paged_kv_cache: expected k_cache and v_cache both 4-D [P, page_size, H, D] (NHD) / "
                "[P, H, page_size, D] (HND) or both 3-D [tokens, H, D] (page_size 1), got shapes "
                f"{tuple(k_c.shape)} and {tuple(v_c.shape)}"
            )
        if k_c.dim() == 3:
            k_pages, v_pages = k_c.unsqueeze(1), v_c.unsqueeze(1)
        elif layout is TensorLayout.HND:
            k_pages, v_pages = k_c.transpose(1, 2), v_c.transpose(1, 2)
        else:
            k_pages, v_pages = k_c, v_c
        if k_pages.shape[:3] != v_pages.shape[:3]:
            raise ValueError(
                f"paged_kv_cache: k_cache and v_cache disagree on pages, page size or heads: "
                f"{tuple(k_c.shape)} vs {tuple(v_c.shape)}"
            )
        return k_pages, v_pages
    raise TypeError(f"paged_kv_cache: expected a tensor or a (k_cache, v_cache) tuple, got {type(paged_kv_cache).__name__}")


def get_kv_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of each request of a paged cache.

    ``(indptr[i+1]-indptr[i]-1)*page_size + last_page_len[i]`` for a request with pages, 0 for one
    without (whatever its ``last_page_len``).

    Parameters
    ----------
    kv_indptr : torch.Tensor
        shape ``[B+1]``, int32/int64.
    kv_last_page_len : torch.Tensor
        shape ``[B]``, int32/int64.
    page_size : int

    Returns
    -------
    torch.Tensor
        shape ``[B]``, dtype ``torch.int32``, on the device of ``kv_indptr``.
    """
    _opts.check_int_index_tensor(kv_indptr, "kv_indptr")
    _opts.check_int_index_tensor(kv_last_page_len, "kv_last_page_len", length=kv_indptr.numel() - 1)
    page_size = _opts.check_positive_int(page_size, "page_size")
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    last = kv_last_page_len.to(device=kv_indptr.device, dtype=torch.int64)
    lens = torch.where(num_pages > 0, (num_pages - 1) * page_size + last, torch.zeros_like(num_pages))
    return lens.to(torch.int32)


def _page_table(kv_indptr, kv_indices, kv_last_page_len, page_size: int, num_pages: int):
    """Host lists (indptr, indices, kv_lens) with every check that needs the values."""
    indptr = _check_indptr(kv_indptr, "kv_indptr")
    batch = len(indptr) - 1
    indices = _host_ints(kv_indices, "kv_indices")
    last = _host_ints(kv_last_page_len, "kv_last_page_len")
    if len(last) != batch:
        raise ValueError(f"kv_last_page_len: expected {batch} elements (len(kv_indptr) - 1), got {len(last)}")
    if len(indices) < indptr[-1]:
        raise ValueError(f"kv_indices: expected at least kv_indptr[-1] = {indptr[-1]} elements, got {len(indices)}")
    kv_lens = []
    for i in range(batch):
        n = indptr[i + 1] - indptr[i]
        if n == 0:
            kv_lens.append(0)
            continue
        if not 1 <= last[i] <= page_size:
            raise ValueError(
                f"kv_last_page_len: request {i} has {n} page(s), so its last_page_len must be in "
                f"[1, page_size={page_size}], got {last[i]}"
            )
        for p in indices[indptr[i]:indptr[i + 1]]:
            if not 0 <= p < num_pages:
                raise ValueError(f"kv_indices: page index {p} of request {i} is out of range [0, {num_pages})")
        kv_lens.append((n - 1) * page_size + last[i])
    return indptr, indices, kv_lens


def gather_paged_kv(
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Dense per-request K and V read from a paged cache, in the cache's dtype.

    Parameters
    ----------
    paged_kv_cache : torch.Tensor or tuple
        One of: a 5-D tensor ``[P, 2, page_size, H_kv, D]`` (NHD) or ``[P, 2, H_kv, page_size, D]``
        (HND); a ``(k_cache, v_cache)`` tuple of 4-D ``[P, page_size, H_kv, D]`` (NHD) or
        ``[P, H_kv, page_size, D]`` (HND); a tuple of 3-D ``[tokens, H_kv, D]`` (page size 1, any
        layout); a single 4-D ``[P, 2, H_kv, D]`` (page size 1). Strided views are fine.
    kv_indptr : torch.Tensor
        shape ``[B+1]``, int32.
    kv_indices : torch.Tensor
        shape ``[>= kv_indptr[-1]]``, int32: page ids.
    kv_last_page_len : torch.Tensor
        shape ``[B]``, int32, in ``[1, page_size]`` for a request with pages (ignored otherwise).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.

    Returns
    -------
    list of (torch.Tensor, torch.Tensor)
        Per request ``k_i [kv_len_i, H_kv, D_qk]`` and ``v_i [kv_len_i, H_kv, D_vo]``, cache dtype,
        ``kv_len_i = (pages_i - 1)*page_size + last_page_len_i`` (0 without pages).
    """
    layout = _opts.parse_layout(kv_layout)
    k_pages, v_pages = _unpack_paged_kv_cache(paged_kv_cache, layout)  # [P, page, H, D]
    num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
    indptr, indices, kv_lens = _page_table(kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages)
    out = []
    for i, kv_len in enumerate(kv_lens):
        ids = torch.tensor(indices[indptr[i]:indptr[i + 1]], dtype=torch.long, device=k_pages.device)
        k_i = k_pages[ids].reshape(-1, *k_pages.shape[2:])[:kv_len]
        v_i = v_pages[ids].reshape(-1, *v_pages.shape[2:])[:kv_len]
        out.append((k_i, v_i))
    return out


# --------------------------------------------------------------------------------------------------
# batch entry points
# --------------------------------------------------------------------------------------------------


def _split_masks(custom_mask, packed_custom_mask, mask_indptr, qo_lens: Sequence[int], kv_lens: Sequence[int]):
    """Per-request ``[qo_len, kv_len]`` bool masks from FlashInfer's flattened forms, or ``None``."""
    sizes = [qo * kv for qo, kv in zip(qo_lens, kv_lens)]
    if packed_custom_mask is not None:
        if not isinstance(packed_custom_mask, torch.Tensor):
            raise TypeError(f"packed_custom_mask: expected a uint8 torch.Tensor, got {type(packed_custom_mask).__name__}")
        nbytes = [(n + 7) // 8 for n in sizes]
        if mask_indptr is None:
            offsets = [0]
            for b in nbytes:
                offsets.append(offsets[-1] + b)
        else:
            offsets = _check_indptr(mask_indptr, "mask_indptr")
            if len(offsets) != len(sizes) + 1:
                raise ValueError(f"mask_indptr: expected {len(sizes) + 1} elements (batch_size + 1), got {len(offsets)}")
        masks = []
        for i, (n, b) in enumerate(zip(sizes, nbytes)):
            if offsets[i + 1] - offsets[i] < b:
                raise ValueError(
                    f"mask_indptr: request {i} needs ceil(qo_len*kv_len/8) = {b} bytes, its segment has "
                    f"{offsets[i + 1] - offsets[i]}"
                )
            seg = packed_custom_mask.reshape(-1)[offsets[i]:offsets[i] + b]
            masks.append(_unpack_bits(seg, n, "packed_custom_mask").reshape(qo_lens[i], kv_lens[i]))
        return masks
    if custom_mask is not None:
        if not isinstance(custom_mask, torch.Tensor) or custom_mask.dtype != torch.bool:
            raise TypeError("custom_mask: expected a flattened torch.bool tensor (True = keep)")
        flat = custom_mask.reshape(-1)
        if flat.numel() != sum(sizes):
            raise ValueError(f"custom_mask: expected sum(qo_len*kv_len) = {sum(sizes)} elements, got {flat.numel()}")
        masks, start = [], 0
        for i, n in enumerate(sizes):
            masks.append(flat[start:start + n].reshape(qo_lens[i], kv_lens[i]))
            start += n
        return masks
    return [None] * len(sizes)


def _batch_attention(q, qo_indptr: List[int], kv_list, masks, causal: bool, opts: dict):
    """Loop :func:`attention` over requests and concatenate."""
    outs, lses = [], []
    for i, (k_i, v_i) in enumerate(kv_list):
        q_i = q[qo_indptr[i]:qo_indptr[i + 1]]
        o_i, lse_i = attention(q_i, k_i, v_i, causal=causal, custom_mask=masks[i], **opts)
        outs.append(o_i)
        lses.append(lse_i)
    if not outs:  # empty batch
        cdtype = _compute_dtype(q)
        return (
            torch.zeros(0, q.shape[1], q.shape[2], dtype=cdtype, device=q.device),
            torch.zeros(0, q.shape[1], dtype=cdtype, device=q.device),
        )
    return torch.cat(outs, 0), torch.cat(lses, 0)


def _common_opts(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_scale, k_scale, v_scale, sinks):
    return dict(
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )


def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
    *,
    q_len_per_req: int = 1,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    q_scale: Scale = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``BatchDecodeWithPagedKVCacheWrapper.run`` (plan and run options together).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[B*q_len_per_req, H_qo, D]``; request ``i`` owns rows
        ``[i*q_len_per_req, (i+1)*q_len_per_req)``.
    paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
        As :func:`gather_paged_kv`; ``B = len(kv_indptr) - 1``.
    q_len_per_req : int
        Queries per request; with more than one they are causal among themselves (bottom-right
        aligned, as prefill). An empty request gives 0 / -inf.
    Other parameters
        As :func:`attention`.

    Returns
    -------
    o : torch.Tensor
        shape ``[B*q_len_per_req, H_qo, D_vo]``, float32.
    lse : torch.Tensor
        shape ``[B*q_len_per_req, H_qo]``, float32, base 2.
    """
    _check_float_tensor(q, "q", 3)
    q_len_per_req = _opts.check_positive_int(q_len_per_req, "q_len_per_req")
    kv = gather_paged_kv(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    batch = len(kv)
    if q.shape[0] != batch * q_len_per_req:
        raise ValueError(
            f"q: expected batch_size*q_len_per_req = {batch}*{q_len_per_req} = {batch * q_len_per_req} rows, got {q.shape[0]}"
        )
    qo_indptr = [i * q_len_per_req for i in range(batch + 1)]
    opts = _common_opts(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_scale, k_scale, v_scale, sinks)
    return _batch_attention(q, qo_indptr, kv, [None] * batch, True, opts)


def batch_prefill_with_paged_kv_cache(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
    *,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    causal: bool = False,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    q_scale: Scale = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``BatchPrefillWithPagedKVCacheWrapper.run`` (plan and run options together).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[qo_indptr[-1], H_qo, D_qk]``.
    qo_indptr : torch.Tensor
        shape ``[B+1]``, int32: request ``i`` owns query rows ``[qo_indptr[i], qo_indptr[i+1])``.
    paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
        As :func:`gather_paged_kv`.
    custom_mask : torch.Tensor, optional
        bool, ``sum_i qo_len_i*kv_len_i`` elements: each request's row-major ``[qo_len, kv_len]``
        mask, concatenated (``True`` = keep). Replaces ``causal``.
    packed_custom_mask : torch.Tensor, optional
        uint8: each request's mask bit-packed little-endian and padded to whole bytes, concatenated.
        Takes precedence over ``custom_mask``.
    mask_indptr : torch.Tensor, optional
        shape ``[B+1]``: byte offset of each request's segment of ``packed_custom_mask``; defaults
        to the running sum of ``ceil(qo_len_i*kv_len_i/8)``.
    causal : bool
        Bottom-right aligned per request; rows that see no key give 0 / -inf.
    Other parameters
        As :func:`attention` (ALiBi's ``i`` and RoPE's query position are per request).

    Returns
    -------
    o : torch.Tensor
        shape ``[qo_indptr[-1], H_qo, D_vo]``, float32.
    lse : torch.Tensor
        shape ``[qo_indptr[-1], H_qo]``, float32, base 2.
    """
    _check_float_tensor(q, "q", 3)
    qo = _check_indptr(qo_indptr, "qo_indptr")
    kv = gather_paged_kv(paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout)
    if len(qo) != len(kv) + 1:
        raise ValueError(f"qo_indptr: expected {len(kv) + 1} elements to match kv_indptr, got {len(qo)}")
    if q.shape[0] != qo[-1]:
        raise ValueError(f"q: expected qo_indptr[-1] = {qo[-1]} rows, got {q.shape[0]}")
    qo_lens = [qo[i + 1] - qo[i] for i in range(len(kv))]
    masks = _split_masks(custom_mask, packed_custom_mask, mask_indptr, qo_lens, [k.shape[0] for k, _ in kv])
    opts = _common_opts(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_scale, k_scale, v_scale, sinks)
    return _batch_attention(q, qo, kv, masks, _check_bool(causal, "causal"), opts)


def batch_prefill_with_ragged_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_layout: str = "NHD",
    *,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    causal: bool = False,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    q_scale: Scale = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    sinks: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``BatchPrefillWithRaggedKVCacheWrapper.run`` (plan and run options together).

    Parameters
    ----------
    q : torch.Tensor
        shape ``[qo_indptr[-1], H_qo, D_qk]``.
    k : torch.Tensor
        shape ``[kv_indptr[-1], H_kv, D_qk]`` (NHD) or ``[H_kv, kv_indptr[-1], D_qk]`` (HND).
    v : torch.Tensor
        shape ``[kv_indptr[-1], H_kv, D_vo]`` (NHD) or ``[H_kv, kv_indptr[-1], D_vo]`` (HND).
    qo_indptr, kv_indptr : torch.Tensor
        shape ``[B+1]``, int32: request ``i`` owns ``q[qo_indptr[i]:qo_indptr[i+1]]`` and
        ``k[kv_indptr[i]:kv_indptr[i+1]]``.
    Other parameters
        As :func:`batch_prefill_with_paged_kv_cache`.

    Returns
    -------
    o : torch.Tensor
        shape ``[qo_indptr[-1], H_qo, D_vo]``, float32.
    lse : torch.Tensor
        shape ``[qo_indptr[-1], H_qo]``, float32, base 2.
    """
    _check_float_tensor(q, "q", 3)
    layout = _opts.parse_layout(kv_layout)
    k = _kv_to_nhd(k, "k", layout)
    v = _kv_to_nhd(v, "v", layout)
    qo = _check_indptr(qo_indptr, "qo_indptr")
    kvp = _check_indptr(kv_indptr, "kv_indptr")
    if len(qo) != len(kvp):
        raise ValueError(f"qo_indptr: expected {len(kvp)} elements to match kv_indptr, got {len(qo)}")
    if q.shape[0] != qo[-1]:
        raise ValueError(f"q: expected qo_indptr[-1] = {qo[-1]} rows, got {q.shape[0]}")
    if k.shape[0] != kvp[-1] or v.shape[0] != kvp[-1]:
        raise ValueError(f"k, v: expected kv_indptr[-1] = {kvp[-1]} tokens, got {k.shape[0]} and {v.shape[0]}")
    batch = len(qo) - 1
    kv = [(k[kvp[i]:kvp[i + 1]], v[kvp[i]:kvp[i + 1]]) for i in range(batch)]
    qo_lens = [qo[i + 1] - qo[i] for i in range(batch)]
    kv_lens = [kvp[i + 1] - kvp[i] for i in range(batch)]
    masks = _split_masks(custom_mask, packed_custom_mask, mask_indptr, qo_lens, kv_lens)
    opts = _common_opts(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_scale, k_scale, v_scale, sinks)
    return _batch_attention(q, qo, kv, masks, _check_bool(causal, "causal"), opts)


def multi_item_mask(
    qo_indptr: torch.Tensor,
    kv_lens: Sequence[int],
    prefix_len_ptr: torch.Tensor,
    token_pos_in_items_ptr: torch.Tensor,
    token_pos_in_items_len: int,
) -> torch.Tensor:
    """Multi-item scoring (the prefill wrappers' ``prefix_len_ptr`` & co.) as a dense custom mask, for
    the ``custom_mask`` argument of :func:`batch_prefill_with_paged_kv_cache` /
    :func:`batch_prefill_with_ragged_kv_cache` (``window_left`` still applies there).

    For request ``i`` with prefix length ``P``, query ``j`` at sequence position
    ``p = kv_len - qo_len + j`` keeps key ``k`` iff ``k <= p`` and (``p < P``, or ``k < P``, or
    ``k > p - t``) where ``t = token_pos_in_items_ptr[i * token_pos_in_items_len + p - P]`` is the
    token's position within its item (0 at a delimiter, which so sees only the prefix):
    FlashInfer 0.5.3's ``logits_mask_multi_item_scoring`` (``include/flashinfer/attention/prefill.cuh``).
    ``max_item_len_ptr`` only lets kernels skip KV tiles; it does not enter the mask.

    Returns
    -------
    torch.Tensor
        bool, ``sum_i qo_len_i * kv_len_i`` elements: each request's row-major ``[qo_len, kv_len]``
        mask, concatenated (``True`` = keep).
    """
    qo = _check_indptr(qo_indptr, "qo_indptr")
    kv_lens = [int(n) for n in kv_lens]
    if len(kv_lens) != len(qo) - 1:
        raise ValueError(f"kv_lens: expected {len(qo) - 1} lengths to match qo_indptr, got {len(kv_lens)}")
    prefix = _host_ints(prefix_len_ptr.to(torch.int64) if isinstance(prefix_len_ptr, torch.Tensor) else prefix_len_ptr,
                        "prefix_len_ptr")
    if len(prefix) != len(kv_lens):
        raise ValueError(f"prefix_len_ptr: expected {len(kv_lens)} elements, got {len(prefix)}")
    positions = token_pos_in_items_ptr.reshape(-1).to("cpu", torch.int64)
    masks = []
    for i, kv_len in enumerate(kv_lens):
        qo_len = qo[i + 1] - qo[i]
        p = torch.arange(qo_len)[:, None] + (kv_len - qo_len)
        k = torch.arange(kv_len)[None, :]
        in_item = p >= prefix[i]
        t = torch.zeros_like(p)
        if in_item.any():
            index = i * token_pos_in_items_len + p[in_item] - prefix[i]
            if int(index.max()) >= positions.numel():
                raise ValueError(f"token_pos_in_items_ptr: request {i} reads element {int(index.max())}, "
                                 f"the tensor has {positions.numel()}")
            t[in_item] = positions[index]
        keep = (k <= p) & (~in_item | (k < prefix[i]) | (k > p - t))
        masks.append(keep.reshape(-1))
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)


# --------------------------------------------------------------------------------------------------
# merging attention states
# --------------------------------------------------------------------------------------------------


def _check_state(v, s, vname: str, sname: str) -> None:
    _check_float_tensor(v, vname, 3)
    _check_float_tensor(s, sname, 2)
    if tuple(s.shape) != tuple(v.shape[:2]):
        raise ValueError(f"{sname}: expected shape {list(v.shape[:2])} to match {vname} [n, H, D], got {tuple(s.shape)}")


def _safe_max(s: torch.Tensor, dim: int) -> torch.Tensor:
    """Max over ``dim``, with 0 where every entry is -inf (so that ``s - m`` stays -inf, not NaN)."""
    m = s.amax(dim=dim, keepdim=True)
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    ``m = max(s_a, s_b)``, ``w = 2**(s - m)``, ``v = (v_a w_a + v_b w_b)/(w_a + w_b)``,
    ``s = m + log2(w_a + w_b)``. A state with ``s = -inf`` contributes nothing; two ``-inf`` states
    give ``v = 0``, ``s = -inf`` (FlashInfer 0.5.3 gives NaN there).

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        shape ``[n, H, D]``, any floating dtype.
    s_a, s_b : torch.Tensor
        shape ``[n, H]``, base-2 LSE.

    Returns
    -------
    v : torch.Tensor
        shape ``[n, H, D]``, float32 (float64 for float64 inputs).
    s : torch.Tensor
        shape ``[n, H]``, same dtype.
    """
    _check_state(v_a, s_a, "v_a", "s_a")
    _check_state(v_b, s_b, "v_b", "s_b")
    if v_a.shape != v_b.shape:
        raise ValueError(f"v_b: expected shape {tuple(v_a.shape)} to match v_a, got {tuple(v_b.shape)}")
    v, s = merge_states(torch.stack([v_a, v_b.to(v_a.device)], 1), torch.stack([s_a, s_b.to(s_a.device)], 1))
    return v, s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """What ``merge_state_in_place`` leaves in ``(v, s)``, returned as new tensors (inputs untouched).

    Parameters
    ----------
    v, v_other : torch.Tensor
        shape ``[n, H, D]``.
    s, s_other : torch.Tensor
        shape ``[n, H]``, base-2 LSE.
    mask : torch.Tensor, optional
        shape ``[n]``, bool: rows where it is ``False`` keep ``(v, s)`` unchanged.

    Returns
    -------
    v : torch.Tensor
        shape ``[n, H, D]``, float32 (float64 for float64 inputs).
    s : torch.Tensor
        shape ``[n, H]``, same dtype.
    """
    v_m, s_m = merge_state(v, s, v_other, s_other)
    if mask is None:
        return v_m, s_m
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask: expected a torch.bool tensor of shape [n]")
    if mask.dim() != 1 or mask.numel() != v.shape[0]:
        raise ValueError(f"mask: expected shape [{v.shape[0]}], got {tuple(mask.shape)}")
    mask = mask.to(v.device)
    v_keep = torch.where(mask[:, None, None], v_m, v.to(v_m.dtype))
    s_keep = torch.where(mask[:, None], s_m, s.to(s_m.dtype))
    return v_keep, s_keep


def merge_states(v: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` attention states per row (see :func:`merge_state`).

    Parameters
    ----------
    v : torch.Tensor
        shape ``[n, S, H, D]``, any floating dtype.
    s : torch.Tensor
        shape ``[n, S, H]``, base-2 LSE.

    Returns
    -------
    v : torch.Tensor
        shape ``[n, H, D]``, float32 (float64 for float64 inputs); 0 where every state is -inf.
    s : torch.Tensor
        shape ``[n, H]``, same dtype; -inf where every state is -inf (or ``S == 0``).
    """
    _check_float_tensor(v, "v", 4)
    _check_float_tensor(s, "s", 3)
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s: expected shape {list(v.shape[:3])} to match v [n, S, H, D], got {tuple(s.shape)}")
    cdtype = _compute_dtype(v, s)
    n, num_states, num_heads, head_dim = v.shape
    if num_states == 0:
        return (
            torch.zeros(n, num_heads, head_dim, dtype=cdtype, device=v.device),
            torch.full((n, num_heads), float("-inf"), dtype=cdtype, device=v.device),
        )
    vf, sf = v.to(cdtype), s.to(device=v.device, dtype=cdtype)
    m = _safe_max(sf, 1)  # [n, 1, H]
    w = torch.exp2(sf - m)  # [n, S, H]; 0 for -inf states
    denom = w.sum(1)  # [n, H]
    num = (vf * w[..., None]).sum(1)  # [n, H, D]
    nonempty = denom > 0
    safe = torch.where(nonempty, denom, torch.ones_like(denom))
    v_out = torch.where(nonempty[..., None], num / safe[..., None], torch.zeros_like(num))
    s_out = m.squeeze(1) + torch.log2(denom)  # log2(0) = -inf
    return v_out, s_out
