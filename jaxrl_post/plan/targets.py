"""Hardware a run can be planned for: the local devices, TPU slices and GPU nodes.

TPU slices compile for real: libtpu's compile-only topologies give abstract chips that
the XLA:TPU and Mosaic compilers target from any host. GPU nodes compile for real too
where jax's CUDA plugin and ptxas are installed (the `gpu-plan` extra): the plugin builds
a topology from a target description of the GPU (`gpu_target_config`) with no device
present, and XLA:GPU and Triton compile for it. Without the plugin a GPU target plans
from the host backend's programs over as many fake devices, with the GPU's memory and
peaks, and the report says so (`Devices.compiled_for`).

Published per-chip figures (vendors' spec sheets): HBM capacity and bandwidth, dense
bfloat16 FLOP/s, and the interconnect a collective between chips uses (ICI for TPU,
NVLink for GPU), one direction.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional

from jaxrl_post import _libtpu
from jaxrl_post.errors import UserError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA:GPU needs to know of a GPU to compile for it without one (its
  GpuTargetConfig): compute capability, SMs, memory, caches, clock."""

  description: str
  major: int
  minor: int
  sms: int
  memory_bytes: int
  bandwidth: float
  l2_bytes: int
  clock_ghz: float
  smem_per_sm: int
  smem_optin: int


GPU_SPECS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", 9, 0, 132, 84929347584, 3.35e12, 52428800, 1.98,
                    233472, 232448),
    "h200": GpuSpec("NVIDIA H200", 9, 0, 132, 150754820096, 4.8e12, 62914560, 1.98,
                    233472, 232448),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", 8, 0, 108, 85899345920, 2.039e12, 41943040,
                    1.41, 167936, 166912),
}


def gpu_target_config(spec: GpuSpec) -> str:
  """The GpuTargetConfig text proto jax's CUDA plugin takes for a deviceless topology."""
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {spec.smem_per_sm} threads_per_core_limit: 2048
  core_count: {spec.sms} fpus_per_core: 128 block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.bandwidth)} l2_cache_size: {spec.l2_bytes}
  clock_rate_ghz: {spec.clock_ghz} device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.smem_optin}
  cuda_compute_capability {{ major: {spec.major} minor: {spec.minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 13 minor: 0 patch: 0 }}
device_description_str: "{spec.description}"
"""


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

# Device kinds (as jax reports them) of the chips above, lower-cased, most specific first.
_KINDS = (("h100 pcie", None), ("h100", "h100"), ("h200", "h200"), ("a100", "a100"),
          ("v5 lite", "v5e"), ("v5e", "v5e"), ("v6 lite", "v6e"), ("v6e", "v6e"),
          ("v5p", "v5p"), ("v4", "v4"))


def chip_of_kind(device_kind: str) -> Optional[Chip]:
  """The published figures of a local accelerator ("NVIDIA H100 80GB HBM3", "TPU v5p"), or
  None for a kind not in the table (a variant with other peaks, or a CPU)."""
  kind = device_kind.lower()
  return next(((CHIPS[name] if name else None) for key, name in _KINDS if key in kind), None)


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



@dataclasses.dataclass(frozen=True)
class Devices:
  """The devices a target's programs compile over, and for what they really compiled."""

  devices: list
  compiled_for: str  # "target", or why not


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
  _libtpu.compile_only_env()


def has_cuda_compiler() -> bool:
  """Whether jax's CUDA plugin is installed (the `gpu-plan` extra) to compile for GPUs."""
  try:
    return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
  except ModuleNotFoundError:  # no jax plugin package at all
    return False


def prepare(target: Target) -> None:
  """Before jax starts its backends: libtpu's compile-only environment; for a GPU target,
  the CUDA plugin without its device checks (no GPU here), or else enough fake host
  devices to stand in for the node's GPUs."""
  compile_only_tpu_env()
  if target.chip is None or target.chip.platform != "gpu":
    return
  if has_cuda_compiler():
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={target.chips}").strip()


def target_devices(target: Target) -> Devices:
  """The devices `target`'s programs are compiled over.

  Raises:
    UserError: a TPU target without libtpu (the `tpu` extra), or a target needing more
      host devices than the host backend has.
  """
  import jax
  from jax.experimental import topologies

  if target.chip is not None and target.chip.platform == "tpu":
    if importlib.util.find_spec("libtpu") is None:
      raise UserError(f"plan: target {target.name} compiles with libtpu, which is not "
                      "installed: pip install -e '.[tpu]'")
    desc = topologies.get_topology_desc(topology_name=target.topology, platform="tpu")
    return Devices(list(desc.devices), "target")
  if target.chip is not None and target.chip.platform == "gpu" and has_cuda_compiler():
    config = gpu_target_config(GPU_SPECS[target.chip.name])
    desc = topologies.get_topology_desc(platform="cuda", target_config=config,
                                        topology=f"1x1x{target.chips}")
    return Devices(list(desc.devices), "target")
  devices = jax.devices()
  if target.chips and len(devices) < target.chips:
    raise UserError(f"plan: target {target.name} needs {target.chips} devices but the host "
                    f"backend has {len(devices)}; set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={target.chips}")
  why = "target" if target.chip is None else (
      "host backend: no GPU compiler here (pip install -e '.[gpu-plan]' compiles for the GPU)")
  return Devices(devices[:target.chips] if target.chips else devices, why)
