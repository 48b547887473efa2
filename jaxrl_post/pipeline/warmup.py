"""The supervised warm-up phase: reference answers of the task's training split.

Examples are drawn with a generator seeded by the run's seed only, so the warm-up is the
same in every attempt of a run (a run killed during warm-up simply redoes it: it ends in
the step-0 checkpoint).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_post.data.prompts import PromptConfig, encode_prompt
from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, Tokenizer, abstract_model
from jaxrl_post.models.transformer import split_adapters
from jaxrl_post.rewards import Problem, Task
from jaxrl_post.rl.packing import Trajectory
from jaxrl_post.rl.sft import SftConfig, SftTrainer
from jaxrl_post.rl.trainer import merge_params, pack_micro_batches
from jaxrl_post.sharding import hosts


Script = Callable[[Problem, np.random.Generator], Optional[tuple[list[int], list[int]]]]


def sft_examples(task: Task, tokenizer: Tokenizer, prompt_cfg: PromptConfig, n: int,
                 max_new_tokens: int, rng: np.random.Generator,
                 script: Optional[Script] = None) -> list[Trajectory]:
  """n (prompt, reference answer + EOS) pairs from the training split; with a `script`
  (multi-turn environments: envs.driver.scripted_episode) the ids and loss mask it gives
  for a problem, where it gives some."""
  train, out = task.split("train"), []
  eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  for _ in range(100 * n):
    if len(out) == n:
      break
    problem = train[int(rng.integers(len(train)))]
    ids, _ = encode_prompt(tokenizer, problem, prompt_cfg)
    scripted = None if script is None or ids is None else script(problem, rng)
    if scripted is not None:
      out.append(Trajectory(ids, scripted[0], loss_mask=scripted[1]))
      continue
    answer = tokenizer.encode(problem.answer, add_special_tokens=False) + eos
    if ids is not None and answer:
      out.append(Trajectory(ids, answer[:max_new_tokens]))
  return out


def warm_up(model_cfg: ModelConfig, params: dict, task: Task, tokenizer: Tokenizer,
            cfg: SftConfig, prompt_cfg: PromptConfig, max_new_tokens: int, seed: int,
            log: Callable[[str], None], mesh: Optional[Mesh] = None,
            script: Optional[Script] = None) -> tuple[dict, dict]:
  """Runs cfg.steps supervised steps; returns (parameters, metrics).

  mesh: the trainer's, where `params` live: every host value (losses, the accuracy probe)
  is read through `hosts.fetch`, so a process holding none of its devices gets them too.
  script: multi-turn examples (see sft_examples).

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
  read = functools.partial(hosts.fetch, mesh=mesh)
  probe = _accuracy_probe(trainer, task, tokenizer, cfg, prompt_cfg, max_new_tokens, seed,
                          read)
  every = max(1, cfg.steps // 5)
  losses, accuracy = [], None
  for step in range(1, cfg.steps + 1):
    batch = sft_examples(task, tokenizer, prompt_cfg, cfg.batch_size, max_new_tokens, rng,
                         script)
    inputs, = pack_micro_batches(batch, [list(range(len(batch)))], cfg.row_tokens,
                                 max_new_tokens)
    params, opt_state, loss = trainer.step(params, opt_state, inputs, adapters)
    losses.append(loss)  # Read on the host only where a stop test needs it, or to log.
    done = None
    if cfg.stop_loss is not None and len(losses) >= cfg.stop_window:
      if float(np.mean(read(losses[-cfg.stop_window:]))) < cfg.stop_loss:
        done = f"mean of the last {cfg.stop_window} below {cfg.stop_loss}"
    if probe is not None and step % cfg.stop_window == 0:
      accuracy = probe(params, adapters)
      if accuracy >= cfg.stop_accuracy:
        done = f"greedy accuracy {accuracy:.3f} >= {cfg.stop_accuracy}"
    if step % every == 0 or step == cfg.steps or done:
      log(f"warm-up step {step}/{cfg.steps}: loss {float(read(loss)):.4f}"
          + (f" ({done}: done)" if done else ""))
    if done:
      break
  if adapters is not None:
    params = merge_params(params, adapters)
  metrics = {"sft/final_loss": float(read(losses[-1])) if losses else float("nan"),
             "sft/steps": len(losses)}
  if accuracy is not None:
    metrics["sft/greedy_accuracy"] = accuracy
  return params, metrics


def _accuracy_probe(trainer: SftTrainer, task: Task, tokenizer: Tokenizer, cfg: SftConfig,
                    prompt_cfg: PromptConfig, max_new_tokens: int, seed: int, read):
  """None without cfg.stop_accuracy; else (params, adapters) -> greedy accuracy on a fixed
  draw of training problems, packed once."""
  if cfg.stop_accuracy is None:
    return None
  rng = np.random.default_rng([seed, 0x5F8])  # Apart from the training batches' stream.
  examples = sft_examples(task, tokenizer, prompt_cfg, cfg.stop_examples, max_new_tokens, rng)
  if not examples:
    raise UserError("sft config: stop_accuracy needs problems with reference answers in "
                    "the task's training split; it has none")
  inputs, = pack_micro_batches(examples, [list(range(len(examples)))], cfg.row_tokens,
                               max_new_tokens)
  return lambda params, adapters: float(
      np.sum(read(trainer.greedy_matches(params, inputs, adapters)))) / len(examples)

