"""The supervised warm-up: a loss or accuracy target ends it early; with LoRA it trains the
base only."""

import dataclasses

import jax
import numpy as np

from jaxrl_post.data.prompts import PromptConfig
from jaxrl_post.models import LoraConfig
from jaxrl_post.models.transformer import split_adapters
from jaxrl_post.pipeline.config import ModelSpec
from jaxrl_post.pipeline.policy import load_policy
from jaxrl_post.pipeline.warmup import warm_up
from jaxrl_post.rewards import ArithmeticTask
from jaxrl_post.rl.sft import SftConfig

TINY = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
        "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 32,
        "compute_dtype": "float32"}
TASK = ArithmeticTask(min_operand=0, max_operand=9, operators=("+",), template="{a}{op}{b}=",
                      num_eval=10)


def _warm_up(cfg: SftConfig, lora=None):
  model_cfg, params, tokenizer = load_policy(ModelSpec(tokenizer="chars", overrides=TINY,
                                                       lora=lora))
  logs = []
  out, metrics = warm_up(model_cfg, params, TASK, tokenizer, cfg,
                         PromptConfig(max_prompt_tokens=8), 4, seed=0, log=logs.append)
  return params, out, metrics, logs


def test_a_loss_target_ends_the_warm_up_early_and_says_so():
  cfg = SftConfig(steps=40, batch_size=8, row_tokens=64, stop_window=3)
  _, _, full, _ = _warm_up(cfg)
  assert full["sft/steps"] == 40
  # A target the first steps already meet: it stops once the window is full.
  _, _, early, logs = _warm_up(dataclasses.replace(cfg, stop_loss=100.0))
  assert early["sft/steps"] == 3 and "done" in logs[-1]
  # One between: the mean of the last 3 losses is below it, and it was not before.
  target = full["sft/final_loss"] + 1.0
  _, _, mid, _ = _warm_up(dataclasses.replace(cfg, stop_loss=target))
  assert 3 <= mid["sft/steps"] < 40


def test_an_accuracy_target_ends_the_warm_up_once_greedy_decoding_reaches_it():
  cfg = SftConfig(steps=60, batch_size=16, row_tokens=64, learning_rate=3e-3, stop_window=5,
                  stop_examples=64)
  _, _, full, _ = _warm_up(dataclasses.replace(cfg, stop_accuracy=1.0))  # Out of reach.
  assert full["sft/steps"] == 60 and 0.0 < full["sft/greedy_accuracy"] < 1.0
  target = full["sft/greedy_accuracy"]
  _, _, mid, logs = _warm_up(dataclasses.replace(cfg, stop_accuracy=target))
  assert mid["sft/steps"] % 5 == 0 and mid["sft/greedy_accuracy"] >= target
  assert "greedy accuracy" in logs[-1] and "done" in logs[-1]


def test_with_lora_the_warm_up_trains_the_base_and_leaves_the_adapters():
  cfg = SftConfig(steps=5, batch_size=8, row_tokens=64)
  before, after, _, _ = _warm_up(cfg, lora=LoraConfig(rank=4))
  (ad0, base0), (ad1, base1) = split_adapters(before), split_adapters(after)
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(ad0), jax.tree.leaves(ad1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  changed = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(base1))]
  assert sum(changed) > len(changed) // 2
