"""Logical-axis rules: one table per role, mapping the model's axis names to mesh axes.

A rule table is an ordered tuple of (logical name, mesh axes). Rules are applied in table
order, so earlier rules win the mesh axes they ask for. A dimension that a rule's axes do
not divide keeps the longest prefix of those axes that does divide it (or stays
replicated): 9 SmolLM2 heads over an 8-way axis stay whole rather than failing.

Training shards every matrix's output dimension over ("tensor", "fsdp") and falls back to
the input ("embed") dimension over "fsdp"; rollout shards the same dimensions over "tensor"
only and replicates over "data". Going from training to rollout is then one all-gather
over "fsdp" per weight.

"expert" splits a mixture-of-experts layer's experts, and it is a batch axis too: every
device holds its own tokens, so attention, norms, dense layers and the KV pool are split
over it like over "data" (not replicated), and only the expert block moves tokens to the
shards holding their experts and back (models.moe). Without experts an "expert" axis of
size > 1 is one more data axis.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, tuple[str, ...]], ...]

TRAINING_RULES: Rules = (
    ("batch", ("data", "expert", "fsdp")),
    ("expert", ("expert",)),
    ("vocab", ("tensor", "fsdp")),
    ("mlp", ("tensor", "fsdp")),
    ("heads", ("tensor", "fsdp")),
    ("kv_heads", ("tensor", "fsdp")),
    ("embed", ("fsdp",)),
)

ROLLOUT_RULES: Rules = (
    ("batch", ("data", "expert")),
    ("expert", ("expert",)),
    ("vocab", ("tensor",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
)


def logical_to_spec(names: Sequence[str], shape: Sequence[int], rules: Rules,
                    mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for one array whose dims are named `names`."""
  assert len(names) == len(shape), (names, shape)
  assigned: list[Any] = [None] * len(names)
  used: set[str] = set()
  for logical, axes in rules:
    for dim, name in enumerate(names):
      if name != logical or assigned[dim] is not None:
        continue
      free = [a for a in axes if a not in used and mesh.shape[a] > 1]
      while free and shape[dim] % math.prod(mesh.shape[a] for a in free):
        free.pop()
      if free:
        assigned[dim] = free[0] if len(free) == 1 else tuple(free)
        used.update(free)
  return PartitionSpec(*assigned)


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(n, str) for n in x)


def tree_shardings(axes_tree, shapes_tree, rules: Rules, mesh: Mesh):
  """NamedShardings for a pytree, given its logical axes (tuples) and its shapes.

  Args:
    axes_tree: pytree whose leaves are tuples of logical axis names.
    shapes_tree: the same structure with arrays or jax.ShapeDtypeStruct leaves.
    rules: a rule table (TRAINING_RULES, ROLLOUT_RULES or a custom one).
    mesh: the mesh to place on.
  """
  return jax.tree.map(
      lambda names, x: NamedSharding(mesh, logical_to_spec(names, x.shape, rules, mesh)),
      axes_tree, shapes_tree, is_leaf=_is_axes)
