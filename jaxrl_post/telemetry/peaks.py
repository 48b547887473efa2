"""The accelerators' published figures: one table, for the planner and the run's telemetry.

`CHIPS` holds each chip's vendor figures (per chip; a v4/v5p chip is one megacore device):
HBM capacity and bandwidth, dense bfloat16 FLOP/s without sparsity, and the chip-to-chip
bandwidth a collective uses (ICI for TPU, NVLink for GPU), one direction. `chip_of_kind`
finds the chip of a jax `Device.device_kind`; `HBM_BYTES_PER_S` and `BF16_FLOPS_PER_S`
are views of the table by device kind for `lookup`.

Device kinds as jax names them: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA
H200"; v5e is "TPU v5 lite", v5p "TPU v5" (or "TPU v5p"), v6e (Trillium) "TPU v6 lite".
Names are matched as substrings, the more specific first ("H100 PCIe" before "H100",
"TPU v5 lite" before "TPU v5").
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator's published figures.

  Attributes:
    name: "v5e", "h100", ...
    platform: "tpu" or "gpu".
    hbm_bytes: memory capacity.
    hbm_bytes_per_s: memory bandwidth.
    bf16_flops_per_s: dense bfloat16 peak.
    link_bytes_per_s: chip-to-chip bandwidth a collective uses, one direction.
    topology_prefix: libtpu's topology name prefix ("v5e", "v5p", ...); GPUs: "".
    kernel_s: device time each kernel a program launches costs beyond its bytes and
      FLOPs (ramp-up, tail, the gap to the next). A TPU runs a program as one launch: 0.
      GPUs: 4 us, measured on one H100 (2026-11-27, docs/BENCHMARKS.md): a 1B decode
      step's device time less its bytes over the bandwidth, over its kernels, was 2.9 us
      (466 kernels a step) and 4.2 us (260).
  """

  name: str
  platform: str
  hbm_bytes: float
  hbm_bytes_per_s: float
  bf16_flops_per_s: float
  link_bytes_per_s: float
  topology_prefix: str = ""
  kernel_s: float = 0.0


GPU_KERNEL_S = 4e-6  # Chip.kernel_s of a GPU

CHIPS = {
    "v4": Chip("v4", "tpu", 32 * GB, 1.2e12, 275e12, 6 * 50e9, "v4"),
    "v5e": Chip("v5e", "tpu", 16 * GB, 0.819e12, 197e12, 4 * 50e9, "v5e"),
    "v5p": Chip("v5p", "tpu", 95 * GB, 2.765e12, 459e12, 6 * 100e9, "v5p"),
    "v6e": Chip("v6e", "tpu", 32 * GB, 1.64e12, 918e12, 4 * 112e9, "v6e"),
    "h100": Chip("h100", "gpu", 80 * GB, 3.35e12, 989e12, 450e9, kernel_s=GPU_KERNEL_S),
    # PCIe card: NVLink bridges pair cards at most; collectives go over PCIe Gen5 x16.
    "h100-pcie": Chip("h100-pcie", "gpu", 80 * GB, 2.0e12, 756e12, 64e9,
                      kernel_s=GPU_KERNEL_S),
    "h200": Chip("h200", "gpu", 141 * GB, 4.8e12, 989e12, 450e9, kernel_s=GPU_KERNEL_S),
    "a100": Chip("a100", "gpu", 80 * GB, 2.039e12, 312e12, 300e9, kernel_s=GPU_KERNEL_S),
}

# Device-kind substrings -> chip, the more specific first.
KINDS = {"H100 PCIe": "h100-pcie", "H100": "h100", "H200": "h200", "A100": "a100",
         "TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5p": "v5p",
         "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}

HBM_BYTES_PER_S = {kind: CHIPS[chip].hbm_bytes_per_s for kind, chip in KINDS.items()}
BF16_FLOPS_PER_S = {kind: CHIPS[chip].bf16_flops_per_s for kind, chip in KINDS.items()}


def lookup(table: Mapping[str, float], device_kind: str) -> Optional[float]:
  """The table's figure for this device kind (None: not listed)."""
  return next((value for name, value in table.items() if name in device_kind), None)


def chip_of_kind(device_kind: str) -> Optional[Chip]:
  """The chip of a device kind ("NVIDIA H100 80GB HBM3", "TPU v5p"); None for one not in
  the table (a CPU, or an accelerator with other figures)."""
  name = lookup(KINDS, device_kind)
  return None if name is None else CHIPS[name]
