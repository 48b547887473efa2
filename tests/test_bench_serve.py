"""bench_serve's compiled-program mode: the service's batched programs compiled for an H100
on this host (the gpu-plan extra), with the plan's predicted tokens/s per adapter count."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_post.plan import targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not targets.has_cuda_compiler(),
                    reason="needs the gpu-plan extra (jax's CUDA plugin and ptxas)")
@pytest.mark.sweep  # Two programs per adapter count compiled for an H100: a minute.
def test_compiled_mode_predicts_more_tokens_per_second_for_adapters_sharing_a_step():
  done = subprocess.run(
      [sys.executable, os.path.join(ROOT, "scripts", "bench_serve.py"), "--compiled-for=h100x1",
       "--shapes=tiny", "--adapters=1,2", "--tokens=32", "--datums=2"],
      capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  one, two = out["predicted_tokens_per_s"]["1"], out["predicted_tokens_per_s"]["2"]
  assert one["ratio"] == 1.0 and out["kernel_s"] > 0
  fb = two["step"]["forward_backward"]
  assert fb["kernels"] > 0 and fb["flops"] > one["step"]["forward_backward"]["flops"]
  # Two adapters' rows in one program launch about what one adapter's do: at these sizes
  # the step is its kernels, so sharing it nearly doubles the tokens per second.
  assert two["ratio"] > 1.5, two
