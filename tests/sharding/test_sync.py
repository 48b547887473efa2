"""Weight sync: values, versions, donation, placement, LoRA, no host transfer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_post.models import LoraConfig, abstract_model
from jaxrl_post.models.transformer import is_adapter, logical_axes, params_of, split_adapters
from jaxrl_post.sharding import (MeshConfig, PartialSync, PlacementConfig, SyncConfig,
                                 WeightSync, build_meshes)
from jaxrl_post.sharding import hosts
from jaxrl_post.rollout.weights import SplitLayers, is_split
from tests.sharding.helpers import CFG, batch, logits_fn, sharded_init

PLACEMENTS = {
    "colocated": PlacementConfig(trainer_mesh=MeshConfig(fsdp=4, tensor=2),
                                 rollout_mesh=MeshConfig(data=4, fsdp=1, tensor=2)),
    "split": PlacementConfig(mode="split", trainer_devices=4,
                             trainer_mesh=MeshConfig(fsdp=2, tensor=2),
                             rollout_mesh=MeshConfig(data=2, fsdp=1, tensor=2)),
}
HOST_OPS = ("outfeed", "infeed", "is_host_transfer=true", "callback", "host-memory")


def make_sync(placement, cfg=CFG, kind=nnx.Param, every=1):
  meshes = build_meshes(PLACEMENTS[placement])
  abstract = abstract_model(cfg)
  sync = WeightSync(meshes, logical_axes(abstract, kind), params_of(abstract, kind),
                    SyncConfig(every_n_steps=every))
  return meshes, sync


def no_host_transfers():
  """Host<->device transfers raise, explicit or not; device-to-device stays allowed."""
  return _Guards()


class _Guards:
  def __enter__(self):
    self._ctx = [jax.transfer_guard_host_to_device("disallow_explicit"),
                 jax.transfer_guard_device_to_host("disallow_explicit")]
    for c in self._ctx:
      c.__enter__()

  def __exit__(self, *exc):
    for c in reversed(self._ctx):
      c.__exit__(*exc)


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_sync_preserves_values_up_to_the_cast_and_bumps_the_version(placement):
  meshes, sync = make_sync(placement)
  train = sharded_init(CFG, meshes.trainer, seed=1)
  rollout = sync.initial(train)
  with no_host_transfers():
    new = sync(train, rollout)
  assert (rollout.version, new.version) == (0, 1)
  rollout_devices = set(meshes.rollout.devices.flat)
  for t, r, s in zip(jax.tree.leaves(train), jax.tree.leaves(new.params),
                     jax.tree.leaves(sync.rollout_shardings)):
    assert r.dtype == jnp.bfloat16 and r.sharding == s
    assert set(r.sharding.device_set) == rollout_devices
    np.testing.assert_array_equal(np.asarray(r), np.asarray(t.astype(jnp.bfloat16)))
  assert all(x.is_deleted() for x in jax.tree.leaves(rollout.params))  # recycled / freed


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_rollout_logits_identical_after_syncing_unchanged_weights(placement):
  meshes, sync = make_sync(placement)
  train = sharded_init(CFG, meshes.trainer, seed=2)
  weights = sync.initial(train)
  logits = logits_fn(CFG.replace(compute_dtype="bfloat16"))
  tokens, positions = batch()
  before = np.asarray(logits(weights.params, tokens, positions))
  weights = sync(train, weights)
  weights = sync(train, weights)
  after = np.asarray(logits(weights.params, tokens, positions))
  np.testing.assert_array_equal(before, after)
  assert weights.version == 2


def test_colocated_sync_is_one_program_with_collectives_and_no_host_traffic():
  meshes, sync = make_sync("colocated")
  train = sharded_init(CFG, meshes.trainer)
  rollout = sync.initial(train)
  hlo = sync.compiled_text(train, rollout.params)
  assert "all-gather" in hlo or "all-to-all" in hlo or "collective-permute" in hlo
  for op in HOST_OPS:
    assert op not in hlo, op
  # Donation: the old rollout buffers are aliased to the outputs.
  assert "input_output_alias" in hlo or "may-alias" in hlo or "must-alias" in hlo


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_lora_sync_moves_only_the_adapters(placement):
  cfg = CFG.replace(lora=LoraConfig(rank=4, targets=("wq", "wv", "w_up")))
  meshes, full = make_sync(placement, cfg)
  abstract = abstract_model(cfg)
  sync = PartialSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig(),
                     moves=is_adapter)
  assert 0 < sync.bytes_per_sync < 0.2 * full.bytes_per_sync
  assert sync.bytes_per_sync == sum(x.size * 2 for x in jax.tree.leaves(
      params_of(abstract, nnx.LoRAParam)))  # bf16 adapters, nothing else
  train = jax.device_put(jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                                      params_of(abstract)), full.train_shardings)
  weights = sync.initial(train)
  base_before = {id(x) for x in jax.tree.leaves(split_adapters(weights.params)[1])}
  trained = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 1 if is_adapter(path) else x, train)
  with no_host_transfers():
    weights = sync(trained, weights)
  assert weights.version == 1
  adapters, base = split_adapters(weights.params)
  assert len(jax.tree.leaves(adapters)) == 6
  assert jax.tree.structure(weights.params) == jax.tree.structure(train)
  assert all(bool(jnp.all(x == 1)) for x in jax.tree.leaves(adapters))
  # The engine's base copy is the one made at the start, not a new one.
  assert {id(x) for x in jax.tree.leaves(base)} == base_before
  for x, want in zip(jax.tree.leaves(weights.params), jax.tree.leaves(full.rollout_shardings)):
    assert x.sharding.is_equivalent_to(want, x.ndim) and x.dtype == jnp.bfloat16
  # What a checkpoint keeps, and putting it back.
  moving = sync.moving(weights.params)
  assert jax.tree.structure(moving) == jax.tree.structure(adapters)
  back = sync.with_moving(weights.params, jax.tree.map(jnp.zeros_like, moving))
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(split_adapters(back)[0]))


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_a_sync_in_the_engines_per_layer_form_writes_each_layer_once(placement):
  """A split engine's weights are the sync's output: the layers exist once, each layer's
  buffers recycled in place by the next sync (colocated), values as the stacked sync's."""
  meshes, stacked = make_sync(placement)
  abstract = abstract_model(CFG)
  form = SplitLayers(CFG.num_layers)
  sync = WeightSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig(),
                    form=form)
  train = sharded_init(CFG, meshes.trainer, seed=3)
  want = stacked.initial(train).params
  rollout = sync.initial(train)
  with no_host_transfers():
    new = sync(train, rollout)
  assert is_split(new.params) and len(new.params["layers"]) == CFG.num_layers
  assert all(x.is_deleted() for x in jax.tree.leaves(rollout.params))  # recycled / freed
  for i, layer in enumerate(new.params["layers"]):
    for name, w in layer.items():
      np.testing.assert_array_equal(np.asarray(w), np.asarray(want["layers"][name][i]))
      spec = tuple(want["layers"][name].sharding.spec)[1:]
      layer_sharding = NamedSharding(meshes.rollout, P(*spec))
      assert w.sharding.is_equivalent_to(layer_sharding, w.ndim), (name, w.sharding)
  np.testing.assert_array_equal(np.asarray(new.params["embed"]), np.asarray(want["embed"]))
  if placement == "colocated":  # Every output buffer is a donated input's.
    hlo = sync.compiled_text(train, new.params)
    header = hlo.splitlines()[0]  # HloModule ..., input_output_alias={ {0}: (12, {}, ...
    assert header.count("may-alias)") + header.count("must-alias)") == len(
        jax.tree.leaves(new.params))


def test_a_lora_sync_in_the_per_layer_form_keeps_its_base_and_moves_the_adapters():
  cfg = CFG.replace(lora=LoraConfig(rank=4, targets=("wq", "w_up")))
  meshes = build_meshes(PLACEMENTS["colocated"])
  abstract = abstract_model(cfg)
  sync = PartialSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig(),
                     moves=is_adapter, form=SplitLayers(cfg.num_layers))
  train = sharded_init(cfg, meshes.trainer, seed=4)
  weights = sync.initial(train)
  assert is_split(weights.params)
  base = {id(w) for layer in weights.params["layers"] for n, w in layer.items()
          if "_lora_" not in n}
  trained = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 1 if is_adapter(path) else x, train)
  with no_host_transfers():
    new = sync(trained, weights)
  for i, layer in enumerate(new.params["layers"]):
    for name, w in layer.items():
      want = trained["layers"][name][i].astype(jnp.bfloat16)
      np.testing.assert_array_equal(np.asarray(w), np.asarray(want))
  assert base == {id(w) for layer in new.params["layers"] for n, w in layer.items()
                  if "_lora_" not in n}
  moving = sync.moving(new.params)  # What a checkpoint keeps: each layer's adapters.
  assert all(set(layer) == {"wq_lora_a", "wq_lora_b", "w_up_lora_a", "w_up_lora_b"}
             for layer in moving["layers"])
  back = sync.with_moving(new.params, jax.tree.map(jnp.zeros_like, moving))
  assert is_split(back) and all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(
      sync.moving(back)))


def test_bytes_and_schedule():
  _, sync = make_sync("colocated", every=3)
  n = sum(x.size for x in jax.tree.leaves(params_of(abstract_model(CFG))))
  assert sync.bytes_per_sync == 2 * n  # bf16
  assert [s for s in range(1, 10) if sync.due(s)] == [3, 6, 9]


@pytest.mark.parametrize("trainer_devices, rollout", [(4, MeshConfig(data=2, fsdp=1, tensor=2)),
                                                      (2, MeshConfig(data=-1, fsdp=1))])
def test_the_collective_transfer_between_meshes_equals_the_shard_copy(trainer_devices, rollout):
  """What a sync does when the roles sit on different processes (sharding/hosts.py), run
  here on one: one ppermute per round from the trainer's devices to the rollout's, with no
  host traffic. 2 trainer devices feed 6 rollout replicas in 3 rounds."""
  meshes = build_meshes(PlacementConfig(mode="split", trainer_devices=trainer_devices,
                                        trainer_mesh=MeshConfig(fsdp=-1),
                                        rollout_mesh=rollout))
  abstract = abstract_model(CFG)
  sync = WeightSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig())
  mirrored = sync._first(sharded_init(CFG, meshes.trainer, seed=3))
  want = jax.tree.map(np.asarray, mirrored)
  with no_host_transfers():
    got = hosts.transfer(mirrored, sync.rollout_shardings, sync._mirror, meshes.rollout)
  for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                     jax.tree.leaves(sync.rollout_shardings)):
    assert g.sharding == s
    for shard in g.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
