"""Counting XLA compilations, so a run that keeps recompiling shows it in its metrics.

Every distinct input shape of a jitted function is one more backend compile (seconds to
minutes at real sizes); a run whose shapes come from fixed buckets compiles a bounded set
and then none. The loop logs `compile/programs` (this process's total so far),
`compile/new_programs` (during the step) and `compile/cached_programs` (loaded from the
persistent compilation cache during the step) from this counter.

Only programs XLA actually compiled are counted as programs. jax reports a program loaded
from the persistent cache (jaxrl_post.compile_cache) with the same backend-compile event
as a compiled one, preceded, in the same thread, by a cache-hit event; those are counted
apart, so a second run of the same config, or a resume, logs `compile/new_programs` 0.
"""

from __future__ import annotations

import collections
import threading

import jax

_COMPILE = "/jax/core/compile/backend_compile_duration"
# Recorded inside the compile event's span, in its thread, when the executable came from
# the persistent cache instead of XLA.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
  """Backend compilations in this process while the counter is open, by function name;
  programs loaded from the persistent compilation cache are counted in `cache_hits`."""

  def __init__(self):
    self.by_function: collections.Counter = collections.Counter()
    self.seconds = 0.0  # Spent in XLA compiling, cache loads excluded.
    self.cache_hits = 0
    self._lock = threading.Lock()
    self._thread = threading.local()  # Whether this thread's compile in flight was a hit.

  @property
  def total(self) -> int:
    return sum(self.by_function.values())

  def _record_hit(self, event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
      self._thread.hit = True

  def _record(self, event: str, duration: float, **kwargs) -> None:
    if event != _COMPILE:
      return
    hit, self._thread.hit = getattr(self._thread, "hit", False), False
    with self._lock:
      if hit:
        self.cache_hits += 1
      else:
        self.by_function[kwargs.get("fun_name", "?")] += 1
        self.seconds += duration

  def __enter__(self) -> "CompileCounter":
    jax.monitoring.register_event_listener(self._record_hit)
    jax.monitoring.register_event_duration_secs_listener(self._record)
    return self

  def __exit__(self, *exc_info) -> None:
    jax.monitoring.unregister_event_duration_listener(self._record)
    jax.monitoring.unregister_event_listener(self._record_hit)
