"""telemetry.trace: the role timeline as a Chrome / Perfetto trace."""

import json
import threading

from jaxrl_post.telemetry import StepTimer
from jaxrl_post.telemetry.trace import TraceWriter, instrument, read_trace


class _Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def _step(timer, clock, step_roles):
  timer.start()
  for name, gap, seconds in step_roles:
    clock.t += gap
    with timer.role(name):
      clock.t += seconds
  clock.t += 0.5
  timer.stop()


def test_step_timeline_has_the_step_its_roles_and_the_waiting_between(tmp_path):
  clock = _Clock()
  trace, timer = TraceWriter(str(tmp_path), clock=clock), StepTimer(clock=clock)
  _step(timer, clock, [("rollout", 0.0, 2.0), ("reward", 0.25, 1.0), ("train", 0.0, 3.0)])
  trace.step_timeline(1, timer.step_span, timer.spans)
  trace.close()
  events = json.loads((tmp_path / "trace.json").read_text())  # Strict JSON once closed.
  slices = [(e["name"], e["dur"]) for e in events if e["ph"] == "X"]
  assert slices == [("step 1", 6.75e6), ("rollout", 2e6), ("waiting", 0.25e6), ("reward", 1e6),
                    ("train", 3e6), ("waiting", 0.5e6)]
  tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
  assert {tracks[e["tid"]] for e in events if e["ph"] == "X"} == {"step", "roles"}
  assert all(e["args"]["step"] == 1 for e in events if e["ph"] == "X")


def test_open_file_is_readable_and_a_resume_cuts_it_back(tmp_path):
  clock = _Clock()
  trace, timer = TraceWriter(str(tmp_path), clock=clock), StepTimer(clock=clock)
  for step in (1, 2, 3):
    _step(timer, clock, [("train", 0.0, 1.0)])
    trace.step_timeline(step, timer.step_span, timer.spans)
  # Still open: an unterminated array, as trace viewers accept it.
  text = (tmp_path / "trace.json").read_text()
  assert text.startswith("[\n") and not text.rstrip().endswith("]")
  json.loads(text + "]")
  with open(tmp_path / "trace.json", "a") as f:
    f.write(',{"name": "torn')  # A killed run's last line.
  trace.close()
  resumed = TraceWriter(str(tmp_path), clock=clock)
  resumed.truncate_after(2)
  resumed.close()
  steps = {e["args"]["step"] for e in read_trace(str(tmp_path / "trace.json")) if e["ph"] == "X"}
  assert steps == {1, 2}
  json.loads((tmp_path / "trace.json").read_text())


def test_instrumented_calls_land_on_their_threads_track(tmp_path):
  class Engine:
    def generate(self, n):
      return n + 1

  engine, other = Engine(), Engine()
  trace = TraceWriter(str(tmp_path))
  undo = instrument(engine, ["generate"], trace, cat="rollout")
  assert engine.generate(1) == 2 and other.generate(1) == 2
  worker = threading.Thread(target=engine.generate, args=(5,), name="verifier-0")
  worker.start()
  worker.join()
  undo()
  assert "generate" not in vars(engine)
  trace.close()
  events = read_trace(str(tmp_path / "trace.json"))
  tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
  calls = [tracks[e["tid"]] for e in events if e["name"] == "generate"]
  assert calls == ["loop", "verifier-0"]
