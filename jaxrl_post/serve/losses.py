"""The loss functions a Tinker client names in forward_backward, as pure per-token terms.

Each takes the current logprobs of the target tokens lp [B, T], the datums' loss_fn_inputs
as [B, T] arrays (zero past each datum's length), the valid-token mask [B, T] and the
loss_fn_config, and returns the per-token loss [B, T]; the caller sums it (Tinker's losses
are sums over tokens, never means) and takes the gradient. `logprobs` in the inputs is the
sampler's (q), `advantages` A, and ratio = exp(lp - log q).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.registry import Registry


@dataclasses.dataclass(frozen=True)
class TinkerLoss:
  fn: Callable  # (lp, inputs, mask, config) -> per-token loss [B, T]
  inputs: tuple[str, ...]  # loss_fn_inputs it reads (besides target_tokens)
  config: dict[str, float]  # loss_fn_config keys it takes, with their defaults


LOSSES = Registry("loss_fn")


def register(name: str, inputs: tuple[str, ...], **config: float):
  def wrap(fn):
    LOSSES.register(name)(TinkerLoss(fn, inputs, config))
    return fn
  return wrap


def _ratio(lp, inputs):
  return jnp.exp(lp - inputs["logprobs"])


def _clip(ratio, config):
  return jnp.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])


@register("cross_entropy", ("weights",))
def cross_entropy(lp, inputs, mask, config):
  # weights are 0/1 masks for supervised data, and dLoss/dlogprob for a client-side
  # custom loss (which the SDK sends as a weighted cross_entropy).
  return -lp * inputs["weights"] * mask


@register("importance_sampling", ("logprobs", "advantages"))
def importance_sampling(lp, inputs, mask, config):
  return -_ratio(lp, inputs) * inputs["advantages"] * mask


@register("ppo", ("logprobs", "advantages"), clip_low_threshold=0.8, clip_high_threshold=1.2)
def ppo(lp, inputs, mask, config):
  ratio, adv = _ratio(lp, inputs), inputs["advantages"]
  return -jnp.minimum(ratio * adv, _clip(ratio, config) * adv) * mask


@register("cispo", ("logprobs", "advantages"), clip_low_threshold=0.8, clip_high_threshold=1.2)
def cispo(lp, inputs, mask, config):
  weight = jax.lax.stop_gradient(_clip(_ratio(lp, inputs), config))
  return -weight * lp * inputs["advantages"] * mask


@register("dro", ("logprobs", "advantages"), beta=float("nan"))
def dro(lp, inputs, mask, config):
  penalty = 0.5 * config["beta"] * jnp.square(lp - inputs["logprobs"])
  return -(lp * inputs["advantages"] - penalty) * mask


@register("gspo", ("logprobs", "advantages", "sequence_ratio_mask"),
          clip_low_threshold=0.8, clip_high_threshold=1.2)
def gspo(lp, inputs, mask, config):
  # GSPO-token: every token carries the sequence's geometric-mean ratio (over the sampled
  # tokens sequence_ratio_mask marks) as its value, and its own logprob's gradient.
  seq_mask = inputs["sequence_ratio_mask"] * mask
  log_ratio = (lp - inputs["logprobs"]) * seq_mask
  seq = jnp.sum(log_ratio, -1, keepdims=True) / jnp.maximum(jnp.sum(seq_mask, -1, keepdims=True), 1)
  ratio = jnp.exp(jax.lax.stop_gradient(seq) + lp - jax.lax.stop_gradient(lp))
  adv = inputs["advantages"]
  return -jnp.minimum(ratio * adv, _clip(ratio, config) * adv) * seq_mask


REFUSED = {
    "stable_reinforce": "its objective and the stability information its samplers record "
                        "(record_stability_info) are not published, so it is not served; "
                        "use importance_sampling, ppo or cispo",
    "custom": "server-side custom losses are off: the SDK computes custom losses as forward "
              "+ cross_entropy",
}


def resolve(name: str, config: dict) -> tuple[TinkerLoss, dict[str, float]]:
  """The loss and its full config (defaults filled in); a UserError names what is wrong."""
  if name in REFUSED:
    raise UserError(f"loss_fn {name!r}: {REFUSED[name]}")
  LOSSES.check("forward_backward", "loss_fn", name)
  loss = LOSSES.get(name)
  unknown = sorted(set(config) - set(loss.config))
  if unknown:
    raise UserError(f"loss_fn_config: {unknown} are not options of {name!r} "
                    f"(it takes {sorted(loss.config) or 'none'})")
  full = {**loss.config, **config}
  for key, value in full.items():
    if not isinstance(value, (int, float)) or value != value:
      raise UserError(f"loss_fn_config.{key}: {name!r} needs a number, got {value!r}")
  return loss, {k: float(v) for k, v in full.items()}
