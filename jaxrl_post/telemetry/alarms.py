"""Alarms: conditions on a run's metrics that a person should hear about while it runs.

`AlarmMonitor.update(step, metrics)` reads one step's metrics line and returns
`{"alarm/<name>": 0.0 or 1.0}` for every alarm: 1 while the alarm's condition holds. An
alarm *fires* when its condition starts to hold: a warning line goes to the log once, and
it stays quiet while the condition goes on holding (one episode); once the condition
clears, a later onset fires again. The thresholds are `AlarmSpec` fields (gin: AlarmSpec.*).

The alarms and the metrics they read:

  step_time         step time running above `step_time_factor` x its running median: the
                    median of the last `recent` steps above that factor times the median
                    of the `window` steps before them, so one slow step on a busy host is
                    no alarm, and a slowdown that lasts is (steps that compiled new
                    programs are left out: a compile is not a slowdown);
  clip_fraction     train/clip_frac_low + train/clip_frac_high above `clip_fraction_max`;
  logprob_mismatch  train/mismatch/abs_mean (|rollout engine logprob - trainer logprob| per
                    token) above `logprob_mismatch_max`;
  kl_spike          train/kl/reference (train/kl/behaviour without a reference) above
                    `kl_spike_factor` x its running median and above `kl_floor`;
  reward_vs_heldout over the last `evals` evaluations, held-out accuracy (eval/accuracy)
                    fell by more than `heldout_drop` while the mean training reward
                    (reward/mean) between the last two rose by more than `reward_rise`
                    over its mean between the first two;
  verifier_failures (verifier/errors + timeouts + crashes) / verifier/samples of the step
                    above `verifier_failure_max`.

An alarm whose metrics a step does not carry is left as it is for that step. A leaf module:
no jax, no other jaxrl_post modules besides `errors`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any, Callable, Mapping, Optional

from jaxrl_post.errors import UserError

ALARMS = ("step_time", "clip_fraction", "logprob_mismatch", "kl_spike", "reward_vs_heldout",
          "verifier_failures")


@dataclasses.dataclass(frozen=True)
class AlarmSpec:
  """Alarm thresholds (see telemetry/alarms.py).

  Attributes:
    enabled: watch the metrics at all.
    window: steps in the running medians of step time and KL.
    min_history: steps a running median needs before its alarm can fire.
    recent: the last steps whose median step time is compared with the running median.
    step_time_factor: recent step time above this times its running median.
    clip_fraction_max: clipped fraction of tokens (low + high bound) above this.
    logprob_mismatch_max: mean |rollout logprob - trainer logprob| per token above this.
    kl_spike_factor: KL above this times its running median...
    kl_floor: ...and above this, in nats per token: a KL this small is no runaway whatever
      its median (near 0 it would make any KL a "spike").
    evals: evaluations compared by the reward-vs-held-out alarm (>= 3).
    heldout_drop: held-out accuracy falling by more than this over those evaluations...
    reward_rise: ...while the training reward rises by more than this.
    verifier_failure_max: verifier errors + timeouts + crashes per sample above this.
  """

  enabled: bool = True
  window: int = 20
  min_history: int = 5
  recent: int = 5
  step_time_factor: float = 1.2
  clip_fraction_max: float = 0.3
  logprob_mismatch_max: float = 0.1
  kl_spike_factor: float = 5.0
  kl_floor: float = 0.01
  evals: int = 3
  heldout_drop: float = 0.02
  reward_rise: float = 0.02
  verifier_failure_max: float = 0.05

  def __post_init__(self):
    if not isinstance(self.enabled, bool):
      raise UserError(f"alarm spec: enabled must be True or False, got {self.enabled!r}")
    for name in ("window", "min_history", "recent"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"alarm spec: {name} must be a positive integer, got {value!r}")
    if self.min_history > self.window:
      raise UserError(f"alarm spec: min_history ({self.min_history}) exceeds window "
                      f"({self.window})")
    if not isinstance(self.evals, int) or isinstance(self.evals, bool) or self.evals < 3:
      raise UserError(f"alarm spec: evals must be an integer >= 3, got {self.evals!r}")
    for name in ("step_time_factor", "kl_spike_factor"):
      value = getattr(self, name)
      if not _number(value) or not value > 1.0:
        raise UserError(f"alarm spec: {name} must be a number > 1, got {value!r}")
    for name in ("clip_fraction_max", "verifier_failure_max"):
      value = getattr(self, name)
      if not _number(value) or not 0.0 <= value < 1.0:
        raise UserError(f"alarm spec: {name} must be in [0, 1), got {value!r}")
    for name in ("logprob_mismatch_max", "kl_floor", "heldout_drop", "reward_rise"):
      value = getattr(self, name)
      if not _number(value) or not 0.0 <= value < math.inf:
        raise UserError(f"alarm spec: {name} must be a finite number >= 0, got {value!r}")


class AlarmMonitor:
  """Judges each step's metrics against an AlarmSpec; logs each alarm once per episode."""

  def __init__(self, spec: Optional[AlarmSpec] = None, log: Callable[[str], None] = print):
    spec = spec or AlarmSpec()
    self.spec, self.log = spec, log
    self.active = {name: False for name in ALARMS}
    self.fired: list[tuple[int, str, str]] = []  # (step, alarm, message), in order
    self._step_times = collections.deque(maxlen=spec.window + spec.recent)
    self._kls = collections.deque(maxlen=spec.window)
    self._evals: list[tuple[int, float]] = []  # (step, held-out accuracy)
    self._rewards: list[tuple[int, float]] = []  # (step, training reward)

  def update(self, step: int, metrics: Mapping[str, Any], quiet: bool = False
             ) -> dict[str, float]:
    """{"alarm/<name>": 1.0 while the alarm holds else 0.0} for this step's metrics.

    Args:
      step: the RL step.
      metrics: the step's metrics, as written to metrics.jsonl.
      quiet: judge without logging (replaying the lines a resumed run already wrote).
    """
    if not self.spec.enabled:
      return {}
    conditions = {name: getattr(self, f"_{name}")(step, metrics) for name in ALARMS}
    for name, found in conditions.items():
      if found is None:
        continue  # The step says nothing about it.
      if found and not self.active[name]:
        message = f"alarm {name} at step {step}: {found}"
        self.fired.append((step, name, message))
        if not quiet:
          self.log(f"warning: {message}")
      self.active[name] = bool(found)
    return {f"alarm/{name}": float(on) for name, on in self.active.items()}

  # ------------------------------------------------------------------ conditions
  # Each returns None (no data this step), "" (clear) or a message (holds).

  def _step_time(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    seconds = _get(m, "time/step")
    if seconds is None or _get(m, "compile/new_programs", 0.0) > 0:
      return None
    history = self._step_times
    history.append(seconds)
    recent = list(history)[-self.spec.recent:]
    before = list(history)[:-self.spec.recent]
    if len(recent) < self.spec.recent or len(before) < self.spec.min_history:
      return None
    now, median = statistics.median(recent), statistics.median(before)
    if now > self.spec.step_time_factor * median:
      return (f"the last {self.spec.recent} steps took {now:.3g} s (median), above "
              f"{self.spec.step_time_factor:g} x the running median {median:.3g} s")
    return ""

  def _clip_fraction(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    low, high = _get(m, "train/clip_frac_low"), _get(m, "train/clip_frac_high")
    if low is None and high is None:
      return None
    clipped = (low or 0.0) + (high or 0.0)
    if clipped > self.spec.clip_fraction_max:
      return f"clip fraction {clipped:.3g} above {self.spec.clip_fraction_max:g}"
    return ""

  def _logprob_mismatch(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    value = _get(m, "train/mismatch/abs_mean")
    if value is None:
      return None
    if not value <= self.spec.logprob_mismatch_max:  # NaN holds too.
      return (f"rollout-vs-trainer logprob mismatch {value:.3g} per token above "
              f"{self.spec.logprob_mismatch_max:g}")
    return ""

  def _kl_spike(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    name = "train/kl/reference" if _get(m, "train/kl/reference") is not None else \
        "train/kl/behaviour"
    kl = _get(m, name)
    if kl is None:
      return None
    history = self._kls
    median = statistics.median(history) if len(history) >= self.spec.min_history else None
    if math.isfinite(kl):
      history.append(kl)
    if median is None:
      return None
    limit = max(self.spec.kl_spike_factor * median, self.spec.kl_floor)
    if not kl <= limit:
      return (f"{name} {kl:.3g} above {self.spec.kl_spike_factor:g} x its running median "
              f"{median:.3g}")
    return ""

  def _reward_vs_heldout(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    reward = _get(m, "reward/mean")
    if reward is not None:
      self._rewards.append((step, reward))
    accuracy = _get(m, "eval/accuracy")
    if accuracy is None:
      return None
    self._evals.append((step, accuracy))
    if len(self._evals) < self.spec.evals:
      return None
    last = self._evals[-self.spec.evals:]
    first_mean = _mean_between(self._rewards, last[0][0], last[1][0])
    last_mean = _mean_between(self._rewards, last[-2][0], last[-1][0])
    if first_mean is None or last_mean is None:
      return None
    drop, rise = last[0][1] - last[-1][1], last_mean - first_mean
    if drop > self.spec.heldout_drop and rise > self.spec.reward_rise:
      return (f"held-out accuracy fell {last[0][1]:.3f} -> {last[-1][1]:.3f} (steps "
              f"{last[0][0]}-{last[-1][0]}) while the training reward rose {first_mean:.3f} "
              f"-> {last_mean:.3f}")
    return ""

  def _verifier_failures(self, step: int, m: Mapping[str, Any]) -> Optional[str]:
    samples = _get(m, "verifier/samples")
    if not samples:
      return None
    failed = sum(_get(m, f"verifier/{k}", 0.0) for k in ("errors", "timeouts", "crashes"))
    rate = failed / samples
    if rate > self.spec.verifier_failure_max:
      return (f"verifier errors/timeouts/crashes in {rate:.1%} of {samples:g} samples, above "
              f"{self.spec.verifier_failure_max:.0%}")
    return ""


def _mean_between(points: list[tuple[int, float]], after: int, upto: int) -> Optional[float]:
  values = [v for s, v in points if after < s <= upto]
  return sum(values) / len(values) if values else None


def _get(m: Mapping[str, Any], name: str, default: Any = None) -> Any:
  """A numeric metric as a float ("nan"/"inf" strings included), else `default`."""
  value = m.get(name)
  if isinstance(value, bool) or value is None:
    return default
  if isinstance(value, (int, float)):
    return float(value)
  if isinstance(value, str):
    try:
      return float(value)
    except ValueError:
      return default
  return default


def _number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)
