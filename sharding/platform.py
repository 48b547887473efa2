"""The platform a program is built for: read from its mesh, never from the host.

Kernel backends (Mosaic on TPU, Triton on GPU, the Pallas interpreter or plain jnp on a
CPU), interpret mode and the scheduler's overlap are choices about the devices a program
will run on. The host that traces it may be another platform: a CPU host compiles a TPU
slice's programs through libtpu's compile-only topologies (jaxrl_post.plan). So every such
choice asks `target_platform()`, which looks, innermost first, at

1. the mesh jax has in context while tracing: a shard_map's body, `jax.set_mesh` or
   `jax.sharding.use_abstract_mesh` (an AbstractMesh knows its devices' platform);
2. the mesh of the enclosing `activation_rules` block (the trainer's and engine's traces);
3. jax.default_backend(), for code traced with no mesh at all (tests, tools).
"""

from __future__ import annotations

from typing import Optional

import jax

from jaxrl_post.kernels.platform import mesh_platform, normalise, traced_platform
from jaxrl_post.sharding.activations import active_mesh

__all__ = ["ACCELERATORS", "context_platform", "mesh_platform", "on_accelerator",
           "target_platform"]

ACCELERATORS = ("gpu", "tpu")


def context_platform() -> Optional[str]:
  """The platform of the mesh in context while tracing (see module doc), else None."""
  traced = traced_platform()
  if traced is not None:
    return traced
  mesh = active_mesh()
  return None if mesh is None else mesh_platform(mesh)


def target_platform() -> str:
  """The platform the program being traced runs on (the host's backend only as a last
  resort, when no mesh is in context)."""
  return context_platform() or normalise(jax.default_backend())


def on_accelerator(platform: Optional[str] = None) -> bool:
  return (platform or target_platform()) in ACCELERATORS
