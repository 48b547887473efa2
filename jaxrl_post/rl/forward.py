"""Per-token logprobs and entropy of completions, through the packed forward.

The model runs on packed rows [R, S]. The LM head is needed only at the N positions that
predict a completion token (the packing's head layout): their hidden states are gathered
and only they go through the chunked logprob kernel, so prompt and padding positions cost
no [D, V] matmul and no softmax, and no [R * S, V] logits tensor exists. The results are
then gathered into the padded completion layout [B, T] the losses use.

On a mesh (under `sharding.activation_rules`) the rows are split over the batch shards,
and the head layout gives each shard N / shards positions inside its own rows: each
device gathers and runs the head on its own tokens, so no device reads another's
[tokens, D] hidden states; only the [N] per-token results are gathered.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.kernels import ChunkedLogprobConfig, chunked_logprob
from jaxrl_post.models import Transformer, moe
from jaxrl_post.models.layers import batch_shards
from jaxrl_post.models.transformer import with_params
from jaxrl_post.rl.packing import gather_completions
from jaxrl_post.sharding import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedInputs:
  """Device arrays of one packed (micro-)batch; see rl.packing.PackedBatch."""

  tokens: jax.Array  # [R, S]
  positions: jax.Array  # [R, S]
  segment_ids: jax.Array  # [R, S]
  targets: jax.Array  # [R, S]
  completion_mask: jax.Array  # [B, T]
  head_index: jax.Array  # [N] flat positions the LM head runs at, grouped by row shard
  head_slot: jax.Array  # [B, T] entry of head_index per completion token
  experts: Optional[jax.Array] = None  # [R, S, L, k] the rollout's experts (MoE), or None
  head_floor: Optional[jax.Array] = None  # [N] kept-set floors (top-k / top-p), or None

  @classmethod
  def from_packed(cls, packed) -> "PackedInputs":
    return cls(*(_maybe(jnp.asarray, getattr(packed, f.name)) for f in dataclasses.fields(cls)))

  @classmethod
  def on_host(cls, packed) -> "PackedInputs":
    """numpy leaves, for placing straight onto a mesh (no stop on one device first)."""
    return cls(*(_maybe(np.asarray, getattr(packed, f.name)) for f in dataclasses.fields(cls)))


def _maybe(fn, x):
  return None if x is None else fn(x)


class CompletionOutputs(NamedTuple):
  """Per completion token [B, T] (0 where masked), and the MoE layers' routing."""

  logprobs: jax.Array
  entropy: jax.Array
  values: Optional[jax.Array]  # the critic's, with_values only
  routing: Optional[moe.Routing]  # [L, ...] per layer; None for a dense model


def completion_outputs(model: Transformer, params: dict, inputs: PackedInputs,
                       temperature: float = 1.0,
                       chunking: ChunkedLogprobConfig = ChunkedLogprobConfig(),
                       with_values: bool = False, replay: bool = False) -> CompletionOutputs:
  """Logprobs and entropy of each completion token, and what else the forward gives.

  Args:
    model: any model of the right structure (abstract is fine); its values are unused.
    params: the full parameter dict to run with.
    inputs: the packed batch.
    temperature: the sampling temperature the rollout used, so logprobs match it.
    chunking: block sizes of the chunked logprob kernel.
    with_values: also the critic's values [B, T] of the states that sampled each
      completion token (the model needs a value head).
    replay: MoE layers route by the rollout's recorded experts (inputs.experts) instead
      of their own top-k (routing replay); either way they report agreement with them.
  """
  if model.config.final_logit_softcapping is not None:  # Static: refused while tracing.
    raise UserError("training: final_logit_softcapping is not supported (the chunked "
                    "logprob kernel computes uncapped logits; no Gemma 3 checkpoint sets it)")
  m, h, targets, routing = head_states(model, params, inputs, replay)
  lm_head = m.lm_head_weight().astype(h.dtype)
  floor = None
  if inputs.head_floor is not None:  # [N] -> [G, n], as the head positions are grouped.
    floor = constrain(inputs.head_floor.reshape(targets.shape), ("batch", None))
  logp, ent = head_logprobs(h, lm_head, targets, temperature, chunking, floor)

  def gather(x):  # [G, n] (all-gathered on a mesh: small) -> [B, T]
    out = gather_completions(x, inputs.head_slot, inputs.completion_mask)
    return constrain(out, ("batch", None))

  values = gather(m.values(h)) if with_values else None
  return CompletionOutputs(gather(logp), gather(ent), values, routing)


def completion_logprobs(model: Transformer, params: dict, inputs: PackedInputs,
                        temperature: float = 1.0,
                        chunking: ChunkedLogprobConfig = ChunkedLogprobConfig(),
                        with_values: bool = False, replay: bool = False):
  """(logprob [B, T], entropy [B, T]) of each completion token, 0 where masked, and the
  critic's values [B, T] with_values (see completion_outputs)."""
  out = completion_outputs(model, params, inputs, temperature, chunking, with_values, replay)
  return out[:3] if with_values else out[:2]


def head_states(model: Transformer, params: dict, inputs: PackedInputs, replay: bool = False):
  """(the model bound to params, hidden states [G, n, D], targets [G, n], MoE routing or
  None) at the batch's head positions: the forward every per-completion-token quantity
  starts from."""
  m = with_params(model, params)
  hidden, routing = m.forward_routed(inputs.tokens, inputs.positions, inputs.segment_ids,
                                     recorded=inputs.experts, replay=replay)  # [R, S, D]
  return (m, *head_inputs(hidden, inputs.targets, inputs.head_index), routing)


def head_inputs(hidden, targets, head_index):
  """The hidden states [G, N / G, D] and targets [G, N / G] at the head positions.

  G is the number of batch shards the active rules cut the rows into (1 without a mesh);
  it must divide the shards the head layout was built for, so every group's positions
  lie in its own rows and the gather stays on each device.
  """
  r, s, d = hidden.shape
  g = batch_shards(r)
  h = constrain(hidden.reshape(g, r // g * s, d), ("batch", None, None))  # [G, r/G * S, D]
  t = constrain(targets.reshape(g, r // g * s), ("batch", None))
  first = (jnp.arange(g, dtype=head_index.dtype) * (r // g * s))[:, None]
  local = constrain(head_index.reshape(g, -1) - first, ("batch", None))  # [G, n]
  picked = jnp.take_along_axis(h, local[..., None], axis=1, mode="clip")
  return picked, jnp.take_along_axis(t, local, axis=1, mode="clip")


def head_logprobs(h, lm_head, targets, temperature=1.0,
                  chunking: ChunkedLogprobConfig = ChunkedLogprobConfig(), floor=None):
  """(logprob, entropy), each [G * n] float32, of hidden states [G, n, D].

  Each group runs its own chunked pass (vmapped over G), so each device works on its own
  tokens and only the lm_head gradient is reduced across devices. floor [G, n]: each
  token's softmax keeps only the sampler's kept set (see kernels.chunked_logprob).
  """
  if floor is None:
    floor = jnp.full(targets.shape, -jnp.inf, jnp.float32)
  # Whole on every device before the pass: it reads the head one vocabulary block at a
  # time, and XLA (GPU and TPU alike) all-gathered the vocab-sharded head at every block
  # of the forward, its recompute and the backward (Llama-3.1-8B on 8 x H100: 55% of the
  # train step's collective bytes). Once per call, its gradient reduced once.
  lm_head = constrain(lm_head, (None, None))
  run = lambda h1, t1, f1: chunked_logprob(h1, lm_head, t1, temperature, f1, config=chunking)
  if h.shape[0] > 1:
    logp, ent = jax.vmap(run)(h, targets, floor)
  else:
    logp, ent = run(h[0], targets[0], floor[0])
  return logp.reshape(-1), ent.reshape(-1)
