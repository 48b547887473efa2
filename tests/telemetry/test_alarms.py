"""telemetry.alarms: each alarm forced by a synthetic metric stream, once per episode."""

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.telemetry.alarms import ALARMS, AlarmMonitor, AlarmSpec


def _healthy(step):
  return {"time/step": 1.0, "train/clip_frac_low": 0.01, "train/clip_frac_high": 0.02,
          "train/mismatch/abs_mean": 1e-4, "train/kl/reference": 0.01, "reward/mean": 0.5,
          "verifier/samples": 64, "verifier/errors": 0, "verifier/timeouts": 0,
          "verifier/crashes": 0}


def _run(stream, spec=AlarmSpec()):
  """(monitor, log lines, per-step alarm metrics) after feeding {step: overrides}."""
  lines = []
  monitor = AlarmMonitor(spec, log=lines.append)
  out = {}
  for step in range(1, max(stream) + 1):
    out[step] = monitor.update(step, {**_healthy(step), **stream.get(step, {})})
  return monitor, lines, out


def _episodes(out, name):
  return [s for s in out if out[s][f"alarm/{name}"] and not out.get(s - 1, {}).get(
      f"alarm/{name}", 0.0)]


def test_a_healthy_stream_fires_nothing():
  monitor, lines, out = _run({40: {}})
  assert lines == [] and monitor.fired == []
  assert set(out[40]) == {f"alarm/{n}" for n in ALARMS}
  assert not any(out[40].values())


def test_step_time_running_above_its_running_median():
  stream = {s: {"time/step": 1.5} for s in range(30, 35)}  # A slowdown that lasts 5 steps,
  stream[40] = {"time/step": 3.0}  # one slow step (a busy host): no alarm,
  stream.update({s: {"time/step": 1.3} for s in range(45, 48)})  # a second slowdown.
  stream[55] = {}
  monitor, lines, out = _run(stream)
  assert [s for s, name, _ in monitor.fired] == [32, 47]  # 3 of the last 5 steps slow
  assert _episodes(out, "step_time") == [32, 47]
  assert out[36]["alarm/step_time"] == 1.0 and out[37]["alarm/step_time"] == 0.0
  assert len(lines) == 2 and lines[0].startswith("warning: alarm step_time at step 32")
  assert "the last 5 steps took 1.5 s (median), above 1.2 x the running median 1 s" in lines[0]


def test_step_time_needs_history_and_skips_compiling_steps():
  # A slow first step (compiling) and a slow step that compiled new programs are no alarm.
  stream = {1: {"time/step": 30.0}, 20: {"time/step": 9.0, "compile/new_programs": 2},
            25: {}}
  monitor, _, _ = _run(stream)
  assert monitor.fired == []


def test_clip_fraction_above_threshold():
  monitor, lines, out = _run({5: {"train/clip_frac_low": 0.2, "train/clip_frac_high": 0.15},
                              6: {"train/clip_frac_high": 0.4}, 9: {}})
  assert [(s, n) for s, n, _ in monitor.fired] == [(5, "clip_fraction")]
  assert out[6]["alarm/clip_fraction"] == 1.0 and out[7]["alarm/clip_fraction"] == 0.0
  assert "clip fraction 0.35 above 0.3" in lines[0]


def test_logprob_mismatch_above_threshold_and_nan():
  spec = AlarmSpec(logprob_mismatch_max=0.05)
  monitor, _, _ = _run({3: {"train/mismatch/abs_mean": 0.2}, 7: {"train/mismatch/abs_mean":
                                                                  "nan"}, 8: {}}, spec)
  assert [(s, n) for s, n, _ in monitor.fired] == [(3, "logprob_mismatch"),
                                                   (7, "logprob_mismatch")]


def test_kl_spike_against_its_running_median():
  monitor, lines, _ = _run({12: {"train/kl/reference": 0.06}, 13: {"train/kl/reference": 0.04},
                            20: {}})
  assert [(s, n) for s, n, _ in monitor.fired] == [(12, "kl_spike")]  # 0.04 < 5 x 0.01
  assert "train/kl/reference 0.06" in lines[0]
  # Five times a tiny median but under the floor (0.01 nats per token): no runaway.
  monitor, _, _ = _run({s: {"train/kl/reference": 5e-4} for s in range(1, 12)} |
                       {12: {"train/kl/reference": 0.004}, 13: {}})
  assert monitor.fired == []


def test_kl_spike_reads_behaviour_kl_without_a_reference_and_respects_the_floor():
  stream = {s: {"train/kl/reference": None, "train/kl/behaviour": 1e-6} for s in range(1, 16)}
  stream[10] = {"train/kl/reference": None, "train/kl/behaviour": 1e-3}  # 1000x, under floor
  stream[15] = {"train/kl/reference": None, "train/kl/behaviour": 0.05}
  monitor, _, _ = _run(stream)
  assert [(s, n) for s, n, _ in monitor.fired] == [(15, "kl_spike")]


def test_training_reward_rising_while_heldout_falls():
  # Evaluations at 0, 10, 20, 30: accuracy falls 0.65 -> 0.6 -> 0.5 -> 0.4 while the
  # reward rises: it fires at 20 (three evaluations) and holds through 30 (one episode).
  stream = {s: {"reward/mean": 0.3 + 0.01 * s} for s in range(1, 31)}
  for step, accuracy in ((10, 0.6), (20, 0.5), (30, 0.4)):
    stream[step] = {**stream[step], "eval/accuracy": accuracy}
  lines = []
  monitor = AlarmMonitor(AlarmSpec(), log=lines.append)
  monitor.update(0, {"eval/accuracy": 0.65})
  for step in range(1, 31):
    out = monitor.update(step, {**_healthy(step), **stream[step]})
  assert [(s, n) for s, n, _ in monitor.fired] == [(20, "reward_vs_heldout")]
  assert out["alarm/reward_vs_heldout"] == 1.0 and len(lines) == 1
  assert "held-out accuracy fell 0.650 -> 0.500 (steps 0-20)" in lines[0]


def test_heldout_and_reward_rising_together_is_no_alarm():
  lines = []
  monitor = AlarmMonitor(AlarmSpec(), log=lines.append)
  monitor.update(0, {"eval/accuracy": 0.2})
  for step in range(1, 31):
    m = {**_healthy(step), "reward/mean": 0.3 + 0.01 * step}
    if step % 10 == 0:
      m["eval/accuracy"] = 0.2 + 0.01 * step
    monitor.update(step, m)
  assert monitor.fired == []


def test_verifier_error_or_timeout_rate_above_five_percent():
  monitor, lines, out = _run({4: {"verifier/errors": 2, "verifier/timeouts": 2},  # 6.25%
                              5: {"verifier/timeouts": 3},  # 4.7%: clears
                              6: {"verifier/crashes": 4}, 7: {}})
  assert [(s, n) for s, n, _ in monitor.fired] == [(4, "verifier_failures"),
                                                   (6, "verifier_failures")]
  assert "6.2% of 64 samples" in lines[0]


def test_quiet_replay_rebuilds_state_without_logging():
  lines = []
  monitor = AlarmMonitor(AlarmSpec(), log=lines.append)
  for step in range(1, 11):
    monitor.update(step, _healthy(step), quiet=True)
  monitor.update(11, {**_healthy(11), "train/clip_frac_low": 0.5}, quiet=True)
  assert lines == [] and monitor.active["clip_fraction"]
  # Still holding after the replay: no second warning for the same episode.
  monitor.update(12, {**_healthy(12), "train/clip_frac_low": 0.5})
  assert lines == []


def test_disabled_monitor_writes_nothing():
  assert AlarmMonitor(AlarmSpec(enabled=False)).update(1, _healthy(1)) == {}


@pytest.mark.parametrize("field,value", [("step_time_factor", 1.0), ("clip_fraction_max", 1.5),
                                         ("window", 0), ("evals", 2), ("kl_floor", -1.0),
                                         ("min_history", 50)])
def test_bad_thresholds_are_one_line_errors(field, value):
  with pytest.raises(UserError, match=f"alarm spec: {field}") as e:
    AlarmSpec(**{field: value})
  assert "\n" not in str(e.value)
