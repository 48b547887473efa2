"""libtpu on a host without TPUs: loaded quietly, or not at all.

libtpu (the `tpu` and `test` extras: the compiler `python -m jaxrl_post.plan` uses for TPU
targets) starts with every jax process. On a host with no TPU it looked for a TPU metadata
server and worker list and printed a block of errors before jax went on with the CPU or GPU,
in every command a user ran. Without TPU hardware these settings make it a compile-only
library; a TPU VM (its chips under /dev/accel* or /dev/vfio/N) is left as it is.
"""

from __future__ import annotations

import glob
import os

COMPILE_ONLY = (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                ("TPU_ACCELERATOR_TYPE", "v5litepod-4"))


def has_tpu_hardware() -> bool:
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def compile_only_env() -> None:
  """Sets COMPILE_ONLY where unset (explicit settings win), before jax starts backends."""
  for key, value in COMPILE_ONLY:
    os.environ.setdefault(key, value)


def quiet_without_tpu() -> None:
  if not has_tpu_hardware():
    compile_only_env()
