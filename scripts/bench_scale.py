"""Benchmark: memory and FLOPs of RL training at real sizes, compiled without weights.

  python scripts/bench_scale.py [--json] [--quick] [--device-gb 80] [--row-tokens 4096]

The train step of Llama-3.2-1B on 1 device and of Llama-3.1-8B on 8 devices (FSDP) is
lowered and compiled on abstract arrays (jaxrl_post.plan); XLA's memory analysis gives the
per-device peak, to which the frozen bf16 reference, the bf16 rollout weights and the KV
pool sized from what is left are added. On a CPU this runs on 8 fake host devices: the
figures are XLA's buffer assignment for the CPU backend, which follows the same program
as the GPU's but not its exact fusion and scheduling, so read them as close estimates.

Keys (one function each):
  memory_gb_1b_1dev, memory_gb_8b_8dev: per-device GB and their breakdown.
  train_flops_per_device_ratio_8v1: one 1B batch compiled on 8 devices vs 1 device,
    per-device FLOPs (ideal 0.125).
  rollout_mesh_greedy_equal: greedy tokens of a tiny model from the engine on one device
    equal those from the engine on a data x tensor mesh.
  compiled_shapes_20_steps: XLA compilations during 20 steps of the quickstart RL run
    (every program, the first step's included; fixed after the first steps when shapes are
    bucketed).
--quick: tiny shapes and 2 RL steps, a smoke run for tests; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  # Harmless on accelerators (only the host platform reads it); gives the CPU 8 devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_post import plan  # noqa: E402
from jaxrl_post.errors import UserError  # noqa: E402
from jaxrl_post.models import ModelConfig, RopeScaling, init_model  # noqa: E402
from jaxrl_post.models.transformer import params_of  # noqa: E402
from jaxrl_post.rl.trainer import TrainerConfig  # noqa: E402
from jaxrl_post.sharding import MeshConfig, make_mesh  # noqa: E402

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Llama 3's RoPE scaling as published (rope_scaling in config.json).
LLAMA3_1B_ROPE = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)
LLAMA3_8B_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192)


def llama_1b(remat: str) -> ModelConfig:
  """Llama-3.2-1B's published shapes (tied embeddings)."""
  return ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                     rope_theta=500000.0, rope_scaling=LLAMA3_1B_ROPE, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, max_position_embeddings=131072,
                     param_dtype="float32", compute_dtype="bfloat16", remat=remat)


def llama_8b(remat: str) -> ModelConfig:
  """Llama-3.1-8B's published shapes (untied output head)."""
  return ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     rope_theta=500000.0, rope_scaling=LLAMA3_8B_ROPE, rms_norm_eps=1e-5,
                     tie_word_embeddings=False, max_position_embeddings=131072,
                     param_dtype="float32", compute_dtype="bfloat16", remat=remat)


def tiny(remat: str, tied: bool) -> ModelConfig:
  """A few-layer stand-in for --quick with the same structure (GQA, llama3 RoPE)."""
  return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_scaling=LLAMA3_1B_ROPE,
                     tie_word_embeddings=tied, max_position_embeddings=512, remat=remat)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One planned placement: a model on a number of colocated devices.

  Attributes:
    model: the model.
    devices: devices of the trainer mesh (FSDP over all of them) and the rollout mesh.
    rows_per_device: packed rows each device trains on per micro-batch.
    row_tokens: tokens per packed row.
    completion_len: the padded completion length T.
    sequences_per_row: trajectories packed into one row.
    rollout_tensor: the rollout mesh's "tensor" size (the rest of the devices are "data").
    page_size: KV page tokens.
    decode_slots_per_shard: the rollout engine's decode batch per data shard.
  """

  model: ModelConfig
  devices: int
  rows_per_device: int
  row_tokens: int
  completion_len: int
  sequences_per_row: int
  rollout_tensor: int
  page_size: int
  decode_slots_per_shard: int

  @property
  def rows(self) -> int:
    return self.rows_per_device * self.devices

  @property
  def data_shards(self) -> int:
    return self.devices // self.rollout_tensor


def meshes(s: Setting):
  """(trainer mesh, rollout mesh) over the first `s.devices` devices, colocated."""
  devices = jax.devices()[:s.devices]
  trainer = make_mesh(MeshConfig(fsdp=s.devices), devices)
  rollout = make_mesh(MeshConfig(data=s.data_shards, fsdp=1, tensor=s.rollout_tensor), devices)
  return trainer, rollout


def train_step(s: Setting, mesh, largest: int = 0) -> plan.TrainStepMemory:
  cfg = TrainerConfig(row_tokens=s.row_tokens)
  return plan.train_step_memory(s.model, cfg, mesh, rows=s.rows, row_tokens=s.row_tokens,
                                completion_len=s.completion_len,
                                sequences=s.rows * s.sequences_per_row, largest=largest,
                                reference_dtype="bfloat16")


def decode_temp(s: Setting, rollout_mesh, pages_per_shard: int) -> int:
  """Temporaries of the engine's decode loop over the planned pool (a full-length table)."""
  slots = s.decode_slots_per_shard * s.data_shards
  table = -(-s.row_tokens // s.page_size)
  return plan.decode_loop_memory(s.model, slots, pages_per_shard, s.page_size, table,
                                 steps=16, mesh=rollout_mesh).temp_bytes


def pool_beside(s: Setting, device_gb: float, train_peak: int, other: int,
                fraction: float) -> tuple[Optional[plan.PoolPlan], str]:
  """The KV pool planned beside the train step, or (None, why) when none fits."""
  try:
    return plan.kv_pool_pages(s.model, s.page_size, "bfloat16", int(device_gb * GB),
                              train_peak, s.rollout_tensor, fraction, other_bytes=other), ""
  except UserError as e:
    return None, str(e)


def memory_breakdown(s: Setting, device_gb: float, fraction: float) -> dict[str, Any]:
  """Per-device memory of one colocated setting, in GB.

  Two moments bound the device: the train step (its compiled peak, which holds the
  parameters, optimizer state, gradients and activations) beside the resident reference,
  rollout weights and KV pool; and decoding (train state, weights, pool and the decode
  loop's temporaries). The pool takes `fraction` of what the first leaves.
  """
  trainer_mesh, rollout_mesh = meshes(s)
  train = train_step(s, trainer_mesh, largest=8)
  # The step takes the bf16 reference as an argument (it runs the reference forward); the
  # reference is resident for the whole run, so it is counted once, with the other weights.
  train_peak = train.peak_bytes - train.reference_bytes
  ref = plan.reference_bytes(s.model, trainer_mesh, "bfloat16")
  rollout = plan.rollout_bytes(s.model, rollout_mesh, "bfloat16")
  pool, why = pool_beside(s, device_gb, train_peak, ref + rollout, fraction)
  pool_bytes, pages = (pool.pool_bytes, pool.pages) if pool else (0, 0)
  tokens = pool.tokens if pool else 0
  state = train.params_bytes + train.frozen_bytes + train.opt_state_bytes
  decode = decode_temp(s, rollout_mesh, max(pages, 2))
  before_pool = train_peak + ref + rollout
  at_decode = state + ref + rollout + pool_bytes + decode
  # A step's rollouts held at once per data shard (no prefix sharing): the least the pool
  # must hold for the planned batch without waiting on free pages.
  need = s.rows * s.row_tokens // s.data_shards
  peak = max(before_pool + pool_bytes, at_decode)
  gb = lambda x: round(x / GB, 3)
  out = {
      "peak_gb": gb(peak),
      "before_pool_gb": gb(before_pool),
      "train_step_peak_gb": gb(train_peak),
      "params_gb": gb(train.params_bytes + train.frozen_bytes),
      "optimizer_state_gb": gb(train.opt_state_bytes),
      "gradients_gb": gb(train.gradient_bytes),
      "activations_gb": gb(train.activation_bytes),
      "xla": {"argument_gb": gb(train.compiled.argument_bytes),
              "output_gb": gb(train.compiled.output_bytes),
              "temp_gb": gb(train.compiled.temp_bytes),
              "alias_gb": gb(train.compiled.alias_bytes)},
      "largest_allocations": [{"gb": gb(a.bytes), "values": a.values[:160]}
                              for a in train.largest],
      "reference_bf16_gb": gb(ref),
      "rollout_weights_bf16_gb": gb(rollout),
      "kv_pool_gb": gb(pool_bytes),
      "kv_pool_pages_per_data_shard": pages,
      "kv_pool_tokens_per_data_shard": tokens,
      "rollout_batch_tokens_per_data_shard": need,
      "decode_temp_gb": gb(decode),
      "at_train_gb": gb(before_pool + pool_bytes),
      "at_decode_gb": gb(at_decode),
      "fits": bool(pool is not None and peak <= device_gb * GB and tokens >= need),
      "device_gb": device_gb,
      "train_flops_per_device": train.compiled.flops,
      "setting": {"devices": s.devices, "trainer_mesh": {"fsdp": s.devices},
                  "rollout_mesh": {"data": s.data_shards, "tensor": s.rollout_tensor},
                  "rows_per_device": s.rows_per_device, "row_tokens": s.row_tokens,
                  "completion_len": s.completion_len, "remat": s.model.remat,
                  "params": s.model.num_params, "page_size": s.page_size,
                  "decode_slots_per_shard": s.decode_slots_per_shard},
  }
  if why:
    out["note"] = why
  return out


def train_flops_ratio(model: ModelConfig, rows: int, row_tokens: int, completion_len: int,
                      devices: int = 8) -> dict[str, Any]:
  """Per-device FLOPs of one batch on `devices` devices over those on one device.

  XLA's cost model counts a loop body once, so the absolute figures undercount the
  scanned layers; both programs share that structure, so the ratio is what to read.
  """
  cfg = TrainerConfig(row_tokens=row_tokens)
  flops = {}
  for n in (1, devices):
    mesh = make_mesh(MeshConfig(fsdp=n), jax.devices()[:n])
    flops[n] = plan.train_step_memory(model, cfg, mesh, rows=rows, row_tokens=row_tokens,
                                      completion_len=completion_len).compiled.flops
  return {"ratio": flops[devices] / flops[1], "ideal": 1 / devices,
          "flops_1dev": flops[1], f"flops_{devices}dev": flops[devices], "rows": rows,
          "row_tokens": row_tokens}


# ---------------------------------------------------------------- engine-dependent keys


def rollout_mesh_greedy_equal(tensor: int = 2) -> dict[str, Any]:
  """Greedy completions of a tiny model: engine on one device vs on a data x tensor mesh."""
  from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig, SamplingParams, generate
  if "mesh" not in inspect.signature(Engine.__init__).parameters:
    return {"value": None, "note": "pending: the rollout Engine takes no mesh= yet"}
  model = tiny("none", tied=True)
  params = params_of(init_model(model, 0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, model.vocab_size, size=n).tolist() for n in (5, 11, 17, 23)]
  sampling = SamplingParams(temperature=0.0, max_tokens=12)
  config = EngineConfig(num_slots=8, decode_steps=4, max_seq_len=64, min_table_pages=2,
                        pool=PoolConfig(page_size=8, num_pages=64))
  mesh = make_mesh(MeshConfig(data=jax.device_count() // tensor, fsdp=1, tensor=tensor))

  def tokens(engine):
    return [[c.tokens for c in group] for group in generate(engine, prompts, n=2,
                                                            sampling=sampling)]

  one, many = tokens(Engine(model, params, config)), tokens(Engine(model, params, config,
                                                                   mesh=mesh))
  return {"value": one == many, "mesh": dict(mesh.shape), "prompts": len(prompts),
          "samples_per_prompt": 2, "max_tokens": sampling.max_tokens}


def compiled_shapes(steps: int, devices: int) -> dict[str, Any]:
  """XLA compilations during `steps` RL steps of the quickstart config on `devices`
  colocated devices (no warm-up, no evaluation), by function name."""
  from jaxrl_post.pipeline.compiles import CompileCounter
  from jaxrl_post.pipeline.loop import RLRun
  from jaxrl_post.telemetry import StepTimer
  from jaxrl_post.train import prepare

  with tempfile.TemporaryDirectory() as workdir:
    exp, workdir = prepare([f"--gin_file={os.path.join(ROOT, 'configs', 'quickstart.gin')}",
                            f"--workdir={workdir}", f"--gin_param=Experiment.steps = {steps}",
                            "--gin_param=SftConfig.steps = 0",
                            f"--gin_param=PlacementConfig.num_devices = {devices}",
                            "--gin_param=CheckpointConfig.every_n_steps = 1000"])
    run = RLRun(exp, workdir, log=lambda message: None)
    try:
      run.start()
      with CompileCounter() as counter:
        for step in range(1, steps + 1):
          timer = StepTimer()
          timer.start()
          run.step(step, timer)
          timer.stop()
    finally:
      run.close()
  main_fns = ("minibatch_update", "decode_loop", "prefill", "sequence_advantages")
  by_function = dict(counter.by_function.most_common())
  return {"value": counter.total, "steps": steps, "devices": devices,
          "step_programs": {k: v for k, v in by_function.items()
                            if any(f in k for f in main_fns)},
          "by_function": by_function}


# ---------------------------------------------------------------------------- main


def settings(args) -> tuple[Setting, Setting]:
  if args.quick:
    common = dict(row_tokens=64, completion_len=32, sequences_per_row=2, page_size=8,
                  decode_slots_per_shard=4)
    return (Setting(tiny(args.remat, True), 1, 2, rollout_tensor=1, **common),
            Setting(tiny(args.remat, False), 8, 2, rollout_tensor=2, **common))
  common = dict(row_tokens=args.row_tokens, completion_len=args.completion_len,
                sequences_per_row=args.sequences_per_row, page_size=args.page_size,
                decode_slots_per_shard=args.decode_slots)
  return (Setting(llama_1b(args.remat), 1, args.rows_per_device, rollout_tensor=1, **common),
          Setting(llama_8b(args.remat), 8, args.rows_per_device,
                  rollout_tensor=args.rollout_tensor_8b, **common))


def run(args) -> dict[str, Any]:
  one, eight = settings(args)
  memory_1b = memory_breakdown(one, args.device_gb, args.pool_fraction)
  # The 8-device figures need 8 devices (a one-GPU host has one; `python -m jaxrl_post.plan
  # --target=h100x8` compiles for eight without them).
  skipped = {"value": None, "skipped": f"needs 8 devices, {jax.device_count()} here"}
  multi = jax.device_count() >= 8
  memory_8b = (memory_breakdown(eight, args.device_gb, args.pool_fraction) if multi
               else dict(skipped))
  flops = (train_flops_ratio(one.model, 8, one.row_tokens, one.completion_len) if multi
           else {"ratio": None, **skipped})
  greedy = rollout_mesh_greedy_equal() if multi else dict(skipped)
  shapes = compiled_shapes(2 if args.quick else 20, 1 if args.quick else jax.device_count())
  return {
      "memory_gb_1b_1dev": memory_1b,
      "memory_gb_8b_8dev": memory_8b,
      "train_flops_per_device_ratio_8v1": flops["ratio"],
      "train_flops_detail": flops,
      "rollout_mesh_greedy_equal": greedy.pop("value"),
      "rollout_mesh_greedy_detail": greedy,
      "compiled_shapes_20_steps": shapes.pop("value"),
      "compiled_shapes_detail": shapes,
      "quick": args.quick,
      "jax": jax.__version__,
      "backend": jax.default_backend(),
  }


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
  p.add_argument("--device-gb", type=float, default=None,
                 help="device memory in 1e9 bytes (default 80; 0.05 with --quick)")
  p.add_argument("--pool-fraction", type=float, default=0.9,
                 help="share of the memory left beside the train step given to the KV pool")
  p.add_argument("--row-tokens", type=int, default=4096)
  p.add_argument("--rows-per-device", type=int, default=2)
  p.add_argument("--completion-len", type=int, default=1024)
  p.add_argument("--sequences-per-row", type=int, default=4)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--decode-slots", type=int, default=64, help="decode slots per data shard")
  p.add_argument("--rollout-tensor-8b", type=int, default=8,
                 help="tensor-parallel size of the 8B rollout mesh (1: replicated weights)")
  p.add_argument("--remat", default="full", help="ModelConfig.remat for both models")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if args.device_gb is None:
    args.device_gb = 0.05 if args.quick else 80.0
  result = run(args)
  if args.json:
    print(json.dumps(result))
  else:
    for key, value in result.items():
      print(f"{key}: {json.dumps(value, indent=2) if isinstance(value, dict) else value}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
