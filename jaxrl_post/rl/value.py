"""PPO's critic loss and per-token targets.

The sequence reward lands on the last completion token (the only place a verifier's score
is defined); GAE then spreads it backwards with the critic's values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_post.rl.losses import LossConfig, aggregate


def terminal_rewards(rewards, mask):  # [B], [B, T] -> [B, T]
  """Each sequence's reward on its last valid token, 0 elsewhere."""
  m = mask.astype(jnp.float32)
  t = jnp.arange(mask.shape[1])
  last = jnp.max(jnp.where(m > 0, t, -1), axis=1)  # -1 for empty rows
  return jnp.where(t[None, :] == last[:, None], rewards[:, None], 0.0) * m


def value_loss(values, old_values, returns, mask, clip: float, normaliser,
               cfg: LossConfig):  # [B, T] x 4 -> scalar
  """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), aggregated
  like the policy loss (so micro-batches add up to the full batch)."""
  old, ret = jax.lax.stop_gradient(old_values), jax.lax.stop_gradient(returns)
  clipped = old + jnp.clip(values - old, -clip, clip)
  per_token = 0.5 * jnp.maximum(jnp.square(values - ret), jnp.square(clipped - ret))
  per_token = jnp.where(mask > 0, per_token, 0.0)
  return aggregate(per_token, mask, normaliser, cfg)
