"""Metrics output: an append-only JSON-lines file plus TensorBoard event files.

`<workdir>/metrics.jsonl` is the source of truth: one JSON object per step, `"step"` first and
the metrics sorted by name, flushed after every line so a killed run loses at most the line
being written. It needs no TensorBoard to read (`read_metrics`, `jq`, pandas).

JSON has no NaN or infinity, and Python's `json` would otherwise write the non-standard
tokens `NaN`/`Infinity` that strict parsers reject. Non-finite floats are therefore written as
the strings `"nan"`, `"inf"` and `"-inf"`: the file stays valid JSON and a diverged run
still shows *which* value blew up, which `null` would hide. `read_metrics` returns those
strings as written; convert with `float(value)` where a number is needed.

TensorBoard gets every finite scalar under `<workdir>/tensorboard`. Events are written
synchronously and flushed per `write` (tensorboardX's `SummaryWriter` queues events to a
background thread, so its `flush()` does not guarantee that the latest step is on disk).
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import operator
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxrl_post.errors import UserError

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Distinguishes event files created in the same second by one process (the file name only
# carries a whole-second timestamp, and a name clash would truncate the earlier file).
_EVENT_FILE_IDS = itertools.count()
_TAIL_CHUNK = 1 << 16


class MetricsWriter:
  """Writes per-step metrics to `metrics.jsonl` and, optionally, TensorBoard.

  Only one process should write a workdir (the training loop's host 0). On a resumed run,
  call `truncate_after(restored_step)` before the first `write` so that steps logged after
  the checkpoint by the previous run are not duplicated.
  """

  def __init__(self, workdir: str, tensorboard: bool = True):
    """Opens `<workdir>/metrics.jsonl` for appending, creating the workdir if needed.

    A torn last line left by a killed run is removed first (or terminated, if it happens to
    be complete JSON), so that the next line starts on a fresh line instead of being glued
    to the fragment and corrupting both.

    Args:
      workdir: Run directory.
      tensorboard: Also write TensorBoard event files under `<workdir>/tensorboard`.
    """
    self.workdir = os.fspath(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    self.tensorboard_dir = os.path.join(self.workdir, TENSORBOARD_DIR) if tensorboard else None
    os.makedirs(self.workdir, exist_ok=True)
    _repair_tail(self.path)
    self._file = open(self.path, "a", encoding="utf-8")
    self._events = None  # Created on first write, so a run that logs nothing leaves no file.
    self._purge_step: int | None = None

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Appends one line for `step` and logs its finite scalars to TensorBoard; returns the
    record as written (plain Python values: `to_json_value`).

    Args:
      step: Training step (an integer, numpy integers included).
      metrics: Metric name to value: Python or numpy scalars, 0-d arrays, anything with
        `__array__` (e.g. device arrays), strings, or lists/arrays of numbers such as
        histograms.

    Raises:
      ValueError: If the writer is closed or a metric is named "step".
      TypeError: If a name is not a string or a value cannot be represented in JSON.
    """
    if self._file is None:
      raise ValueError("MetricsWriter.write() after close()")
    step = operator.index(step)
    record = {"step": step}
    for name in sorted(_check_names(metrics)):
      record[name] = to_json_value(metrics[name], name)
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self.tensorboard_dir is not None:
      self._write_scalars(step, record)
    return record

  def truncate_after(self, step: int) -> None:
    """Keeps only the lines with `"step" <= step`; for resuming from a checkpoint at `step`.

    The file is rewritten to a temporary file and swapped in with `os.replace`, so a crash
    during truncation leaves either the old or the new file, never a partial one. A torn
    last line is dropped. Kept lines are copied byte for byte.

    TensorBoard needs no rewrite: the next event file starts with a session-start event at
    `step + 1`, and TensorBoard then hides the earlier run's events at or after that step
    (it also discards out-of-order steps on its own), so the resumed curves do not overlap.

    Args:
      step: Last step whose metrics are kept.

    Raises:
      ValueError: If the writer is closed.
      UserError: If a line other than the last one is not valid JSON or has no step.
    """
    if self._file is None:
      raise ValueError("MetricsWriter.truncate_after() after close()")
    step = operator.index(step)
    self._file.close()
    kept = [line for line, record in _parse_lines(self.path) if _step_of(record) <= step]
    _replace_file(self.path, "".join(kept))
    self._file = open(self.path, "a", encoding="utf-8")
    self._close_events()
    self._purge_step = step + 1

  def close(self) -> None:
    """Flushes and closes both outputs; safe to call more than once."""
    if self._file is not None:
      self._file.close()
      self._file = None
    self._close_events()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _write_scalars(self, step: int, record: Mapping[str, Any]) -> None:
    """Logs the record's finite numbers as one TensorBoard event and flushes it."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=name, simple_value=float(value))
              for name, value in record.items()
              if name != "step" and _is_finite_number(value)]
    if not values:
      return
    events = self._open_events()
    events.write_event(Event(step=step, wall_time=time.time(), summary=Summary(value=values)))
    events.flush()

  def _open_events(self):
    """Returns the event file writer, starting a new event file if none is open."""
    if self._events is None:
      # Imported here so that importing telemetry (and tensorboard=False runs) stay light.
      from tensorboardX.event_file_writer import EventsWriter
      from tensorboardX.proto.event_pb2 import Event, SessionLog

      os.makedirs(self.tensorboard_dir, exist_ok=True)
      suffix = f".{os.getpid()}.{next(_EVENT_FILE_IDS)}"
      self._events = EventsWriter(os.path.join(self.tensorboard_dir, "events"), suffix)
      if self._purge_step is not None:
        start = SessionLog(status=SessionLog.START)
        self._events.write_event(
            Event(step=self._purge_step, wall_time=time.time(), session_log=start))
    return self._events

  def _close_events(self) -> None:
    """Flushes and closes the current event file; the next write starts a new one."""
    if self._events is not None:
      self._events.close()
      self._events = None


class DiscardMetrics:
  """The writer of every process but the first in a multi-host run: the same calls, no files
  (process 0 writes the run's metrics and TensorBoard events for everyone)."""

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    del step, metrics

  def truncate_after(self, step: int) -> None:
    del step

  def close(self) -> None:
    pass


def read_metrics(path: str) -> list[dict[str, Any]]:
  """Reads a metrics.jsonl file written by `MetricsWriter`.

  A torn last line (the run was killed mid-write) is skipped; a bad line elsewhere means
  the file is corrupt and is reported rather than silently skipped.

  Args:
    path: Path of a metrics.jsonl file.

  Returns:
    One dict per line, in file order. Non-finite floats appear as "nan"/"inf"/"-inf".

  Raises:
    UserError: If the file is missing or a line other than the last is not valid JSON.
  """
  return [record for _, record in _parse_lines(path)]


def to_json_value(value: Any, name: str = "value") -> Any:
  """Converts a metric value to plain Python that `json.dumps` writes as strict JSON.

  Args:
    value: Python/numpy scalar, 0-d or n-d array, array-like with `__array__`, string,
      None, or a list/tuple of those.
    name: Metric name, used only in the error message.

  Returns:
    bool, int, float (finite), str ("nan"/"inf"/"-inf" for non-finite floats), None or a
    (nested) list of those.

  Raises:
    TypeError: For values with no JSON representation (dicts, complex numbers, objects).
  """
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return _float_to_json(float(value))
  if isinstance(value, (list, tuple)):
    return [to_json_value(item, name) for item in value]
  if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
    array = np.asarray(value)
    if array.dtype.kind in "biuf":
      return to_json_value(array.item() if array.ndim == 0 else array.tolist(), name)
  raise TypeError(f"metric {name!r} has a value of type {type(value).__name__} that cannot be "
                  "written as JSON")


def _float_to_json(value: float) -> float | str:
  """Keeps finite floats; spells non-finite ones as strings (see module docstring)."""
  if math.isfinite(value):
    return value
  if math.isnan(value):
    return "nan"
  return "inf" if value > 0 else "-inf"


def _is_finite_number(value: Any) -> bool:
  """Whether a converted value is a TensorBoard scalar (bools count as 0/1)."""
  return isinstance(value, (bool, int, float)) and math.isfinite(value)


def _check_names(metrics: Mapping[str, Any]) -> Mapping[str, Any]:
  """Rejects names that would break the line format; returns `metrics` unchanged."""
  for name in metrics:
    if not isinstance(name, str):
      raise TypeError(f"metric names must be strings, got {name!r}")
    if name == "step":
      raise ValueError("metric name 'step' is reserved for the step number")
  return metrics


def truncate_jsonl(path: str, step: int) -> None:
  """Keeps the lines of a run's side log (e.g. dead letters) with `"step" <= step`, as
  `MetricsWriter.truncate_after` does for metrics: steps recomputed after a resume then log
  their records once. Lines without an integer step are kept; a missing file is fine."""
  if not os.path.exists(path):
    return
  kept = [line for line, record in _parse_lines(path)
          if not isinstance(record, dict) or not isinstance(record.get("step"), int)
          or record["step"] <= step]
  _replace_file(path, "".join(kept))


def _parse_lines(path: str) -> list[tuple[str, dict[str, Any]]]:
  """Returns (raw line with newline, parsed object) pairs, skipping a torn last line."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except FileNotFoundError:
    raise UserError(f"metrics file not found: {path}") from None
  parsed = []
  for index, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if index == len(lines) - 1:
        break
      raise UserError(f"{path}:{index + 1}: not a JSON line; the metrics file is corrupt") from None
    parsed.append((line if line.endswith("\n") else line + "\n", record))
  return parsed


def _step_of(record: Any) -> int:
  """The integer step of a parsed line, for truncation."""
  if isinstance(record, dict) and isinstance(record.get("step"), int):
    return record["step"]
  raise UserError(f"metrics line without an integer 'step': {json.dumps(record)[:200]}")


def _replace_file(path: str, text: str) -> None:
  """Atomically replaces `path` with `text` (write, fsync, rename in the same directory)."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _repair_tail(path: str) -> None:
  """Makes the file end with a newline: drops a torn last line, terminates a complete one."""
  try:
    f = open(path, "r+b")
  except FileNotFoundError:
    return
  with f:
    size = f.seek(0, os.SEEK_END)
    start = _line_start_before(f, size)
    f.seek(start)
    tail = f.read()
    if not tail:
      return
    if _is_json_object(tail):
      f.write(b"\n")
    else:
      f.truncate(start)


def _is_json_object(data: bytes) -> bool:
  try:
    return isinstance(json.loads(data), dict)
  except ValueError:  # Includes UnicodeDecodeError from a cut multi-byte character.
    return False


def _line_start_before(f, end: int) -> int:
  """Offset just past the last newline before `end` (0 if none), scanning backwards."""
  pos = end
  while pos > 0:
    begin = max(0, pos - _TAIL_CHUNK)
    f.seek(begin)
    newline = f.read(pos - begin).rfind(b"\n")
    if newline >= 0:
      return begin + newline + 1
    pos = begin
  return 0
