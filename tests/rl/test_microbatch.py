"""Micro-batched == full batch: losses and gradients, for every loss and aggregation.

The global normaliser is computed once from the full batch's mask; each micro-batch (a
slice of rows) gets the same value, and the micro-batch losses and their gradients must
add up to the full-batch ones. Padding rows and ragged rows land in different slices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rl import LossConfig, global_normaliser, policy_loss
from tests.rl.helpers import B, batch
from tests.rl.test_losses import AGGREGATIONS, config, LOSSES

# Only the summation order differs (the per-token gradient is computed identically).
LOSS_RTOL, LOSS_ATOL = 1e-6, 1e-7
GRAD_RTOL, GRAD_ATOL = 0.0, 0.0

INPUTS = ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "mask", "entropy",
          "is_weights")


def loss_and_grads(data, cfg, normaliser):
  """(loss, d/d logprobs, d/d entropy, summed metrics) of one (micro-)batch."""

  def fn(lp, entropy):
    return policy_loss(lp, data["old_logprobs"], data["ref_logprobs"], data["advantages"],
                       data["mask"], entropy, cfg, normaliser, is_weights=data["is_weights"])

  (loss, metrics), (d_lp, d_ent) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(
      data["logprobs"], data["entropy"])
  return loss, d_lp, d_ent, metrics


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_microbatches_sum_to_full_batch(name, aggregation):
  cfg = config(name, aggregation, kl_coef=0.1, entropy_coef=0.01)
  data = {k: jnp.asarray(v) for k, v in batch(seed=11, seq_advantages=name == "gspo").items()
          if k in INPUTS}
  normaliser = global_normaliser(data["mask"], cfg)
  full_loss, full_d_lp, full_d_ent, full_metrics = loss_and_grads(data, cfg, normaliser)
  assert float(jnp.abs(full_d_lp).max()) > 0

  for splits in (2, 4):
    rows = B // splits
    parts = [loss_and_grads({k: v[i * rows:(i + 1) * rows] for k, v in data.items()}, cfg,
                            normaliser) for i in range(splits)]
    np.testing.assert_allclose(sum(float(p[0]) for p in parts), float(full_loss),
                               rtol=LOSS_RTOL, atol=LOSS_ATOL)
    for key in ("pg_loss", "kl_loss", "entropy"):
      np.testing.assert_allclose(sum(float(p[3][key]) for p in parts), float(full_metrics[key]),
                                 rtol=LOSS_RTOL, atol=LOSS_ATOL)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), full_d_lp,
                               rtol=GRAD_RTOL, atol=GRAD_ATOL)
    np.testing.assert_allclose(np.concatenate([p[2] for p in parts]), full_d_ent,
                               rtol=GRAD_RTOL, atol=GRAD_ATOL)


def test_local_normaliser_would_break_equivalence():
  """The check above can fail: normalising each micro-batch by its own count differs."""
  cfg = LossConfig("ppo", aggregation="token-mean")
  data = {k: jnp.asarray(v) for k, v in batch(seed=11).items() if k in INPUTS}
  full = loss_and_grads(data, cfg, global_normaliser(data["mask"], cfg))[0]
  halves = [{k: v[i * B // 2:(i + 1) * B // 2] for k, v in data.items()} for i in range(2)]
  local = sum(loss_and_grads(h, cfg, global_normaliser(h["mask"], cfg))[0] for h in halves) / 2
  assert abs(float(local) - float(full)) > 1e-3
