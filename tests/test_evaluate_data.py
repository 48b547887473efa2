"""The evaluate CLI says what a task read from its data files and what it skipped, and why.

The first test decodes and scores for real; the others replace `evaluate.evaluate` with a
stand-in that returns fixed metrics, to check what is printed where without a decode each.
"""

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_post import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.gin")
METRICS = {"eval/accuracy": 0.5, "eval/problems": 4, "eval/skipped": 0}


@pytest.fixture
def stub_evaluation(monkeypatch):
  seen = []

  def fake(exp, cfg, params, tokenizer):
    seen.append(exp.task)
    return dict(METRICS)

  monkeypatch.setattr(evaluate, "evaluate", fake)
  return seen


def cli_args(data, *extra):
  return [f"--gin_file={QUICKSTART}", "--compilation_cache=off",
          "--gin_param=Experiment.task = @JsonlTask()",
          f"--gin_param=JsonlTask.path = '{data}'", *extra]


def test_evaluate_reports_rows_read_and_skipped(tmp_path, capsys):
  rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)]
  rows += [{"prompt": "", "answer": "1"}, {"prompt": "1+1=", "answer": None}]
  data = tmp_path / "train-00000-of-00001.parquet"
  pq.write_table(pa.Table.from_pylist(rows), data)
  assert evaluate.main(cli_args(data)) == 0
  report, accuracy = capsys.readouterr().out.splitlines()
  assert report == f"read 14 rows from {data}; skipped 2 (missing_field=2)"
  # 12 rows, eval_fraction 0.1: one held-out problem, decoded and scored.
  assert re.fullmatch(r"held-out accuracy: [01]\.000 \(1 problems, 0 skipped\)", accuracy)


def test_with_json_the_report_goes_to_stderr(tmp_path, capsys, stub_evaluation):
  data = tmp_path / "main"
  data.mkdir()
  for shard in range(2):
    rows = [{"question": f"Q{shard}.{i}?", "answer": f"#### {i}"} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), data / f"train-0000{shard}-of-00002.parquet")
  assert evaluate.main(cli_args(data, "--json")) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out) == METRICS  # stdout stays one JSON object.
  assert captured.err.splitlines()[-1] == f"read 8 rows from {data} (2 files); skipped 0"


def test_evaluate_names_an_unreadable_parquet_file(tmp_path, capsys, stub_evaluation):
  data = tmp_path / "cut.parquet"
  pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}] * 50), data)
  data.write_bytes(data.read_bytes()[:100])
  assert evaluate.main(cli_args(data)) == 2
  assert capsys.readouterr().err == (
      f"error: {data}: cannot be read as parquet (Parquet magic bytes not found in footer. "
      "Either the file is corrupted or this is not a parquet file.)\n")
  assert not stub_evaluation
