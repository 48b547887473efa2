"""Per-token logprobs and entropy of completions, through the packed forward.

The model runs on packed rows [R, S]; the LM head is applied by the chunked logprob kernel
over the flattened tokens, so no [R * S, V] logits tensor exists; the values are then
gathered into the padded completion layout [B, T] the losses use.

On a mesh (under `sharding.activation_rules`) the rows are split over the batch shards;
each shard's tokens go through their own chunked-logprob pass, so no device gathers
another's [tokens, D] hidden states: only the [R * S] per-token results are gathered.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.kernels import ChunkedLogprobConfig, chunked_logprob
from jaxrl_post.models import Transformer
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
  completion_index: jax.Array  # [B, T]
  completion_mask: jax.Array  # [B, T]

  @classmethod
  def from_packed(cls, packed) -> "PackedInputs":
    return cls(*(jnp.asarray(getattr(packed, f.name)) for f in dataclasses.fields(cls)))

  @classmethod
  def on_host(cls, packed) -> "PackedInputs":
    """numpy leaves, for placing straight onto a mesh (no stop on one device first)."""
    return cls(*(np.asarray(getattr(packed, f.name)) for f in dataclasses.fields(cls)))


def completion_logprobs(model: Transformer, params: dict, inputs: PackedInputs,
                        temperature: float = 1.0,
                        chunking: ChunkedLogprobConfig = ChunkedLogprobConfig(),
                        with_values: bool = False):
  """(logprob [B, T], entropy [B, T]) of each completion token, 0 where masked.

  Args:
    model: any model of the right structure (abstract is fine); its values are unused.
    params: the full parameter dict to run with.
    inputs: the packed batch.
    temperature: the sampling temperature the rollout used, so logprobs match it.
    chunking: block sizes of the chunked logprob kernel.
    with_values: also return the critic's values [B, T] of the states that sampled each
      completion token (the model needs a value head).
  """
  m = with_params(model, params)
  hidden = m(inputs.tokens, inputs.positions, inputs.segment_ids)  # [R, S, D]
  lm_head = m.lm_head_weight().astype(hidden.dtype)
  logp, ent = token_logprobs(hidden, lm_head, inputs.targets, temperature, chunking)

  def gather(x):  # [R * S] (all-gathered on a mesh: small) -> [B, T]
    out = gather_completions(x, inputs.completion_index, inputs.completion_mask)
    return constrain(out, ("batch", None))

  if with_values:
    return gather(logp), gather(ent), gather(m.values(hidden))
  return gather(logp), gather(ent)


def token_logprobs(hidden, lm_head, targets, temperature=1.0,
                   chunking: ChunkedLogprobConfig = ChunkedLogprobConfig()):
  """(logprob, entropy), each [R * S] float32, of packed hidden states [R, S, D].

  The rows are cut into as many contiguous groups as the active rules give batch shards
  (one group without a mesh), so each device runs the chunked pass on its own rows and
  only the lm_head gradient is reduced across devices.
  """
  r, s, d = hidden.shape
  g = batch_shards(r)
  h = constrain(hidden.reshape(g, r // g * s, d), ("batch", None, None))  # [G, N, D]
  t = constrain(targets.reshape(g, r // g * s), ("batch", None))  # [G, N]
  run = lambda h1, t1: chunked_logprob(h1, lm_head, t1, temperature, config=chunking)
  logp, ent = jax.vmap(run)(h, t) if g > 1 else run(h[0], t[0])
  return logp.reshape(-1), ent.reshape(-1)
