"""Hardware a run can be planned for: the local devices, TPU slices and GPU nodes.

TPU slices compile for real: libtpu's compile-only topologies give abstract chips that
the XLA:TPU and Mosaic compilers target from any host. GPU nodes compile for real too
where jax's CUDA plugin and ptxas are installed (the `gpu-plan` extra): the plugin builds
a topology from a target description of the GPU (`gpu_target_config`) with no device
present, and XLA:GPU and Triton compile for it. Without the plugin a GPU target plans
from the host backend's programs over as many fake devices, with the GPU's memory and
peaks, and the report says so (`Devices.compiled_for`).

The chips' published figures live in one table, jaxrl_post.telemetry.peaks (CHIPS),
which the run's telemetry reads too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Optional

from jaxrl_post import libtpu_plugin
from jaxrl_post.errors import UserError
from jaxrl_post.telemetry.peaks import CHIPS, Chip, chip_of_kind  # noqa: F401  (the table)



@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA:GPU needs to know of a GPU to compile for it without one (its
  GpuTargetConfig) beyond its published figures (CHIPS): compute capability, SMs, the
  memory the driver reports, caches, clock."""

  chip: str  # its CHIPS entry, for the HBM bandwidth
  description: str
  major: int
  minor: int
  sms: int
  memory_bytes: int
  l2_bytes: int
  clock_ghz: float
  smem_per_sm: int
  smem_optin: int


GPU_SPECS = {
    "h100": GpuSpec("h100", "NVIDIA H100 80GB HBM3", 9, 0, 132, 84929347584, 52428800, 1.98,
                    233472, 232448),
    "h200": GpuSpec("h200", "NVIDIA H200", 9, 0, 132, 150754820096, 62914560, 1.98,
                    233472, 232448),
    "a100": GpuSpec("a100", "NVIDIA A100-SXM4-80GB", 8, 0, 108, 85899345920, 41943040,
                    1.41, 167936, 166912),
}


def gpu_target_config(spec: GpuSpec) -> str:
  """The GpuTargetConfig text proto jax's CUDA plugin takes for a deviceless topology."""
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {spec.smem_per_sm} threads_per_core_limit: 2048
  core_count: {spec.sms} fpus_per_core: 128 block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(CHIPS[spec.chip].hbm_bytes_per_s)} l2_cache_size: {spec.l2_bytes}
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


# Slice name -> chips. v4 and v5p names count TensorCores, two per chip (v5p-8 is 4 chips);
# v5e and v6e names count chips.
TPU_SLICES = {
    "v4": (8, 16, 32), "v5p": (8, 16, 32, 64, 128),
    "v5e": (4, 8, 16, 32, 64, 256), "v6e": (4, 8, 16, 32, 64, 256),
}
GPU_NODES = {"h100x1": ("h100", 1), "h100x8": ("h100", 8), "h200x1": ("h200", 1),
             "h200x8": ("h200", 8), "a100x1": ("a100", 1), "a100x8": ("a100", 8)}


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

  @property
  def compile_only(self) -> bool:
    """Whether these are abstract devices of a compile-only client (libtpu's topologies, the
    CUDA plugin on a host without a GPU): their executables cannot be loaded, so none can
    come back from jax's persistent cache either (reading one fails, with a warning, and
    the program is compiled again)."""
    import jax

    platform = self.devices[0].platform if self.devices else "cpu"
    return platform != "cpu" and not any(d.platform == platform for d in jax.devices())


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
  libtpu_plugin.compile_only_env()


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


def measured_peaks(devices) -> tuple[float, float]:
  """(FLOP/s, bytes/s) of one local device, measured: a large matmul and a large copy in
  float32 (the CPU has no bfloat16 matmul units worth the name). Only for devices with
  no published peaks: a short benchmark on a GPU times its launches, not its peaks (an
  H100 measured 10 TFLOP/s and 0.96 TB/s)."""
  import time

  import jax
  import jax.numpy as jnp

  def best(fn, *args, repeats=5):
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn(*args).block_until_ready()
      times.append(time.perf_counter() - t0)
    return min(times)

  n = 1024
  a = jax.device_put(jnp.ones((n, n), jnp.float32), devices[0])
  flops = 2 * n ** 3 / best(jax.jit(lambda x: x @ x), a)
  big = jax.device_put(jnp.ones((16 << 20,), jnp.float32), devices[0])
  bandwidth = 2 * big.nbytes / best(jax.jit(lambda x: x * 1.0001), big)
  return flops, bandwidth


def per_device(chip: Chip, share: float) -> Chip:
  """A chip's memory and peaks for one of its devices holding `share` of it (a v4 chip
  shows as two devices)."""
  return dataclasses.replace(chip, hbm_bytes=chip.hbm_bytes * share,
                             hbm_bytes_per_s=chip.hbm_bytes_per_s * share,
                             bf16_flops_per_s=chip.bf16_flops_per_s * share)
