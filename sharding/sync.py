"""Weight sync: trainer parameters (f32, training sharding) -> rollout weights (bf16,
rollout sharding), on the devices, with an integer version per sync.

Colocated: one jitted function fuses the cast with the reshard (an all-gather over "fsdp")
and donates the previous rollout buffers so XLA writes the new weights into them.

Split: the cast and reshard run on the trainer's devices into a mirror of the rollout
layout, then each shard is copied device-to-device to the rollout device that holds the
same slice. The host never sees a byte in either case.

With LoRA, build the sync over the adapter subtree only: the rollout keeps its own copy of
the frozen base and receives just the adapters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl_post.errors import UserError
from jaxrl_post.sharding.mesh import AXES
from jaxrl_post.sharding.placement import Meshes
from jaxrl_post.sharding.rules import ROLLOUT_RULES, TRAINING_RULES, Rules, tree_shardings


@dataclasses.dataclass(frozen=True)
class SyncConfig:
  every_n_steps: int = 1
  rollout_dtype: str = "bfloat16"

  def __post_init__(self):
    if not isinstance(self.every_n_steps, int) or self.every_n_steps < 1:
      raise UserError(f"sync config: every_n_steps must be >= 1, got {self.every_n_steps!r}")
    if self.rollout_dtype not in ("bfloat16", "float16", "float32"):
      raise UserError(f"sync config: rollout_dtype={self.rollout_dtype!r} is not a float dtype")


@dataclasses.dataclass(frozen=True)
class RolloutWeights:
  """The rollout engine's weights and the trainer version they came from."""

  params: Any
  version: int


def _mirror_mesh(rollout: Mesh, devices: list) -> Mesh:
  """The rollout mesh's layout rebuilt on other devices, resizing only "data"."""
  other = math.prod(size for name, size in rollout.shape.items() if name != "data")
  if len(devices) % other:
    raise UserError(f"placement: {len(devices)} trainer devices cannot hold the rollout "
                    f"layout {dict(rollout.shape)} (need a multiple of {other})")
  shape = [len(devices) // other if a == "data" else rollout.shape[a] for a in AXES]
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def _index_key(index) -> tuple:
  return tuple((s.start, s.stop) for s in index)


def _copy_shards(x: jax.Array, target: NamedSharding) -> jax.Array:
  """Device-to-device copy of `x` into `target`, whose slices `x` already holds."""
  shards = {_index_key(s.index): s.data for s in x.addressable_shards}
  arrays = []
  for device, index in target.addressable_devices_indices_map(x.shape).items():
    source = shards.get(_index_key(index))
    if source is None:
      raise UserError("split placement: a rollout shard lives on another process; "
                      "use colocated placement across hosts")
    arrays.append(jax.device_put(source, device))
  return jax.make_array_from_single_device_arrays(x.shape, target, arrays)


class WeightSync:
  """Moves trainer parameters into the rollout engine's layout and dtype.

  Args:
    meshes: the trainer and rollout meshes.
    axes_tree: logical axis names per parameter (leaves are tuples of names).
    shapes_tree: matching arrays or ShapeDtypeStructs.
    cfg: sync frequency and the rollout dtype.
  """

  def __init__(self, meshes: Meshes, axes_tree, shapes_tree, cfg: SyncConfig = SyncConfig(),
               train_rules: Rules = TRAINING_RULES, rollout_rules: Rules = ROLLOUT_RULES):
    self.cfg = cfg
    self.meshes = meshes
    dtype = jnp.dtype(cfg.rollout_dtype)
    self.train_shardings = tree_shardings(axes_tree, shapes_tree, train_rules, meshes.trainer)
    self.rollout_shardings = tree_shardings(axes_tree, shapes_tree, rollout_rules,
                                            meshes.rollout)
    self.bytes_per_sync = sum(math.prod(x.shape) * dtype.itemsize
                              for x in jax.tree.leaves(shapes_tree))
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    if meshes.colocated:
      self._first = jax.jit(cast, in_shardings=(self.train_shardings,),
                            out_shardings=self.rollout_shardings)
      # keep_unused: the old weights are not read, only donated, and jit would drop them.
      self._sync = jax.jit(lambda new, old: cast(new),
                           in_shardings=(self.train_shardings, self.rollout_shardings),
                           out_shardings=self.rollout_shardings, donate_argnums=1,
                           keep_unused=True)
    else:
      mirror = _mirror_mesh(meshes.rollout, list(meshes.trainer.devices.flat))
      self._mirror_shardings = jax.tree.map(lambda s: NamedSharding(mirror, s.spec),
                                            self.rollout_shardings)
      self._first = jax.jit(cast, in_shardings=(self.train_shardings,),
                            out_shardings=self._mirror_shardings)

  def due(self, step: int) -> bool:
    """Whether a sync follows optimizer step `step` (counted from 1)."""
    return step % self.cfg.every_n_steps == 0

  def initial(self, train_params) -> RolloutWeights:
    """The first rollout copy (version 0); nothing to recycle yet."""
    return RolloutWeights(self._place(self._first(train_params)), version=0)

  def __call__(self, train_params, rollout: RolloutWeights) -> RolloutWeights:
    """New rollout weights (version + 1); `rollout.params` is consumed."""
    if self.meshes.colocated:
      params = self._sync(train_params, rollout.params)
    else:
      params = self._place(self._first(train_params))
      jax.tree.map(lambda x: x.delete(), rollout.params)  # Free the old copy now.
    return RolloutWeights(params, rollout.version + 1)

  def _place(self, params):
    if self.meshes.colocated:
      return params
    return jax.tree.map(_copy_shards, params, self.rollout_shardings)

  def compiled_text(self, train_params, rollout_params) -> str:
    """HLO of the jitted sync (colocated) or cast + reshard (split), for inspection."""
    if self.meshes.colocated:
      return self._sync.lower(train_params, rollout_params).compile().as_text()
    return self._first.lower(train_params).compile().as_text()
