"""A DeepSeek-V2/V3-style decoder with multi-head latent attention (MLA), served in the absorbed form
by tritoninfer's MLA kernels (``BatchMLAPagedAttentionWrapper``, ``append_paged_mla_kv_cache``).

The attention follows Hugging Face's ``DeepseekV3Attention`` (transformers 5.24):

- queries: ``q_b_proj(rmsnorm(q_a_proj(x)))`` with a ``q_lora_rank`` (or one ``q_proj`` without),
  per head ``[q_nope (qk_nope_head_dim); q_pe (qk_rope_head_dim)]``;
- ``kv_a_proj_with_mqa(x) = [c (kv_lora_rank); k_pe (qk_rope_head_dim)]``, ``ckv = rmsnorm(c)``,
  ``k_pe`` one rotary key shared by all heads;
- ``kv_b_proj(ckv)`` gives per head ``k_nope`` and ``v``; scores ``(q_nope·k_nope + q_pe·k_pe) /
  sqrt(qk_nope + qk_rope)``; ``o_proj`` of the heads' outputs.

Served absorbed, as FlashInfer's MLA kernels compute it: ``kv_b_proj``'s rows split per head into
``W_UK`` ``[qk_nope, kv_lora_rank]`` and ``W_UV`` ``[v_head_dim, kv_lora_rank]``; the cache holds only
``ckv`` and ``k_pe`` per token (one latent row shared by every head); the query becomes
``q_nope·W_UK`` (kv_lora_rank wide), attention returns ``P·ckv`` and ``·W_UV^T`` gives each head's
output. :class:`DeepseekModel` derives ``W_UK``/``W_UV`` from ``kv_b`` once, so the dense reference
(which expands ``kv_b_proj`` as the definition does) checks the absorption too.

Simplifications, all deliberate: plain RoPE (rotate-half, ``rope_interleave=False``, no YaRN
scaling, so no mscale on the softmax scale), a dense SwiGLU MLP in every layer (no MoE), no biases.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from tritoninfer.activation import silu_and_mul
from tritoninfer.norm import fused_add_rmsnorm, rmsnorm
from tritoninfer.rope import apply_rope_pos_ids_inplace

__all__ = ["MLAConfig", "MLALayerWeights", "MLAWeights", "DeepseekModel", "random_mla_weights", "MLA_TINY"]


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """The shape of a DeepSeek-style MLA decoder (dense MLP, plain RoPE)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    q_lora_rank: Optional[int] = 32  # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32  # head_dim_ckv of the MLA kernels (DeepSeek: 512)
    qk_nope_head_dim: int = 16  # DeepSeek: 128
    qk_rope_head_dim: int = 16  # head_dim_kpe (DeepSeek: 64)
    v_head_dim: int = 16  # DeepSeek: 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    name: str = "random"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank: expected a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even number (rotary pairs), got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """``1/sqrt(qk_nope + qk_rope)`` (1/sqrt(192) for DeepSeek): the scale of the non-absorbed
        scores, unchanged by the absorption. YaRN would multiply it by mscale², not used here."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def num_parameters(self) -> int:
        h, i, v, hq = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_heads
        q_in = self.q_lora_rank if self.q_lora_rank is not None else h
        per_layer = q_in * hq * self.qk_head_dim + h * (self.kv_lora_rank + self.qk_rope_head_dim)
        per_layer += self.kv_lora_rank * hq * (self.qk_nope_head_dim + self.v_head_dim) + hq * self.v_head_dim * h
        per_layer += 3 * h * i + 2 * h + self.kv_lora_rank
        if self.q_lora_rank is not None:
            per_layer += h * self.q_lora_rank + self.q_lora_rank
        return 2 * v * h + self.num_layers * per_layer + h

    def describe(self) -> str:
        q = f"q_lora_rank {self.q_lora_rank}" if self.q_lora_rank is not None else "no q_lora"
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads, MLA kv_lora_rank "
                f"{self.kv_lora_rank} + rope {self.qk_rope_head_dim}, qk_nope {self.qk_nope_head_dim}, v "
                f"{self.v_head_dim}, {q}, dense intermediate {self.intermediate_size}, vocab {self.vocab_size}")


MLA_TINY = MLAConfig()


@dataclasses.dataclass
class MLALayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_a: Optional[torch.Tensor]  # [q_lora_rank, hidden] (None without q_lora)
    q_a_norm: Optional[torch.Tensor]  # [q_lora_rank]
    q_b: torch.Tensor  # [H (nope + rope), q_lora_rank or hidden]: q_b_proj, or q_proj without q_lora
    kv_a: torch.Tensor  # [kv_lora_rank + rope, hidden]: kv_a_proj_with_mqa
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [H (nope + v), kv_lora_rank]: per head k_nope rows, then v rows
    o: torch.Tensor  # [hidden, H v]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor  # [hidden, I]


@dataclasses.dataclass
class MLAWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: List[MLALayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]

    def to(self, dtype: torch.dtype, device=None) -> "MLAWeights":
        def cv(t):
            return None if t is None else t.to(device=device if device is not None else t.device, dtype=dtype)

        return MLAWeights(
            embed=cv(self.embed),
            layers=[MLALayerWeights(*(cv(getattr(lw, f.name)) for f in dataclasses.fields(MLALayerWeights)))
                    for lw in self.layers],
            final_norm=cv(self.final_norm), lm_head=cv(self.lm_head))


def random_mla_weights(cfg: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                       device="cpu") -> MLAWeights:
    """Deterministic random weights, scaled as :func:`model.random_weights` (projections
    ~N(0, 1/fan_in), norm weights ~1 + N(0, 0.1²), lm_head ~N(0, 4/hidden))."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
        return t.mul_(std).add_(mean).to(dtype)

    h, i, hq, r = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.kv_lora_rank
    q_in = cfg.q_lora_rank if cfg.q_lora_rank is not None else h
    layers = []
    for _ in range(cfg.num_layers):
        lora = cfg.q_lora_rank is not None
        layers.append(MLALayerWeights(
            input_norm=normal(h, std=0.1, mean=1.0),
            q_a=normal(cfg.q_lora_rank, h, std=1 / math.sqrt(h)) if lora else None,
            q_a_norm=normal(cfg.q_lora_rank, std=0.1, mean=1.0) if lora else None,
            q_b=normal(hq * cfg.qk_head_dim, q_in, std=1 / math.sqrt(q_in)),
            kv_a=normal(r + cfg.qk_rope_head_dim, h, std=1 / math.sqrt(h)),
            kv_a_norm=normal(r, std=0.1, mean=1.0),
            kv_b=normal(hq * (cfg.qk_nope_head_dim + cfg.v_head_dim), r, std=1 / math.sqrt(r)),
            o=normal(h, hq * cfg.v_head_dim, std=1 / math.sqrt(hq * cfg.v_head_dim)),
            post_norm=normal(h, std=0.1, mean=1.0),
            gate_up=normal(2 * i, h, std=1 / math.sqrt(h)),
            down=normal(h, i, std=1 / math.sqrt(i)),
        ))
    embed = normal(cfg.vocab_size, h)
    final_norm = normal(h, std=0.1, mean=1.0)
    lm_head = normal(cfg.vocab_size, h, std=2 / math.sqrt(h))
    return MLAWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def split_kv_b(cfg: MLAConfig, kv_b: torch.Tensor):
    """``kv_b_proj``'s weight as ``(W_UK [H, qk_nope, R], W_UV [H, v, R])`` (contiguous copies)."""
    w = kv_b.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim].contiguous(), w[:, cfg.qk_nope_head_dim:].contiguous()


# attention(layer, q_nope_absorbed [n, H, R], q_pe [n, H, P], ckv [n, R], kpe [n, P]) -> P·ckv [n, H, R]
MLAAttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DeepseekModel:
    """The MLA decoder on tritoninfer's kernels, in the absorbed form; weights and activations in
    ``dtype``; attention with fp16/bf16 queries and latents (``attn_dtype``, fp16 for fp32 models).

    ``w_uk`` / ``w_uv`` (per layer, ``[H, qk_nope, R]`` / ``[H, v, R]``) are taken from ``kv_b`` here
    and used instead of it; tests perturb them to see ``--check`` fail."""

    arch = "deepseek"

    def __init__(self, cfg: MLAConfig, weights: MLAWeights, dtype: torch.dtype = torch.bfloat16,
                 attn_dtype: Optional[torch.dtype] = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.attn_dtype = attn_dtype or (dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16)
        self.w = weights
        self.device = weights.embed.device
        self.w_uk, self.w_uv = [], []
        for lw in weights.layers:
            uk, uv = split_kv_b(cfg, lw.kv_b)
            self.w_uk.append(uk)
            self.w_uv.append(uv.transpose(1, 2))  # [H, R, v]: bmm's right operand

    def one_layer(self) -> "DeepseekModel":
        """A copy with only the first layer (the engine's warm-up rehearses with it)."""
        return DeepseekModel(dataclasses.replace(self.cfg, num_layers=1),
                             dataclasses.replace(self.w, layers=self.w.layers[:1]), self.dtype, self.attn_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: MLAAttentionFn,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (float32) of a flat batch of tokens (as :meth:`LlamaModel.forward`)."""
        cfg, w = self.cfg, self.w
        n = input_ids.shape[0]
        hq, nope, rope, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        residual = F.embedding(input_ids, w.embed)
        x = rmsnorm(residual, w.layers[0].input_norm, eps)
        for i, lw in enumerate(w.layers):
            q_in = x if lw.q_a is None else rmsnorm(F.linear(x, lw.q_a), lw.q_a_norm, eps)
            q = F.linear(q_in, lw.q_b).view(n, hq, nope + rope)
            kv = F.linear(x, lw.kv_a)  # [n, R + P]
            ckv = rmsnorm(kv[:, :r].contiguous(), lw.kv_a_norm, eps).to(self.attn_dtype)
            q_pe = q[:, :, nope:].to(self.attn_dtype)  # strided views (rotated in place) unless converted
            kpe = kv[:, r:].to(self.attn_dtype).unsqueeze(1)  # [n, 1, P]: one rotary key for all heads
            apply_rope_pos_ids_inplace(q_pe, kpe, positions, rope_theta=cfg.rope_theta)
            # absorbed query: per head q_nope·W_UK, [H, n, nope] @ [H, nope, R]; viewed [n, H, R]
            q_abs = torch.bmm(q[:, :, :nope].transpose(0, 1), self.w_uk[i]).transpose(0, 1)
            if q_abs.dtype != self.attn_dtype:
                q_abs = q_abs.to(self.attn_dtype)
            lat = attention(i, q_abs, q_pe, ckv, kpe.squeeze(1))  # [n, H, R]: P·ckv
            o = torch.bmm(lat.to(self.dtype).transpose(0, 1), self.w_uv[i])  # [H, n, v]
            a = F.linear(o.transpose(0, 1).reshape(n, hq * cfg.v_head_dim), lw.o)
            fused_add_rmsnorm(a, residual, lw.post_norm, eps)
            mlp = F.linear(silu_and_mul(F.linear(a, lw.gate_up)), lw.down)
            next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            fused_add_rmsnorm(mlp, residual, next_norm, eps)
            x = mlp
        if logits_rows is not None:
            x = x[logits_rows]
        return F.linear(x, w.lm_head).float()
