"""A Llama-architecture decoder (RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP) on
tritoninfer's kernels.

The model knows nothing about pages or batching: :meth:`LlamaModel.forward` takes a flat batch of
tokens with their positions and an ``attention(layer, q, k, v)`` callback, which the engine
implements over its paged KV cache (append with ``append_paged_kv_cache``, then the prefill or
decode wrapper). Norms, rotary embeddings and the SwiGLU activation are tritoninfer kernels; the
projections are ``torch.nn.functional.linear``.

Weights are held fused: ``qkv`` is ``[q; k; v]`` stacked on the output dimension (Qwen2's biases
likewise) and ``gate_up`` is ``[gate; up]``, the layout ``silu_and_mul`` expects.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from tritoninfer.activation import silu_and_mul
from tritoninfer.norm import fused_add_rmsnorm, rmsnorm
from tritoninfer.rope import apply_llama31_rope_pos_ids_inplace, apply_rope_pos_ids_inplace

__all__ = ["ModelConfig", "LayerWeights", "ModelWeights", "LlamaModel", "random_weights", "TINY", "H200",
           "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape and hyper-parameters of a Llama-architecture decoder (Llama, Qwen2, Mistral)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None (plain RoPE), or {"rope_type": "linear", "factor": f}, or {"rope_type": "llama3",
    # "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: Optional[dict] = None
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None  # Mistral: each query sees the last `sliding_window` keys
    name: str = "random"

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads: {self.num_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"head_dim: expected a multiple of 8 up to 256 (tritoninfer's attention), got {self.head_dim}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("linear", "llama3"):
            raise NotImplementedError(f"rope_scaling: only 'linear' and 'llama3' are supported, got {self.rope_scaling}")

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def window_left(self) -> int:
        """The attention wrappers' ``window_left`` (keys kept: ``window_left + 1``); -1 for none."""
        return -1 if not self.sliding_window else self.sliding_window - 1

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * self.qkv_size + self.num_heads * self.head_dim * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += self.qkv_size
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, heads {self.num_heads}/{self.num_kv_heads}, "
                f"head_dim {self.head_dim}, intermediate {self.intermediate_size}, vocab {self.vocab_size}")


# The interpreter configuration (CPU) and the realistic one (GPU preset `h200`).
TINY = ModelConfig()
H200 = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=8, num_heads=32,
                   num_kv_heads=8, head_dim=128)


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: Optional[torch.Tensor]  # [(Hq + 2 Hkv) D] (Qwen2) or None
    o: torch.Tensor  # [hidden, Hq D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows first, then up
    down: torch.Tensor  # [hidden, I]


@dataclasses.dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: List[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)

    def to(self, dtype: torch.dtype, device=None) -> "ModelWeights":
        """A copy in ``dtype`` (norm weights included) on ``device``."""
        def cv(t):
            return None if t is None else t.to(device=device if device is not None else t.device, dtype=dtype)

        tied = self.lm_head is self.embed
        embed = cv(self.embed)
        return ModelWeights(
            embed=embed,
            layers=[LayerWeights(*(cv(getattr(lw, f.name)) for f in dataclasses.fields(LayerWeights)))
                    for lw in self.layers],
            final_norm=cv(self.final_norm),
            lm_head=embed if tied else cv(self.lm_head),
        )


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   device="cpu") -> ModelWeights:
    """Deterministic random weights (same seed, device and dtype: same weights).

    Scaled so activations stay O(1) through the layers and the logits spread over a few units,
    which keeps greedy tokens well separated: embeddings ~N(0, 1), projections ~N(0, 1/fan_in),
    norm weights ~1 + N(0, 0.1^2), lm_head ~N(0, 4/hidden).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32 if device.type == "cpu" else dtype)
        t = t.mul_(std).add_(mean)
        return t.to(dtype)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layers = []
    for _ in range(cfg.num_layers):
        layers.append(LayerWeights(
            input_norm=normal(h, std=0.1, mean=1.0),
            qkv=normal(cfg.qkv_size, h, std=1 / math.sqrt(h)),
            qkv_bias=normal(cfg.qkv_size, std=0.1) if cfg.attention_bias else None,
            o=normal(h, cfg.num_heads * d, std=1 / math.sqrt(cfg.num_heads * d)),
            post_norm=normal(h, std=0.1, mean=1.0),
            gate_up=normal(2 * i, h, std=1 / math.sqrt(h)),
            down=normal(h, i, std=1 / math.sqrt(i)),
        ))
    embed = normal(cfg.vocab_size, h)
    final_norm = normal(h, std=0.1, mean=1.0)
    lm_head = embed if cfg.tie_word_embeddings else normal(cfg.vocab_size, h, std=2 / math.sqrt(h))
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


# attention(layer, q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]) -> o [n, Hq, D]; q/k/v are strided views.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LlamaModel:
    """The decoder on tritoninfer's kernels; weights and activations in ``dtype``.

    Attention runs with fp16/bf16 queries (tritoninfer's attention takes no fp32 queries): with
    ``dtype=float32`` the callback receives q/k/v in ``attn_dtype`` (fp16 by default), and its output
    is converted back.
    """

    arch = "llama"  # the engine's attention backend (attention.py); DeepseekModel's is "deepseek"

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, dtype: torch.dtype = torch.bfloat16,
                 attn_dtype: Optional[torch.dtype] = None) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.attn_dtype = attn_dtype or (dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16)
        self.w = weights
        self.device = weights.embed.device

    def one_layer(self) -> "LlamaModel":
        """A copy with only the first layer (the engine's warm-up rehearses with it)."""
        return LlamaModel(dataclasses.replace(self.cfg, num_layers=1),
                          dataclasses.replace(self.w, layers=self.w.layers[:1]), self.dtype, self.attn_dtype)

    def rope_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate q and k in place (rotate-half, as Hugging Face's Llama)."""
        cfg, rs = self.cfg, self.cfg.rope_scaling
        if rs is not None and rs["rope_type"] == "llama3":
            apply_llama31_rope_pos_ids_inplace(
                q, k, positions, rope_scale=float(rs["factor"]), rope_theta=cfg.rope_theta,
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                old_context_len=int(rs.get("original_max_position_embeddings", 8192)))
        else:
            scale = float(rs["factor"]) if rs is not None else 1.0
            apply_rope_pos_ids_inplace(q, k, positions, rope_scale=scale, rope_theta=cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                logits_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (float32) of a flat batch of tokens.

        input_ids : int64 ``[n]``; positions : int32 ``[n]``; logits_rows: which rows get logits
        (e.g. the last token of each prefilled request), all rows when None.
        """
        cfg, w = self.cfg, self.w
        n = input_ids.shape[0]
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        residual = F.embedding(input_ids, w.embed)  # [n, hidden]
        x = rmsnorm(residual, w.layers[0].input_norm, cfg.rms_norm_eps)
        for i, lw in enumerate(w.layers):
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # [n, (Hq + 2 Hkv) D]
            if qkv.dtype != self.attn_dtype:
                qkv = qkv.to(self.attn_dtype)
            q = qkv[:, : hq * d].view(n, hq, d)
            k = qkv[:, hq * d: (hq + hkv) * d].view(n, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(n, hkv, d)
            self.rope_(q, k, positions)
            o = attention(i, q, k, v)  # [n, Hq, D]
            a = F.linear(o.reshape(n, hq * d).to(self.dtype), lw.o)
            fused_add_rmsnorm(a, residual, lw.post_norm, cfg.rms_norm_eps)  # residual += a; a = norm(residual)
            mlp = F.linear(silu_and_mul(F.linear(a, lw.gate_up)), lw.down)
            next_norm = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            fused_add_rmsnorm(mlp, residual, next_norm, cfg.rms_norm_eps)
            x = mlp
        if logits_rows is not None:
            x = x[logits_rows]
        return F.linear(x, w.lm_head).float()
