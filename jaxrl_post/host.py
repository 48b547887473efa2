"""What the host lends this process."""

from __future__ import annotations

import os


def cpus() -> int:
  """The CPUs this process may run on (its affinity, which a container or a job scheduler
  may set below the machine's count), at least 1."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0)) or 1
  return os.cpu_count() or 1
