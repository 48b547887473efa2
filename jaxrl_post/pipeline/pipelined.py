"""Asynchronous RL: rollouts drawn ahead of training under a staleness bound.

The synchronous loop (pipeline/loop.py) draws step t's batch with the weights of step
t - 1, so the trainer waits for every rollout and the engine idles through every update.
Here a rollout thread draws the batches of later steps while the trainer trains on the
current one: step t's batch comes from the weights of version t - 1 - lag (the trainer's
weights after step t - 1 - lag), so at most `lag` batches are in flight or queued, and
every token's weights are exactly lag RL steps (lag x minibatches optimizer steps) behind
the weights that train on it. The loss corrects with the configured off-policy weights
(TIS or sequence masking) against the behaviour logprobs the engine recorded.

  mode            lag                                   staleness (optimizer steps)
  sync            0 (the synchronous loop itself)       0 .. minibatches - 1
  one_step_off    1                                     + minibatches
  bounded         max_staleness // minibatches          <= max_staleness

With AsyncSpec.weight_updates = "in_flight" the thread also takes newer weights between two
decode calls of the batch it draws: running sequences go on with the new weights, each
token stamped with its version, and staleness is counted per token. Otherwise (the
default) which weights draw which batch is fixed by the step, not by timing, so an
asynchronous run samples the same tokens however fast each side is. Either way it resumes
with no batch lost or trained twice: a checkpoint after step s waits for the batches of
steps s + 1 .. s + lag (they need no weights newer than s - 1), saves them and the prompt
stream's position beside the train state, and only then releases step s to the rollout
thread (step s + 1 + lag, the first that reads past the saved position, waits for it).
A restarted run trains on the saved batches and draws the rest with the restored weights.

A batch whose tokens are staler than the bound (by construction none is; the check guards
the invariant) is never trained on: it is dropped, its groups counted in
async/dropped_groups, and the trainer draws the step's batch again itself, with the newest
weights (version step - 1, the synchronous loop's: within every bound), the same prompts
round by round and the same seeds. The redraw is a function of the step as the dropped
batch was, so a resumed run redraws what the uninterrupted one did, and it leaves the
prompt stream, which the thread reads ahead, where it was.

The engine gets new weights between decode calls (Engine.set_weights: launched calls keep
the weights they were launched with, and the prefix cache is cleared, so no cached K/V
crosses versions); each version is a fresh copy, never donated while the engine may read it.
So up to lag + 2 rollout copies are alive at once, lag + 1 more than the synchronous
loop's one (`versions_in_flight`): the KV pool is sized with their bytes set aside, and the
planner counts them. Evaluation borrows the engine between batches, with the trainer's
newest weights.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from jaxrl_post.envs import Environment
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import dynamic, rollouts
from jaxrl_post.pipeline.agent import AgentRLRun
from jaxrl_post.pipeline.loop import Progress, RLRun
from jaxrl_post.sharding import RolloutWeights
from jaxrl_post.telemetry import StepTimer

@dataclasses.dataclass
class _Drawn:
  """One step's batch as the rollout thread leaves it (picklable: saved in checkpoints)."""

  step: int
  version: int  # the weights that drew it
  batch: Any  # dynamic.Drawn used for training
  drawn: Any  # every group drawn (DAPO's refills included)
  metrics: dict
  seconds: float  # the thread's wall time drawing it


class _Ahead:
  """The rollout thread: draws step t's batch once step t - 1 - lag is trained and
  released (its checkpoint, if any, written), with version t - 1 - lag: while the trainer
  trains step r + 1, batches r + 2 .. r + 1 + lag may be drawn. Counting releases, not
  versions, bounds the queue to lag batches also where the version clamps at 0."""

  def __init__(self, run: "AsyncRLRun", next_step: int, last_step: int, floor: int = 0):
    self.run, self.next_step, self.last_step = run, next_step, last_step
    self.floor = floor  # the oldest version this process can publish (see AsyncRLRun.start)
    self.cond = threading.Condition()
    self.engine_lock = threading.Lock()
    self.ready: dict[int, _Drawn] = {}
    self.weights: dict[int, Any] = {}
    self.released = next_step - 1  # steps trained whose batches may be drawn past
    self.error: Optional[BaseException] = None
    self.closed = False
    self.idle_s = 0.0  # time waiting for weights (rollout idle)
    self.swaps = 0  # in-flight weight updates in the batch being drawn
    self.thread = threading.Thread(target=self._work, name="rollout-ahead", daemon=True)

  def need(self, step: int) -> int:
    return max(step - 1 - self.run.lag, self.floor)

  def publish(self, version: int, params) -> None:
    """Version `version` (the weights after RL step `version`) may draw, and the thread
    may run `lag` steps past that step."""
    with self.cond:
      self.weights[version] = params
      self.released = max(self.released, version)
      for old in [v for v in self.weights if v < self.need(self.next_step) and v != version]:
        del self.weights[old]  # No batch still to draw reads it.
      self.cond.notify_all()

  def newest(self) -> tuple[int, Any]:
    """The newest published version and its weights."""
    with self.cond:
      version = max(self.weights)
      return version, self.weights[version]

  def take(self, step: int) -> _Drawn:
    with self.cond:
      self.cond.wait_for(lambda: step in self.ready or self.error is not None)
      self._raise()
      return self.ready.pop(step)

  def wait_drawn(self, step: int) -> list[_Drawn]:
    """Blocks until every batch up to `step` is drawn; the queued ones, in step order."""
    with self.cond:
      self.cond.wait_for(lambda: self.next_step > min(step, self.last_step)
                         or self.error is not None)
      self._raise()
      return [self.ready[t] for t in sorted(self.ready)]

  def queue_depth(self) -> int:
    with self.cond:
      return len(self.ready)

  def start(self) -> None:
    self.thread.start()

  def fill(self) -> None:
    """Draws what may be drawn now: the thread does, on its own."""

  def close(self) -> None:
    with self.cond:
      self.closed = True
      self.cond.notify_all()
    if self.thread.is_alive():
      self.thread.join(timeout=600)

  def _raise(self) -> None:
    if self.error is not None:
      raise RuntimeError("the rollout thread failed") from self.error

  def _work(self) -> None:
    try:
      while self.next_step <= self.last_step:
        t = self.next_step
        t0 = time.perf_counter()
        with self.cond:
          self.cond.wait_for(lambda: (t - 1 - self.run.lag <= self.released
                                      and self.need(t) in self.weights) or self.closed)
          if self.closed:
            return
          params = self.weights[self.need(t)]
        self.idle_s += time.perf_counter() - t0
        item = self._draw(t, params)
        with self.cond:
          self.ready[t] = item
          self.next_step = t + 1
          self.cond.notify_all()
    except BaseException as e:  # Surfaces in the trainer's thread, at its next take.
      with self.cond:
        self.error = e
        self.cond.notify_all()

  def _draw(self, step: int, params) -> _Drawn:
    version = self.need(step)
    timer = StepTimer()
    with self.engine_lock:
      engine = self.run.engine
      if engine.version != version:  # Versions name weights: one number, one copy.
        engine.set_weights(params, version)
      timer.start()
      self.swaps = 0
      batch, drawn, metrics = self.run.sample_batch(step, timer)
      metrics["async/weight_swaps"] = self.swaps  # In-flight updates within this batch.
      roles = timer.stop()
    return _Drawn(step, version, batch, drawn, metrics, roles["time/step"])


class _Inline(_Ahead):
  """The batches drawn ahead in the trainer's own thread, for a run over several processes.

  Every program with cross-process collectives (rollout, scoring, sync, training) must be
  launched in the same order on every process, which two threads would not keep. Here a
  step launches its update, draws every batch the published weights allow while the
  devices train (on a split placement the rollout devices work meanwhile: `fill`), and then
  waits for the update. Which weights draw which batch is the thread's function of the
  step, so the run writes the metrics of the one-process run on the same seed.
  """

  def start(self) -> None:
    pass

  def _drawable(self, t: int) -> bool:
    return (t <= self.last_step and t - 1 - self.run.lag <= self.released
            and self.need(t) in self.weights)

  def fill(self) -> None:
    while self._drawable(self.next_step):
      t = self.next_step
      self.ready[t] = self._draw(t, self.weights[self.need(t)])
      self.next_step = t + 1

  def take(self, step: int) -> _Drawn:
    self.fill()
    if step not in self.ready:  # The schedule always drew it by now.
      raise RuntimeError(f"async: step {step}'s batch was not drawn (next to draw: "
                         f"{self.next_step}, released: {self.released})")
    return self.ready.pop(step)

  def wait_drawn(self, step: int) -> list[_Drawn]:
    self.fill()
    return [self.ready[t] for t in sorted(self.ready)]

  def close(self) -> None:
    self.closed = True


class AsyncRLRun(RLRun):
  """RLRun whose batches come from the rollout thread (see the module docstring)."""

  def __init__(self, exp, workdir: str, log=print):
    if exp.sync.every_n_steps != 1:
      raise UserError("async spec: asynchronous modes sync the weights every step "
                      f"(SyncConfig.every_n_steps = 1), got {exp.sync.every_n_steps}")
    spec = exp.asynchronous
    check_processes(spec, jax.process_count())
    super().__init__(exp, workdir, log)
    self.lag = spec.lag(exp.trainer.minibatches)
    self.max_staleness = (spec.max_staleness if spec.mode == "bounded"
                          else self.lag * exp.trainer.minibatches)
    self.in_flight = spec.weight_updates == "in_flight"
    self.ahead: Optional[_Ahead] = None
    self.counters = {"async/dropped_groups": 0}

  # ------------------------------------------------------------------ start / stop

  def start(self) -> Progress:
    resuming = self.checkpointer.latest_step() is not None
    progress = super().start()
    self.counters.update({k: progress.counters[k] for k in self.counters
                          if k in progress.counters})  # Counts before the restart.
    queued = self._load_queue(progress.step) if resuming else []
    first = progress.step + 1 + len(queued)
    # A resume after a kill finds the steps up to progress.step + lag queued, so the first
    # to draw needs the restored weights. A finished run extended to more steps saved
    # fewer (none past its last step): those draw with the restored weights too, the
    # oldest this process has (an uninterrupted longer run would have drawn them older).
    drawer = _Ahead if jax.process_count() == 1 else _Inline
    self.ahead = drawer(self, first, self.exp.steps, floor=progress.step)
    self.ahead.ready.update({d.step: d for d in queued})
    self.ahead.publish(self.rollout.version, self.rollout.params)
    # The restored checkpoint released its step. A fresh run saves its step-0 checkpoint
    # (the prompt stream's position included) after the first evaluation: until that save
    # releases step 0, the thread draws only the batches the checkpoint queues.
    self.ahead.released = progress.step if resuming else progress.step - 1
    self.ahead.start()
    return progress

  def close(self) -> None:
    try:
      if self.ahead is not None:
        self.ahead.close()
    finally:
      super().close()

  # ------------------------------------------------------------------ the step's roles

  def _sample(self, step: int, timer):
    with timer.role("wait_data"):
      item = self.ahead.take(step)
    batch, drawn, metrics = item.batch, item.drawn, dict(item.metrics)
    hist = self._staleness_hist(step, batch.groups)
    if len(hist) > self.max_staleness + 1:  # Never trained on (the schedule makes none).
      self.counters["async/dropped_groups"] += len(batch.groups)
      self.log(f"async: step {step}'s batch has tokens {len(hist) - 1} optimizer steps "
               f"stale, over max_staleness={self.max_staleness}: dropped, drawn again")
      batch, drawn, metrics = self._redraw(step, item, timer)
      hist = self._staleness_hist(step, batch.groups)
      if len(hist) > self.max_staleness + 1:
        raise RuntimeError(f"async: step {step}'s redrawn batch is {len(hist) - 1} "
                           f"optimizer steps stale, over max_staleness={self.max_staleness}")
    staleness = max(i for i, n in enumerate(hist) if n) if any(hist) else 0
    queued = self.ahead.queue_depth()
    metrics.update({"async/staleness": staleness, "async/staleness_hist": hist,
                    "async/lag_steps": self.lag, "async/rollout_s": item.seconds,
                    "async/queue_depth": queued,
                    "async/queued_groups": queued * self.exp.rollout.prompts_per_step,
                    "async/rollout_idle_s": self.ahead.idle_s, **self.counters})
    self.ahead.idle_s = 0.0
    return batch, drawn, metrics

  def _redraw(self, step: int, dropped: _Drawn, timer):
    """Step `step`'s batch drawn again here, with the newest weights (see the module
    docstring): each round the dropped batch drew, its prompts and seeds again. Dynamic
    sampling may take as many rounds as the dropped batch did, no more: further prompts
    would come from the stream, where the thread has read on."""
    p = self.exp.rollout.prompts_per_step
    groups = dropped.drawn.groups
    rounds = [groups[i:i + p] for i in range(0, len(groups), p)]
    draw = lambda round_: self._draw_again(step, round_, rounds[round_], timer)
    spec = self.exp.dynamic_sampling
    with self.ahead.engine_lock:  # Between two batches; the thread resets its weights.
      self.engine.set_weights(self.rollout.params, self.rollout.version)
      if spec is None:
        batch = draw(0)
        return batch, batch, {"async/weight_swaps": 0}
      batch, drawn, counts = dynamic.refill(
          draw, p, self.exp.rollout.group_size,
          dataclasses.replace(spec, max_extra_rounds=len(rounds) - 1))
    return batch, drawn, {**counts, "async/weight_swaps": 0}

  def _draw_again(self, step: int, round_: int, groups, timer) -> dynamic.Drawn:
    """Rollout round `round_` of a redraw: RLRun._draw on the prompts of `groups`, not
    the stream's next ones (scored under their own tag: no key meets the dropped one's)."""
    exp = self.exp
    scoring = rollouts.Scoring(self.pool, self.tokenizer, f"train/redraw{round_}", step)
    with timer.role("rollout"):
      t0 = time.perf_counter()
      fresh = rollouts.sample_groups(self.engine, [g.problem for g in groups],
                                     [g.prompt for g in groups], exp.rollout.group_size,
                                     self.sampling, exp.rollout.scheduler,
                                     dynamic.round_seed(exp.seed, round_), step,
                                     on_group=scoring.submit)
      seconds = time.perf_counter() - t0
    with timer.role("reward"):
      rewards, stats = scoring.results(fresh)
    return dynamic.Drawn(fresh, rewards, stats, seconds)

  def _staleness_hist(self, step: int, groups) -> list[int]:
    """Completion tokens per staleness in optimizer steps: between the weights that
    produced a token and the old policy of step `step` (version step - 1)."""
    versions = np.concatenate([np.asarray(c.versions, np.int64) for g in groups
                               for c in g.completions])
    ages = (step - 1 - versions) * self.exp.trainer.minibatches
    return np.bincount(ages, minlength=self.max_staleness + 1).tolist()

  def _beside_train(self) -> None:
    """While the step's update runs: across processes, the batches drawn in this thread."""
    self.ahead.fill()

  def _between_decode_calls(self) -> None:
    """In-flight updates: the rollout thread takes the newest published weights between two
    decode calls (never newer than step - 1 for the step it draws: the trainer has not
    trained that step yet, so none is published)."""
    if not self.in_flight or threading.current_thread() is not self.ahead.thread:
      return
    version, params = self.ahead.newest()
    if version > self.engine.version:
      self.engine.set_weights(params, version)
      self.ahead.swaps += 1

  def _sync(self, step: int) -> dict[str, int]:
    """A fresh rollout copy of the new weights (the engine may still read the old one);
    handed to the rollout thread now, or once this step's checkpoint is written."""
    fresh = self.sync.initial(self.trainer.full_params(self.state))
    self.rollout = RolloutWeights(fresh.params, self.rollout.version + 1)
    jax.block_until_ready(self.rollout.params)
    if not self._saves_after(step):  # Else `save` releases the step once it is written.
      self.ahead.publish(self.rollout.version, self.rollout.params)
    return {"sync/bytes": self.sync.bytes_per_sync}

  def _rollout_versions_in_flight(self) -> int:
    return versions_in_flight(self.exp)

  def _saves_after(self, step: int) -> bool:
    return step % self.exp.checkpoint.every_n_steps == 0 or step == self.exp.steps

  def evaluate(self) -> dict[str, float]:
    with self.ahead.engine_lock:  # Between two batches; the thread resets its weights.
      self.engine.set_weights(self.rollout.params, self.rollout.version)
      return super().evaluate()

  # ------------------------------------------------------------------ checkpoints

  def save(self, progress: Progress) -> None:
    progress.counters.update(self.counters)
    queued = self.ahead.wait_drawn(progress.step + self.lag) if self.ahead else []
    if jax.process_index() == 0:
      self._write_queue(progress.step, queued)
    super().save(progress)  # Returns with the checkpoints before this one complete on disk.
    if jax.process_index() == 0:
      self._drop_old_queues(progress.step)
    if self.ahead is not None:
      self.ahead.publish(self.rollout.version, self.rollout.params)

  def _queue_path(self, step: int) -> str:
    return os.path.join(self.workdir, "checkpoints", f"queue_{step}.pkl")

  def _write_queue(self, step: int, queued: list[_Drawn]) -> None:
    """The drawn batches not yet trained on, beside checkpoint `step` (written first and
    renamed into place, so a checkpoint never has a partial queue)."""
    path = self._queue_path(step)
    with open(path + ".tmp", "wb") as f:
      pickle.dump({"step": step, "lag": self.lag, "batches": queued}, f)
    os.replace(path + ".tmp", path)

  def _drop_old_queues(self, step: int) -> None:
    """Removes the queues of checkpoints Orbax dropped. Only once the checkpoints before
    `step` are complete: one still being written has no folder of its own yet."""
    folder = os.path.dirname(self._queue_path(step))
    for name in os.listdir(folder):
      if name.startswith("queue_") and name.endswith(".pkl"):
        old = int(name[len("queue_"):-len(".pkl")])
        if old < step and not os.path.isdir(os.path.join(folder, str(old))):
          os.remove(os.path.join(folder, name))

  def _load_queue(self, step: int) -> list[_Drawn]:
    path = self._queue_path(step)
    if not os.path.exists(path):
      raise UserError(f"{path}: checkpoint {step} has no saved rollout queue; an "
                      "asynchronous run resumes only from its own checkpoints")
    try:
      with open(path, "rb") as f:
        saved = pickle.load(f)
    except Exception as e:  # Cut short or overwritten: unpickling fails in many ways.
      raise UserError(f"{path}: the rollout queue of checkpoint {step} cannot be read "
                      f"({type(e).__name__}: {e}); move checkpoint {step} and this file "
                      "away to resume from an earlier one") from e
    if saved["lag"] != self.lag:
      raise UserError(f"{path}: saved with lag {saved['lag']}, this run's is {self.lag} "
                      "(AsyncSpec changed)")
    return saved["batches"]


def check_processes(spec, processes: int) -> None:
  """Across processes the batches are drawn at fixed points of the step (_Inline): weights
  taken mid-batch whenever the trainer has them would differ between processes."""
  if processes > 1 and spec.weight_updates == "in_flight":
    raise UserError(f"async spec: weight_updates = 'in_flight' runs in one process (this "
                    f"job has {processes}); use 'between_batches' across hosts")


def versions_in_flight(exp) -> int:
  """Rollout weight copies the run holds at most beside the one a synchronous run holds.

  While `_sync` makes version v, a fresh copy (the engine may still read the old one), the
  versions v - 1 - lag .. v - 1 may all be alive: `publish` keeps the ones the batches not
  yet drawn need, from need(step after the newest drawn) on, and the engine reads one of
  them (evaluation and a redraw the newest). So lag + 2 copies, lag + 1 more than the
  synchronous loop's, whose sync writes the new version into the old one's buffers.
  """
  lag = exp.asynchronous.lag(exp.trainer.minibatches)
  return lag + 1 if lag else 0


def run_class(exp) -> type:
  """The run for this experiment: multi-turn episodes for an environment task, else the
  one for its asynchronous mode."""
  if isinstance(exp.task, Environment):
    if exp.asynchronous.mode != "sync":
      raise UserError(f"agent: multi-turn episodes run synchronously for now; "
                      f"AsyncSpec.mode = 'sync', got {exp.asynchronous.mode!r}")
    return AgentRLRun
  return RLRun if exp.asynchronous.mode == "sync" else AsyncRLRun
