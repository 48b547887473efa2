"""Routing replay for mixture-of-experts policies: config and metrics.

The rollout engine and the trainer run the same weights through different kernels and
precisions (bf16 paged decode vs the packed training forward), so a MoE router near a tie
can pick other experts in training than it did when the token was sampled: the gradient is
then taken through experts that never produced the token, and the importance ratio moves
for no reason the policy chose. With replay the trainer's forward takes the experts the
engine recorded for every token, and gates them with its own router probabilities at those
experts, so the router still learns (models.moe).

Metrics, per optimizer step:
  routing/expert_agreement   share of (token, layer) pairs whose recorded experts are the
                             trainer's own top-k, i.e. how often replay changes anything;
  routing/mismatch_replay    |trainer - rollout| logprob, mean over tokens, with replay;
  routing/mismatch_free      the same with the trainer routing by itself;
  moe/balance_loss           the load-balancing loss (1 = uniform), mean over layers.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrl_post.errors import UserError
from jaxrl_post.rl.masked import masked_mean

ROUTING_MODES = ("off", "replay")


@dataclasses.dataclass(frozen=True)
class RoutingReplay:
  """How the trainer routes the tokens of a MoE policy.

  Attributes:
    mode: "replay" routes every token through the experts the rollout engine chose for it;
      "off" lets the trainer's router choose (the recorded experts are still compared).
    measure: a diagnostic: also run the other mode's forward (no gradient) each
      micro-batch, for the logprob mismatch with and without replay
      (routing/mismatch_replay, routing/mismatch_free). It costs one more forward per
      micro-batch, about a third of the train step's FLOPs, so it is off unless asked for.
  """

  mode: str = "replay"
  measure: bool = False

  def __post_init__(self):
    if self.mode not in ROUTING_MODES:
      raise UserError(f"routing replay: mode={self.mode!r} is not one of {ROUTING_MODES}")

  @property
  def replay(self) -> bool:
    return self.mode == "replay"


def routing_sums(routing) -> dict:
  """Per micro-batch scalars of a forward's moe.Routing ([L, ...] over layers)."""
  return {"moe_agree": jnp.sum(routing.agree), "moe_recorded": jnp.sum(routing.recorded),
          "moe_balance": jnp.mean(routing.balance)}


def routing_metrics(t: dict, cfg: RoutingReplay, behaviour, mask) -> dict:
  """The metrics above from the scanned per-micro-batch values `t` ([M, ...] leaves):
  logp (the loss forward's), and logp_other (the other mode's) when measured; behaviour
  and mask are [M * B, T]."""
  out = {"moe/balance_loss": jnp.mean(t["moe_balance"]),
         "routing/expert_agreement": jnp.sum(t["moe_agree"]) / jnp.maximum(
             jnp.sum(t["moe_recorded"]), 1.0)}
  if "logp_other" in t:
    gap = lambda lp: masked_mean(jnp.abs(lp.reshape(behaviour.shape) - behaviour), mask)
    with_replay, free = t["logp"], t["logp_other"]
    if not cfg.replay:
      with_replay, free = free, with_replay
    out["routing/mismatch_replay"] = gap(with_replay)
    out["routing/mismatch_free"] = gap(free)
  return out
