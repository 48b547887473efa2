"""The training program end to end on the CPU: loop, metrics, checkpoints, kill and resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_post import train
from jaxrl_post.telemetry import read_metrics
from jaxrl_post.telemetry.trace import read_trace

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.gin")
QUICKSTART_LORA = os.path.join(ROOT, "configs", "quickstart_lora.gin")
# The quickstart, shrunk to seconds: few steps, small groups, a checkpoint every step.
FAST = ["Experiment.steps = 5", "SftConfig.steps = 4", "EvalSpec.every_n_steps = 2",
        "EvalSpec.num_problems = 16", "RolloutSpec.prompts_per_step = 4",
        "RolloutSpec.group_size = 4", "EngineConfig.num_slots = 16", "EngineConfig.group_slots = 4",
        "CheckpointConfig.every_n_steps = 1", "CheckpointConfig.keep = 2",
        "PlacementConfig.num_devices = 1", "OptimizerConfig.total_steps = 10"]
# Wall-clock figures and this process's compile counts differ between any two runs (a
# resumed process compiles afresh); everything else must not.
TIMING = ("time/", "rollout/tokens_per_s", "compile/", "reward/wait_s",
          "verifier/seconds_per_sample", "train/tokens_per_s", "perf/", "alarm/step_time")


def _argv(workdir, extra=(), gin_file=QUICKSTART):
  return ([f"--gin_file={gin_file}", f"--workdir={workdir}"] +
          [f"--gin_param={p}" for p in FAST + list(extra)])


def _deterministic(records):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


# W&B (offline) and MLflow (the workdir's store) beside metrics.jsonl, as users turn them on.
TRACKERS = ["LogSpec.wandb = @WandbSpec()", "WandbSpec.mode = 'offline'",
            "LogSpec.mlflow = @MlflowSpec()"]


def test_run_writes_metrics_tensorboard_checkpoints_and_resumes(tmp_path, capsys):
  from tests.telemetry.test_trackers import check_trackers_hold

  workdir = tmp_path / "run"
  assert train.main(_argv(workdir, TRACKERS)) == 0
  out = capsys.readouterr().out
  assert "held-out accuracy:" in out
  records = read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
  step = records[1]
  for key in ("reward/mean", "time/rollout", "time/reward", "time/pack",
              "time/advantage", "time/train", "time/sync", "time/waiting", "sync/bytes",
              "rollout/tokens_per_s", "train/loss", "train/kl/behaviour", "weight_version",
              "data/skipped_overlong", "verifier/errors"):
    assert key in step, key
  assert step["weight_version"] == 1 and records[5]["weight_version"] == 5
  assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 4, 5]
  assert "sft/final_loss" in records[0]
  # Telemetry: MFU against this host's measured matmul rate, the alarms (none fire), the
  # role timeline and the report, whose path the run prints. No memory figures: the CPU
  # reports no device memory, and its train program is not analysed for them.
  for key in ("perf/train_mfu_vs_cpu_measured_matmul", "train/tokens_per_s",
              "alarm/step_time", "alarm/verifier_failures"):
    assert key in step, key
  assert not any(k.startswith("memory/") for k in step)
  assert not any(v for k, v in records[-1].items() if k.startswith("alarm/"))
  roles = {e["name"] for e in read_trace(str(workdir / "trace.json")) if e.get("cat") == "role"}
  assert {"rollout", "reward", "train", "sync"} <= roles
  assert f"report: {workdir / 'report.html'}" in out and (workdir / "report.html").exists()
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tensorboard"))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "5"]
  assert json.loads((workdir / "config.json").read_text())["steps"] == 5
  # Same command again: everything is done, nothing is recomputed or duplicated.
  assert train.main(_argv(workdir, TRACKERS)) == 0
  assert "resumed from" in capsys.readouterr().out
  assert read_metrics(str(workdir / "metrics.jsonl")) == records
  # A longer run continues from the last checkpoint, and the trackers' runs with it.
  assert train.main(_argv(workdir, [*TRACKERS, "Experiment.steps = 6"])) == 0
  records = read_metrics(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(7))
  check_trackers_hold(str(workdir), records)
  capsys.readouterr()
  # Resumed with another model: one line naming the first array that differs.
  assert train.main(_argv(workdir, ["ModelSpec.overrides = {'hidden_size': 96}"])) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "params.embed is (128, 128) in the checkpoint" in err, err


def _train_args(workdir, extra=(), gin_file=QUICKSTART):
  return _argv(workdir, ["Experiment.steps = 6", "LogSpec.progress = False", *extra], gin_file)


def _train_cmd(workdir, extra=(), gin_file=QUICKSTART):
  return [sys.executable, "-m", "jaxrl_post.train"] + _train_args(workdir, extra, gin_file)


def _wait_for_step(path, step, proc, timeout=300):
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, "the run ended before it could be killed"
    if os.path.exists(path) and any(r["step"] >= step for r in read_metrics(path)):
      return
    time.sleep(0.05)
  raise AssertionError(f"step {step} never appeared in {path}")


@pytest.mark.slow(reason="a straight run against a killed run and its resume")
@pytest.mark.parametrize("gin_file,sync_every,checkpoint_every,kills,steps",
                         [pytest.param(QUICKSTART, 1, 1, (3,), 6, marks=pytest.mark.sweep),
                          (QUICKSTART, 2, 3, (4,), 6),
                          pytest.param(QUICKSTART_LORA, 2, 3, (4,), 6, marks=pytest.mark.sweep),
                          pytest.param(QUICKSTART, 2, 3, (4, 7, 10), 12,
                                       marks=pytest.mark.sweep)],
                         ids=["sync1", "sync2", "lora-sync2", "sync2-three-kills"])
def test_sigkill_and_restart_gives_the_uninterrupted_metrics(tmp_path, gin_file, sync_every,
                                                             checkpoint_every, kills, steps):
  """A run killed (SIGKILL) mid-run and restarted with the same command writes the same
  metrics, bit for bit, as one that was never interrupted. sync2: the engine syncs every 2
  steps and the kill comes after checkpoint 3 is on disk, so the run resumes where the
  engine's weights (version 2) lag the train state's (step 3). lora-sync2: the same where
  only the adapters train and move. sync2-three-kills: killed after steps 4, 7 and 10."""
  env = dict(os.environ, PYTHONPATH=ROOT)
  extra = [f"SyncConfig.every_n_steps = {sync_every}",
           f"CheckpointConfig.every_n_steps = {checkpoint_every}", f"Experiment.steps = {steps}"]
  straight = tmp_path / "straight"  # In this process: it reuses the programs compiled here.
  assert train.main(_train_args(straight, extra, gin_file)) == 0
  killed = tmp_path / "killed"
  for kill_after in kills:
    proc = subprocess.Popen(_train_cmd(killed, extra, gin_file), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
      _wait_for_step(str(killed / "metrics.jsonl"), kill_after, proc)
      if sync_every > 1:  # Renamed into place when complete.
        _wait_for_path(killed / "checkpoints" / str(kill_after // 3 * 3), proc)
      proc.send_signal(signal.SIGKILL)  # Mid-run: possibly while a checkpoint is being written.
    finally:
      proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    done = read_metrics(str(killed / "metrics.jsonl"))
    assert max(r["step"] for r in done) < steps  # Really cut short.
  resumed = subprocess.run(_train_cmd(killed, extra, gin_file), env=env, check=True,
                           capture_output=True, text=True, timeout=600)
  assert "resumed from" in resumed.stdout
  if sync_every > 1:
    assert f"(step {kills[-1] // 3 * 3})" in resumed.stdout, resumed.stdout
  want = _deterministic(read_metrics(str(straight / "metrics.jsonl")))
  got = _deterministic(read_metrics(str(killed / "metrics.jsonl")))
  assert [r["step"] for r in got] == list(range(steps + 1))
  assert got == want
  if gin_file == QUICKSTART_LORA:
    # Only the adapters move: rank 16 on all 7 matrices of 3 layers is 38912 float32s a
    # layer, against 196864 for the layer's weights.
    adapters = 3 * 38912 * 4
    assert [r["sync/bytes"] for r in got[1:]] == [0, adapters] * 3


def _wait_for_path(path, proc, timeout=120):
  deadline = time.time() + timeout
  while not os.path.exists(path):
    assert proc.poll() is None and time.time() < deadline, f"{path} never appeared"
    time.sleep(0.05)


def test_malformed_rows_and_overlong_prompts_are_skipped_and_counted(tmp_path, capsys):
  data = tmp_path / "data.jsonl"
  rows = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)})
          for a in range(10) for b in range(10)]
  rows += ["{not json", json.dumps([1, 2]), json.dumps({"prompt": "1+1="}),
           json.dumps({"prompt": "9" * 40 + "+1=", "answer": "0"})]  # Last: too long.
  data.write_text("\n".join(rows) + "\n")
  workdir = tmp_path / "run"
  extra = ["Experiment.task = @JsonlTask()", f"JsonlTask.path = '{data}'",
           "JsonlTask.format = 'prompt_answer'", "JsonlTask.template = '{question}'",
           "Experiment.steps = 2", "EvalSpec.num_problems = 8"]
  assert train.main(_argv(workdir, extra)) == 0
  last = read_metrics(str(workdir / "metrics.jsonl"))[-1]
  assert last["data/skipped_rows/invalid_json"] == 1
  assert last["data/skipped_rows/not_an_object"] == 1
  assert last["data/skipped_rows/missing_field"] == 1
  assert "reward/mean" in last
