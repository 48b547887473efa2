"""Model configuration: one frozen dataclass per concern, small and nested."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrl_post.errors import UserError

# The dtypes a model's parameters, its activations, the rollout weights and the KV pool
# may take (configs name them as strings).
FLOAT_DTYPES = ("float32", "bfloat16", "float16")

# Activation-checkpointing policies for the scanned layer (see transformer.remat_policy).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ROPE_SCALING_TYPES = ("none", "linear", "llama3", "factors")
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's layer_types names.
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama family), GeGLU (Gemma).


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling.

  `kind` is "none", "linear", "llama3", or "factors": per-frequency divisors given
  explicitly, as GGUF files store Llama 3 scaling (the rope_freqs tensor).
  """

  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  factors: tuple[float, ...] = ()


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """A mixture-of-experts feed-forward block in every layer (Qwen3-MoE, OLMoE, Mixtral).

  Attributes:
    num_experts: E experts per layer.
    experts_per_token: k, the router's top-k.
    intermediate_size: each expert's hidden width (Hugging Face's moe_intermediate_size).
    norm_topk_prob: renormalise the k chosen probabilities to sum to 1 (Qwen3-MoE's
      norm_topk_prob, Mixtral); else they stay softmax probabilities over all E (OLMoE).
  """

  num_experts: int = 8
  experts_per_token: int = 2
  intermediate_size: int = 64
  norm_topk_prob: bool = True

  def __post_init__(self):
    for name in ("num_experts", "experts_per_token", "intermediate_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise UserError(f"moe config: {name} must be a positive integer, got {value!r}")
    if self.experts_per_token > self.num_experts:
      raise UserError(f"moe config: experts_per_token={self.experts_per_token} exceeds "
                      f"num_experts={self.num_experts}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters W + (alpha / rank) * A @ B on the named layer matrices.

  adapters > 1: A and B hold that many independent adapters of rank / adapters each, side
  by side on the rank axis, and each token uses only its own one (the layer's params carry
  `lora_adapter`, every token's adapter index): how one rollout engine decodes sequences
  of several adapters in the same batch (jaxrl_post.serve).
  """

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = ("wq", "wk", "wv", "wo")
  adapters: int = 1

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank <= 0:
      raise UserError(f"lora config: rank must be a positive integer, got {self.rank!r}")
    if not isinstance(self.adapters, int) or self.adapters < 1 or self.rank % self.adapters:
      raise UserError(f"lora config: adapters must be a positive divisor of rank "
                      f"{self.rank}, got {self.adapters!r}")
    unknown = sorted(set(self.targets) - set(LORA_TARGETS))
    if unknown or not self.targets:
      raise UserError(f"lora config: targets {unknown or '()'} not in {LORA_TARGETS}")

  @property
  def scale(self) -> float:
    return self.alpha / (self.rank // self.adapters)  # each adapter's own rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer (Llama 2/3, Qwen2/2.5, Qwen3 dense, Mistral, SmolLM2, Gemma 3).

  Attributes mirror Hugging Face's config.json names where one exists, so a reader can
  check a preset against the model card.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2, and Llama with attention_bias.
  o_bias: bool = False  # Llama with attention_bias.
  qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k, before RoPE.
  sliding_window: Optional[int] = None  # Mistral v0.1.
  max_position_embeddings: int = 4096
  param_dtype: str = "float32"
  compute_dtype: str = "bfloat16"
  remat: str = "none"
  lora: Optional[LoraConfig] = None
  value_head: bool = False  # A scalar value per position, for PPO's critic.
  moe: Optional[MoeConfig] = None  # Experts in place of the dense MLP in every layer.
  # Gemma 3. layer_types None: every layer uses sliding_window (None: full attention);
  # else one entry per layer, and only "sliding_attention" layers use the window.
  layer_types: Optional[tuple[str, ...]] = None
  rope_local_base_freq: Optional[float] = None  # RoPE base of sliding layers (no scaling).
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w), in float32.
  sandwich_norms: bool = False  # Also norms on the attention and MLP outputs.
  scale_embeddings: bool = False  # Embeddings times sqrt(hidden_size).
  query_pre_attn_scalar: Optional[float] = None  # Scores scale 1/sqrt(this); None: head_dim.
  mlp_activation: str = "silu"
  attn_logit_softcapping: Optional[float] = None  # cap * tanh(score / cap)
  final_logit_softcapping: Optional[float] = None

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise UserError(f"model config: {name} must be a positive integer, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise UserError(f"model config: num_heads={self.num_heads} is not a multiple of "
                      f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise UserError(f"model config: head_dim={self.head_dim} must be even for RoPE")
    if self.remat not in REMAT_POLICIES:
      raise UserError(f"model config: remat={self.remat!r} is not one of {REMAT_POLICIES}")
    if self.rope_scaling.kind not in ROPE_SCALING_TYPES:
      raise UserError(f"model config: rope_scaling kind {self.rope_scaling.kind!r} is not "
                      f"supported (supported: {ROPE_SCALING_TYPES})")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in FLOAT_DTYPES:
        raise UserError(f"model config: {name}={getattr(self, name)!r} is not a float dtype")
    if self.moe is not None and self.lora is not None:
      mlp = sorted(set(self.lora.targets) & {"w_gate", "w_up", "w_down"})
      if mlp:
        raise UserError(f"model config: LoRA targets {mlp} name the dense MLP, which a "
                        "mixture-of-experts model does not have")
    self._check_gemma_fields()

  def _check_gemma_fields(self):
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise UserError(f"model config: mlp_activation={self.mlp_activation!r} is not one of "
                      f"{MLP_ACTIVATIONS}")
    for name in ("rope_local_base_freq", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "sliding_window"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not value > 0):
        raise UserError(f"model config: {name} must be positive or None, got {value!r}")
    if self.layer_types is None:
      return
    if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
      raise UserError(f"model config: layer_types must be a tuple of num_layers="
                      f"{self.num_layers} entries, got {self.layer_types!r}")
    unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
    if unknown:
      raise UserError(f"model config: layer_types {unknown} not in {LAYER_TYPES}")
    if "sliding_attention" in self.layer_types and self.sliding_window is None:
      raise UserError("model config: layer_types has sliding_attention layers but "
                      "sliding_window is None")

  @property
  def layer_windows(self) -> tuple[Optional[int], ...]:
    """Each layer's attention window (None: the whole causal prefix)."""
    if self.layer_types is None:
      return (self.sliding_window,) * self.num_layers
    return tuple(self.sliding_window if t == "sliding_attention" else None
                 for t in self.layer_types)

  @property
  def layer_windows_types(self) -> tuple[str, ...]:
    """layer_windows in Hugging Face's layer_types names."""
    return tuple("full_attention" if w is None else "sliding_attention"
                 for w in self.layer_windows)

  @property
  def mixed_windows(self) -> bool:
    """Whether layers differ in window: attention then picks its variant per layer."""
    return len(set(self.layer_windows)) > 1

  @property
  def any_window(self) -> bool:
    return any(w is not None for w in self.layer_windows)

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += hd * (self.num_heads + 2 * self.num_kv_heads)
    if self.o_bias:
      attn += d
    if self.qk_norm:
      attn += 2 * hd
    mlp = 3 * d * f
    if self.moe is not None:
      mlp = self.moe.num_experts * (3 * d * self.moe.intermediate_size + d)
    layer = attn + mlp + (4 if self.sandwich_norms else 2) * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    value = d + 1 if self.value_head else 0
    return self.num_layers * layer + self.vocab_size * d + d + head + value

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def overridden(self, source: str, **overrides) -> "ModelConfig":
    """This config (read from `source`'s weights) with a user's overrides: dtypes, remat,
    LoRA, a value head and the like. The fields its weights' shapes fix may be repeated,
    not changed."""
    for name in WEIGHT_SHAPE_FIELDS:
      if name in overrides and overrides[name] != getattr(self, name):
        raise UserError(f"{source}: override {name}={overrides[name]!r} differs from the "
                        f"model's {getattr(self, name)!r}, which its weights fix")
    return self.replace(**overrides)


# What a loaded model's weights fix (their shapes and which of them exist).
WEIGHT_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                       "num_heads", "num_kv_heads", "head_dim", "tie_word_embeddings",
                       "qkv_bias", "o_bias", "qk_norm")
