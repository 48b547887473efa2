"""MetricsWriter: JSON-lines format, value conversion, truncation and TensorBoard events."""

import glob
import json
import os
import struct

import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.telemetry import MetricsWriter, read_metrics, truncate_jsonl


def read_events(tb_dir):
  """Parses every event file under `tb_dir` from its TFRecord framing (no TensorBoard needed).

  Each record is: uint64 length, uint32 masked CRC of the length, the payload, uint32 masked
  CRC of the payload (little-endian). The CRCs are not checked here.
  """
  from tensorboardX.proto.event_pb2 import Event

  events = []
  for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack_from("<Q", data, pos)
      events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4
  return events


def scalars(events):
  return [(e.step, v.tag, v.simple_value) for e in events if e.HasField("summary")
          for v in e.summary.value]


def raw_lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return f.read().splitlines()


def test_lines_are_json_with_step_first_and_sorted_names(tmp_path):
  with MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(1, {"loss": 0.5, "alpha": 1, "time/step": 0.25})
    w.write(2, {"loss": 0.25})
  lines = raw_lines(tmp_path)
  assert len(lines) == 2
  first = json.loads(lines[0])
  assert list(first) == ["step", "alpha", "loss", "time/step"]
  assert first == {"step": 1, "alpha": 1, "loss": 0.5, "time/step": 0.25}
  assert read_metrics(str(tmp_path / "metrics.jsonl"))[1] == {"step": 2, "loss": 0.25}
  assert not (tmp_path / "tensorboard").exists()


def test_numpy_and_array_values_become_plain_python(tmp_path):
  class DeviceArray:  # Stands in for a jax array: only exposes __array__.
    def __array__(self, dtype=None, copy=None):
      return np.array(3.5, dtype=np.float32)

  with MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(np.int64(7), {"f32": np.float32(0.5), "i64": np.int64(3), "b": np.bool_(True),
                          "zero_d": np.array(2.0), "hist": np.array([1, 2, 3]),
                          "list": [np.float16(1.0), 2], "dev": DeviceArray(), "flag": False,
                          "name": "grpo", "missing": None})
  (record,) = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert record == {"step": 7, "b": True, "dev": 3.5, "f32": 0.5, "flag": False,
                    "hist": [1, 2, 3], "i64": 3, "list": [1.0, 2], "missing": None,
                    "name": "grpo", "zero_d": 2.0}
  assert type(record["i64"]) is int and type(record["b"]) is bool
  assert type(record["hist"][0]) is int


def test_non_finite_values_are_strings_and_file_stays_strict_json(tmp_path):
  with MetricsWriter(str(tmp_path)) as w:
    w.write(1, {"nan": float("nan"), "inf": np.float32("inf"), "ninf": -np.inf,
                "hist": [1.0, float("nan")], "ok": 1.0})
  (line,) = raw_lines(tmp_path)
  record = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
  assert record == {"step": 1, "hist": [1.0, "nan"], "inf": "inf", "nan": "nan",
                    "ninf": "-inf", "ok": 1.0}
  # Only the finite scalar reaches TensorBoard.
  assert scalars(read_events(str(tmp_path / "tensorboard"))) == [(1, "ok", 1.0)]


def test_bad_metrics_raise(tmp_path):
  with MetricsWriter(str(tmp_path), tensorboard=False) as w:
    with pytest.raises(ValueError, match="reserved"):
      w.write(1, {"step": 3})
    with pytest.raises(TypeError, match="'cfg'"):
      w.write(1, {"cfg": {"a": 1}})
    with pytest.raises(TypeError):
      w.write(1.5, {"a": 1})
  with pytest.raises(ValueError, match="close"):
    w.write(2, {"a": 1})


def test_tensorboard_events_hold_scalars_and_are_flushed_per_write(tmp_path):
  w = MetricsWriter(str(tmp_path))
  w.write(3, {"reward/mean": 0.75, "ok": True, "hist": [1, 2], "tag": "x"})
  # Read before close(): each write must already be on disk.
  files = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert len(files) == 1 and os.path.getsize(files[0]) > 0
  assert sorted(scalars(read_events(str(tmp_path / "tensorboard")))) == [
      (3, "ok", 1.0), (3, "reward/mean", 0.75)]
  w.close()
  w.close()  # Idempotent.


def test_truncate_after_drops_later_lines_and_torn_tail(tmp_path):
  path = tmp_path / "metrics.jsonl"
  with MetricsWriter(str(tmp_path)) as w:
    for step in range(1, 6):
      w.write(step, {"loss": float(step)})
  with open(path, "a") as f:
    f.write('{"step": 6, "lo')  # A run killed mid-line.
  assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3, 4, 5]

  with MetricsWriter(str(tmp_path)) as w:
    w.truncate_after(3)
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3]
    w.write(4, {"loss": 40.0})
  assert read_metrics(str(path))[-1] == {"step": 4, "loss": 40.0}
  assert all(json.loads(line) for line in raw_lines(tmp_path))
  assert not os.path.exists(str(path) + ".tmp")

  # The resumed event file starts with a session start at step 4, which makes TensorBoard
  # hide the first run's events from step 4 on.
  events = read_events(str(tmp_path / "tensorboard"))
  starts = [e.step for e in events if e.HasField("session_log")]
  assert starts == [4]
  assert (4, "loss", 40.0) in scalars(events)


def test_reopening_drops_torn_tail_before_appending(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2')
  with MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(2, {"a": 1})
  assert raw_lines(tmp_path) == ['{"step": 1}', '{"step": 2, "a": 1}']


def test_reopening_terminates_a_complete_unterminated_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}')
  with MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(2, {})
  assert [r["step"] for r in read_metrics(str(path))] == [1, 2]


def test_read_metrics_errors(tmp_path):
  with pytest.raises(UserError, match="not found"):
    read_metrics(str(tmp_path / "nope.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(UserError, match=":2:"):
    read_metrics(str(bad))


def test_truncate_jsonl_keeps_steps_up_to_the_checkpoint(tmp_path):
  path = tmp_path / "dead_letter.jsonl"
  truncate_jsonl(str(path), 3)  # no file yet: nothing to do
  assert not path.exists()
  lines = [{"step": 2, "key": "a"}, {"step": None, "key": "b"}, {"step": 4, "key": "c"},
           {"step": 3, "key": "d"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "ke')
  truncate_jsonl(str(path), 3)
  assert [json.loads(l)["key"] for l in path.read_text().splitlines()] == ["a", "b", "d"]
