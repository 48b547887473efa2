"""Supervised warm-up: next-token cross-entropy on reference completions.

RL from a policy that never produces a correct answer learns nothing (every group has zero
reward variance), so a run may first teach the answer format with a few supervised steps.
The warm-up reuses the RL data path (packing, the chunked-logprob forward) and has its own
optimizer state: the RL optimizer starts fresh from the warmed-up parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from jaxrl_post.errors import UserError
from jaxrl_post.models import Transformer
from jaxrl_post.rl.forward import PackedInputs, completion_logprobs, head_states
from jaxrl_post.rl.packing import gather_completions
from jaxrl_post.rl.trainer import merge_params


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """Attributes:
    steps: optimizer steps of warm-up (0: none); the most, with stop_loss.
    batch_size: examples per step.
    learning_rate: constant AdamW learning rate.
    row_tokens: packed row length.
    stop_loss: end the warm-up early once the mean loss of the last `stop_window` steps
      is below this (None: always run `steps`). How fast a model learns the format varies
      with the seed; a loss target starts RL from a similar policy for every seed.
    stop_window: steps averaged for stop_loss; steps between the checks of stop_accuracy.
    stop_accuracy: end the warm-up early once the greedy accuracy on `stop_examples`
      problems of the training split reaches this (None: no such check). Measured by
      teacher forcing: a completion counts when the argmax at every position is its
      reference token, which is exactly when greedy decoding writes that answer. RL then
      starts from a policy of known skill, whatever the seed or the machine's numerics.
    stop_examples: problems in that check (drawn once, apart from the training batches).
  """

  steps: int = 0
  batch_size: int = 64
  learning_rate: float = 1e-3
  row_tokens: int = 512
  stop_loss: Optional[float] = None
  stop_window: int = 10
  stop_accuracy: Optional[float] = None
  stop_examples: int = 256

  def __post_init__(self):
    if self.steps < 0:
      raise UserError(f"sft config: steps must be >= 0, got {self.steps}")
    if self.stop_loss is not None and not self.stop_loss > 0:
      raise UserError(f"sft config: stop_loss must be > 0 or None, got {self.stop_loss}")
    if self.stop_accuracy is not None and not 0.0 < self.stop_accuracy <= 1.0:
      raise UserError(f"sft config: stop_accuracy must be in (0, 1] or None, got "
                      f"{self.stop_accuracy}")
    for name in ("batch_size", "row_tokens", "stop_window", "stop_examples"):
      if getattr(self, name) < 1:
        raise UserError(f"sft config: {name} must be >= 1, got {getattr(self, name)}")
    if self.learning_rate <= 0:
      raise UserError(f"sft config: learning_rate must be > 0, got {self.learning_rate}")


def sft_loss(model: Transformer, params: dict, inputs: PackedInputs) -> jax.Array:
  """Mean negative log-likelihood per completion token (prompt tokens carry no loss)."""
  logp, _ = completion_logprobs(model, params, inputs)
  mask = inputs.completion_mask
  return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _with_frozen(params: dict, frozen: dict | None) -> dict:
  return params if frozen is None else merge_params(params, frozen)


def _kept(params: dict):
  """x -> the sharding a step's output keeps: x's own on the parameters' mesh; replicated
  there for the rest (the optimizer's step count, the loss, given as None)."""
  named = [x.sharding for x in jax.tree.leaves(params)
           if isinstance(x.sharding, jax.sharding.NamedSharding)]
  if not named:
    return lambda x: x.sharding if x is not None else None
  replicated = jax.sharding.NamedSharding(named[0].mesh, jax.sharding.PartitionSpec())
  return lambda x: (x.sharding if x is not None and isinstance(
      x.sharding, jax.sharding.NamedSharding) else replicated)


class SftTrainer:
  """Jitted AdamW steps on `sft_loss`; parameters stay in the caller's layout."""

  def __init__(self, model: Transformer, cfg: SftConfig):
    self.model, self.cfg = model, cfg
    self.optimizer = optax.adamw(cfg.learning_rate)
    self._step = None
    self._shardings = None  # (params, opt_state) shardings the step keeps, once known.

  def init(self, params: dict):
    return self.optimizer.init(params)

  def step(self, params, opt_state, inputs: PackedInputs, frozen=None):
    """One AdamW step on a packed batch; (params, opt_state, loss). Donates params and
    opt_state. `frozen`: further parameters the model reads but the step leaves alone."""
    if self._step is None:
      # The outputs keep the first inputs' shardings: left to the compiler, a spec such as
      # P(None, 'fsdp', None) comes back as the equal P(None, 'fsdp'), which jax keys as
      # another program, so the second step compiled the whole step again.
      out = {}
      if all(isinstance(x, jax.Array) for x in jax.tree.leaves((params, opt_state))):
        kept = _kept(params)
        self._shardings = jax.tree.map(kept, (params, opt_state))
        out = {"out_shardings": (*self._shardings, kept(None))}
      self._step = jax.jit(self._update, donate_argnums=(0, 1), **out)
    if self._shardings is not None:  # No copy once the state is where the step keeps it.
      params, opt_state = jax.device_put((params, opt_state), self._shardings)
    return self._step(params, opt_state, inputs, frozen)

  def _update(self, params, opt_state, inputs: PackedInputs, frozen):
    loss, grads = jax.value_and_grad(
        lambda p: sft_loss(self.model, _with_frozen(p, frozen), inputs))(params)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @functools.partial(jax.jit, static_argnums=0)
  def greedy_matches(self, params, inputs: PackedInputs, frozen=None):
    """[B] bool: the model's argmax is the reference at every completion position (so
    greedy decoding writes exactly that completion); False for padding completions."""
    m, h, targets, _ = head_states(self.model, _with_frozen(params, frozen), inputs)
    hit = (jnp.argmax(m.logits(h), axis=-1) == targets).astype(jnp.float32).reshape(-1)
    mask = inputs.completion_mask
    per_token = gather_completions(hit, inputs.head_slot, mask)  # [B, T]
    return jnp.all((per_token > 0) | (mask == 0), axis=1) & jnp.any(mask > 0, axis=1)
