"""Abstract TPU chips for compile-only tests: libtpu's topologies on a CPU-only host.

`jax.experimental.topologies.get_topology_desc` gives devices that run no computation but
that the real XLA:TPU and Mosaic compilers compile for; a mesh of them makes every program
traced over it a TPU program (see jaxrl_post.sharding.platform).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_post.sharding import AXES


@functools.lru_cache(maxsize=None)
def tpu_devices(topology: str) -> tuple:
  """The chips of a TPU topology such as "v5e:2x2"; skips the test without libtpu."""
  pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]')")
  from jax.experimental import topologies
  return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def tpu_mesh(topology: str, **shape: int) -> Mesh:
  """A mesh with the project's axes over the topology's first chips: `shape` names axis
  sizes (unnamed axes are 1); with none, "data" spans every chip."""
  devices = tpu_devices(topology)
  sizes = {name: shape.get(name, 1) for name in AXES}
  if not shape:
    sizes["data"] = len(devices)
  used = devices[:int(np.prod(list(sizes.values())))]
  return Mesh(np.asarray(used, dtype=object).reshape([sizes[a] for a in AXES]), AXES)
