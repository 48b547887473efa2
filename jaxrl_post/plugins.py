"""Your own task, environment or config, configurable in gin as the built-in ones are.

    import dataclasses
    import jaxrl_post

    @jaxrl_post.register
    @dataclasses.dataclass(frozen=True)
    class ReverseTask:
      ...  # name, split(), score(), skipped: see jaxrl_post.rewards.Task

A gin file then says `Experiment.task = @ReverseTask()` and `ReverseTask.max_length = 6`,
and the commands import the module before they parse it: `python -m jaxrl_post.train
--gin_import=my_tasks --gin_file=...` (or the gin file's own `import my_tasks` line). An
environment (a subclass of jaxrl_post.envs.Environment) is registered the same way.

A registration waits here until the gin registry (pipeline/config.py) is loaded, so a
module of tasks costs no jax to import: verifier worker processes import it to unpickle
the task, and they never touch an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
from typing import Callable, Optional, Sequence, TypeVar

from jaxrl_post.errors import UserError

T = TypeVar("T", bound=type)

_MODULE = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

_sink: Optional[Callable[[type], None]] = None  # The gin registry, once loaded.
_pending: list[type] = []


def register(cls: T) -> T:
  """Class decorator: makes a dataclass configurable in gin under its class name.

  Each field is a gin parameter (`ReverseTask.max_length = 6`), and nested config fields
  are built in scopes as the built-in configs' are (pipeline/config.py).

  Raises:
    UserError: `cls` is not a dataclass, or its name is taken by another configurable.
  """
  if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
    raise UserError(f"register: {cls!r} is not a dataclass; put @jaxrl_post.register "
                    "above @dataclasses.dataclass")
  if _sink is None:
    _pending.append(cls)
  else:
    _sink(cls)
  return cls


def attach(sink: Callable[[type], None]) -> None:
  """Called once by the gin registry: registers what waited, and from now on at once."""
  global _sink
  _sink = sink
  while _pending:
    sink(_pending.pop(0))


def add_import_flag(parser: argparse.ArgumentParser) -> None:
  """--gin_import=MODULE (repeatable), for every command that parses gin files."""
  parser.add_argument("--gin_import", action="append", default=[], metavar="MODULE",
                      help="import a module of your own tasks or environments (registered "
                           "with jaxrl_post.register) before the gin files are parsed")


def import_modules(names: Sequence[str]) -> None:
  """Imports each --gin_import module; a missing or broken one is one UserError line."""
  for name in names:
    _import(name)


def import_lines(names: Sequence[str]) -> list[str]:
  """The gin `import` statements of the modules, as bindings: gin then writes them into the
  config it prints, so a run's config.gin parses again (evaluate --checkpoint, export)."""
  return [f"import {name}" for name in names]


def _import(name: str) -> None:
  flag = f"--gin_import={name}"
  if not _MODULE.fullmatch(name):
    dotted = name.removesuffix(".py").replace("/", ".").strip(".")
    raise UserError(f"{flag}: not a module name; give one as Python imports it, "
                    f"e.g. {dotted!r}, not a path")
  try:
    importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name and (name == e.name or name.startswith(e.name + ".")):
      raise UserError(f"{flag}: no module named {e.name!r} (run from the directory that "
                      "holds it, or add that directory to PYTHONPATH)") from e
    raise UserError(f"{flag}: cannot import it: {e}") from e  # One of its own imports.
  except ImportError as e:
    raise UserError(f"{flag}: cannot import it: {e}") from e
  except SyntaxError as e:
    raise UserError(f"{flag}: {e.filename}:{e.lineno}: {e.msg}") from e
