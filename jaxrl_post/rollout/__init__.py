"""Rollouts: paged KV pool with prefix sharing, continuous batching, sampling, the engine.

Data path: requests -> Scheduler (admission, chunked prefill, slots) -> Engine (pages,
jitted prefill and multi-step decode) -> Completions with behaviour logprobs and the weight
version of every token.
"""

from jaxrl_post.rollout.engine import Engine, EngineConfig
from jaxrl_post.rollout.pages import PageAllocator, PagedSequence, PoolConfig
from jaxrl_post.rollout.sampling import SamplingParams
from jaxrl_post.rollout.scheduler import (Completion, Request, Scheduler, SchedulerConfig,
                                          generate)
from jaxrl_post.rollout.sequences import Held, Prefix, ResultTokens

__all__ = ["Completion", "Engine", "EngineConfig", "Held", "PageAllocator", "PagedSequence",
           "PoolConfig", "Prefix", "Request", "ResultTokens", "SamplingParams", "Scheduler",
           "SchedulerConfig", "generate"]
