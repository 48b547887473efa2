"""What the loop records about each step besides its own metrics: the role timeline, a
profiler window, device memory, throughput and utilisation, and alarms.

The loop calls `begin(step)` before a step and merges `end(step, timer, metrics)` into the
step's metrics before writing them; everything else is here, so the step's data path in
loop.py stays as it is. Metrics added (per step):

  train/tokens_per_s              prompt + completion tokens trained / time/train
  perf/train_flops                model FLOPs of the step's training: (6 + 2 with a reference
                                  forward) x matmul parameters x tokens trained (attention
                                  scores not counted)
  perf/train_mfu                  perf/train_flops / time/train / (device peak x devices),
                                  the peak from telemetry.peaks (bf16 models on a listed
                                  device); elsewhere the FLOP/s of a matmul measured at the
                                  start, and the name says so:
                                  perf/train_mfu_vs_cpu_measured_matmul on the CPU
  perf/decode_hbm_util            the bytes the decode calls must read (each device's rollout
                                  weights once per decode step, plus the KV pages each step
                                  attends over) / decode time / (HBM bandwidth x rollout
                                  devices; the host's measured bandwidth on the CPU); decode
                                  time is the rollout role less its prefill calls, so host
                                  scheduling counts against it (a lower bound). Named
                                  ..._vs_cpu_measured_copy against a measured bandwidth.
  memory/<role>/peak_bytes,       device memory (most loaded local device) where the backend
  memory/peak_bytes_in_use        reports it; nothing on the CPU
  memory/train_program/*_bytes    the train step's compiled memory analysis per device
                                  (arguments, outputs, XLA temporaries, peak), compiled once
                                  at the start on abstract inputs at the longest completion
  alarm/<name>                    1 while an alarm holds (telemetry.alarms)
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Optional

import jax

from jaxrl_post.telemetry import read_metrics
from jaxrl_post.telemetry.alarms import AlarmMonitor
from jaxrl_post.telemetry.profile import ProfileWindow
from jaxrl_post.telemetry.resources import DeviceRates, MemorySampler
from jaxrl_post.telemetry.trace import TraceWriter, instrument
from jaxrl_post.telemetry.writers import METRICS_FILE


class RunTelemetry:
  """Per-step telemetry of one RLRun (process 0 writes the files; every process profiles)."""

  def __init__(self, run_, workdir: str, start_step: int, log: Callable[[str], None] = print,
               writes: bool = True):
    exp, self.run_, self.log = run_.exp, run_, log
    spec = exp.profile
    self.profile = ProfileWindow(spec, workdir, log)
    self.trace = TraceWriter(workdir) if spec.trace and writes else None
    if self.trace is not None:
      self.trace.truncate_after(start_step)
    local = [d for d in run_.meshes.trainer.devices.flat
             if d.process_index == jax.process_index()]
    self.memory = MemorySampler(local, spec.memory_poll_s)
    first = run_.meshes.trainer.devices.flat[0]
    self.rates = DeviceRates(first.device_kind, first.platform, run_.model_cfg.compute_dtype)
    self.train_devices = 1 if first.platform == "cpu" else run_.meshes.trainer.devices.size
    self.decode = _DecodeCounter(run_)
    self.alarms = AlarmMonitor(exp.alarms, log=self._alarm_log)
    self._replay(workdir, start_step)
    # Like the memory stats, only where device memory is what bounds the run: on the CPU
    # the analysis would trace and lower a second train step for it (6 of a short run's
    # 41 s, with every program already in the compilation cache).
    self.compiled = {} if first.platform == "cpu" else _train_program_memory(run_)
    self._undo = []
    if self.trace is not None and spec.trace_calls:
      engine = run_.engine
      self._undo.append(instrument(engine, ["prefill_batch", "generate", "launch", "collect"],
                                   self.trace, cat="rollout"))
      self._undo.append(instrument(run_, ["evaluate", "save"], self.trace, cat="run"))

  def begin(self, step: int) -> None:
    self.profile.before(step)
    if self.trace is not None:
      self.trace.step = step
    self.decode.reset()
    self.memory.start()

  def end(self, step: int, timer, metrics: dict[str, Any]) -> dict[str, Any]:
    """The step's telemetry metrics (`metrics`: what the loop has for the step so far)."""
    out = self.memory.stop(timer.spans)
    if self.trace is not None:
      self.trace.step_timeline(step, timer.step_span, timer.spans)
    out.update(self.compiled)
    out.update(self._throughput(metrics))
    out.update(self.alarms.update(step, {**metrics, **out}))
    self.profile.after(step)
    return out

  def close(self) -> None:
    self.profile.close()
    for undo in self._undo:
      undo()
    if self.trace is not None:
      self.trace.close()

  # ------------------------------------------------------------------ pieces

  def _throughput(self, m: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    seconds, tokens = m.get("time/train", 0.0), m.get("train/tokens", 0)
    if seconds > 0 and tokens:
      flops = _flops_per_token(self.run_) * tokens
      out["train/tokens_per_s"] = tokens / seconds
      out["perf/train_flops"] = flops
      name = self.rates.metric("perf/train_mfu", self.rates.flops_label)
      out[name] = flops / seconds / (self.rates.flops_per_s * self.train_devices)
    decode_s = m.get("time/rollout", 0.0) - self.decode.prefill_s
    if decode_s > 0 and self.decode.bytes:
      devices = 1 if self.decode.cpu else self.decode.devices
      name = self.rates.metric("perf/decode_hbm_util", self.rates.bytes_label)
      out[name] = self.decode.bytes / decode_s / (self.rates.bytes_per_s * devices)
      out["perf/decode_bytes"] = float(self.decode.bytes)
    return out

  def _alarm_log(self, message: str) -> None:
    self.log(message)
    if self.trace is not None:
      self.trace.instant(message.split(":", 1)[-1].strip().split(" at step")[0])

  def _replay(self, workdir: str, step: int) -> None:
    """Running medians and evaluations of a resumed run, from the lines it kept (silent)."""
    path = os.path.join(workdir, METRICS_FILE)
    if step <= 0 or not os.path.exists(path):
      return
    for record in read_metrics(path):
      if 0 < record.get("step", 0) <= step:
        self.alarms.update(record["step"], record, quiet=True)
      elif record.get("step") == 0:
        self.alarms.update(0, record, quiet=True)


class _DecodeCounter:
  """Bytes the step's decode calls read, and the seconds its prefill calls took, counted by
  wrapping the engine's methods (evaluation's calls are left out)."""

  def __init__(self, run_):
    engine = self.engine = run_.engine
    self.steps = engine.config.decode_steps
    mesh = run_.meshes.rollout
    self.devices, self.cpu = mesh.devices.size, mesh.devices.flat[0].platform == "cpu"
    pages = sum(a.num_pages for a in engine.allocs)
    self.page_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.pool)) / max(pages, 1)
    # Every device reads its own copy or shard of the weights each decode step (replicas
    # included), so the weights count once per device.
    self.weight_bytes = self.devices * sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x in jax.tree.leaves(engine.params))
    self.counting = True
    self.reset()
    launch, prefill, evaluate = engine.launch, engine.prefill_batch, run_.evaluate

    def counted_launch(*args, **kwargs):
      if self.counting:
        cascade, paged = engine.attention_reads()
        self.bytes += self.steps * (self.weight_bytes + (cascade if engine.cascade else paged)
                                    * self.page_bytes)
      return launch(*args, **kwargs)

    def timed_prefill(*args, **kwargs):
      begin = time.perf_counter()
      try:
        return prefill(*args, **kwargs)
      finally:
        if self.counting:
          self.prefill_s += time.perf_counter() - begin

    def uncounted_evaluate(*args, **kwargs):
      self.counting = False
      try:
        return evaluate(*args, **kwargs)
      finally:
        self.counting = True

    engine.launch, engine.prefill_batch = counted_launch, timed_prefill
    run_.evaluate = uncounted_evaluate

  def reset(self) -> None:
    self.bytes, self.prefill_s = 0.0, 0.0


def _flops_per_token(run_) -> float:
  """Dense matmul FLOPs per trained token: 6 per parameter (forward and backward), 2 more
  with the reference forward; the input embedding is a lookup, not a matmul, and of a
  MoE layer's experts only the k a token goes through count."""
  cfg = run_.model_cfg
  params = cfg.num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
  if cfg.moe is not None:  # A token runs through k experts, not all E.
    idle = cfg.moe.num_experts - cfg.moe.experts_per_token
    params -= cfg.num_layers * idle * 3 * cfg.hidden_size * cfg.moe.intermediate_size
  reference = run_.exp.trainer.loss.kl_coef > 0
  return (6 + 2 * reference) * params


def _train_program_memory(run_) -> dict[str, float]:
  """memory/train_program/* of the train step compiled on abstract inputs (the shapes the
  KV pool is sized beside), per device; {} where it cannot be compiled here."""
  try:
    step = run_.train_step_plan()  # Compiled already where it sized the KV pool.
  except Exception as e:  # Telemetry never stops a run.
    run_.log(f"warning: the train program's memory analysis failed: {type(e).__name__}: {e}")
    return {}
  c = step.compiled
  return {"memory/train_program/argument_bytes": float(c.argument_bytes),
          "memory/train_program/output_bytes": float(c.output_bytes),
          "memory/train_program/temp_bytes": float(c.temp_bytes),
          "memory/train_program/peak_bytes": float(step.peak_bytes)}


def write_report(workdir: str, log: Callable[[str], None]) -> Optional[str]:
  """Writes `<workdir>/report.html` and logs its path (None, with a warning, on failure)."""
  from jaxrl_post import report

  try:
    path = report.write(workdir)
  except Exception as e:  # A report is never worth failing a finished run for.
    log(f"warning: no report: {type(e).__name__}: {e}")
    return None
  log(f"report: {path}")
  return path
