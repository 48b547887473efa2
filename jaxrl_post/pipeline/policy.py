"""The policy a run starts from: model config, full parameter dict, tokenizer."""

from __future__ import annotations

import dataclasses

from jaxrl_post.errors import UserError
from jaxrl_post.models import PRESETS, ModelConfig, Tokenizer, load, preset
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import init_lora, init_model_compiled, params_of
from jaxrl_post.pipeline.config import ModelSpec


def load_policy(spec: ModelSpec) -> tuple[ModelConfig, dict, Tokenizer]:
  """Builds or loads the model named by `spec` (random weights for presets)."""
  overrides = dict(spec.overrides)
  if spec.lora is not None:
    overrides["lora"] = spec.lora
  if spec.moe is not None:
    if spec.source not in PRESETS:
      raise UserError(f"ModelSpec.moe: {spec.source} brings its own architecture; MoE "
                      "layers are added to presets only (random weights)")
    overrides["moe"] = spec.moe
  bad = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
  if bad:
    raise UserError(f"ModelSpec.overrides: unknown ModelConfig field(s) {sorted(bad)}")
  if spec.source in PRESETS:
    if spec.tokenizer != "chars":
      raise UserError(f"model preset {spec.source!r} has random weights and no tokenizer: "
                      "set ModelSpec.tokenizer = 'chars'")
    tokenizer = char_tokenizer()
    cfg = preset(spec.source, **overrides)
    if tokenizer.vocab_size > cfg.vocab_size:
      raise UserError(f"model preset {spec.source!r}: vocab_size {cfg.vocab_size} is smaller "
                      f"than the char tokenizer's {tokenizer.vocab_size}")
    model = init_model_compiled(cfg, spec.init_seed)
  else:
    model, tokenizer = load(spec.source, **overrides)
    if spec.tokenizer == "chars":
      raise UserError(f"{spec.source}: a loaded model uses its own tokenizer "
                      "(ModelSpec.tokenizer = '')")
  if spec.lora is not None:
    init_lora(model, spec.init_seed)
  return model.config, params_of(model), tokenizer
