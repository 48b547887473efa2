"""Counting XLA compilations, so a run that keeps recompiling shows it in its metrics.

Every distinct input shape of a jitted function is one more backend compile (seconds to
minutes at real sizes); a run whose shapes come from fixed buckets compiles a bounded set
and then none. The loop logs `compile/programs` (this process's total so far) and
`compile/new_programs` (during the step) from this counter.
"""

from __future__ import annotations

import collections
import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
  """Backend compilations in this process while the counter is open, by function name."""

  def __init__(self):
    self.by_function: collections.Counter = collections.Counter()
    self.seconds = 0.0
    self._lock = threading.Lock()

  @property
  def total(self) -> int:
    return sum(self.by_function.values())

  def _record(self, event: str, duration: float, **kwargs) -> None:
    if event != _EVENT:
      return
    with self._lock:
      self.by_function[kwargs.get("fun_name", "?")] += 1
      self.seconds += duration

  def __enter__(self) -> "CompileCounter":
    jax.monitoring.register_event_duration_secs_listener(self._record)
    return self

  def __exit__(self, *exc_info) -> None:
    jax.monitoring.unregister_event_duration_listener(self._record)
