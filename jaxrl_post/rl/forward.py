"""Per-token logprobs and entropy of completions, through the packed forward.

The model runs on packed rows [R, S]; the LM head is applied by the chunked logprob kernel
over the flattened tokens, so no [R * S, V] logits tensor exists; the values are then
gathered into the padded completion layout [B, T] the losses use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_post.kernels import ChunkedLogprobConfig, chunked_logprob
from jaxrl_post.models import Transformer
from jaxrl_post.models.transformer import with_params
from jaxrl_post.rl.packing import gather_completions


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
  d = hidden.shape[-1]
  lm_head = m.lm_head_weight().astype(hidden.dtype)
  logp, ent = chunked_logprob(hidden.reshape(-1, d), lm_head, inputs.targets.reshape(-1),
                              temperature, config=chunking)
  gather = lambda x: gather_completions(x, inputs.completion_index, inputs.completion_mask)
  if with_values:
    return gather(logp), gather(ent), gather(m.values(hidden))
  return gather(logp), gather(ent)
