"""Which platform a program is built for: the one helper kernels and meshes both ask.

A platform is read from a mesh's devices (abstract ones included), never from the host:
a CPU host compiles TPU and GPU programs over abstract chips (jaxrl_post.plan). A kernel
call reads the mesh jax has in context while tracing (a shard_map body, `jax.set_mesh`,
`jax.sharding.use_abstract_mesh`); only with none does the host's backend decide.
jaxrl_post.sharding.platform adds the mesh of an enclosing `activation_rules` block, for
the trainer's and engine's traces.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
from jax.sharding import AbstractMesh, Mesh


def normalise(platform: str) -> str:
  """"gpu" for the device platforms "cuda"/"rocm"; jax.default_backend() and our tables
  say "gpu"."""
  return "gpu" if platform in ("cuda", "rocm") else platform


def mesh_platform(mesh: Union[Mesh, AbstractMesh]) -> str:
  """"cpu", "gpu" or "tpu": the platform of `mesh`'s devices (abstract ones included)."""
  if isinstance(mesh, AbstractMesh):
    return normalise(mesh.abstract_device.platform)
  return normalise(mesh.devices.flat[0].platform)


def traced_platform() -> Optional[str]:
  """The platform of the abstract mesh in context while tracing, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh_platform(mesh)


def kernel_platform() -> str:
  """"cpu", "gpu" or "tpu" for the kernel call being traced."""
  return traced_platform() or normalise(jax.default_backend())
