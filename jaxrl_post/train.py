"""Train a policy with RL: `python -m jaxrl_post.train --gin_file=configs/X.gin`.

  --gin_file=FILE       gin config (repeatable; later files override earlier ones)
  --gin_param=BINDING   one binding, e.g. --gin_param='Experiment.steps = 50' (repeatable)
  --gin_import=MODULE   import a module of your own tasks or environments (registered with
                        jaxrl_post.register) before the gin files are parsed (repeatable)
  --workdir=DIR         checkpoints, metrics.jsonl, TensorBoard events, the resolved config
  --compilation_cache=PATH|off
                        persistent XLA compilation cache (default: $JAXRL_COMPILATION_CACHE,
                        else ~/.cache/jaxrl_post/xla), so a resume compiles nothing again

Multi-host (one process per host, every process runs the same command):
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I
                        start jax.distributed explicitly (or set JAXRL_COORDINATOR,
                        JAXRL_NUM_PROCESSES, JAXRL_PROCESS_ID)
  --distributed=auto    let jax detect the cluster (TPU pods, SLURM, Open MPI, GKE)
Only process 0 writes metrics, TensorBoard events and the config files; checkpoints are
written by every process together (Orbax), so the workdir must be on a shared filesystem.

Every binding is parsed and the whole config built and validated before any work starts;
a mistake is one `error: ...` line and exit status 2. A workdir holding a checkpoint is
resumed automatically: rerunning a killed command continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Optional, Sequence

from jaxrl_post import compile_cache, plugins
from jaxrl_post.errors import UserError, make_directory


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.train",
                              description="RL post-training (GRPO/PPO) of a language model.")
  p.add_argument("--gin_file", action="append", default=[], help="gin config file")
  p.add_argument("--gin_param", action="append", default=[], help="one gin binding")
  plugins.add_import_flag(p)
  p.add_argument("--workdir", default=None,
                 help="run directory (default: runs/<first gin file's name>)")
  p.add_argument("--distributed", choices=("off", "auto"), default="off",
                 help="auto: jax.distributed detects the cluster")
  p.add_argument("--coordinator_address", default=None, help="HOST:PORT of process 0")
  p.add_argument("--num_processes", type=int, default=None)
  p.add_argument("--process_id", type=int, default=None)
  compile_cache.add_cache_flag(p)
  return p


def start_distributed(args: argparse.Namespace) -> None:
  """jax.distributed from flags, else JAXRL_* environment variables; before any device use."""
  from jaxrl_post.sharding import DistributedConfig, distributed_config_from_env, initialize

  env = distributed_config_from_env()
  cfg = DistributedConfig(
      coordinator_address=args.coordinator_address or env.coordinator_address,
      num_processes=args.num_processes if args.num_processes is not None else env.num_processes,
      process_id=args.process_id if args.process_id is not None else env.process_id,
      auto=args.distributed == "auto")
  initialize(cfg)


def _jsonable(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    fields = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return {"__class__": type(value).__name__, **fields}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return repr(value)


def write_resolved_config(workdir: str, exp, gin_text: str) -> None:
  """config.gin (the bindings as parsed) and config.json (every resolved field)."""
  make_directory(workdir, "--workdir")
  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write(gin_text)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(_jsonable(exp), f, indent=2)
    f.write("\n")


def prepare(argv: Sequence[str]):
  """Parses flags and gin, builds and validates the config; (experiment, workdir)."""
  import gin

  from jaxrl_post.pipeline import config

  args = _parser().parse_args(argv)
  compile_cache.enable(args.compilation_cache)
  start_distributed(args)
  if not args.gin_file:
    raise UserError("no config: pass --gin_file=configs/<name>.gin")
  for path in args.gin_file:
    if not os.path.isfile(path):
      raise UserError(f"{path}: no such gin file")
  plugins.import_modules(args.gin_import)
  config.parse(args.gin_file, [*plugins.import_lines(args.gin_import), *args.gin_param])
  exp = config.build_experiment()
  workdir = args.workdir or os.path.join(
      "runs", os.path.splitext(os.path.basename(args.gin_file[0]))[0])
  import jax

  if jax.process_index() == 0:
    write_resolved_config(workdir, exp, gin.config_str())
  return exp, workdir


def main(argv: Optional[Sequence[str]] = None) -> int:
  try:
    exp, workdir = prepare(sys.argv[1:] if argv is None else argv)
    from jaxrl_post.pipeline.loop import run
    from jaxrl_post.pipeline.pipelined import run_class

    import jax

    quiet = jax.process_index() != 0  # One process speaks for the run.
    run(exp, workdir, log=(lambda m: None) if quiet else (lambda m: print(m, flush=True)),
        run_cls=run_class(exp))
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
