"""Memory planning on abstract arrays: compiled figures, FSDP scaling, KV pool sizing."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrl_post import plan
from jaxrl_post.errors import UserError
from jaxrl_post.models import LoraConfig, preset
from jaxrl_post.rl.trainer import TrainerConfig
from jaxrl_post.sharding import MeshConfig, make_mesh

CFG = preset("tiny", remat="full")
ROW_TOKENS = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def step_memory(devices: int, rows: int) -> plan.TrainStepMemory:
  mesh = make_mesh(MeshConfig(fsdp=devices), jax.devices()[:devices])
  return plan.train_step_memory(CFG, TrainerConfig(row_tokens=ROW_TOKENS), mesh, rows=rows,
                                completion_len=32, largest=4)


def test_train_step_figures_are_positive_and_the_peak_grows_with_rows():
  small, large = step_memory(1, 2), step_memory(1, 8)
  for m in (small, large):
    c = m.compiled
    assert min(c.argument_bytes, c.output_bytes, c.temp_bytes, c.alias_bytes, c.flops) > 0
    assert c.peak_bytes == c.argument_bytes + c.output_bytes + c.temp_bytes - c.alias_bytes
    # The state is donated: its bytes are an argument and an output, counted once.
    assert c.alias_bytes >= m.params_bytes + m.opt_state_bytes
  assert small.params_bytes == 4 * CFG.num_params  # f32 masters on one device
  assert small.opt_state_bytes >= 2 * small.params_bytes  # Adam's two moments
  assert large.peak_bytes > small.peak_bytes
  assert large.compiled.flops > small.compiled.flops


def test_largest_allocations_name_the_buffers_behind_the_peak():
  m = step_memory(1, 8)
  sizes = [a.bytes for a in m.largest]
  assert len(sizes) == 4 and sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
  assert sum(sizes) <= m.peak_bytes
  assert all("[" in a.values for a in m.largest)  # shapes such as f32[2,64,192]


def test_largest_allocations_are_reported_with_a_persistent_compilation_cache(tmp_path):
  # The cache's keys leave out the dump options: without care, the second process would get
  # the first one's executable from the cache, compiled by no one, and no report.
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_plan; "
          "print(len(test_plan.step_memory(1, 8).largest))")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  counts = [subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "tests")], env=env,
                           capture_output=True, text=True, check=True).stdout.split()[-1]
            for _ in range(2)]
  assert counts == ["4", "4"]


def test_fsdp_over_8_devices_divides_the_per_device_arguments_by_about_8():
  one, eight = step_memory(1, 8), step_memory(8, 8)
  assert one.params_bytes == 8 * eight.params_bytes  # every tiny matrix splits 8 ways
  ratio = one.compiled.argument_bytes / eight.compiled.argument_bytes
  assert 7.5 < ratio <= 8.0, ratio  # only the replicated scalars keep it under 8
  assert one.batch_bytes == 8 * eight.batch_bytes  # rows are split too (data parallel)


def test_weight_copies_per_device():
  one = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
  fsdp = make_mesh(MeshConfig(fsdp=8))
  assert plan.reference_bytes(CFG, one, "bfloat16") == 2 * CFG.num_params
  assert plan.reference_bytes(CFG, fsdp, "bfloat16") == 2 * CFG.num_params // 8
  assert plan.reference_bytes(CFG.replace(lora=LoraConfig()), fsdp) == 0  # the base is it
  replicated = make_mesh(MeshConfig(data=8, fsdp=1))
  assert plan.rollout_bytes(CFG, replicated) == 2 * CFG.num_params  # a whole copy each
  tensor = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  assert plan.rollout_bytes(CFG, tensor) < plan.rollout_bytes(CFG, replicated)


def test_kv_pool_takes_what_the_train_step_leaves():
  device, peak, other = 10 << 20, 3 << 20, 1 << 20
  pool = plan.kv_pool_pages(CFG, 16, "bfloat16", device, peak, fraction=0.5,
                            other_bytes=other)
  assert pool.budget_bytes == int(0.5 * (device - peak - other))
  assert pool.pages * pool.page_bytes <= pool.budget_bytes
  assert (pool.pages + 1) * pool.page_bytes > pool.budget_bytes  # none left unused
  # Two KV heads over tensor=2: a device holds half of each page, so twice the pages fit.
  split = plan.kv_pool_pages(CFG, 16, "bfloat16", device, peak, tensor_shards=2,
                             fraction=0.5, other_bytes=other)
  assert split.page_bytes * 2 == pool.page_bytes
  assert split.pages * split.page_bytes <= split.budget_bytes
  # Four tensor shards do not divide 2 KV heads: the pool stays replicated over them.
  assert plan.kv_pool_pages(CFG, 16, "bfloat16", device, peak, tensor_shards=4, fraction=0.5,
                            other_bytes=other).page_bytes == pool.page_bytes


def test_kv_pool_raises_a_user_error_when_nothing_is_left():
  with pytest.raises(UserError, match="nothing left for the KV pool"):
    plan.kv_pool_pages(CFG, 16, "bfloat16", 1 << 30, 1 << 30, other_bytes=1 << 20)
  with pytest.raises(UserError, match="fraction"):
    plan.kv_pool_pages(CFG, 16, "bfloat16", 1 << 30, 0, fraction=0.0)


def test_decode_loop_memory_holds_the_pool():
  pages = 32
  m = plan.decode_loop_memory(CFG, num_slots=8, pages_per_shard=pages, page_size=16,
                              table_pages=4, steps=4)
  pool = 2 * pages * (16 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 2)
  assert m.argument_bytes >= pool + 2 * CFG.num_params
  assert m.alias_bytes >= pool  # the pool is donated and written in place
  assert m.temp_bytes > 0


def _bench_scale():
  from tests import scripts  # Not at the top: a test imports this file as `test_plan`.
  return scripts.load("bench_scale")


@pytest.mark.slow
@pytest.mark.sweep  # bench_scale's own smoke run; the plan's programs are tested elsewhere
def test_bench_scale_quick_prints_every_key(capsys):
  assert _bench_scale().main(["--quick", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  for key in ("memory_gb_1b_1dev", "memory_gb_8b_8dev"):
    m = out[key]
    assert m["peak_gb"] > 0 and m["kv_pool_pages_per_data_shard"] >= 2
    assert m["peak_gb"] <= m["device_gb"]
  assert 0 < out["train_flops_per_device_ratio_8v1"] < 0.5
  assert out["rollout_mesh_greedy_equal"] is True
  assert out["compiled_shapes_20_steps"] > 0


def _quickstart(name: str, *bindings: str):
  from jaxrl_post.pipeline import config
  small = ["RolloutSpec.prompts_per_step = 4", "RolloutSpec.group_size = 4",
           "EngineConfig.num_slots = 16", "EngineConfig.group_slots = 4"]
  config.parse([os.path.join(ROOT, "configs", name)],
               [*small, "PlacementConfig.num_devices = 1", "PoolConfig.num_pages = None",
                *bindings])
  return config.build_experiment()


def test_an_asynchronous_run_holds_more_rollout_weight_versions_and_a_smaller_pool():
  """The quickstart and its asynchronous twin (which differ in schedule and AsyncSpec only,
  so share their programs): lag 1 keeps 2 more rollout copies alive through every phase
  (pipelined.versions_in_flight), lag 2 keeps 3; a pool sized by memory gets what a device
  that much smaller would give it."""
  from jaxrl_post.plan import programs, report, targets
  devices, capacity = jax.devices()[:1], 1 << 30
  sync = _quickstart("quickstart.gin")
  p = programs.compile_programs(sync, devices)
  copy = plan.rollout_bytes(p.model, p.meshes.rollout, sync.sync.rollout_dtype)
  assert copy == 4 * p.model.num_params  # float32 rollout weights on one device
  base = report._memory_plan(p, sync, capacity)
  assert base.in_flight_bytes == 0
  for exp, copies in ((_quickstart("quickstart_async.gin"), 2),
                      (_quickstart("quickstart_async.gin", "AsyncSpec.max_staleness = 4"), 3)):
    mem = report._memory_plan(p, exp, capacity)
    assert mem.in_flight_bytes == copies * copy
    assert {k: v - base.phases[k] for k, v in mem.phases.items()} == dict.fromkeys(
        base.phases, copies * copy)
    assert mem.kv_pages == report._memory_plan(p, sync, capacity - copies * copy).kv_pages
    assert mem.kv_pages < base.kv_pages
  chip = report.local_chip(devices, 1e12, 1e11, capacity)
  built = report.build(p, targets.resolve("local", 1), chip, exp, 1)
  assert built.resident_gb["rollout_weights_in_flight"] == round(3 * copy / plan.GB, 3) > 0
  assert "of versions in flight" in report.text(built)


def test_the_train_phase_counts_the_later_minibatches_old_policy_forward():
  """The quickstart's rollout batch is 2 minibatches: the run computes the second's old
  policy with a forward program before the two updates, and the plan's train phase is
  those three calls; with one minibatch there is no such forward."""
  from types import SimpleNamespace as NS

  from jaxrl_post.plan import programs, report, targets
  devices = jax.devices()[:1]
  exp = _quickstart("quickstart.gin")
  assert exp.trainer.minibatches == 2
  p = programs.compile_programs(exp, devices)
  train, forward = p.train_filled.cost, p.old_policy.cost
  # A forward of the same rows without the backward, the remat or the reference.
  assert 0 < forward.flops < train.flops / 2
  # No gradients or optimizer temporaries: the memory plan's train phase is the update's.
  assert p.old_policy.peak_bytes < p.train_filled.peak_bytes
  chip = report.local_chip(devices, 1e12, 1e11, 1 << 30)
  built = report.build(p, targets.resolve("local", 1), chip, exp, 1)
  assert built.flops["train"] == pytest.approx(2 * train.flops + forward.flops)
  assert built.hbm_bytes["train"] == pytest.approx(2 * train.bytes + forward.bytes)
  seconds = lambda c, n: report._seconds(report._terms(c, chip, n))
  assert built.predicted_s["train"] == pytest.approx(
      seconds(train, 2) + seconds(forward, 1), abs=5e-5)  # reported to 0.1 ms
  # The FLOPs at the predicted seconds over the peak: the utilisation the plan expects.
  assert built.flops_utilisation["train"] == pytest.approx(
      built.flops["train"] / (seconds(train, 2) + seconds(forward, 1)) / 1e12, rel=1e-3)
  assert f"{built.flops_utilisation['train']:.0%} of the bf16 peak" in report.text(built)
  one = NS(**{**vars(p), "old_policy": None})  # what a one-minibatch rollout batch runs
  single = NS(**{**vars(exp), "trainer": NS(minibatches=1)})
  runs = report._runs(one, single, p.decode.cost)
  assert [(cost, n) for cost, n, _ in runs["train"]] == [(train, 1)]


def test_an_engine_that_splits_its_layers_holds_the_rollout_weights_once():
  """The sync writes the engine's per-layer form (rollout.weights.SplitLayers), so the plan
  counts one copy of the rollout weights, as the run holds."""
  from jaxrl_post.plan import programs
  exp = _quickstart("quickstart.gin", "EngineConfig.split_layers = True")
  p = programs.compile_programs(exp, jax.devices()[:1])
  assert p.rollout_weight_bytes == plan.rollout_bytes(p.model, p.meshes.rollout, "float32")
  assert p.rollout_weight_bytes == 4 * p.model.num_params


def test_a_grpo_config_is_planned_with_the_cascade_decode_its_engine_runs():
  """group_slots makes the engine decode blocks of samples with cascade attention: the
  plan lowers that loop, and its slots need (and a step reads) the prompt's whole pages
  once per block."""
  from jaxrl_post.plan import programs, report
  devices = jax.devices()[:1]
  cascade, plain = _quickstart("quickstart.gin"), _quickstart(
      "quickstart.gin", "EngineConfig.group_slots = 0")
  p, q = programs.compile_programs(cascade, devices), programs.compile_programs(plain, devices)
  s = p.shapes
  assert (s.group_slots, q.shapes.group_slots) == (4, 0)
  assert s.shared_pages == cascade.prompts.max_prompt_tokens // s.page_size > 0
  assert report._memory_plan(q, plain, 1 << 30).kv_needed == 16 * s.table_pages * s.page_size
  assert report._memory_plan(p, cascade, 1 << 30).kv_needed == (
      16 * (s.table_pages - s.shared_pages) + 4 * s.shared_pages) * s.page_size
  assert p.decode.cost.bytes != q.decode.cost.bytes  # Another program.


def test_decode_is_predicted_with_the_kv_a_rollout_reads_not_whole_tables():
  """Kernels read the pages a row has reached; the compiled program declares whole tables.
  A prompt of 32 tokens and 64 new ones in pages of 16: the table is 6 pages, a step's row
  holds 3, 4, 5 then 6 of them for 16 steps each (4.5 on average), so 1.5 pages of every
  row's KV and their attention FLOPs are not read; without a kernel nothing changes."""
  from types import SimpleNamespace as NS

  from jaxrl_post.models import ModelConfig
  from jaxrl_post.plan import report
  from jaxrl_post.plan.hlo_cost import ProgramCost
  from jaxrl_post.plan.programs import Shapes
  from jaxrl_post.rollout import EngineConfig

  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
                    num_heads=8, num_kv_heads=2, head_dim=16, compute_dtype="bfloat16")
  shapes = Shapes(samples=32, longest=96, completion_len=64, rows=4, rows_filled=4,
                  sequences=32, num_slots=8, table_pages=6, page_size=16, group_slots=0,
                  shared_pages=0, prefill_rows=1, prefill_width=32)
  exp = NS(prompts=NS(max_prompt_tokens=32),
           rollout=NS(max_new_tokens=64, engine=EngineConfig()))
  compiled = ProgramCost(1e12, 1e10, 5.0, [])

  def programs(kernels, tensor):
    mesh = NS(shape={"data": 2, "fsdp": 1, "expert": 1, "tensor": tensor})
    return NS(decode=NS(cost=compiled, kernels=kernels), shapes=shapes, model=cfg,
              meshes=NS(rollout=mesh), decode_steps=4)

  for tensor in (1, 2):
    run = report.decode_as_run(programs(("paged_attention mosaic",), tensor), exp)
    tokens = 8 // 2 * 1.5 * 16 * 4  # rows per data shard x unread pages x steps
    kv_bytes = 2 * 2 // tensor * 16 * 2 * 3  # K and V, KV heads per shard, head_dim, bf16
    assert run.bytes == pytest.approx(1e10 - tokens * kv_bytes)
    assert run.flops == pytest.approx(1e12 - tokens * 4 * 8 // tensor * 16 * 3)
    assert run.collective_bytes == 5.0
  assert report.decode_as_run(programs((), 1), exp) == compiled


def test_a_gpu_step_pays_for_each_decode_kernel_and_a_tpu_step_does_not():
  """Decode launches hundreds of small kernels a step; on a GPU each costs the chip's
  kernel_s of device time beyond its bytes (measured on an H100), a TPU runs one program."""
  from jaxrl_post.plan import report, targets
  from jaxrl_post.plan.hlo_cost import ProgramCost
  from jaxrl_post.plan.memory import CompiledMemory

  decode = CompiledMemory(0, 0, 0, 0, 0, 0.0, ProgramCost(1e9, 3.35e9, 0.0, []), (),
                          {"total": 500.0, "by_kind": {}, "flag_reads": 0.0})
  gpu, tpu = targets.CHIPS["h100"], targets.CHIPS["v5p"]
  assert gpu.kernel_s == pytest.approx(4e-6) and tpu.kernel_s == 0
  terms = report._terms(decode.cost, gpu, calls=2, launches=500 * 32)  # 2 calls of 32 steps
  assert terms["memory"] == pytest.approx(2e-3)
  assert terms["kernels"] == pytest.approx(2 * 500 * 32 * 4e-6)
  assert report._seconds(terms) == pytest.approx(2e-3 + 0.128)
  tpu_terms = report._terms(decode.cost, tpu, calls=2, launches=500 * 32)
  assert tpu_terms["kernels"] == 0
  assert report._seconds(tpu_terms) == pytest.approx(2 * 3.35e9 / tpu.hbm_bytes_per_s)


def test_a_programs_kernels_are_timed_one_after_another():
  """A compute-bound matmul and a memory-bound fusion do not overlap: the program takes
  each one's own roofline in turn, more than the larger of its total FLOPs and bytes; the
  bytes decode_as_run takes off the totals come off at the bandwidth; a real program's
  kernel list sums to its totals, and each launch costs a GPU kernel_s."""
  from jaxrl_post.plan import report, targets
  from jaxrl_post.plan.hlo_cost import ProgramCost, program_cost

  gpu = targets.CHIPS["h100"]
  matmul, fusion = (989e9, 1e6, 4.0), (0.0, 3.35e9, 2.0)  # FLOPs, bytes, launches a call
  cost = ProgramCost(4 * 989e9, 4e6 + 6.7e9, 0.0, [], (matmul, fusion))
  terms = report._terms(cost, gpu, calls=3, launches=cost.launches)
  assert terms["compute"] == pytest.approx(3 * 4e-3)
  assert terms["memory"] == pytest.approx(3 * (2e-3 + 4e6 / 3.35e12))
  assert terms["serial"] == pytest.approx(3 * (4e-3 + 2e-3))  # not max(4, 2) ms
  assert terms["kernels"] == pytest.approx(3 * 6 * 4e-6)
  assert report._seconds(terms) == pytest.approx(terms["serial"] + terms["kernels"])
  unread = dataclasses.replace(cost, bytes=cost.bytes - 3.35e8)
  assert report.serial_seconds(unread, gpu) == pytest.approx(6e-3 - 1e-4)
  assert report.serial_seconds(ProgramCost(989e9, 3.35e9, 0.0, []), gpu) == pytest.approx(1e-3)

  x = jnp.ones((256, 256), jnp.float32)
  f = jax.jit(lambda a: jnp.sin(jax.lax.fori_loop(0, 3, lambda i, b: jnp.tanh(b @ a), a)))
  real = program_cost(f.lower(x).compile().as_text())
  assert sum(n * fl for fl, _, n in real.launched) == pytest.approx(real.flops)
  assert sum(n * b for _, b, n in real.launched) == pytest.approx(real.bytes)
  assert real.flops == pytest.approx(3 * 2 * 256 ** 3) and real.launches >= 4


def test_an_asynchronous_collective_hides_behind_the_kernels_scheduled_while_it_runs():
  """XLA's latency-hiding scheduler runs kernels between a collective's start and its done;
  its transfer counts only where it outlasts them. Synchronous collectives count whole."""
  from jaxrl_post.plan import report, targets
  from jaxrl_post.plan.hlo_cost import ProgramCost

  gpu = targets.CHIPS["h100"]  # 450 GB/s links, 989 TFLOP/s, 3.35 TB/s
  ms = lambda x: x * 1e-3
  gather = (0.9e9, 2.0, ((989e9, 1e6, 1.0),))  # 2 ms each, twice, behind 1 ms of matmul
  hidden = (0.45e9, 1.0, ((0.0, 1.675e9, 2.0),))  # 1 ms behind two 0.5 ms fusions
  alone = (0.45e9, 1.0, ())  # nothing scheduled while it runs
  total = 2 * 0.9e9 + 0.45e9 + 0.45e9 + 2.7e9  # and 6 ms of synchronous all-reduce
  cost = ProgramCost(0.0, 0.0, total, [], (), (gather, hidden, alone))
  assert report.exposed_collective_seconds(cost, gpu) == pytest.approx(
      ms(2 * (2 - 1) + 0 + 1 + 6))
  terms = report._terms(cost, gpu, calls=3)
  assert terms["collective"] == pytest.approx(3 * ms(9))
  plain = ProgramCost(0.0, 0.0, total, [])
  assert report.exposed_collective_seconds(plain, gpu) == pytest.approx(total / 450e9)
