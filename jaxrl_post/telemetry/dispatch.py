"""Counting what a block of code asks of the devices: programs executed, host fetches.

A step that dispatches many small programs, or waits for the devices several times, spends
its time in dispatch and round trips rather than in FLOPs, and a device profile does not
show it. `DispatchCensus` records, while it is open, every compiled program the process
executes (jitted functions and the one-op programs of eager jnp calls alike) and every
device-to-host fetch, each under the section (`census.section(name)`) it happened in.

How it counts, and what that costs:

* Programs: JAX's C++ dispatch runs a cached program without entering Python, so the census
  turns that fast path off while open (clearing the C++ dispatch caches on entry) and wraps
  `pjit._pjit_call_impl_python`, which every execution then passes through. Compiled
  executables stay cached, so nothing recompiles; calls only dispatch more slowly, so take
  the census of a step that is not timed. These are JAX internals (checked on jax 0.11):
  the census refuses to open where they are missing rather than count nothing.
* Fetches: one `jax.device_get` of a whole pytree is one round trip (its leaves copy
  concurrently); any other read of an array's value (`np.asarray`, `float`, `int`, `bool`,
  `.tolist()`, `.item()`), all of which go through `ArrayImpl._value`, is one more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import jax
from jax._src import array as _array
from jax._src import pjit as _pjit


@dataclasses.dataclass
class Program:
  """One compiled program the census saw run.

  Attributes:
    name: the jitted function's name (an eager op's program is named after its primitive).
    executable: the compiled executable (`cost_analysis()`, `as_text()`).
    jaxpr: the ClosedJaxpr it was compiled from.
    calls: executions per section.
  """

  name: str
  executable: Any
  jaxpr: Any
  calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class DispatchCensus:
  """Programs executed and host fetches while open, per section. Not reentrant."""

  def __init__(self):
    self.programs: dict[int, Program] = {}  # id(executable) -> Program
    self.fetches: collections.Counter = collections.Counter()
    self._section = "-"
    self._local = threading.local()
    self._saved: dict[str, Any] = {}

  @contextlib.contextmanager
  def section(self, name: str) -> Iterator[None]:
    """Attributes what runs inside to `name` (sections do not nest)."""
    before, self._section = self._section, name
    try:
      yield
    finally:
      self._section = before

  def executions(self, section: str | None = None) -> int:
    """Program executions in `section` (all sections when None)."""
    return sum(_in(p.calls, section) for p in self.programs.values())

  def distinct(self, section: str | None = None) -> int:
    """Distinct programs executed in `section` (all sections when None)."""
    return sum(1 for p in self.programs.values() if _in(p.calls, section))

  def round_trips(self, section: str | None = None) -> int:
    """Device-to-host fetches in `section` (all sections when None)."""
    return _in(self.fetches, section)

  # ------------------------------------------------------------------ hooks

  def _call(self, *args, jaxpr, name, **kwargs):
    out = self._saved["call"](*args, jaxpr=jaxpr, name=name, **kwargs)
    executable = out[1]
    program = self.programs.get(id(executable))
    if program is None:
      program = self.programs[id(executable)] = Program(name, executable, jaxpr)
    program.calls[self._section] += 1
    return out

  def _device_get(self, tree):
    if getattr(self._local, "fetching", False):
      return self._saved["device_get"](tree)
    self.fetches[self._section] += 1
    self._local.fetching = True
    try:
      return self._saved["device_get"](tree)
    finally:
      self._local.fetching = False

  def _value_of(self, array):
    if not getattr(self._local, "fetching", False):
      self.fetches[self._section] += 1
    return self._saved["value"].fget(array)

  def __enter__(self) -> "DispatchCensus":
    for name in ("_pjit_call_impl_python", "_get_fastpath_data", "_cpp_pjit_cache_fun_only",
                 "_cpp_pjit_cache_explicit_attributes"):
      if not hasattr(_pjit, name):
        raise RuntimeError(f"DispatchCensus: jax {jax.__version__} has no pjit.{name}")
    census = self
    self._saved = {"call": _pjit._pjit_call_impl_python, "fastpath": _pjit._get_fastpath_data,
                   "device_get": jax.device_get, "value": _array.ArrayImpl._value}
    _pjit._pjit_call_impl_python = self._call
    _pjit._get_fastpath_data = lambda *args, **kwargs: None
    _pjit._cpp_pjit_cache_fun_only.clear()
    _pjit._cpp_pjit_cache_explicit_attributes.clear()
    jax.device_get = self._device_get
    _array.ArrayImpl._value = property(lambda array: census._value_of(array))
    return self

  def __exit__(self, *exc_info) -> None:
    _pjit._pjit_call_impl_python = self._saved["call"]
    _pjit._get_fastpath_data = self._saved["fastpath"]
    jax.device_get = self._saved["device_get"]
    _array.ArrayImpl._value = self._saved["value"]


def _in(counter: collections.Counter, section: str | None) -> int:
  return sum(counter.values()) if section is None else counter.get(section, 0)
