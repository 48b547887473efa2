"""Vendors' peak figures by device kind (jax's `Device.device_kind`), for roofline shares.

Each table lists its more specific names first: `lookup` takes the first name that occurs
in the device kind ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3", "TPU v5 lite" before
"TPU v5"). TPU kinds as jax names them: v5e is "TPU v5 lite", v5p "TPU v5" (or "TPU v5p"),
v6e (Trillium) "TPU v6 lite"; TPU figures are per chip (Google Cloud's TPU system
architecture pages).
"""

from __future__ import annotations

from typing import Mapping, Optional

HBM_BYTES_PER_S = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.039e12,
                   "TPU v4": 1.2288e12, "TPU v5 lite": 8.19e11, "TPU v5e": 8.19e11,
                   "TPU v5p": 2.765e12, "TPU v5": 2.765e12, "TPU v6 lite": 1.64e12,
                   "TPU v6e": 1.64e12}
# Dense bfloat16 FLOP/s without sparsity; SXM parts unless named otherwise.
BF16_FLOPS_PER_S = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12,
                    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
                    "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
                    "TPU v6e": 918e12}


def lookup(table: Mapping[str, float], device_kind: str) -> Optional[float]:
  """The table's figure for this device kind (None: not listed)."""
  return next((value for name, value in table.items() if name in device_kind), None)
