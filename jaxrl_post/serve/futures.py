"""Request ids a client polls with retrieve_future, and their results once known."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Optional, Union


@dataclasses.dataclass(frozen=True)
class Result:
  payload: Union[dict, bytes]  # JSON, or a serialised protobuf message
  failed: bool = False

  @property
  def proto(self) -> bool:
    return isinstance(self.payload, bytes)


class Futures:
  """Thread-safe: the HTTP handlers create and wait, the worker resolves."""

  def __init__(self):
    self._cv = threading.Condition()
    self._results: dict[str, Optional[Result]] = {}
    self._ids = itertools.count()

  def create(self) -> str:
    with self._cv:
      rid = f"req-{next(self._ids)}"
      self._results[rid] = None
      return rid

  def resolve(self, rid: str, payload: Union[dict, bytes]) -> None:
    self._set(rid, Result(payload))

  def fail(self, rid: str, message: str, category: str = "user") -> None:
    """Fails a request still pending (one resolved already keeps its result)."""
    self._set(rid, Result({"error": message, "category": category}, failed=True))

  def _set(self, rid: str, result: Result) -> None:
    with self._cv:
      if self._results.get(rid) is not None:
        return
      self._results[rid] = result
      self._cv.notify_all()

  def known(self, rid: str) -> bool:
    with self._cv:
      return rid in self._results

  def wait(self, rid: str, timeout: float) -> Optional[Result]:
    """The result, or None if it is not ready within `timeout` seconds."""
    with self._cv:
      self._cv.wait_for(lambda: self._results.get(rid) is not None, timeout)
      return self._results.get(rid)
