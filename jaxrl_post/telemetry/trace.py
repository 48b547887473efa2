"""A timeline of the roles, as a Chrome / Perfetto trace: `<workdir>/trace.json`.

Open it at https://ui.perfetto.dev (or chrome://tracing). Each RL step is one slice on the
"step" track; below it the loop's roles (rollout, reward, advantage, pack, train, sync and
the time between them, "waiting"), and on their own threads' tracks the calls made inside
them (the engine's prefill and decode calls, evaluation, checkpoint saves). Work that runs
concurrently on other threads (verifier threads, an asynchronous driver) lands on those
threads' tracks, so overlap shows as overlap.

The file is the Trace Event Format's JSON array form, one event per line ("[", `{...}`,
`,{...}`, ..., and "]" once the run closes it: then it is strict JSON). Trace viewers
accept the array without its closing bracket, so the file opens while the run is still
writing it, and a killed run loses at most one line.
Each event carries its RL step in `args.step`, so a resumed run cuts the file back to the
restored step (`truncate_after`), as it does metrics.jsonl. Timestamps are wall-clock
microseconds, so a resumed run continues the same timeline.

A leaf module: no jax, no other jaxrl_post modules.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any, Callable, Iterable, Optional

TRACE_FILE = "trace.json"
_PID = 1  # One process track: the trainer's host process.


class TraceWriter:
  """Appends complete ("X") events to `<workdir>/trace.json`, thread-safe.

  Times passed in are on `clock` (time.perf_counter by default, as StepTimer's); they are
  moved onto the wall clock once, when the writer opens, so one run's events line up.
  """

  def __init__(self, workdir: str, clock: Callable[[], float] = time.perf_counter):
    self.path = os.path.join(os.fspath(workdir), TRACE_FILE)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    self._offset = time.time() - clock()
    self._clock = clock
    self._lock = threading.Lock()
    self._threads: dict[int, int] = {}  # thread ident -> small track id (1: the loop)
    self._names: list[dict] = []
    self.step = 0  # Stamped on events recorded without an explicit step.
    self._file = None
    self._reopen([json.dumps(e, separators=(",", ":"))
                  for e in _parse(_read_lines(self.path))])
    self._track(threading.get_ident(), "loop")
    self._file.flush()

  def now(self) -> float:
    return self._clock()

  def span(self, name: str, begin: float, end: float, *, cat: str = "role",
           step: Optional[int] = None, tid: Optional[int] = None,
           args: Optional[dict] = None) -> None:
    """One complete event from `begin` to `end` (seconds on the writer's clock)."""
    event = {"name": name, "cat": cat, "ph": "X", "pid": _PID,
             "tid": tid if tid is not None else self._track(threading.get_ident()),
             "ts": round((begin + self._offset) * 1e6, 1),
             "dur": round(max(end - begin, 0.0) * 1e6, 1),
             "args": {"step": self.step if step is None else step, **(args or {})}}
    self._write(event)

  def step_timeline(self, step: int, step_span: tuple[float, float],
                    spans: Iterable[tuple[str, float, float]]) -> None:
    """A step's slice (track "step") and its roles' (track "roles"), the gaps between
    roles as "waiting" slices, from a StepTimer's `step_span` and `spans`."""
    begin, end = step_span
    self.span(f"step {step}", begin, end, cat="step", step=step, tid=self._named("step"))
    roles = self._named("roles")
    cursor = begin
    for name, b, e in sorted(spans, key=lambda s: s[1]):
      if b > cursor:
        self.span("waiting", cursor, b, cat="waiting", step=step, tid=roles)
      self.span(name, b, e, cat="role", step=step, tid=roles)
      cursor = max(cursor, e)
    if end > cursor:
      self.span("waiting", cursor, end, cat="waiting", step=step, tid=roles)

  def instant(self, name: str, *, step: Optional[int] = None,
              args: Optional[dict] = None) -> None:
    """A global instant event (an alarm, say), drawn across every track."""
    self._write({"name": name, "cat": "alarm", "ph": "i", "s": "g", "pid": _PID,
                 "tid": self._named("step"), "ts": round((self.now() + self._offset) * 1e6, 1),
                 "args": {"step": self.step if step is None else step, **(args or {})}})

  def truncate_after(self, step: int) -> None:
    """Keeps the events of steps <= `step` (and the track names); for a resumed run."""
    with self._lock:
      self._file.close()
      kept = [e for e in _parse(_read_lines(self.path))
              if e.get("ph") == "M" or e.get("args", {}).get("step", 0) <= step]
      self._reopen([json.dumps(e, separators=(",", ":")) for e in kept])

  def close(self) -> None:
    """Ends the array (the file is then strict JSON); a later writer reopens it."""
    with self._lock:
      if self._file is not None:
        self._file.write("]\n")
        self._file.close()
        self._file = None

  def _reopen(self, events: list[str]) -> None:
    """Rewrites the file as "[" and `events` (JSON texts), left open for appending."""
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write("[\n" + "".join(("," if i else "") + e + "\n" for i, e in enumerate(events)))
    os.replace(tmp, self.path)
    self._count = len(events)
    self._file = open(self.path, "a", encoding="utf-8")

  # ------------------------------------------------------------------ tracks

  def _named(self, label: str) -> int:
    """A track of its own for `label` (not a thread): "step", "roles"."""
    return self._track(hash(("track", label)), label)

  def _track(self, key: int, label: Optional[str] = None) -> int:
    with self._lock:
      tid = self._threads.get(key)
      if tid is None:
        tid = self._threads[key] = len(self._threads) + 1
        label = label or threading.current_thread().name
        self._write_locked({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid,
                            "args": {"name": label}})
        self._write_locked({"name": "thread_sort_index", "ph": "M", "pid": _PID, "tid": tid,
                            "args": {"sort_index": tid}})
    return tid

  def _write(self, event: dict) -> None:
    with self._lock:
      self._write_locked(event)

  def _write_locked(self, event: dict) -> None:
    if self._file is None:
      return
    self._file.write(("," if self._count else "") + json.dumps(event, separators=(",", ":"))
                     + "\n")
    self._count += 1
    self._file.flush()


def instrument(obj: Any, methods: Iterable[str], trace: TraceWriter, cat: str,
               prefix: str = "") -> Callable[[], None]:
  """Wraps `obj`'s bound methods so each call is a slice on its thread's track.

  The wrappers are instance attributes: the class, and other instances, are untouched.
  Returns a function that removes them again.
  """
  saved = {}
  for name in methods:
    original = getattr(obj, name)
    saved[name] = vars(obj).get(name)  # None: the class's method

    @functools.wraps(original)
    def traced(*args, _original=original, _label=prefix + name, **kwargs):
      begin = trace.now()
      try:
        return _original(*args, **kwargs)
      finally:
        trace.span(_label, begin, trace.now(), cat=cat)

    setattr(obj, name, traced)

  def undo() -> None:
    for name, own in saved.items():
      if own is None:
        delattr(obj, name)
      else:
        setattr(obj, name, own)

  return undo


def read_trace(path: str) -> list[dict]:
  """The events of a trace file written by TraceWriter (a torn last line skipped)."""
  return list(_parse(_read_lines(path)))


def _read_lines(path: str) -> list[str]:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().splitlines()
  except FileNotFoundError:
    return []


def _parse(lines: Iterable[str]) -> Iterable[dict]:
  """Events of the file's lines: brackets and a torn line (a killed run's) skipped."""
  for line in lines:
    line = line.strip().lstrip(",").rstrip(",")
    if not line or line in ("[", "]"):
      continue
    try:
      event = json.loads(line)
    except ValueError:
      continue
    if isinstance(event, dict):
      yield event
