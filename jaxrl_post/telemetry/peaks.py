"""Vendors' peak figures by device kind (jax's `Device.device_kind`), for roofline shares.

Each table lists its more specific names first: `lookup` takes the first name that occurs
in the device kind ("NVIDIA H100 PCIe" before "NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

from typing import Mapping, Optional

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
# Dense bfloat16 FLOP/s without sparsity; SXM parts unless named otherwise.
BF16_FLOPS_PER_S = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def lookup(table: Mapping[str, float], device_kind: str) -> Optional[float]:
  """The table's figure for this device kind (None: not listed)."""
  return next((value for name, value in table.items() if name in device_kind), None)
