"""Loading a local Hugging Face Llama / Qwen2 / Mistral checkpoint (``config.json`` + ``*.safetensors``).

No download and no dependency: the safetensors files are read with a small reader of the format
(an 8-byte header length, a JSON header, then the raw little-endian tensors), memory-mapped.
Qwen2's q/k/v biases and tied word embeddings are handled; Mistral's sliding window becomes the
attention wrappers' ``window_left``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import mmap
import os
import struct
from typing import Dict, Tuple

import torch

from .model import LayerWeights, ModelConfig, ModelWeights

__all__ = ["config_from_hf", "load_checkpoint", "read_safetensors", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """All tensors of one ``.safetensors`` file, as CPU tensors over a (copy-on-write) memory map."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = info["shape"]
        count = (end - start) // torch.empty(0, dtype=dtype).element_size()
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + start)
        out[name] = t.reshape(shape)
    return out


def _rope_scaling(d: dict):
    rs = d.get("rope_scaling") or d.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise NotImplementedError(f"config.json: rope scaling {kind!r} is not supported (only linear and llama3)")
    out = {"rope_type": kind, "factor": float(rs["factor"])}
    if kind == "llama3":
        for key, default in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                             ("original_max_position_embeddings", 8192)):
            out[key] = rs.get(key, default)
    return out


def config_from_hf(d: dict) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict (Llama, Qwen2, Mistral)."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"config.json: hidden_act {act!r} (only silu, i.e. SwiGLU)")
    if d.get("mlp_bias"):
        raise NotImplementedError("config.json: mlp_bias=true is not supported")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    sliding = None
    if model_type == "mistral":
        sliding = d.get("sliding_window")
    elif model_type == "qwen2" and d.get("use_sliding_window"):
        raise NotImplementedError("config.json: Qwen2 with use_sliding_window=true is not supported")
    rope_theta = d.get("rope_theta")
    if rope_theta is None:
        rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling(d),
        attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        name=model_type,
    )


def load_checkpoint(path: str, dtype: torch.dtype, device) -> Tuple[ModelConfig, ModelWeights]:
    """Config and weights (converted to ``dtype`` on ``device``) of a local checkpoint folder."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"--model {path}: no config.json there (expected a Hugging Face checkpoint folder)")
    with open(cfg_path) as f:
        cfg = config_from_hf(json.load(f))
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--model {path}: no *.safetensors files")
    tensors: Dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(read_safetensors(file))

    def take(name: str, required: bool = True):
        t = tensors.pop(name, None)
        if t is None:
            if required:
                raise KeyError(f"--model {path}: tensor {name!r} is missing")
            return None
        return t.to(device=device, dtype=dtype)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
        gate, up = take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=torch.cat([q, k, v]),
            qkv_bias=bias,
            o=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([gate, up]),
            down=take(p + "mlp.down_proj.weight"),
        ))
        del q, k, v, gate, up
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight", required=False)
    if lm_head is None or cfg.tie_word_embeddings:
        lm_head = embed
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    expected = (cfg.qkv_size, cfg.hidden_size)
    if tuple(layers[0].qkv.shape) != expected:
        raise ValueError(f"--model {path}: fused qkv weight is {tuple(layers[0].qkv.shape)}, config says {expected}")
    return cfg, ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)
