"""Memory planning at real sizes, without weights.

Whether a 1B-8B model trains on a given device count, and how many KV pages the rollout
may take beside it, is decided by the compiled programs, not by arithmetic on parameter
counts: XLA's buffer assignment knows the activations, the gradient accumulators and what
donation recycles. So every figure here comes from compiling on abstract arrays
(`jax.ShapeDtypeStruct` with shardings): `jax.jit(f).lower(*abstract).compile()` then
`memory_analysis()` and `cost_analysis()`. Nothing is allocated, so an 8B model plans on a
laptop CPU with fake devices in the time one compile takes.

All byte figures are per device. This module sits above the roles (it builds a trainer
and reads the rollout pool's layout); only entry points, the pipeline and scripts import
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, abstract_model
from jaxrl_post.plan.buffers import Allocation, largest_allocations, reported_allocations
from jaxrl_post.plan.hlo_cost import ProgramCost, kernels_in, loop_launches, program_cost
from jaxrl_post.plan.hlo_sources import bytes_by_source
from jaxrl_post.models.transformer import logical_axes, params_of
from jaxrl_post.rl.forward import PackedInputs
from jaxrl_post.rl.packing import bucket
from jaxrl_post.rl.trainer import (SequenceScores, StepBatch, Trainer, TrainerConfig,
                                   TrainState, optimizer_state_shardings)
from jaxrl_post.rollout.pages import PoolConfig, page_bytes, pool_budget
from jaxrl_post.sharding import (MeshConfig, ROLLOUT_RULES, TRAINING_RULES,
                                 logical_to_spec, make_mesh, mesh_platform, tree_shardings)

GB = 1e9


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device figures of one compiled program.

  Attributes:
    argument_bytes: inputs (parameters, optimizer state, the batch).
    output_bytes: outputs (the new state, metrics).
    temp_bytes: XLA temporaries: activations kept for the backward, gradient
      accumulators, the optimizer update's intermediates.
    generated_code_bytes: the compiled code itself.
    alias_bytes: outputs written into donated inputs; counted in both argument and output.
    flops: floating-point operations per device, from XLA's cost model, which counts a
      loop body once: scanned layers and micro-batches are undercounted, so compare
      programs of one structure (the same step on 1 and 8 devices), not absolute FLOPs.
    cost: FLOPs, memory bytes and collective bytes per device with every loop counted
      by its trip count (plan.hlo_cost), for predicting times (None unless analysed).
    kernels: the Pallas kernels the compiled program calls, e.g. "paged_attention mosaic"
      (empty unless analysed).
    launches: device launches per iteration of the program's main loop, by kind
      (plan.hlo_cost.loop_launches; None unless analysed, or without a loop).
    sources: the functions whose ops move the most bytes, per call
      (plan.hlo_sources.bytes_by_source; empty unless analysed).
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  generated_code_bytes: int
  alias_bytes: int
  flops: float
  cost: Optional[ProgramCost] = None
  kernels: tuple[str, ...] = ()
  launches: Optional[dict] = None
  sources: tuple = ()

  @property
  def peak_bytes(self) -> int:
    """argument + output + temp - alias: what the program holds at once.

    Arguments and outputs are live together at the end of the step; the donated part of
    the state is one buffer seen from both sides, so it is subtracted once. The code
    size is left out (it is not device memory on GPU/TPU).
    """
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


@dataclasses.dataclass(frozen=True)
class TrainStepMemory:
  """The compiled train step plus the state's share of its arguments, per device.

  Attributes:
    compiled: the step's memory analysis and FLOPs.
    params_bytes: trainable parameters (f32 masters).
    frozen_bytes: frozen parameters (the LoRA base), else 0.
    opt_state_bytes: optimizer state (Adam's moments mirror the trainable parameters).
    batch_bytes: one step's StepBatch.
    largest: the largest allocations of the step (empty unless asked for): what to
      shrink when the peak is too high.
    reference_bytes: the frozen reference weights, an argument of the step (it computes
      the reference logprobs) but resident for the whole run; 0 with LoRA.
  """

  compiled: CompiledMemory
  params_bytes: int
  frozen_bytes: int
  opt_state_bytes: int
  batch_bytes: int
  largest: tuple[Allocation, ...] = ()
  reference_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    return self.compiled.peak_bytes

  @property
  def resident_bytes(self) -> int:
    """What lives on the device for the whole run: the state and the reference."""
    return (self.params_bytes + self.frozen_bytes + self.opt_state_bytes +
            self.reference_bytes)

  @property
  def transient_bytes(self) -> int:
    """What the step adds on top of the resident state while it runs (activations,
    gradients, outputs not written in place, the batch): a colocated KV pool leaves it."""
    return max(self.peak_bytes - self.resident_bytes, 0)

  @property
  def gradient_bytes(self) -> int:
    """The gradient accumulator: one f32 copy of the trainable parameters (inside temp)."""
    return self.params_bytes

  @property
  def activation_bytes(self) -> int:
    """temp minus the gradient accumulator: activations and update intermediates (an
    estimate: XLA reports temporaries as one figure)."""
    return max(self.compiled.temp_bytes - self.gradient_bytes, 0)


# ------------------------------------------------------------------------ helpers


def single_device_mesh(device: Optional[jax.Device] = None) -> Mesh:
  """A 1-device mesh, so one code path places abstract arrays with or without sharding."""
  return make_mesh(MeshConfig(fsdp=1), [device or jax.devices()[0]])


def device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (or arrays)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def _abstract(tree, shardings, dtype=None):
  """ShapeDtypeStructs of `tree`'s leaves carrying `shardings` (and `dtype` if given)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                      tree, shardings)


def _spec(names, shape, mesh: Mesh, rules) -> NamedSharding:
  """The sharding `rules` give an activation-like array; "" marks an unnamed dim."""
  return NamedSharding(mesh, logical_to_spec(names, shape, rules, mesh))


def compiled_memory(compiled, analyse: bool = False,
                    segment_tokens: Optional[int] = None) -> CompiledMemory:
  """CompiledMemory of a `jax.stages.Compiled`; with `analyse`, also its loop-counted cost
  and kernels, read from the program's text (a pass over all of it: the run's pool sizing
  at start-up needs only the memory figures). `segment_tokens`: the longest sequence a
  training program's packed rows hold, which its attention kernels' FLOPs depend on."""
  m = compiled.memory_analysis()
  text = compiled.as_text() if analyse else None
  return CompiledMemory(argument_bytes=int(m.argument_size_in_bytes),
                        output_bytes=int(m.output_size_in_bytes),
                        temp_bytes=int(m.temp_size_in_bytes),
                        generated_code_bytes=int(m.generated_code_size_in_bytes),
                        alias_bytes=int(m.alias_size_in_bytes),
                        flops=_flops(compiled),
                        cost=program_cost(text, segment_tokens) if analyse else None,
                        kernels=kernels_in(text) if analyse else (),
                        launches=loop_launches(text) if analyse else None,
                        sources=tuple(bytes_by_source(text)) if analyse else ())


def _flops(compiled) -> float:
  """FLOPs per device; cost_analysis() is a dict or a list of dicts by jax version."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    return float(sum(c.get("flops", 0.0) for c in cost if c))
  return float((cost or {}).get("flops", 0.0))


# plan --fit plans configs a binding or two apart, whose programs are mostly the same: a
# slots move leaves the train step as it was, a micro-batch move the decode loop. Inside
# compiling_once(), a program whose lowered text was compiled before (with the same
# options) is not compiled again; outside, every call compiles.
_COMPILED: Optional[dict] = None


@contextlib.contextmanager
def compiling_once():
  """Within the block, each distinct program compiles once (compile_lowered and
  compile_with_allocations keep what they compiled until the block ends)."""
  global _COMPILED
  saved, _COMPILED = _COMPILED, {}
  try:
    yield
  finally:
    _COMPILED = saved


def _once(lowered, options: tuple, compile_fn):
  if _COMPILED is None:
    return compile_fn()
  key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), options)
  if key not in _COMPILED:
    _COMPILED[key] = compile_fn()
  return _COMPILED[key]


def compile_lowered(lowered):
  """lowered.compile(); once per distinct program inside compiling_once()."""
  return _once(lowered, (), lowered.compile)


def compile_with_allocations(lowered, top: int = 0, platform: str = "cpu"):
  """(compiled, its `top` largest allocations) for a program built for `platform`: read
  from the executable's buffer assignment where XLA's CPU and GPU clients report it;
  libtpu reports none, so a TPU program is compiled with its module dumped (which writes
  text files only) and the allocations are read from the memory-usage report beside it.
  Once per distinct program inside compiling_once()."""
  return _once(lowered, ("allocations", top, platform),
               lambda: _compile_with_allocations(lowered, top, platform))


def _compile_with_allocations(lowered, top: int, platform: str):
  if top <= 0 or platform != "tpu":
    compiled = lowered.compile()
    return compiled, largest_allocations(compiled, top)
  with tempfile.TemporaryDirectory() as scratch, _persistent_cache_off():
    compiled = lowered.compile(compiler_options={"xla_dump_to": scratch})
    return compiled, reported_allocations(scratch, top)


@contextlib.contextmanager
def _persistent_cache_off():
  """Compilations inside this block skip jax's persistent compilation cache (when one is
  configured). Its keys leave out the dump options, so a cached executable would come back
  without XLA having compiled it, and so without the dump the report is read from."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()  # The cache decides once whether it is in use.
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


# ------------------------------------------------------------------------ train step


def abstract_train_state(trainer: Trainer, mesh: Mesh) -> TrainState:
  """The TrainState `trainer.init_state` would build, as sharded ShapeDtypeStructs."""
  model = trainer.model
  shardings = trainer.param_shardings or tree_shardings(
      logical_axes(model), params_of(model), TRAINING_RULES, mesh)
  full = _abstract(params_of(model), shardings)
  trainable, frozen = trainer.split(full)
  opt = jax.eval_shape(trainer.optimizer.init, trainable)
  opt = _abstract(opt, optimizer_state_shardings(opt, trainable, mesh))
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
  return TrainState(step=scalar, params=trainable, frozen=frozen, opt_state=opt,
                    skipped=scalar)


def abstract_step_batch(mesh: Mesh, micro_batches: int, rows: int, row_tokens: int,
                        sequences: int, completion_len: int, head_positions: int,
                        rules=TRAINING_RULES, experts=None) -> StepBatch:
  """A StepBatch of [M, R, S] packed rows, [M, B, T] completions and [M, N] LM-head
  positions, sharded over the rules' "batch" axes (data parallelism is a sharding). R, B
  and N should be multiples of those axes' size, as the trainer packs them; otherwise the
  rules fall back to fewer axes and the plan shows the imbalance. experts (L, k) adds the
  rollout's recorded experts [M, R, S, L, k] int16 that a MoE step replays."""
  m = micro_batches

  def array(shape, dtype):
    names = ("", "batch") + ("",) * (len(shape) - 2)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_spec(names, shape, mesh, rules))

  row = lambda dtype: array((m, rows, row_tokens), dtype)
  comp = lambda dtype: array((m, sequences, completion_len), dtype)
  inputs = PackedInputs(tokens=row(jnp.int32), positions=row(jnp.int32),
                        segment_ids=row(jnp.int32), targets=row(jnp.int32),
                        completion_mask=comp(jnp.float32),
                        head_index=array((m, head_positions), jnp.int32),
                        head_slot=comp(jnp.int32),
                        experts=None if experts is None else array(
                            (m, rows, row_tokens, *experts), jnp.int16))
  return StepBatch(inputs=inputs, behaviour_logprobs=comp(jnp.float32),
                   sequence=array((m, sequences), jnp.int32))


def head_positions_bound(sequences: int, completion_len: int, shards: int) -> int:
  """LM-head positions of a planned micro-batch: every slot of its [B, T] completion
  layout, split evenly over the row shards (the packer's per-shard buckets hold about
  that many when the rows are balanced)."""
  return shards * math.ceil(sequences * completion_len / shards)


def micro_batch_shape(trajectories: int, longest: int, row_tokens: int,
                      shards: int) -> tuple[int, int]:
  """(packed rows, sequences) of one micro-batch of `trajectories` at worst, as the
  trainer buckets them: first-fit needs under twice the rows the tokens fill and never
  more than one per trajectory; sequences round up to whole row shards."""
  filled = math.ceil(trajectories * longest / row_tokens)
  return (bucket(min(trajectories, 2 * filled), shards),
          shards * math.ceil(trajectories / shards))


def _state_shardings(state: TrainState):
  return jax.tree.map(lambda x: x.sharding, state)


def abstract_reference(trainer: Trainer, mesh: Mesh, dtype="float32") -> Optional[dict]:
  """The frozen reference weights the step takes, in `dtype` (None with LoRA: the base)."""
  if trainer.lora:
    return None
  model = trainer.model
  shardings = trainer.param_shardings or tree_shardings(
      logical_axes(model), params_of(model), TRAINING_RULES, mesh)
  return _abstract(params_of(model), shardings, jnp.dtype(dtype))


def lower_train_step(trainer: Trainer, state: TrainState, batch: StepBatch,
                     reference: Optional[dict] = None):
  """The trainer's minibatch update (a rollout batch of one minibatch),
  jitted as `Trainer.init_state` jits it, lowered on abstract inputs. Kept alone so a
  change to how the trainer builds its step changes one place.

  It traces under the trainer's activation rules (the model's logical constraints keep
  each device on its own rows).
  """
  step = trainer.jit(trainer.minibatch_update, donate_argnums=0,
                     out_shardings=(_state_shardings(state), None))
  n = batch.sequence.shape[1] * batch.sequence.shape[0]
  replicated = NamedSharding(trainer.mesh, PartitionSpec())
  f32 = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=replicated)
  with _gpu_target(trainer.mesh):
    return step.lower(state, reference, batch, SequenceScores(f32, f32), None)


def lower_old_policy(trainer: Trainer, state: TrainState, batch: StepBatch):
  """The old-policy forward a rollout batch of several minibatches runs for each later
  one (`Trainer.old_policy`), jitted as the trainer jits it, lowered on abstract inputs."""
  # Split like the batch, as the trainer's program returns it.
  forward = trainer.jit(trainer.minibatch_old_policy,
                        out_shardings=batch.inputs.completion_mask.sharding)
  with _gpu_target(trainer.mesh):
    return forward.lower(trainer.full_params(state), batch.inputs)


def _gpu_target(mesh: Mesh):
  """Where a GPU program is traced on a host without one: its mesh as the abstract mesh in
  context, which Pallas' Triton lowering asks for the GPU it compiles for (a kernel under
  shard_map finds it there already; one called on a one-device mesh does not)."""
  if mesh_platform(mesh) == "gpu" and jax.default_backend() != "gpu":
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
  return contextlib.nullcontext()


def train_step_memory(model_cfg: ModelConfig, trainer_cfg: TrainerConfig = TrainerConfig(),
                      mesh: Optional[Mesh] = None, rows: int = 1,
                      row_tokens: Optional[int] = None, completion_len: int = 512,
                      micro_batches: int = 1, sequences: Optional[int] = None,
                      largest: int = 0, reference_dtype="float32",
                      analyse: bool = False,
                      segment_tokens: Optional[int] = None) -> TrainStepMemory:
  """Compiles one optimizer step on abstract inputs and reads its per-device memory.

  The step is the trainer's whole minibatch program: the reference forward included, with
  the reference weights (`reference_dtype`) among its arguments.

  Args:
    model_cfg: the model (remat, dtypes and LoRA as configured).
    trainer_cfg: the trainer (loss, optimizer); its row_tokens is the default row length.
    mesh: the training mesh; None means one device.
    rows: packed rows per micro-batch, across the whole mesh.
    row_tokens: tokens per packed row (default: trainer_cfg.row_tokens).
    completion_len: T, the padded completion length.
    micro_batches: M, gradient-accumulation chunks of the step (scanned, so the peak
      holds one micro-batch's activations).
    sequences: B, trajectories per micro-batch; default: one per row.
    largest: also report this many of the step's largest allocations.
    reference_dtype: the frozen reference's dtype (ReferenceSpec.dtype).
    analyse: also read the step's loop-counted cost and kernels (see compiled_memory).
    segment_tokens: the longest sequence a row packs (prompt and completion), for the
      cost of its attention kernels (see compiled_memory); None: a whole row.
  """
  trainer, state, batch = _abstract_step(model_cfg, trainer_cfg, mesh, rows, row_tokens,
                                         completion_len, micro_batches, sequences)
  mesh = trainer.mesh
  reference = abstract_reference(trainer, mesh, reference_dtype)
  compiled, allocations = compile_with_allocations(
      lower_train_step(trainer, state, batch, reference), largest, mesh_platform(mesh))
  return TrainStepMemory(compiled=compiled_memory(compiled, analyse, segment_tokens),
                         params_bytes=device_bytes(state.params),
                         frozen_bytes=device_bytes(state.frozen),
                         opt_state_bytes=device_bytes(state.opt_state),
                         batch_bytes=device_bytes(batch), largest=allocations,
                         reference_bytes=device_bytes(reference or {}))


def old_policy_memory(model_cfg: ModelConfig, trainer_cfg: TrainerConfig = TrainerConfig(),
                      mesh: Optional[Mesh] = None, rows: int = 1,
                      row_tokens: Optional[int] = None, completion_len: int = 512,
                      micro_batches: int = 1, sequences: Optional[int] = None,
                      analyse: bool = False,
                      segment_tokens: Optional[int] = None) -> CompiledMemory:
  """Compiles the old-policy forward of one minibatch (arguments as train_step_memory's),
  which a rollout batch of N minibatches runs N - 1 times before its updates."""
  trainer, state, batch = _abstract_step(model_cfg, trainer_cfg, mesh, rows, row_tokens,
                                         completion_len, micro_batches, sequences)
  return compiled_memory(compile_lowered(lower_old_policy(trainer, state, batch)), analyse,
                         segment_tokens)


def _abstract_step(model_cfg, trainer_cfg, mesh, rows, row_tokens, completion_len,
                   micro_batches, sequences) -> tuple[Trainer, TrainState, StepBatch]:
  """The trainer on `mesh` (one device when None), its abstract state and minibatch."""
  mesh = mesh or single_device_mesh()
  row_tokens = row_tokens or trainer_cfg.row_tokens
  trainer = Trainer(model_cfg, trainer_cfg, mesh=mesh)
  sequences = sequences or rows
  head = head_positions_bound(sequences, completion_len, trainer.batch_shards)
  experts = None if model_cfg.moe is None else (model_cfg.num_layers,
                                                 model_cfg.moe.experts_per_token)
  batch = abstract_step_batch(mesh, micro_batches, rows, row_tokens, sequences,
                              completion_len, head, trainer.rules,
                              experts)
  return trainer, abstract_train_state(trainer, mesh), batch


# ------------------------------------------------------------------------ weights


def weight_bytes(model_cfg: ModelConfig, mesh: Mesh, dtype, rules=TRAINING_RULES) -> int:
  """Per-device bytes of one copy of the full weights in `dtype`, laid out by `rules`."""
  model = abstract_model(model_cfg)
  shapes = params_of(model)
  shardings = tree_shardings(logical_axes(model), shapes, rules, mesh)
  return device_bytes(_abstract(shapes, shardings, jnp.dtype(dtype)))


def reference_bytes(model_cfg: ModelConfig, mesh: Mesh, dtype="bfloat16") -> int:
  """Per-device bytes of the frozen reference policy on the training mesh.

  With LoRA the reference is the base with the adapters off, which the train state
  already holds, so it costs nothing extra.
  """
  if model_cfg.lora is not None:
    return 0
  return weight_bytes(model_cfg.replace(lora=None), mesh, dtype, TRAINING_RULES)


def rollout_bytes(model_cfg: ModelConfig, mesh: Mesh, dtype="bfloat16") -> int:
  """Per-device bytes of the rollout engine's weights: tensor-parallel, replicated over
  "data" (ROLLOUT_RULES), so a rollout mesh without "tensor" holds a whole copy."""
  return weight_bytes(model_cfg, mesh, dtype, ROLLOUT_RULES)


# ------------------------------------------------------------------------ KV pool


@dataclasses.dataclass(frozen=True)
class PoolPlan:
  """A KV pool sized from what is left on a device.

  Attributes:
    pages: pages per data shard (page 0, the write sink, included); every device of a
      data shard holds these pages for its share of the KV heads.
    page_bytes: bytes of one page on one device (K and V, all layers, its KV heads).
    budget_bytes: the bytes the pool was allowed.
    page_size: tokens per page.
  """

  pages: int
  page_bytes: int
  budget_bytes: int
  page_size: int

  @property
  def pool_bytes(self) -> int:
    return self.pages * self.page_bytes

  @property
  def tokens(self) -> int:
    """Tokens the pool holds per data shard (the write sink excluded)."""
    return (self.pages - 1) * self.page_size


def kv_head_shards(model_cfg: ModelConfig, tensor_shards: int) -> int:
  """How many ways the pool's KV-head axis really splits: the rules keep a head count
  that the tensor axis does not divide whole (replicated), as they do the weights."""
  return tensor_shards if model_cfg.num_kv_heads % tensor_shards == 0 else 1


def kv_pool_pages(model_cfg: ModelConfig, page_size: int, kv_dtype, device_bytes: int,
                  train_peak_bytes: int, tensor_shards: int = 1, fraction: float = 0.9,
                  other_bytes: int = 0) -> PoolPlan:
  """The KV pool that fits beside the train step on one device.

  The pool lives for the whole run (colocated roles), so it must coexist with the train
  step's peak and with every weight copy that is not an argument of that step.

  Args:
    model_cfg: the model (layers, KV heads, head dim).
    page_size: tokens per page.
    kv_dtype: the pool's dtype.
    device_bytes: the device's capacity.
    train_peak_bytes: the compiled train step's peak on that device.
    tensor_shards: the rollout mesh's "tensor" size (KV heads split over it).
    fraction: share of the remainder given to the pool; the rest is headroom for
      fragmentation and the runtime.
    other_bytes: resident bytes outside the train step (reference and rollout weights).

  Raises:
    UserError: when the remainder holds fewer than 2 pages (page 0 is reserved).
  """
  if not 0.0 < fraction <= 1.0:
    raise UserError(f"kv pool plan: fraction must be in (0, 1], got {fraction}")
  shards = kv_head_shards(model_cfg, tensor_shards)
  full_page = page_bytes(model_cfg, page_size, kv_dtype)  # All KV heads.
  one_page = full_page // shards
  left = device_bytes - train_peak_bytes - other_bytes
  pool = PoolConfig(page_size=page_size, memory_fraction=fraction)
  free = device_bytes - other_bytes  # The engine's rule (rollout.pages.pool_pages).
  budget = pool_budget(pool, free, train_peak_bytes)
  pages = budget * shards // full_page
  if pages < 2:
    raise UserError(
        f"kv pool plan: nothing left for the KV pool: the device has {device_bytes / GB:.2f} "
        f"GB, the train step peaks at {train_peak_bytes / GB:.2f} GB and other weights take "
        f"{other_bytes / GB:.2f} GB, leaving {left / GB:.2f} GB ({pages} pages of "
        f"{one_page} bytes); shard wider, use LoRA, remat, or fewer rows per device")
  return PoolPlan(pages=int(pages), page_bytes=int(one_page), budget_bytes=budget,
                  page_size=page_size)


# ------------------------------------------------------------------------ decode loop


def decode_operands(model_cfg: ModelConfig, num_slots: int, pages_per_shard: int,
                    page_size: int, table_pages: int, kv_dtype, weight_dtype,
                    max_stop_ids: int, layout, window_pages_per_shard: int = 0):
  """Abstract (params, pool, slot state) as the engine passes them to its decode loop
  (rollout.programs.decode_loop) on `layout` (a rollout.layout.RolloutLayout).

  The pool is [Hkv, L, D * P, page, hd] sharded over (tensor, -, data) and the slots over
  "data"; the weights are in the engine's form for the layout (rollout.weights). A model
  with a window pool (rollout.pages.split_kv) keeps its global layers there and its
  sliding layers in a window pool of window_pages_per_shard pages per data shard.
  """
  from jaxrl_post.rollout.pages import KVPool, window_layers
  from jaxrl_post.rollout.programs import SlotState
  from jaxrl_post.rollout.weights import abstract_split

  model = abstract_model(model_cfg)
  shapes = params_of(model)
  shardings = tree_shardings(logical_axes(model), shapes, ROLLOUT_RULES, layout.mesh)
  params = _abstract(shapes, shardings, jnp.dtype(weight_dtype))
  if layout.split_layers:  # The engine's per-layer copy (GPU).
    params = abstract_split(params, model_cfg.num_layers)
  windowed = window_layers(model_cfg)
  kv = lambda layers, pages: jax.ShapeDtypeStruct(
      (model_cfg.num_kv_heads, layers, layout.data_shards * pages, page_size,
       model_cfg.head_dim), jnp.dtype(kv_dtype), sharding=layout.sharding(layout.pool_spec))
  full = kv(model_cfg.num_layers - windowed, pages_per_shard)
  pool = KVPool(full, full)
  if windowed:
    window = kv(windowed, window_pages_per_shard)
    pool = pool._replace(wk=window, wv=window)
  vec = lambda dtype, *tail: jax.ShapeDtypeStruct((num_slots, *tail), dtype,
                                                  sharding=layout.rows(1 + len(tail)))
  state = SlotState(tokens=vec(jnp.int32), lengths=vec(jnp.int32),
                    num_generated=vec(jnp.int32), max_tokens=vec(jnp.int32),
                    active=vec(jnp.bool_), page_table=vec(jnp.int32, table_pages),
                    seeds=vec(jnp.uint32), sample_ids=vec(jnp.int32),
                    temperature=vec(jnp.float32), top_k=vec(jnp.int32),
                    top_p=vec(jnp.float32), stop_ids=vec(jnp.int32, max_stop_ids),
                    adapter=vec(jnp.int32))
  return params, pool, state


def window_map_operand(pool, layout):
  """The abstract window-page map a pool with a window pool is read through (None
  without one): one int32 per page, split over the data shards as the pages are."""
  if pool.wk is None:
    return None
  return jax.ShapeDtypeStruct((pool.k.shape[2],), jnp.int32, sharding=layout.rows(1))


def lower_decode(model_cfg: ModelConfig, params, pool, state, steps: int, layout,
                 truncation: bool = True, shared=None, width=None):
  """The engine's decode loop lowered on `decode_operands`' arguments (`shared`: cascade
  attention's block prefixes, None for plain paged attention; `width`: the page-table
  columns the loop reads, None for all)."""
  from jaxrl_post.rollout.programs import decode_program
  return decode_program(layout).lower(params, pool, state, shared,
                                      window_map_operand(pool, layout), cfg=model_cfg,
                                      steps=steps, truncation=truncation, layout=layout,
                                      width=width)


def decode_loop_memory(model_cfg: ModelConfig, num_slots: int, pages_per_shard: int,
                       page_size: int = 16, table_pages: int = 16, steps: int = 16,
                       kv_dtype="bfloat16", weight_dtype="bfloat16", max_stop_ids: int = 8,
                       mesh: Optional[Mesh] = None, analyse: bool = False) -> CompiledMemory:
  """Compiles the rollout engine's multi-step decode loop on abstract arrays.

  Plain paged attention (no shared prefix): the cascade path adds only small tables.

  Args:
    model_cfg: the model.
    num_slots: sequences decoded together, over the whole rollout mesh.
    pages_per_shard: KV pages per data shard (the arguments include the whole pool,
      which the loop donates and returns).
    page_size: tokens per page.
    table_pages: width of the page table the call sees (the engine narrows it to a power
      of two of the pages in use); attention gathers this many pages per slot.
    steps: decode steps per call.
    kv_dtype: the pool's dtype.
    weight_dtype: the rollout weights' dtype.
    max_stop_ids: stop ids per slot.
    mesh: the rollout mesh (None: one device).
    analyse: also read the loop's cost and kernels (see compiled_memory).
  """
  from jaxrl_post.rollout.layout import RolloutLayout
  layout = RolloutLayout.build(model_cfg, mesh)
  params, pool, state = decode_operands(model_cfg, num_slots, pages_per_shard, page_size,
                                        table_pages, kv_dtype, weight_dtype, max_stop_ids,
                                        layout)
  return compiled_memory(compile_lowered(lower_decode(model_cfg, params, pool, state, steps,
                                                      layout)), analyse)
