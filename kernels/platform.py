"""Which platform a kernel call is built for, and so which lowering it takes.

Read from the mesh jax has in context while tracing (a shard_map body, `jax.set_mesh`,
`jax.sharding.use_abstract_mesh`), whose devices may be abstract TPU or GPU chips while the
host tracing it is a CPU; only with no mesh in context does the host's backend decide.
Callers that know their target better (jaxrl_post.sharding.target_platform) pass the
backend and interpret flags explicitly instead.
"""

from __future__ import annotations

import jax


def kernel_platform() -> str:
  """"cpu", "gpu" or "tpu" for the kernel call being traced."""
  mesh = jax.sharding.get_abstract_mesh()
  platform = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
  return "gpu" if platform in ("cuda", "rocm") else platform
