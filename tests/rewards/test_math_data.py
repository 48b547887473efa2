"""JsonlTask: loading with skip counts, disjoint splits, math-verify scoring on threads."""

import json
import threading

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import JsonlTask, Problem, score_batch
from jaxrl_post.rewards.math_data import last_boxed

GOOD_GSM8K = [{"question": f"Q{i}?", "answer": f"Work.\n#### {i},000"} for i in range(1, 21)]
BAD_GSM8K = [
    '{"question": "cut off',  # invalid_json
    "[1, 2]",  # not_an_object
    '"just a string"',  # not_an_object
    json.dumps({"question": "", "answer": "#### 3"}),  # missing_field (empty)
    json.dumps({"question": "Q?"}),  # missing_field (absent)
    json.dumps({"question": "Q?", "answer": "42"}),  # no_final_answer
    json.dumps({"question": "Q?", "answer": "so #### "}),  # no_final_answer
    json.dumps({"text": "hello"}),  # unknown_format
]


def write(path, rows):
  lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
  path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # A trailing blank line.
  return str(path)


def test_gsm8k_skips_malformed_rows_by_reason(tmp_path):
  path = write(tmp_path / "gsm8k.jsonl", GOOD_GSM8K[:10] + BAD_GSM8K + GOOD_GSM8K[10:])
  task = JsonlTask(path, format="auto", template="Q: {question}\nA:")
  assert task.skipped == {"invalid_json": 1, "missing_field": 2, "no_final_answer": 2,
                          "not_an_object": 2, "unknown_format": 1}
  problems = list(task.split("train")) + list(task.split("eval"))
  assert len(problems) == 20 and len(task.split("eval")) == 2
  by_id = {p.id: p for p in problems}
  assert by_id["gsm8k.jsonl:1"] == Problem("gsm8k.jsonl:1", "Q: Q1?\nA:", "1000")
  assert by_id["gsm8k.jsonl:28"].answer == "20000"  # Line numbers count skipped rows.


def test_explicit_format_requires_its_fields(tmp_path):
  path = write(tmp_path / "pa.jsonl", [
      {"prompt": "2+3?", "answer": 5}, {"prompt": "x?", "answer": "\\frac{1}{2}"},
      {"question": "q", "answer": "#### 1"}, {"prompt": "y?", "answer": None},
      {"prompt": "z?", "answer": "7"}])
  task = JsonlTask(path, format="prompt_answer", eval_fraction=0.0)
  assert task.skipped == {"missing_field": 2}
  assert [p.answer for p in task.split("train")] == ["5", "\\frac{1}{2}", "7"]
  assert len(task.split("eval")) == 0


def test_math_format(tmp_path):
  path = write(tmp_path / "math.jsonl", [
      {"problem": "P1", "solution": "So it is \\boxed{\\frac{1}{2}}."},
      {"problem": "P2", "solution": "No box.", "answer": "3"},
      {"problem": "P3", "solution": "A set \\boxed{\\{1, 2\\}} and \\fbox{ 4 }"},
      {"problem": "P4", "solution": "No box at all."},
      {"problem": "P5", "solution": "\\boxed{12"},
      {"problem": "P6"},
      {"problem": "P7", "solution": "\\boxed{}"}])
  task = JsonlTask(path, format="math", eval_fraction=0.0)
  assert task.skipped == {"missing_field": 1, "no_boxed_answer": 3}
  assert [p.answer for p in task.split("train")] == ["\\frac{1}{2}", "3", "4"]


def test_last_boxed():
  assert last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
  assert last_boxed("\\boxed {x^{2}}") == "x^{2}"
  assert last_boxed("\\boxed{\\}}") == "\\}"
  assert last_boxed("none") is None


def test_held_out_eval_is_seeded_and_disjoint(tmp_path):
  rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(200)]
  rows += [{"prompt": "q7", "answer": "7"}]  # A duplicate question must not straddle.
  path = write(tmp_path / "d.jsonl", rows)
  a, b, c = JsonlTask(path, seed=1), JsonlTask(path, seed=1), JsonlTask(path, seed=2)
  assert a.split("eval") == b.split("eval") and a.split("train") == b.split("train")
  assert a.split("eval") != c.split("eval")
  for task in (a, c):
    train = {p.prompt for p in task.split("train")}
    evals = {p.prompt for p in task.split("eval")}
    assert len(evals) == 20 and not train & evals and len(train | evals) == 200


def test_eval_path_removes_overlap_from_train(tmp_path):
  train = write(tmp_path / "train.jsonl", GOOD_GSM8K)
  evals = write(tmp_path / "test.jsonl", GOOD_GSM8K[:3] + ["not json"])
  task = JsonlTask(train, eval_path=evals)
  assert task.skipped == {"duplicate_of_eval": 3, "invalid_json": 1}
  assert len(task.split("train")) == 17 and len(task.split("eval")) == 3
  assert task.split("eval")[0].id == "test.jsonl:1"
  assert not {p.prompt for p in task.split("train")} & {p.prompt for p in task.split("eval")}


def test_user_errors(tmp_path):
  with pytest.raises(UserError, match="nope.jsonl: no such file"):
    JsonlTask(str(tmp_path / "nope.jsonl"))
  bad = write(tmp_path / "bad.jsonl", BAD_GSM8K)
  with pytest.raises(UserError, match="bad.jsonl: no valid rows"):
    JsonlTask(bad)
  good = write(tmp_path / "good.jsonl", GOOD_GSM8K)
  with pytest.raises(UserError, match="format='csv'"):
    JsonlTask(good, format="csv")
  with pytest.raises(UserError, match="eval_fraction"):
    JsonlTask(good, eval_fraction=1.0)
  with pytest.raises(UserError, match="template"):
    JsonlTask(good, template="{prompt}")
  one = write(tmp_path / "one.jsonl", GOOD_GSM8K[:1])
  with pytest.raises(UserError, match="one.jsonl: 1 distinct"):
    JsonlTask(one)
  with pytest.raises(UserError, match="every valid row"):
    JsonlTask(one, eval_path=one)
  with pytest.raises(UserError, match="is a directory"):
    JsonlTask(str(tmp_path))


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  """A JsonlTask only to reach `score`, which depends on the problem, not on the file."""
  path = write(tmp_path_factory.mktemp("data") / "t.jsonl", [{"prompt": "q", "answer": "1"}])
  return JsonlTask(path, eval_fraction=0.0)


@pytest.mark.parametrize("gold, completion, reward", [
    ("\\frac{1}{2}", "The answer is $0.5$", 1.0),
    ("\\frac{1}{2}", "so \\boxed{\\frac{2}{4}}", 1.0),
    ("0.5", "The answer is $\\frac{1}{2}$", 1.0),
    ("\\boxed{3}", "3", 1.0),
    ("3", "\\boxed{3}", 1.0),
    ("$3$", "We get 3.", 1.0),
    ("1234", "She earns $1,234 in total. The answer is 1234.", 1.0),
    ("18", "16 - 3 - 4 = 9 eggs, 9 * 2 = 18. The answer is 18</s>", 1.0),
    ("\\sqrt{2}", "$\\sqrt 2$", 1.0),
    ("18", "The answer is \\boxed{17}", 0.0),
    ("5", "no idea", 0.0),
    ("5", "", 0.0),
])
def test_math_verify_score(task, gold, completion, reward):
  assert task.score(Problem("p", "", gold), completion) == reward


def test_scores_from_worker_threads(task):
  problem, results = Problem("p", "", "\\frac{1}{2}"), []
  threads = [threading.Thread(target=lambda: results.append(task.score(problem, "$0.5$")))
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == [1.0] * 4
  rewards, stats = score_batch(task, [problem] * 3, ["0.5", "1/2", "2"], workers=2)
  assert list(rewards) == [1.0, 1.0, 0.0] and stats.errors == 0 == stats.timeouts
