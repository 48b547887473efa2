"""Loading Hugging Face model directories (config.json + safetensors, single or sharded)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Optional

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig, MoeConfig, RopeScaling
from jaxrl_post.models.transformer import Transformer
from jaxrl_post.models.weights import model_from_tensors

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral",
                         "gemma3_text", "gemma3")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
# transformers' Gemma3TextConfig defaults: the multimodal checkpoints' text_config (and
# some text ones) leave out every field that has its default.
GEMMA3_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
}


def read_json(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise UserError(f"{path}: file not found")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: not valid JSON ({e})") from None


def _rope(c: dict[str, Any], path: str) -> tuple[float, RopeScaling]:
  # transformers >= 5 nests theta and scaling in rope_parameters; older files use
  # rope_theta + rope_scaling with "type" or "rope_type".
  params = c.get("rope_parameters") or {}
  scaling = c.get("rope_scaling") or params
  theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
  kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
  if kind == "default":
    return theta, RopeScaling()
  if kind == "linear":
    return theta, RopeScaling("linear", factor=float(scaling["factor"]))
  if kind == "llama3":
    return theta, RopeScaling(
        "llama3", factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
  raise UserError(f"{path}: rope scaling type {kind!r} is not supported "
                  "(supported: default, linear, llama3)")


def _sliding_window(c: dict[str, Any], model_type: str, path: str) -> Optional[int]:
  """The one window every layer uses, or None; mixed full/sliding layers are refused.

  Qwen2/Qwen3 use the window only with use_sliding_window, and then only in the layers
  layer_types marks (by default those from max_window_layers on).
  """
  window = c.get("sliding_window")
  if model_type not in ("qwen2", "qwen3", "qwen3_moe"):
    return int(window) if window else None
  if not window or not c.get("use_sliding_window", False):
    return None
  n = int(c["num_hidden_layers"])
  first = int(c.get("max_window_layers", 28))  # transformers' default for both.
  kinds = c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                   for i in range(n)]
  if set(kinds) == {"full_attention"}:
    return None
  if set(kinds) != {"sliding_attention"}:
    raise UserError(f"{path}: layer_types/max_window_layers mix full and sliding-window "
                    "attention layers, which is not supported (one window for all layers)")
  return int(window)


_REQUIRED = object()


def _field(c: dict[str, Any], key: str, cast, path: str, default: Any = _REQUIRED) -> Any:
  """c[key] as `cast`; absent or null gives `default`, or an error naming the field."""
  value = c.get(key)
  if value is None:
    if default is _REQUIRED:
      raise UserError(f"{path}: missing field {key!r}")
    return default
  try:
    return cast(value)
  except (TypeError, ValueError):
    raise UserError(f"{path}: field {key!r} has an invalid value {value!r}") from None


def _config_fields(c: dict[str, Any], model_type: str, path: str) -> dict[str, Any]:
  """ModelConfig fields from config.json."""
  get = lambda key, cast=int, default=_REQUIRED: _field(c, key, cast, path, default)
  heads, hidden = get("num_attention_heads"), get("hidden_size")
  bias = get("attention_bias", bool, False)
  theta, scaling = _rope(c, path)
  if model_type in ("qwen3", "qwen3_moe"):  # transformers defaults it to 128, not D / heads.
    head_dim = get("head_dim")
  else:
    head_dim = get("head_dim", int, hidden // max(heads, 1))
  fields = dict(
      vocab_size=get("vocab_size"), hidden_size=hidden,
      intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
      num_heads=heads, num_kv_heads=get("num_key_value_heads", int, heads), head_dim=head_dim,
      rope_theta=theta, rope_scaling=scaling, rms_norm_eps=get("rms_norm_eps", float, 1e-6),
      tie_word_embeddings=get("tie_word_embeddings", bool, False),
      qkv_bias=bias or model_type == "qwen2", o_bias=bias,
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      sliding_window=_sliding_window(c, model_type, path),
      max_position_embeddings=get("max_position_embeddings", int, 4096),
      moe=_moe(c, model_type, path) if model_type in MOE_MODEL_TYPES else None)
  if model_type == "gemma3_text":
    fields.update(_gemma3_fields(c, path))
  return fields


def _moe(c: dict[str, Any], model_type: str, path: str) -> MoeConfig:
  """The experts of a Qwen3-MoE or Mixtral config; every layer must be sparse."""
  get = lambda key, cast=int, default=_REQUIRED: _field(c, key, cast, path, default)
  if model_type == "mixtral":  # Softmax over the top-k logits: renormalised probabilities.
    return MoeConfig(num_experts=get("num_local_experts"),
                     experts_per_token=get("num_experts_per_tok"),
                     intermediate_size=get("intermediate_size"), norm_topk_prob=True)
  step = get("decoder_sparse_step", int, 1)
  dense = c.get("mlp_only_layers") or []
  if step != 1 or dense:
    raise UserError(f"{path}: decoder_sparse_step={step}, mlp_only_layers={dense}: dense "
                    "layers between MoE layers are not supported (every layer must be MoE)")
  experts = c.get("num_experts", c.get("num_local_experts"))
  return MoeConfig(num_experts=_field({"num_experts": experts}, "num_experts", int, path),
                   experts_per_token=get("num_experts_per_tok"),
                   intermediate_size=get("moe_intermediate_size"),
                   norm_topk_prob=get("norm_topk_prob", bool, False))


def _gemma3_text(c: dict[str, Any], path: str) -> dict[str, Any]:
  """The text model's config.json fields of a gemma3 (multimodal) or gemma3_text file."""
  if c.get("model_type") == "gemma3":
    text = c.get("text_config")
    if not isinstance(text, dict):
      raise UserError(f"{path}: model_type 'gemma3' needs a 'text_config' object")
    tied = {"tie_word_embeddings": c["tie_word_embeddings"]} \
        if "tie_word_embeddings" in c else {}
    c = {**text, **tied, "model_type": "gemma3_text"}
  return {**GEMMA3_DEFAULTS, **c}


def _gemma3_rope(c: dict[str, Any], path: str) -> dict[str, Any]:
  """Global RoPE (theta + scaling) and the sliding layers' base, from either form:
  transformers 5's rope_parameters per layer type, or rope_theta + rope_scaling +
  rope_local_base_freq."""
  params = c.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:
    full = {"rope_theta": GEMMA3_DEFAULTS["rope_theta"], **(params.get("full_attention") or {})}
    local = {"rope_theta": GEMMA3_DEFAULTS["rope_local_base_freq"],
             **(params.get("sliding_attention") or {})}
    theta, scaling = _rope({"rope_parameters": full}, path)
    local_theta, local_scaling = _rope({"rope_parameters": local}, path)
    if local_scaling.kind != "none":
      raise UserError(f"{path}: RoPE scaling on the sliding-window layers is not supported")
  else:
    theta, scaling = _rope({k: v for k, v in c.items() if k != "rope_parameters"}, path)
    local_theta = float(c["rope_local_base_freq"])
  return dict(rope_theta=theta, rope_scaling=scaling, rope_local_base_freq=local_theta)


def _gemma3_fields(c: dict[str, Any], path: str) -> dict[str, Any]:
  """The Gemma 3 architecture's ModelConfig fields (c has GEMMA3_DEFAULTS filled in)."""
  act = c["hidden_activation"]
  if act != "gelu_pytorch_tanh":
    raise UserError(f"{path}: hidden_activation {act!r} is not supported "
                    "(only gelu_pytorch_tanh)")
  if c.get("use_bidirectional_attention"):
    raise UserError(f"{path}: use_bidirectional_attention=true is not supported (decoder only)")
  n = int(c["num_hidden_layers"])
  pattern = int(c["sliding_window_pattern"])
  kinds = c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else
                                   "full_attention" for i in range(n)]
  if not isinstance(kinds, list):
    raise UserError(f"{path}: field 'layer_types' has an invalid value {kinds!r}")
  # transformers' Gemma 3 attention never applies attn_logit_softcapping (q/k norms took
  # its place after Gemma 2), so the field is read as absent to give the same logits.
  caps = {"final_logit_softcapping": _field(c, "final_logit_softcapping", float, path, None)}
  return dict(
      qk_norm=True, norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
      mlp_activation="gelu_tanh", layer_types=tuple(kinds),
      query_pre_attn_scalar=_field(c, "query_pre_attn_scalar", float, path),
      **_gemma3_rope(c, path), **caps)


def config_from_hf(c: dict[str, Any], path: str, **overrides) -> ModelConfig:
  """ModelConfig from a parsed config.json; `path` names the file in errors."""
  model_type = c.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise UserError(f"{path}: model_type {model_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  if model_type in ("gemma3", "gemma3_text"):  # Its activation is hidden_activation.
    c, model_type = _gemma3_text(c, path), "gemma3_text"
  elif c.get("hidden_act", "silu") != "silu":
    raise UserError(f"{path}: hidden_act {c['hidden_act']!r} is not supported (only silu)")
  if c.get("mlp_bias"):
    raise UserError(f"{path}: mlp_bias=true is not supported")
  try:
    fields = _config_fields(c, model_type, path)
    try:
      cfg = ModelConfig(**fields)
    except UserError as e:  # A value ModelConfig refuses: say which file it came from.
      raise UserError(f"{path}: {e}") from None
    return cfg.overridden(path, **overrides)
  except KeyError as e:
    raise UserError(f"{path}: missing field {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise UserError(f"{path}: invalid value ({e})") from None


def _text_model_reader(reader: "_SafetensorsReader"):
  """get(name) for model_from_tensors: a gemma3 (multimodal) checkpoint keeps its text
  model under a prefix (transformers >= 4.52 and older spellings); plain names otherwise."""
  for prefix, head in (("model.language_model.", "lm_head.weight"),
                       ("language_model.model.", "language_model.lm_head.weight")):
    if prefix + "embed_tokens.weight" in reader.files:
      return lambda name: reader(head if name == "lm_head.weight" else
                                 prefix + name.removeprefix("model."))
  return reader


def _weight_files(model_dir: str) -> dict[str, str]:
  """Maps tensor name -> safetensors file, from the index when the weights are sharded."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise UserError(f"{index}: missing field 'weight_map'")
    return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
  single = os.path.join(model_dir, "model.safetensors")
  if not os.path.isfile(single):
    raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
  with _open_safetensors(single) as f:
    return {k: single for k in f.keys()}


@contextlib.contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
  if not os.path.isfile(path):
    raise UserError(f"{path}: file not found")
  try:
    with safe_open(path, framework="numpy") as f:
      yield f
  except (SafetensorError, OSError) as e:
    raise UserError(f"{path}: corrupt or truncated safetensors file ({e})") from None


class _SafetensorsReader:
  """Reads tensors lazily, keeping each shard open once."""

  def __init__(self, model_dir: str):
    self.files = _weight_files(model_dir)
    self.model_dir = model_dir
    self._stack = contextlib.ExitStack()
    self._open: dict[str, Any] = {}

  def __call__(self, name: str) -> np.ndarray:
    path = self.files.get(name)
    if path is None:
      raise UserError(f"{self.model_dir}: tensor {name} not found in the safetensors weights")
    if path not in self._open:
      self._open[path] = self._stack.enter_context(_open_safetensors(path))
    try:
      return np.asarray(self._open[path].get_tensor(name), np.float32)
    except (SafetensorError, OSError, ValueError) as e:
      raise UserError(f"{path}: cannot read tensor {name}: corrupt or truncated ({e})") from None

  def close(self) -> None:
    self._stack.close()


def load_hf_model(model_dir: str, **overrides) -> Transformer:
  """Loads a Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE/Mixtral/Gemma 3 checkpoint directory;
  overrides go to ModelConfig."""
  cfg_path = os.path.join(model_dir, "config.json")
  cfg = config_from_hf(read_json(cfg_path), cfg_path, **overrides)
  reader = _SafetensorsReader(model_dir)
  try:
    return model_from_tensors(cfg, _text_model_reader(reader), model_dir)
  finally:
    reader.close()
