"""Request ids a client polls with retrieve_future, and their results once known.

A result is kept for `keep_s` seconds after it is ready, then dropped: a server that runs
for days would otherwise hold every sample and forward_backward output it ever answered.
The SDK polls a request until it has the result, so a result stays only while a client
that lost a reply could still ask again; an id dropped since answers a failed result that
says so, rather than "unknown".
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Optional, Union


@dataclasses.dataclass(frozen=True)
class Result:
  payload: Union[dict, bytes]  # JSON, or a serialised protobuf message
  failed: bool = False

  @property
  def proto(self) -> bool:
    return isinstance(self.payload, bytes)


class Futures:
  """Thread-safe: the HTTP handlers create and wait, the worker resolves."""

  def __init__(self, keep_s: float, clock: Callable[[], float] = time.monotonic):
    self._cv = threading.Condition()
    self._results: dict[str, Optional[Result]] = {}
    self._next = 0
    self._keep_s, self._clock = keep_s, clock
    self._ready: collections.deque[tuple[float, str]] = collections.deque()  # Oldest first.

  def create(self) -> str:
    with self._cv:
      self._drop_old()
      rid = f"req-{self._next}"
      self._next += 1
      self._results[rid] = None
      return rid

  def resolve(self, rid: str, payload: Union[dict, bytes]) -> None:
    self._set(rid, Result(payload))

  def fail(self, rid: str, message: str, category: str = "user") -> None:
    """Fails a request still pending (one resolved already keeps its result)."""
    self._set(rid, Result({"error": message, "category": category}, failed=True))

  def _set(self, rid: str, result: Result) -> None:
    with self._cv:
      if rid not in self._results or self._results[rid] is not None:
        return
      self._results[rid] = result
      self._ready.append((self._clock(), rid))
      self._cv.notify_all()

  def _drop_old(self) -> None:
    cutoff = self._clock() - self._keep_s
    while self._ready and self._ready[0][0] < cutoff:
      del self._results[self._ready.popleft()[1]]

  def known(self, rid: str) -> bool:
    """Whether this server gave out `rid` (its result may have been dropped since)."""
    number = rid[len("req-"):] if isinstance(rid, str) and rid.startswith("req-") else ""
    with self._cv:
      return number.isdigit() and int(number) < self._next and number == str(int(number))

  def held(self) -> int:
    """Requests pending or with a result still kept."""
    with self._cv:
      return len(self._results)

  def wait(self, rid: str, timeout: float) -> Optional[Result]:
    """The result, or None if it is not ready within `timeout` seconds."""
    with self._cv:
      self._drop_old()
      if rid not in self._results:
        return Result({"error": f"request_id {rid}: its result was dropped {self._keep_s:g} s "
                                "after it was ready (ServeConfig.keep_results_s)",
                       "category": "user"}, failed=True)
      self._cv.wait_for(lambda: self._results.get(rid) is not None, timeout)
      return self._results.get(rid)
