"""Will this config fit, and how long will a step take? `python -m jaxrl_post.plan`.

  python -m jaxrl_post.plan --gin_file=configs/X.gin [--gin_param=...] [--target=T] [--json]

Compiles the run's own programs (train minibatch, prefill, decode loop, weight sync) for
the target on abstract arrays, with no weights and no data, and prints memory per device,
the KV pool that fits, the attention kernels each program compiled with, predicted
seconds per role and the bytes each step moves. Targets: `local` (this host's devices,
the default), TPU slices (v4-8 ... v6e-256, compiled by libtpu on any host: pip install
-e '.[tpu]') and GPU nodes (h100x1, h100x8, h200x1, h200x8, a100x1, a100x8; compiled by XLA:GPU and
Triton without a GPU with pip install -e '.[gpu-plan]', else planned from this host's
programs). Exit status: 0 fits, 1 does not fit (after the report: use it as a pre-flight
check), 2 bad input. With --fit it searches bindings that make the config fit (plan.fit)
and prints the fastest, ready to paste as --gin_param, with the runners-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Optional, Sequence

from jaxrl_post import compile_cache, cuda_plugin, plugins
from jaxrl_post.errors import UserError
from jaxrl_post.plan import targets

# Planning reads no data: the task only scores completions, so any data files the config
# names are not opened (a laptop plans a run whose data lives on the cluster).
NO_DATA = "Experiment.task = @ArithmeticTask()"


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.plan",
                              description="Plan a run: memory, kernels, predicted step time.")
  p.add_argument("--gin_file", action="append", default=[], help="gin config file")
  p.add_argument("--gin_param", action="append", default=[], help="one gin binding")
  p.add_argument("--target", default="local",
                 help=f"hardware to plan for (one of: {', '.join(targets.known_targets())})")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--fit", action="store_true",
                 help="search bindings (micro-batches, remat, reference dtype, rollout mesh, "
                      "slots) for the fastest predicted step that fits the target")
  p.add_argument("--fit_budget", type=int, default=6,
                 help="most configs --fit compiles (each is a full plan)")
  compile_cache.add_cache_flag(p)
  plugins.add_import_flag(p)
  return p


def measured_peaks(devices) -> tuple[float, float]:
  """(FLOP/s, bytes/s) of one local device, measured: a large matmul and a large copy in
  the model's float32 (the CPU has no bfloat16 matmul units worth the name)."""
  import jax
  import jax.numpy as jnp

  def best(fn, *args, repeats=5):
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn(*args).block_until_ready()
      times.append(time.perf_counter() - t0)
    return min(times)

  n = 1024
  a = jax.device_put(jnp.ones((n, n), jnp.float32), devices[0])
  flops = 2 * n ** 3 / best(jax.jit(lambda x: x @ x), a)
  big = jax.device_put(jnp.ones((16 << 20,), jnp.float32), devices[0])
  bandwidth = 2 * big.nbytes / best(jax.jit(lambda x: x * 1.0001), big)
  return flops, bandwidth


def run(argv: Sequence[str]) -> int:
  args = _parser().parse_args(argv)
  target = targets.resolve(args.target)
  targets.prepare(target)  # before jax starts its backends
  if not args.gin_file:
    raise UserError("no config: pass --gin_file=configs/<name>.gin")
  plugins.import_modules(args.gin_import)  # The config may bind the user's own classes.
  found = targets.target_devices(target)
  compile_cache.enable("off" if found.compile_only else args.compilation_cache)
  if args.fit:
    return _fit(args, target, found)
  try:
    plan = _plan(args.gin_file, args.gin_param, target, found)
  except _OutOfMemory as e:
    return _out_of_memory(args, target, e.devices, e.message)
  if args.json:
    print(json.dumps(plan.as_json()))  # one line: scripts keep the last line
  else:
    from jaxrl_post.plan import report
    print(report.text(plan))
  return 0 if plan.fits else 1


class _OutOfMemory(Exception):
  def __init__(self, devices: int, message: str):
    super().__init__(message)
    self.devices, self.message = devices, message


def _experiment(gin_files, gin_params):
  from jaxrl_post.pipeline import config
  config.parse(gin_files, [*gin_params, NO_DATA])
  return config.build_experiment()


def _devices(exp, found):
  devices = found.devices
  return devices[:exp.placement.num_devices] if exp.placement.num_devices else devices


def _plan(gin_files, gin_params, target, found):
  """The Plan of the config (files + bindings) on `target`'s devices `found`."""
  from jaxrl_post.plan import programs, report

  exp = _experiment(gin_files, gin_params)
  devices = _devices(exp, found)
  try:
    compiled = programs.compile_programs(exp, devices)
  except Exception as e:  # noqa: BLE001  (jax raises its runtime error type)
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise _OutOfMemory(len(devices), str(e)) from e
  stats = True  # A target's memory is known; a local device may report none (the CPU).
  if target.chip is None:  # A known accelerator's published peaks: a short benchmark on a
    # GPU times its launches, not its peaks (an H100 measured 10 TFLOP/s and 0.96 TB/s).
    known = targets.chip_of_kind(devices[0].device_kind)
    peaks = ((known.bf16_flops_per_s, known.hbm_bytes_per_s) if known
             else measured_peaks(devices))
    capacity = programs.local_chip_memory(devices)
    chip, stats = report.local_chip(devices, *peaks, capacity), capacity is not None
  else:
    share = target.chips / len(devices)  # a v4 chip shows as two devices
    chip = target.chip if share == 1 else _per_device(target.chip, share)
    if chip.platform == "gpu":  # What jax's allocator holds of it in a run.
      chip = dataclasses.replace(chip, hbm_bytes=chip.hbm_bytes * cuda_plugin.gpu_memory_share())
  return report.build(compiled, target, chip, exp, len(devices), found.compiled_for,
                      memory_stats=stats)


def _fit(args, target, found) -> int:
  """plan --fit: the fastest bindings that fit (plan.fit), printed ready to paste."""
  from jaxrl_post.plan import fit, memory
  from jaxrl_post.sharding import build_meshes

  def plan_with(bindings):
    try:
      return _plan(args.gin_file, [*args.gin_param, *bindings], target, found).as_json()
    except _OutOfMemory as e:  # The compiler refused: as far from fitting as it gets.
      raise UserError(f"the compiler refused a program: {e.message.splitlines()[0]}") from e

  experiment = lambda bindings: _experiment(args.gin_file, [*args.gin_param, *bindings])
  mesh = lambda exp: dict(build_meshes(exp.placement, _devices(exp, found)).rollout.shape)
  log = (lambda line: print(line, file=sys.stderr)) if args.json else print
  with memory.compiling_once():  # Candidates share most of their programs.
    candidates = fit.search(plan_with, experiment, mesh, budget=args.fit_budget, log=log)
  if args.json:
    print(json.dumps({"target": target.name, "fits": candidates[0].fits, "candidates": [
        {"bindings": list(c.bindings), "moves": list(c.moves), "fits": c.fits,
         "peak_gb_per_device": c.peak if c.plan else None,
         "predicted_step_s": c.step_s if c.plan else None, "error": c.error}
        for c in candidates]}))
  else:
    print(fit.report(candidates, target.name))
  return 0 if candidates[0].fits else 1


def _out_of_memory(args, target, devices: int, message: str) -> int:
  """The verdict when the target's compiler itself refuses a program for lack of memory
  (XLA:TPU does, before any buffer is assigned): which program and by how much."""
  line = next((l for l in message.splitlines() if "RESOURCE_EXHAUSTED" in l), message)
  line = line.split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
  if args.json:
    print(json.dumps({"target": target.name, "devices": devices, "fits": False,
                      "compiler_refused": line}))
  else:
    print(f"plan for {target.name}: {devices} device(s)\nverdict: does NOT fit: the "
          f"compiler refused a program: {line}")
  return 1


def _per_device(chip, share: float):
  return dataclasses.replace(chip, hbm_bytes=chip.hbm_bytes * share,
                             hbm_bytes_per_s=chip.hbm_bytes_per_s * share,
                             bf16_flops_per_s=chip.bf16_flops_per_s * share)


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    return run(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
