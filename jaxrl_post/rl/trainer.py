"""The jitted trainer step: packed forward, chunked logprobs, policy loss, AdamW.

One rollout batch becomes `minibatches` optimizer steps; each step accumulates gradients
over `micro_batches` packed micro-batches (lax.scan), with the loss normalised by the whole
step's token or sequence count so micro-batching changes nothing.

Each optimizer step is one compiled program, fed the packed minibatch: it runs the
reference forward (only when the loss has a KL term: at kl_coef 0 it would cost a quarter
of the step's FLOPs for a metric), gathers the advantages, takes the normaliser, the loss
and gradients and the AdamW update, and returns the metrics as device arrays. Separate no-gradient
programs per micro-batch and per-minibatch metric fetches each cost a dispatch and a host
round trip, which dominate a small model's step; here the host packs each micro-batch
once, places the rollout batch once, and fetches the metrics once per rollout batch. The
first minibatch's parameters are the old policy, so its forward doubles as the old
logprobs; the old policy of the later minibatches is a forward program run before it,
and every minibatch runs the same train program (one to compile per rollout batch shape,
not two). Parameters are f32
masters; the forward computes in the model's compute dtype (bf16 by default). A step whose
loss or gradient is not finite leaves parameters and optimizer state untouched and is
counted in `TrainState.skipped`.

With LoRA only the adapters train; the frozen base lives in `TrainState.frozen` and the
reference policy is the base with the adapters switched off (no second copy of weights).

On a mesh the step is data-parallel by sharding, not by a loop: the packed rows R and the
trajectories B of every batch are split over the mesh axes the rules give "batch" (data,
fsdp in training), and the jitted functions trace under `activation_rules`, so the model's
activation constraints keep each device on its own rows. Rows and trajectories are padded
to a multiple of that shard count with padding that carries no completion token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, abstract_model
from jaxrl_post.models.transformer import logical_axes, params_of, split_adapters
from jaxrl_post.rl import metrics as canaries
from jaxrl_post.rl.advantages import AdvantageConfig, compute_advantages
from jaxrl_post.rl.forward import PackedInputs, completion_logprobs, completion_outputs
from jaxrl_post.rl.losses import LossConfig, global_normaliser, policy_loss
from jaxrl_post.rl.masked import masked_mean, sequence_lengths, to_tokens
from jaxrl_post.rl.off_policy import OffPolicyConfig, off_policy_correction
from jaxrl_post.rl.optim import OptimizerConfig, learning_rate_schedule, make_optimizer
from jaxrl_post.rl.routing import RoutingReplay, routing_metrics, routing_sums
from jaxrl_post.rl.packing import (Trajectory, bucket, completion_bucket, head_bucket,
                                   head_tokens, pack, pad_rows, pad_trajectories,
                                   with_head_layout)
from jaxrl_post.rl.value import terminal_rewards, value_loss
from jaxrl_post.sharding import (TRAINING_RULES, activation_rules, hosts, logical_to_spec,
                                 spec_axes, tree_shardings)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  loss: LossConfig = LossConfig()
  off_policy: Optional[OffPolicyConfig] = OffPolicyConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  minibatches: int = 1  # Optimizer steps per rollout batch.
  micro_batches: int = 1  # Gradient-accumulation chunks per optimizer step.
  row_tokens: int = 1024  # Packed row length.
  temperature: float = 1.0  # The rollout's sampling temperature.
  value_coef: float = 0.5  # PPO critic loss weight (models with a value head).
  value_clip: float = 0.2
  gae: AdvantageConfig = AdvantageConfig("gae")  # PPO advantages (value head).
  routing: RoutingReplay = RoutingReplay()  # MoE policies: route by the rollout's experts.
  balance_coef: float = 0.0  # MoE policies: weight of the load-balancing loss term.

  def __post_init__(self):
    for name in ("minibatches", "micro_batches", "row_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise UserError(f"trainer config: {name} must be a positive integer, got {value!r}")
    if self.temperature <= 0:
      raise UserError(f"trainer config: temperature must be > 0, got {self.temperature}")
    if self.balance_coef < 0:
      raise UserError(f"trainer config: balance_coef must be >= 0, got {self.balance_coef}")


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 optimizer steps taken (skipped ones included)
  params: dict  # trainable f32 parameters
  frozen: dict  # parameters that do not train (the LoRA base), else {}
  opt_state: Any
  skipped: jax.Array  # int32 steps whose update was dropped as non-finite


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
  """One minibatch as packed on the host; every leaf has a leading micro-batch axis [M]."""

  inputs: PackedInputs
  behaviour_logprobs: jax.Array  # [M, B, T] from the rollout engine
  sequence: jax.Array  # [M, B] int32 index into the rollout batch (0 for padding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceScores:
  """Per-trajectory values of the whole rollout batch, [N] each, in rollout order.

  Group estimators need the whole batch, so they are computed before it is split; each
  minibatch program gathers its trajectories' entries through StepBatch.sequence.
  """

  # [N] sequence advantages (GRPO family; zeros for a critic model), or [N, T] per token in
  # the completion layout of pack_rollouts (multi-turn reward-to-go credit: rl.turn_credit).
  advantages: jax.Array
  rewards: jax.Array  # [N] sequence rewards (GAE's terminal rewards with a critic)

  @classmethod
  def of(cls, n: int, advantages=None, rewards=None) -> "SequenceScores":
    def f32(x):  # A device array stays where it is (no fetch); host values become f32.
      if x is None:
        return np.zeros(n, np.float32)
      return x if isinstance(x, jax.Array) else np.asarray(x, np.float32)

    return cls(f32(advantages), f32(rewards))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OldPolicy:
  """The policy before a rollout batch's updates, on one minibatch: [M, B, T] each."""

  logprobs: jax.Array
  values: jax.Array  # the critic's (zeros without a value head)


def merge_params(a: dict, b: dict) -> dict:
  """Union of two nested dicts with disjoint leaves (trainable + frozen)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = merge_params(out[k], v) if isinstance(v, dict) and k in out else v
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Micro:
  """What the scan over a minibatch's micro-batches feeds one loss: [B, ...] leaves."""

  inputs: PackedInputs
  behaviour_logprobs: jax.Array  # [B, T]
  advantages: jax.Array  # [B] sequence advantages, or [B, T] per token
  rewards: jax.Array  # [B]
  old: Optional[OldPolicy]  # [B, T] each; None: these parameters are the old policy


class Trainer:
  """Builds and runs the jitted minibatch update for one model config on the training mesh."""

  def __init__(self, model_cfg: ModelConfig, cfg: TrainerConfig = TrainerConfig(),
               mesh: Optional[Mesh] = None, rules=TRAINING_RULES):
    self.model_cfg, self.cfg, self.mesh, self.rules = model_cfg, cfg, mesh, rules
    self.model = abstract_model(model_cfg)
    self.lora = model_cfg.lora is not None
    self.value_head = model_cfg.value_head
    self.moe = model_cfg.moe is not None
    self.replay = self.moe and cfg.routing.replay  # Static: which routing the forwards take.
    self.optimizer = make_optimizer(cfg.optimizer)
    self.schedule = learning_rate_schedule(cfg.optimizer)
    self.param_shardings = None
    self.batch_shards = 1  # Pieces the rows and trajectories of a batch are split into.
    self._inputs_sharding = self._batch_sharding = self._replicated = None
    if mesh is not None:
      self.param_shardings = tree_shardings(logical_axes(self.model), params_of(self.model),
                                            rules, mesh)
      axes = _batch_axes(rules, mesh)
      self.batch_shards = math.prod(mesh.shape[a] for a in spec_axes(axes))
      self._inputs_sharding = NamedSharding(mesh, PartitionSpec(axes))  # [R, ...], [B, ...]
      self._batch_sharding = NamedSharding(mesh, PartitionSpec(None, axes))  # [M, R or B, ...]
      self._replicated = NamedSharding(mesh, PartitionSpec())
    self._logprobs = self.jit(self._completion_logprobs)
    self._values = self.jit(self._completion_values)
    # Split like the batches: a later minibatch's old policy is an input of the train
    # program beside the first's (`_no_old_policy`), in the same sharding.
    self._old = self.jit(self.minibatch_old_policy, **(
        {} if mesh is None else {"out_shardings": self._batch_sharding}))
    self._update = None  # Built by init_state, once the state's shardings are known.
    self._no_old = {}  # _no_old_policy's arrays, by shape.

  def jit(self, fn, **kwargs):
    """jax.jit of fn traced under this trainer's activation rules, as every program of the
    trainer is (and as plan lowers them). The rules must be active while jax traces (not
    around a call). Inputs arrive placed (`place_*`), so their own shardings are the
    programs' input shardings."""
    @functools.wraps(fn)
    def traced(*args, **kw):
      with activation_rules(self.rules, self.mesh):
        return fn(*args, **kw)

    return jax.jit(traced, **kwargs)

  def place_inputs(self, inputs: PackedInputs) -> PackedInputs:
    """A packed batch on the device(s), rows and trajectories split over the batch shards."""
    return self._place(inputs, self._inputs_sharding, axis=0)

  def place_batch(self, batch):
    """A step's batch (or a list of them) on the device(s), split like `place_inputs`
    behind its [M] axis, in one transfer."""
    return self._place(batch, self._batch_sharding, axis=1)

  def place_scores(self, scores: SequenceScores) -> SequenceScores:
    """Per-sequence values on the device(s), whole on each (every shard gathers from it)."""
    return jax.device_put(scores, self._replicated)

  def _place(self, tree, sharding, axis: int):
    if sharding is None:
      return jax.device_put(tree)
    for x in jax.tree.leaves(tree):
      if x.shape[axis] % self.batch_shards:
        raise ValueError(f"trainer: a batch dimension of {x.shape[axis]} (shape {x.shape}) "
                         f"does not split over {self.batch_shards} batch shards; pack with "
                         f"pack_micro_batches(..., shards={self.batch_shards})")
    return jax.device_put(tree, sharding)

  # ------------------------------------------------------------------ state

  def split(self, params: dict) -> tuple[dict, dict]:
    """(trainable, frozen) halves of a full parameter dict."""
    if not self.lora:
      return params, {}
    return split_adapters(params)

  def place(self, params: dict) -> dict:
    """Full parameters in the training sharding (unchanged without a mesh)."""
    if self.param_shardings is None:
      return params
    return jax.device_put(params, self.param_shardings)

  def init_state(self, params: dict) -> TrainState:
    """A TrainState from full parameters, placed on the training mesh when one is set.

    The jitted update is built here with explicit out_shardings equal to the state's, so
    the state never moves between steps and donation recycles its buffers in place.
    """
    # The state owns copies: steps donate its buffers, and the caller's arrays (often the
    # reference weights too) must stay valid.
    trainable, frozen = jax.tree.map(jnp.copy, self.split(self.place(params)))
    shardings = None
    if self.mesh is not None:
      opt_abstract = jax.eval_shape(self.optimizer.init, trainable)
      shardings = optimizer_state_shardings(opt_abstract, trainable, self.mesh)
    opt_state = jax.jit(self.optimizer.init, out_shardings=shardings)(trainable)
    state = TrainState(step=jnp.zeros((), jnp.int32), params=trainable, frozen=frozen,
                       opt_state=opt_state, skipped=jnp.zeros((), jnp.int32))
    out = {}
    if self.mesh is not None:
      placed = _state_shardings(state, self.mesh)
      state = jax.device_put(state, placed)
      # Metrics replicated (small, and every process can read them).
      out = {"out_shardings": (placed, self._replicated)}
    self._update = self.jit(self.minibatch_update, donate_argnums=0, **out)
    return state

  def full_params(self, state: TrainState) -> dict:
    return merge_params(state.params, state.frozen)

  def reference_params(self, state: TrainState) -> dict:
    """The base model with LoRA switched off (zero adapters); needs no weight copy."""
    if not self.lora:
      raise ValueError("without LoRA, keep a frozen copy of the initial parameters")
    return merge_params(jax.tree.map(jnp.zeros_like, state.params), state.frozen)

  # ---------------------------------------------------------------- logprobs

  def _completion_logprobs(self, params, inputs: PackedInputs):
    return completion_logprobs(self.model, params, inputs, self.cfg.temperature,
                               replay=self.replay)

  def logprobs(self, params: dict, inputs: PackedInputs):
    """(logprob [B, T], entropy [B, T]) of a packed batch under `params` (no gradient)."""
    return self._logprobs(params, self.place_inputs(inputs))

  def _completion_values(self, params, inputs: PackedInputs):
    return completion_logprobs(self.model, params, inputs, self.cfg.temperature,
                               with_values=True)[2]

  def values(self, params: dict, inputs: PackedInputs):
    """Critic values [B, T] of a packed batch under `params` (value-head models)."""
    return self._values(params, self.place_inputs(inputs))

  def old_policy(self, params: dict, inputs: PackedInputs) -> OldPolicy:
    """The OldPolicy of `params` on a minibatch's placed inputs ([M, ...] leaves): the
    `old` argument of a minibatch that the sampling parameters no longer hold."""
    return self._old(params, inputs)

  def minibatch_old_policy(self, params: dict, inputs: PackedInputs) -> OldPolicy:
    """The OldPolicy of a minibatch's [M, ...] inputs, as `old_policy` computes it
    unjitted (for plan to lower): one forward body mapped over its micro-batches."""
    return jax.lax.map(lambda x: self._old_policy(params, x), inputs)

  def _old_policy(self, params: dict, inputs: PackedInputs) -> OldPolicy:
    """Logprobs (and critic values) of one packed micro-batch, without gradients."""
    out = completion_logprobs(self.model, params, inputs, self.cfg.temperature,
                              with_values=self.value_head, replay=self.replay)
    values = out[2] if self.value_head else jnp.zeros_like(out[0])
    return jax.lax.stop_gradient(OldPolicy(out[0], values))

  # ----------------------------------------------------------------- update

  def _advantages(self, mb: _Micro, old_values, mask):  # -> ([B, T], [B, T])
    """(advantages, returns) per token: the sequence advantages broadcast to the tokens,
    or with a critic GAE over its old values, the reward on each sequence's last token."""
    if not self.value_head:
      return to_tokens(mb.advantages, mask), jnp.zeros_like(mask)
    return compute_advantages(terminal_rewards(mb.rewards, mask), mask, self.cfg.gae,
                              values=old_values)

  def _micro_loss(self, trainable, frozen, mb: _Micro, ref_logprobs, normaliser,
                  micro_batches: int = 1, first=None):
    params = merge_params(trainable, frozen)
    out = completion_outputs(self.model, params, mb.inputs, self.cfg.temperature,
                             with_values=self.value_head, replay=self.replay)
    logp, ent = out.logprobs, out.entropy
    values = out.values if self.value_head else jnp.zeros_like(logp)
    # The first minibatch's parameters are the old policy: reuse this forward (exact
    # ratio 1, one forward pass saved) instead of a separately computed copy.
    own = jax.lax.stop_gradient(OldPolicy(logp, values))
    old = own if mb.old is None else mb.old
    if first is not None:  # One program for every minibatch: the flag picks, exactly.
      old = jax.tree.map(lambda a, b: jnp.where(first, a, b), own, mb.old)
    mask = mb.inputs.completion_mask
    advantages, returns = self._advantages(mb, old.values, mask)
    loss_mask, weights = mask, None
    if self.cfg.off_policy is not None:
      weights, loss_mask, _ = off_policy_correction(old.logprobs, mb.behaviour_logprobs, mask,
                                                    self.cfg.off_policy)
    loss, m = policy_loss(logp, old.logprobs, ref_logprobs, advantages, loss_mask, ent,
                          self.cfg.loss, normaliser, is_weights=weights)
    v_loss = jnp.float32(0.0)
    if self.value_head:
      v_loss = value_loss(values, old.values, returns, mask, self.cfg.value_clip, normaliser,
                          self.cfg.loss)
      loss = loss + self.cfg.value_coef * v_loss
    per_token = {"logp": logp, "entropy": ent, "ratio": m["ratio"],
                 "clip_low": m["clip_low"], "clip_high": m["clip_high"],
                 "is_weights": weights if weights is not None else jnp.ones_like(logp),
                 "advantages": advantages, "value_loss": v_loss, "old_logp": old.logprobs}
    if self.moe:
      per_token.update(routing_sums(out.routing))
      # A per-micro-batch mean: scaled so the step's micro-batches add up to one mean.
      loss = loss + self.cfg.balance_coef * per_token["moe_balance"] / micro_batches
      if self.cfg.routing.measure and mb.inputs.experts is not None:
        other = completion_logprobs(self.model, params, mb.inputs, self.cfg.temperature,
                                    replay=not self.replay)[0]
        per_token["logp_other"] = jax.lax.stop_gradient(other)
    return loss, per_token

  def minibatch_update(self, state: TrainState, ref_params: Optional[dict],
                       batch: StepBatch, scores: SequenceScores, old: Optional[OldPolicy],
                       first=None):
    """One optimizer step on a minibatch, with every pass it needs, as one program.

    Reference logprobs (from `ref_params`, or the LoRA base when None), the normaliser,
    the advantages, the loss and gradients of each micro-batch (scanned), the AdamW update
    and the metrics. `old` None marks the only minibatch of a rollout batch: its
    parameters are the old policy, so its own forward gives the old logprobs.

    `first` (a traced bool, with `old` given) makes one program for all minibatches of a
    rollout batch: where it is true its own forward is the old policy (`old` unread),
    where false `old` is, computed before the first update (`Trainer.update`).

    Returns:
      (new state, metrics as device scalars and histograms).
    """
    ref = None
    if self.cfg.loss.kl_coef > 0:
      ref = ref_params if ref_params is not None else self.reference_params(state)
    mask = batch.inputs.completion_mask  # [M, B, T]: the whole step's tokens
    normaliser = global_normaliser(mask.reshape(-1, mask.shape[-1]), self.cfg.loss)
    micro = _Micro(batch.inputs, batch.behaviour_logprobs, scores.advantages[batch.sequence],
                   scores.rewards[batch.sequence], old)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def accumulate(carry, mb):
      grads, total = carry
      ref_logp = None
      if ref is not None:
        ref_logp = jax.lax.stop_gradient(completion_logprobs(
            self.model, ref, mb.inputs, self.cfg.temperature, replay=self.replay)[0])
      (loss, per_token), g = grad_fn(state.params, state.frozen, mb, ref_logp, normaliser,
                                     mask.shape[0], first)
      if ref_logp is not None:
        per_token = per_token | {"ref_logp": ref_logp}
      return (jax.tree.map(jnp.add, grads, g), total + loss), per_token

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, loss), per_token = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)), micro)
    new_state, metrics = self._apply(state, grads, loss)
    metrics["value_loss"] = jnp.sum(per_token["value_loss"])
    metrics.update(self._canaries(batch, per_token))
    return new_state, metrics

  def _apply(self, state: TrainState, grads, loss) -> tuple[TrainState, dict]:
    """The AdamW update, dropped (and counted) when the loss or a gradient is not finite."""
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                              opt_state=keep(opt_state, state.opt_state),
                              skipped=state.skipped + (~finite).astype(jnp.int32))
    return new_state, {"loss": loss, "grad_norm": grad_norm, "skipped": new_state.skipped,
                       "lr": self.schedule(state.step), "update_finite": finite}

  def _canaries(self, batch: StepBatch, t: dict) -> dict:
    flat = lambda x: x.reshape(-1, x.shape[-1])  # [M, B, T] -> [M * B, T]
    mask = flat(batch.inputs.completion_mask)
    out = {}
    out.update(canaries.ratio_canaries(flat(t["ratio"]), mask))
    # 17 bins of 1/16 centred on 1 (the outer bins also count everything beyond them).
    # Ratio 1 is the mode (on-policy tokens, tokens an update left alone): on a bin edge,
    # summation-order rounding (another device count) would move those tokens across it.
    out["ratio/hist"] = canaries.masked_histogram(flat(t["ratio"]), mask, 15 / 32, 49 / 32, 17)
    out.update(canaries.clip_fractions(flat(t["clip_low"]), flat(t["clip_high"]), mask))
    out["kl/behaviour"] = canaries.behaviour_kl(flat(t["logp"]), flat(batch.behaviour_logprobs),
                                                mask)
    if "ref_logp" in t:  # Only a loss with a KL term runs the reference forward.
      out["kl/reference"] = canaries.reference_kl(flat(t["logp"]), flat(t["ref_logp"]), mask)
    out["entropy"] = canaries.mean_entropy(flat(t["entropy"]), mask)
    if self.moe:
      out.update(routing_metrics(t, self.cfg.routing, flat(batch.behaviour_logprobs), mask))
    out.update(canaries.logprob_mismatch(flat(t["logp"]), flat(batch.behaviour_logprobs), mask))
    out["is/ess"] = canaries.effective_sample_size(flat(t["is_weights"]), mask)
    out.update(canaries.advantage_stats(flat(t["advantages"]), mask))
    out.update(_length_stats(mask))
    if self.cfg.off_policy is not None:
      # The loss takes the correction per micro-batch; its statistics are over the whole
      # minibatch's tokens (rows are sequences, so flattening changes no sequence test).
      _, _, corrected = off_policy_correction(flat(t["old_logp"]),
                                              flat(batch.behaviour_logprobs), mask,
                                              self.cfg.off_policy)
      out.update({f"off_policy/{name}": v for name, v in corrected.items()})
    return out

  def step(self, state: TrainState, batch: StepBatch, scores: SequenceScores,
           ref_params: Optional[dict] = None, old: Optional[OldPolicy] = None
           ) -> tuple[TrainState, dict]:
    """One optimizer step; `state` is donated.

    Args:
      state: the current state.
      batch: the minibatch (host or placed).
      scores: the rollout batch's per-sequence advantages and rewards.
      ref_params: frozen reference parameters; None with LoRA (the base is the reference).
        Unused when the loss has no KL term (kl_coef 0).
      old: the old policy on this minibatch (`old_policy` of the parameters that sampled
        it); None when `state`'s parameters are it.

    Returns:
      (new state, metrics as device arrays).
    """
    return self._update(state, ref_params, self.place_batch(batch), self.place_scores(scores),
                        old)

  def update(self, state: TrainState, batches: Sequence[StepBatch], scores: SequenceScores,
             ref_params: Optional[dict] = None) -> tuple[TrainState, list[dict]]:
    """All optimizer steps of one rollout batch: the old policy of the later minibatches,
    then one call of one train program per minibatch; the metrics stay on the device, for
    one fetch per step (`fetch_metrics`)."""
    batches, scores = self.place_batch(list(batches)), self.place_scores(scores)
    if len(batches) == 1:
      state, metrics = self._update(state, ref_params, batches[0], scores, None)
      return state, [metrics]
    # The old policy of the later minibatches first, a forward program of its own; then
    # every minibatch runs one train program, the first's old policy its own forward
    # (`first`). Two train programs (the first's computing the others' old policy) cost
    # twice the compile (XLA:CPU: 1.7 s at the quickstart's size, 6 s over 8 devices),
    # and the forward kept inside the train program under a lax.cond put its collectives
    # in a sequence of their own, which XLA:CPU's devices could start out of order
    # against the step's (a deadlock in one of two 8-device runs).
    params = self.full_params(state)
    olds = [self._old(params, batch.inputs) for batch in batches[1:]]
    history = []
    for n, batch in enumerate(batches):
      old = olds[n - 1] if n else self._no_old_policy(batch)
      state, metrics = self._update(state, ref_params, batch, scores, old, n == 0)
      history.append(metrics)
    return state, history

  def _no_old_policy(self, batch: StepBatch) -> OldPolicy:
    """The first minibatch's `old` argument, never read (its own forward is the old
    policy): zeros of the old policy's shapes, split like the batch; made once a shape,
    so a step runs no program for it."""
    shape = batch.inputs.completion_mask.shape
    if shape not in self._no_old:
      zeros = np.zeros(shape, np.float32)
      self._no_old[shape] = self._place(OldPolicy(zeros, zeros), self._batch_sharding, axis=1)
    return self._no_old[shape]


def fetch_metrics(history: Sequence[dict], mesh=None) -> list[dict]:
  """Device metrics of a step's optimizer steps on the host, in one transfer: Python
  floats, ints and bools, and lists for histograms. With the trainer's `mesh`, also on a
  process that holds none of its devices (sharding/hosts.py)."""
  return [{k: np.asarray(v).tolist() for k, v in m.items()} for m in hosts.fetch(history, mesh)]


def rollout_batch_metrics(rewards, group_size: Optional[int] = None) -> dict:
  """Reward statistics of a rollout batch, from its host rewards [N] (no device work)."""
  if rewards is None:
    return {}
  rewards = np.asarray(rewards, np.float32)
  out = {"reward/mean": float(np.mean(rewards))}
  if group_size:
    out["groups/zero_variance_frac"] = float(
        canaries.zero_variance_fraction(rewards.reshape(-1, group_size)))
  return out


def _length_stats(mask):  # [N, T] -> dict of scalars
  """Completion lengths of the real trajectories: a padding one has none (a real
  completion is never empty), and must not pull the mean and minimum to 0."""
  lengths = sequence_lengths(mask)
  real = lengths > 0
  shortest = jnp.min(jnp.where(real, lengths, jnp.inf))
  return {"length/mean": masked_mean(lengths, real),
          "length/min": jnp.where(jnp.any(real), shortest, 0.0),
          "length/max": jnp.max(lengths)}


def _batch_axes(rules, mesh: Mesh):
  """Mesh axes the rules give a "batch" dimension that all of them divide (None: none)."""
  wanted = dict(rules).get("batch", ())
  size = math.prod(mesh.shape[a] for a in wanted)
  return logical_to_spec(("batch",), (size,), rules, mesh)[0]


def _state_shardings(state: TrainState, mesh: Mesh):
  """Each state leaf keeps the sharding it has; scalars are replicated on `mesh`."""
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                      else replicated, state)


def optimizer_state_shardings(tree, params: dict, mesh: Mesh):
  """Shardings for an optimizer state: a leaf whose path ends with a parameter's path
  (Adam's mu and nu mirror the parameters) takes that parameter's sharding."""
  by_path = {tuple(k.key for k in p): x.sharding
             for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  replicated = NamedSharding(mesh, PartitionSpec())

  def pick(path, leaf):
    keys = tuple(getattr(k, "key", getattr(k, "name", None)) for k in path)
    for n in range(len(keys)):
      if keys[n:] in by_path and by_path[keys[n:]] is not None:
        return by_path[keys[n:]]
    return replicated

  return jax.tree_util.tree_map_with_path(pick, tree)


def split_minibatches(n: int, minibatches: int, micro_batches: int) -> list[list[list[int]]]:
  """Trajectory indices [minibatch][micro-batch][...], contiguous and as even as possible."""
  if n % (minibatches * micro_batches):
    raise UserError(f"trainer: {n} trajectories do not split into {minibatches} minibatches "
                    f"x {micro_batches} micro-batches")
  size = n // (minibatches * micro_batches)
  idx = list(range(n))
  chunks = [idx[i:i + size] for i in range(0, n, size)]
  return [chunks[i:i + micro_batches] for i in range(0, len(chunks), micro_batches)]


def pack_micro_batches(trajectories: Sequence[Trajectory], groups: list[list[int]],
                       row_tokens: int, max_completion: int,
                       shards: int = 1) -> list[PackedInputs]:
  """Packs each micro-batch once, on the host, all with the same shapes (static for the
  scan, and one program for every minibatch of a step).

  Rows come from fixed buckets, `shards` x a power of two, so every batch shard gets whole
  rows and a run compiles few shapes; so do the head positions per shard. The
  trajectories of the completion layout are padded with empty ones to a multiple of
  `shards`. Padding rows have segment id 0 everywhere.
  """
  packed = [pack([trajectories[i] for i in g], row_tokens, max_completion=max_completion)
            for g in groups]
  rows = bucket(max(len(p.tokens) for p in packed), shards)
  packed = [pad_rows(p, rows) for p in packed]
  per_shard = head_bucket(max(head_tokens(p, shards) for p in packed),
                          rows // shards * row_tokens)
  size = shards * math.ceil(max(len(g) for g in groups) / shards)
  return [PackedInputs.on_host(pad_trajectories(with_head_layout(p, shards, per_shard), size))
          for p in packed]


def pack_rollouts(trainer: Trainer, trajectories: Sequence[Trajectory],
                  behaviour_logprobs: Sequence[Sequence[float]]) -> list[StepBatch]:
  """A rollout batch as one StepBatch per minibatch, placed on the trainer's devices.

  Every micro-batch is packed once, with the shapes of all the others (rows, trajectories,
  completion width, head positions), so the first minibatch's program can run the old
  policy of the rest as one batch; everything goes to the devices in one transfer.
  Per-trajectory inputs are padded like the completion layout (zeros: padding
  trajectories have an all-zero mask, so nothing reads them).
  """
  cfg = trainer.cfg
  t = completion_bucket(max(len(x.completion) for x in trajectories))
  groups = [g for minibatch in split_minibatches(len(trajectories), cfg.minibatches,
                                                 cfg.micro_batches) for g in minibatch]
  host = pack_micro_batches(trajectories, groups, cfg.row_tokens, t, trainer.batch_shards)
  b = host[0].completion_mask.shape[0]
  behaviour = [_pad_to(to_completion_layout([behaviour_logprobs[i] for i in g], t), b)
               for g in groups]
  sequence = [_pad_to(np.asarray(g, np.int32), b) for g in groups]
  m = cfg.micro_batches
  return trainer.place_batch([
      StepBatch(inputs=_stack_host(host[i:i + m]), behaviour_logprobs=np.stack(behaviour[i:i + m]),
                sequence=np.stack(sequence[i:i + m])) for i in range(0, len(groups), m)])


def _stack_host(items: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: np.stack(xs), *items)


def _pad_to(x: np.ndarray, n: int) -> np.ndarray:  # [b, ...] -> [n, ...], zero rows after
  return np.pad(x, ((0, n - len(x)),) + ((0, 0),) * (x.ndim - 1))


def to_completion_layout(values: Sequence[Sequence[float]], t: int) -> np.ndarray:
  """Ragged per-token values -> [B, T] float32, zero-padded."""
  out = np.zeros((len(values), t), np.float32)
  for i, v in enumerate(values):
    out[i, :len(v)] = v
  return out


def train_on_rollouts(trainer: Trainer, state: TrainState, trajectories: Sequence[Trajectory],
                      behaviour_logprobs: Sequence[Sequence[float]],
                      advantages: Optional[np.ndarray] = None,
                      rewards: Optional[np.ndarray] = None,
                      ref_params: Optional[dict] = None,
                      group_size: Optional[int] = None) -> tuple[TrainState, list[dict]]:
  """All optimizer steps for one rollout batch.

  The old policy is `state`'s parameters (the policy before this batch's updates); the
  rollout's own logprobs enter through the off-policy correction.

  Args:
    trainer: the trainer.
    state: the current state (donated step by step).
    trajectories: prompts and completions, groups of K contiguous.
    behaviour_logprobs: per completion token, from the rollout engine.
    advantages: [N] sequence-level advantages (GRPO family), host or device; None for a
      value-head model, whose advantages come from GAE over `rewards` and its critic.
    rewards: [N] sequence rewards: required for GAE; otherwise only reported.
    ref_params: frozen reference parameters; None with LoRA (the base is the reference).
      Unused when the loss has no KL term (kl_coef 0).
    group_size: K, to report the fraction of groups whose rewards do not vary.

  Returns:
    The new state and one metrics dict (host values) per optimizer step.
  """
  if (advantages is None) != trainer.value_head or (advantages is None and rewards is None):
    raise ValueError("pass advantages for a policy-only model, rewards for a value-head one")
  batches = pack_rollouts(trainer, trajectories, behaviour_logprobs)
  scores = SequenceScores.of(len(trajectories), advantages, rewards)
  state, history = trainer.update(state, batches, scores, ref_params)
  extra = rollout_batch_metrics(rewards, group_size)
  return state, [h | extra for h in fetch_metrics(history)]
