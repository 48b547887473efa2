"""One of two processes (4 CPU devices each) forming one 8-device mesh over jax.distributed.

Usage: python tests/sharding/two_process_worker.py PORT PROCESS_ID
Prints one JSON line: loss, gradient norm and rollout logits sum after one sync.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from jaxrl_post.sharding import DistributedConfig, initialize  # noqa: E402


def main(port: int, process_id: int) -> None:
  initialize(DistributedConfig(f"127.0.0.1:{port}", num_processes=2, process_id=process_id))
  assert (jax.device_count(), jax.local_device_count()) == (8, 4)
  from tests.sharding.helpers import run_step
  print(json.dumps(run_step()), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
