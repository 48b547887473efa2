"""scripts/bench_kv_memory.py: what a Gemma 3 sequence holds with and without the window pool."""

import json

from tests import scripts

bench_kv_memory = scripts.load("bench_kv_memory")


def test_the_window_pool_holds_the_global_layers_whole_and_a_window_of_the_rest(capsys):
  bench_kv_memory.main(["--models", "gemma3-1b,llama3-8b", "--contexts", "512,32768"])
  rows = {(r["model"], r["tokens"]): r for r in json.loads(capsys.readouterr().out)["sequences"]}
  short, long = rows["gemma3-1b", 512], rows["gemma3-1b", 32768]
  assert short["ratio"] == 1.0  # Within the window every layer holds every page.
  # 4 global layers of 26 hold all 2,048 pages, 22 sliding ones their window's 39.
  assert long["window_pages_per_sequence"] == 39 and long["one_pool_mb"] == 832.0
  assert long["ratio"] == round(26 * 2048 / (4 * 2048 + 22 * 39), 2)
  assert rows["llama3-8b", 32768]["ratio"] == 1.0  # No sliding layers, no window pool.
