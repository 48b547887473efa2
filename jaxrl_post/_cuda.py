"""jax's CUDA plugin on a host without an NVIDIA GPU: loaded quietly.

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
