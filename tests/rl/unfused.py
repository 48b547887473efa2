"""An unfused RL update, the reference the trainer's fused minibatch program must equal.

It is written the way the trainer ran before one program did the whole minibatch: the
reference and old-policy logprobs come from separate forward programs that run the LM head
over every packed position (prompt and padding tokens included) and gather the completion
tokens afterwards; per-token advantages and the normaliser are built outside the loss; each
micro-batch's loss and gradients are their own computation; AdamW runs after. Only the
library's pure functions are shared (policy loss, off-policy correction, canaries,
optimizer), so a wiring mistake in the fused program — a wrong parameter set, a reference
from the updated policy, a misplaced gather at completion positions — shows here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.kernels import chunked_logprob
from jaxrl_post.models.transformer import with_params
from jaxrl_post.rl import metrics as canaries
from jaxrl_post.rl.losses import global_normaliser, policy_loss
from jaxrl_post.rl.masked import masked_mean, sequence_lengths
from jaxrl_post.rl.off_policy import off_policy_correction
from jaxrl_post.rl.packing import completion_bucket, gather_completions, pack
from jaxrl_post.rl.trainer import merge_params, split_minibatches, to_completion_layout


def full_position_logprobs(model, params, packed, temperature):
  """(logprob [B, T], entropy [B, T]): the LM head over all R * S packed positions.

  packed: `host_arrays` of a PackedBatch.
  """
  m = with_params(model, params)
  hidden = m(packed["tokens"], packed["positions"], packed["segment_ids"])  # [R, S, D]
  d = hidden.shape[-1]
  lp, ent = chunked_logprob(hidden.reshape(-1, d), m.lm_head_weight().astype(hidden.dtype),
                            packed["targets"].reshape(-1), temperature)
  index, mask = packed["completion_index"], packed["completion_mask"]
  return gather_completions(lp, index, mask), gather_completions(ent, index, mask)


def host_arrays(packed) -> dict:
  """A PackedBatch's arrays, as a dict a jitted function takes."""
  return {name: np.asarray(getattr(packed, name)) for name in PACKED_FIELDS}


PACKED_FIELDS = ("tokens", "positions", "segment_ids", "targets", "completion_index",
                 "completion_mask")


def unfused_update(trainer, trainable, frozen, opt_state, step, trajectories, behaviour,
                   advantages, ref_params):
  """All optimizer steps of one rollout batch; returns (trainable, opt_state, [metrics]).

  Policy-only models (GRPO family); `advantages` [N] per sequence. The first minibatch's
  old policy is its own forward (the parameters that sampled); later minibatches use the
  logprobs of the parameters before any update, from a separate forward.
  """
  cfg = trainer.cfg
  fwd = jax.jit(lambda p, x: full_position_logprobs(trainer.model, p, x, cfg.temperature))
  t = completion_bucket(max(len(x.completion) for x in trajectories))
  plan = split_minibatches(len(trajectories), cfg.minibatches, cfg.micro_batches)
  before = merge_params(trainable, frozen)
  history = []
  for n, minibatch in enumerate(plan):
    micro = []
    for g in minibatch:
      packed = host_arrays(pack([trajectories[i] for i in g], cfg.row_tokens,
                                max_completion=t))
      mask = jnp.asarray(packed["completion_mask"])
      micro.append(dict(
          packed=packed, mask=mask,
          behaviour=jnp.asarray(to_completion_layout([behaviour[i] for i in g], t)),
          ref=fwd(ref_params, packed)[0],
          old=None if n == 0 else fwd(before, packed)[0],
          advantages=jnp.asarray(np.asarray(advantages, np.float32)[g])[:, None] * mask))
    trainable, opt_state, metrics = _update(trainer, trainable, frozen, opt_state, step, micro)
    step += 1
    history.append(metrics)
  return trainable, opt_state, history


def _loss(trainer, params, frozen, mb, normaliser):
  cfg = trainer.cfg
  logp, ent = full_position_logprobs(trainer.model, merge_params(params, frozen),
                                     mb["packed"], cfg.temperature)
  old = jax.lax.stop_gradient(logp) if mb["old"] is None else mb["old"]
  mask = mb["mask"]
  weights, mask, _ = off_policy_correction(old, mb["behaviour"], mask, cfg.off_policy)
  loss, m = policy_loss(logp, old, mb["ref"], mb["advantages"], mask, ent, cfg.loss,
                        normaliser, is_weights=weights)
  return loss, {"logp": logp, "entropy": ent, "ratio": m["ratio"],
                "clip_low": m["clip_low"], "clip_high": m["clip_high"], "is_weights": weights}


# Each micro-batch's loss and gradients are still their own program; compiled, not run op
# by op (which took most of a minute per test).
_value_and_grad = functools.partial(jax.jit, static_argnums=0)(
    jax.value_and_grad(_loss, argnums=1, has_aux=True))


def _update(trainer, trainable, frozen, opt_state, step, micro):
  cfg = trainer.cfg
  normaliser = global_normaliser(jnp.concatenate([mb["mask"] for mb in micro]), cfg.loss)
  grads = jax.tree.map(jnp.zeros_like, trainable)
  loss, per_token = jnp.float32(0.0), []
  for mb in micro:
    (l, tokens), g = _value_and_grad(trainer, trainable, frozen, mb, normaliser)
    grads, loss = jax.tree.map(jnp.add, grads, g), loss + l
    per_token.append(tokens)
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
  updates, opt_state = trainer.optimizer.update(grads, opt_state, trainable)
  trainable = jax.tree.map(lambda p, u: p + u.astype(p.dtype), trainable, updates)
  cat = lambda key: jnp.concatenate([t[key] for t in per_token])
  inputs = lambda key: jnp.concatenate([mb[key] for mb in micro])
  mask = inputs("mask")
  metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": jnp.int32(0),
             "value_loss": jnp.float32(0.0), "lr": trainer.schedule(step),
             "update_finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
  metrics.update(canaries.ratio_canaries(cat("ratio"), mask))
  metrics["ratio/hist"] = canaries.masked_histogram(cat("ratio"), mask, 15 / 32, 49 / 32, 17)
  metrics.update(canaries.clip_fractions(cat("clip_low"), cat("clip_high"), mask))
  metrics["kl/behaviour"] = canaries.behaviour_kl(cat("logp"), inputs("behaviour"), mask)
  metrics["kl/reference"] = canaries.reference_kl(cat("logp"), inputs("ref"), mask)
  metrics["entropy"] = canaries.mean_entropy(cat("entropy"), mask)
  metrics.update(canaries.logprob_mismatch(cat("logp"), inputs("behaviour"), mask))
  metrics["is/ess"] = canaries.effective_sample_size(cat("is_weights"), mask)
  metrics.update(canaries.advantage_stats(inputs("advantages"), mask))
  lengths = sequence_lengths(mask)
  metrics.update({"length/mean": masked_mean(lengths, lengths > 0),
                  "length/min": jnp.min(jnp.where(lengths > 0, lengths, jnp.inf)),
                  "length/max": jnp.max(lengths)})
  return trainable, opt_state, jax.device_get(metrics)
