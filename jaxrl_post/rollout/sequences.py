"""What the engine hands its callers about sequences: prompts being prefilled (Prefix),
sequences held between turns (Held), and each decode call's tokens (ResultTokens)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_post.rollout.pages import PagedSequence
from jaxrl_post.rollout.sampling import SamplingParams


def record_prompt_experts(prefixes, segments, experts) -> None:
  """Stores each prefix's chunk of a prefill call's experts ([R, T, L, k], host) in its
  `experts` record; chunk c is the tokens whose segment is c, in row order."""
  flat_segments = np.asarray(segments).reshape(-1)
  flat = experts.reshape(-1, *experts.shape[2:])
  for c, prefix in enumerate(prefixes):
    chunk = flat[flat_segments == c]
    prefix.experts[prefix.prefilled:prefix.prefilled + len(chunk)] = chunk


@dataclasses.dataclass
class Prefix:
  """A prompt being prefilled, or prefilled and handing its samples to slots.

  Attributes:
    prompt: [P] int32 prompt ids.
    sampling: how its samples are drawn.
    seed: the request's seed.
    sample_ids: indices (within the request) of the samples this prefix serves.
    seq: the prompt's pages, plus the reservation for every sample not yet inserted.
    private_pages: pages one sample may need beyond the shared full prompt pages.
    shard: the data shard whose pages hold the prompt; its samples decode in its slots.
    prefilled: prompt tokens written so far.
    first_tokens / first_logprobs / first_version / first_floors: each sample's first
      token, once prefilled (floors: its kept set under top-k / top-p, see sampling).
    next_sample: samples handed out so far (inserted or finished at their first token).
    experts: MoE models: [P, L, k] int16 each prompt token's experts, filled as the prompt
      is prefilled (tokens served from the prefix cache take the cache's record).
  """

  prompt: np.ndarray
  sampling: SamplingParams
  seed: int
  sample_ids: tuple[int, ...]
  seq: PagedSequence
  private_pages: int
  shard: int = 0
  prefilled: int = 0
  first_tokens: np.ndarray | None = None
  first_logprobs: np.ndarray | None = None
  first_version: int | None = None
  first_floors: np.ndarray | None = None
  next_sample: int = 0
  experts: np.ndarray | None = None
  continued: bool = False  # A later turn of a held sequence (see Engine.continue_held).

  @property
  def done(self) -> bool:
    return self.first_tokens is not None

  @property
  def remaining(self) -> int:
    return len(self.sample_ids) - self.next_sample

  def finishes_at_first(self, i: int) -> bool:
    """Whether sample i ends with its first token (a stop id, or max_tokens == 1)."""
    return (self.sampling.max_tokens == 1 or
            int(self.first_tokens[i]) in self.sampling.stop_ids)


@dataclasses.dataclass
class Held:
  """A sequence whose turn ended but whose K/V stays in the pool for its next turn.

  Attributes:
    seq: its pages (no reservation left).
    length: tokens whose K/V the pages hold: every token of the history but the turn's
      last one, which was sampled and never fed.
    shard: the data shard whose pool holds the pages.
  """

  seq: PagedSequence
  length: int
  shard: int


@dataclasses.dataclass(frozen=True)
class ResultTokens:
  """What one `generate` call produced, per slot.

  Attributes:
    tokens: [B, N] int32, -1 where the slot produced no token at that step.
    logprobs: [B, N] float32 behaviour log-probabilities.
    finished: [B] bool, the slot's sequence ended during this call.
    version: the weight version that produced these tokens.
    experts: MoE models: [B, N, L, k] int16, at step n the experts of the token fed then
      (the slot's previous token); None for a dense model.
    floors: [B, N] float32 each token's kept-set floor (sampling.truncate), when the call
      could truncate; else None.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  finished: np.ndarray
  version: int
  experts: np.ndarray | None = None
  floors: np.ndarray | None = None
