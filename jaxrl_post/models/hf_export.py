"""Writing a policy as a Hugging Face model directory (the inverse of hf.py + weights.py).

Our parameters are already in Hugging Face convention apart from layout: the GGUF loader
un-permutes llama.cpp's Q/K rows at load time, so every matrix only needs its [in, ...out]
layout turned back into [out, in]. The directory holds config.json, model.safetensors (or
shards plus model.safetensors.index.json), tokenizer.json, tokenizer_config.json with the
chat template, and generation_config.json, so transformers and `models.load` both open it.

LoRA adapters are folded into their base matrices first (W + scale * A @ B): the exported
model is a plain dense checkpoint that needs no adapter support to load.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.tokenizer import Tokenizer
from jaxrl_post.models.transformer import layer_param_shapes
from jaxrl_post.models.weights import expert_name, moe_prefix, sandwich_norm_names

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Ours -> Hugging Face name under model.layers.{i}. (the table weights.py reads with).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
# How many leading (input) dims each layer matrix has in our layout (transformer._INPUT_DIMS).
_INPUT_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def merge_lora(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
  """(config without LoRA, params with every adapter folded into its base matrix).

  Matches the forward's `x @ W + scale * (x @ A) @ B` exactly up to float rounding.
  """
  if cfg.lora is None:
    return cfg, params
  layers = {k: np.asarray(v, np.float32) for k, v in params["layers"].items()}
  for name in cfg.lora.targets:
    # A [L, in..., r] and B [L, r, out...]: flatten to [L, in, r] @ [L, r, out].
    a, b = layers.pop(f"{name}_lora_a"), layers.pop(f"{name}_lora_b")
    w = layers[name]
    a2 = a.reshape(a.shape[0], -1, a.shape[-1])
    b2 = b.reshape(b.shape[0], b.shape[1], -1)
    layers[name] = w + cfg.lora.scale * np.matmul(a2, b2).reshape(w.shape)
  return cfg.replace(lora=None), {**params, "layers": layers}


def hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """Hugging Face name -> float32 host tensor in Hugging Face layout ([out, in] matrices).

  A value head (PPO's critic) has no Hugging Face counterpart and is left out.
  """
  if cfg.lora is not None:
    raise ValueError("merge_lora first: Hugging Face checkpoints hold no adapters")
  host = lambda x: np.asarray(x, np.float32)
  out: dict[str, np.ndarray] = {}
  hf_names = {**_LAYER_NAMES, **sandwich_norm_names(cfg)}
  for name in layer_param_shapes(cfg):
    stacked = host(params["layers"][name])  # [L, ...]
    for i in range(cfg.num_layers):
      pre = f"model.layers.{i}."
      if name == "router":  # [D, E] -> [E, D]
        out[pre + moe_prefix(cfg) + "gate.weight"] = np.ascontiguousarray(stacked[i].T)
      elif name.startswith("we_"):  # [E, in, out] -> E matrices [out, in]
        for e, w in enumerate(stacked[i]):
          out[pre + expert_name(cfg, name, e)] = np.ascontiguousarray(w.T)
      else:
        out[pre + hf_names[name]] = _to_hf_layout(name, stacked[i])
  out["model.embed_tokens.weight"] = host(params["embed"])  # [V, D] in both.
  out["model.norm.weight"] = host(params["final_norm"])
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = np.ascontiguousarray(host(params["lm_head"]).T)  # [D, V] -> [V, D]
  return out


def _to_hf_layout(name: str, w: np.ndarray) -> np.ndarray:
  if name not in _INPUT_DIMS:  # Norms are [D] or [hd]; biases [H, hd] flatten to [H * hd].
    return np.ascontiguousarray(w.reshape(-1))
  n = _INPUT_DIMS[name]
  fan_in = int(np.prod(w.shape[:n]))
  return np.ascontiguousarray(w.reshape(fan_in, -1).T)  # [in, out] -> [out, in]


def hf_config(cfg: ModelConfig, bos_id: Optional[int], eos_id: Optional[int],
              dtype: str = "float32") -> dict[str, Any]:
  """config.json for transformers (and config_from_hf, which reads it back)."""
  model_type = _model_type(cfg)
  if model_type == "gemma3_text":
    return _gemma3_config(cfg, bos_id, eos_id, dtype)
  arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
          "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[model_type]
  c: dict[str, Any] = {
      "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": dtype,
      "bos_token_id": bos_id, "eos_token_id": eos_id, "use_cache": True,
      "attention_dropout": 0.0,
  }
  c.update(_rope_fields(cfg))
  if cfg.moe is not None:
    c.update(_moe_fields(cfg, model_type))
  if model_type == "llama":
    c.update(attention_bias=cfg.qkv_bias, mlp_bias=False)
  elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
    sliding = cfg.sliding_window is not None
    c.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
             max_window_layers=0)  # Layers >= max_window_layers use the window: all of them.
    if model_type != "qwen2":  # One flag for the Q/K/V and output biases alike.
      c["attention_bias"] = cfg.qkv_bias
  else:
    c["sliding_window"] = cfg.sliding_window
  return c


def _moe_fields(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
  m = cfg.moe
  if model_type == "mixtral":  # Its experts are intermediate_size wide.
    if not m.norm_topk_prob:
      raise UserError("export: Mixtral renormalises its top-k gates; norm_topk_prob=False "
                      "has no Mixtral form")
    return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "intermediate_size": m.intermediate_size, "router_aux_loss_coef": 0.0}
  return {"num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "moe_intermediate_size": m.intermediate_size, "norm_topk_prob": m.norm_topk_prob,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.0}


# Gemma 3's fixed architecture traits, which no other exported type has.
_GEMMA3_TRAITS = {"qk_norm": True, "norm_plus_one": True, "sandwich_norms": True,
                  "scale_embeddings": True, "mlp_activation": "gelu_tanh"}


def _gemma3_config(cfg: ModelConfig, bos_id, eos_id, dtype: str) -> dict[str, Any]:
  """config.json of a Gemma3ForCausalLM (transformers' Gemma3TextConfig fields)."""
  if cfg.attn_logit_softcapping is not None:
    raise UserError("export: transformers' Gemma 3 does not soft-cap attention scores, so "
                    "a model with attn_logit_softcapping has no Hugging Face form")
  if cfg.qkv_bias != cfg.o_bias:
    raise UserError("export: Gemma 3's attention_bias sets Q/K/V and output biases together")
  if cfg.rope_local_base_freq is None and cfg.rope_scaling.kind != "none" and cfg.any_window:
    raise UserError("export: Gemma 3's sliding layers have unscaled RoPE; set "
                    "rope_local_base_freq")
  c: dict[str, Any] = {
      "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": cfg.max_position_embeddings,
      "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
      "torch_dtype": dtype, "bos_token_id": bos_id, "eos_token_id": eos_id,
      "use_cache": True, "attention_dropout": 0.0, "attention_bias": cfg.qkv_bias,
      "query_pre_attn_scalar": _whole(cfg.query_pre_attn_scalar or cfg.head_dim),
      "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_windows_types),
      "rope_local_base_freq": cfg.rope_local_base_freq or cfg.rope_theta,
      "final_logit_softcapping": cfg.final_logit_softcapping,
      "attn_logit_softcapping": None,
  }
  c.update(_rope_fields(cfg))
  return c


def _whole(x: float):
  """x as an int when it is one: transformers' config classes type-check int fields."""
  return int(x) if float(x).is_integer() else x


def _model_type(cfg: ModelConfig) -> str:
  gemma = [getattr(cfg, k) == v for k, v in _GEMMA3_TRAITS.items()]
  if all(gemma):
    return "gemma3_text"
  if any(gemma[1:]):  # Gemma traits without the whole set (q/k norms alone are Qwen3's).
    raise UserError(f"export: only the full Gemma 3 set of {sorted(_GEMMA3_TRAITS)} has a "
                    "Hugging Face architecture, not a part of it")
  if cfg.layer_types is not None or cfg.rope_local_base_freq is not None or \
      cfg.query_pre_attn_scalar not in (None, cfg.head_dim) or \
      cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
    raise UserError("export: per-layer windows, a local RoPE base, query_pre_attn_scalar and "
                    "soft-capping have a Hugging Face form only in Gemma 3")
  if cfg.moe is not None:  # Qwen3-MoE has q/k norms, Mixtral none (see weights.moe_prefix).
    if cfg.qkv_bias or cfg.o_bias:
      raise UserError("export: a mixture-of-experts model with attention biases has no "
                      "Hugging Face architecture here (qwen3_moe and mixtral have none)")
    return "qwen3_moe" if cfg.qk_norm else "mixtral"
  if cfg.qk_norm:
    if cfg.qkv_bias != cfg.o_bias:
      raise UserError("export: a model with q/k norms needs Q/K/V and output biases both or "
                      "neither (qwen3's attention_bias sets all four)")
    return "qwen3"
  if cfg.qkv_bias and not cfg.o_bias:
    return "qwen2"  # Bias on Q/K/V only.
  if cfg.o_bias and not cfg.qkv_bias:
    raise UserError("export: a model with an output-projection bias but no Q/K/V bias has no "
                    "Hugging Face architecture (llama's attention_bias sets both)")
  if cfg.sliding_window is not None:
    if cfg.qkv_bias:
      raise UserError("export: sliding-window attention with attention biases has no "
                      "Hugging Face architecture")
    return "mistral"
  return "llama"


def _rope_fields(cfg: ModelConfig) -> dict[str, Any]:
  """rope_theta + rope_scaling (transformers 4 names; transformers 5 reads them too).

  No scaling means no rope_scaling key: transformers 5 reads an explicit null as "no RoPE
  parameters" and falls back to its default theta.
  """
  s = cfg.rope_scaling
  out: dict[str, Any] = {"rope_theta": cfg.rope_theta}
  if s.kind == "linear":
    out["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
  elif s.kind == "llama3":
    out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                           "low_freq_factor": s.low_freq_factor,
                           "high_freq_factor": s.high_freq_factor,
                           "original_max_position_embeddings":
                               s.original_max_position_embeddings}
  elif s.kind == "factors":
    raise UserError("export: RoPE scaling given as per-frequency factors (a GGUF rope_freqs "
                    "tensor) has no Hugging Face config form")
  return out


def parse_size(text: str) -> int:
  """'5GB', '200MB', '60KB', '2GiB' or a byte count -> bytes (transformers' max_shard_size
  style: KB/MB/GB in powers of 1000, KiB/MiB/GiB in powers of 1024)."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(text), re.IGNORECASE)
  if not m:
    raise UserError(f"max shard size {text!r}: expected a size like 5GB, 200MB or 1000000")
  unit = (m.group(2) or "B").upper()
  base = 1024 if "I" in unit else 1000
  size = int(float(m.group(1)) * base ** "BKMG".index(unit[0]))
  if size < 1:
    raise UserError(f"max shard size {text!r}: must be at least one byte")
  return size


def write_safetensors(tensors: dict[str, np.ndarray], out_dir: str,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
  """model.safetensors, or model-0000i-of-0000n.safetensors + index when over the limit.

  Tensors fill shards in name order; a tensor larger than the limit gets a shard of its own.
  """
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors, key=_natural_key):
    nbytes = tensors[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += nbytes
  meta = {"format": "pt"}  # transformers refuses safetensors files without it.
  if len(shards) == 1:
    save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
    return ["model.safetensors"]
  files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for file, shard in zip(files, shards):
    save_file(shard, os.path.join(out_dir, file), metadata=meta)
    weight_map.update({name: file for name in shard})
  total = sum(t.nbytes for t in tensors.values())
  _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
              {"metadata": {"total_size": total}, "weight_map": weight_map})
  return files + ["model.safetensors.index.json"]


def _natural_key(name: str) -> list:
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def write_tokenizer(tok: Tokenizer, out_dir: str) -> None:
  """tokenizer.json (the tokenizers object itself), tokenizer_config.json with the chat
  template and special tokens, so transformers' fast tokenizer and ours encode alike."""
  with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(tok.to_json())
  cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                         "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                         "clean_up_tokenization_spaces": False,
                         "model_max_length": 1000000000000000019884624838656}
  for name in ("pad_token", "unk_token"):  # The char tokenizer's own specials.
    token = "<pad>" if name == "pad_token" else "<unk>"
    if tok.token_to_id(token) is not None:
      cfg[name] = token
  if tok.chat_template:
    cfg["chat_template"] = tok.chat_template
  _write_json(os.path.join(out_dir, "tokenizer_config.json"), cfg)


def generation_config(tok: Tokenizer) -> dict[str, Any]:
  """Every stop id as eos_token_id, so generation stops where our rollouts stop."""
  stops = list(tok.stop_ids)
  eos: Any = stops[0] if len(stops) == 1 else stops or None
  return {"bos_token_id": tok.bos_id, "eos_token_id": eos}


def save_pretrained(out_dir: str, cfg: ModelConfig, params: dict, tok: Tokenizer,
                    dtype: str = "float32",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
  """Writes the whole Hugging Face directory; returns the files written.

  Args:
    out_dir: created if missing; files of an earlier export there are replaced.
    cfg: the model config the params belong to (LoRA adapters are merged here).
    params: nested parameter dict as `params_of` gives (host or device arrays).
    tok: the policy's tokenizer.
    dtype: stored weight dtype: float32 (what training keeps), bfloat16 or float16.
    max_shard_bytes: larger weights are split into shards with an index.
  """
  if dtype not in EXPORT_DTYPES:
    raise UserError(f"export: dtype {dtype!r} is not one of {sorted(EXPORT_DTYPES)}")
  if tok.vocab_size > cfg.vocab_size:
    raise UserError(f"export: the tokenizer has {tok.vocab_size} tokens, more than the "
                    f"model's vocab_size {cfg.vocab_size}")
  cfg, params = merge_lora(cfg, params)
  tensors = {k: v.astype(EXPORT_DTYPES[dtype]) for k, v in hf_tensors(cfg, params).items()}
  os.makedirs(out_dir, exist_ok=True)
  _remove_old_weights(out_dir)
  files = write_safetensors(tensors, out_dir, max_shard_bytes)
  gen = generation_config(tok)
  _write_json(os.path.join(out_dir, "config.json"),
              hf_config(cfg, gen["bos_token_id"], gen["eos_token_id"], dtype))
  _write_json(os.path.join(out_dir, "generation_config.json"), gen)
  write_tokenizer(tok, out_dir)
  return files + ["config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json"]


def _remove_old_weights(out_dir: str) -> None:
  """Shards of an earlier export would otherwise be listed next to the new ones."""
  for name in os.listdir(out_dir):
    if name.endswith(".safetensors") or name == "model.safetensors.index.json" or \
        name == "chat_template.jinja":
      os.remove(os.path.join(out_dir, name))


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2, ensure_ascii=False)
    f.write("\n")
