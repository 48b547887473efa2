"""Loading GGUF files: metadata -> ModelConfig, dequantised tensors -> Hugging Face layout."""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig, RopeScaling
from jaxrl_post.models.gguf_reader import read_gguf
from jaxrl_post.models.tokenizer import Tokenizer, tokenizer_from_gguf
from jaxrl_post.models.transformer import Transformer
from jaxrl_post.models.weights import model_from_tensors

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Per-layer GGUF tensor names -> Hugging Face names.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str | None:
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation (interleaved RoPE -> rotate-half)."""
  rows = w.shape[0]
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
  """A parsed GGUF file: metadata dict and lazily dequantised tensors."""

  def __init__(self, path: str):
    if not os.path.isfile(path):
      raise UserError(f"{path}: file not found")
    self.path = path
    try:
      self.meta, self.tensors = read_gguf(path)
    except Exception as e:  # ValueError, struct.error, OSError, unknown ggml types.
      raise UserError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") \
          from None
    self.arch = self.meta.get("general.architecture")

  def field(self, key: str, default: Any = KeyError) -> Any:
    value = self.meta.get(key, default)
    if value is KeyError:
      raise UserError(f"{self.path}: missing GGUF field {key}")
    return value

  def tensor(self, name: str) -> np.ndarray:
    """Dequantised float32 tensor in numpy (row-major, [out, in]) order."""
    t = self.tensors.get(name)
    if t is None:
      raise UserError(f"{self.path}: tensor {name} not found")
    try:
      fast = _WHOLE_ARRAY.get(int(t.tensor_type))
      data = fast(t.data) if fast else gguf.quants.dequantize(t.data, t.tensor_type)
      return np.asarray(data, np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
    except Exception as e:
      raise UserError(f"{self.path}: cannot read tensor {name}: corrupt or truncated ({e})") \
          from None


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:  # bytes -> [blocks, size] uint8
  raw = np.ascontiguousarray(raw).reshape(-1)
  if raw.size % size:
    raise ValueError(f"{raw.size} bytes is not a whole number of {size}-byte blocks")
  return raw.reshape(-1, size)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:  # [n, 1] float32 from a float16
  return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _q4_0(raw):  # 18-byte blocks: scale d, 16 bytes of 32 nibbles (low halves first)
  b = _blocks(raw, 18)
  q = np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1).astype(np.float32)
  return (_scale(b, 0) * (q - 8.0)).reshape(-1)


def _q4_1(raw):  # 20-byte blocks: scale d, minimum m, 16 bytes of 32 nibbles
  b = _blocks(raw, 20)
  q = np.concatenate([b[:, 4:] & 0x0F, b[:, 4:] >> 4], axis=1).astype(np.float32)
  return (_scale(b, 0) * q + _scale(b, 2)).reshape(-1)


def _q8_0(raw):  # 34-byte blocks: scale d, 32 int8
  b = _blocks(raw, 34)
  return (_scale(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


# The common block formats dequantised over the whole tensor at once: the gguf package
# works through 16 rows at a time, which took 1.5 s of SmolLM2's (Q4_1) 4 s load.
# Equal to gguf.quants.dequantize to the bit (tests/models); other types use it.
_WHOLE_ARRAY = {int(gguf.GGMLQuantizationType.Q4_0): _q4_0,
                int(gguf.GGMLQuantizationType.Q4_1): _q4_1,
                int(gguf.GGMLQuantizationType.Q8_0): _q8_0}


def config_from_gguf(f: GGUFFile, **overrides) -> ModelConfig:
  if f.arch not in SUPPORTED_ARCHITECTURES:
    raise UserError(f"{f.path}: GGUF general.architecture={f.arch!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
  a = f.arch
  hidden = int(f.field(f"{a}.embedding_length"))
  heads = int(f.field(f"{a}.attention.head_count"))
  vocab = f.meta.get(f"{a}.vocab_size") or len(f.field("tokenizer.ggml.tokens"))
  window = f.meta.get(f"{a}.attention.sliding_window")
  return ModelConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(f.field(f"{a}.feed_forward_length")),
      num_layers=int(f.field(f"{a}.block_count")), num_heads=heads,
      num_kv_heads=int(f.meta.get(f"{a}.attention.head_count_kv", heads)),
      head_dim=int(f.meta.get(f"{a}.attention.key_length", hidden // heads)),
      rope_theta=float(f.meta.get(f"{a}.rope.freq_base", 10000.0)), rope_scaling=_rope(f),
      rms_norm_eps=float(f.field(f"{a}.attention.layer_norm_rms_epsilon")),
      tie_word_embeddings="output.weight" not in f.tensors,
      qkv_bias="blk.0.attn_q.bias" in f.tensors, o_bias="blk.0.attn_output.bias" in f.tensors,
      qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
      sliding_window=int(window) if window else None,
      max_position_embeddings=int(f.meta.get(f"{a}.context_length", 4096)),
  ).overridden(f.path, **overrides)


def _rope(f: GGUFFile) -> RopeScaling:
  if "rope_freqs.weight" in f.tensors:  # Llama 3 scaling, stored as per-frequency divisors.
    return RopeScaling("factors", factors=tuple(float(x) for x in f.tensor("rope_freqs.weight")))
  kind = f.meta.get(f"{f.arch}.rope.scaling.type", "none")
  if kind == "none":
    return RopeScaling()
  if kind == "linear":
    return RopeScaling("linear", factor=float(f.field(f"{f.arch}.rope.scaling.factor")))
  raise UserError(f"{f.path}: GGUF rope scaling type {kind!r} is not supported")


def load_gguf(path: str, **overrides) -> tuple[Transformer, Tokenizer]:
  """Loads a GGUF file's model (dequantised to param_dtype) and its tokenizer."""
  f = GGUFFile(path)
  cfg = config_from_gguf(f, **overrides)
  by_hf = {_hf_name(n): n for n in f.tensors if _hf_name(n)}

  def get(hf_name: str) -> np.ndarray:
    if hf_name not in by_hf:
      raise UserError(f"{path}: tensor for {hf_name} not found in the GGUF file")
    w = f.tensor(by_hf[hf_name])
    if f.arch == "llama" and "q_proj" in hf_name:
      w = _unpermute(w, cfg.num_heads)
    elif f.arch == "llama" and "k_proj" in hf_name:
      w = _unpermute(w, cfg.num_kv_heads)
    return w

  return model_from_tensors(cfg, get, path), tokenizer_from_gguf(f.meta, path)
