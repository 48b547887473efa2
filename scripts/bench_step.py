"""Benchmark one full GRPO step against the device's achievable FLOP/s.

  python scripts/bench_step.py [--json] [--model tiny-llama] [--batch 8x8] [--steps 5]

The step is the training command's own: `pipeline.loop.RLRun.step` (rollout engine, reward
verifier threads, group advantages, packing, the trainer's fused minibatch programs,
weight sync), built from an Experiment like `python -m jaxrl_post.train` builds it. Only
the prompts are synthetic: `--batch PxK` draws P prompts of exactly --prompt-tokens random
ids per step (K samples each), and generation ignores stop ids, so every completion has
exactly --new-tokens tokens. The reward is the arithmetic task's verifier (cheap). The
loss has a small KL term (kl_coef 0.001), so the step runs the reference forward. The
trainer takes one optimizer step on all rollouts, its packed rows holding
--sequences-per-row whole sequences (1 by default: the sequences all have one length, so
rows are full and attention spends nothing across sequences).

Workloads (--model):
  tiny-llama: vocab 1024, hidden 256, 4 layers, 4 heads / 2 KV heads, head_dim 64, MLP 768,
    untied embeddings, float32 (random weights); the default, 8x8, 32 + 64 tokens. Its
    training forward checkpoints activations with remat=dots_no_batch (--remat): the
    backward recomputes attention scores from the saved projections, whose dots count
    in flops_per_step (about 1% more than saving everything).
  smollm2-135m-instruct: the embedded SmolLM2 (its GGUF weights and tokenizer).
  llama-1b: Llama-3.2-1B's shapes (preset llama3.2-1b, random weights), for a GPU.
  micro: a 2-layer toy for smoke tests (--quick).

Keys (medians over --steps steps after --warmup steps that compile everything):
  step_s: seconds per step; phase_s: seconds per StepTimer role of the loop (rollout,
    reward, advantage, pack, train, sync) and time not in any role (waiting).
  flops_per_step, flops_per_phase: matmul FLOPs of every program the step executes, per
    call times its calls. Each program's FLOPs come from the jaxpr it was compiled from:
    dot_general FLOPs (2 x output size x contraction size), loop bodies times their trip
    counts (scan lengths; for a while loop the integer bound its condition compares
    against, an upper bound the decode loop reaches on every call but the last), shard_map
    bodies times their devices and Pallas kernels times their grid.
  xla_cost_analysis_flops_per_step: the same sum from XLA's `compiled.cost_analysis()`,
    for reference only: XLA counts a loop body once, so it undercounts the scanned layers,
    micro-batches and decode steps by their trip counts.
  achievable_flops_per_s: the best FLOP/s of a matmul microbenchmark in the compute dtype,
    run in this process before and after the steps, at the model's matrix shapes (the
    token counts of the training forward, the LM head's completion tokens, the decode
    batch) and at a large square shape; matmul_benchmark lists each shape.
  roofline_fraction, roofline_fraction_per_phase: FLOPs / seconds / (achievable FLOP/s x
    devices), for the step and each phase. Host phases (reward, pack) run no device FLOPs.
  mlp_block_flops_per_s: the best FLOP/s of the SwiGLU MLP block's forward and backward
    alone, at the training forward's token count (9 matmuls and the SwiGLU).
  roofline_ceilings: roofline fractions that parts of a phase reach when run alone, bounds
    on what the phase itself can reach on this device: rollout_decode_matmuls (one decode
    step's matmuls, each at its own shape's measured rate, nothing else taking time) and
    train_mlp_block (mlp_block_flops_per_s / achievable_flops_per_s).
  peak_flops_per_s, mfu: the device's dense peak in the compute dtype where known
    (bfloat16 on H100 / H200 / A100, telemetry.peaks) and the model FLOPs
    utilisation of the step, the rollout and the train phase against it; null elsewhere.
  host_round_trips_per_step (and per phase): device-to-host fetches in one steady-state
    step, counted by telemetry.DispatchCensus: one per jax.device_get (a whole pytree) and
    one per other read of an array's value (np.asarray, float, .tolist(), ...).
  compiled_programs_per_step: distinct compiled programs executed in that step (eager jnp
    ops included, one program each), program_executions_per_step their executions, and
    programs the list by name and phase. The census disables JAX's C++ dispatch fast path,
    so it is taken in one extra step that is not timed.
  compilations_in_timed_steps: XLA compilations during the timed steps (0: shapes fixed).
  plan (with --plan): what `python -m jaxrl_post.plan` predicts for this same workload on
    these devices (report.plan_of with the local target: a known accelerator's published
    peaks, else peaks measured here), beside the medians measured above: predicted_s and
    measured_s per device phase (rollout = prefill + decode, train, sync) and for the
    step, predicted_over_measured, the plan's roofline terms and the chip's peaks they
    divide by, flops_utilisation (the plan's FLOPs at its predicted seconds over the
    chip's bf16 peak: the MFU it expects, beside `mfu`), and host_s, the measured time of
    the phases the plan does not model (reward, advantage, pack, waiting).

On a CPU the absolute figures describe this host only (XLA's CPU matmuls, shared cores);
the ratios measured in one run (roofline fractions, counts) are what to compare.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.checkpoint import CheckpointConfig
from jaxrl_post.data.prompts import PromptConfig
from jaxrl_post.models.config import REMAT_POLICIES
from jaxrl_post.pipeline.compiles import CompileCounter
from jaxrl_post.pipeline.config import (EvalSpec, Experiment, LogSpec, ModelSpec, RolloutSpec,
                                        validate)
from jaxrl_post.pipeline.loop import RLRun
from jaxrl_post.rewards import ArithmeticTask
from jaxrl_post.rl.losses import LossConfig
from jaxrl_post.rl.optim import OptimizerConfig
from jaxrl_post.rl.sft import SftConfig
from jaxrl_post.rl.trainer import TrainerConfig
from jaxrl_post.rollout import EngineConfig
from jaxrl_post.rollout.pages import PoolConfig
from jaxrl_post.sharding import PlacementConfig, SyncConfig
from jaxrl_post.telemetry import StepTimer, peaks
from jaxrl_post.telemetry.dispatch import DispatchCensus

TINY_LLAMA = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
              "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
              "tie_word_embeddings": False, "compute_dtype": "float32",
              "param_dtype": "float32", "max_position_embeddings": 1024,
              # Backward recomputes the attention scores and elementwise ops from the
              # saved projections: on a CPU the train step writes far less memory per
              # layer and runs about 15% faster than saving every activation.
              "remat": "dots_no_batch"}
MICRO = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
         "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "tie_word_embeddings": False,
         "compute_dtype": "float32", "param_dtype": "float32", "max_position_embeddings": 128}
MODELS = {
    "tiny-llama": ModelSpec(source="tiny", tokenizer="chars", overrides=TINY_LLAMA),
    "micro": ModelSpec(source="tiny", tokenizer="chars", overrides=MICRO),
    "smollm2-135m-instruct": ModelSpec(source="smollm2-135m-instruct"),
    "llama-1b": ModelSpec(source="llama3.2-1b", tokenizer="chars"),
}
PHASES = ("rollout", "reward", "advantage", "pack", "train", "sync", "waiting")


@dataclasses.dataclass(frozen=True)
class Workload:
  model: str = "tiny-llama"
  prompts: int = 8
  samples: int = 8
  prompt_tokens: int = 32
  new_tokens: int = 64
  compute_dtype: Optional[str] = None  # None: the model's own
  devices: int = 0  # The first N devices (0: all of them), colocated.
  sequences_per_row: int = 1  # Packed row length: this many whole sequences.
  remat: Optional[str] = None  # Activation checkpointing (None: the model's own).
  micro_batches: int = 1  # Gradient-accumulation chunks of the one optimizer step.

  @property
  def rollouts(self) -> int:
    return self.prompts * self.samples

  @property
  def sequence_tokens(self) -> int:
    return self.prompt_tokens + self.new_tokens


# ---------------------------------------------------------------------------- the run


def experiment(w: Workload) -> Experiment:
  """The run's config: one optimizer step on all rollouts, rows that hold whole sequences
  (one by default: every sequence has the same length, so rows are full and attention
  computes no scores across sequences)."""
  spec = MODELS[w.model]
  for field in ("compute_dtype", "remat"):
    if getattr(w, field):
      spec = dataclasses.replace(spec, overrides={**spec.overrides, field: getattr(w, field)})
  pages = 2 * w.rollouts * math.ceil(w.sequence_tokens / 16) + 1
  # min_table_pages=1: page tables as narrow as the pages in use allow (powers of two), so
  # attention reads a block's 2 prompt pages and only the completion pages written so far
  # rather than the longest sequence's 6; it costs one more compiled decode width.
  engine = EngineConfig(num_slots=w.rollouts, group_slots=w.samples, min_table_pages=1,
                        max_seq_len=w.sequence_tokens, pool=PoolConfig(num_pages=pages))
  return validate(Experiment(
      steps=1000, seed=0, model=spec, task=ArithmeticTask(),
      prompts=PromptConfig(max_prompt_tokens=w.prompt_tokens),
      rollout=RolloutSpec(prompts_per_step=w.prompts, group_size=w.samples,
                          max_new_tokens=w.new_tokens, temperature=1.0, engine=engine),
      # A KL term, so the step has its reference forward (at kl_coef 0 there is none).
      trainer=TrainerConfig(row_tokens=w.sequences_per_row * w.sequence_tokens,
                            micro_batches=w.micro_batches,
                            loss=LossConfig(kl_coef=0.001),
                            optimizer=OptimizerConfig(learning_rate=1e-5)),
      sft=SftConfig(steps=0), eval=EvalSpec(every_n_steps=0, num_problems=1),
      placement=PlacementConfig(num_devices=w.devices),
      # The rollout's weights in the compute dtype, as the training forward uses them.
      sync=SyncConfig(rollout_dtype=spec.overrides.get("compute_dtype", "bfloat16")),
      logging=LogSpec(tensorboard=False, progress=False),
      checkpoint=CheckpointConfig(every_n_steps=1000)))


class FixedLengthPrompts:
  """Stands in for the run's PromptStream: problems from the task, prompts of exactly
  `length` random token ids (so every step has the same shapes)."""

  def __init__(self, task, length: int, low: int, high: int, seed: int = 0):
    self.split, self.length, self.low, self.high = task.split("train"), length, low, high
    self.rng = np.random.default_rng(seed)
    self.counts: dict = {}

  def next_batch(self, n: int):
    problems = [self.split[int(i)] for i in self.rng.integers(len(self.split), size=n)]
    ids = [self.rng.integers(self.low, self.high, self.length).tolist() for _ in range(n)]
    return problems, ids


def build_run(w: Workload, workdir: str) -> RLRun:
  run = RLRun(experiment(w), workdir, log=lambda message: None)
  run.start()
  tokenizer_ids = min(run.tokenizer.vocab_size, run.model_cfg.vocab_size)
  run.prompts = FixedLengthPrompts(run.task, w.prompt_tokens, 4, tokenizer_ids)
  run.sampling = dataclasses.replace(run.sampling, stop_ids=())  # exactly new_tokens
  return run


class _CensusTimer(StepTimer):
  """A StepTimer whose roles are also the census's sections."""

  def __init__(self, census: DispatchCensus):
    super().__init__()
    self._census = census

  @contextlib.contextmanager
  def role(self, name: str):
    with super().role(name), self._census.section(name):
      yield


def timed_steps(run: RLRun, warmup: int, steps: int) -> tuple[list[dict], int, int]:
  """(per-step timings, compilations in warm-up, compilations in the timed steps)."""
  timer, timings = StepTimer(), []
  with CompileCounter() as compiles:
    for step in range(1, warmup + steps + 1):
      if step == warmup + 1:
        warm = compiles.total
      timer.start()
      run.step(step, timer)
      timings.append(timer.stop())
  return timings[warmup:], warm, compiles.total - warm


def census_step(run: RLRun, step: int) -> DispatchCensus:
  with DispatchCensus() as census:
    timer = _CensusTimer(census)
    timer.start()
    run.step(step, timer)
    timer.stop()
  return census


# ---------------------------------------------------------------------------- FLOPs


def jaxpr_flops(jaxpr) -> float:
  """Matmul FLOPs of a jaxpr (or ClosedJaxpr), loop bodies times their trip counts."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  total = 0.0
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if name == "dot_general":
      (contract, _), _ = params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
    elif name == "scan":
      total += params["length"] * jaxpr_flops(params["jaxpr"])
    elif name == "while":
      trips = _while_bound(params["cond_jaxpr"])
      total += trips * (jaxpr_flops(params["body_jaxpr"]) + jaxpr_flops(params["cond_jaxpr"]))
    elif name == "cond":
      total += max(jaxpr_flops(b) for b in params["branches"])
    elif name == "pallas_call":
      total += math.prod(params["grid_mapping"].grid) * jaxpr_flops(params["jaxpr"])
    elif name == "shard_map":
      mesh = params["mesh"]
      axes = params.get("manual_axes") or mesh.axis_names
      total += math.prod(mesh.shape[a] for a in axes) * jaxpr_flops(params["jaxpr"])
    else:
      total += sum(jaxpr_flops(sub) for sub in _sub_jaxprs(params))
  return total


def _sub_jaxprs(params: dict):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
        yield item


def _while_bound(cond) -> int:
  """The largest integer literal a `lt`/`le` in the loop condition compares against (the
  loop's static bound), else 1 (the body counted once, as XLA does)."""
  bound = 1
  for eqn in getattr(cond, "jaxpr", cond).eqns:
    if eqn.primitive.name in ("lt", "le"):
      for v in eqn.invars:
        if isinstance(v, jax.extend.core.Literal) and np.issubdtype(np.asarray(v.val).dtype,
                                                                    np.integer):
          bound = max(bound, int(v.val) + (eqn.primitive.name == "le"))
  return bound


def xla_flops(executable) -> float:
  try:
    cost = executable.cost_analysis()
  except Exception:  # Some backends have no cost model.
    return 0.0
  if isinstance(cost, (list, tuple)):
    return float(sum(c.get("flops", 0.0) for c in cost if c))
  return float((cost or {}).get("flops", 0.0))


def program_table(census: DispatchCensus) -> list[dict]:
  rows = []
  for p in census.programs.values():
    flops, xla = jaxpr_flops(p.jaxpr), xla_flops(p.executable)
    for phase, calls in sorted(p.calls.items()):
      rows.append({"name": p.name, "phase": _phase(phase), "calls": calls,
                   "flops_per_call": flops, "xla_cost_analysis_flops_per_call": xla})
  return sorted(rows, key=lambda r: -r["calls"] * r["flops_per_call"])


def _phase(section: str) -> str:
  return "waiting" if section == "-" else section


# ---------------------------------------------------------------------------- matmuls


def decode_matmuls(cfg, rows: int) -> list[tuple[tuple[int, int, int], int]]:
  """((m, k, n), matmuls of that shape) of one decode step over `rows` rows: the layers'
  Q, K, V, O and MLP projections and the LM head."""
  d, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return [((rows, d, q), layers), ((rows, d, kv), 2 * layers), ((rows, q, d), layers),
          ((rows, d, f), 2 * layers), ((rows, f, d), layers), ((rows, d, v), 1)]


def matmul_shapes(cfg, w: Workload, square: int) -> list[tuple[int, int, int]]:
  """(m, k, n) of the model's matmuls at the step's token counts, and one square shape."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  train, head = w.rollouts * w.sequence_tokens, w.rollouts * w.new_tokens
  shapes = [(train, d, q), (train, d, kv), (train, q, d), (train, d, f), (train, f, d),
            (head, d, v), (head, v, d)]
  shapes += [shape for shape, _ in decode_matmuls(cfg, w.rollouts)] + [(square,) * 3]
  return list(dict.fromkeys(shapes))


def best_seconds(fn, *args, seconds: float = 0.3) -> float:
  """The fastest of repeated timed calls of a jitted fn (after one untimed call)."""
  jax.block_until_ready(fn(*args))
  best, spent = float("inf"), 0.0
  while spent < seconds or best == float("inf"):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    elapsed = time.perf_counter() - start
    best, spent = min(best, elapsed), spent + elapsed
  return best


def matmul_flops_per_s(m: int, k: int, n: int, dtype) -> float:
  """Best FLOP/s of one [m, k] x [k, n] matmul over repeated timed calls."""
  a = jax.random.normal(jax.random.key(0), (m, k), dtype)
  b = jax.random.normal(jax.random.key(1), (k, n), dtype)
  return 2.0 * m * k * n / best_seconds(jax.jit(jnp.matmul), a, b)


def mlp_block_flops_per_s(cfg, tokens: int, dtype) -> float:
  """Best FLOP/s of the SwiGLU MLP block's forward and backward (gradients of the input
  and the three weights: 3 + 6 matmuls) at the training forward's token count."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (tokens, d), dtype)
  weights = [0.05 * jax.random.normal(k, s, dtype)
             for k, s in zip(keys[1:], ((d, f), (d, f), (f, d)))]

  def block(x, gate, up, down):
    return jnp.sum((jax.nn.silu(x @ gate) * (x @ up)) @ down)

  grad = jax.jit(jax.grad(block, argnums=(0, 1, 2, 3)))
  return 9 * 2.0 * tokens * d * f / best_seconds(grad, x, *weights)


def matmul_benchmark(cfg, w: Workload, square: int) -> tuple[float, list[dict], float]:
  """(best matmul FLOP/s, one row per shape, the MLP block's FLOP/s)."""
  dtype = jnp.dtype(cfg.compute_dtype)
  rows = [{"m": m, "k": k, "n": n, "dtype": dtype.name,
           "flops_per_s": matmul_flops_per_s(m, k, n, dtype)}
          for m, k, n in matmul_shapes(cfg, w, square)]
  block = mlp_block_flops_per_s(cfg, w.rollouts * w.sequence_tokens, dtype)
  return max(r["flops_per_s"] for r in rows), rows, block


def ceilings(cfg, w: Workload, matmuls: list[dict], block: float, peak: float) -> dict:
  """Roofline fractions that parts of the phases reach run alone, as bounds on theirs.

  rollout_decode_matmuls: a decode step whose matmuls each ran at their own shape's
    measured rate, with nothing else taking time (no attention, sampling or loop).
  train_mlp_block: the SwiGLU MLP block's forward and backward at the training token
    count, the largest part of the train phase's FLOPs.
  """
  rate = {(r["m"], r["k"], r["n"]): r["flops_per_s"] for r in matmuls}
  shapes = decode_matmuls(cfg, w.rollouts)
  flops = sum(2.0 * m * k * n * count for (m, k, n), count in shapes)
  seconds = sum(2.0 * m * k * n * count / rate[(m, k, n)] for (m, k, n), count in shapes)
  return {"rollout_decode_matmuls": flops / seconds / peak, "train_mlp_block": block / peak}


# ---------------------------------------------------------------------------- report


def peak_flops_per_s(device_kind: str, compute_dtype: str) -> Optional[float]:
  """The device's dense peak FLOP/s in the compute dtype, where known (bfloat16 GPUs)."""
  if compute_dtype != "bfloat16":
    return None
  return peaks.lookup(peaks.BF16_FLOPS_PER_S, device_kind)


def model_flops_utilisation(out: dict, peak: Optional[float]) -> Optional[dict]:
  """The step's and device phases' roofline fractions rescaled from the achievable FLOP/s
  to the device's peak (None: no peak)."""
  if peak is None:
    return None
  scale = out["achievable_flops_per_s"] / peak
  per_phase = out["roofline_fraction_per_phase"]
  return {"step": out["roofline_fraction"] * scale,
          **{phase: per_phase[phase] * scale for phase in ("rollout", "train")}}


def summarise(timings: list[dict], census: DispatchCensus, peak: float, devices: int) -> dict:
  median = lambda key: statistics.median(t.get(key, 0.0) for t in timings)
  step_s = median("time/step")
  phase_s = {p: median(f"time/{p}") for p in PHASES}
  programs = program_table(census)
  flops_phase, xla_phase = collections.Counter(), collections.Counter()
  for row in programs:
    flops_phase[row["phase"]] += row["calls"] * row["flops_per_call"]
    xla_phase[row["phase"]] += row["calls"] * row["xla_cost_analysis_flops_per_call"]
  flops = sum(flops_phase.values())
  capacity = peak * devices
  fraction = lambda f, s: f / s / capacity if s > 0 else 0.0
  sections = sorted(set(census.fetches) | {s for p in census.programs.values() for s in p.calls})
  return {
      "step_s": step_s,
      "phase_s": phase_s,
      "flops_per_step": flops,
      "flops_per_phase": {p: flops_phase.get(p, 0.0) for p in PHASES},
      "xla_cost_analysis_flops_per_step": sum(xla_phase.values()),
      "achievable_flops_per_s": peak,
      "roofline_fraction": fraction(flops, step_s),
      "roofline_fraction_per_phase": {p: fraction(flops_phase.get(p, 0.0), phase_s[p])
                                      for p in PHASES},
      "host_round_trips_per_step": census.round_trips(),
      "host_round_trips_per_phase": {_phase(s): census.round_trips(s) for s in sections},
      "compiled_programs_per_step": census.distinct(),
      "program_executions_per_step": census.executions(),
      "compiled_programs_per_phase": {_phase(s): census.distinct(s) for s in sections},
      "program_executions_per_phase": {_phase(s): census.executions(s) for s in sections},
      "programs": programs,
  }


def planned_beside_measured(exp: Experiment, out: dict) -> dict:
  """The plan's prediction for `exp` on the local devices beside the measured medians of
  `out` (summarise's phase_s and step_s): the same workload, so the ratio is the
  planner's error on this device (docs/BENCHMARKS.md explains it per phase)."""
  from jaxrl_post.plan import report, targets
  target = targets.resolve("local")
  plan = report.plan_of(exp, target, targets.target_devices(target))
  p = plan.predicted_s
  predicted = {"rollout": p["prefill"] + p["decode"], "train": p["train"], "sync": p["sync"],
               "step": p["step"]}
  measured = {**{k: out["phase_s"][k] for k in ("rollout", "train", "sync")},
              "step": out["step_s"]}
  chip = {k: plan.chip[k] for k in ("name", "bf16_flops_per_s", "hbm_bytes_per_s")}
  return {"chip": chip, "predicted_s": predicted, "measured_s": measured,
          "predicted_over_measured": {k: predicted[k] / measured[k] if measured[k] > 0
                                      else None for k in predicted},
          "roofline_s": plan.roofline_s,
          "flops_utilisation": plan.flops_utilisation,
          "host_s": sum(out["phase_s"][k] for k in ("reward", "advantage", "pack", "waiting"))}


def run(args) -> dict[str, Any]:
  w = workload(args)
  with tempfile.TemporaryDirectory() as workdir:
    rl = build_run(w, workdir)
    try:
      # The matmuls run before and after the steps and the best counts: on a shared host
      # the load changes while the benchmark runs.
      before = matmul_benchmark(rl.model_cfg, w, args.square)
      timings, warm_compiles, timed_compiles = timed_steps(rl, args.warmup, args.steps)
      census = census_step(rl, args.warmup + args.steps + 1)
      trajectories = w.rollouts
      model_cfg = rl.model_cfg
    finally:
      rl.close()
  after = matmul_benchmark(model_cfg, w, args.square)
  matmuls = [max(a, b, key=lambda r: r["flops_per_s"]) for a, b in zip(before[1], after[1])]
  peak = max(before[0], after[0])
  devices = w.devices or jax.device_count()
  out = summarise(timings, census, peak, devices)
  out["matmul_benchmark"] = matmuls
  out["mlp_block_flops_per_s"] = max(before[2], after[2])
  out["roofline_ceilings"] = ceilings(model_cfg, w, matmuls, out["mlp_block_flops_per_s"], peak)
  out["compilations_in_warmup"] = warm_compiles
  out["compilations_in_timed_steps"] = timed_compiles
  out["workload"] = {**dataclasses.asdict(w), "rollouts": trajectories,
                     "optimizer_steps": 1, "params": model_cfg.num_params,
                     "remat": model_cfg.remat, "train_tokens": trajectories * w.sequence_tokens,
                     "compute_dtype": model_cfg.compute_dtype, "steps": args.steps,
                     "warmup": args.warmup}
  out["device"] = jax.devices()[0].device_kind
  out["devices"] = devices
  out["peak_flops_per_s"] = peak_flops_per_s(out["device"], model_cfg.compute_dtype)
  out["mfu"] = model_flops_utilisation(out, out["peak_flops_per_s"])
  out["backend"] = jax.default_backend()
  out["jax"] = jax.__version__
  out["date"] = datetime.date.today().isoformat()
  if args.plan:  # After the run, its memory freed: the plan compiles the programs again.
    out["plan"] = planned_beside_measured(experiment(w), out)
  return out


def workload(args) -> Workload:
  prompts, samples = (int(x) for x in args.batch.lower().split("x"))
  if args.quick:
    return Workload("micro", prompts=2, samples=2, prompt_tokens=8, new_tokens=8,
                    compute_dtype=args.compute_dtype, devices=args.devices,
                    sequences_per_row=args.sequences_per_row, remat=args.remat,
                    micro_batches=args.micro_batches)
  return Workload(args.model, prompts, samples, args.prompt_tokens, args.new_tokens,
                  args.compute_dtype, args.devices, args.sequences_per_row, args.remat,
                  args.micro_batches)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--model", default="tiny-llama", choices=sorted(MODELS))
  p.add_argument("--batch", default="8x8", help="prompts x samples per prompt")
  p.add_argument("--prompt-tokens", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--compute-dtype", default=None, help="override the model's compute dtype")
  p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
  p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation)")
  p.add_argument("--square", type=int, default=2048, help="the square matmul's size")
  p.add_argument("--devices", type=int, default=0, help="use the first N devices (0: all)")
  p.add_argument("--sequences-per-row", type=int, default=1,
                 help="whole sequences per packed row (TrainerConfig.row_tokens)")
  p.add_argument("--micro-batches", type=int, default=1,
                 help="gradient-accumulation chunks of the optimizer step (TrainerConfig."
                      "micro_batches): an RL-sized minibatch's activations in pieces")
  p.add_argument("--remat", default=None, choices=REMAT_POLICIES,
                 help="activation checkpointing of the training forward (default: the "
                      "model's: dots_no_batch for tiny-llama, none for the others)")
  p.add_argument("--plan", action="store_true",
                 help="add the planner's predicted phases for this workload beside the "
                      "measured ones (compiles the plan's programs after the run)")
  p.add_argument("--quick", action="store_true",
                 help="the micro model, 2x2 prompts, 8 + 8 tokens: a smoke run")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if args.quick:
    args.square = min(args.square, 256)
  result = run(args)
  if args.json:
    print(json.dumps(result))
  else:
    for key, value in result.items():
      print(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
