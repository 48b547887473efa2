"""XLA flags for the test processes and the commands they start on the CPU."""

# LLVM at -O0 for the CPU code: the suite compiles far more than it runs (most programs run
# a few steps), and XLA's own HLO passes, which decide the numerics, run as they do at the
# default level. The compile-bound tests ran 26% faster, the training runs 6%.
OPT = "--xla_backend_optimization_level=0"


def host_flags(devices: int) -> str:
  """XLA_FLAGS for a process with `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {OPT}"
