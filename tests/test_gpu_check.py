"""scripts/gpu_check.sh: one dated JSON with every part's result, failures recorded."""

import json
import os
import subprocess

from tests.xla import host_flags

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _check(tmp_path, greedy_args: str):
  out = tmp_path / "check.json"
  env = dict(os.environ, PARTS="greedy", GREEDY_ARGS=greedy_args, GPU_CHECK_OUT=str(out),
             JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  return done.returncode, json.loads(out.read_text())


def test_a_part_that_works_and_a_part_that_fails(tmp_path):
  rc, report = _check(tmp_path, "--model tiny --new_tokens 4")
  assert rc == 0 and report["backend"] == "cpu" and report["date"]
  greedy = report["parts"]["greedy"]
  assert greedy["rc"] == 0 and greedy["result"]["paged"]["agreement"] == 1.0
  assert greedy["result"]["cascade"]["prompts"] == 12
  rc, report = _check(tmp_path, "--model no-such-model")
  assert rc == 1 and report["parts"]["greedy"]["rc"] != 0
  assert "no-such-model" in report["parts"]["greedy"]["log_tail"]


def test_out_of_budget_parts_are_recorded_as_skipped(tmp_path):
  """BUDGET_S bounds the whole check (GPU time is often short): parts that would start
  with under 20 s left are skipped, and the JSON is still written."""
  out = tmp_path / "check.json"
  env = dict(os.environ, PARTS="greedy kernels", BUDGET_S="1", GPU_CHECK_OUT=str(out),
             JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  report = json.loads(out.read_text())
  assert done.returncode == 0, done.stderr[-2000:]
  assert report["parts"] == {"greedy": {"skipped": "out of BUDGET_S"},
                             "kernels": {"skipped": "out of BUDGET_S"}}
