"""scripts/bench_async.py: a smoke run compares the two drivers on the same workload."""

import json

from tests import scripts


def _bench_async():
  scripts.load("bench_step")  # bench_async imports it by name.
  return scripts.load("bench_async")


def test_quick_run_reports_both_drivers_and_the_staleness(capsys):
  assert _bench_async().main(["--quick", "--devices", "1", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  sync, ahead = out["sync"], out["async"]
  assert (sync["mode"], ahead["mode"]) == ("sync", "bounded")
  assert sync["steps"] == ahead["steps"] == 3
  assert out["async_vs_sync_throughput"] == ahead["tokens_per_s"] / sync["tokens_per_s"] > 0
  # Long-tailed: stop tokens end most samples before the cap, some reach it.
  assert 1 <= sync["completion_len"]["mean_of_step_means"] < 32
  # max_staleness 2 over 1 minibatch: 2 optimizer steps once the lag has filled (the
  # first timed step, 2, is drawn with version 0: 1 step stale); none fresh.
  hist = ahead["staleness"]["hist_tokens"]
  assert ahead["staleness"]["max"] == 2 and len(hist) == 3 and hist[0] == 0 and hist[2] > 0
