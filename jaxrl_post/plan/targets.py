"""Hardware a run can be planned for: the local devices, TPU slices and GPU nodes.

TPU slices compile for real: libtpu's compile-only topologies give abstract chips that
the XLA:TPU and Mosaic compilers target from any host. This jax cannot compile for a GPU
without one (its CUDA plugin needs a device to describe the target), so a GPU target
plans from the host backend's programs over as many fake devices, with the GPU's memory
and peaks; the report says so (`Target.compiled_for`).

Published per-chip figures (vendors' spec sheets): HBM capacity and bandwidth, dense
bfloat16 FLOP/s, and the interconnect a collective between chips uses (ICI for TPU,
NVLink for GPU), one direction.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Optional

from jaxrl_post.errors import UserError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures (per chip; a v4/v5p chip is one megacore device).

  Attributes:
    name: "v5e", "h100", ...
    platform: "tpu" or "gpu".
    hbm_bytes: memory capacity.
    hbm_bytes_per_s: memory bandwidth.
    bf16_flops_per_s: dense bfloat16 peak.
    link_bytes_per_s: chip-to-chip bandwidth a collective uses, one direction.
    topology_prefix: libtpu's topology name prefix ("v5e", "v5p", ...); GPUs: "".
  """

  name: str
  platform: str
  hbm_bytes: float
  hbm_bytes_per_s: float
  bf16_flops_per_s: float
  link_bytes_per_s: float
  topology_prefix: str = ""


CHIPS = {
    "v4": Chip("v4", "tpu", 32 * GB, 1.2e12, 275e12, 6 * 50e9, "v4"),
    "v5e": Chip("v5e", "tpu", 16 * GB, 0.819e12, 197e12, 4 * 50e9, "v5e"),
    "v5p": Chip("v5p", "tpu", 95 * GB, 2.765e12, 459e12, 6 * 100e9, "v5p"),
    "v6e": Chip("v6e", "tpu", 32 * GB, 1.64e12, 918e12, 4 * 112e9, "v6e"),
    "h100": Chip("h100", "gpu", 80 * GB, 3.35e12, 989e12, 450e9),
    "h200": Chip("h200", "gpu", 141 * GB, 4.8e12, 989e12, 450e9),
    "a100": Chip("a100", "gpu", 80 * GB, 2.039e12, 312e12, 300e9),
}

# Slice name -> chips. v4 and v5p names count TensorCores, two per chip (v5p-8 is 4 chips);
# v5e and v6e names count chips.
TPU_SLICES = {
    "v4": (8, 16, 32), "v5p": (8, 16, 32, 64, 128),
    "v5e": (4, 8, 16, 32, 64, 256), "v6e": (4, 8, 16, 32, 64, 256),
}
GPU_NODES = {"h100x1": ("h100", 1), "h100x8": ("h100", 8), "h200x8": ("h200", 8),
             "a100x8": ("a100", 8)}


@dataclasses.dataclass(frozen=True)
class Target:
  """Where a plan's programs run.

  Attributes:
    name: "local", "v5p-8", "h100x8", ...
    chip: the chip's figures (None: the local devices, whose figures are measured).
    chips: how many chips the programs span (a TPU topology may present a chip as
      several devices: v4 as its two TensorCores).
    topology: libtpu topology name ("v5p:2x2x1") for TPU slices, else "".
  """

  name: str
  chip: Optional[Chip]
  chips: int
  topology: str = ""

  @property
  def platform(self) -> str:
    return self.chip.platform if self.chip else "local"

  @property
  def compiled_for(self) -> str:
    """What the programs were compiled for: the target itself, or the host's backend."""
    if self.chip is None or self.chip.platform == "tpu":
      return "target"
    return "host backend (no deviceless GPU compiler in this jax)"


def _tpu_topology(chip: str, chips: int) -> str:
  """libtpu's topology name: 2-D tori for v5e/v6e, 3-D for v4/v5p, as square as it goes."""
  if chip in ("v5e", "v6e"):
    x = 2 ** (int(math.log2(chips)) // 2)
    return f"{chip}:{x}x{chips // x}"
  dims = [1, 1, 1]
  for i in range(int(math.log2(chips))):
    dims[(i + 1) % 3 if chips > 4 else i % 2] *= 2
  dims = sorted(dims[:2]) + [dims[2]]
  return f"{chip}:{dims[0]}x{dims[1]}x{dims[2]}"


def known_targets() -> list[str]:
  names = ["local"] + [f"{c}-{n}" for c, sizes in TPU_SLICES.items() for n in sizes]
  return names + list(GPU_NODES)


def resolve(name: str, local_devices: int = 0) -> Target:
  """The Target called `name`; one UserError listing the known names otherwise."""
  if name == "local":
    return Target("local", None, local_devices)
  match = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name)
  if match and int(match.group(2)) in TPU_SLICES[match.group(1)]:
    chip, count = match.group(1), int(match.group(2))
    chips = count // 2 if chip in ("v4", "v5p") else count
    return Target(name, CHIPS[chip], chips, _tpu_topology(chip, chips))
  if name in GPU_NODES:
    chip, count = GPU_NODES[name]
    return Target(name, CHIPS[chip], count)
  raise UserError(f"plan: unknown target {name!r} (known: {', '.join(known_targets())})")


def compile_only_tpu_env() -> None:
  """Environment for libtpu on a host without TPUs, set before jax starts its backends.

  Several processes may load libtpu at once (it otherwise holds a machine-wide lock
  file), and it looks for no TPU metadata server or worker list, which a CPU host lacks.
  Explicit settings win.
  """
  for key, value in (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                     ("TPU_ACCELERATOR_TYPE", "v5litepod-4")):
    os.environ.setdefault(key, value)


def target_devices(target: Target) -> list:
  """The devices `target`'s programs are compiled over.

  Raises:
    UserError: a TPU target without libtpu (the `tpu` extra), or a GPU/local target with
      fewer host devices than it needs (GPU targets set the host's fake device count
      before jax starts: see `host_device_flags`).
  """
  import jax

  if target.chip is not None and target.chip.platform == "tpu":
    try:
      import libtpu  # noqa: F401
    except ImportError:
      raise UserError(f"plan: target {target.name} compiles with libtpu, which is not "
                      "installed: pip install -e '.[tpu]'") from None
    from jax.experimental import topologies
    return list(topologies.get_topology_desc(topology_name=target.topology,
                                             platform="tpu").devices)
  devices = jax.devices()
  if target.chips and len(devices) < target.chips:
    raise UserError(f"plan: target {target.name} needs {target.chips} devices but the host "
                    f"backend has {len(devices)}; set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={target.chips}")
  return devices[:target.chips] if target.chips else devices


def host_device_flags(target: Target) -> None:
  """Before jax starts: enough fake host devices to stand in for a GPU node's devices."""
  if target.chip is None or target.chip.platform != "gpu":
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={target.chips}").strip()
