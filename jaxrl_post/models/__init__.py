"""The policy model: transformer, presets, loading (Hugging Face, GGUF), tokenizer."""

from __future__ import annotations

import os

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import LoraConfig, ModelConfig, MoeConfig, RopeScaling
from jaxrl_post.models.presets import EMBEDDED, PRESETS, embedded_path, preset
from jaxrl_post.models.tokenizer import Tokenizer
from jaxrl_post.models.transformer import KVCache, Transformer, abstract_model, init_model

__all__ = ["KVCache", "LoraConfig", "ModelConfig", "MoeConfig", "RopeScaling", "Tokenizer", "Transformer", "abstract_model",
           "init_model", "load", "preset", "PRESETS", "EMBEDDED"]


def load(name_or_path: str, **overrides) -> tuple[Transformer, Tokenizer]:
  """Loads a model and its tokenizer.

  Args:
    name_or_path: an embedded model name (e.g. "smollm2-135m-instruct"), a GGUF file, a
      Hugging Face model directory (config.json, safetensors, tokenizer.json) or a hub id
      ("Qwen/Qwen3-0.6B", read through the hub's cache: models.hub).
    **overrides: ModelConfig fields, e.g. param_dtype, compute_dtype, remat.
  """
  from jaxrl_post.models.gguf_file import load_gguf
  from jaxrl_post.models.hf import load_hf_model
  from jaxrl_post.models.tokenizer import tokenizer_from_hf_dir

  from jaxrl_post.models import hub

  if name_or_path in EMBEDDED:
    return load_gguf(embedded_path(name_or_path), **overrides)
  name_or_path = hub.local_source(name_or_path)
  if os.path.isdir(name_or_path):
    return load_hf_model(name_or_path, **overrides), tokenizer_from_hf_dir(name_or_path)
  if os.path.isfile(name_or_path):
    if not name_or_path.endswith(".gguf"):
      raise UserError(f"{name_or_path}: not a .gguf file or a model directory")
    return load_gguf(name_or_path, **overrides)
  raise UserError(f"unknown model {name_or_path!r}: not an embedded model "
                  f"({', '.join(EMBEDDED)}), a GGUF file, a model directory or a hub id")
