"""Device meshes from config, over all devices of all processes, and multi-host start-up."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_post.errors import UserError

# Axis order matters: the last axis varies fastest over the ordered device list, so
# "tensor" groups neighbouring devices (same host, fastest links) for its collectives.
AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the named mesh axes; one of them may be -1 (all remaining devices)."""

  data: int = 1
  fsdp: int = -1
  expert: int = 1  # Reserved for mixture-of-experts layers.
  tensor: int = 1

  def shape(self, num_devices: int, name: str = "mesh config") -> tuple[int, ...]:
    """The axis sizes over `num_devices`; `name` says which mesh in an error."""
    sizes = [getattr(self, a) for a in AXES]
    bad = [f"{a}={s}" for a, s in zip(AXES, sizes) if s == 0 or s < -1]
    if bad or sizes.count(-1) > 1:
      raise UserError(f"{name}: invalid axis sizes {bad or sizes} (positive, or one -1)")
    known = math.prod(s for s in sizes if s != -1)
    given = " x ".join(f"{a}={s}" for a, s in zip(AXES, sizes))
    if -1 in sizes:
      if num_devices % known:
        raise UserError(f"{name}: {given}: the other axes ({known} devices) do not divide "
                        f"the {num_devices} devices the -1 axis shares out")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise UserError(f"{name}: {given} is {math.prod(sizes)} devices and the run has "
                      f"{num_devices}; make the sizes multiply to {num_devices} or set one "
                      "to -1")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None,
              name: str = "mesh config") -> Mesh:
  """A mesh over `devices` (default: every device of every process), in the given order.

  Every mesh of one program is built from the same ordered device list, so a reshard
  between two meshes over the same devices is a collective, never a host copy.
  """
  devices = list(jax.devices() if devices is None else devices)
  return Mesh(np.asarray(devices, dtype=object).reshape(cfg.shape(len(devices), name)),
              AXES)


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process start-up through jax.distributed.

  `auto` lets jax detect the cluster (TPU pods, SLURM, Open MPI, GKE); otherwise give the
  coordinator address and this process's id explicitly. One process needs nothing.
  """

  coordinator_address: Optional[str] = None
  num_processes: int = 1
  process_id: int = 0
  auto: bool = False
  cpu_collectives: str = "gloo"  # Cross-process collectives for CPU devices.


def initialize(cfg: DistributedConfig) -> None:
  """Starts jax.distributed before any device is touched; a no-op for one process."""
  if not cfg.auto and cfg.num_processes == 1:
    return
  if not cfg.auto and not cfg.coordinator_address:
    raise UserError(f"distributed config: num_processes={cfg.num_processes} needs "
                    "coordinator_address (host:port)")
  if not cfg.auto and not 0 <= cfg.process_id < cfg.num_processes:
    raise UserError(f"distributed config: process_id={cfg.process_id} is not in "
                    f"[0, {cfg.num_processes})")
  # Only affects CPU devices; GPU/TPU use NCCL/ICI. Must be set before initialize.
  jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
  if cfg.auto:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id)


def distributed_config_from_env() -> DistributedConfig:
  """JAXRL_COORDINATOR / JAXRL_NUM_PROCESSES / JAXRL_PROCESS_ID, for launch scripts."""
  n = int(os.environ.get("JAXRL_NUM_PROCESSES", "1"))
  return DistributedConfig(coordinator_address=os.environ.get("JAXRL_COORDINATOR"),
                           num_processes=n, process_id=int(os.environ.get("JAXRL_PROCESS_ID", "0")))
