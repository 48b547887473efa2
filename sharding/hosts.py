"""Roles on different processes: split placement with the trainer's and the rollout's
devices held by different processes (a trainer host and a rollout host).

Every process still runs the same loop. jax runs a program only on the devices this
process holds, so a process that holds none of a role's devices skips that role's
programs, and their outputs are arrays it cannot read. What such a process needs on the
host -- the rollouts, the train step's metrics -- it receives from the processes that
computed them (`share`, `fetch`), and the weights cross from the trainer's devices to the
rollout's device to device, as one collective program (`transfer`).

Where every process holds some of a role's devices (one process, colocated placement,
or meshes that each span every host) all of this is a no-op.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_post.sharding.mesh import AXES
from jaxrl_post.sharding.rules import spec_axes


def processes(mesh: Mesh) -> frozenset[int]:
  """The processes holding at least one of `mesh`'s devices."""
  return frozenset(d.process_index for d in mesh.devices.flat)


def holds(mesh: Mesh) -> bool:
  return jax.process_index() in processes(mesh)


def everywhere(mesh: Mesh) -> bool:
  """Whether every process holds some of `mesh`'s devices (and so reads its outputs)."""
  return len(processes(mesh)) == jax.process_count()


def allgather_objects(obj: Any) -> list[Any]:
  """Each process's picklable `obj`, in process order, on every process. Collective."""
  from jax.experimental import multihost_utils

  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
  sizes = sizes.reshape(-1)
  width = 1 << max(int(sizes.max()) - 1, 1).bit_length()  # Few shapes: few compilations.
  padded = np.zeros(width, np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
  return [pickle.loads(rows[p, :int(sizes[p])].tobytes()) for p in range(len(sizes))]


def share(value: Any, mesh: Mesh) -> Any:
  """`value` as computed by the processes holding `mesh` (the others pass anything, e.g.
  None), on every process. Collective unless every process holds part of `mesh`."""
  if everywhere(mesh):
    return value
  source = min(processes(mesh))
  return allgather_objects(value if jax.process_index() == source else None)[source]


def fetch(tree: Any, mesh: Optional[Mesh] = None) -> Any:
  """jax.device_get of arrays on `mesh`, on every process (see `share`); without a mesh,
  jax.device_get."""
  if mesh is None:
    return jax.device_get(tree)
  return share(jax.device_get(tree) if holds(mesh) else None, mesh)


def unreadable(shape: tuple, dtype, sharding: NamedSharding) -> jax.Array:
  """An array of `sharding` on a process that holds none of its devices: jax runs nothing
  here, and the program is built once per shape."""
  return _unreadable(tuple(shape), np.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=512)
def _unreadable(shape: tuple, dtype, sharding: NamedSharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _assemble(shape, sharding: NamedSharding, shards: dict, dtype) -> jax.Array:
  """A global array from this process's shards {device: buffer}; where this process holds
  none of `sharding`'s devices, an array it cannot read (as jax's own outputs are)."""
  local = sharding.addressable_devices_indices_map(shape)
  if not local:
    return unreadable(shape, dtype, sharding)
  return jax.make_array_from_single_device_arrays(shape, sharding,
                                                  [shards[d] for d in local])


def transfer(tree: Any, targets: Any, source_mesh: Mesh, target_mesh: Mesh) -> Any:
  """Copies `tree` (arrays on `source_mesh`, laid out as `targets` is on `target_mesh`:
  the same axes, "data" resized and unused by the arrays' specs) into `targets`, device to
  device, across processes.

  Each round pairs every source device with the target device at the same position (so
  holding the same slice) and sends with one ppermute over a two-row mesh [sources;
  targets]: the target rows' "data" indices are covered source-row by source-row.
  Collective: every process calls it with the same trees.
  """
  src = source_mesh.devices  # [data_s, ...rest]
  dst = target_mesh.devices  # [data_t, ...rest]
  leaves, treedef = jax.tree.flatten(tree)
  specs = [s.spec for s in jax.tree.leaves(targets)]
  for spec in specs:
    if any("data" in spec_axes(p) for p in spec):
      raise ValueError(f"transfer: spec {spec} shards over 'data', which the meshes differ in")
  received: list[dict] = [{} for _ in leaves]
  step = src.shape[0]
  for start in range(0, dst.shape[0], step):
    rows = dst[start:start + step]
    _round(leaves, specs, src[:len(rows)], rows, received)
  outs = [_assemble(x.shape, t, got, x.dtype)
          for x, t, got in zip(leaves, jax.tree.leaves(targets), received)]
  return jax.tree.unflatten(treedef, outs)


def _round(leaves: list, specs: list, src: np.ndarray, dst: np.ndarray,
           received: list[dict]) -> None:
  """One ppermute from `src` devices to the `dst` devices at the same positions; the
  received shards go into `received[i]` by target device."""
  mesh = Mesh(np.stack([src, dst]), ("side", *AXES))
  if not any(d.process_index == jax.process_index() for d in mesh.devices.flat):
    return  # The program runs on its devices' processes only.
  # The buffers the ppermute fills on the targets, made there (no host transfer).
  blank = _zeros(Mesh(dst, AXES), tuple((x.shape, x.dtype) for x in leaves), tuple(specs))()
  lifted = []
  for x, spec, empty in zip(leaves, specs, blank):
    sharding = NamedSharding(mesh, PartitionSpec("side", *spec))
    local = {s.device: s.data[None] for s in x.addressable_shards}
    local.update({s.device: s.data[None] for s in empty.addressable_shards})
    lifted.append(_assemble((2, *x.shape), sharding, local, x.dtype))
  moved = _send(mesh, tuple(PartitionSpec("side", *s) for s in specs))(lifted)
  for i, y in enumerate(moved):
    for shard in y.addressable_shards:
      if shard.index[0].start == 1:
        received[i][shard.device] = shard.data[0]


@functools.lru_cache(maxsize=64)
def _zeros(mesh: Mesh, avals: tuple, specs: tuple):
  shardings = tuple(NamedSharding(mesh, spec) for spec in specs)
  return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in avals),
                 out_shardings=shardings)


@functools.lru_cache(maxsize=64)
def _send(mesh: Mesh, specs: tuple):
  def move(xs):
    return [jax.lax.ppermute(x, "side", [(0, 1)]) for x in xs]
  return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=(list(specs),),
                               out_specs=list(specs)))
