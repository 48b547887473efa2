"""The engine on a rollout mesh: one jitted program over every device equals one device.

Slots and pages split over "data" (one allocator per data shard), KV heads over "tensor";
prefix sharing, cascade attention, chunked prefill and continuous batching run within each
data shard. Greedy tokens must be identical and behaviour logprobs equal within float32
rounding (tensor parallelism sums the heads' contributions in another order).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_post.models import ModelConfig
from jaxrl_post.models.transformer import init_model, params_of
from jaxrl_post.rollout import Engine, SamplingParams, generate
from jaxrl_post.rollout.scheduler import SchedulerConfig
from jaxrl_post.sharding import MeshConfig, make_mesh
from tests.rollout import helpers as H

MESHES = {"data4_tensor2": MeshConfig(data=4, fsdp=1, tensor=2),
          "data8": MeshConfig(data=8, fsdp=1),
          "tensor2": MeshConfig(data=1, fsdp=1, tensor=2)}
# 12 prompts of lengths 1..38 (page size 4: multiples and not), more groups than blocks.
LENGTHS = [1, 3, 4, 5, 8, 9, 13, 16, 21, 30, 33, 38]


def _mesh(name):
  cfg = MESHES[name]
  n = cfg.data * cfg.tensor
  return make_mesh(cfg, jax.devices()[:n])


def _run(engine_cfg, mesh=None, model=None, n=3, max_tokens=9):
  model = model or H.model()
  eng = Engine.from_model(model, engine_cfg, mesh=mesh)
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, model.config.vocab_size, size=k).tolist() for k in LENGTHS]
  greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
  out = generate(eng, prompts, n=n, sampling=greedy,
                 scheduler=SchedulerConfig(prefill_tokens_per_step=8))
  assert eng.pages_in_use == 0 and all(a.reserved == 0 for a in eng.allocs)
  return out


def _assert_same(got, want):
  for g_req, w_req in zip(got, want):
    for g, w in zip(g_req, w_req):
      assert g.tokens == w.tokens
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=2e-5)


def _cases():
  """Every mesh with independent slots; cascade blocks on the mesh with both axes (the
  other two meshes' cascade cases are sweep cases)."""
  for mesh in sorted(MESHES):
    for group_slots in (0, 3):
      marks = pytest.mark.sweep if group_slots and mesh != "data4_tensor2" else ()
      yield pytest.param(mesh, group_slots, marks=marks, id=f"{mesh}-{group_slots}")


@pytest.mark.parametrize("mesh,group_slots", list(_cases()))
def test_greedy_on_a_mesh_equals_one_device(mesh, group_slots):
  cfg = dataclasses.replace(H.ENGINE, num_slots=6, group_slots=group_slots, prefill_chunk=8,
                            decode_steps=4)
  want = _run(cfg)
  got = _run(cfg, _mesh(mesh))
  _assert_same(got, want)


def test_heads_that_do_not_divide_the_tensor_axis_stay_replicated():
  model = init_model(ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=64,
                                 num_layers=2, num_heads=6, num_kv_heads=3, head_dim=8,
                                 compute_dtype="float32", max_position_embeddings=128), seed=3)
  cfg = dataclasses.replace(H.ENGINE, num_slots=4, group_slots=2)
  eng = Engine.from_model(model, cfg, mesh=_mesh("data4_tensor2"))
  assert eng.layout.kv_axis is None
  _assert_same(_run(cfg, _mesh("data4_tensor2"), model, n=2), _run(cfg, None, model, n=2))


def test_slots_and_pages_split_over_data_shards():
  cfg = dataclasses.replace(H.ENGINE, num_slots=6, group_slots=2)
  eng = Engine.from_model(H.model(), cfg, mesh=_mesh("data4_tensor2"))
  assert eng.num_slots == 8 and eng.slots_per_shard == 2  # Rounded up to whole blocks.
  assert len(eng.allocs) == 4
  assert eng.pool.k.shape[2] == 4 * H.NUM_PAGES
  # Each device holds its data shard's pages of its KV head.
  shard = eng.pool.k.addressable_shards[0].data
  assert shard.shape == (1, H.CFG.num_layers, H.NUM_PAGES, H.PAGE_SIZE, H.CFG.head_dim)
  assert {str(s.sharding.spec) for s in jax.tree.leaves(eng.params)} - {"PartitionSpec()"}


def test_weights_from_another_device_are_moved_onto_the_mesh():
  params = jax.device_put(params_of(H.model()), jax.devices()[5])
  eng = Engine(H.CFG, params, H.ENGINE, mesh=_mesh("data8"))
  devices = set(eng.layout.mesh.devices.flat)
  assert all(set(x.sharding.device_set) == devices for x in jax.tree.leaves(eng.params))


def test_the_pool_keeps_its_sharding_through_prefill_so_shapes_compile_once():
  """Programs that return the pool hand it back as it was created: a differently spelled
  but equivalent sharding (replicated over a data axis of size 1) would make the next
  call's jit compile the same shapes again."""
  eng = Engine.from_model(H.model(), H.ENGINE, mesh=_mesh("tensor2"))
  created = eng.pool.k.sharding
  generate(eng, [[1, 2, 3], [4, 5, 6, 7, 8]], sampling=SamplingParams(temperature=0.0,
                                                                      max_tokens=3))
  assert eng.pool.k.sharding == created and eng.pool.v.sharding == created


def test_a_request_pinned_to_a_data_shard_takes_only_its_pages():
  """Scheduler.submit(shard=...) (the multi-turn driver balances held pages itself): the
  request's samples prefill and decode on that shard alone, whatever has more room."""
  from jaxrl_post.rollout.scheduler import Scheduler

  eng = Engine.from_model(H.model(), H.ENGINE, mesh=_mesh("data4_tensor2"))
  sched = Scheduler(eng, SchedulerConfig())
  greedy = SamplingParams(temperature=0.0, max_tokens=6)
  rids = [sched.submit([5, 6, 7, 8, 9], greedy, n=2, shard=3) for _ in range(2)]
  seen = set()
  while not sched.idle:
    sched.step()
    seen.add(tuple(a.in_use + a.reserved > 0 for a in eng.allocs))
  assert seen - {(False, False, False, False)} == {(False, False, False, True)}
  assert all(len(c.tokens) == 6 for rid in rids for c in sched.results[rid])
  with pytest.raises(ValueError, match="shard 4"):
    sched.submit([1], greedy, shard=4)
