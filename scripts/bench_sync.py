"""Benchmark weight sync: in-device reshard vs a round trip through the host.

  python scripts/bench_sync.py [--json] [--model smollm2-135m] [--lora-rank 16]

Both paths start from the trainer's f32 parameters (FSDP x TP sharding) and end with the
rollout's bf16 weights (TP sharding), timed side by side in one run (median of --repeats).
Also reports bytes per sync: full bf16 weights, LoRA adapters only, and a sparse delta
when 2% of the entries changed (int32 index + bf16 value per changed entry).
On a CPU it runs on 8 host devices; absolute times count only on a GPU/TPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  # Harmless on accelerators (only the host platform reads it); gives the CPU 8 devices.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl_post.models import LoraConfig, abstract_model, init_model, preset  # noqa: E402
from jaxrl_post.models.transformer import logical_axes, params_of  # noqa: E402
from jaxrl_post.sharding import (MeshConfig, PlacementConfig, SyncConfig, WeightSync,  # noqa
                                 build_meshes)


def median_time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # Compile and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def placement(mode: str, n: int, tensor: int) -> PlacementConfig:
  if mode == "colocated":
    return PlacementConfig(trainer_mesh=MeshConfig(fsdp=-1, tensor=tensor),
                           rollout_mesh=MeshConfig(data=-1, fsdp=1, tensor=tensor))
  return PlacementConfig(mode="split", trainer_devices=n // 2,
                         trainer_mesh=MeshConfig(fsdp=-1, tensor=tensor),
                         rollout_mesh=MeshConfig(data=-1, fsdp=1, tensor=tensor))


def sync_times(cfg, mode: str, tensor: int, repeats: int) -> dict:
  meshes = build_meshes(placement(mode, jax.device_count(), tensor))
  abstract = abstract_model(cfg)
  sync = WeightSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig())
  train = jax.jit(lambda: params_of(init_model(cfg, 0)), out_shardings=sync.train_shardings)()
  state = {"w": sync.initial(train)}

  def device_sync():
    state["w"] = sync(train, state["w"])
    return state["w"].params

  def host_sync():  # What a sync through the host costs: gather, cast, scatter.
    host = jax.device_get(train)
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), host)
    return jax.device_put(cast, sync.rollout_shardings)

  return {"device_s": median_time(device_sync, repeats),
          "host_s": median_time(host_sync, repeats), "bytes": sync.bytes_per_sync,
          "train": train, "rollout": state["w"].params}


def delta_bytes(train, rollout, fraction: float, seed: int = 0) -> int:
  """Bytes of a sparse update after changing `fraction` of the entries."""
  @jax.jit
  def changed(train, rollout, key):
    leaves, treedef = jax.tree.flatten(train)
    keys = jax.random.split(key, len(leaves))
    count = 0
    for x, old, k in zip(leaves, jax.tree.leaves(rollout), keys):
      mask = jax.random.uniform(k, x.shape) < fraction
      new = jnp.where(mask, x + 0.05 * (jnp.abs(x) + 1e-3), x).astype(old.dtype)
      count += jnp.sum(new != old)
    return count

  nnz = int(changed(train, rollout, jax.random.key(seed)))
  return nnz * (4 + 2)  # int32 index + bf16 value


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true")
  p.add_argument("--model", default="smollm2-135m", help="model preset (random weights)")
  p.add_argument("--lora-rank", type=int, default=16)
  p.add_argument("--lora-targets", default="wq,wk,wv,wo,w_gate,w_up,w_down")
  p.add_argument("--tensor", type=int, default=2, help="tensor-parallel degree")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)

  cfg = preset(args.model, compute_dtype="bfloat16")
  n = jax.device_count()
  # One GPU has no tensor axis to speak of and no second half for a split placement: the
  # bench measures what the host has (tensor divides the devices; split needs two halves).
  tensor = math.gcd(args.tensor, n)
  co = sync_times(cfg, "colocated", tensor, args.repeats)
  split = (sync_times(cfg, "split", tensor, args.repeats) if n >= 2 and (n // 2) % tensor == 0
           else None)
  lora_cfg = cfg.replace(lora=LoraConfig(rank=args.lora_rank,
                                         targets=tuple(args.lora_targets.split(","))))
  lora_bytes = 2 * sum(x.size for x in jax.tree.leaves(
      params_of(abstract_model(lora_cfg), nnx.LoRAParam)))
  full = co["bytes"]
  result = {
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "num_devices": jax.device_count(), "jax": jax.__version__, "model": args.model,
      "params": cfg.num_params, "tensor_parallel": tensor,
      "full_bytes": full, "lora_rank": args.lora_rank, "lora_bytes": lora_bytes,
      "lora_bytes_fraction": lora_bytes / full,
      "delta_2pct_bytes": delta_bytes(co["train"], co["rollout"], 0.02),
      "colocated_sync_s": co["device_s"], "colocated_host_sync_s": co["host_s"],
      "split_sync_s": split and split["device_s"], "split_host_sync_s": split and split["host_s"],
      "device_vs_host_speedup": co["host_s"] / co["device_s"],
      "split_device_vs_host_speedup": split and split["host_s"] / split["device_s"],
      "colocated_sync_GBps": full / co["device_s"] / 1e9,
  }
  result["delta_2pct_fraction"] = result["delta_2pct_bytes"] / full
  if args.json:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k:32s} {v}")


if __name__ == "__main__":
  main()
