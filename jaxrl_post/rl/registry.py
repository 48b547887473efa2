"""Name -> pure function tables for the RL maths, checked when a config is created.

Configs name their loss, aggregation, KL estimator or advantage estimator by string so
that gin files stay plain data. Each table is a `Registry`; a config's `__post_init__`
calls `check`, so a typo fails when the config loads, with one line naming the field and
the known names, rather than as a KeyError deep inside a jitted step.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxrl_post.errors import UserError


class Registry:
  """Entries of one kind, registered by name at import time."""

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, Any] = {}

  def register(self, name: str) -> Callable[[Any], Any]:
    """Decorator storing its argument under `name`; duplicate names are a bug."""

    def add(entry):
      if name in self._entries:
        raise ValueError(f"{self.kind} {name!r} is registered twice")
      self._entries[name] = entry
      return entry

    return add

  def names(self) -> tuple[str, ...]:
    return tuple(sorted(self._entries))

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def check(self, owner: str, field: str, name: str) -> None:
    """Raises a one-line UserError when `name` is not registered."""
    if name not in self._entries:
      raise UserError(f"{owner}: {field}={name!r} is not a known {self.kind} "
                      f"(known: {', '.join(self.names())})")

  def get(self, name: str) -> Any:
    """The entry for a name already validated by `check` (configs do so on creation)."""
    return self._entries[name]
