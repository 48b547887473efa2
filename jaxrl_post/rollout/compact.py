"""Decode steps over the live slots only.

A decode call runs all of its slots for every step, but slots finish inside a call (and,
with overlapped calls, wait one call to be refilled), and at the end of a job only a few
are left: a slot that is done or empty still costs a full row of every matmul. Here a
step gathers the live rows of each data shard first, runs the model on the narrowest of a
few static widths that holds them, and scatters the results back to their slots.

Rows move only within their data shard (slot s of shard d stays on shard d), so the
shard-local page ids in their page tables stay valid. The widths are static, so each is
its own branch of a `lax.switch`: a few compiled copies of the step instead of one.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def widths(rows_per_shard: int, buckets: int) -> tuple[int, ...]:
  """Per-shard row counts a step may run at: `buckets` evenly spaced up to all rows."""
  return tuple(sorted({-(-rows_per_shard * i // buckets) for i in range(1, buckets + 1)}))


def live_rows_step(step: Callable, pool, rows, active, shards: int, sizes: tuple[int, ...]):
  """step(pool, rows) on each shard's live rows only; returns (pool, outputs per slot).

  Args:
    step: (pool, rows) -> (pool, outputs): rows and outputs are pytrees of [N, ...] arrays,
      one row per slot; rows include `active`, so a gathered dead row (a width larger than
      the live count) is still masked by the step itself.
    pool: passed through to step (the KV pool).
    rows: pytree of [B, ...] per-slot inputs, B = shards * rows per shard.
    active: [B] bool, the live slots.
    shards: data shards; slots [d * B / shards, (d + 1) * B / shards) belong to shard d.
    sizes: static per-shard widths, ascending, the last one every row of a shard.

  Returns:
    (pool, outputs as [B, ...] per slot; rows left out of the step get zeros).
  """
  live = active.reshape(shards, -1)  # [S, per]
  order = jnp.argsort(~live, axis=1, stable=True)  # Live rows first, in slot order.
  inverse = jnp.argsort(order, axis=1)
  need = jnp.max(jnp.sum(live, axis=1))
  branch = jnp.sum(jnp.asarray(sizes[:-1]) < need)

  def by_slot(x, width):  # [S * width, ...] -> [B, ...]
    x = x.reshape(shards, width, *x.shape[1:])
    x = jnp.pad(x, [(0, 0), (0, live.shape[1] - width)] + [(0, 0)] * (x.ndim - 2))
    return _take_rows(x, inverse).reshape(-1, *x.shape[2:])

  def run(width, pool, rows):
    pick = lambda x: _take_rows(x.reshape(shards, -1, *x.shape[1:]),
                                order[:, :width]).reshape(-1, *x.shape[1:])
    pool, out = step(pool, jax.tree.map(pick, rows))
    return pool, jax.tree.map(lambda x: by_slot(x, width), out)

  branches = [lambda p, r, w=w: run(w, p, r) for w in sizes]
  return jax.lax.switch(branch, branches, pool, rows)


def _take_rows(x, index):  # [S, per, ...], [S, n] -> [S, n, ...]
  index = index.reshape(*index.shape, *([1] * (x.ndim - 2)))
  return jnp.take_along_axis(x, index, axis=1)
