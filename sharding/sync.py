"""Weight sync: trainer parameters (f32, training sharding) -> rollout weights (bf16,
rollout sharding), on the devices, with an integer version per sync.

Colocated: one jitted function fuses the cast with the reshard (an all-gather over "fsdp")
and donates the previous rollout buffers so XLA writes the new weights into them.

Split: the cast and reshard run on the trainer's devices into a mirror of the rollout
layout, then each shard is copied device-to-device to the rollout device that holds the
same slice; with the roles on different processes, as one collective program
(sharding/hosts.py). The host never sees a byte in any case.

With LoRA, `PartialSync` moves the adapters only: the rollout keeps its own copy of the
frozen base, made once, and receives just the adapters at each sync.

Either sync writes the weights in the rollout engine's form (`form`: an engine that holds
its layers one buffer per layer gets them so, rollout.weights.SplitLayers), so the engine
uses the sync's output as it is and the weights exist once on the rollout's devices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import FLOAT_DTYPES
from jaxrl_post.sharding import hosts
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
    if self.rollout_dtype not in FLOAT_DTYPES:
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
    source = shards[_index_key(index)]
    arrays.append(jax.device_put(source, device))
  return jax.make_array_from_single_device_arrays(x.shape, target, arrays)


class WeightSync:
  """Moves trainer parameters into the rollout engine's layout and dtype.

  Args:
    meshes: the trainer and rollout meshes.
    axes_tree: logical axis names per parameter (leaves are tuples of names).
    shapes_tree: matching arrays or ShapeDtypeStructs.
    cfg: sync frequency and the rollout dtype.
    form: the rollout engine's form of the tree, applied in the sync's program (called on
      the cast tree; `form.shardings` maps the tree's shardings likewise); None keeps the
      trainer's tree.
  """

  def __init__(self, meshes: Meshes, axes_tree, shapes_tree, cfg: SyncConfig = SyncConfig(),
               train_rules: Rules = TRAINING_RULES, rollout_rules: Rules = ROLLOUT_RULES,
               form=None):
    self.cfg = cfg
    self.meshes = meshes
    dtype = jnp.dtype(cfg.rollout_dtype)
    self.train_shardings = tree_shardings(axes_tree, shapes_tree, train_rules, meshes.trainer)
    self.rollout_shardings = tree_shardings(axes_tree, shapes_tree, rollout_rules,
                                            meshes.rollout)
    if form is not None:
      self.rollout_shardings = form.shardings(self.rollout_shardings)
    self.bytes_per_sync = sum(math.prod(x.shape) * dtype.itemsize
                              for x in jax.tree.leaves(shapes_tree))
    shaped = form or (lambda tree: tree)
    cast = lambda tree: shaped(jax.tree.map(lambda x: x.astype(dtype), tree))
    if meshes.colocated:
      self._first = jax.jit(cast, in_shardings=(self.train_shardings,),
                            out_shardings=self.rollout_shardings)
      # keep_unused: the old weights are not read, only donated, and jit would drop them.
      self._sync = jax.jit(lambda new, old: cast(new),
                           in_shardings=(self.train_shardings, self.rollout_shardings),
                           out_shardings=self.rollout_shardings, donate_argnums=1,
                           keep_unused=True)
    else:
      mirror = self._mirror = _mirror_mesh(meshes.rollout, list(meshes.trainer.devices.flat))
      self._mirror_shardings = jax.tree.map(lambda s: NamedSharding(mirror, s.spec),
                                            self.rollout_shardings)
      self._first = jax.jit(cast, in_shardings=(self.train_shardings,),
                            out_shardings=self._mirror_shardings)

  def due(self, step: int) -> bool:
    """Whether a sync follows optimizer step `step` (counted from 1)."""
    return step % self.cfg.every_n_steps == 0

  def moving(self, params):
    """What a sync moves of a whole tree: all of it (see PartialSync)."""
    return params

  def with_moving(self, params, moving):
    return moving

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
    if jax.process_count() > 1:  # A slice's source may be on another process.
      return hosts.transfer(params, self.rollout_shardings, self._mirror, self.meshes.rollout)
    return jax.tree.map(_copy_shards, params, self.rollout_shardings)

  def compiled_text(self, train_params, rollout_params) -> str:
    """HLO of the jitted sync (colocated) or cast + reshard (split), for inspection."""
    if self.meshes.colocated:
      return self._sync.lower(train_params, rollout_params).compile().as_text()
    return self._first.lower(train_params).compile().as_text()


_NONE = object()  # A half of a subtree that holds no leaf of that half.


def _split(tree, moves: Callable[[tuple], bool], is_leaf=None, path: tuple = ()):
  """(moving, fixed) halves of a nested dict, split leaf by leaf on `moves(path)` (path:
  jax.tree_util keys). Tuples inside (a split engine's layers) keep their positions in
  both halves."""
  tu = jax.tree_util
  if isinstance(tree, dict) and not (is_leaf and is_leaf(tree)):
    halves: tuple[dict, dict] = ({}, {})
    for key, sub in tree.items():
      for half, part in zip(halves, _split(sub, moves, is_leaf, path + (tu.DictKey(key),))):
        if part is not _NONE:
          half[key] = part
    return tuple(h if h else _NONE for h in halves)
  if isinstance(tree, (tuple, list)) and not (is_leaf and is_leaf(tree)):
    parts = [_split(sub, moves, is_leaf, path + (tu.SequenceKey(i),))
             for i, sub in enumerate(tree)]
    return tuple(_NONE if all(p[h] is _NONE for p in parts)
                 else tuple({} if p[h] is _NONE else p[h] for p in parts) for h in (0, 1))
  return (tree, _NONE) if moves(path) else (_NONE, tree)


def _halves(tree, moves, is_leaf=None) -> tuple[dict, dict]:
  return tuple({} if h is _NONE else h for h in _split(tree, moves, is_leaf))


def _merge(a, b):
  """Union of two nested dicts with disjoint leaves (tuples inside merged by position)."""
  if isinstance(a, tuple) and isinstance(b, tuple):
    return tuple(_merge(x, y) for x, y in zip(a, b, strict=True))
  out = dict(a)
  for k, v in b.items():
    out[k] = _merge(out[k], v) if isinstance(v, (dict, tuple)) and k in out else v
  return out


class PartialSync:
  """A weight sync that moves only the leaves that train (LoRA adapters), not the frozen rest.

  The rollout gets its own copy of the fixed leaves once, in `initial`; every later sync
  casts and reshards just the moving leaves (a WeightSync over that subtree, donating the
  engine's previous copy of them) and puts them beside the fixed copy. `bytes_per_sync`
  counts what moves. Same interface as WeightSync: trees in and out are whole.

  Args:
    moves: whether the leaf at a `tree_flatten_with_path` path trains (and so moves).
    form: as WeightSync's, applied to each half.
  """

  def __init__(self, meshes: Meshes, axes_tree, shapes_tree, cfg: SyncConfig,
               moves: Callable[[tuple], bool], form=None):
    self.cfg, self.meshes, self._moves = cfg, meshes, moves
    split_axes = _halves(axes_tree, moves, is_leaf=lambda x: isinstance(x, tuple))
    moving_shapes, fixed_shapes = _halves(shapes_tree, moves)
    if not jax.tree.leaves(moving_shapes):
      raise UserError("weight sync: no parameter trains, so none would ever move")
    self._moving = WeightSync(meshes, split_axes[0], moving_shapes, cfg, form=form)
    self._fixed = WeightSync(meshes, split_axes[1], fixed_shapes, cfg, form=form)
    self.bytes_per_sync = self._moving.bytes_per_sync

  def due(self, step: int) -> bool:
    return self._moving.due(step)

  def moving(self, params) -> dict:
    """The leaves of a whole tree that a sync moves (what a checkpoint must keep)."""
    return _halves(params, self._moves)[0]

  def with_moving(self, params, moving) -> dict:
    """A whole tree with its moving leaves replaced by `moving`."""
    return _merge(moving, _halves(params, self._moves)[1])

  def initial(self, train_params) -> RolloutWeights:
    """Version 0: the fixed leaves (once, for the whole run) and the moving ones."""
    moving, fixed = _halves(train_params, self._moves)
    params = _merge(self._moving.initial(moving).params, self._fixed.initial(fixed).params)
    return RolloutWeights(params, version=0)

  def __call__(self, train_params, rollout: RolloutWeights) -> RolloutWeights:
    """Version + 1, moving only the trained leaves; the engine's old copy of them is
    consumed, its fixed leaves are kept as they are."""
    old_moving, fixed = _halves(rollout.params, self._moves)
    new = self._moving(self.moving(train_params), RolloutWeights(old_moving, rollout.version))
    return RolloutWeights(_merge(new.params, fixed), new.version)
