"""Logical-axis constraints on activations, resolved by the rules table in force.

Model code names an activation's dimensions ("batch", "embed", ...) and calls `constrain`;
the caller that traces it (the trainer step, the rollout engine) says which rules table
and mesh apply with `activation_rules(...)`. Outside such a block `constrain` does
nothing, so the same model code runs unsharded in tests and tools.

The context is read while jax traces, so it must be active inside the traced function
(wrap the body, not the call of an already-compiled function).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from jaxrl_post.sharding.rules import Rules, logical_to_spec

_ACTIVE: contextvars.ContextVar[Optional[tuple[Rules, Mesh]]] = contextvars.ContextVar(
    "activation_rules", default=None)


@contextlib.contextmanager
def activation_rules(rules: Rules, mesh: Optional[Mesh]) -> Iterator[None]:
  """Makes `constrain` map logical names through `rules` onto `mesh` (None: no-op)."""
  token = _ACTIVE.set(None if mesh is None else (rules, mesh))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_rules() -> Optional[tuple[Rules, Mesh]]:
  """(rules, mesh) of the enclosing `activation_rules` block on more than one device, else
  None: for code that must split work per device itself (a Pallas call under shard_map)."""
  active = _ACTIVE.get()
  return None if active is None or active[1].size == 1 else active


def active_mesh() -> Optional[Mesh]:
  """The mesh of the enclosing `activation_rules` block (one device included), else None."""
  active = _ACTIVE.get()
  return None if active is None else active[1]


def constrain(x: jax.Array, names: Sequence[Optional[str]]) -> jax.Array:
  """x with a sharding constraint from its logical dim names (None: replicated dim)."""
  active = active_rules()
  if active is None:
    return x
  rules, mesh = active
  spec = logical_to_spec([n or "" for n in names], x.shape, rules, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
