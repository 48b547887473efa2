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
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jaxrl_post.errors import UserError


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
  """Saves and restores (state, reference, meta) triples in `directory`."""

  def __init__(self, directory: str, cfg: CheckpointConfig = CheckpointConfig()):
    self.cfg = cfg
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
        cleanup_tmp_directories=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "reference", "rollout", "meta"))

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step (None if there is none)."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict, reference: Any = None,
           rollout: Any = None) -> None:
    """Starts saving; returns once the arrays are off the devices (async mode)."""
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    for name, tree in (("reference", reference), ("rollout", rollout)):
      if tree is not None:
        items[name] = ocp.args.StandardSave(tree)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, abstract_reference: Any = None):
    """(state, reference, meta) of `step`, placed as the abstract trees' shardings say."""
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if abstract_reference is not None:
      items["reference"] = ocp.args.StandardRestore(abstract_reference)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**items))
    except (ValueError, KeyError, FileNotFoundError) as e:
      raise UserError(f"{self.directory}/{step}: checkpoint does not match this run's "
                      f"config ({str(e).splitlines()[0]})") from e
    reference = out["reference"] if abstract_reference is not None else None
    return out["state"], reference, out["meta"]

  def restore_rollout(self, step: int, abstract_rollout: Any) -> Any:
    """The rollout weights saved with `step`, placed as `abstract_rollout` says; None when
    that checkpoint has none (they were the train state's)."""
    # The item's directory, not item_metadata: a fresh process has not registered the item.
    if not os.path.isdir(os.path.join(self.directory, str(step), "rollout")):
      return None
    args = ocp.args.Composite(rollout=ocp.args.StandardRestore(abstract_rollout))
    try:
      return self._manager.restore(step, args=args)["rollout"]
    except (ValueError, KeyError, FileNotFoundError) as e:
      raise UserError(f"{self.directory}/{step}: rollout weights do not match this run's "
                      f"config ({str(e).splitlines()[0]})") from e

  def wait(self) -> None:
    """Blocks until the last save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings) of a tree of arrays: a restore target."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)
