"""W&B (offline) and MLflow (local SQLite store) get what metrics.jsonl gets, and a resumed
run continues the same tracker runs. The training command's own run with both is in
tests/pipeline/test_train.py (test_run_writes_metrics_tensorboard_checkpoints_and_resumes)."""

import glob
import json
import math
import os
import struct

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.pipeline.config import LogSpec
from jaxrl_post.telemetry import MetricsWriter, read_metrics
from jaxrl_post.telemetry import trackers
from jaxrl_post.telemetry.trackers import MlflowSpec, WandbSpec, with_trackers

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

_BLOCK = 32 * 1024


def _records(path: str) -> list[bytes]:
  """The protobuf records of a .wandb file: a 7-byte W&B header, then LevelDB's log format
  (32 KiB blocks; each chunk a 7-byte header of crc, length and type: 1 full, 2 first,
  3 middle, 4 last)."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", path
  out, pending, pos = [], b"", 7
  while pos + 7 <= len(data):
    room = _BLOCK - pos % _BLOCK
    if room < 7:  # A block's tail too short for a header is padding.
      pos += room
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    chunk = data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind == 0 and length == 0:
      continue
    pending = chunk if kind in (1, 2) else pending + chunk
    if kind in (1, 4):
      out.append(pending)
  return out


def wandb_history(workdir) -> tuple[set, dict]:
  """(the run ids, {step: {name: value}}) of every offline W&B run under workdir."""
  from wandb.proto import wandb_internal_pb2

  ids, steps = set(), {}
  for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
    for raw in _records(path):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(raw)
      kind = record.WhichOneof("record_type")
      if kind == "run":
        ids.add(record.run.run_id)
      elif kind == "history":
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                 for i in record.history.item}
        step = items.pop("_step")
        steps.setdefault(step, {}).update(
            {k: v for k, v in items.items() if not k.startswith("_")})
  return ids, steps


def mlflow_runs(workdir):
  from mlflow.tracking import MlflowClient

  client = MlflowClient(tracking_uri="sqlite:///" + os.path.join(workdir, "mlflow", "mlflow.db"))
  experiment = client.get_experiment_by_name("jaxrl_post")
  return client, client.search_runs([experiment.experiment_id])


def _same(got, want) -> bool:
  want = float(want)
  return (math.isnan(got) and math.isnan(want)) or got == want


def check_trackers_hold(workdir, records) -> None:
  """Both trackers hold every scalar of metrics.jsonl at its step, and nothing else."""
  expected = {r["step"]: trackers.scalars(r) for r in records}
  ids, history = wandb_history(workdir)
  assert len(ids) == 1, ids
  assert set(history) == set(expected)
  for step, values in expected.items():
    assert set(history[step]) == set(values), step
    assert all(_same(float(history[step][k]), v) for k, v in values.items()), step
  client, runs = mlflow_runs(workdir)
  assert len(runs) == 1
  run_id = runs[0].info.run_id
  for name in {k for values in expected.values() for k in values}:
    logged = {}
    for m in client.get_metric_history(run_id, name.replace("@", "_")):
      logged[m.step] = m.value  # A recomputed step's later value is the one that counts.
    want = {s: v[name] for s, v in expected.items() if name in v}
    assert set(logged) == set(want), name
    assert all(_same(logged[s], v) for s, v in want.items()), name
  assert runs[0].info.status == "FINISHED"


def _spec():
  return LogSpec(tensorboard=False, wandb=WandbSpec(mode="offline", project="t"),
                 mlflow=MlflowSpec())


def test_each_record_reaches_both_and_a_resume_continues_their_runs(tmp_path):
  workdir = str(tmp_path)
  (tmp_path / "config.gin").write_text("Experiment.steps = 4\n")
  (tmp_path / "config.json").write_text('{"steps": 4}\n')
  writer = with_trackers(MetricsWriter(workdir, tensorboard=False), _spec(), workdir, True)
  writer.truncate_after(-1)
  writer.write(0, {"eval/accuracy": 0.25})
  writer.write(1, {"train/loss": 1.5, "alarm/kl_spike": True, "train/ratio/hist": [1.0, 2.0],
                   "reward/mean": float("nan"), "note": "text", "eval/pass@4": 0.5})
  writer.write(2, {"train/loss": 1.25})
  writer.close()
  # Resumed from a checkpoint at step 1: step 2 is recomputed, step 3 is new.
  writer = with_trackers(MetricsWriter(workdir, tensorboard=False), _spec(), workdir, False)
  writer.truncate_after(1)
  writer.write(2, {"train/loss": 1.25})
  writer.write(3, {"train/loss": 1.0})
  writer.close()
  records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  check_trackers_hold(workdir, records)
  client, runs = mlflow_runs(workdir)
  config = client.download_artifacts(runs[0].info.run_id, "config.gin", str(tmp_path / "got"))
  assert open(config).read() == "Experiment.steps = 4\n"


def test_a_fresh_run_in_a_used_workdir_starts_new_tracker_runs(tmp_path):
  workdir = str(tmp_path)
  for _ in range(2):
    writer = with_trackers(MetricsWriter(workdir, tensorboard=False), _spec(), workdir, True)
    writer.write(0, {"eval/accuracy": 0.5})
    writer.close()
  assert len(wandb_history(workdir)[0]) == 2
  assert len(mlflow_runs(workdir)[1]) == 2


def test_bad_specs_are_one_line_errors(monkeypatch):
  with pytest.raises(UserError, match="wandb spec: mode='cloud'"):
    WandbSpec(mode="cloud")
  with pytest.raises(UserError, match="mlflow spec: experiment"):
    MlflowSpec(experiment="")
  real = trackers.importlib.util.find_spec
  monkeypatch.setattr(trackers.importlib.util, "find_spec",
                      lambda name: None if name == "wandb" else real(name))
  with pytest.raises(UserError, match=r"the wandb package is not installed \(pip install"):
    WandbSpec()


def test_an_unreachable_tracking_server_is_one_line(tmp_path):
  (tmp_path / "a_file").write_text("")  # No store can be made under a file.
  uri = f"sqlite:///{tmp_path}/a_file/mlflow.db"
  spec = LogSpec(mlflow=MlflowSpec(tracking_uri=uri))
  with pytest.raises(UserError, match=f"mlflow spec: tracking_uri='{uri}': "):
    with_trackers(MetricsWriter(str(tmp_path), tensorboard=False), spec, str(tmp_path), True)
