"""Two processes on localhost (4 CPU devices each) run one sharded step and one sync."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.sharding.helpers import run_step

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The training command over two processes (tests/pipeline/test_devices.py) covers this end
# to end by default; this lower-level step and sync is a sweep case.
@pytest.mark.sweep
def test_two_processes_match_one_process():
  port = free_port()
  env = {**os.environ, "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  worker = os.path.join(ROOT, "tests", "sharding", "two_process_worker.py")
  procs = [subprocess.Popen([sys.executable, worker, str(port), str(i)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      stdout, stderr = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("two-process run timed out")
    assert p.returncode == 0, stderr[-3000:]
    outs.append(json.loads(stdout.strip().splitlines()[-1]))
  assert outs[0] == outs[1]  # Every process sees the same global results.
  local = run_step()  # The same step on this process's 8 devices.
  assert outs[0]["version"] == local["version"] == 1
  for key in ("loss", "grad_norm", "logits_sum"):
    assert outs[0][key] == pytest.approx(local[key], rel=1e-5, abs=1e-4), key
