"""Checkpoints of a training run: Orbax arrays plus a JSON record of everything else.

A checkpoint holds the train state (parameters, optimizer state, step counters), the
reference parameters where they are not derivable, the rollout engine's weights where they
are not the train state's (a sync cadence above one step), and a JSON `meta` record: the RL step,
the weight version, the prompt iterator's state, counters, and whatever else the loop needs
to continue exactly where it stopped.

Atomicity comes from Orbax: a step is written into a temporary directory and renamed into
place only once every item is complete, so a save cut off mid-write (a killed process) leaves
a temporary directory that is never listed as a step, and is deleted on the next start.
Saves are asynchronous: the arrays are copied off the devices, then written by a background
thread while training continues.

With the trainer on some processes only (split placement across processes), those processes
save and restore (Orbax's active processes), and the others receive what they read -- the
latest step, the meta record -- from them; they hold no part of the arrays.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # Orbax's path type (an Orbax dependency)
from jax.sharding import Mesh

from jaxrl_post.errors import UserError
from jaxrl_post.sharding import hosts


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Attributes:
    every_n_steps: save after every N RL steps (and after the last one).
    keep: most recent checkpoints kept on disk.
    async_save: write in a background thread.
  """

  every_n_steps: int = 10
  keep: int = 3
  async_save: bool = True

  def __post_init__(self):
    for name in ("every_n_steps", "keep"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise UserError(f"checkpoint config: {name} must be a positive integer, "
                        f"got {getattr(self, name)!r}")


class Checkpointer:
  """Saves and restores (state, reference, meta) triples in `directory`.

  holders: the mesh whose devices hold the arrays (the trainer's). Where some processes
    hold none of its devices, only those that do call Orbax.
  """

  def __init__(self, directory: str, cfg: CheckpointConfig = CheckpointConfig(),
               holders: Optional[Mesh] = None):
    self.cfg = cfg
    self.directory = os.path.abspath(directory)
    self._mesh = None if holders is None or hosts.everywhere(holders) else holders
    self._active = self._mesh is None or hosts.holds(self._mesh)
    # Orbax refuses arrays that one process holds whole in a multi-process job (it takes
    # them for pmap's per-host arrays): a sole holder saves host copies.
    self._host_copies = self._mesh is not None and len(hosts.processes(self._mesh)) == 1
    processes = None if self._mesh is None else hosts.processes(self._mesh)
    multi = ocp.options.MultiprocessingOptions(
        primary_host=0 if processes is None else min(processes),
        active_processes=None if processes is None else set(processes))
    if processes is not None and self._active:
      os.makedirs(self.directory, exist_ok=True)  # Orbax creates it only for all processes.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
        create=processes is None, cleanup_tmp_directories=True,
        multiprocessing_options=multi)
    self._manager = (ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "reference", "rollout", "meta"))
                     if self._active else None)

  def _shared(self, read):
    """read() on the holders, its value on every process (collective when split)."""
    value = read() if self._active else None
    return value if self._mesh is None else hosts.share(value, self._mesh)

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step (None if there is none)."""
    return self._shared(lambda: self._manager.latest_step())

  def all_steps(self) -> list[int]:
    return list(self._shared(lambda: list(self._manager.all_steps())))

  def save(self, step: int, state: Any, meta: dict, reference: Any = None,
           rollout: Any = None) -> None:
    """Starts saving; returns once the arrays are off the devices (async mode)."""
    if not self._active:
      return
    if self._host_copies:
      state, reference, rollout = jax.device_get((state, reference, rollout))
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    for name, tree in (("reference", reference), ("rollout", rollout)):
      if tree is not None:
        items[name] = ocp.args.StandardSave(tree)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, abstract_reference: Any = None):
    """(state, reference, meta) of `step`, placed as the abstract trees' shardings say."""
    if not self._active:  # Arrays this process cannot read; the record from the holders.
      reference = None if abstract_reference is None else _unreadable(abstract_reference)
      return _unreadable(abstract_state), reference, self._shared(None)
    wanted = (abstract_state, abstract_reference)
    if self._host_copies:
      wanted = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), wanted)
    items = {"state": ocp.args.StandardRestore(wanted[0]), "meta": ocp.args.JsonRestore()}
    if abstract_reference is not None:
      items["reference"] = ocp.args.StandardRestore(wanted[1])
    for name, tree in (("state", wanted[0]), ("reference", wanted[1])):
      if tree is not None:
        self._check_shapes(step, name, tree)
    out = self._read(step, lambda: self._manager.restore(step, args=ocp.args.Composite(**items)))
    state, meta = out["state"], self._shared(lambda: out["meta"])
    reference = out["reference"] if abstract_reference is not None else None
    if self._host_copies:
      place = lambda tree, like: jax.tree.map(lambda x, a: jax.device_put(x, a.sharding),
                                              tree, like)
      state = place(state, abstract_state)
      reference = None if reference is None else place(reference, abstract_reference)
    return state, reference, meta

  def restore_rollout(self, step: int, abstract_rollout: Any) -> Any:
    """The rollout weights saved with `step`, placed as `abstract_rollout` says; None when
    that checkpoint has none (they were the train state's)."""
    # The item's directory, not item_metadata: a fresh process has not registered the item.
    if not os.path.isdir(os.path.join(self.directory, str(step), "rollout")):
      return None
    self._check_shapes(step, "rollout", abstract_rollout)
    args = ocp.args.Composite(rollout=ocp.args.StandardRestore(abstract_rollout))
    return self._read(step, lambda: self._manager.restore(step, args=args)["rollout"])

  def _read(self, step: int, read):
    """read() of a stored step whose arrays are this run's shapes: what fails now is the
    files (cut short, corrupted), reported as one line that says how to go on."""

    def fail(what: str) -> str:
      earlier = [s for s in self._manager.all_steps() if s < step]
      hint = (f"move it away to resume from step {max(earlier)}" if earlier
              else "no earlier checkpoint to resume from")
      return f"{self.directory}/{step}: checkpoint cannot be read ({what}); {hint}"

    return read_stored(read, fail)

  def _check_shapes(self, step: int, item: str, wanted: Any) -> None:
    """Refuses a stored item whose arrays are not `wanted`'s (another model or optimizer),
    naming the first that differs. Orbax would fail on it too, but from inside reads
    already under way, whose callbacks then print tracebacks on a closed event loop."""
    path = epath.Path(self.directory) / str(step) / item
    where = f"{self.directory}/{step}: checkpoint does not match this run's config"
    if not path.exists():
      raise UserError(f"{where} (it holds no {item})")
    stored = self._read(step, lambda: ocp.StandardCheckpointHandler().metadata(path))
    differs = shape_difference(stored, wanted, item, "this run")
    if differs:
      raise UserError(f"{where} ({differs})")

  def wait(self) -> None:
    """Blocks until the last save is on disk."""
    if self._manager is not None:
      self._manager.wait_until_finished()

  def close(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()


def read_stored(read: Callable[[], Any], fail: Callable[[str], str]) -> Any:
  """read() of what Orbax stored. A failure is one UserError, fail(what went wrong as
  the innermost error says it), and the reads still in flight behind it print nothing."""
  loud = _quiet_late_reads()  # Before reading: the first failure can close the loop at once.
  try:
    value = read()
  except UserError:
    raise
  except Exception as e:  # Orbax and TensorStore raise plain Exceptions too.
    cause = e
    while cause.__cause__ is not None:  # The innermost names the file and what is wrong.
      cause = cause.__cause__
    # TensorStore ends its message with the store's whole spec: not for the user.
    what = (str(cause) or type(cause).__name__).splitlines()[0].split(" [tensorstore_spec=")[0]
    raise UserError(fail(what)) from e
  loud()  # Read whole: nothing is left in flight.
  return value


def _quiet_late_reads() -> Callable[[], None]:
  """After one read of a restore fails, Orbax's other reads still in flight end later:
  into the event loop it has closed (a traceback each, through sys.excepthook or as
  unraisable), as coroutines collected with the same failure, or as tasks asyncio logs as
  never retrieved. The one line that says what failed is what the user needs: those go
  unprinted until the returned function puts the hooks back (after a read that succeeded)."""
  excepthook, unraisablehook = sys.excepthook, sys.unraisablehook
  asyncio_log = logging.getLogger("asyncio")
  level = asyncio_log.level
  closed = lambda value: isinstance(value, RuntimeError) and str(value) == "Event loop is closed"

  def quiet(kind, value, tb):
    if not closed(value):
      excepthook(kind, value, tb)

  def quiet_unraisable(unraisable):
    if not (closed(unraisable.exc_value) or inspect.iscoroutine(unraisable.object)):
      unraisablehook(unraisable)

  sys.excepthook, sys.unraisablehook = quiet, quiet_unraisable
  asyncio_log.setLevel(logging.CRITICAL)

  def restore() -> None:
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
    asyncio_log.setLevel(level)

  return restore


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def shape_difference(stored: Any, wanted: Any, item: str, wanted_by: str) -> Optional[str]:
  """How the first array of `wanted` (in its order: params first) that a stored tree lacks,
  holds extra or holds in another shape differs, as "params.embed is (128, 64) in the
  checkpoint, (512, 96) in <wanted_by>"; None when the shapes agree."""
  stored, here = _shapes(stored), _shapes(wanted)
  for name in [n for n in here if n not in stored][:1]:
    return f"{item} {name} is not in the checkpoint"
  for name in [n for n in stored if n not in here][:1]:
    return f"{item} {name} is in the checkpoint, not in {wanted_by}"
  for name in [n for n in here if here[n] != stored[n]][:1]:
    return f"{item} {name} is {stored[name]} in the checkpoint, {here[name]} in {wanted_by}"
  return None


def _shapes(tree: Any) -> dict[str, tuple]:
  """Each array leaf's dotted path (as Orbax names it) -> its shape."""
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: x is None)
  return {".".join(_key_name(k) for k in path): tuple(leaf.shape)
          for path, leaf in leaves if leaf is not None and hasattr(leaf, "shape")}


def _unreadable(abstract: Any) -> Any:
  """Arrays of the abstract tree's shapes and shardings on a process that holds none of
  their devices (jax runs nothing here, so they cost nothing)."""
  return jax.tree.map(lambda a: hosts.unreadable(a.shape, a.dtype, a.sharding), abstract)


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a tree of arrays: a restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)
