"""scripts/gpu_check.sh: one dated JSON with every part's result, failures recorded."""

import json
import os
import subprocess
import sys

import pytest

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


def test_the_quick_check_names_its_parts_within_its_budget(tmp_path):
  """QUICK=1: the parts that answer the step target in about 6 minutes of device time."""
  out = tmp_path / "check.json"
  env = dict(os.environ, QUICK="1", BUDGET_S="1", GPU_CHECK_OUT=str(out),
             JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  parts = json.loads(out.read_text())["parts"]
  assert list(parts) == ["decode", "kernels", "step_1b", "serve", "decode_cascade"]


def test_the_decode_part_reports_the_roofline_and_a_kernel_profile(tmp_path):
  """The decode part's script on the CPU (tiny model): tokens/s per slot count, and the
  profile of one decode call (a CPU trace has no device kernels: zero launches)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_flags(1))
  done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_rollout.py"),
                         "--decode-only", "--models", "tiny", "--slots", "2,4", "--profile",
                         "--json"], env=env, capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  assert done.returncode == 0, done.stderr[-2000:]
  decode = json.loads(done.stdout.strip().splitlines()[-1])["decode"]
  assert [d["decode_slots"] for d in decode] == [2, 4]
  for d in decode:
    assert d["decode_tokens_per_s"] > 0 and d["profile"]["decode_steps"] == 32


def test_cascade_decode_roofline_reads_each_prompt_once(monkeypatch):
  """--group-slots K: slots / K prompts of K samples decode with cascade attention, and the
  roofline reads each prompt's KV once a step; the same steps otherwise, so the two
  rooflines differ by exactly the prompt KV the other K - 1 samples do not reread."""
  from jaxrl_post.rollout.pages import page_bytes
  from tests import scripts
  bench = scripts.load("bench_rollout")
  monkeypatch.setattr(bench, "_peak_bandwidth", lambda: 1e9)
  cfg = bench.TINY.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  run = lambda group: bench.decode_roofline(cfg, slots=8, prompt_len=32, completion=24,
                                            steps=8, group=group)
  plain, cascade = run(0), run(4)
  assert (plain["decode_group_slots"], cascade["decode_group_slots"]) == (0, 4)
  assert cascade["decode_tokens_per_s"] > 0
  saved = (8 - 8 // 4) * 32 * page_bytes(cfg, 1, "bfloat16") / 1e9
  assert plain["roofline_step_ms"] - cascade["roofline_step_ms"] == pytest.approx(
      1e3 * saved, abs=2e-3)  # Both rounded to 1 us.
