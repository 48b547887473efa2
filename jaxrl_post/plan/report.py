"""The plan's verdict: memory per device, predicted seconds per role, bytes on the wire.

Every figure is per device. Times are rooflines: a program takes at least its FLOPs over
the chip's peak and at least its memory bytes over the HBM bandwidth (plan.hlo_cost counts
both with loops at their trip counts), and as its kernels run one after another, at least
the sum of each kernel's own roofline (`serial_seconds`: a train step's compute-bound
matmuls and memory-bound fusions do not overlap); its collective bytes cross the
chip-to-chip links, an asynchronous collective's behind the kernels scheduled while it
runs (`exposed_collective_seconds`). The prediction is the largest of the first three
plus the fourth. On a
GPU each kernel a program launches adds the chip's kernel_s besides (a decode step
launches hundreds of small ones, a train step thousands).
Decode is predicted with the KV its attention kernels read over a rollout (each row's
pages up to its length, `decode_as_run`), not the whole page tables the compiled
program declares for every step.
Measured steps run slower by what this leaves out (host work, imperfect overlap, kernels
short of the peaks), which docs/BENCHMARKS.md records against real runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from jaxrl_post import cuda_plugin
from jaxrl_post.errors import UserError
from jaxrl_post.plan.hlo_cost import ProgramCost
from jaxrl_post.plan.memory import GB, CompiledMemory, kv_head_shards, rollout_bytes
from jaxrl_post.plan.programs import Programs, compile_programs, local_chip_memory
from jaxrl_post.plan.targets import (Chip, Devices, Target, chip_of_kind, measured_peaks,
                                    per_device)
from jaxrl_post.rollout.layout import batch_shards
from jaxrl_post.rollout.pages import (pool_page_bytes, pool_pages, window_layers,
                                      window_share)

PAYLOAD_BYTES_PER_TOKEN = 12  # token id, behaviour logprob, weight version (4 bytes each)


@dataclasses.dataclass(frozen=True)
class Plan:
  target: str
  devices: int
  compiled_for: str
  chip: dict
  fits: bool
  peak_gb_per_device: float
  memory_gb: dict  # program -> {argument, temp, output, alias, peak}
  resident_gb: dict  # train_state, reference, rollout_weights (+ _in_flight), kv_pool
  kv_pages: int
  kv_tokens: int
  kv_tokens_needed: int
  attention_backends: dict  # program -> implementation
  predicted_s: dict  # prefill, decode, train, sync, step
  roofline_s: dict  # role -> {compute, memory, serial, kernels, collective}: predicted_s's terms
  flops: dict  # program -> FLOPs per device per step
  # prefill, decode, train, step -> their FLOPs (recomputation included) at the predicted
  # seconds, over the chip's bf16 peak: the utilisation the plan expects
  flops_utilisation: dict
  hbm_bytes: dict  # program -> memory bytes per device per step
  sync_bytes: int
  grad_bytes_per_rank: int  # the train phase's collectives (updates, old-policy forwards)
  rollout_payload_bytes: int
  decode_bytes_vs_floor: float
  decode_kernels_per_step: dict  # total, per_layer, by_kind (plan.hlo_cost.loop_launches)
  # program -> the functions whose ops move most of its bytes (plan.hlo_sources)
  bytes_by_source: dict
  largest_buffers: list
  notes: list

  def as_json(self) -> dict:
    return dataclasses.asdict(self)


def _terms(cost: ProgramCost, chip: Chip, calls: float, launches: float = 0.0) -> dict:
  """A program's roofline terms over a step: compute, memory, serial (its kernels one
  after another, each at its own roofline: serial_seconds), kernel overhead (`launches`
  kernels per call) and collective seconds."""
  return {"compute": calls * cost.flops / chip.bf16_flops_per_s,
          "memory": calls * cost.bytes / chip.hbm_bytes_per_s,
          "serial": calls * serial_seconds(cost, chip),
          "kernels": calls * launches * chip.kernel_s,
          "collective": calls * exposed_collective_seconds(cost, chip)}


def serial_seconds(cost: ProgramCost, chip: Chip) -> float:
  """One call's kernels run one after another, each taking the longer of its FLOPs at the
  peak and its bytes at the bandwidth: at least the larger of the program's compute and
  memory terms, and more where compute-bound matmuls alternate with memory-bound fusions
  (a train step). Bytes the totals have and the kernels do not (decode_as_run's unread
  pages, taken off the totals) count at the bandwidth, as the memory-bound reads they are.
  Without a kernel list (a cost not read from a program): the larger term."""
  if not cost.launched:
    return max(cost.flops / chip.bf16_flops_per_s, cost.bytes / chip.hbm_bytes_per_s)
  unlisted = cost.bytes - sum(n * b for _, b, n in cost.launched)
  return _kernels_seconds(cost.launched, chip) + unlisted / chip.hbm_bytes_per_s


def _kernels_seconds(kernels, chip: Chip) -> float:
  """(FLOPs, bytes, launches) kernels run one after another, each at its own roofline."""
  flops, bw = chip.bf16_flops_per_s, chip.hbm_bytes_per_s
  return sum(n * max(f / flops, b / bw) for f, b, n in kernels)


def exposed_collective_seconds(cost: ProgramCost, chip: Chip) -> float:
  """One call's collective time that its kernels do not hide: an asynchronous collective
  moves its bytes over the links while the kernels scheduled between its start and its
  done run (XLA's latency-hiding scheduler places them there: an FSDP step's weight
  gathers run a layer ahead), so only what outlasts them counts; a synchronous one counts
  whole."""
  link = chip.link_bytes_per_s
  exposed = cost.collective_bytes / link
  for collective_bytes, starts, cover in cost.overlapped:
    exposed -= starts * min(collective_bytes / link, _kernels_seconds(cover, chip))
  return exposed


def _seconds(terms: dict) -> float:
  return (max(terms["compute"], terms["memory"], terms["serial"]) + terms["kernels"] +
          terms["collective"])


def predicted_seconds(cost: ProgramCost, chip: Chip, launches: float = 0.0) -> float:
  """One call of a program of `cost` launching `launches` kernels, as the plan predicts it."""
  return _seconds(_terms(cost, chip, 1.0, launches))


def _backend(mem: CompiledMemory, fallback: str) -> str:
  attention = [k for k in mem.kernels if "attention" in k or "splash" in k or "mha" in k]
  return ", ".join(attention) if attention else fallback


@dataclasses.dataclass(frozen=True)
class _Memory:
  """Per device: the peak of each phase of a step, and the KV pool beside the rest."""

  phases: dict  # phase -> bytes held while it runs
  in_flight_bytes: int  # rollout weight versions an asynchronous run holds beside its one
  kv_per_token: int
  kv_pages: int  # pages of the pool that fit
  kv_needed: int  # tokens the slots need at the longest sequence
  kv_bytes: int  # the pool those tokens take


def _memory_plan(p: Programs, exp, capacity: Optional[float]) -> _Memory:
  """What each phase holds at once. Colocated, the train state and reference stay
  resident while the engine runs, and the rollout weights and pool while training does.
  An asynchronous run holds up to lag + 1 more rollout weight versions through every
  phase (pipelined.versions_in_flight), on the rollout's devices.

  The pool is what the run allocates: rollout.pages.pool_pages on the memory free once
  the state and the rollout weights are in place, the train step's transient memory and
  the versions in flight left aside (capacity None: a device without memory stats, which
  takes the fallback budget).
  """
  from jaxrl_post.pipeline.pipelined import versions_in_flight  # (pipeline imports plan)

  s, cfg, train = p.shapes, p.model, p.train
  tensor, data = p.meshes.rollout.shape["tensor"], batch_shards(p.meshes.rollout)
  kv_dtype = exp.rollout.engine.pool_dtype(cfg)
  kv_shards = kv_head_shards(cfg, tensor)
  # A window pool (Gemma 3's sliding layers) holds about a window per sequence: its share
  # of a token's bytes, as the engine sizes it (rollout.pages.window_share).
  share = window_share(cfg, s.page_size, s.table_pages, p.decode_steps)
  kv_per_token = int(pool_page_bytes(cfg, 1, kv_dtype, share)) // kv_shards
  # Cascade blocks hold (and a step reads) their prompt's whole pages once.
  blocks = s.num_slots // s.group_slots if s.group_slots else 0
  kv_needed = (s.num_slots * (s.table_pages - s.shared_pages) +
               blocks * s.shared_pages) // data * s.page_size
  kv_bytes = (kv_needed + s.page_size) * kv_per_token  # the sink page too
  colocated = p.meshes.colocated
  in_flight = versions_in_flight(exp) * rollout_bytes(cfg, p.meshes.rollout,
                                                      exp.sync.rollout_dtype)
  resident = train.resident_bytes if colocated else 0
  free = None if capacity is None else capacity - resident - p.rollout_weight_bytes
  try:
    kv_pages = pool_pages(exp.rollout.engine.pool, cfg, kv_dtype, free, kv_shards=kv_shards,
                          data_shards=data, reserved_bytes=in_flight +
                          (train.transient_bytes if colocated else 0), window=share)
  except UserError:  # Fewer than two pages fit: the verdict says so.
    kv_pages = 0
  other = resident + in_flight
  beside_train = p.rollout_weight_bytes + kv_bytes + in_flight if colocated else 0
  phases = {
      "train": train.peak_bytes + beside_train,
      "prefill": p.prefill.peak_bytes + other,
      "decode": p.decode.peak_bytes + other,
      "sync": p.sync.peak_bytes + (train.opt_state_bytes + train.reference_bytes + kv_bytes
                                   + in_flight if colocated else 0),
  }
  return _Memory(phases, in_flight, kv_per_token, kv_pages, kv_needed, kv_bytes)


def decode_as_run(p: Programs, exp) -> ProgramCost:
  """One decode call's cost over a rollout, as its attention kernels read. The compiled
  program's kernels declare every row's whole page table read each step (that is the
  floor decode_bytes_vs_floor compares with); a row's context grows from its prompt to
  the longest over the rollout, and the kernels read only the pages a row has reached,
  so a step reads on average (its completion's steps averaged, every row running to the
  longest) this much less of the global layers' KV, and computes as much less attention.
  The jnp gather (no kernel in the program: a CPU) reads its whole table: left as
  compiled. Windowed layers read about a window each step: left as compiled too."""
  cost, s, cfg = p.decode.cost, p.shapes, p.model
  if not any("attention" in k for k in p.decode.kernels):
    return cost
  prompt = exp.prompts.max_prompt_tokens
  end = min(s.table_pages * s.page_size, prompt + exp.rollout.max_new_tokens)
  reached = [-(-tokens // s.page_size) for tokens in range(prompt + 1, end + 1)]
  unread = s.table_pages - sum(reached) / max(len(reached), 1)  # pages per row per step
  if unread <= 0:
    return cost
  tensor = p.meshes.rollout.shape["tensor"]
  kv_dtype = exp.rollout.engine.pool_dtype(cfg)
  rows = s.num_slots // batch_shards(p.meshes.rollout)
  tokens = rows * unread * s.page_size * p.decode_steps
  global_layers = cfg.num_layers - window_layers(cfg)
  kv_bytes = pool_page_bytes(cfg, 1, kv_dtype, share=0.0) / kv_head_shards(cfg, tensor)
  flops = 4 * cfg.num_heads / tensor * cfg.head_dim * global_layers
  return dataclasses.replace(cost, bytes=cost.bytes - tokens * kv_bytes,
                             flops=cost.flops - tokens * flops)


def _runs(p: Programs, exp, decode: ProgramCost) -> dict:
  """role -> [(cost, calls per step, kernels launched per call)] of the programs it runs
  (`decode`: decode_as_run's cost)."""
  s, r, n = p.shapes, exp.rollout, exp.trainer.minibatches
  data_shards = batch_shards(p.meshes.rollout)
  prompt_tokens = r.prompts_per_step * exp.prompts.max_prompt_tokens
  prefills = math.ceil(prompt_tokens / (data_shards * s.prefill_rows * s.prefill_width))
  decodes = math.ceil(s.samples / s.num_slots) * math.ceil(r.max_new_tokens / p.decode_steps)
  train = [(p.train_filled.cost, n)]
  if p.old_policy is not None:  # Each later minibatch's old policy: a forward first.
    train.append((p.old_policy.cost, n - 1))
  runs = {"prefill": [(p.prefill.cost, prefills)], "decode": [(decode, decodes)],
          "train": train, "sync": [(p.sync.cost, 1.0 / exp.sync.every_n_steps)]}
  return {role: [(cost, calls, cost.launches) for cost, calls in programs]
          for role, programs in runs.items()}


def _roofline(runs: dict, chip: Chip) -> dict:
  """role -> the roofline terms (`_terms`) of each of its programs on `chip` over a step."""
  return {role: [_terms(cost, chip, n, launches) for cost, n, launches in programs]
          for role, programs in runs.items()}


def _per_step_total(programs: list, field: str) -> float:
  """A role's `field` (flops, bytes) over a step: each program's times its calls."""
  return sum(getattr(cost, field) * n for cost, n, _ in programs)


def build(programs: Programs, target: Target, chip: Chip, exp, devices: int,
          compiled_for: str = "target", memory_stats: bool = True) -> Plan:
  """The Plan of compiled `programs` on `chip` (per device: a chip or a share of one)."""
  p, s, train = programs, programs.shapes, programs.train
  mem = _memory_plan(p, exp, chip.hbm_bytes if memory_stats else None)
  peak = max(mem.phases.values())
  fits = peak <= chip.hbm_bytes and mem.kv_pages * s.page_size >= mem.kv_needed
  decode = decode_as_run(p, exp)
  runs = _runs(p, exp, decode)
  per_program = _roofline(runs, chip)
  # Each program's own roofline, then their sum: a compute-bound update and a
  # memory-bound forward do not overlap.
  predicted = {role: sum(map(_seconds, terms)) for role, terms in per_program.items()}
  predicted["step"] = sum(predicted.values())
  roles = ("prefill", "decode", "train")
  flops = {role: _per_step_total(runs[role], "flops") for role in roles}
  floor = p.decode_weight_bytes + mem.kv_needed * mem.kv_per_token
  gb = lambda x: round(x / GB, 3)
  return Plan(
      target=target.name, devices=devices, compiled_for=compiled_for,
      chip=dataclasses.asdict(chip), fits=bool(fits), peak_gb_per_device=gb(peak),
      memory_gb={name: _memory(m) for name, m in (
          ("train", train.compiled), ("prefill", p.prefill), ("decode", p.decode),
          ("sync", p.sync))},
      resident_gb={"train_state": gb(train.params_bytes + train.frozen_bytes +
                                     train.opt_state_bytes),
                   "reference": gb(train.reference_bytes),
                   "rollout_weights": gb(p.rollout_weight_bytes),
                   "rollout_weights_in_flight": gb(mem.in_flight_bytes),
                   "kv_pool": gb(mem.kv_bytes),
                   "peak_by_phase": {k: gb(v) for k, v in mem.phases.items()}},
      kv_pages=int(mem.kv_pages), kv_tokens=int(mem.kv_pages * s.page_size),
      kv_tokens_needed=int(mem.kv_needed),
      attention_backends={
          "train": _backend(train.compiled, "masked softmax (jnp)"),
          "prefill": _backend(p.prefill, "paged gather (jnp)"),
          "decode": _backend(p.decode, "paged gather (jnp)")},
      predicted_s={k: round(v, 4) for k, v in predicted.items()},
      roofline_s={role: {k: round(sum(t[k] for t in terms), 4) for k in terms[0]}
                  for role, terms in per_program.items()},
      flops=flops,
      flops_utilisation=_utilisation(flops, predicted, chip),
      hbm_bytes={**{role: _per_step_total(runs[role], "bytes") for role in roles},
                 "sync": p.sync.cost.bytes},
      sync_bytes=int(p.sync_bytes),
      grad_bytes_per_rank=int(_per_step_total(runs["train"], "collective_bytes")),
      rollout_payload_bytes=int(s.samples * exp.rollout.max_new_tokens *
                                PAYLOAD_BYTES_PER_TOKEN),
      decode_bytes_vs_floor=round(p.decode.cost.bytes / p.decode_steps / floor, 3),
      decode_kernels_per_step=_per_step(p.decode.launches, p.model.num_layers),
      bytes_by_source={"train": list(p.train_filled.sources), "decode": list(p.decode.sources)},
      largest_buffers=[] if fits else [{"bytes": a.bytes, "values": a.values}
                                       for a in train.largest[:5]],
      notes=_notes(p, target, compiled_for))


def _utilisation(flops: dict, predicted: dict, chip: Chip) -> dict:
  """Role (and the step) -> its FLOPs over the predicted seconds at the bf16 peak."""
  flops = {**flops, "step": sum(flops.values())}
  return {role: round(f / predicted[role] / chip.bf16_flops_per_s, 4) if predicted[role] > 0
          else 0.0 for role, f in flops.items()}


def _per_step(launches, layers: int) -> dict:
  """The decode loop's launches per step, and per layer: a step is layers x a handful of
  kernels plus the sampling; each launch costs microseconds whatever it computes."""
  if not launches:
    return {}
  return {"total": launches["total"], "per_layer": round(launches["total"] / layers, 1),
          "by_kind": launches["by_kind"], "flag_reads": launches["flag_reads"]}


def _memory(mem: CompiledMemory) -> dict:
  gb = lambda x: round(x / GB, 3)
  return {"argument": gb(mem.argument_bytes), "temp": gb(mem.temp_bytes),
          "output": gb(mem.output_bytes), "alias": gb(mem.alias_bytes),
          "peak": gb(mem.peak_bytes)}


def _notes(p: Programs, target: Target, compiled_for: str) -> list:
  notes = []
  if compiled_for != "target":
    notes.append(f"programs compiled for the {compiled_for}; memory and peaks are the "
                 f"{target.chip.name}'s")
  if target.chip is not None and target.chip.platform == "gpu":
    notes.append(f"memory per GPU: the {cuda_plugin.gpu_memory_share():.2f} of it jax's allocator "
                 "holds in a run (XLA_PYTHON_CLIENT_MEM_FRACTION, which jaxrl_post sets to "
                 f"{cuda_plugin.GPU_MEMORY_SHARE} unless you do)")
  for name, mem in (("train", p.train.compiled), ("prefill", p.prefill), ("decode", p.decode)):
    if mem.cost.unknown_loops:
      notes.append(f"{name}: {len(mem.cost.unknown_loops)} loop(s) without a constant trip "
                   "count were counted once")
  return notes


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype), 2)


def text(plan: Plan) -> str:
  """The human-readable report."""
  lines = [f"plan for {plan.target}: {plan.devices} device(s), compiled for "
           f"{plan.compiled_for}",
           f"verdict: {'fits' if plan.fits else 'does NOT fit'}: peak "
           f"{plan.peak_gb_per_device:.2f} GB of {plan.chip['hbm_bytes'] / GB:.1f} GB per device",
           "memory per program (GB per device):"]
  for name, m in plan.memory_gb.items():
    lines.append(f"  {name:8s} args {m['argument']:8.3f}  temp {m['temp']:8.3f}  "
                 f"out {m['output']:8.3f}  alias {m['alias']:8.3f}  peak {m['peak']:8.3f}")
  r = plan.resident_gb
  in_flight = (f" (+ {r['rollout_weights_in_flight']:.2f} GB of versions in flight)"
               if r["rollout_weights_in_flight"] else "")
  lines.append(f"resident: train state {r['train_state']:.2f} GB, reference "
               f"{r['reference']:.2f} GB, rollout weights {r['rollout_weights']:.2f} GB"
               f"{in_flight}, KV pool {r['kv_pool']:.2f} GB")
  short = ""
  if plan.kv_tokens < plan.kv_tokens_needed:
    short = (f": short, the pool holds {plan.kv_tokens / plan.kv_tokens_needed:.0%} of the "
             "slots' sequences at their longest (--fit sizes the slots to it)")
  lines.append(f"kv: {plan.kv_pages} pages ({plan.kv_tokens} tokens) fit per data shard; "
               f"the slots need {plan.kv_tokens_needed} tokens{short}")
  lines.append("attention: " + "; ".join(f"{k}: {v}" for k, v in
                                          plan.attention_backends.items()))
  t = plan.predicted_s
  lines.append(f"predicted step {t['step']:.3f} s = prefill {t['prefill']:.3f} + decode "
               f"{t['decode']:.3f} + train {t['train']:.3f} + sync {t['sync']:.3f}")
  for role in ("decode", "train"):
    r = plan.roofline_s[role]
    lines.append(f"  {role}: compute {r['compute']:.3f} s, memory {r['memory']:.3f} s, kernels "
                 f"in turn {r['serial']:.3f} s + launches {r['kernels']:.3f} s, collectives "
                 f"{r['collective']:.3f} s; {plan.flops_utilisation[role]:.0%} of the bf16 "
                 "peak")
  lines.append(f"wire per step: sync {plan.sync_bytes / GB:.3f} GB, gradient collectives "
               f"{plan.grad_bytes_per_rank / GB:.3f} GB per rank, rollout payload "
               f"{plan.rollout_payload_bytes / 1e6:.2f} MB")
  lines.append(f"decode bytes vs floor: {plan.decode_bytes_vs_floor:.2f}")
  if plan.decode_kernels_per_step:
    k = plan.decode_kernels_per_step
    cost = plan.roofline_s["decode"]["kernels"]
    paid = (f"; {cost:.3f} s of the decode's at {plan.chip['kernel_s'] * 1e6:g} us each"
            if cost else "")
    lines.append(f"decode kernels per step: {k['total']:.0f} ({k['per_layer']} per layer, "
                 f"{k['flag_reads']:.0f} control flags read back{paid})")
  for role, sources in plan.bytes_by_source.items():
    if sources:
      lines.append(f"{role} bytes by source: " + "; ".join(
          f"{s['source']} {s['share']:.0%}" for s in sources[:5]))
  for buf in plan.largest_buffers:
    lines.append(f"  largest: {buf['bytes'] / GB:.3f} GB {buf['values']}")
  lines.extend(f"note: {n}" for n in plan.notes)
  return "\n".join(lines)


def run_devices(exp, found: Devices) -> list:
  """The devices of `found` (targets.target_devices) a run of `exp` uses: its placement's
  num_devices first ones, or all of them."""
  devices = found.devices
  return devices[:exp.placement.num_devices] if exp.placement.num_devices else devices


def plan_of(exp, target: Target, found: Devices) -> Plan:
  """The Plan of Experiment `exp` on `target`'s devices `found`: the run's programs
  compiled there, timed on the target's chip, or on a local device's (a known
  accelerator's published peaks, else peaks measured on it)."""
  devices = run_devices(exp, found)
  compiled = compile_programs(exp, devices)
  stats = True  # A target's memory is known; a local device may report none (the CPU).
  if target.chip is None:
    known = chip_of_kind(devices[0].device_kind)
    peaks = ((known.bf16_flops_per_s, known.hbm_bytes_per_s) if known
             else measured_peaks(devices))
    capacity = local_chip_memory(devices)
    chip, stats = local_chip(devices, *peaks, capacity), capacity is not None
  else:
    share = target.chips / len(devices)  # a v4 chip shows as two devices
    chip = target.chip if share == 1 else per_device(target.chip, share)
    if chip.platform == "gpu":  # What jax's allocator holds of it in a run.
      chip = dataclasses.replace(chip, hbm_bytes=chip.hbm_bytes * cuda_plugin.gpu_memory_share())
  return build(compiled, target, chip, exp, len(devices), found.compiled_for,
               memory_stats=stats)


def local_chip(devices, measured_flops: float, measured_bw: float,
               capacity: Optional[float]) -> Chip:
  """The local devices as a Chip: peaks measured on them, capacity from memory_stats
  (host memory where the backend reports none)."""
  cap = capacity or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)
  return Chip(name=f"local {devices[0].device_kind}", platform=devices[0].platform,
              hbm_bytes=float(cap), hbm_bytes_per_s=measured_bw,
              bf16_flops_per_s=measured_flops, link_bytes_per_s=measured_bw)
