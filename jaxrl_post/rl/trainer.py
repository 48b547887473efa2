"""The jitted trainer step: packed forward, chunked logprobs, policy loss, AdamW.

One rollout batch becomes `minibatches` optimizer steps; each step accumulates gradients
over `micro_batches` packed micro-batches (lax.scan), with the loss normalised by the whole
step's token or sequence count so micro-batching changes nothing. Parameters are f32
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
from jaxrl_post.models.transformer import logical_axes, params_of
from jaxrl_post.rl import metrics as canaries
from jaxrl_post.rl.advantages import AdvantageConfig, compute_advantages
from jaxrl_post.rl.forward import PackedInputs, completion_logprobs
from jaxrl_post.rl.losses import LossConfig, global_normaliser, policy_loss
from jaxrl_post.rl.masked import masked_mean, sequence_lengths
from jaxrl_post.rl.off_policy import OffPolicyConfig, off_policy_correction
from jaxrl_post.rl.optim import OptimizerConfig, learning_rate_schedule, make_optimizer
from jaxrl_post.rl.packing import (Trajectory, bucket, completion_bucket, pack,
                                   pad_trajectories)
from jaxrl_post.rl.value import terminal_rewards, value_loss
from jaxrl_post.sharding import (TRAINING_RULES, activation_rules, logical_to_spec,
                                 tree_shardings)


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

  def __post_init__(self):
    for name in ("minibatches", "micro_batches", "row_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise UserError(f"trainer config: {name} must be a positive integer, got {value!r}")
    if self.temperature <= 0:
      raise UserError(f"trainer config: temperature must be > 0, got {self.temperature}")


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
  """One optimizer step's data; every leaf has a leading micro-batch axis [M]."""

  inputs: PackedInputs
  old_logprobs: jax.Array  # [M, B, T] policy before this rollout batch's updates
  behaviour_logprobs: jax.Array  # [M, B, T] from the rollout engine
  ref_logprobs: jax.Array  # [M, B, T]
  advantages: jax.Array  # [M, B, T]
  old_values: jax.Array  # [M, B, T] critic before the updates (zeros without a critic)
  returns: jax.Array  # [M, B, T] critic targets (zeros without a critic)


def merge_params(a: dict, b: dict) -> dict:
  """Union of two nested dicts with disjoint leaves (trainable + frozen)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = merge_params(out[k], v) if isinstance(v, dict) and k in out else v
  return out


def _is_lora(path) -> bool:
  return "_lora_" in str(path[-1])


class Trainer:
  """Builds and runs the jitted step for one model config on the training mesh."""

  def __init__(self, model_cfg: ModelConfig, cfg: TrainerConfig = TrainerConfig(),
               mesh: Optional[Mesh] = None, rules=TRAINING_RULES):
    self.model_cfg, self.cfg, self.mesh, self.rules = model_cfg, cfg, mesh, rules
    self.model = abstract_model(model_cfg)
    self.lora = model_cfg.lora is not None
    self.value_head = model_cfg.value_head
    self.optimizer = make_optimizer(cfg.optimizer)
    self.schedule = learning_rate_schedule(cfg.optimizer)
    self.param_shardings = None
    self.batch_shards = 1  # Pieces the rows and trajectories of a batch are split into.
    self._inputs_sharding = self._batch_sharding = None
    if mesh is not None:
      self.param_shardings = tree_shardings(logical_axes(self.model), params_of(self.model),
                                            rules, mesh)
      axes = _batch_axes(rules, mesh)
      self.batch_shards = math.prod(mesh.shape[a] for a in _axis_names(axes))
      self._inputs_sharding = NamedSharding(mesh, PartitionSpec(axes))  # [R, ...], [B, ...]
      self._batch_sharding = NamedSharding(mesh, PartitionSpec(None, axes))  # [M, R or B, ...]
    self._logprobs = self._jit(self._completion_logprobs, (None, self._inputs_sharding))
    self._values = self._jit(self._completion_values, (None, self._inputs_sharding))
    self._step = None  # Built by init_state, once the state's shardings are known.

  def _jit(self, fn, in_shardings, **kwargs):
    """jax.jit of fn traced under this trainer's activation rules, with explicit input
    shardings on a mesh. The rules must be active while jax traces (not around a call)."""
    @functools.wraps(fn)
    def traced(*args, **kw):
      with activation_rules(self.rules, self.mesh):
        return fn(*args, **kw)

    if self.mesh is not None:
      kwargs["in_shardings"] = in_shardings
    return jax.jit(traced, **kwargs)

  def place_inputs(self, inputs: PackedInputs) -> PackedInputs:
    """A packed batch on the device(s), rows and trajectories split over the batch shards."""
    return self._place(inputs, self._inputs_sharding, axis=0)

  def place_batch(self, batch: StepBatch) -> StepBatch:
    """A step's batch on the device(s), split like `place_inputs` behind its [M] axis."""
    return self._place(batch, self._batch_sharding, axis=1)

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
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    pick = lambda want: _unflatten([(p, x) for p, x in flat if _is_lora(p) == want])
    return pick(True), pick(False)

  def place(self, params: dict) -> dict:
    """Full parameters in the training sharding (unchanged without a mesh)."""
    if self.param_shardings is None:
      return params
    return jax.device_put(params, self.param_shardings)

  def init_state(self, params: dict) -> TrainState:
    """A TrainState from full parameters, placed on the training mesh when one is set.

    The jitted step is built here with explicit out_shardings equal to the state's, so
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
    placed, out = None, {}
    if self.mesh is not None:
      placed = _state_shardings(state, self.mesh)
      state = jax.device_put(state, placed)
      # Metrics replicated: small, and every process can read them.
      out = {"out_shardings": (placed, NamedSharding(self.mesh, PartitionSpec()))}
    self._step = self._jit(self._train_step, (placed, self._batch_sharding), donate_argnums=0,
                           static_argnums=2, **out)
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
    return completion_logprobs(self.model, params, inputs, self.cfg.temperature)

  def logprobs(self, params: dict, inputs: PackedInputs):
    """(logprob [B, T], entropy [B, T]) of a packed batch under `params` (no gradient)."""
    return self._logprobs(params, self.place_inputs(inputs))

  def _completion_values(self, params, inputs: PackedInputs):
    return completion_logprobs(self.model, params, inputs, self.cfg.temperature,
                               with_values=True)[2]

  def values(self, params: dict, inputs: PackedInputs):
    """Critic values [B, T] of a packed batch under `params` (value-head models)."""
    return self._values(params, self.place_inputs(inputs))

  # -------------------------------------------------------------------- step

  def _micro_loss(self, trainable, frozen, mb: StepBatch, normaliser, on_policy: bool):
    params = merge_params(trainable, frozen)
    out = completion_logprobs(self.model, params, mb.inputs, self.cfg.temperature,
                              with_values=self.value_head)
    logp, ent = out[:2]
    # On-policy, the old policy *is* these parameters: reuse this forward (exact ratio 1,
    # one forward pass saved) instead of a separately computed copy.
    old = jax.lax.stop_gradient(logp) if on_policy else mb.old_logprobs
    mask = mb.inputs.completion_mask
    weights = None
    if self.cfg.off_policy is not None:
      weights, mask, _ = off_policy_correction(old, mb.behaviour_logprobs, mask,
                                               self.cfg.off_policy)
    loss, m = policy_loss(logp, old, mb.ref_logprobs, mb.advantages, mask, ent,
                          self.cfg.loss, normaliser, is_weights=weights)
    v_loss = jnp.float32(0.0)
    if self.value_head:
      v_loss = value_loss(out[2], mb.old_values, mb.returns, mb.inputs.completion_mask,
                          self.cfg.value_clip, normaliser, self.cfg.loss)
      loss = loss + self.cfg.value_coef * v_loss
    per_token = {"logp": logp, "entropy": ent, "ratio": m["ratio"],
                 "clip_low": m["clip_low"], "clip_high": m["clip_high"],
                 "is_weights": weights if weights is not None else jnp.ones_like(logp),
                 "value_loss": v_loss}
    return loss, per_token

  def _train_step(self, state: TrainState, batch: StepBatch, on_policy: bool):
    mask = batch.inputs.completion_mask  # [M, B, T]: the whole step's tokens
    normaliser = global_normaliser(mask.reshape(-1, mask.shape[-1]), self.cfg.loss)
    grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

    def accumulate(carry, mb):
      grads, total = carry
      (loss, per_token), g = grad_fn(state.params, state.frozen, mb, normaliser, on_policy)
      return (jax.tree.map(jnp.add, grads, g), total + loss), per_token

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, loss), per_token = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)), batch)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                              opt_state=keep(opt_state, state.opt_state),
                              skipped=state.skipped + (~finite).astype(jnp.int32))
    metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": new_state.skipped,
               "value_loss": jnp.sum(per_token["value_loss"]),
               "lr": self.schedule(state.step), "update_finite": finite}
    metrics.update(self._canaries(batch, per_token))
    return new_state, metrics

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
    out["kl/reference"] = canaries.reference_kl(flat(t["logp"]), flat(batch.ref_logprobs), mask)
    out["entropy"] = canaries.mean_entropy(flat(t["entropy"]), mask)
    out.update(canaries.logprob_mismatch(flat(t["logp"]), flat(batch.behaviour_logprobs), mask))
    out["is/ess"] = canaries.effective_sample_size(flat(t["is_weights"]), mask)
    out.update(canaries.advantage_stats(flat(batch.advantages), mask))
    out.update(_length_stats(mask))
    return out

  def step(self, state: TrainState, batch: StepBatch,
           on_policy: bool = False) -> tuple[TrainState, dict]:
    """One optimizer step; `state` is donated.

    on_policy: the parameters are those that sampled the batch (the first step after a
      synchronous rollout); batch.old_logprobs is then not read.
    """
    return self._step(state, self.place_batch(batch), on_policy)


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


def _axis_names(axes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


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


def _unflatten(pairs) -> dict:
  out: dict = {}
  for path, x in pairs:
    node = out
    for key in path[:-1]:
      node = node.setdefault(key.key, {})
    node[path[-1].key] = x
  return out


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
  """Packs each micro-batch with the same shapes (static for the scan), on the host.

  Rows come from fixed buckets, `shards` x a power of two, so every batch shard gets whole
  rows and a run compiles few shapes; the trajectories of the completion layout are padded
  with empty ones to a multiple of `shards`. Padding rows have segment id 0 everywhere.
  """
  need = max(len(pack([trajectories[i] for i in g], row_tokens).tokens) for g in groups)
  rows = bucket(need, shards)
  size = shards * math.ceil(max(len(g) for g in groups) / shards)
  return [PackedInputs.on_host(pad_trajectories(
      pack([trajectories[i] for i in g], row_tokens, rows, max_completion), size))
          for g in groups]


def stack(items: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *items)


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
                      ref_params: Optional[dict] = None, on_policy: bool = True,
                      group_size: Optional[int] = None) -> tuple[TrainState, list[dict]]:
  """All optimizer steps for one rollout batch.

  Args:
    trainer: the trainer.
    state: the current state (donated step by step).
    trajectories: prompts and completions, groups of K contiguous.
    behaviour_logprobs: per completion token, from the rollout engine.
    advantages: [B] sequence-level advantages (GRPO family); None for a value-head model,
      whose advantages come from GAE over `rewards` and its critic.
    rewards: [B] sequence rewards: required for GAE; otherwise only reported.
    ref_params: frozen reference parameters; None with LoRA (the base is the reference).
    on_policy: the rollout sampled from `state`'s parameters (synchronous training), so
      the first step needs no separate old-logprob pass.
    group_size: K, to report the fraction of groups whose rewards do not vary.

  Returns:
    The new state and one metrics dict (host values) per optimizer step.
  """
  batches = prepare_step_batches(trainer, state, trajectories, behaviour_logprobs, advantages,
                                 rewards, ref_params, on_policy)
  return run_step_batches(trainer, state, batches, rewards, on_policy, group_size)


def prepare_step_batches(trainer: Trainer, state: TrainState,
                         trajectories: Sequence[Trajectory],
                         behaviour_logprobs: Sequence[Sequence[float]],
                         advantages: Optional[np.ndarray] = None,
                         rewards: Optional[np.ndarray] = None,
                         ref_params: Optional[dict] = None,
                         on_policy: bool = True) -> list[StepBatch]:
  """Packs a rollout batch and runs the no-gradient passes: reference logprobs, and the
  old policy's (and critic's) where a step cannot reuse its own forward.

  Arguments as in `train_on_rollouts`. All passes use the parameters of `state` before
  any update, so they are computed up front, one StepBatch per optimizer step.
  """
  cfg = trainer.cfg
  if (advantages is None) != trainer.value_head or (advantages is None and rewards is None):
    raise ValueError("pass advantages for a policy-only model, rewards for a value-head one")
  t = completion_bucket(max(len(x.completion) for x in trajectories))
  plan = split_minibatches(len(trajectories), cfg.minibatches, cfg.micro_batches)
  old_params = trainer.full_params(state)  # The policy that sampled (before any update).
  ref = ref_params if ref_params is not None else trainer.reference_params(state)
  return [_step_batch(trainer, old_params, ref, trajectories, behaviour_logprobs,
                      advantages, rewards, minibatch, t, skip_old=on_policy and n == 0)
          for n, minibatch in enumerate(plan)]


def run_step_batches(trainer: Trainer, state: TrainState, batches: Sequence[StepBatch],
                     rewards: Optional[np.ndarray] = None, on_policy: bool = True,
                     group_size: Optional[int] = None) -> tuple[TrainState, list[dict]]:
  """The optimizer steps over prepared batches; returns the state and per-step metrics."""
  extra = {}
  if rewards is not None:
    extra["reward/mean"] = float(np.mean(rewards))
    if group_size:
      extra["groups/zero_variance_frac"] = float(canaries.zero_variance_fraction(
          jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)))
  history = []
  for n, batch in enumerate(batches):
    state, metrics = trainer.step(state, batch, on_policy=on_policy and n == 0)
    history.append({k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
                   | extra)
  return state, history


def _step_batch(trainer, old_params, ref, trajectories, behaviour, advantages, rewards,
                minibatch, t, skip_old: bool) -> StepBatch:
  """Packs one minibatch's micro-batches and gathers every per-token input of the step.

  Per-trajectory inputs are padded like the completion layout (zeros: padding
  trajectories have an all-zero mask, so nothing reads them).
  """
  host = pack_micro_batches(trajectories, minibatch, trainer.cfg.row_tokens, t,
                            trainer.batch_shards)
  inputs = [trainer.place_inputs(x) for x in host]
  b = host[0].completion_mask.shape[0]
  per_seq = lambda x, g: _pad_to(np.asarray(x, np.float32)[g], b)  # [B]
  zeros = [np.zeros((b, t), np.float32)] * len(host)
  old = zeros if skip_old else [trainer.logprobs(old_params, x)[0] for x in inputs]
  if trainer.value_head:
    values = [trainer.values(old_params, x) for x in inputs]
    targets = [compute_advantages(terminal_rewards(jnp.asarray(per_seq(rewards, g)),
                                                   x.completion_mask), x.completion_mask,
                                  trainer.cfg.gae, values=v)
               for g, x, v in zip(minibatch, inputs, values)]
    adv, returns = [a for a, _ in targets], [r for _, r in targets]
  else:
    values, returns = zeros, zeros
    adv = [per_seq(advantages, g)[:, None] * x.completion_mask for g, x in zip(minibatch, host)]
  beh = [_pad_to(to_completion_layout([behaviour[i] for i in g], t), b) for g in minibatch]
  ref_logprobs = [trainer.logprobs(ref, x)[0] for x in inputs]
  return trainer.place_batch(StepBatch(
      inputs=_stack_host(host), old_logprobs=stack(old), behaviour_logprobs=_stack_host(beh),
      ref_logprobs=stack(ref_logprobs), advantages=stack(adv), old_values=stack(values),
      returns=stack(returns)))
