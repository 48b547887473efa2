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
import json
import sys
from typing import Optional, Sequence

from jaxrl_post import compile_cache, plugins
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


def _plan(gin_files, gin_params, target, found):
  """The Plan of the config (files + bindings) on `target`'s devices `found`."""
  from jaxrl_post.plan import report

  exp = _experiment(gin_files, gin_params)
  try:
    return report.plan_of(exp, target, found)
  except Exception as e:  # noqa: BLE001  (jax raises its runtime error type)
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise _OutOfMemory(len(report.run_devices(exp, found)), str(e)) from e


def _fit(args, target, found) -> int:
  """plan --fit: the fastest bindings that fit (plan.fit), printed ready to paste."""
  from jaxrl_post.plan import fit, memory, report
  from jaxrl_post.sharding import build_meshes

  def plan_with(bindings):
    try:
      return _plan(args.gin_file, [*args.gin_param, *bindings], target, found).as_json()
    except _OutOfMemory as e:  # The compiler refused: as far from fitting as it gets.
      raise UserError(f"the compiler refused a program: {e.message.splitlines()[0]}") from e

  experiment = lambda bindings: _experiment(args.gin_file, [*args.gin_param, *bindings])
  mesh = lambda exp: dict(build_meshes(exp.placement,
                                      report.run_devices(exp, found)).rollout.shape)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    return run(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
