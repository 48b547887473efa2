"""Placement of the trainer and rollout roles on devices: colocated or split.

Roles and placement are data: a frozen config names each role's mesh and, when split, how
many of the ordered devices the trainer takes. Both meshes always come from one ordered
device list, so every transfer between them stays on the devices.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
from jax.sharding import Mesh

from jaxrl_post.errors import UserError
from jaxrl_post.sharding import hosts
from jaxrl_post.sharding.mesh import MeshConfig, make_mesh

PLACEMENT_MODES = ("colocated", "split")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  """Which devices each role uses, and the mesh shape of each role.

  Attributes:
    mode: "colocated" (both roles on all devices) or "split" (disjoint device subsets).
    trainer_devices: split only: the first N devices train, the rest roll out
      (0: half of them).
    trainer_mesh: FSDP x TP mesh for training.
    rollout_mesh: TP mesh for rollout, replicated over "data".
    num_devices: use only the first N devices (0: all of them).
  """

  mode: str = "colocated"
  trainer_devices: int = 0
  trainer_mesh: MeshConfig = MeshConfig(fsdp=-1)
  rollout_mesh: MeshConfig = MeshConfig(data=-1, fsdp=1)
  num_devices: int = 0

  def __post_init__(self):
    if self.mode not in PLACEMENT_MODES:
      raise UserError(f"placement config: mode={self.mode!r} is not one of {PLACEMENT_MODES}")
    if not isinstance(self.num_devices, int) or self.num_devices < 0:
      raise UserError(f"placement config: num_devices must be >= 0, got {self.num_devices!r}")


@dataclasses.dataclass(frozen=True)
class Meshes:
  trainer: Mesh
  rollout: Mesh

  @property
  def colocated(self) -> bool:
    return set(self.trainer.devices.flat) == set(self.rollout.devices.flat)

  @property
  def on_every_process(self) -> bool:
    """Whether every process holds devices of both roles (always so on one process)."""
    return hosts.everywhere(self.trainer) and hosts.everywhere(self.rollout)


def build_meshes(cfg: PlacementConfig,
                 devices: Optional[Sequence[jax.Device]] = None) -> Meshes:
  devices = list(jax.devices() if devices is None else devices)
  if cfg.num_devices:
    if cfg.num_devices > len(devices):
      raise UserError(f"placement config: num_devices={cfg.num_devices} but only "
                      f"{len(devices)} devices exist")
    devices = devices[:cfg.num_devices]
  if cfg.mode == "colocated":
    return Meshes(make_mesh(cfg.trainer_mesh, devices, "trainer_mesh"),
                  make_mesh(cfg.rollout_mesh, devices, "rollout_mesh"))
  n = cfg.trainer_devices or len(devices) // 2
  if not 0 < n < len(devices):
    raise UserError(f"placement config: trainer_devices={cfg.trainer_devices} leaves no "
                    f"devices for one role ({len(devices)} devices)")
  return Meshes(make_mesh(cfg.trainer_mesh, devices[:n], "trainer_mesh (split placement)"),
                make_mesh(cfg.rollout_mesh, devices[n:], "rollout_mesh (split placement)"))
