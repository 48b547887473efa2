"""The run's programs compiled by the real XLA:TPU and Mosaic compilers (libtpu's
compile-only topology, v5e 2x2) from this CPU host, with the Pallas kernels inside them:
a lowering break in a kernel or in the programs around it fails here the day it is made.
Also the plan's cost walker (loops by trip count) and its targets."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrl_post import plan
from jaxrl_post.models import preset
from jaxrl_post.plan import hlo_cost, hlo_sources, report, targets
from jaxrl_post.rl.trainer import TrainerConfig
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.tpu import tpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = preset("tiny", remat="full")


def test_train_step_compiles_for_tpu_with_the_splash_kernel_inside_shard_map():
  mesh = make_mesh(MeshConfig(fsdp=-1), tpu_devices("v5e:2x2"))
  # Rows longer than TrainingAttention.plain_max_len take the kernel path.
  m = plan.train_step_memory(CFG, TrainerConfig(row_tokens=1024), mesh, rows=4,
                             completion_len=256, analyse=True, largest=3)
  assert any(k.endswith("mosaic") for k in m.compiled.kernels), m.compiled.kernels
  assert m.compiled.cost.flops > 0 and m.peak_bytes > 0
  # libtpu reports no buffer assignment: the largest buffers come from its dumped report.
  sizes = [a.bytes for a in m.largest]
  assert len(sizes) == 3 and sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
  assert all("[" in a.values for a in m.largest)


def test_decode_loop_compiles_for_tpu_with_the_paged_mosaic_kernel():
  mesh = make_mesh(MeshConfig(data=2, tensor=2, fsdp=1), tpu_devices("v5e:2x2"))
  m = plan.decode_loop_memory(CFG, num_slots=16, pages_per_shard=64, mesh=mesh, steps=4,
                              analyse=True)
  assert "paged_attention mosaic" in m.kernels
  # Sampling takes no lax.cond on a TPU: the logits would cross into it relaid out, a copy
  # of the whole [B, V] f32 row every step (rollout.programs._shortcuts).
  assert "conditional" not in m.launches["by_kind"], m.launches
  # The same program traced over CPU devices keeps the jnp path: the mesh decides.
  cpu = plan.decode_loop_memory(CFG, num_slots=16, pages_per_shard=64, steps=4,
                                mesh=make_mesh(MeshConfig(data=2, tensor=2, fsdp=1),
                                               jax.devices()[:4]), analyse=True)
  assert cpu.kernels == ()


def test_a_sliding_window_models_decode_loop_compiles_for_tpu_with_the_windowed_kernel():
  """Sliding-window layers (Mistral, Gemma 3's local ones) run the paged kernel over their
  window's pages on the TPU too (the table from the window's first page, the keys before
  the window masked in the kernel): it must compile there, with the in-place KV write."""
  import dataclasses

  mesh = make_mesh(MeshConfig(data=2, tensor=2, fsdp=1), tpu_devices("v5e:2x2"))
  windowed = dataclasses.replace(CFG, sliding_window=24)
  m = plan.decode_loop_memory(windowed, num_slots=16, pages_per_shard=64, mesh=mesh, steps=4,
                              analyse=True)
  assert "paged_attention mosaic" in m.kernels and "kv_page_write mosaic" in m.kernels


def test_cascade_decode_compiles_for_tpu_with_both_paged_kernel_parts():
  """Blocks of samples sharing their prompt's pages: the prefix and suffix parts of the
  cascade kernel are two paged Mosaic calls in each layer (plain decode has one)."""
  from jaxrl_post.rollout.attention import SharedPrefix

  mesh = make_mesh(MeshConfig(data=2, tensor=2, fsdp=1), tpu_devices("v5e:2x2"))
  layout = RolloutLayout.build(CFG, mesh)
  params, pool, state = plan.memory.decode_operands(CFG, 16, 64, 16, 16, "bfloat16",
                                                    "bfloat16", 8, layout)
  blocks = 16 // 4
  shared = SharedPrefix(jax.ShapeDtypeStruct((blocks, 4), jnp.int32, sharding=layout.rows(2)),
                        jax.ShapeDtypeStruct((blocks,), jnp.int32, sharding=layout.rows(1)))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    text = plan.memory.lower_decode(CFG, params, pool, state, 2, layout, truncation=False,
                                    shared=shared).compile().as_text()
  paged = [line for line in text.splitlines()
           if 'custom_call_target="tpu_custom_call"' in line and "paged_attention" in line]
  assert len(paged) == 2, len(paged)


def test_cost_walker_counts_scanned_layers_by_their_trip_count():
  def layers(w, x):
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]

  for n in (3, 6):
    w = jax.ShapeDtypeStruct((n, 128, 128), jnp.float32)
    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    cost = hlo_cost.program_cost(jax.jit(layers).lower(w, x).compile().as_text())
    assert cost.flops == n * 2 * 16 * 128 * 128  # XLA's cost_analysis counts one layer
    assert cost.unknown_loops == []
    assert cost.bytes >= n * 128 * 128 * 4  # every layer's weights are read


_GATHER_AFTER_ELEMENTWISE = """
%fused (p0: f32[64,4096], p1: f32[64], p2: s32[64,8,2]) -> f32[64,8,1,1] {
  %p0 = f32[64,4096]{1,0} parameter(0)
  %p1 = f32[64]{0} parameter(1)
  %b = f32[64,4096]{1,0} broadcast(%p1), dimensions={0}
  %d = f32[64,4096]{1,0} divide(%p0, %b)
  %e = f32[64,4096]{1,0} exponential(%d)
  %v = f32[262144]{0} bitcast(%e)
  %w = f32[64,4096]{1,0} bitcast(%v)
  %p2 = s32[64,8,2]{2,1,0} parameter(2)
  ROOT %g = f32[64,8,1,1]{3,2,1,0} gather(%w, %p2), offset_dims={2,3}, collapsed_slice_dims={}, start_index_map={0,1}, index_vector_dim=2, slice_sizes={1,1}
}

ENTRY %main (x: f32[64,4096], t: f32[64], i: s32[64,8,2]) -> f32[64,8,1,1] {
  %x = f32[64,4096]{1,0} parameter(0)
  %t = f32[64]{0} parameter(1)
  %i = s32[64,8,2]{2,1,0} parameter(2)
  ROOT %f = f32[64,8,1,1]{3,2,1,0} fusion(%x, %t, %i), kind=kLoop, calls=%fused
}
"""


def test_a_fusion_reads_of_an_operand_only_what_its_gather_takes_through_elementwise_ops():
  """A row's chosen logits gathered out of an op over the whole row (the draw's scaled
  logits): the fusion computes the op for the gathered elements only, and reads those."""
  cost = hlo_cost.program_cost(_GATHER_AFTER_ELEMENTWISE)
  gathered = 64 * 8 * 4
  assert cost.bytes == gathered + 64 * 4 + 64 * 8 * 2 * 4 + gathered  # + the index, out
  whole = _GATHER_AFTER_ELEMENTWISE.replace("%e = f32[64,4096]{1,0} exponential(%d)",
                                            "%e = f32[64,4096]{1,0} reverse(%d), dimensions={1}")
  assert hlo_cost.program_cost(whole).bytes >= 64 * 4096 * 4  # not elementwise: all of it
  # An elementwise op that is the fusion's output reads every element.
  output = _GATHER_AFTER_ELEMENTWISE.replace("ROOT %g", "%g").replace(
      "%e = f32[64,4096]{1,0} exponential(%d)", "ROOT %e = f32[64,4096]{1,0} exponential(%d)")
  assert hlo_cost.program_cost(output).bytes >= 64 * 4096 * 4


# XLA:TPU's prefetches into VMEM (S(1)): a layer's weight slice and an array copied in.
_ASYNC_COPIES = """
ENTRY %main (w: bf16[2,1024,512], x: f32[64,512]) -> (bf16[1,1024,512], f32[64,512]) {
  %w = bf16[2,1024,512]{2,1,0:T(8,128)(2,1)} parameter(0)
  %x = f32[64,512]{1,0:T(8,128)} parameter(1)
  %ss = ((bf16[2,1024,512]{2,1,0:T(8,128)(2,1)}), bf16[1,1024,512]{2,1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[1:2], [0:1024], [0:512]}
  %sd = bf16[1,1024,512]{2,1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  %cs = (f32[64,512]{1,0:T(8,128)S(1)}, f32[64,512]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%x)
  %cd = f32[64,512]{1,0:T(8,128)S(1)} copy-done(%cs)
  ROOT %t = (bf16[1,1024,512]{2,1,0:T(8,128)(2,1)S(1)}, f32[64,512]{1,0:T(8,128)S(1)}) tuple(%sd, %cd)
}
"""


def test_an_asynchronous_copy_into_vmem_costs_the_read_of_what_it_copies():
  """A slice-start reads its slice (not the whole operand) and a copy-start its source,
  once each: the source their tuple names is an alias, the VMEM destination and the -done
  move nothing in HBM."""
  cost = hlo_cost.program_cost(_ASYNC_COPIES)
  assert cost.bytes == 1024 * 512 * 2 + 64 * 512 * 4
  into_hbm = _ASYNC_COPIES.replace("(2,1)S(1)}, s32", "(2,1)}, s32")
  assert hlo_cost.program_cost(into_hbm).bytes == 2 * 1024 * 512 * 2 + 64 * 512 * 4


def _in_loop(w, x):  # Module-level functions: the sources below are named by them.
  return jax.lax.fori_loop(0, 10, lambda i, h: jnp.tanh(h @ w), x)


def _once(x):
  return jnp.exp(x) * 2.0


def test_bytes_by_source_names_the_functions_that_traced_them():
  w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  text = jax.jit(lambda w, x: _once(_in_loop(w, x))).lower(w, x).compile().as_text()
  sources = hlo_sources.bytes_by_source(text, top=50)
  by = {s["source"].split(" ")[0]: s for s in sources}
  assert by["_in_loop.<locals>.<lambda>"]["launches"] % 10 == 0  # each trip counted
  assert by["_in_loop.<locals>.<lambda>"]["bytes"] > by["_once"]["bytes"] > 0
  assert "tests/test_plan_tpu.py:" in by["_once"]["source"]
  assert sum(s["bytes"] for s in sources) == pytest.approx(hlo_cost.program_cost(text).bytes)
  assert sum(s["share"] for s in sources) == pytest.approx(1.0, abs=1e-3)


def test_cost_walker_counts_a_predicated_conds_branches_and_its_flag_reads():
  """lax.cond on a bool compiles to a conditional naming true/false computations: its
  costlier branch is counted, and its flag, and a data-dependent loop exit's, are reads."""
  def loop(w, x, flag):
    def body(carry):
      i, h = carry
      h = jax.lax.cond(flag, lambda h: jnp.tanh(h @ w), lambda h: h, h)
      return i + 1, h
    return jax.lax.while_loop(lambda c: (c[0] < 4) & (c[1][0, 0] < 9.0), body, (0, x))[1]

  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  text = jax.jit(loop).lower(w, x, jax.ShapeDtypeStruct((), jnp.bool_)).compile().as_text()
  assert hlo_cost.program_cost(text).flops >= 2 * 16 * 128 * 128
  launches = hlo_cost.loop_launches(text)
  assert launches["flag_reads"] == 2 and launches["by_kind"]["conditional"] == 1, launches


def test_targets_name_the_published_slices():
  v5p = targets.resolve("v5p-8")
  assert (v5p.chips, v5p.topology, v5p.platform) == (4, "v5p:2x2x1", "tpu")
  assert targets.resolve("v5e-8").topology == "v5e:2x4"
  assert targets.resolve("h100x8").chip.hbm_bytes == 80e9
  h200 = targets.resolve("h200x1")  # The one-GPU nodes people rent.
  assert (h200.chip.name, h200.chips, h200.platform) == ("h200", 1, "gpu")
  with pytest.raises(Exception, match="unknown target 'v7-9'"):
    targets.resolve("v7-9")
  found = targets.target_devices(targets.resolve("v6e-4"))
  assert len(found.devices) == 4 and found.compiled_for == "target"
  # Abstract chips: plan keeps their programs out of the persistent cache (none would load).
  assert found.compile_only
  assert not targets.target_devices(targets.resolve("local")).compile_only


def _plan_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxrl_post.plan", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_plan_cli_on_the_quickstart_prints_a_json_verdict():
  out = _plan_cli("--gin_file=configs/quickstart.gin", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout)
  for key in ("target", "devices", "fits", "peak_gb_per_device", "kv_tokens",
              "attention_backends", "predicted_s", "sync_bytes", "grad_bytes_per_rank",
              "rollout_payload_bytes", "decode_bytes_vs_floor"):
    assert key in result
  assert result["fits"] is True and result["target"] == "local"
  assert set(result["predicted_s"]) == {"prefill", "decode", "train", "sync", "step"}
  assert result["predicted_s"]["step"] > 0 and result["kv_tokens"] > 0
  assert result["rollout_payload_bytes"] == 32 * 8 * 4 * 12  # samples x tokens x 12 bytes
  # Where the train step's bytes go, by the model code that traced them.
  train = result["bytes_by_source"]["train"]
  assert train and all(0 < s["share"] <= 1 for s in train), train
  assert any("models/" in s["source"] for s in train), train


def test_plan_cli_errors_are_one_line():
  out = _plan_cli("--gin_file=configs/quickstart.gin", "--target=v9-1")
  assert out.returncode == 2 and out.stderr.strip().startswith("error: plan: unknown target")


def test_a_plan_that_does_not_fit_says_so_and_lists_the_largest_buffers():
  from jaxrl_post.pipeline import config
  from jaxrl_post.plan import programs

  config.parse([os.path.join(ROOT, "configs/quickstart.gin")], [])
  exp = config.build_experiment()
  compiled = programs.compile_programs(exp, jax.devices()[:1])
  small = targets.Chip("small", "tpu", 1e6, 1e11, 1e13, 1e10)
  verdict = report.build(compiled, targets.Target("small", small, 1), small, exp, 1)
  assert verdict.fits is False and verdict.largest_buffers
  assert "does NOT fit" in report.text(verdict)
  # A pool short of the slots' need says by how much, and what sizes the slots to it.
  short = dataclasses.replace(verdict, kv_tokens=verdict.kv_tokens_needed // 4)
  assert ("tokens: short, the pool holds 25% of the slots' sequences at their longest "
          "(--fit sizes the slots to it)") in report.text(short)
  # On a chip that pays per kernel, the decode's kernels cost time, and the text says how much.
  gpu_like = dataclasses.replace(small, platform="gpu", kernel_s=4e-6)
  paid = report.build(compiled, targets.Target("gpu-like", gpu_like, 1), gpu_like, exp, 1)
  kernels = paid.decode_kernels_per_step["total"]
  assert paid.roofline_s["decode"]["kernels"] > 0 and verdict.roofline_s["decode"]["kernels"] == 0
  assert paid.predicted_s["decode"] > verdict.predicted_s["decode"]
  assert f"decode kernels per step: {kernels:.0f} (" in report.text(paid)
  assert "s of the decode's at 4 us each)" in report.text(paid)


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
@pytest.mark.slow
@pytest.mark.sweep  # tests/test_plan_gpu.py compiles the decode loop for an H100 in every run.
def test_plan_compiles_for_an_h100_without_one_with_the_triton_kernels():
  out = _plan_cli("--gin_file=configs/quickstart.gin", "--target=h100x1", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout)
  assert result["compiled_for"] == "target"
  # The quickstart decodes in cascade blocks: the prefix kernel, then the one appending K/V.
  assert result["attention_backends"]["decode"] == ("paged_attention_append triton, "
                                                    "paged_attention_blocks triton")
  kernels = result["decode_kernels_per_step"]  # Each layer's weights read in place.
  assert kernels["total"] > 0 and "slice_copy" not in kernels["by_kind"], kernels
  assert result["roofline_s"]["decode"]["kernels"] > 0  # each launch costs device time
  # What jax's allocator holds of the GPU in a run, not the whole 80 GB.
  assert result["chip"]["hbm_bytes"] == pytest.approx(0.9 * 80e9)
  assert any("XLA_PYTHON_CLIENT_MEM_FRACTION" in note for note in result["notes"])


def test_a_run_takes_the_gpu_memory_share_unless_the_user_sets_one():
  show = ("import os, jaxrl_post; from jaxrl_post import cuda_plugin; "
          "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], cuda_plugin.gpu_memory_share())")
  env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  for value, want in ((None, "0.9 0.9"), ("0.5", "0.5 0.5")):
    run_env = env if value is None else {**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": value}
    out = subprocess.run([sys.executable, "-c", show], cwd=ROOT, env=run_env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == want.split(), out.stderr[-2000:]


def test_a_moe_models_decode_loop_reads_its_expert_weights_in_place_on_tpu():
  """XLA:TPU copies each layer's expert matrices out of the stacked weights before the
  grouped matmuls read them, so on a TPU mesh the engine holds a mixture-of-experts
  model's weights one buffer per layer (RolloutLayout.build): the loop reads each expert
  matrix once, where the stacked form reads it, writes the copy and reads that. Experts
  of a real model's size: a layer's small enough to fit in VMEM are prefetched there, a
  read of HBM either way."""
  from jaxrl_post.models.config import MoeConfig
  from jaxrl_post.plan import memory

  cfg = CFG.replace(hidden_size=2048, head_dim=64, param_dtype="bfloat16",
                    compute_dtype="bfloat16",
                    moe=MoeConfig(num_experts=64, experts_per_token=2, intermediate_size=1024))
  mesh = make_mesh(MeshConfig(fsdp=1, expert=4), tpu_devices("v5e:2x2"))
  assert RolloutLayout.build(cfg, mesh).split_layers
  assert not RolloutLayout.build(CFG, mesh).split_layers  # Dense: read in place anyway.
  read = {}
  for split in (False, True):
    layout = RolloutLayout.build(cfg, mesh, split)
    args = memory.decode_operands(cfg, 16, 64, 16, 4, "bfloat16", "bfloat16", 8, layout)
    compiled = memory.lower_decode(cfg, *args, 4, layout).compile()
    read[split] = memory.compiled_memory(compiled, analyse=True).cost.bytes
  # Per device and step: 16 local experts x 3 matrices x 2 layers of 2048 x 1024 bf16
  # (403 MB); the stacked loop read 2.2x the split one's bytes when this test was written.
  expert_bytes = 16 * 3 * 2 * 2048 * 1024 * 2 * 4  # x 4 steps
  assert read[False] - read[True] >= expert_bytes, read
  assert read[True] < 0.6 * read[False], read
