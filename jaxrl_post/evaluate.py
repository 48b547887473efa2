"""Held-out evaluation on its own: python -m jaxrl_post.evaluate --gin_file=configs/X.gin.

  --gin_file, --gin_param   the run's config (task, eval size, prompts, engine, placement);
                            with --checkpoint and no --gin_file, the run's own config.gin
  --gin_import MODULE       import a module of your own tasks (jaxrl_post.register) first
  --checkpoint WORKDIR      evaluate a run's checkpoint (newest, or --step N)
  --model NAME_OR_PATH      or a model: embedded name, GGUF file, Hugging Face directory
                            (default: the config's ModelSpec, as a run starts from it)
  --json                    print the metrics as one JSON object
  --compilation_cache=PATH|off
                            persistent XLA compilation cache (default: ~/.cache/jaxrl_post/xla)

The evaluation is the run's own: the same held-out problems, prompt encoding, greedy decode
on the rollout engine over the rollout mesh in SyncConfig.rollout_dtype, and verifier, so
the accuracy equals the eval/accuracy a run logs for the same weights. With
`--gin_param='EvalSpec.samples = 16'` it also reports pass@k and maj@k of 16 samples per
problem at EvalSpec.temperature (eval/pass@1, @2, @4, @8, @16 and eval/maj@k), as a run
does at its eval cadence.

A task read from data files first says what it read and what it skipped, and why, one line
per path ("read N rows from FILE; skipped M (reason=count, ...)"); with --json those lines
go to stderr, so stdout stays one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Callable

from jaxrl_post import compile_cache, plugins
from jaxrl_post.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.evaluate",
                              description="Held-out greedy accuracy of a policy.")
  p.add_argument("--gin_file", action="append", default=[],
                 help="gin config file (default with --checkpoint: the run's config.gin)")
  p.add_argument("--gin_param", action="append", default=[], help="one gin binding")
  plugins.add_import_flag(p)
  p.add_argument("--checkpoint", default=None, metavar="WORKDIR", help="a run's checkpoint")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  p.add_argument("--model", default=None, help="embedded name, GGUF file, HF directory or hub id")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  compile_cache.add_cache_flag(p)
  return p.parse_args(argv)


def _policy(args, exp):
  """(model config, full params, tokenizer) of what is evaluated."""
  from jaxrl_post.pipeline.policy import load_policy
  from jaxrl_post.pipeline.trained import load_trained

  if args.checkpoint and args.model:
    raise UserError("--checkpoint and --model: give one of them")
  if args.checkpoint:
    policy = load_trained(args.checkpoint, args.step)
    # Adapters stay separate, as in the run's engine, so the decode is the run's exactly.
    return policy.config, policy.params, policy.tokenizer
  if args.step is not None:
    raise UserError("--step needs --checkpoint WORKDIR")
  spec = exp.model if args.model is None else dataclasses.replace(
      exp.model, source=args.model, tokenizer="", lora=None)
  return load_policy(spec)


def evaluate(exp, cfg, params, tokenizer) -> dict:
  """The run's held-out evaluation (RLRun.evaluate) on these weights."""
  import jax
  import jax.numpy as jnp

  from jaxrl_post.models.transformer import abstract_model, logical_axes
  from jaxrl_post.pipeline import rollouts
  from jaxrl_post.rewards import VerifierPool
  from jaxrl_post.rollout import Engine
  from jaxrl_post.rollout.weights import engine_form
  from jaxrl_post.sharding import WeightSync, build_meshes

  meshes = build_meshes(exp.placement)
  full = jax.tree.map(lambda x: jnp.asarray(x, jnp.dtype(cfg.param_dtype)), params)
  form = engine_form(cfg, meshes.rollout, exp.rollout.engine.split_layers)  # Held once.
  sync = WeightSync(meshes, logical_axes(abstract_model(cfg)), full, exp.sync, form=form)
  rollout = sync.initial(full)
  from jaxrl_post.envs import Environment

  episodes = isinstance(exp.task, Environment)  # Multi-turn: the episode token budget.
  engine_cfg = exp.rollout.engine
  if engine_cfg.max_seq_len is None:
    after = exp.agent.max_tokens if episodes else exp.rollout.max_new_tokens
    engine_cfg = dataclasses.replace(engine_cfg,
                                     max_seq_len=exp.prompts.max_prompt_tokens + after)
  engine = Engine(cfg, rollout.params, engine_cfg, version=0, mesh=meshes.rollout)
  split = exp.task.split("eval")
  if len(split) == 0:
    raise UserError("the task's eval split is empty")
  problems = [split[i] for i in range(min(exp.eval.num_problems, len(split)))]
  if episodes:
    return _evaluate_episodes(exp, engine, tokenizer, problems)
  with VerifierPool(exp.task, workers=exp.reward.workers, timeout_s=exp.reward.timeout_s,
                    processes=exp.reward.processes) as pool:  # as the run's, RewardSpec's
    return rollouts.evaluate(engine, tokenizer, exp.task, problems, exp.prompts,
                             exp.rollout.max_new_tokens, exp.rollout.scheduler, pool=pool,
                             samples=exp.eval.samples, temperature=exp.eval.temperature)


def _evaluate_episodes(exp, engine, tokenizer, problems) -> dict:
  """The agent run's evaluation: greedy episodes, and pass@k / maj@k of sampled ones."""
  from jaxrl_post.envs import EpisodeRunner, TurnFormat
  from jaxrl_post.pipeline.agent import evaluate_episodes

  runner = EpisodeRunner(engine, exp.task, TurnFormat(tokenizer, exp.prompts.chat_template),
                         exp.agent.limits(), exp.rollout.scheduler,
                         workers=exp.agent.env_workers)
  try:
    out, *_ = evaluate_episodes(runner, tokenizer, exp.task, problems, exp.prompts,
                                exp.rollout.max_new_tokens, exp.eval.samples,
                                exp.eval.temperature)
  finally:
    runner.close()
  return out


def read_lines(task) -> list[str]:
  """What a task read from its data files and skipped there; none for generated tasks."""
  from jaxrl_post.rewards.base import ReadsFiles

  return [report.line() for report in task.reads] if isinstance(task, ReadsFiles) else []


def _run_config(checkpoint: str | None) -> list[str]:
  """Without --gin_file: a checkpoint's run is evaluated as it evaluated itself, on the
  task and eval settings of the config.gin it wrote."""
  path = checkpoint and os.path.join(checkpoint, "config.gin")
  if not path or not os.path.isfile(path):
    raise UserError("no config: pass --gin_file=configs/<name>.gin" + (
        f" ({checkpoint} has no config.gin)" if checkpoint else ""))
  return [path]


def run(args, say: Callable[[str], None] = print) -> dict:
  from jaxrl_post.pipeline import config

  gin_files = args.gin_file or _run_config(args.checkpoint)
  plugins.import_modules(args.gin_import)
  config.parse(gin_files, args.gin_param)
  exp = config.build_experiment()
  for line in read_lines(exp.task):  # Before the model loads: a data mistake shows at once.
    say(line)
  cfg, params, tokenizer = _policy(args, exp)
  return evaluate(exp, cfg, params, tokenizer)


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache)
  say = functools.partial(print, file=sys.stderr) if args.json else print
  try:
    metrics = run(args, say)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(metrics))
  else:
    print(f"held-out accuracy: {metrics['eval/accuracy']:.3f} "
          f"({metrics['eval/problems']} problems, {metrics['eval/skipped']} skipped)")
    at_k = [f"{name[len('eval/'):]} {value:.3f}" for name, value in metrics.items()
            if name.startswith(("eval/pass@", "eval/maj@"))]
    if at_k:
      print(f"{metrics['eval/k_samples']} samples per problem: " + ", ".join(at_k))
  return 0


if __name__ == "__main__":
  sys.exit(main())
