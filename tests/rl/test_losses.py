"""Policy losses, KL terms and aggregation against the NumPy loop references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.rl import LossConfig, global_normaliser, kl_estimate, policy_loss
from tests.rl import reference as ref
from tests.rl.helpers import assert_close, batch

LOSSES = {
    "ppo": LossConfig("ppo", clip_low=0.2, clip_high=0.28),
    "dual_clip": LossConfig("dual_clip", clip_low=0.2, clip_high=0.28, clip_c=1.5),
    "gspo": LossConfig("gspo", clip_low=0.03, clip_high=0.05),
    "cispo": LossConfig("cispo", clip_low=0.2, clip_high=0.28),
}
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")
NORM_LENGTH = 16


def config(name, aggregation, **extra):
  return LossConfig(**{**LOSSES[name].__dict__, "aggregation": aggregation,
                       "norm_length": NORM_LENGTH, **extra})


def run(data, cfg, with_terms=True):
  """(loss, metrics, d loss / d logprobs, d loss / d entropy) on the given batch."""
  j = {k: jnp.asarray(v) for k, v in data.items()}
  normaliser = global_normaliser(j["mask"], cfg)

  def fn(lp, entropy):
    return policy_loss(lp, j["old_logprobs"], j["ref_logprobs"] if with_terms else None,
                       j["advantages"], j["mask"], entropy if with_terms else None, cfg,
                       normaliser, is_weights=j["is_weights"] if with_terms else None)

  (loss, metrics), grads = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(
      j["logprobs"], j["entropy"])
  return loss, metrics, grads[0], grads[1]


def reference_terms(data, cfg):
  """NumPy per-token pg loss, d pg / d lp and clip indicators (low, high, dual)."""
  args = (data["logprobs"], data["old_logprobs"], data["advantages"], data["mask"], cfg)
  if cfg.name in ("ppo", "dual_clip"):
    return ref.ppo(*args, dual=cfg.name == "dual_clip")
  out = ref.gspo(*args) if cfg.name == "gspo" else ref.cispo(*args)
  return (*out, np.zeros_like(data["mask"]))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_policy_loss_matches_reference(name, aggregation):
  data = batch(seed=1)
  cfg = config(name, aggregation, kl_coef=0.1, entropy_coef=0.01)
  loss, metrics, d_lp, d_ent = run(data, cfg)

  mask = data["mask"]
  pg, d_pg, low, high, dual = reference_terms(data, cfg)
  kl, d_kl = ref.kl(data["logprobs"], data["ref_logprobs"], mask, "k3")
  w = ref.aggregation_weights(mask, aggregation, mask, NORM_LENGTH)
  isw = np.where(mask > 0, data["is_weights"], 0.0)
  pg_loss = ref.weighted_sum(w, pg * isw, mask)
  kl_loss = ref.weighted_sum(w, kl, mask)
  entropy = ref.weighted_sum(w, data["entropy"], mask)
  # The data must exercise both clip bounds (and the dual clip), or the test proves little.
  assert low.any() and high.any() and (dual.any() or name != "dual_clip")

  assert_close(loss, pg_loss + 0.1 * kl_loss - 0.01 * entropy)
  assert_close(metrics["pg_loss"], pg_loss)
  assert_close(metrics["kl_loss"], kl_loss)
  assert_close(metrics["entropy"], entropy)
  assert_close(d_lp, w * (d_pg * isw + 0.1 * d_kl))
  assert_close(d_ent, -0.01 * w)
  np.testing.assert_array_equal(metrics["clip_low"], low)
  np.testing.assert_array_equal(metrics["clip_high"], high)
  if name == "dual_clip":
    np.testing.assert_array_equal(metrics["clip_dual"], dual)
  assert_close(metrics["kl"], kl)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_per_token_losses_and_ratio(name):
  """Per-token values through the registry, without the auxiliary terms."""
  from jaxrl_post.rl.losses import POLICY_LOSSES
  data = batch(seed=2)
  cfg = LOSSES[name]
  loss, metrics = POLICY_LOSSES.get(name)(*(jnp.asarray(data[k]) for k in (
      "logprobs", "old_logprobs", "advantages", "mask")), cfg)
  pg = reference_terms(data, cfg)[0]
  assert_close(loss, pg)
  mask = data["mask"]
  if name == "gspo":
    ratio = ref.to_tokens(ref.sequence_ratios(data["logprobs"], data["old_logprobs"], mask), mask)
  else:
    ratio = np.where(mask > 0, np.exp(np.float64(data["logprobs"]) - data["old_logprobs"]), 0.0)
  assert_close(metrics["ratio"], ratio)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_gradient_is_the_sequence_objective(aggregation):
  """With sequence-level advantages, the GSPO-token gradient equals the gradient of the
  plain sequence objective taken through s = exp(mean log ratio)."""
  data = batch(seed=3, seq_advantages=True)
  cfg = config("gspo", aggregation)
  _, _, d_lp, _ = run(data, cfg, with_terms=False)
  mask = data["mask"]
  w = ref.aggregation_weights(mask, aggregation, mask, NORM_LENGTH)
  seq_adv = np.where(mask > 0, data["advantages"], -np.inf).max(axis=1)  # constant per row
  want = ref.gspo_sequence_grad(data["logprobs"], data["old_logprobs"], seq_adv, mask, cfg, w)
  assert np.abs(want).max() > 0
  assert_close(d_lp, want)


@pytest.mark.parametrize("clips", [(0.2, 0.28), (0.0, 0.0), (1.0, 0.0)])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_first_on_policy_step(name, clips):
  """logprobs == old_logprobs: the ratio is exactly 1, nothing is clipped, and the
  gradient is the plain policy gradient -A (times the aggregation weight)."""
  data = batch(seed=4)
  data["old_logprobs"] = np.where(data["mask"] > 0, data["logprobs"], 0.0).astype(np.float32)
  cfg = config(name, "token-mean", clip_low=clips[0], clip_high=clips[1])
  _, metrics, d_lp, _ = run(data, cfg, with_terms=False)
  m = data["mask"] > 0
  np.testing.assert_array_equal(np.asarray(metrics["ratio"])[m], 1.0)
  for key in ("clip_low", "clip_high", "clip_dual"):
    if key in metrics:
      assert float(jnp.sum(metrics[key])) == 0.0
  w = ref.aggregation_weights(data["mask"], "token-mean", data["mask"])
  assert_close(d_lp, -w * np.where(m, data["advantages"], 0.0))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
  data = batch(seed=5)
  mask = data["mask"]
  want, d_want = ref.kl(data["logprobs"], data["ref_logprobs"], mask, estimator)
  fn = lambda lp: kl_estimate(lp, data["ref_logprobs"], mask, estimator)
  assert_close(fn(data["logprobs"]), want)
  d_got = jax.grad(lambda lp: jnp.sum(fn(lp)))(jnp.asarray(data["logprobs"]))
  assert_close(d_got, d_want)
  # As a loss term: kl_coef * aggregated KL, gradient through the estimator.
  cfg = config("ppo", "token-mean", kl_coef=0.5, kl_estimator=estimator)
  _, metrics, _, _ = run(data, cfg)
  w = ref.aggregation_weights(mask, "token-mean", mask)
  assert_close(metrics["kl_loss"], ref.weighted_sum(w, want, mask))


def test_k3_is_nonnegative_and_exact_near_zero():
  lp = jnp.asarray([[-1.0, -1.0, -2.0]])
  other = jnp.asarray([[-1.0, -1.0 + 1e-4, -2.0 - 1e-3]])
  k3 = np.asarray(kl_estimate(lp, other, jnp.ones_like(lp), "k3"))
  assert k3[0, 0] == 0.0 and (k3 >= 0).all()
  assert_close(k3[0, 1:], [0.5e-8, 0.5e-6], rtol=2e-2, atol=0)  # d^2/2 to leading order


def test_padding_never_leaks():
  """Junk at padded positions (inf, NaN, 1e4) leaves values and gradients finite, and the
  gradients there are exactly 0."""
  for name in LOSSES:
    for aggregation in AGGREGATIONS:
      loss, metrics, d_lp, d_ent = run(batch(seed=6), config(name, aggregation, kl_coef=0.1,
                                                             entropy_coef=0.01))
      pad = batch(seed=6)["mask"] == 0
      assert np.isfinite(float(loss))
      assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())
      assert (np.asarray(d_lp)[pad] == 0).all() and (np.asarray(d_ent)[pad] == 0).all()


def test_jit_matches_eager():
  data = {k: jnp.asarray(v) for k, v in batch(seed=7).items()}
  cfg = config("dual_clip", "seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01)
  args = (data["logprobs"], data["old_logprobs"], data["ref_logprobs"], data["advantages"],
          data["mask"], data["entropy"])
  normaliser = global_normaliser(data["mask"], cfg)
  jitted = jax.jit(functools.partial(policy_loss, cfg=cfg))(*args, normaliser=normaliser)
  eager = policy_loss(*args, cfg, normaliser)
  assert_close(jitted[0], eager[0])


def test_missing_inputs_for_configured_terms():
  data = {k: jnp.asarray(v) for k, v in batch().items()}
  args = (data["logprobs"], data["old_logprobs"])
  with pytest.raises(ValueError, match="ref_logprobs"):
    policy_loss(*args, None, data["advantages"], data["mask"], data["entropy"],
                LossConfig(kl_coef=0.1), 1.0)
  with pytest.raises(ValueError, match="entropy"):
    policy_loss(*args, data["ref_logprobs"], data["advantages"], data["mask"], None,
                LossConfig(entropy_coef=0.1), 1.0)


def test_auxiliary_inputs_are_constants():
  """The old, reference and importance-weight inputs get no gradient, even when a caller
  derives them from the differentiated logprobs."""
  data = {k: jnp.asarray(v) for k, v in batch(seed=8).items()}
  cfg = config("ppo", "token-mean", kl_coef=0.1)
  normaliser = global_normaliser(data["mask"], cfg)

  def fn(old, ref_lp, weights):
    return policy_loss(data["logprobs"], old, ref_lp, data["advantages"], data["mask"], None,
                       cfg, normaliser, is_weights=weights)[0]

  grads = jax.grad(fn, argnums=(0, 1, 2))(data["old_logprobs"], data["ref_logprobs"],
                                          data["is_weights"])
  for g in grads:
    assert float(jnp.abs(g).max()) == 0.0
