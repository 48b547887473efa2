"""The supervised warm-up phase: reference answers of the task's training split.

Examples are drawn with a generator seeded by the run's seed only, so the warm-up is the
same in every attempt of a run (a run killed during warm-up simply redoes it: it ends in
the step-0 checkpoint).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.data.prompts import PromptConfig, encode_prompt
from jaxrl_post.models import ModelConfig, Tokenizer, abstract_model
from jaxrl_post.models.transformer import split_adapters
from jaxrl_post.rewards import Task
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rl.sft import SftConfig, SftTrainer
from jaxrl_post.rl.trainer import merge_params, pack_micro_batches


def sft_examples(task: Task, tokenizer: Tokenizer, prompt_cfg: PromptConfig, n: int,
                 max_new_tokens: int, rng: np.random.Generator) -> list[Trajectory]:
  """n (prompt, reference answer + EOS) pairs from the training split."""
  train, out = task.split("train"), []
  eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  for _ in range(100 * n):
    if len(out) == n:
      break
    problem = train[int(rng.integers(len(train)))]
    ids, _ = encode_prompt(tokenizer, problem, prompt_cfg)
    answer = tokenizer.encode(problem.answer, add_special_tokens=False) + eos
    if ids is not None and answer:
      out.append(Trajectory(ids, answer[:max_new_tokens]))
  return out


def warm_up(model_cfg: ModelConfig, params: dict, task: Task, tokenizer: Tokenizer,
            cfg: SftConfig, prompt_cfg: PromptConfig, max_new_tokens: int, seed: int,
            log: Callable[[str], None]) -> tuple[dict, dict]:
  """Runs cfg.steps supervised steps; returns (parameters, metrics).

  With LoRA the warm-up trains the base and leaves the adapters as initialised (B = 0, a
  no-op), so RL starts from the warmed-up model, which is also its reference.
  """
  trainer = SftTrainer(abstract_model(model_cfg), cfg)
  params = jax.tree.map(jnp.array, params)  # Own copy: the steps donate it.
  adapters = None
  if model_cfg.lora is not None:
    adapters, params = split_adapters(params)
  opt_state = trainer.init(params)
  rng = np.random.default_rng([seed, 0x5F7])
  every = max(1, cfg.steps // 5)
  losses = []
  for step in range(1, cfg.steps + 1):
    batch = sft_examples(task, tokenizer, prompt_cfg, cfg.batch_size, max_new_tokens, rng)
    inputs, = pack_micro_batches(batch, [list(range(len(batch)))], cfg.row_tokens,
                                 max_new_tokens)
    params, opt_state, loss = trainer.step(params, opt_state, inputs, adapters)
    losses.append(loss)  # Read on the host only where a stop_loss needs it, or to log.
    reached = (cfg.stop_loss is not None and len(losses) >= cfg.stop_window
               and float(np.mean(losses[-cfg.stop_window:])) < cfg.stop_loss)
    if step % every == 0 or step == cfg.steps or reached:
      log(f"warm-up step {step}/{cfg.steps}: loss {float(loss):.4f}"
          + (f" (mean of the last {cfg.stop_window} below {cfg.stop_loss}: done)"
             if reached else ""))
    if reached:
      break
  if adapters is not None:
    params = merge_params(params, adapters)
  return params, {"sft/final_loss": float(losses[-1]) if losses else float("nan"),
                  "sft/steps": len(losses)}

