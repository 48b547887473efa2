"""Decode calls over the live slots only.

A decode call runs every row it is given for every step, but at the end of a job, or
while slots wait to be refilled, only a few slots are live: a slot that is done or empty
still costs a full row of every matmul. Here a call gathers the live rows of each data
shard first, decodes the narrowest of a few static widths that holds them, and puts the
results back in their slots.

The width is picked on the host when the call is launched (`call_width`), from its view of
the live slots, and is a static argument: each width is its own program, compiled the
first time a call needs it. A job whose slots stay full (a batch of short completions)
compiles one decode program; a long tail compiles the narrower ones as it reaches them.
Slots finishing inside a call keep their (masked) rows until the call ends.

Rows move only within their data shard (slot s of shard d stays on shard d), so the
shard-local page ids in their page tables stay valid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def widths(rows_per_shard: int, buckets: int) -> tuple[int, ...]:
  """Per-shard row counts a call may run at: `buckets` evenly spaced up to all rows."""
  return tuple(sorted({-(-rows_per_shard * i // buckets) for i in range(1, buckets + 1)}))


def call_width(active: np.ndarray, shards: int, buckets: int) -> int | None:
  """Rows per data shard for the next call: the narrowest width that holds every shard's
  live slots (`active` [B] the host's view, which may only overcount: a slot that ended in
  a call not yet collected still looks live), or None when that is every row."""
  per = active.shape[0] // shards
  need = max(1, int(active.reshape(shards, per).sum(axis=1).max()))
  width = min(w for w in widths(per, buckets) if w >= need)
  return None if width == per else width


def live_first(active, shards: int):
  """[B] bool -> [S, B / S] each shard's slot indices (shard-local), live ones first, each
  group in slot order."""
  return jnp.argsort(~active.reshape(shards, -1), axis=1, stable=True)


def take(tree, order, width: int):
  """Rows order[:, :width] of each shard: pytree of [B, ...] -> [S * width, ...]."""
  shards = order.shape[0]
  pick = lambda x: _take_rows(x.reshape(shards, -1, *x.shape[1:]),
                              order[:, :width]).reshape(-1, *x.shape[1:])
  return jax.tree.map(pick, tree)


def put(full, part, order):
  """`full` ([B, ...] leaves) with rows order[:, :width] replaced by `part` ([S * width,
  ...], as `take` gave them); every other row as it was."""
  shards, inverse = order.shape[0], jnp.argsort(order, axis=1)

  def one(x, p):
    by_order = _take_rows(x.reshape(shards, -1, *x.shape[1:]), order)
    width = p.shape[0] // shards
    by_order = by_order.at[:, :width].set(p.reshape(shards, width, *p.shape[1:]))
    return _take_rows(by_order, inverse).reshape(x.shape)

  return jax.tree.map(one, full, part)


def _take_rows(x, index):  # [S, per, ...], [S, n] -> [S, n, ...]
  index = index.reshape(*index.shape, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, index, axis=1)
