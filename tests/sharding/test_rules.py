"""Meshes and logical-axis rules."""

import math

import jax
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models import abstract_model, preset
from jaxrl_post.models.transformer import logical_axes, params_of
from jaxrl_post.sharding import (ROLLOUT_RULES, TRAINING_RULES, MeshConfig, logical_to_spec,
                                 make_mesh, tree_shardings)
from jax.sharding import PartitionSpec as P


def test_mesh_fills_the_free_axis_and_orders_tensor_innermost():
  mesh = make_mesh(MeshConfig(fsdp=-1, tensor=2))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
  assert [d.id for d in mesh.devices.reshape(-1, 2)[0]] == [0, 1]


@pytest.mark.parametrize("cfg", [MeshConfig(fsdp=3), MeshConfig(data=-1, fsdp=-1),
                                 MeshConfig(fsdp=0), MeshConfig(data=3, fsdp=-1)])
def test_bad_mesh_configs_are_one_line_errors(cfg):
  with pytest.raises(UserError, match="mesh config"):
    make_mesh(cfg)


def test_a_role_mesh_that_does_not_cover_the_devices_names_the_role_and_the_fix():
  from jaxrl_post.sharding.placement import PlacementConfig, build_meshes
  cfg = PlacementConfig(trainer_mesh=MeshConfig(fsdp=3))
  with pytest.raises(UserError, match=r"^trainer_mesh: data=1 x fsdp=3 x expert=1 x "
                     r"tensor=1 is 3 devices and the run has 8; make the sizes multiply to "
                     r"8 or set one to -1$"):
    build_meshes(cfg)
  cfg = PlacementConfig(rollout_mesh=MeshConfig(data=-1, fsdp=3))
  with pytest.raises(UserError, match=r"^rollout_mesh: .*fsdp=3.* do not divide the 8 "):
    build_meshes(cfg)


def test_training_shards_outputs_over_tensor_and_fsdp():
  mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
  spec = lambda names, shape: logical_to_spec(names, shape, TRAINING_RULES, mesh)
  assert spec(("layers", "embed", "heads", "head_dim"), (2, 64, 32, 8)) == \
      P(None, None, ("tensor", "fsdp"), None)
  # 2 KV heads take only "tensor"; the input dim then takes "fsdp".
  assert spec(("layers", "embed", "kv_heads", "head_dim"), (2, 64, 2, 8)) == \
      P(None, "fsdp", "tensor", None)
  # 9 heads divide by neither: the input dim takes "fsdp", heads stay whole.
  assert spec(("embed", "heads", "head_dim"), (576, 9, 64)) == P("fsdp", None, None)
  assert spec(("batch", None), (8, 16)) == P("fsdp", None)


def test_rollout_is_tensor_parallel_and_replicated_over_data():
  mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  spec = lambda names, shape: logical_to_spec(names, shape, ROLLOUT_RULES, mesh)
  assert spec(("layers", "embed", "mlp"), (2, 64, 128)) == P(None, None, "tensor")
  assert spec(("vocab", "embed"), (128, 64)) == P("tensor", None)
  assert spec(("layers", "embed"), (2, 64)) == P(None, None)


def test_full_size_model_is_fully_sharded_for_training():
  """llama3-8b by shape only: every matrix is split 8 ways, so each device holds 1/8."""
  model = abstract_model(preset("llama3-8b"))
  shapes = params_of(model)
  mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
  shardings = tree_shardings(logical_axes(model), shapes, TRAINING_RULES, mesh)
  total = per_device = 0
  for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    total += math.prod(x.shape)
    per_device += math.prod(s.shard_shape(x.shape))
  assert per_device / total == pytest.approx(1 / 8, rel=1e-3)
