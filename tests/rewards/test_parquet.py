"""Tasks read from parquet: the same problems and skip counts as the JSONL of the same rows,
in Hugging Face's layouts (GSM8K, MATH, HumanEval) and verl's, from one file or shards."""

import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_post.data.prompts import PromptConfig, prompt_text
from jaxrl_post.errors import UserError
from jaxrl_post.rewards import HumanEvalTask, JsonlTask
from jaxrl_post.rewards.humaneval import packaged_data_path
from jaxrl_post.rewards.parquet import rows as parquet_rows
from jaxrl_post.rewards.rows import ReadReport
from tests.rewards.sandboxed import SANDBOXED

pytestmark = SANDBOXED  # One worker: see tests/rewards/sandboxed.py.

GSM8K = [{"question": f"Q{i}?", "answer": f"Work.\n#### {i},000"} for i in range(1, 21)]
BAD_GSM8K = [
    {"question": "", "answer": "#### 3"},  # missing_field (empty)
    {"question": None, "answer": "#### 3"},  # missing_field (null)
    {"question": "Q?", "answer": None},  # missing_field (null)
    {"question": "Q?", "answer": "42"},  # no_final_answer
]
MATH = [
    {"problem": "P1", "solution": "So it is \\boxed{\\frac{1}{2}}.", "answer": None},
    {"problem": "P2", "solution": "No box.", "answer": "3"},
    {"problem": "P3", "solution": "\\boxed{12", "answer": None},  # no_boxed_answer
    {"problem": "P4", "solution": None, "answer": None},  # missing_field
    {"problem": "P5", "solution": "\\fbox{ 4 }", "answer": ""},
]


def user(text):
  return [{"role": "user", "content": text}]


def verl_row(question, truth, messages=None):
  return {"data_source": "openai/gsm8k", "prompt": messages or user(question),
          "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
          "extra_info": {"split": "train", "index": 0, "question": question}}


def write_parquet(path, rows, row_group_size=None):
  pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
  return str(path)


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


def pairs(task):
  return [(p.prompt, p.answer) for name in ("train", "eval") for p in task.split(name)]


def test_gsm8k_shard_equals_its_jsonl(tmp_path):
  rows = GSM8K[:10] + BAD_GSM8K + GSM8K[10:]
  data = write_parquet(tmp_path / "train-00000-of-00001.parquet", rows, row_group_size=7)
  task = JsonlTask(data, template="Q: {question}\nA:")
  twin = JsonlTask(write_jsonl(tmp_path / "train.jsonl", rows), template="Q: {question}\nA:")
  assert pairs(task) == pairs(twin) and len(pairs(task)) == 20
  assert task.skipped == twin.skipped == {"missing_field": 3, "no_final_answer": 1}
  # Ids point at the 0-based parquet row (skipped rows counted), as pyarrow and pandas do.
  ids = {p.id: p.answer for name in ("train", "eval") for p in task.split(name)}
  assert ids["train-00000-of-00001.parquet:0"] == "1000"
  assert ids["train-00000-of-00001.parquet:23"] == "20000"
  assert [r.line() for r in task.reads] == [
      f"read 24 rows from {data}; skipped 4 (missing_field=3, no_final_answer=1)"]


def test_math_shard_equals_its_jsonl(tmp_path):
  task = JsonlTask(write_parquet(tmp_path / "m.parquet", MATH), eval_fraction=0.0)
  twin = JsonlTask(write_jsonl(tmp_path / "m.jsonl", MATH), eval_fraction=0.0)
  assert pairs(task) == pairs(twin) == [("P1", "\\frac{1}{2}"), ("P2", "3"), ("P5", "4")]
  assert task.skipped == twin.skipped == {"missing_field": 1, "no_boxed_answer": 1}


def test_verl_layout_gives_the_gsm8k_problems(tmp_path):
  hf = JsonlTask(write_parquet(tmp_path / "hf.parquet", GSM8K), format="gsm8k", seed=3)
  verl_rows = [verl_row(r["question"], r["answer"].split("#### ")[1].replace(",", ""))
               for r in GSM8K]
  verl = JsonlTask(write_parquet(tmp_path / "verl.parquet", verl_rows), seed=3)
  assert pairs(verl) == pairs(hf) and verl.skipped == {}
  assert verl.split("train")[0].meta == {"data_source": "openai/gsm8k"}
  # The same rows as JSONL (verl's layout needs no parquet) read alike.
  assert pairs(JsonlTask(write_jsonl(tmp_path / "verl.jsonl", verl_rows), seed=3)) == pairs(hf)


def test_verl_bad_rows_are_skipped_by_reason(tmp_path):
  system = [{"role": "system", "content": "Be brief."}] + user("Q2?")
  chat = user("Q3?") + [{"role": "assistant", "content": "4"}, *user("Sure?")]
  rows = [verl_row("Q1?", "1"), verl_row("", "2", system), verl_row("", "3", chat),
          verl_row("", "4", user("  ")), verl_row("Q5?", "")]
  rows.append({**verl_row("Q6?", "6"), "reward_model": None})
  rows.append({**verl_row("Q7?", "7"), "prompt": None})
  task = JsonlTask(write_parquet(tmp_path / "v.parquet", rows), eval_fraction=0.0)
  assert task.skipped == {"missing_field": 4, "unsupported_messages": 1}
  one, two = task.split("train")
  assert (one.prompt, one.answer, dict(one.meta)) == ("Q1?", "1", {"data_source": "openai/gsm8k"})
  assert (two.prompt, two.answer, two.meta["system"]) == ("Q2?", "2", "Be brief.")


def test_a_rows_system_turn_leads_its_prompt():
  class Chat:
    def apply_chat_template(self, messages):
      return "|".join(f"{m['role']}:{m['content']}" for m in messages)

  from jaxrl_post.rewards import Problem
  own = Problem("v:0", "Q?", "1", meta={"system": "Be brief."})
  plain = Problem("v:1", "Q?", "1")
  chat = PromptConfig(chat_template=True, system_prompt="Config.")
  assert prompt_text(Chat(), own, chat) == "system:Be brief.|user:Q?"
  assert prompt_text(Chat(), plain, chat) == "system:Config.|user:Q?"
  assert prompt_text(Chat(), own, PromptConfig()) == "Be brief.\n\nQ?"
  assert prompt_text(Chat(), plain, PromptConfig(system_prompt="Config.")) == "Q?"


def test_wrong_column_types_are_skipped_like_jsonl(tmp_path):
  rows = [{"question": ["a", "list"], "answer": "#### 1"}, {"question": ["Q?"], "answer": "x"}]
  shard = write_parquet(tmp_path / "listy.parquet", rows)
  write_parquet(tmp_path / "good.parquet", GSM8K)  # The glob below reads it too.
  with pytest.raises(UserError, match=r"listy.parquet: no valid rows \(format=gsm8k; "
                                      r"skipped: missing_field=2\)"):
    JsonlTask(shard, format="gsm8k")
  task = JsonlTask(str(tmp_path / "*.parquet"), format="gsm8k")
  assert task.skipped == {"missing_field": 2} and len(pairs(task)) == 20


def test_shards_from_a_directory_or_a_glob(tmp_path):
  data = tmp_path / "main"
  data.mkdir()
  write_parquet(data / "train-00000-of-00002.parquet", GSM8K[:12])
  write_parquet(data / "train-00001-of-00002.parquet", GSM8K[12:] + BAD_GSM8K[:1])
  write_parquet(data / "test-00000-of-00001.parquet", GSM8K[:2] + BAD_GSM8K[3:])
  (data / "README.md").write_text("not data")
  pattern = str(data / "train-*.parquet")
  task = JsonlTask(pattern, eval_path=str(data / "test-*.parquet"))
  assert len(task.split("train")) == 18 and len(task.split("eval")) == 2
  assert task.split("train")[-1].id == "train-00001-of-00002.parquet:7"
  assert task.skipped == {"duplicate_of_eval": 2, "missing_field": 1, "no_final_answer": 1}
  assert [r.line() for r in task.reads] == [
      f"read 21 rows from {pattern} (2 files); skipped 3 (duplicate_of_eval=2, "
      "missing_field=1)",
      f"read 3 rows from {data}/test-*.parquet; skipped 1 (no_final_answer=1)"]
  whole = JsonlTask(str(data), eval_fraction=0.0)  # A directory: all its shards, by name.
  assert whole.reads[0].files == 3 and whole.reads[0].rows == 24
  assert [p.id for p in whole.split("train")][:2] == ["test-00000-of-00001.parquet:0",
                                                      "test-00000-of-00001.parquet:1"]


def test_unreadable_parquet_is_one_line_naming_the_file(tmp_path):
  whole = (tmp_path / "whole.parquet")
  write_parquet(whole, GSM8K * 20, row_group_size=50)
  data = whole.read_bytes()
  cases = {"cut.parquet": data[:len(data) // 2], "empty.parquet": b"",
           "text.parquet": b"question,answer\n", "damaged.parquet": data[:4] + b"\0" * 600
           + data[604:]}
  for name, content in cases.items():
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError) as e:
      JsonlTask(str(tmp_path / name))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / name}: cannot be read as parquet (")
    assert "\n" not in message, message
  with pytest.raises(UserError, match="nope.parquet: no such file"):
    JsonlTask(str(tmp_path / "nope.parquet"))
  with pytest.raises(UserError, match=r"train-\*.parquet: no file matches"):
    JsonlTask(str(tmp_path / "train-*.parquet"))
  (tmp_path / "empty_dir").mkdir()
  with pytest.raises(UserError, match="empty_dir: is a directory with no"):
    JsonlTask(str(tmp_path / "empty_dir"))


def test_rows_are_read_in_batches_of_the_wanted_columns(tmp_path):
  rows = [verl_row(f"Q{i}?", str(i)) for i in range(25)]
  path = write_parquet(tmp_path / "v.parquet", rows, row_group_size=10)
  got = list(parquet_rows(path, columns=("prompt", "reward_model", "absent"), batch_rows=4))
  assert [i for i, _ in got] == list(range(25))
  assert got[24][1] == {"prompt": user("Q24?"),
                        "reward_model": {"style": "rule", "ground_truth": "24"}}


def test_humaneval_from_parquet_equals_the_packaged_jsonl(tmp_path):
  with gzip.open(packaged_data_path(), "rt") as f:
    rows = [json.loads(line) for line in f][:12]
  rows.append({**rows[0], "task_id": "bad", "entry_point": "not an id"})
  shard = write_parquet(tmp_path / "test-00000-of-00001.parquet", rows)
  task = HumanEvalTask(path=shard, num_eval=3)
  twin = HumanEvalTask(path=write_jsonl(tmp_path / "he.jsonl", rows), num_eval=3)
  assert task.split("train") == twin.split("train") and task.split("eval") == twin.split("eval")
  assert [dict(p.meta) for p in task.split("eval")] == [dict(p.meta) for p in twin.split("eval")]
  assert task.skipped == twin.skipped == {"bad_entry_point": 1}
  assert task.reads == (ReadReport(shard, 1, 13, {"bad_entry_point": 1}),)


def test_report_line():
  assert ReadReport("d.jsonl", 1, 5, {}).line() == "read 5 rows from d.jsonl; skipped 0"
  assert os.path.basename(ReadReport("x", 2, 9, {"b": 1, "a": 2}).line()) == (
      "read 9 rows from x (2 files); skipped 3 (a=2, b=1)")
