"""Sampling sessions: which weights each one samples with, and the engines that decode.

A session samples the base model, an adapter snapshot taken by save_weights_for_sampler,
or a saved sampler checkpoint (tinker:// path, read when first sampled). One rollout
engine per LoRA rank (and one for the base) decodes with paged KV and prefix sharing;
the requests of one session in a batch go through its scheduler together.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jaxrl_post.models.config import LoraConfig, ModelConfig
from jaxrl_post.rollout import Completion, Engine, Scheduler
from jaxrl_post.rollout.engine_config import EngineConfig
from jaxrl_post.serve.adapters import ATTN, MLP
from jaxrl_post.serve.requests import Sample


@dataclasses.dataclass
class Weights:
  """An adapter to sample with: rank and [L, ...] arrays (a params_of-shaped dict)."""

  rank: int
  adapter: dict


@dataclasses.dataclass
class Session:
  base_model: str
  model_path: Optional[str] = None  # tinker:// path it was created from, if any
  weights: Optional[Weights] = None  # None with no path: the base model


class Engines:
  """The engines, and which session's weights each holds."""

  def __init__(self, cfg: ModelConfig, base: dict, engine_cfg: EngineConfig, lora_alpha: float,
               mesh=None):
    self.cfg, self.base, self.engine_cfg, self.alpha, self.mesh = (cfg, base, engine_cfg,
                                                                   lora_alpha, mesh)
    self._engines: dict[Optional[int], Engine] = {}
    self._holds: dict[Optional[int], int] = {}  # rank -> id() of the Weights it holds
    self._version = 0

  def lora_config(self, rank: int) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=self.alpha, targets=ATTN + MLP)

  def _params(self, weights: Optional[Weights]) -> dict:
    if weights is None:
      return self.base
    return {**self.base, "layers": {**self.base["layers"], **weights.adapter["layers"]}}

  def engine(self, weights: Optional[Weights]) -> Engine:
    """An engine holding `weights` (set now unless it already held them)."""
    rank = None if weights is None else weights.rank
    tag = id(weights) if weights is not None else 0
    if rank not in self._engines:
      cfg = self.cfg if rank is None else self.cfg.replace(lora=self.lora_config(rank))
      self._engines[rank] = Engine(cfg, self._params(weights), self.engine_cfg, mesh=self.mesh)
    elif self._holds.get(rank) != tag:
      self._version += 1
      self._engines[rank].set_weights(self._params(weights), self._version)
    self._holds[rank] = tag
    return self._engines[rank]

  def sample(self, weights: Optional[Weights], jobs: list[tuple[Sample, int]]
             ) -> list[list[Completion]]:
    """Each (request, seed)'s completions, all of them decoded together."""
    sched = Scheduler(self.engine(weights))
    ids = [sched.submit(req.prompt, req.sampling, n=req.num_samples, seed=seed)
           for req, seed in jobs]
    results = sched.run()
    return [results[i] for i in ids]


def seeds(rng: np.random.Generator, jobs: list[Sample]) -> list[int]:
  """Each request's seed: its own, or a fresh one (requests never share draws)."""
  return [req.seed if req.seed is not None else int(rng.integers(0, 2**31)) for req in jobs]


def snapshot(adapter: dict) -> dict:
  """A copy of an adapter that later training steps do not change."""
  return jax.tree.map(lambda x: jax.numpy.array(x, copy=True), adapter)
