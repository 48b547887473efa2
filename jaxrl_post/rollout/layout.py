"""Where the rollout engine's arrays live on the rollout mesh.

One jitted decode program runs over the whole rollout mesh:

* decode slots (and prefill rows, and blocks of slots) are sharded over the batch axes
  ("data", then "expert": a mixture-of-experts mesh splits its tokens over the expert axis
  too, so attention and KV are not replicated over it): batch shard s owns slots
  [s * B/D, (s + 1) * B/D) and its own range of KV pages;
* the KV pool ``[Hkv, L, D * P, page, hd]`` is sharded over "tensor" on its KV heads (when
  they divide, else replicated, as the rules table does for the weights) and over the
  batch axes on its pages, so each device holds P pages of its KV heads;
* page ids in page tables are local to the batch shard (0..P-1, page 0 the shard's write
  sink). The host keeps one allocator per batch shard.

The model's matrices run under GSPMD with the weights in the rollout sharding; only the
paged KV write and the attention, whose page ids are shard-local, run per device inside
`shard_map` -- the same per-device call a Pallas kernel needs. A one-device layout is the
same program over a 1x1 mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.sharding import AXES, ROLLOUT_RULES
from jaxrl_post.sharding.platform import mesh_platform


def single_device_mesh(device: Optional[jax.Device] = None) -> Mesh:
  device = device or jax.devices()[0]
  return Mesh(np.asarray([device], dtype=object).reshape((1,) * len(AXES)), AXES)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
  """The rollout mesh and how the engine's arrays are split over it (hashable: static).

  Attributes:
    mesh: the rollout mesh (axes jaxrl_post.sharding.AXES).
    kv_axis: "tensor" when the KV heads are split over it, else None (replicated).
    split_layers: the engine holds one weight buffer per layer and its programs unroll
      the layers (rollout.weights): what a GPU needs to read each layer's weights in place.
  """

  mesh: Mesh
  kv_axis: Optional[str]
  split_layers: bool = False

  @classmethod
  def build(cls, cfg: ModelConfig, mesh: Optional[Mesh] = None,
            split_layers: Optional[bool] = None) -> "RolloutLayout":
    """split_layers None: split on a GPU mesh, and on a TPU mesh for mixture-of-experts
    models (XLA:TPU reads a dense layer's stacked slices in place, but copies each layer's
    expert matrices out of the stack for the grouped matmuls: 2.5x the decode floor for
    Qwen3-30B-A3B on v5p-64, 1.3x split); on a CPU the unrolled programs would only
    compile slower."""
    mesh = mesh if mesh is not None else single_device_mesh()
    tensor = mesh.shape["tensor"]
    split = tensor > 1 and cfg.num_kv_heads % tensor == 0
    if split_layers is None:
      platform = mesh_platform(mesh)
      split_layers = platform == "gpu" or (platform == "tpu" and cfg.moe is not None)
    return cls(mesh, "tensor" if split else None, bool(split_layers))

  @property
  def data_shards(self) -> int:
    """Batch shards: the slots, pages and page allocators are split this many ways."""
    return batch_shards(self.mesh)

  @property
  def local_device(self) -> jax.Device:
    """A device of this mesh that this process drives (memory stats exist only for those).
    A process that drives none (split placement across processes) never runs the engine's
    programs, and sizes its idle copy by one of its own devices."""
    return next((d for d in self.mesh.devices.flat if d.process_index == jax.process_index()),
                jax.local_devices()[0])

  # ---------------------------------------------------------------- specs

  @property
  def pool_spec(self) -> P:  # [Hkv, L, pages, page, hd]
    return P(self.kv_axis, None, BATCH_AXES, None, None)

  def rows_spec(self, ndim: int) -> P:  # [B, ...]: slots, prefill rows or blocks
    return P(BATCH_AXES, *([None] * (ndim - 1)))

  def heads_spec(self, ndim: int) -> P:  # [B, (T,) H, hd]: queries, keys, values, outputs
    return P(BATCH_AXES, *([None] * (ndim - 3)), self.kv_axis, None)

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def rows(self, ndim: int) -> NamedSharding:
    return self.sharding(self.rows_spec(ndim))

  @property
  def replicated(self) -> NamedSharding:
    return self.sharding(P())

  # ---------------------------------------------------------------- placement

  def put_rows(self, tree):
    """Host arrays with a leading slot/row axis -> global arrays split over the batch axes.

    Every process passes the same full host arrays (the schedulers run in lockstep), so
    each process places just the shards of its own devices.
    """
    return jax.tree.map(lambda x: _put(np.asarray(x), self.rows(np.ndim(x))), tree)

  def put_replicated(self, tree):
    """Host arrays -> global arrays every device of the mesh holds whole."""
    return jax.tree.map(lambda x: _put(np.asarray(x), self.replicated), tree)

  def per_device(self, fn: Callable, in_specs, out_specs) -> Callable:
    """fn run per device on its shards (page ids in the tables are shard-local)."""
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  # make_array_from_callback works across processes: each places its addressable shards.
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


# The mesh axes the rollout's rows are split over: the rules' "batch" axes, in their order.
BATCH_AXES: tuple[str, ...] = dict(ROLLOUT_RULES)["batch"]


def batch_shards(mesh) -> int:
  """How many ways a rollout mesh (a Mesh or a {axis: size} mapping) splits its rows."""
  shape = getattr(mesh, "shape", mesh)
  return int(np.prod([shape[a] for a in BATCH_AXES]))


def shard_count(num_slots: int, data_shards: int, block: int) -> int:
  """num_slots rounded up so every data shard holds the same whole blocks of slots."""
  unit = data_shards * max(block, 1)
  return -(-num_slots // unit) * unit
