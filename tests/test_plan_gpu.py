"""The rollout's decode loop as XLA:GPU compiles it for an H100, on this CPU host (the
gpu-plan extra: jax's CUDA plugin and ptxas): each layer's weights are read in place (with
LoRA adapters too), and no step reads a control flag back to the host.

XLA:GPU copies a scanned layer's slice of a stacked weight into a buffer of its own
before a matmul reads it; on a GPU the engine holds its weights one buffer per layer
(rollout.weights) so no such copy is left in the loop. The stacked form compiled beside it
shows the copies, so the check sees them where they are.
"""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post.plan import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = """
import json
from jaxrl_post.plan import targets
target = targets.resolve("h100x1")
targets.prepare(target)
import jax, numpy as np
from jax.sharding import Mesh
from jaxrl_post.models import ModelConfig
from jaxrl_post.plan import memory
from jaxrl_post.plan.hlo_cost import leaf_costs, loop_launches, parse, program_cost
from jaxrl_post.models import LoraConfig
from jaxrl_post.rollout.layout import RolloutLayout
from jaxrl_post.sharding import AXES
cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, param_dtype="bfloat16",
                  compute_dtype="bfloat16", max_position_embeddings=256)
device = targets.target_devices(target).devices[0]
mesh = Mesh(np.asarray([device], dtype=object).reshape((1,) * len(AXES)), AXES)
out = {}
for split in (False, True):
  layout = RolloutLayout.build(cfg, mesh, split)
  args = memory.decode_operands(cfg, 8, 1 + 8 * 4, 16, 4, "bfloat16", "bfloat16", 8, layout)
  text = memory.lower_decode(cfg, *args, 4, layout, False).compile().as_text()
  out["split" if split else "stacked"] = {**loop_launches(text), "bytes": program_cost(text).bytes}
# Launches of a decode step that read all of the step's f32 logits [8 slots, 512]: the
# sampling's passes over them (the LM head's matmul writes them).
shapes = {i.name: i.shape for c in parse(text)[0].values() for i in c}
out["logit_passes"] = sum(
    times > 1 and cost.bytes >= 8 * 512 * 4 and "f32[8,512]" in instr.shape + "".join(
        shapes.get(o, "") for o in instr.operands) for instr, times, cost in leaf_costs(text)
    if instr.opcode != "custom-call" and "gemm" not in instr.attrs)
# Qwen3's q and k norms, applied with RoPE inside the attention kernels (kernels.qk_prep):
# the same launches as the model without them.
normed = cfg.replace(qk_norm=True)
args = memory.decode_operands(normed, 8, 1 + 8 * 4, 16, 4, "bfloat16", "bfloat16", 8, layout)
out["qk_norm"] = loop_launches(memory.lower_decode(normed, *args, 4, layout, False).compile()
                               .as_text())
# Adapters on all 7 matrices: XLA's dot merger put W and A side by side when their products
# were alike (a copy of W every step); a LoRA step reads about what the base's does.
lora = cfg.replace(lora=LoraConfig(rank=8, targets=("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                    "w_down")))
args = memory.decode_operands(lora, 8, 1 + 8 * 4, 16, 4, "bfloat16", "bfloat16", 8, layout)
text = memory.lower_decode(lora, *args, 4, layout, False).compile().as_text()
out["lora"] = {**loop_launches(text), "bytes": program_cost(text).bytes}
# Cascade decode (blocks of 4 rows sharing prompt pages): the prefix kernel reads the rows'
# queries in place, its splits go to the suffix kernel, which writes the K/V and returns
# the layer's attention itself.
from jaxrl_post.rollout.attention import SharedPrefix
int32 = lambda shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=layout.rows(len(shape)))
args = memory.decode_operands(cfg, 8, 1 + 8 * 4, 16, 4, "bfloat16", "bfloat16", 8, layout)
text = memory.lower_decode(cfg, *args, 4, layout, False,
                           shared=SharedPrefix(int32((2, 4)), int32((2,)))).compile().as_text()
out["cascade"] = loop_launches(text)
# K and V of 36 GB (1,450,000 pages), the share of an H100 a run gives its pool: XLA:GPU
# counted them twice and rematerialised the loop's fusions, K/V writes included.
args = memory.decode_operands(cfg, 8, 1_450_001, 16, 4, "bfloat16", "bfloat16", 8, layout)
text = memory.lower_decode(cfg, *args, 4, layout, False).compile().as_text()
out["big_pool"] = {**loop_launches(text), "remat": text.count(".remat")}
# The service's batched LoRA forward/backward (serve.adapters) over the base as a server on
# a GPU holds it (split per layer, shared with its engines). Its stacked form, the copies
# the decode loop's comparison above shows, takes as long again to compile: not compiled.
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl_post.models.transformer import abstract_model, params_of
from jaxrl_post.plan.hlo_cost import program_launches
from jaxrl_post.rollout import weights
from jaxrl_post.serve import adapters
spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
served = cfg.replace(lora=LoraConfig(rank=8, targets=adapters.ATTN + adapters.MLP))
shapes = adapters.adapter_shapes(served)
bank = jax.tree.map(spec, jax.eval_shape(lambda: adapters.stacked(shapes, 3)))
base = jax.tree.map(spec, params_of(abstract_model(cfg)))
rows = lambda dtype, *shape: spec(jax.ShapeDtypeStruct((4, *shape), dtype))
batch = {"slot": rows(np.int32), "tokens": rows(np.int32, 32), "targets": rows(np.int32, 32),
         "mask": rows(np.float32, 32), "inputs": {"weights": rows(np.float32, 32)}}
program = adapters.batch_program(served, "cross_entropy", False)
compiled = program.trace(bank, bank, weights.abstract_split(base, 3), batch, {}).lower().compile()
out["service"] = program_launches(compiled.as_text())
print(json.dumps(out))
"""


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_the_h100_decode_loop_copies_no_layer_weights():
  out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  launches = json.loads(out.stdout.strip().splitlines()[-1])
  stacked, split = launches["stacked"]["by_kind"], launches["split"]["by_kind"]
  assert stacked.get("slice_copy", 0) >= 3 * 7  # 7 matrices (and norms) per layer
  assert "slice_copy" not in split and "copy" not in split, split
  # A layer is 8 launches: the norm, the Q/K/V product, attention (with the q/k norms,
  # RoPE and the K/V write), the O product, the residual add and norm, the gate-and-up
  # product, SwiGLU, the down product; then a step's sampling and bookkeeping (22).
  assert launches["split"]["total"] <= 3 * 8 + 22, launches["split"]
  assert launches["qk_norm"]["total"] == launches["split"]["total"], launches["qk_norm"]
  # The draw reads the logits once: max, block masses and argmax in one reduction (three
  # passes before; at 256 rows of Llama 3's vocabulary each is 131 MB a step).
  assert launches["logit_passes"] == 1, launches["logit_passes"]
  # No flag read back per step: the loop runs a trip count XLA knows, sampling no cond.
  assert launches["split"]["flag_reads"] == 0 and "conditional" not in split, launches
  big = launches["big_pool"]
  assert big["remat"] == 0 and big["total"] == launches["split"]["total"], big
  # 1.15x the base's bytes (the adapters' products and their sum, which the base's
  # q, k and v do without); 1.41x with W copied beside A.
  lora = launches["lora"]
  assert lora["bytes"] <= 1.2 * launches["split"]["bytes"], (lora, launches["split"])
  assert "copy" not in lora["by_kind"] and lora["flag_reads"] == 0, lora
  # Per layer the prefix kernel beside plain decode's launches (a merge of the two
  # kernels' outputs and its rounding would be two more, a grouped copy of the queries
  # one), and per step a few for the blocks' tables.
  cascade = launches["cascade"]
  assert cascade["by_kind"]["attention"] == 2 * 3, cascade
  assert cascade["total"] <= launches["split"]["total"] + 3 + 4, (cascade, split)
  # The service's training program over the split base copies no layer's weights either.
  service = launches["service"]
  assert "slice_copy" not in service["by_kind"], service
  # Each row's adapter gathered once for all layers: its gradient goes back into the slots
  # in one scatter per LoRA matrix (A and B of 7), not one per matrix and layer.
  assert service["by_kind"].get("update", 0) <= 2 * 7, service
  # 251 launches for 3 layers, the A products grouped by input (serve.adapters.bind_rows):
  # the forward, its recompute and the backward of 7 LoRA'd matrices a layer, plus the head.
  assert service["total"] <= 270, service


_PREFILL = """
from jaxrl_post.plan import targets
target = targets.resolve("h100x1")
targets.prepare(target)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl_post import kernels
from jaxrl_post.plan.hlo_cost import program_cost
device = targets.target_devices(target).devices[0]
mesh = Mesh(np.asarray([device], dtype=object).reshape(1), ("x",))
s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
r, t, k, ps = 12, 24, 64, 16  # the engine's packed rows of 24 tokens, 64 key pages each
for d, hq, hkv, window in ((64, 9, 3, None), (128, 32, 8, None), (256, 8, 4, 1024)):
  pool = s((hkv, 512, ps, d), jnp.bfloat16)
  fn = lambda *a: kernels.paged_prefill_attention(*a, window=window)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    text = jax.jit(fn).trace(s((r, t, hq, d), jnp.bfloat16), pool, pool, s((r, k)), s((r, k)),
                             s((r, k)), s((r, t)), s((r, t))).lower().compile().as_text()
  print("compiled", d, int(program_cost(text).flops))
"""


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_the_prefill_kernel_compiles_for_an_h100_at_every_head_dim():
  """SmolLM2 (64), Llama (128) and Gemma 3 (256) heads: ptxas and the shared-memory limit
  (227 KB) are only met in a real compile, which jax.export's lowering does not run."""
  out = subprocess.run([sys.executable, "-c", _PREFILL], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [line.split() for line in out.stdout.strip().splitlines()]
  assert [line[:2] for line in lines] == [["compiled", "64"], ["compiled", "128"],
                                          ["compiled", "256"]]
  # plan counts the call as the kernel does: 4 x rows x KV heads x query rows (24 tokens x
  # 3 heads, padded to a block of 128) x keys (64 pages of 16) x head_dim.
  assert int(lines[0][2]) == 4 * 12 * 3 * 128 * 64 * 16 * 64


_SAMPLING = """
from jaxrl_post.plan import targets
target = targets.resolve("h100x8")
targets.prepare(target)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl_post.plan.hlo_cost import parse
from jaxrl_post.rollout.sampling import sample_with_floors
from jaxrl_post.sharding import ROLLOUT_RULES, MeshConfig, activation_rules, make_mesh
mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2), list(targets.target_devices(target).devices))
b, v = 64, 128256  # Llama 3's vocabulary, its logits split over tensor as the LM head's
s = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
rows = lambda dt: s((b,), dt, P("data"))

def draw(logits, keys, t, k, p):
  with activation_rules(ROLLOUT_RULES, mesh):
    return sample_with_floors(logits, keys, t, k, p, True, True, shortcuts=False)

with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
  text = jax.jit(draw).trace(s((b, v), jnp.float32, P("data", "tensor")),
                             rows(jax.random.key(0).dtype), rows(jnp.float32), rows(jnp.int32),
                             rows(jnp.float32)).lower().compile().as_text()
computations, _ = parse(text)
print(sum(i.opcode in ("while", "conditional") for c in computations.values() for i in c))
"""


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_sampling_over_a_tensor_split_vocabulary_runs_no_loop_on_gpus():
  """The inverse-CDF draw's cumulative sum over vocabulary blocks split between GPUs ran
  as a loop of one step per block (2,004 for Llama 3: 14,000 launches per decode step)."""
  out = subprocess.run([sys.executable, "-c", _SAMPLING], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1] == "0"


_TRAIN_FSDP = """
from jaxrl_post.plan import targets
target = targets.resolve("h100x8")
targets.prepare(target)
import json, jax
from jaxrl_post.models import ModelConfig
from jaxrl_post.plan import memory
from jaxrl_post.rl.trainer import TrainerConfig
from jaxrl_post.sharding import MeshConfig, make_mesh
# An LM head of 64 x 65,536 (8 of the chunked log-probability pass's vocabulary blocks)
# beside one small layer, float32 masters over fsdp 8, bf16 compute, 2 micro-batches.
cfg = ModelConfig(vocab_size=65536, hidden_size=64, intermediate_size=128, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=32, param_dtype="float32",
                  compute_dtype="bfloat16", max_position_embeddings=512,
                  tie_word_embeddings=False)
mesh = make_mesh(MeshConfig(fsdp=8), list(targets.target_devices(target).devices))
step = memory.train_step_memory(cfg, TrainerConfig(row_tokens=64), mesh, rows=8,
                                completion_len=32, micro_batches=2, analyse=True)
from jaxrl_post.plan import report
cost, chip = step.compiled.cost, targets.CHIPS["h100"]
print(json.dumps({"collective": cost.collective_bytes, "bf16_weights": 2 * cfg.num_params,
                  "async": len(cost.overlapped),
                  "covered": sum(bool(cover) for _, _, cover in cost.overlapped),
                  "async_bytes": sum(b * n for b, n, _ in cost.overlapped),
                  "exposed_s": report.exposed_collective_seconds(cost, chip),
                  "total_s": cost.collective_bytes / chip.link_bytes_per_s}))
"""


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_the_fsdp_train_step_gathers_the_lm_head_once_per_micro_batch():
  """The chunked log-probability pass reads the LM head one vocabulary block at a time;
  XLA:GPU all-gathered the whole vocab-sharded head at every block of every pass
  (Llama-3.1-8B on 8 x H100: 55% of the train step's collective bytes). Gathered once per
  micro-batch, the step moves per micro-batch about what FSDP needs: the weights for the
  forward and the backward in bf16 and the gradients' reduction (the head's in float32)."""
  out = subprocess.run([sys.executable, "-c", _TRAIN_FSDP], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  moved = json.loads(out.stdout.strip().splitlines()[-1])
  # 3.1 weights' worth per micro-batch; 8.5 with the head gathered at every block.
  assert moved["collective"] <= 2 * 4 * moved["bf16_weights"], moved
  # XLA:GPU runs the collectives asynchronously, most with kernels scheduled while they
  # move (plan.hlo_cost pairs each start with its done): the plan counts what outlasts
  # those kernels.
  assert moved["covered"] > moved["async"] / 2 > 0, moved
  assert moved["async_bytes"] <= moved["collective"] + 1
  assert 0 < moved["exposed_s"] < moved["total_s"], moved


_SHORT_ROWS = """
from jaxrl_post.plan import targets
target = targets.resolve("h100x1")
targets.prepare(target)
import json, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl_post.models import layers as L
from jaxrl_post.plan.hlo_cost import kernels_in, program_cost
mesh = Mesh(np.asarray(targets.target_devices(target).devices[:1]), ("x",))
spec = lambda dt, *shape: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
rows, length = 32, 128  # Llama-3.2-1B's heads: 32 query and 8 KV heads of 64
q, kv = spec(jnp.bfloat16, rows, length, 32, 64), spec(jnp.bfloat16, rows, length, 8, 64)
seg = spec(jnp.int32, rows, length)
out = {}
for name, config, window in (("default", L.TrainingAttention(), None),
                             ("plain", L.TrainingAttention(plain_max_len=512), None),
                             ("window", L.TrainingAttention(), 16)):
  def loss(q, k, v, seg, pos):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      attend = L.packed_attention_fn(seg, pos, window, config)
      return jnp.sum(jnp.square(attend(q, k, v).astype(jnp.float32)))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = grads.trace(q, kv, kv, seg, seg).lower().compile().as_text()
  out[name] = {"bytes": program_cost(text).bytes, "kernels": kernels_in(text),
               "flops": program_cost(text).flops, "flops_32": program_cost(text, 32).flops}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def short_rows() -> dict:
  out = subprocess.run([sys.executable, "-c", _SHORT_ROWS], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_short_training_rows_take_the_attention_kernels_on_a_gpu(short_rows):
  """XLA:GPU writes the plain path's float32 scores and probabilities to HBM several times
  over in the forward and backward; the Triton kernels keep them on chip, so on a GPU
  they take rows of every length (a row of one 128-token sequence, bench_step's)."""
  moved = short_rows
  assert moved["default"]["kernels"] == ["packed_attention_dkv triton",
                                         "packed_attention_dq triton",
                                         "packed_attention_fwd triton"], moved
  assert moved["plain"]["kernels"] == []
  assert moved["default"]["bytes"] < moved["plain"]["bytes"] / 5, moved


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
def test_the_plan_counts_the_flops_of_the_gpus_training_attention_kernels(short_rows):
  """The Triton calls carry no cost estimate; the plan counts 4, 8 and 6 FLOPs per query,
  key and head dim in the forward, dK/dV and dQ kernels, over the keys a query sees: its
  segment's up to it (a row of one sequence, or of sequences of at most 32 tokens), or
  its window's (the window is in the kernels' names)."""
  moved = short_rows
  per_key = (4 + 8 + 6) * 32 * 128 * 32 * 64  # rows x tokens x query heads x head_dim
  assert moved["default"]["flops"] == pytest.approx(per_key * 129 / 2)
  assert moved["default"]["flops_32"] == pytest.approx(per_key * 33 / 2)
  assert moved["window"]["kernels"] == ["packed_attention_dkv_window16 triton",
                                        "packed_attention_dq_window16 triton",
                                        "packed_attention_fwd_window16 triton"]
  assert moved["window"]["flops"] == pytest.approx(per_key * (16 - 16 * 15 / 256))
  assert moved["window"]["flops_32"] == pytest.approx(per_key * (16 - 16 * 15 / 64))
