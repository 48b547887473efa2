"""jax's CUDA plugin: loaded quietly on a host without an NVIDIA GPU, and the share of
each GPU's memory jax's allocator takes where there is one.

The plugin (the `gpu-plan` and `test` extras: what `python -m jaxrl_post.plan` compiles
for GPU targets with) starts with every jax process. Without a GPU it first checks the
host's CUDA libraries, finds no cuDNN and prints a traceback before jax goes on with the
CPU, in every command a user runs. With no GPU device there is nothing for that check to
protect, so it is skipped; a host with a GPU (its /dev/nvidia* nodes) keeps it.
"""

from __future__ import annotations

import glob
import os


def has_gpu_hardware() -> bool:
  return bool(glob.glob("/dev/nvidia[0-9]*"))


def quiet_without_gpu() -> None:
  if not has_gpu_hardware():
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


# jax's allocator takes 0.75 of each GPU's memory by default; the rollout's KV pool is sized
# from what the allocator has left (rollout.pages), so a run here takes more, as the
# inference engines do (leaving the CUDA context, cuBLAS and NCCL their own). plan counts
# the same share of a GPU target's memory (gpu_memory_share).
GPU_MEMORY_SHARE = 0.9
_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def share_gpu_memory() -> None:
  os.environ.setdefault(_FRACTION, str(GPU_MEMORY_SHARE))


def gpu_memory_share() -> float:
  """The share of a GPU's memory a run's allocator holds (the user's own setting wins)."""
  try:
    return float(os.environ.get(_FRACTION, GPU_MEMORY_SHARE))
  except ValueError:
    return GPU_MEMORY_SHARE
