"""Turns Hugging Face-named host tensors into a Transformer.

Both loaders (safetensors directories and GGUF files) produce tensors under Hugging Face
names in Hugging Face layout ([out, in] matrices, rotate-half Q/K rows); this module is the
single place that maps them into our stacked, logically named parameters.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.transformer import Transformer, abstract_model, layer_param_shapes

GetTensor = Callable[[str], np.ndarray]


def _layer_tensors(cfg: ModelConfig, get: GetTensor, i: int) -> dict[str, np.ndarray]:
  d, hd, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  pre = f"model.layers.{i}."
  out = {
      "attn_norm": get(pre + "input_layernorm.weight"),
      "wq": get(pre + "self_attn.q_proj.weight").T.reshape(d, hq, hd),
      "wk": get(pre + "self_attn.k_proj.weight").T.reshape(d, hkv, hd),
      "wv": get(pre + "self_attn.v_proj.weight").T.reshape(d, hkv, hd),
      "wo": get(pre + "self_attn.o_proj.weight").T.reshape(hq, hd, d),
      "mlp_norm": get(pre + "post_attention_layernorm.weight"),
      "w_gate": get(pre + "mlp.gate_proj.weight").T,
      "w_up": get(pre + "mlp.up_proj.weight").T,
      "w_down": get(pre + "mlp.down_proj.weight").T,
  }
  if cfg.qkv_bias:
    out["bq"] = get(pre + "self_attn.q_proj.bias").reshape(hq, hd)
    out["bk"] = get(pre + "self_attn.k_proj.bias").reshape(hkv, hd)
    out["bv"] = get(pre + "self_attn.v_proj.bias").reshape(hkv, hd)
  if cfg.o_bias:
    out["bo"] = get(pre + "self_attn.o_proj.bias")
  return out


def _checked(value: np.ndarray, shape: tuple, name: str, source: str) -> np.ndarray:
  if tuple(value.shape) != tuple(shape):
    raise UserError(f"{source}: tensor {name} has shape {tuple(value.shape)}, the config "
                    f"implies {tuple(shape)}")
  return value


def model_from_tensors(cfg: ModelConfig, get: GetTensor, source: str) -> Transformer:
  """Builds a Transformer whose parameters come from `get(hf_name)`.

  Args:
    cfg: the model config (param_dtype decides the stored dtype).
    get: returns the host tensor for a Hugging Face parameter name, raising UserError
      naming the file when it is missing.
    source: the file or directory, for error messages.
  """
  dtype = jnp.dtype(cfg.param_dtype)
  model = abstract_model(cfg)
  shapes = layer_param_shapes(cfg)
  per_layer = [_layer_tensors(cfg, get, i) for i in range(cfg.num_layers)]
  for name, (shape, _) in shapes.items():
    stacked = np.stack([_checked(t[name], shape, f"layer {i} {name}", source)
                        for i, t in enumerate(per_layer)])
    getattr(model.layers, name).value = jnp.asarray(stacked, dtype)
  v, d = cfg.vocab_size, cfg.hidden_size
  embed = _checked(get("model.embed_tokens.weight"), (v, d), "model.embed_tokens.weight", source)
  model.embed.value = jnp.asarray(embed, dtype)
  norm = _checked(get("model.norm.weight"), (d,), "model.norm.weight", source)
  model.final_norm.value = jnp.asarray(norm, dtype)
  if not cfg.tie_word_embeddings:
    head = _checked(get("lm_head.weight"), (v, d), "lm_head.weight", source)
    model.lm_head.value = jnp.asarray(head.T, dtype)
  _assert_concrete(model, source)
  return model


def _assert_concrete(model: Transformer, source: str) -> None:
  for path, leaf in nnx.to_flat_state(nnx.state(model)):
    if not hasattr(leaf.value, "devices"):
      raise UserError(f"{source}: no tensor was loaded for parameter {'.'.join(map(str, path))}")
