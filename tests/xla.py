"""XLA flags for the test processes and the commands they start on the CPU."""

import os

# LLVM at -O0 for the CPU code: the suite compiles far more than it runs (most programs run
# a few steps), and XLA's own HLO passes, which decide the numerics, run as they do at the
# default level. The compile-bound tests ran 26% faster, the training runs 6%.
OPT = "--xla_backend_optimization_level=0"
# XLA:GPU's autotuner, compiling for an H100 on a host without a GPU (the gpu-plan extra),
# has nothing to time its candidates on: it compiles them for nothing (the H100 decode-loop
# test's programs came out the same without it, in 32 s instead of 43). With a GPU, its
# choices are part of the programs under test.
if not os.path.exists("/dev/nvidiactl"):
  OPT += " --xla_gpu_autotune_level=0"


def host_flags(devices: int, real_model: bool = False) -> str:
  """XLA_FLAGS for a process with `devices` fake CPU devices. A command that runs a real
  model (SmolLM2-135M) spends longer running it than compiling: it keeps LLVM's default
  level (HumanEval's training step took 45 s, 56 s at -O0; bench_generate's tiny run 19
  and 24 s)."""
  flags = [f"--xla_force_host_platform_device_count={devices}", *OPT.split()]
  return " ".join(f for f in flags if not (real_model and f.startswith("--xla_backend_opt")))
