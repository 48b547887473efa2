"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, each optional.

`LogSpec.wandb = @WandbSpec()` and `LogSpec.mlflow = @MlflowSpec()` turn them on. Every step
the training loop writes to metrics.jsonl reaches each tracker too: the same names and
scalars (non-finite values as NaN/inf; lists such as histograms stay in metrics.jsonl and
TensorBoard). Each tracker run also gets the run's gin config: config.gin's text and
config.json's resolved fields.

A resumed run continues the same tracker run: the ids are kept in `<workdir>/trackers.json`.
Steps recomputed after a resume (the killed run had logged past its last checkpoint) are
logged again; resume is exact, so they carry the values logged the first time.

Neither package is a dependency of the project: `pip install wandb` or `pip install mlflow`
(mlflow-skinny plus sqlalchemy and alembic suffice for the default local store).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any, Optional

from jaxrl_post.errors import UserError

IDS_FILE = "trackers.json"
WANDB_MODES = ("online", "offline")


def _need(package: str, spec: str, install: str) -> None:
  if importlib.util.find_spec(package) is None:
    raise UserError(f"{spec}: the {package} package is not installed (pip install {install})")


def _check_str(value, where: str, optional: bool = True) -> None:
  if not (isinstance(value, str) and value) and not (optional and value is None):
    raise UserError(f"{where} must be a non-empty string{' or None' * optional}, "
                    f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class WandbSpec:
  """Logs the run to Weights & Biases.

  Attributes:
    project: the W&B project.
    entity: the team or user (None: the logged-in user's default).
    name: the run's display name (None: the workdir's name).
    mode: "online" (needs `wandb login` or WANDB_API_KEY) or "offline" (writes the run
      under `<workdir>/wandb/` without a network; `wandb sync` uploads it later).
    tags: the run's tags.
  """

  project: str = "jaxrl_post"
  entity: Optional[str] = None
  name: Optional[str] = None
  mode: str = "online"
  tags: tuple = ()

  def __post_init__(self):
    _check_str(self.project, "wandb spec: project", optional=False)
    _check_str(self.entity, "wandb spec: entity")
    _check_str(self.name, "wandb spec: name")
    if self.mode not in WANDB_MODES:
      raise UserError(f"wandb spec: mode={self.mode!r} is not one of {WANDB_MODES}")
    object.__setattr__(self, "tags", tuple(self.tags))
    if not all(isinstance(t, str) and t for t in self.tags):
      raise UserError(f"wandb spec: tags must be non-empty strings, got {self.tags!r}")
    _need("wandb", "wandb spec", "wandb")


@dataclasses.dataclass(frozen=True)
class MlflowSpec:
  """Logs the run to MLflow.

  Attributes:
    tracking_uri: the tracking server or store (None: a local SQLite store and artifact
      folder under `<workdir>/mlflow/`; `mlflow ui --backend-store-uri
      sqlite:///<workdir>/mlflow/mlflow.db` shows it).
    experiment: the MLflow experiment's name (created if missing).
    run_name: the run's name (None: the workdir's name).
  """

  tracking_uri: Optional[str] = None
  experiment: str = "jaxrl_post"
  run_name: Optional[str] = None

  def __post_init__(self):
    _check_str(self.tracking_uri, "mlflow spec: tracking_uri")
    _check_str(self.experiment, "mlflow spec: experiment", optional=False)
    _check_str(self.run_name, "mlflow spec: run_name")
    _need("mlflow", "mlflow spec", "mlflow")


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
  """A metrics.jsonl record's scalars as floats ("nan", "inf", "-inf" back to floats)."""
  out = {}
  for name, value in record.items():
    if name == "step" or isinstance(value, (list, tuple, dict)):
      continue
    if isinstance(value, bool):
      value = float(value)
    if isinstance(value, str):
      if value not in ("nan", "inf", "-inf"):
        continue
      value = float(value)
    if isinstance(value, (int, float)):
      out[name] = float(value)
  return out


def _config(workdir: str) -> tuple[str, dict]:
  """The run's config.gin text and config.json fields (empty when not written)."""
  gin_text, fields = "", {}
  path = os.path.join(workdir, "config.gin")
  if os.path.exists(path):
    with open(path) as f:
      gin_text = f.read()
  path = os.path.join(workdir, "config.json")
  if os.path.exists(path):
    with open(path) as f:
      fields = json.load(f)
  return gin_text, fields


class _Ids:
  """The tracker run ids of this workdir, kept across resumes."""

  def __init__(self, workdir: str, fresh: bool):
    self.path = os.path.join(workdir, IDS_FILE)
    self.ids = {}
    if not fresh and os.path.exists(self.path):
      with open(self.path) as f:
        self.ids = json.load(f)

  def get(self, name: str) -> Optional[str]:
    return self.ids.get(name)

  def put(self, name: str, run_id: str) -> None:
    self.ids[name] = run_id
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.ids, f)
    os.replace(tmp, self.path)


class WandbTracker:
  """One W&B run per workdir, resumed by id."""

  def __init__(self, spec: WandbSpec, workdir: str, ids: _Ids, config: tuple[str, dict]):
    import wandb

    run_id = ids.get("wandb") or uuid.uuid4().hex[:16]
    gin_text, fields = config
    try:
      self.run = wandb.init(
          project=spec.project, entity=spec.entity, id=run_id, resume="allow",
          name=spec.name or os.path.basename(os.path.abspath(workdir)), mode=spec.mode,
          dir=workdir, tags=list(spec.tags) or None,
          config={"gin_config": gin_text, **fields}, settings=wandb.Settings(silent=True))
    except Exception as e:  # Login, network or permission: one line, not a stack.
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise UserError(f"wandb spec: wandb.init failed: {first}") from e
    ids.put("wandb", run_id)

  def log(self, step: int, values: dict[str, float]) -> None:
    if values:
      self.run.log(values, step=step)

  def close(self) -> None:
    import wandb

    self.run.finish()
    # The W&B service process would otherwise outlive the run as this process's child.
    wandb.teardown()


# MLflow allows letters, digits and _ - . / space and colon in a metric's name.
_MLFLOW_UNSAFE = re.compile(r"[^\w\-./ :]")


class MlflowTracker:
  """One MLflow run per workdir, resumed by id; its store defaults to the workdir."""

  def __init__(self, spec: MlflowSpec, workdir: str, ids: _Ids, config: tuple[str, dict]):
    import logging

    from mlflow.tracking import MlflowClient

    # Its store announces each table it creates at INFO; the run's own log says enough.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    local = os.path.join(os.path.abspath(workdir), "mlflow")
    uri = spec.tracking_uri
    if uri is None:
      os.makedirs(local, exist_ok=True)
      uri = "sqlite:///" + os.path.join(local, "mlflow.db")
    try:
      self.client = MlflowClient(tracking_uri=uri)
      self.run_id = ids.get("mlflow") or self._start(spec, workdir, local, config)
    except Exception as e:
      first = (str(e).strip().splitlines() or [type(e).__name__])[0]
      raise UserError(f"mlflow spec: tracking_uri={uri!r}: {first}") from e
    ids.put("mlflow", self.run_id)
    self.client.update_run(self.run_id, status="RUNNING")

  def _start(self, spec: MlflowSpec, workdir: str, local: str, config) -> str:
    found = self.client.get_experiment_by_name(spec.experiment)
    if found is not None:
      experiment = found.experiment_id
    else:
      location = (None if spec.tracking_uri is not None
                  else "file://" + os.path.join(local, "artifacts"))
      experiment = self.client.create_experiment(spec.experiment, artifact_location=location)
    name = spec.run_name or os.path.basename(os.path.abspath(workdir))
    run_id = self.client.create_run(experiment, run_name=name).info.run_id
    gin_text, fields = config
    self.client.log_text(run_id, gin_text, "config.gin")
    self.client.log_dict(run_id, fields, "config.json")
    return run_id

  def log(self, step: int, values: dict[str, float]) -> None:
    from mlflow.entities import Metric

    at = int(time.time() * 1000)
    metrics = [Metric(_MLFLOW_UNSAFE.sub("_", k), v, at, step) for k, v in values.items()]
    for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics.
      self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)

  def close(self) -> None:
    self.client.set_terminated(self.run_id, status="FINISHED")


class TrackedWriter:
  """A metrics writer that also logs each record's scalars to the configured trackers.

  Same calls as MetricsWriter (write, truncate_after, close), which it wraps.
  """

  def __init__(self, writer, trackers: list):
    self.writer = writer
    self.trackers = trackers

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    record = self.writer.write(step, metrics)
    values = scalars(record)
    for tracker in self.trackers:
      tracker.log(record["step"], values)
    return record

  def truncate_after(self, step: int) -> None:
    self.writer.truncate_after(step)

  def close(self) -> None:
    try:
      for tracker in self.trackers:
        tracker.close()
    finally:
      self.writer.close()


def with_trackers(writer, log_spec, workdir: str, fresh: bool):
  """`writer`, wrapped to also log to the trackers `log_spec` turns on (process 0 only)."""
  if log_spec.wandb is None and log_spec.mlflow is None:
    return writer
  ids, config = _Ids(workdir, fresh), _config(workdir)
  trackers = []
  try:
    if log_spec.wandb is not None:
      trackers.append(WandbTracker(log_spec.wandb, workdir, ids, config))
    if log_spec.mlflow is not None:
      trackers.append(MlflowTracker(log_spec.mlflow, workdir, ids, config))
  except BaseException:
    for tracker in trackers:
      tracker.close()
    raise
  return TrackedWriter(writer, trackers)
