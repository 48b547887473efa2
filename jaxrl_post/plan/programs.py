"""A run's own programs, compiled for a target on abstract arrays.

From an Experiment (the gin config the run would train with) and the target's devices:
the placement's meshes, the model's shapes (no weights), and the four programs one RL
step runs, each lowered exactly as the run jits it and compiled by the target's compiler:

* train: the trainer's minibatch update at the run's worst-case packed micro-batch (its
  memory), and at the rows its tokens fill (its time); with several minibatches, also the
  old-policy forward each later one runs first (its time);
* prefill: one packed prefill call of the engine at its configured rows and chunk;
* decode: the engine's multi-step decode loop at the configured slots and a page table
  as wide as the longest sequence (cascade attention where the engine decodes with it:
  blocks of `group_slots` samples reading their prompt's whole pages once);
* sync: the weight sync (cast + reshard training -> rollout layout).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_post.models import PRESETS, ModelConfig, abstract_model, preset
from jaxrl_post.models.transformer import is_adapter, logical_axes, params_of
from jaxrl_post.plan import memory
from jaxrl_post.plan.memory import CompiledMemory, TrainStepMemory, compiled_memory
from jaxrl_post.rl.packing import bucket, completion_bucket
from jaxrl_post.rl.trainer import Trainer
from jaxrl_post.rollout.forward import cascade_refusal
from jaxrl_post.rollout.layout import RolloutLayout, shard_count
from jaxrl_post.rollout.pages import cdiv, window_span
from jaxrl_post.rollout.weights import engine_form
from jaxrl_post.sharding import Meshes, PartialSync, WeightSync, build_meshes


def model_config(exp) -> ModelConfig:
  """The policy's shapes from ModelSpec.source without reading weights: a preset, a
  Hugging Face directory or hub id (config.json is enough: no shard is downloaded), or a
  GGUF / embedded model's metadata."""
  spec = exp.model
  overrides = dict(spec.overrides)
  if spec.lora is not None:
    overrides["lora"] = spec.lora
  if spec.source in PRESETS:
    return preset(spec.source, **overrides)
  from jaxrl_post.models import hub
  source = hub.local_source(spec.source, weights=False)
  if os.path.isdir(source):
    from jaxrl_post.models.hf import config_from_hf, read_json
    path = os.path.join(source, "config.json")
    return config_from_hf(read_json(path), path, **overrides)
  from jaxrl_post.models import load  # GGUF files carry their weights; small ones only.
  model, _ = load(spec.source, **overrides)
  return model.config


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The sizes the run's programs see, derived from the config as the run derives them."""

  samples: int  # trajectories per RL step
  longest: int  # prompt + completion tokens
  completion_len: int  # T of the trainer's [B, T] completion layout
  rows: int  # packed rows of one micro-batch at worst (what memory must hold)
  rows_filled: int  # packed rows its tokens fill (what a step takes on average)
  sequences: int  # trajectories of one micro-batch (padded to row shards)
  num_slots: int  # decode slots over the rollout mesh
  table_pages: int  # page-table width of the longest sequence
  page_size: int
  group_slots: int  # slots per cascade block (0: plain paged attention)
  shared_pages: int  # a block's shared prompt pages (cascade; 0 otherwise)
  prefill_rows: int  # packed prefill rows per data shard and call
  prefill_width: int  # tokens per prefill row


def shapes(exp, trainer: Trainer, layout: RolloutLayout) -> Shapes:
  r, t, eng = exp.rollout, exp.trainer, exp.rollout.engine
  samples = r.prompts_per_step * r.group_size
  longest = exp.prompts.max_prompt_tokens + r.max_new_tokens
  per_micro = samples // (t.minibatches * t.micro_batches)
  rows, sequences = memory.micro_batch_shape(per_micro, longest, t.row_tokens,
                                             trainer.batch_shards)
  filled = bucket(math.ceil(per_micro * longest / t.row_tokens), trainer.batch_shards)
  page = eng.pool.page_size
  # The engine decodes with cascade attention when asked and the model allows it; a
  # block shares the whole pages of its prompt.
  group = eng.group_slots if eng.group_slots and cascade_refusal(trainer.model_cfg) is None \
      else 0
  table = cdiv(min(eng.max_seq_len or longest, longest), page)
  return Shapes(samples=samples, longest=longest,
                completion_len=completion_bucket(r.max_new_tokens), rows=rows,
                rows_filled=min(filled, rows), sequences=sequences,
                num_slots=shard_count(eng.num_slots, layout.data_shards, eng.group_slots),
                table_pages=table,
                page_size=page, prefill_rows=eng.prefill_rows,
                prefill_width=min(eng.prefill_chunk, exp.prompts.max_prompt_tokens),
                group_slots=group,
                # At least the new token's page is a slot's own.
                shared_pages=min(exp.prompts.max_prompt_tokens // page, table - 1) if group
                else 0)


@dataclasses.dataclass(frozen=True)
class Programs:
  """Every compiled program of one step, per device, and what they were built from."""

  model: ModelConfig
  meshes: Meshes
  shapes: Shapes
  train: TrainStepMemory  # at the worst-case rows
  train_filled: CompiledMemory  # at the rows the tokens fill: what predicts its time
  # The later minibatches' old-policy forward at those rows (None with one minibatch).
  old_policy: Optional[CompiledMemory]
  prefill: CompiledMemory
  decode: CompiledMemory  # one call of `decode_steps` steps
  decode_steps: int
  sync: CompiledMemory
  rollout_weight_bytes: int
  decode_weight_bytes: int  # what a decode step reads of them (untied embeddings: rows only)
  sync_bytes: int


def compile_programs(exp, devices, largest: int = 5) -> Programs:
  """Compiles the run's programs over `devices` (abstract TPU chips or real devices)."""
  cfg = model_config(exp)
  meshes = build_meshes(exp.placement, devices)
  trainer = Trainer(cfg, exp.trainer, mesh=meshes.trainer)
  layout = RolloutLayout.build(cfg, meshes.rollout, exp.rollout.engine.split_layers)
  s = shapes(exp, trainer, layout)
  train = memory.train_step_memory(cfg, exp.trainer, meshes.trainer, rows=s.rows,
                                   completion_len=s.completion_len,
                                   micro_batches=exp.trainer.micro_batches,
                                   sequences=s.sequences, largest=largest,
                                   reference_dtype=exp.reference.dtype, analyse=True,
                                   segment_tokens=s.longest)
  train_filled = train.compiled
  if s.rows_filled != s.rows:
    train_filled = memory.train_step_memory(
        cfg, exp.trainer, meshes.trainer, rows=s.rows_filled, completion_len=s.completion_len,
        micro_batches=exp.trainer.micro_batches, sequences=s.sequences,
        reference_dtype=exp.reference.dtype, analyse=True, segment_tokens=s.longest).compiled
  old_policy = None
  if exp.trainer.minibatches > 1:
    old_policy = memory.old_policy_memory(
        cfg, exp.trainer, meshes.trainer, rows=s.rows_filled, completion_len=s.completion_len,
        micro_batches=exp.trainer.micro_batches, sequences=s.sequences, analyse=True,
        segment_tokens=s.longest)
  kv_dtype = exp.rollout.engine.pool_dtype(cfg)
  wdt = exp.sync.rollout_dtype
  steps = exp.rollout.engine.decode_steps
  per_shard = s.num_slots // layout.data_shards
  pages = 1 + per_shard * s.table_pages  # the sink page too
  span = window_span(cfg, s.page_size, steps)  # A window pool's pages (split_kv models).
  wpages = 0 if span is None else 1 + per_shard * min(s.table_pages, span)
  params, pool, state = memory.decode_operands(cfg, s.num_slots, pages, s.page_size,
                                               s.table_pages, kv_dtype, wdt,
                                               exp.rollout.engine.max_stop_ids, layout,
                                               window_pages_per_shard=wpages)
  r = exp.rollout  # The engine leaves the truncation pass out when no request uses it.
  shared, width = _cascade_operands(s, layout)
  decode = compiled_memory(memory.compile_lowered(memory.lower_decode(
      cfg, params, pool, state, steps, layout, r.top_k > 0 or r.top_p < 1, shared, width)),
      analyse=True)
  prefill = compiled_memory(memory.compile_lowered(_lower_prefill(cfg, params, pool, s, layout)),
                            analyse=True)
  sync, sync_bytes = _compile_sync(exp, cfg, meshes, layout)
  return Programs(model=cfg, meshes=meshes, shapes=s, train=train, train_filled=train_filled,
                  old_policy=old_policy, prefill=prefill,
                  decode=decode, decode_steps=steps, sync=sync,
                  rollout_weight_bytes=memory.device_bytes(params),
                  decode_weight_bytes=_decode_weight_bytes(cfg, params), sync_bytes=sync_bytes)


def _cascade_operands(s: Shapes, layout: RolloutLayout):
  """(SharedPrefix, the slots' table width after it) of a cascade decode call at the
  longest sequence, as the engine passes them; (None, None) for plain paged attention."""
  if not s.group_slots:
    return None, None
  from jaxrl_post.rollout.attention import SharedPrefix
  blocks = s.num_slots // s.group_slots
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32,
                                             sharding=layout.rows(len(shape)))
  return (SharedPrefix(spec(blocks, max(s.shared_pages, 1)), spec(blocks)),
          s.table_pages - s.shared_pages)


def _decode_weight_bytes(cfg: ModelConfig, params) -> int:
  """Bytes of the rollout weights one decode step must read: all of them but an untied
  input embedding, of which it gathers one row per sequence."""
  total = memory.device_bytes(params)
  return total if cfg.tie_word_embeddings else total - memory.device_bytes(params["embed"])


def _lower_prefill(cfg: ModelConfig, params, pool, s: Shapes, layout: RolloutLayout):
  """One packed prefill call: R rows of W tokens per data shard, each row reading the
  key pages of its chunks (at most its own pages plus one chunk's overhang)."""
  from jaxrl_post.rollout.programs import prefill_program
  from jaxrl_post.rollout.prefill_pack import PackedRows

  rows = layout.data_shards * s.prefill_rows
  key_pages = cdiv(s.prefill_width, s.page_size) + 1
  grid = lambda width: jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=layout.rows(2))
  packed = PackedRows(tokens=grid(s.prefill_width), positions=grid(s.prefill_width),
                      segments=grid(s.prefill_width), write_pages=grid(s.prefill_width),
                      key_pages=grid(key_pages), key_segments=grid(key_pages),
                      key_starts=grid(key_pages))
  last = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=layout.replicated)
  return prefill_program(layout).lower(params, pool, packed, last,
                                      memory.window_map_operand(pool, layout), cfg=cfg,
                                      layout=layout)


def _compile_sync(exp, cfg: ModelConfig, meshes: Meshes,
                  layout: RolloutLayout) -> tuple[CompiledMemory, int]:
  """The weight sync's program (writing the engine's form of the weights, as the run's
  does) and the bytes it moves (only adapters with LoRA)."""
  model = abstract_model(cfg)
  shapes_ = params_of(model)
  axes = logical_axes(model)
  form = engine_form(cfg, layout.mesh, layout.split_layers)
  if cfg.lora is not None:
    sync = PartialSync(meshes, axes, shapes_, exp.sync, moves=is_adapter, form=form)
    inner, tree = sync._moving, sync.moving(shapes_)
  else:
    inner, tree = WeightSync(meshes, axes, shapes_, exp.sync, form=form), shapes_
  train = _placed(tree, inner.train_shardings)
  dtype = jnp.dtype(exp.sync.rollout_dtype)
  if meshes.colocated:
    rollout = _placed(form.abstract(tree) if form else tree, inner.rollout_shardings, dtype)
    lowered = inner._sync.lower(train, rollout)
  else:
    lowered = inner._first.lower(train)
  return compiled_memory(memory.compile_lowered(lowered), analyse=True), inner.bytes_per_sync


def _placed(tree, shardings, dtype=None):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                      tree, shardings)


def local_chip_memory(devices) -> Optional[int]:
  """Bytes a local device holds (memory_stats), None where the backend does not say."""
  try:
    stats = devices[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  (abstract and CPU devices may raise or return None)
    return None
  return stats.get("bytes_limit")

