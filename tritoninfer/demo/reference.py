"""The dense float32 reference forward pass that ``--check`` compares every step's logits with.

Plain torch, independent of tritoninfer's kernels: its own RMSNorm, rotary embedding, SwiGLU and
softmax attention over a contiguous per-request KV store (float32). It follows the serving loop's
tokens (teacher forcing), so both see the same sequences even where greedy choices are close.

With an fp8 KV cache the reference stores K/V quantised and dequantised with the same per-tensor
scales, so the check measures the kernels, not the (expected) quantisation error of fp8 itself.
"""

from __future__ import annotations

import itertools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .model import ModelConfig, ModelWeights

__all__ = ["DenseReference", "MLADenseReference", "rope_inv_freq"]


def rope_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding (float64 then float32), with Llama 3 / linear scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None and rs["rope_type"] == "linear":
        inv = inv / float(rs["factor"])
    elif rs is not None and rs["rope_type"] == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / low, inv / factor, torch.where(wavelen < old / high, inv, scaled))
    return inv.to(device=device, dtype=torch.float32)


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DenseReference:
    """float32 forward of the same weights; one contiguous KV store per request id.

    ``kv_quant``: ``None``, or ``(dtype, k_scales, v_scales)`` (per layer) to store K/V as the fp8
    cache does (``x / scale`` rounded to ``dtype``, times ``scale``).
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device=None,
                 kv_quant: Optional[Tuple[torch.dtype, Sequence[float], Sequence[float]]] = None,
                 query_chunk: int = 1024) -> None:
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else weights.embed.device
        self.w = weights.to(torch.float32, self.device)
        self.inv_freq = rope_inv_freq(cfg, self.device)
        self.kv_quant = kv_quant
        self.query_chunk = query_chunk
        self._kv: Dict[int, torch.Tensor] = {}  # rid -> [layers, 2, capacity, Hkv, D]
        self._len: Dict[int, int] = {}

    def reset(self) -> None:
        """Forget every request and the fp8 scales (a new run on the same weights)."""
        self._kv.clear()
        self._len.clear()
        self.kv_quant = None

    def set_kv_quant(self, kv_quant) -> None:
        self.kv_quant = kv_quant

    def release(self, rid: int) -> None:
        self._kv.pop(rid, None)
        self._len.pop(rid, None)

    def reserve(self, rid: int, num_tokens: int) -> None:
        """Make request ``rid``'s KV store hold ``num_tokens`` (avoids regrowing it token by token)."""
        buf = self._kv.get(rid)
        if buf is not None and buf.shape[2] >= num_tokens:
            return
        cfg = self.cfg
        new = torch.zeros(cfg.num_layers, 2, num_tokens, cfg.num_kv_heads, cfg.head_dim, device=self.device)
        if buf is not None:
            new[:, :, : buf.shape[2]] = buf
        self._kv[rid] = new

    def _store(self, rid: int, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        buf = self._kv.get(rid)
        need = pos + n
        if buf is None or buf.shape[2] < need:
            old = 0 if buf is None else buf.shape[2]
            self.reserve(rid, max(16, need, old + old // 4))
            buf = self._kv[rid]
        if self.kv_quant is not None:
            dtype, ks, vs = self.kv_quant
            fmax = torch.finfo(dtype).max
            k = (k * (1.0 / ks[layer])).clamp(-fmax, fmax).to(dtype).float() * ks[layer]
            v = (v * (1.0 / vs[layer])).clamp(-fmax, fmax).to(dtype).float() * vs[layer]
        buf[layer, 0, pos:need] = k
        buf[layer, 1, pos:need] = v

    @torch.no_grad()
    def forward(self, segments: List[Tuple[int, List[int]]], all_rows: bool = False) -> torch.Tensor:
        """Extend each request ``rid`` by ``tokens``; float32 logits of the last new token of each
        segment ``[len(segments), vocab]`` (of every new token, in segment order, with ``all_rows``)."""
        cfg, w = self.cfg, self.w
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = hq // hkv
        ids = torch.tensor([t for _, toks in segments for t in toks], dtype=torch.long, device=self.device)
        starts = [self._len.get(rid, 0) for rid, _ in segments]
        pos = torch.cat([torch.arange(s, s + len(toks), device=self.device) for s, (_, toks) in zip(starts, segments)])
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None, :]  # [n, 1, D]
        sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None, :]
        n = ids.shape[0]
        h = w.embed[ids]
        for li, lw in enumerate(w.layers):
            x = _rmsnorm(h, lw.input_norm, cfg.rms_norm_eps)
            qkv = x @ lw.qkv.T
            if lw.qkv_bias is not None:
                qkv = qkv + lw.qkv_bias
            q = _rotate(qkv[:, : hq * d].view(n, hq, d), cos, sin)
            k = _rotate(qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d), cos, sin)
            v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
            out = torch.empty(n, hq, d, device=self.device)
            row = 0
            for (rid, toks), start in zip(segments, starts):
                m = len(toks)
                self._store(rid, li, start, k[row: row + m], v[row: row + m])
                kk = self._kv[rid][li, 0, : start + m]  # [T, Hkv, D]
                vv = self._kv[rid][li, 1, : start + m]
                for c in range(0, m, self.query_chunk):
                    qc = q[row + c: row + min(m, c + self.query_chunk)]  # [c, Hq, D]
                    nc = qc.shape[0]
                    qg = qc.view(nc, hkv, group, d)  # query head h uses KV head h // group
                    s = torch.einsum("qhgd,khd->hgqk", qg, kk) / math.sqrt(d)
                    qpos = torch.arange(start + c, start + c + nc, device=self.device)[:, None]
                    kpos = torch.arange(start + m, device=self.device)[None, :]
                    keep = kpos <= qpos
                    if cfg.sliding_window:
                        keep &= kpos > qpos - cfg.sliding_window
                    s = s.masked_fill(~keep, float("-inf"))
                    o = torch.einsum("hgqk,khd->qhgd", s.softmax(-1), vv)
                    out[row + c: row + c + nc] = o.reshape(nc, hq, d)
                row += m
            h = h + out.reshape(n, hq * d) @ lw.o.T
            x = _rmsnorm(h, lw.post_norm, cfg.rms_norm_eps)
            gu = x @ lw.gate_up.T
            gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size:]
            h = h + (torch.nn.functional.silu(gate) * up) @ lw.down.T
        for (rid, toks), start in zip(segments, starts):
            self._len[rid] = start + len(toks)
        if not all_rows:
            last = torch.tensor(list(itertools.accumulate(len(t) for _, t in segments)), device=self.device) - 1
            h = h[last]
        return _rmsnorm(h, w.final_norm, cfg.rms_norm_eps) @ w.lm_head.T


class MLADenseReference:
    """float32 forward of a :class:`~tritoninfer.demo.deepseek.DeepseekModel`'s weights, from the
    definition (not absorbed): per request a contiguous store of the latent rows (``ckv`` after
    ``kv_a_layernorm``, rotated ``k_pe``), expanded by ``kv_b_proj`` into per-head ``k_nope`` and ``v``
    at every step; scores ``q_nope·k_nope + q_pe·k_pe`` over ``sqrt(qk_nope + qk_rope)``. The served
    model multiplies by ``W_UK``/``W_UV`` instead, so this also checks the absorption. Same interface
    as :class:`DenseReference`; the MLA cache has no fp8 form, so no ``kv_quant``."""

    def __init__(self, cfg, weights, device=None, query_chunk: int = 1024) -> None:
        self.cfg = cfg
        self.device = torch.device(device) if device is not None else weights.embed.device
        self.w = weights.to(torch.float32, self.device)
        d = cfg.qk_rope_head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.inv_freq = inv.to(device=self.device, dtype=torch.float32)
        self.query_chunk = query_chunk
        self._kv: Dict[int, torch.Tensor] = {}  # rid -> [layers, capacity, kv_lora_rank + rope]
        self._len: Dict[int, int] = {}

    def reset(self) -> None:
        self._kv.clear()
        self._len.clear()

    def set_kv_quant(self, kv_quant) -> None:
        if kv_quant is not None:
            raise ValueError("kv_quant: the MLA reference has no quantised latent cache")

    def release(self, rid: int) -> None:
        self._kv.pop(rid, None)
        self._len.pop(rid, None)

    def reserve(self, rid: int, num_tokens: int) -> None:
        buf = self._kv.get(rid)
        if buf is not None and buf.shape[1] >= num_tokens:
            return
        cfg = self.cfg
        new = torch.zeros(cfg.num_layers, num_tokens, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device=self.device)
        if buf is not None:
            new[:, : buf.shape[1]] = buf
        self._kv[rid] = new

    @torch.no_grad()
    def forward(self, segments: List[Tuple[int, List[int]]], all_rows: bool = False) -> torch.Tensor:
        """As :meth:`DenseReference.forward`."""
        cfg, w = self.cfg, self.w
        hq, nope, rope, r, dv = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                                 cfg.v_head_dim)
        eps = cfg.rms_norm_eps
        ids = torch.tensor([t for _, toks in segments for t in toks], dtype=torch.long, device=self.device)
        starts = [self._len.get(rid, 0) for rid, _ in segments]
        pos = torch.cat([torch.arange(s, s + len(toks), device=self.device) for s, (_, toks) in zip(starts, segments)])
        ang = pos.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat((ang.cos(), ang.cos()), -1)  # [n, P]
        sin = torch.cat((ang.sin(), ang.sin()), -1)
        n = ids.shape[0]
        h = w.embed[ids]
        for li, lw in enumerate(w.layers):
            x = _rmsnorm(h, lw.input_norm, eps)
            q_in = x if lw.q_a is None else _rmsnorm(x @ lw.q_a.T, lw.q_a_norm, eps)
            q = (q_in @ lw.q_b.T).view(n, hq, nope + rope)
            q_nope = q[..., :nope]
            q_pe = _rotate(q[..., nope:], cos[:, None], sin[:, None])
            kv = x @ lw.kv_a.T
            latent = torch.cat((_rmsnorm(kv[:, :r], lw.kv_a_norm, eps), _rotate(kv[:, r:], cos, sin)), -1)
            out = torch.empty(n, hq, dv, device=self.device)
            row = 0
            for (rid, toks), start in zip(segments, starts):
                m = len(toks)
                self.reserve(rid, start + m)
                self._kv[rid][li, start: start + m] = latent[row: row + m]
                lat = self._kv[rid][li, : start + m]  # [T, R + P]
                kvb = (lat[:, :r] @ lw.kv_b.T).view(-1, hq, nope + dv)  # kv_b_proj: per head [k_nope; v]
                k_nope, v = kvb[..., :nope], kvb[..., nope:]
                k_pe = lat[:, r:]  # shared by every head
                for c in range(0, m, self.query_chunk):
                    sl = slice(row + c, row + min(m, c + self.query_chunk))
                    nc = sl.stop - sl.start
                    s = (torch.einsum("qhd,khd->hqk", q_nope[sl], k_nope)
                         + torch.einsum("qhd,kd->hqk", q_pe[sl], k_pe)) * cfg.sm_scale
                    qpos = torch.arange(start + c, start + c + nc, device=self.device)[:, None]
                    kpos = torch.arange(start + m, device=self.device)[None, :]
                    s = s.masked_fill(kpos > qpos, float("-inf"))
                    out[sl] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
                row += m
            h = h + out.reshape(n, hq * dv) @ lw.o.T
            x = _rmsnorm(h, lw.post_norm, eps)
            gu = x @ lw.gate_up.T
            gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size:]
            h = h + (torch.nn.functional.silu(gate) * up) @ lw.down.T
        for (rid, toks), start in zip(segments, starts):
            self._len[rid] = start + len(toks)
        if not all_rows:
            last = torch.tensor(list(itertools.accumulate(len(t) for _, t in segments)), device=self.device) - 1
            h = h[last]
        return _rmsnorm(h, w.final_norm, eps) @ w.lm_head.T
