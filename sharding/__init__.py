"""Meshes, logical-axis rules (one table per role), placement and weight sync.

Model parameters carry `logical_axes` metadata (see jaxrl_post.models.transformer); this
package maps those names to mesh axes, so model code never names a mesh.
"""

from jaxrl_post.sharding.activations import activation_rules, active_mesh, active_rules, constrain
from jaxrl_post.sharding.mesh import (AXES, DistributedConfig, MeshConfig,
                                      distributed_config_from_env, initialize, make_mesh)
from jaxrl_post.sharding.platform import (context_platform, mesh_platform, on_accelerator,
                                          target_platform)
from jaxrl_post.sharding.placement import Meshes, PlacementConfig, build_meshes
from jaxrl_post.sharding.rules import (ROLLOUT_RULES, TRAINING_RULES, logical_to_spec,
                                       spec_axes, tree_shardings)
from jaxrl_post.sharding.sync import PartialSync, RolloutWeights, SyncConfig, WeightSync

__all__ = ["AXES", "activation_rules", "active_mesh", "active_rules", "context_platform",
           "mesh_platform", "on_accelerator", "target_platform", "constrain", "DistributedConfig", "MeshConfig", "Meshes", "PartialSync",
           "PlacementConfig",
           "ROLLOUT_RULES", "RolloutWeights", "SyncConfig", "TRAINING_RULES", "WeightSync",
           "build_meshes", "distributed_config_from_env", "initialize", "logical_to_spec",
           "make_mesh", "spec_axes", "tree_shardings"]
