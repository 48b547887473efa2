"""The service's settings, gin-bindable as ServeConfig.* (--gin_param=ServeConfig.max_adapters=16)."""

from __future__ import annotations

import dataclasses

from jaxrl_post.errors import UserError
from jaxrl_post.plugins import register
from jaxrl_post.rollout.engine_config import EngineConfig


@register
@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Attributes:
    max_adapters: LoRA adapters trained at once per rank (slots of one batched program).
    max_samplers: adapters one sampler engine holds at once (per rank; the base model is
      one more): the sampling sessions whose requests decode in the same batch.
    lora_alpha: adapters compute W + (lora_alpha / rank) * A @ B.
    max_length: the longest datum, or prompt + completion, a request may send.
    default_max_tokens: completion limit of samples that name none.
    engine: the sampler's engine (slots, pages, decode steps).
    batch_wait_s: how long a forward_backward waits for those of other adapters whose
      clients, at the pace of their last two steps, are about to send theirs, to run with them
      as one program.
    session_timeout_s: a session whose client sent no heartbeat (the SDK sends one every
      10 s) for this long ends, and its adapters' slots are freed.
    poll_seconds: how long retrieve_future holds a request for a result before it answers
      try_again (the client re-polls at once; its own timeout is 45 s).
    keep_results_s: how long a request's result is kept once ready, for a client to
      retrieve (again); then it is dropped, so a long-running server's memory stays flat.
  """

  max_adapters: int = 8
  max_samplers: int = 4
  lora_alpha: float = 32.0
  max_length: int = 2048
  default_max_tokens: int = 256
  engine: EngineConfig = EngineConfig(num_slots=16, decode_steps=8)
  batch_wait_s: float = 0.005
  session_timeout_s: float = 600.0
  poll_seconds: float = 20.0
  keep_results_s: float = 3600.0

  def __post_init__(self):
    for name in ("max_adapters", "max_samplers", "max_length", "default_max_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise UserError(f"ServeConfig.{name}: must be a positive integer, got {value!r}")
    if not 0 <= self.batch_wait_s <= 1:
      raise UserError(f"ServeConfig.batch_wait_s: must be in [0, 1], got {self.batch_wait_s}")
    if not self.session_timeout_s > 0:
      raise UserError(f"ServeConfig.session_timeout_s: must be > 0, got {self.session_timeout_s}")
    if not self.keep_results_s >= 60:  # A client polling its result must still find it.
      raise UserError(f"ServeConfig.keep_results_s: must be >= 60, got {self.keep_results_s}")
    if not 0 < self.poll_seconds <= 40:
      raise UserError(f"ServeConfig.poll_seconds: must be in (0, 40], got {self.poll_seconds}")
