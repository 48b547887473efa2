"""Sampling sessions: which weights each one samples with, and the engines that decode.

A session samples the base model, an adapter snapshot taken by save_weights_for_sampler,
or a saved sampler checkpoint (tinker:// path, read when first sampled). One rollout
engine per LoRA rank holds several adapters at once (LoraConfig.adapters: side by side on
the rank axis, each sequence decoding with its own; its slot 0 is all zeros, the base
model), so the queued requests of every session of that rank -- and of the base -- decode
together, with paged KV, each request's samples sharing its prompt's pages. A session
without a slot takes the least recently used one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.models.config import LoraConfig, ModelConfig
from jaxrl_post.models.transformer import stack_adapters
from jaxrl_post.rollout import Completion, Engine, Scheduler, weights
from jaxrl_post.rollout.engine_config import EngineConfig
from jaxrl_post.serve.adapters import ATTN, MLP, adapter_shapes
from jaxrl_post.serve.requests import Sample

BASE_RANK = 8  # The engine the base model's sessions use while no adapter engine exists.


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


class _RankEngine:
  """An engine of `slots` adapters of one rank; slot 0 stays the base (zeros).

  `base` is in the engines' form (rollout.weights): with the layers split, each new set
  of adapters is split per layer beside it, so swapping adapters never copies the base.
  """

  def __init__(self, cfg: ModelConfig, base: dict, lora: LoraConfig, slots: int,
               engine_cfg: EngineConfig, mesh):
    self.base = base
    self.cfg = cfg.replace(lora=dataclasses.replace(lora, rank=slots * lora.rank,
                                                    adapters=slots))
    zero = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                        adapter_shapes(cfg.replace(lora=lora)))
    self.adapters = [zero] * slots
    # What each slot holds: the Weights object itself (kept alive, so no other can take its
    # identity), None for an empty slot; slot 0 is the base's.
    self.held: list[Optional[Weights]] = [None] * slots
    self.used = [0] * slots  # when each slot was last sampled with (a counter)
    self.engine = Engine(self.cfg, self._params(), engine_cfg, mesh=mesh)
    self.version = 0

  def _params(self) -> dict:
    stacked = stack_adapters(self.adapters)["layers"]
    if not weights.is_split(self.base):
      return {**self.base, "layers": {**self.base["layers"], **stacked}}
    per_layer = weights.SplitLayers(len(self.base["layers"]))({"layers": stacked})["layers"]
    return {**self.base, "layers": tuple({**b, **a} for b, a in zip(self.base["layers"],
                                                                    per_layer))}

  def slots_for(self, weights: list[Optional[Weights]], clock: int) -> list[int]:
    """The slot of each (distinct) weights, writing those not held yet into the least
    recently used others; the engine gets its new weights once."""
    wanted = {id(w) for w in weights if w is not None}  # All alive during this call.
    out, changed = [], False
    for w in weights:
      k = 0 if w is None else next((k for k in range(1, len(self.held))
                                    if self.held[k] is w), None)
      if k is None:
        free = [k for k in range(1, len(self.held))
                if self.held[k] is None or id(self.held[k]) not in wanted]
        k = min(free, key=lambda k: self.used[k])
        self.held[k], self.adapters[k], changed = w, w.adapter, True
      self.used[k] = clock
      out.append(k)
    if changed:
      self.version += 1
      self.engine.set_weights(self._params(), self.version)
    return out


class Engines:
  """The engines by rank, and the batches their requests decode in."""

  def __init__(self, cfg: ModelConfig, base: dict, engine_cfg: EngineConfig, lora_alpha: float,
               slots: int, mesh=None):
    self.cfg, self.engine_cfg, self.alpha, self.mesh = cfg, engine_cfg, lora_alpha, mesh
    # One copy of the base for every rank's engine, in their form (split on a GPU).
    form = weights.engine_form(cfg, mesh, engine_cfg.split_layers)
    self.base = base if form is None else weights.split_layers(base, cfg.num_layers)
    self.slots = slots
    self._engines: dict[int, _RankEngine] = {}
    self._clock = 0

  def lora_config(self, rank: int) -> LoraConfig:
    return LoraConfig(rank=rank, alpha=self.alpha, targets=ATTN + MLP)

  def rank_of(self, weights: Optional[Weights]) -> int:
    if weights is not None:
      return weights.rank
    return min(self._engines) if self._engines else BASE_RANK

  def _engine(self, rank: int) -> _RankEngine:
    if rank not in self._engines:
      self._engines[rank] = _RankEngine(self.cfg, self.base, self.lora_config(rank),
                                        self.slots, self.engine_cfg, self.mesh)
    return self._engines[rank]

  def batches(self, jobs: list[tuple]):
    """The jobs ((weights, request, seed, ...) tuples) in runs of one rank with at most
    `slots` - 1 distinct adapters each (and any number of the base's)."""
    by_rank: dict[int, list] = {}
    for job in jobs:
      by_rank.setdefault(self.rank_of(job[0]), []).append(job)
    for rank, group in by_rank.items():
      part, seen = [], set()  # The adapters in `part` (the base has a slot of its own).
      for job in group:
        key = None if job[0] is None else id(job[0])
        if key is not None and key not in seen and len(seen) == self.slots - 1:
          yield rank, part
          part, seen = [], set()
        if key is not None:
          seen.add(key)
        part.append(job)
      yield rank, part

  def sample(self, rank: int, jobs: list[tuple]) -> list[list[Completion]]:
    """Each job's completions, all of them decoded together in the rank's engine."""
    self._clock += 1
    held = self._engine(rank)
    slots = held.slots_for([job[0] for job in jobs], self._clock)
    sched = Scheduler(held.engine)
    ids = [sched.submit(req.prompt, dataclasses.replace(req.sampling, adapter=k),
                        n=req.num_samples, seed=seed)
           for (_, req, seed, *_), k in zip(jobs, slots)]
    results = sched.run()
    return [results[i] for i in ids]


def seeds(rng: np.random.Generator, jobs: list[Sample]) -> list[int]:
  """Each request's seed: its own, or a fresh one (requests never share draws)."""
  return [req.seed if req.seed is not None else int(rng.integers(0, 2**31)) for req in jobs]


def snapshot(adapter: dict) -> dict:
  """A copy of an adapter that later training steps do not change."""
  return jax.tree.map(lambda x: jax.numpy.array(x, copy=True), adapter)
