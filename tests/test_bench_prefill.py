"""scripts/bench_prefill.py: the pages a long prompt's prefill reads, jnp gather vs kernel."""

import json

from tests import scripts

bench_prefill = scripts.load("bench_prefill")


def test_a_sliding_layer_reads_its_window_and_a_global_layer_everything(capsys):
  bench_prefill.main(["--models", "gemma3-1b", "--contexts", "600,32768"])
  short, long = json.loads(capsys.readouterr().out)["results"]
  # A row of 24 queries sees its 24 positions and 511 keys before the first: 535
  # positions, 34 pages of 16 at most (33 when they start on a page boundary).
  assert long["sliding"]["key_pages_per_row_kernel"] == 34
  assert long["sliding"]["key_pages_per_row_jnp"] == long["global"]["key_pages_per_row_kernel"]
  assert long["global"]["key_pages_per_row_jnp"] == 32768 // 16
  # Early rows of a 600-token prompt: the window reaches back to its start on most rows.
  assert short["sliding"]["kv_mb_read_kernel"] < short["global"]["kv_mb_read_kernel"]
