"""The synchronous on-policy RL loop, with checkpoints that lose nothing.

One step: prompts (grain) -> rollout engine (K samples each) -> rewards (verifier processes,
each prompt's group scored as soon as it is decoded, while the engine decodes the rest)
-> advantages -> packing -> trainer (one program per minibatch: reference logprobs, loss,
update, metrics) -> weight sync. Every role is timed; the rest of the step is reported as
time/waiting. The step's training metrics reach the host in one fetch.

The algorithm changes the data path in three places, each a function of its own: DAPO's
dynamic sampling draws further rollout rounds to replace groups whose rewards do not vary
(`dynamic.refill`), its overlong penalty shapes the rewards (`_shape_rewards`), and with a
critic (PPO) the advantages are GAE over the critic's values, computed inside each
minibatch's program, so the loop passes rewards instead of group advantages (`_scores`).

Resuming: a checkpoint holds the train state, the reference parameters, the prompt
iterator's position, the weight version and the run's counters; every random draw is a
function of (seed, step, rollout round), so a run killed at any point and restarted with
the same command continues with exactly the metrics the uninterrupted run would have
written. metrics.jsonl is cut back to the restored step first (lines written after the
last checkpoint are recomputed, not duplicated).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post import plan
from jaxrl_post.checkpoint import Checkpointer, abstract_like
from jaxrl_post.data.prompts import PromptStream
from jaxrl_post.errors import UserError
from jaxrl_post.models.transformer import abstract_model, is_adapter, logical_axes
from jaxrl_post.pipeline import dynamic, rollouts
from jaxrl_post.pipeline.compiles import CompileCounter
from jaxrl_post.pipeline.config import Experiment
from jaxrl_post.pipeline.observe import RunTelemetry, write_report
from jaxrl_post.pipeline.policy import load_policy
from jaxrl_post.pipeline.warmup import warm_up
from jaxrl_post.rewards import VerifierPool
from jaxrl_post.rl.advantages import sequence_advantages
from jaxrl_post.rl.dapo import OverlongConfig, overlong_penalty
from jaxrl_post.rl.packing import completion_bucket
from jaxrl_post.rl.trainer import (SequenceScores, Trainer, fetch_metrics, pack_rollouts,
                                   rollout_batch_metrics)
from jaxrl_post.rollout import Engine, EngineConfig, SamplingParams, weights
from jaxrl_post.rollout.pages import free_device_bytes
from jaxrl_post.sharding import PartialSync, WeightSync, build_meshes
from jaxrl_post.telemetry import (DiscardMetrics, MetricsWriter, ProgressBar, StepTimer,
                                  truncate_jsonl)
from jaxrl_post.telemetry.progress import format_duration
from jaxrl_post.telemetry.trackers import with_trackers


@dataclasses.dataclass
class Progress:
  """What the loop carries between steps besides the train state (saved as JSON)."""

  step: int = 0  # RL steps done.
  eval_history: list = dataclasses.field(default_factory=list)  # [[step, accuracy], ...]
  counters: dict = dataclasses.field(default_factory=dict)  # cumulative counts


class RLRun:
  """Builds every role of a run from its Experiment and runs the loop in `workdir`."""

  def __init__(self, exp: Experiment, workdir: str, log=print):
    self.exp, self.workdir, self.log = exp, workdir, log
    self.model_cfg, params, self.tokenizer = load_policy(exp.model)
    self.task = exp.task
    self.eval_problems = _eval_problems(self.task, exp.eval.num_problems)
    self.meshes = build_meshes(exp.placement)
    if not self.meshes.on_every_process and exp.sync.every_n_steps > 1:
      raise UserError("placement: with the trainer and the rollout on different processes "
                      "each sync must follow its step (the rollout's lagging weights live "
                      "where nothing is checkpointed): SyncConfig.every_n_steps = 1, got "
                      f"{exp.sync.every_n_steps}")
    self.trainer = Trainer(self.model_cfg, exp.trainer, mesh=self.meshes.trainer)
    self.prompts = PromptStream(self.task.split("train"), self.tokenizer, exp.prompts,
                                seed=exp.seed)
    self.sampling = SamplingParams(exp.rollout.temperature, exp.rollout.top_k,
                                   exp.rollout.top_p, exp.rollout.max_new_tokens,
                                   self.tokenizer.stop_ids)
    self.checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), exp.checkpoint,
                                     holders=self.meshes.trainer)
    self._initial_params = params
    self._step = 0  # The last step run: labels eval calls in the dead-letter file.
    self._train_step_plan = None  # train_step_plan(), compiled on first use.
    # Started last (workers come up while the run restores or warms up). Each process
    # scores its share of the samples (pipeline/agreement.py), so each records its own
    # failed calls; process 0 alone writes the other files but checkpoints.
    self.dead_letter = os.path.join(workdir, dead_letter_name(jax.process_index()))
    self.pool = self._verifier_pool()

  def _verifier_pool(self) -> Optional[VerifierPool]:
    """The run's verifier workers (None: its rewards come from elsewhere)."""
    exp = self.exp
    return VerifierPool(self.task, workers=exp.reward.workers, timeout_s=exp.reward.timeout_s,
                        processes=exp.reward.processes, dead_letter=self.dead_letter)

  # ------------------------------------------------------------------ start

  def start(self) -> Progress:
    """Restores the newest checkpoint, or warms up (the caller then saves step 0)."""
    latest = self.checkpointer.latest_step()
    if latest is None:
      progress = Progress()
      params = self._warm_up(self.trainer.place(self._initial_params), progress)
      self.state, self.ref = self.trainer.init_state(params), self._reference(params)
    else:
      progress = self._restore(latest)
    self._initial_params = None  # From here the train state and the reference hold weights.
    self._build_rollout(meta_version=progress.counters.get("weight_version", 0),
                        restored_step=latest)
    return progress

  def _warm_up(self, params: dict, progress: Progress) -> dict:
    """The parameters after the supervised warm-up (unchanged when it has no steps)."""
    if not self.exp.sft.steps:
      return params
    params, metrics = warm_up(self.model_cfg, params, self.task, self.tokenizer,
                              self.exp.sft, self.exp.prompts, self._completion_budget(),
                              self.exp.seed, self.log, mesh=self.meshes.trainer,
                              script=self._warm_up_script())
    progress.counters.update(metrics)  # Step 0's metrics: sft/final_loss, sft/steps, ...
    return params

  def _restore(self, step: int) -> Progress:
    # The initial weights give the restore targets their structure and shardings.
    state = self.trainer.init_state(self._initial_params)
    ref = self._reference(self._initial_params)
    abstract_ref = None if ref is None else abstract_like(ref)
    self.state, self.ref, meta = self.checkpointer.restore(step, abstract_like(state),
                                                           abstract_ref)
    self.prompts.set_state(meta["prompts"])
    self.log(f"resumed from {self.checkpointer.directory}/{step} (step {meta['step']})")
    return Progress(meta["step"], meta["eval_history"], meta["counters"])

  def _completion_budget(self) -> int:
    """Most tokens after a prompt (a multi-turn run's episodes hold several turns)."""
    return self.exp.rollout.max_new_tokens

  def _warm_up_script(self):
    """Multi-turn examples for the warm-up (None: the task's reference answers)."""
    return None

  def _reference(self, params):
    """Frozen reference weights on the training mesh, in ReferenceSpec.dtype (None with
    LoRA: the base is it). A copy: the train state's steps donate their own buffers."""
    if self.trainer.lora:
      return None
    dtype = jnp.dtype(self.exp.reference.dtype)
    return self.trainer.place(jax.tree.map(lambda x: jnp.asarray(x, dtype), params))

  def _build_rollout(self, meta_version: int, restored_step: Optional[int]) -> None:
    model = abstract_model(self.model_cfg)
    full = self.trainer.full_params(self.state)
    # The sync writes the engine's form, so the engine's weights are the sync's output.
    form = weights.engine_form(self.model_cfg, self.meshes.rollout,
                               self.exp.rollout.engine.split_layers)
    if self.trainer.lora:  # The engine runs base + adapters; only the adapters move.
      self.sync = PartialSync(self.meshes, logical_axes(model), full, self.exp.sync,
                              moves=is_adapter, form=form)
    else:
      self.sync = WeightSync(self.meshes, logical_axes(model), full, self.exp.sync, form=form)
    rollout = self.sync.initial(full)
    if restored_step is not None:  # Saved when they may lag the train state (`save`).
      moving = self.sync.moving(rollout.params)
      saved = self.checkpointer.restore_rollout(restored_step, abstract_like(moving))
      if saved is not None:
        rollout = dataclasses.replace(rollout,
                                      params=self.sync.with_moving(rollout.params, saved))
    self.rollout = dataclasses.replace(rollout, version=meta_version)
    self.engine = Engine(self.model_cfg, self.rollout.params, self._engine_config(),
                         version=self.rollout.version, mesh=self.meshes.rollout)
    if self.engine.cascade_refused:
      self.log(f"rollout: no cascade attention: {self.engine.cascade_refused}; each sample "
               "reads its prompt's pages itself")

  def _engine_config(self) -> EngineConfig:
    """The engine's shapes, with the pool sized after the train step where it must be.

    Colocated on a device that reports its memory, a pool sized by memory_fraction takes
    that share of what is free once the train step's own peak (compiled on abstract
    inputs: activations, gradients, outputs) is set aside, so training never runs short
    beside a pool that lives for the whole run. The rollout weight versions an
    asynchronous run keeps alive beside the engine's are set aside too, colocated or not:
    they are made after the pool (pipelined.versions_in_flight).
    """
    exp, cfg = self.exp, self.exp.rollout.engine
    longest = exp.prompts.max_prompt_tokens + self._completion_budget()
    if cfg.max_seq_len is None:
      cfg = dataclasses.replace(cfg, max_seq_len=longest)
    pool, copies = cfg.pool, self._rollout_versions_in_flight()
    if (pool.num_pages is not None or pool.memory_bytes is not None
        or not (self.meshes.colocated or copies)):
      return cfg
    local = [d for d in self.meshes.rollout.devices.flat if d.process_index == jax.process_index()]
    if not local or free_device_bytes(local[0]) is None:  # Stats exist only for local devices.
      return cfg
    reserved = copies * plan.rollout_bytes(self.model_cfg, self.meshes.rollout,
                                           exp.sync.rollout_dtype)
    if copies:
      self.log(f"kv pool: {reserved / 1e9:.2f} GB left to {copies} more rollout weight "
               "versions held in flight")
    if self.meshes.colocated:
      step = self.train_step_plan()
      self.log(f"kv pool: {pool.memory_fraction:.2f} of the memory free beside the weights, "
               f"{step.transient_bytes / 1e9:.2f} GB left to a train step peaking at "
               f"{step.peak_bytes / 1e9:.2f} GB")
      reserved += step.transient_bytes
    # The engine sizes the pool once its own weights are in place (rollout.pages.pool_pages,
    # the rule the planner predicts with).
    return dataclasses.replace(cfg, pool=dataclasses.replace(
        pool, reserved_bytes=pool.reserved_bytes + reserved))

  def _rollout_versions_in_flight(self) -> int:
    """Rollout weight copies alive beside the engine's one at most (none here: each sync
    writes the new weights into the old ones' buffers)."""
    return 0

  def train_step_plan(self):
    """The train step compiled on abstract inputs of the largest micro-batch (its memory
    analysis sizes the KV pool and goes into the run's telemetry); compiled once."""
    if self._train_step_plan is None:
      exp = self.exp
      longest = exp.prompts.max_prompt_tokens + self._completion_budget()
      rows, sequences = plan.micro_batch_shape(self._per_micro(), longest,
                                               exp.trainer.row_tokens, self.trainer.batch_shards)
      self._train_step_plan = plan.train_step_memory(
          self.model_cfg, exp.trainer, self.meshes.trainer, rows=rows,
          completion_len=completion_bucket(self._completion_budget()),
          micro_batches=exp.trainer.micro_batches, sequences=sequences,
          reference_dtype=exp.reference.dtype)
    return self._train_step_plan

  def _per_micro(self) -> int:
    """Trajectories per micro-batch."""
    exp = self.exp
    return (exp.rollout.prompts_per_step * exp.rollout.group_size //
            (exp.trainer.minibatches * exp.trainer.micro_batches))

  # ------------------------------------------------------------------ one step

  def step(self, step: int, timer: StepTimer) -> dict[str, Any]:
    exp, k = self.exp, self.exp.rollout.group_size
    self._step = step
    batch, drawn, metrics = self._sample(step, timer)  # Timed as rollout and reward.
    metrics.update(rollouts.rollout_metrics(drawn.groups, drawn.seconds))
    rewards, shaping = _shape_rewards(batch, exp.overlong)
    trajs, behaviour = self._trajectories(batch.groups)
    with timer.role("advantage"):  # Group statistics of the whole batch, left on the device.
      scores = self._scores(rewards)
    with timer.role("pack"):  # Each micro-batch packed once; one transfer to the devices.
      batches = pack_rollouts(self.trainer, trajs, behaviour)
    with timer.role("train"):  # Per minibatch one program: reference, loss, update, metrics.
      self.state, history = self.trainer.update(self.state, batches, scores, self.ref)
    self._beside_train()  # Launched: the host is free until the metrics are fetched.
    with timer.role("train"):
      history = fetch_metrics(history, self.meshes.trainer)  # The step's one wait.
    with timer.role("sync"):
      metrics.update(self._sync(step))
    metrics.update(_train_metrics(history), **batch.stats.as_metrics(), **shaping)
    metrics.update(rollout_batch_metrics(drawn.rewards, k))
    metrics.update({"reward/std": float(np.std(drawn.rewards)),
                    "weight_version": self.rollout.version,
                    "train/tokens": sum(len(t.prompt) + len(t.completion) for t in trajs)})
    return metrics

  def _beside_train(self) -> None:
    """Host work while the step's update runs on the devices (asynchronous runs)."""

  def _trajectories(self, groups) -> tuple[list, list]:
    """The trainer's trajectories and behaviour logprobs, groups of K contiguous."""
    return rollouts.flatten(groups)

  def _sample(self, step: int, timer: StepTimer) -> tuple[dynamic.Drawn, dynamic.Drawn, dict]:
    """The step's batch: drawn here (an asynchronous run takes it from its rollout
    thread instead, which draws it with `sample_batch`)."""
    return self.sample_batch(step, timer)

  def sample_batch(self, step: int,
                   timer: StepTimer) -> tuple[dynamic.Drawn, dynamic.Drawn, dict]:
    """(training batch, every group drawn, counts): one rollout round, or with dynamic
    sampling as many as it takes to replace the groups whose rewards do not vary."""
    draw = lambda round_: self._draw(step, round_, timer)
    spec = self.exp.dynamic_sampling
    if spec is None:
      batch = draw(0)
      return batch, batch, {}
    return dynamic.refill(draw, self.exp.rollout.prompts_per_step, self.exp.rollout.group_size,
                          spec)

  def _draw(self, step: int, round_: int, timer: StepTimer) -> dynamic.Drawn:
    """One rollout round: the next prompts, K samples each, scored as groups finish."""
    exp = self.exp
    problems, prompt_ids = self.prompts.next_batch(exp.rollout.prompts_per_step)
    tag = "train" if round_ == 0 else f"train/refill{round_}"  # Pool keys never collide.
    scoring = rollouts.Scoring(self.pool, self.tokenizer, tag, step)
    with timer.role("rollout"):  # Each finished group goes to the verifiers meanwhile.
      t0 = time.perf_counter()
      groups = rollouts.sample_groups(self.engine, problems, prompt_ids, exp.rollout.group_size,
                                      self.sampling, exp.rollout.scheduler,
                                      dynamic.round_seed(exp.seed, round_), step,
                                      on_group=scoring.submit,
                                      between_calls=self._between_decode_calls)
      seconds = time.perf_counter() - t0
    with timer.role("reward"):  # Only the calls still running once decoding is done.
      rewards, stats = scoring.results(groups)
    return dynamic.Drawn(groups, rewards, stats, seconds)

  def _between_decode_calls(self) -> None:
    """Runs between two decode calls of a training batch: nothing here (the synchronous
    loop syncs between batches); the asynchronous driver swaps in newer weights."""

  def _scores(self, rewards: np.ndarray) -> SequenceScores:
    """What the trainer's programs read per sequence. With a critic (PPO) the rewards
    alone: each minibatch's program puts them on the last tokens and runs GAE over its
    old values on the device; otherwise the group advantages of the whole batch."""
    if self.trainer.value_head:
      return SequenceScores.of(len(rewards), rewards=rewards)
    return SequenceScores(sequence_advantages(rewards, self.exp.advantage), rewards)

  def _sync(self, step: int) -> dict[str, int]:
    """Syncs when due; the bytes moved (the adapters alone with LoRA)."""
    if not self.sync.due(step):
      return {"sync/bytes": 0}
    self.rollout = self.sync(self.trainer.full_params(self.state), self.rollout)
    self.engine.set_weights(self.rollout.params, self.rollout.version)
    jax.block_until_ready(self.rollout.params)
    return {"sync/bytes": self.sync.bytes_per_sync}

  def evaluate(self) -> dict[str, float]:
    spec = self.exp.eval
    return rollouts.evaluate(self.engine, self.tokenizer, self.task, self.eval_problems,
                             self.exp.prompts, self.exp.rollout.max_new_tokens,
                             self.exp.rollout.scheduler, pool=self.pool, step=self._step,
                             samples=spec.samples, temperature=spec.temperature)

  # ------------------------------------------------------------------ checkpoints

  def save(self, progress: Progress) -> None:
    meta = {"step": progress.step, "eval_history": progress.eval_history,
            "counters": progress.counters | {"weight_version": self.rollout.version},
            "prompts": self.prompts.get_state()}
    # With a sync every N > 1 steps the engine may sample with older weights than the
    # train state's: those are saved too, so a resumed run samples what this one would.
    lagging = self.exp.sync.every_n_steps > 1
    rollout = self.sync.moving(self.rollout.params) if lagging else None  # LoRA: adapters
    self.checkpointer.save(progress.step, self.state, meta, self.ref, rollout=rollout)

  def close(self) -> None:
    try:
      if self.pool is not None:
        self.pool.close()
    finally:
      self.checkpointer.close()


def _shape_rewards(batch: dynamic.Drawn, overlong: Optional[OverlongConfig]
                   ) -> tuple[np.ndarray, dict[str, float]]:
  """The rewards the advantages see: DAPO's soft overlong penalty added to the verifier's
  (whose own scores stay in reward/mean, comparable across algorithms)."""
  if overlong is None:
    return batch.rewards, {}
  lengths = np.array([len(c.tokens) for g in batch.groups for c in g.completions])
  penalty = np.asarray(overlong_penalty(lengths, overlong), np.float32)
  shaped = batch.rewards + penalty
  return shaped, {"dapo/overlong_frac": float(np.mean(penalty < 0)),
                  "dapo/overlong_penalty_mean": float(np.mean(penalty)),
                  "dapo/train_reward_mean": float(np.mean(shaped))}


def _eval_problems(task, num: int) -> list:
  split = task.split("eval")
  if len(split) == 0:
    raise UserError("the task's eval split is empty")
  return [split[i] for i in range(min(num, len(split)))]


def _train_metrics(history: list[dict]) -> dict[str, Any]:
  """Scalars averaged over the step's optimizer steps; histograms from the last one."""
  out: dict[str, Any] = {}
  for name in history[0]:
    values = [h[name] for h in history]
    if isinstance(values[0], list):
      out[f"train/{name}"] = values[-1]
    else:
      out[f"train/{name}"] = float(np.mean(values))
  return out


def dead_letter_name(process: int) -> str:
  """The failed verifier calls of one process's samples."""
  return "dead_letter.jsonl" if process == 0 else f"dead_letter.process{process}.jsonl"


def run(exp: Experiment, workdir: str, log=print, run_cls=None) -> dict[str, Any]:
  """Runs (or resumes) the experiment to its last step; returns the summary.

  run_cls: the run's class: RLRun (synchronous), or pipelined.AsyncRLRun, which draws the
  batches ahead of training under a staleness bound.
  """
  started = time.time()
  run_ = (run_cls or RLRun)(exp, workdir, log)
  progress = run_.start()
  first = jax.process_index() == 0  # Process 0 writes the run's files for every process.
  fresh = not progress.eval_history  # No checkpoint: lines of a killed attempt are stale.
  writer = (with_trackers(MetricsWriter(workdir, tensorboard=exp.logging.tensorboard),
                          exp.logging, workdir, fresh) if first else DiscardMetrics())
  writer.truncate_after(-1 if fresh else progress.step)
  truncate_jsonl(run_.dead_letter, -1 if fresh else progress.step)  # This process's own.
  telemetry = None
  try:
    telemetry = RunTelemetry(run_, workdir, progress.step, log, writes=first)
    if fresh:
      _record_eval(run_, progress, writer, extra=progress.counters)
      run_.save(progress)
    with CompileCounter() as compiles:
      _loop(run_, progress, writer, compiles, telemetry)
  finally:
    if telemetry is not None:
      telemetry.close()
    writer.close()
    run_.close()
  summary = _summary(progress, time.time() - started)
  log(summary["message"])
  if first:
    summary["report"] = write_report(workdir, log)
  return summary


def _loop(run_: RLRun, progress: Progress, writer: MetricsWriter,
          compiles: CompileCounter, telemetry: RunTelemetry) -> None:
  exp = run_.exp
  show = exp.logging.progress and jax.process_index() == 0
  bar = ProgressBar(exp.steps, progress.step) if show else None
  timer = StepTimer()
  seen, loaded = compiles.total, compiles.cache_hits
  for step in range(progress.step + 1, exp.steps + 1):
    telemetry.begin(step)
    timer.start()
    metrics = run_.step(step, timer)
    metrics.update(timer.stop())
    progress.step = step
    if step == exp.steps or (exp.eval.every_n_steps and step % exp.eval.every_n_steps == 0):
      metrics.update(_evaluate(run_, progress))
    metrics.update(_counters(run_))
    before, seen = seen, compiles.total
    loaded_before, loaded = loaded, compiles.cache_hits
    metrics.update({"compile/programs": seen, "compile/new_programs": seen - before,
                    "compile/cached_programs": loaded - loaded_before})
    metrics.update(telemetry.end(step, timer, metrics))  # Memory, MFU, alarms, trace.
    writer.write(step, metrics)
    if bar:
      bar.update(step, metrics["reward/mean"], metrics["rollout/tokens_per_s"])
    if step % exp.checkpoint.every_n_steps == 0 or step == exp.steps:
      run_.save(progress)
  if bar:
    bar.close()


def _evaluate(run_: RLRun, progress: Progress) -> dict[str, float]:
  out = run_.evaluate()
  progress.eval_history.append([progress.step, out["eval/accuracy"]])
  return out


def _record_eval(run_: RLRun, progress: Progress, writer: MetricsWriter, extra: dict) -> None:
  metrics = _evaluate(run_, progress)
  writer.write(0, metrics | {k: v for k, v in extra.items() if k.startswith("sft/")})
  run_.log(f"step 0: held-out accuracy {metrics['eval/accuracy']:.3f}")


def _counters(run_: RLRun) -> dict[str, int]:
  out = {f"data/{k}": v for k, v in run_.prompts.counts.items()}
  out.update({f"data/skipped_rows/{k}": v for k, v in run_.task.skipped.items()})
  return out


def _summary(progress: Progress, seconds: float) -> dict[str, Any]:
  first, last = progress.eval_history[0], progress.eval_history[-1]
  message = (f"held-out accuracy: {first[1]:.3f} at step {first[0]} -> {last[1]:.3f} at step "
             f"{last[0]} (wall time {format_duration(seconds)} in this process)")
  return {"start_accuracy": first[1], "end_accuracy": last[1], "steps": progress.step,
          "seconds": seconds, "message": message}
