"""scripts/bench_generate.py: the job's prompts, completion trimming, and a tiny run's JSON."""

import json
import os
import subprocess
import sys

from tests import scripts
from tests.xla import host_flags

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "bench_generate.py")


def _module():
  return scripts.load("bench_generate")


def test_prompts_are_distinct_deterministic_and_mixed():
  bench = _module()
  prompts = bench.chat_prompts(300)
  assert len(set(prompts)) == 300
  assert prompts == bench.chat_prompts(300)
  assert bench.chat_prompts(7) == prompts[:7]  # A smaller job is a prefix of the full one.
  assert sum(p.startswith("What is") for p in prompts[:30]) == 20


def test_completions_are_cut_after_the_first_stop_id():
  bench = _module()
  assert bench.trim_at_stop([5, 6, 2, 2, 2], {2}, 24) == [5, 6, 2]
  assert bench.trim_at_stop([5, 6, 7, 8], {2}, 3) == [5, 6, 7]
  assert bench.agreement([[1, 2], [3]], [[1, 2], [4]]) == 0.5


def test_tiny_run_prints_one_json_object_with_sane_figures():
  # Its own process and one CPU device: the suite's 8 fake devices are not what we measure.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=host_flags(1, real_model=True))
  proc = subprocess.run([sys.executable, SCRIPT, "--prompts", "4", "--new_tokens", "4",
                         "--num_slots", "4", "--decode_buckets", "2", "--no_peer", "--json"],
                        capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  assert len(lines) == 1, proc.stdout
  out = json.loads(lines[0])
  ours = out["ours"]
  assert out["job"]["prompts"] == 4 and out["job"]["new_tokens"] == 4
  assert ours["wall_s"] > 0 and ours["prefill_s"] > 0 and ours["decode_s"] > 0
  assert ours["prefill_tokens"] >= 4 * out["job"]["prompt_tokens"]["min"]
  assert ours["prefill_tokens_per_s"] > 0
  assert 4 <= ours["generated_tokens"] <= 16
  assert ours["decode_tokens"] == ours["generated_tokens"] - 4
  assert ours["compiles_in_timed_run"] == 0
  assert out["transformers"] is None and out["wall_ratio"] is None
  assert out["versions"]["jax"] and out["date"]
  # The batch CLI on its defaults: a first pass that compiles, a second run that loads.
  first, second = out["cli_first_pass"], out["cli_second_run"]
  assert out["cli_prompt_ids_match"] is True and out["first_pass_wall_ratio"] is None
  for run in (first, second):
    assert run["exit_status"] == 0 and run["wall_s"] > run["prefill_s"] + run["decode_s"] > 0
    assert min(run["setup_s"], run["interpreter_s"], run["other_s"]) >= 0
  assert first["decode_programs_compiled"] >= 1 and first["decode_compile_s"] > 0
