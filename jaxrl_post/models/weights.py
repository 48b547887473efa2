"""Turns Hugging Face-named host tensors into a Transformer.

Both loaders (safetensors directories and GGUF files) produce tensors under Hugging Face
names in Hugging Face layout ([out, in] matrices, rotate-half Q/K rows); this module is the
single place that maps them into our stacked, logically named parameters.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_post import host
from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.transformer import Transformer, abstract_model, init_lora, \
    layer_param_shapes

GetTensor = Callable[[str], np.ndarray]


def _fetch(get: GetTensor, name: str, hf_shape: tuple, shape: tuple, source: str,
           transpose: bool = True) -> np.ndarray:
  """Reads `name`, checks its Hugging Face shape, and returns it in our layout.

  Hugging Face matrices are [out, in]; ours are [in, ...out] so a forward is x @ W.
  """
  w = get(name)
  if tuple(w.shape) != tuple(hf_shape):
    raise UserError(f"{source}: tensor {name} has shape {tuple(w.shape)}, the config implies "
                    f"{tuple(hf_shape)}")
  return (w.T if transpose and w.ndim == 2 else w).reshape(shape)


def _layer_tensors(cfg: ModelConfig, get: GetTensor, i: int, source: str) -> dict:
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  hq, hkv = cfg.num_heads, cfg.num_kv_heads
  pre = f"model.layers.{i}."
  spec = {  # ours -> (HF name, HF shape); our shapes come from layer_param_shapes.
      "attn_norm": ("input_layernorm.weight", (d,)),
      "wq": ("self_attn.q_proj.weight", (hq * hd, d)),
      "wk": ("self_attn.k_proj.weight", (hkv * hd, d)),
      "wv": ("self_attn.v_proj.weight", (hkv * hd, d)),
      "wo": ("self_attn.o_proj.weight", (d, hq * hd)),
      "mlp_norm": ("post_attention_layernorm.weight", (d,)),
      "w_gate": ("mlp.gate_proj.weight", (f, d)),
      "w_up": ("mlp.up_proj.weight", (f, d)),
      "w_down": ("mlp.down_proj.weight", (d, f)),
      "bq": ("self_attn.q_proj.bias", (hq * hd,)),
      "bk": ("self_attn.k_proj.bias", (hkv * hd,)),
      "bv": ("self_attn.v_proj.bias", (hkv * hd,)),
      "bo": ("self_attn.o_proj.bias", (d,)),
      "q_norm": ("self_attn.q_norm.weight", (hd,)),
      "k_norm": ("self_attn.k_norm.weight", (hd,)),
  }
  spec.update({ours: (hf, (d,)) for ours, hf in sandwich_norm_names(cfg).items()})
  if cfg.moe is not None:
    spec.update(_moe_spec(cfg))
  out = {}
  for ours, (shape, _) in layer_param_shapes(cfg).items():
    if ours in _EXPERT_NAMES:
      out[ours] = _experts(cfg, get, pre, ours, source)
    else:
      out[ours] = _fetch(get, pre + spec[ours][0], spec[ours][1], shape, source)
  return out


# Our stacked expert matrices -> the per-expert Hugging Face name of each family.
_EXPERT_NAMES = {"we_gate": ("gate_proj", "w1"), "we_up": ("up_proj", "w3"),
                 "we_down": ("down_proj", "w2")}


def moe_prefix(cfg: ModelConfig) -> str:
  """Where a layer's MoE block lives: Qwen3-MoE's "mlp." or Mixtral's "block_sparse_moe.".

  The two families we load differ in q/k norms (Qwen3-MoE has them), which decides it.
  """
  return "mlp." if cfg.qk_norm else "block_sparse_moe."


def expert_name(cfg: ModelConfig, ours: str, e: int) -> str:
  qwen, mixtral = _EXPERT_NAMES[ours]
  if moe_prefix(cfg) == "mlp.":
    return f"mlp.experts.{e}.{qwen}.weight"
  return f"block_sparse_moe.experts.{e}.{mixtral}.weight"


def _moe_spec(cfg: ModelConfig) -> dict:
  d, e = cfg.hidden_size, cfg.moe.num_experts
  return {"router": (moe_prefix(cfg) + "gate.weight", (e, d))}


def _experts(cfg: ModelConfig, get: GetTensor, pre: str, ours: str, source: str) -> np.ndarray:
  """[E, in, out] from the E per-expert [out, in] matrices."""
  d, f = cfg.hidden_size, cfg.moe.intermediate_size
  hf_shape = (d, f) if ours == "we_down" else (f, d)
  return np.stack([_fetch(get, pre + expert_name(cfg, ours, e), hf_shape, hf_shape[::-1],
                          source) for e in range(cfg.moe.num_experts)])


def sandwich_norm_names(cfg: ModelConfig) -> dict[str, str]:
  """Gemma's per-layer norm names where they differ from Llama's: its
  post_attention_layernorm norms the attention output, and the MLP's input norm is
  pre_feedforward_layernorm."""
  if not cfg.sandwich_norms:
    return {}
  return {"mlp_norm": "pre_feedforward_layernorm.weight",
          "post_attn_norm": "post_attention_layernorm.weight",
          "post_mlp_norm": "post_feedforward_layernorm.weight"}


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
  # Layers dequantise on every core: numpy lets go of the interpreter lock in its loops.
  with concurrent.futures.ThreadPoolExecutor(host.cpus()) as pool:
    per_layer = list(pool.map(lambda i: _layer_tensors(cfg, get, i, source),
                              range(cfg.num_layers)))
  for name in layer_param_shapes(cfg):
    getattr(model.layers, name).set_value(_on_devices([t[name] for t in per_layer], dtype))
  v, d = cfg.vocab_size, cfg.hidden_size
  embed = _fetch(get, "model.embed_tokens.weight", (v, d), (v, d), source, transpose=False)
  model.embed.set_value(_on_devices(embed, dtype))
  model.final_norm.set_value(
      _on_devices(_fetch(get, "model.norm.weight", (d,), (d,), source), dtype))
  if not cfg.tie_word_embeddings:  # HF stores [V, D]; ours is [D, V].
    model.lm_head.set_value(_on_devices(
        _fetch(get, "lm_head.weight", (v, d), (d, v), source), dtype))
  init_lora(model)  # Adapters are new: the checkpoint holds the base weights.
  if cfg.value_head:  # So is a critic head on a policy checkpoint.
    model.value_w.set_value(jnp.zeros((cfg.hidden_size,), dtype))
    model.value_b.set_value(jnp.zeros((), dtype))
  _assert_concrete(model, source)
  return model


def _on_devices(host: np.ndarray | list[np.ndarray], dtype) -> jax.Array:
  """`host` (a list: its arrays stacked) as one array of `dtype`: converted straight into
  a 64-byte aligned host buffer, which a CPU backend takes as the array's memory instead
  of copying it (the copy of SmolLM2-135M's 538 MB of float32 weights took 1.5 s); an
  accelerator copies it over."""
  shape = (len(host), *host[0].shape) if isinstance(host, list) else host.shape
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  out = raw[start:start + nbytes].view(dtype).reshape(shape)
  if isinstance(host, list):
    np.stack(host, out=out, casting="same_kind")
  else:
    np.copyto(out, host, casting="same_kind")
  return jax.device_put(out)


_ALIGN = 64  # What XLA's CPU buffers need to be used in place.


def _assert_concrete(model: Transformer, source: str) -> None:
  for path, leaf in nnx.to_flat_state(nnx.state(model)):
    if not hasattr(leaf.get_value(), "devices"):
      raise UserError(f"{source}: no tensor was loaded for parameter {'.'.join(map(str, path))}")
