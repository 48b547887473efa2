"""python -m jaxrl_post.generate: flags, JSON output, errors without stack traces."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl_post import generate, models
from jaxrl_post.models.decode import generate_dense
from tests.xla import host_flags

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA_DIR = os.path.join(FIXTURES, "hf", "tiny_llama")


def run_cli(*args):
  env = dict(os.environ, XLA_FLAGS=host_flags(1))
  return subprocess.run([sys.executable, "-m", "jaxrl_post.generate", *args],
                        capture_output=True, text=True, env=env, timeout=600)


def test_json_output_is_one_object_with_the_documented_keys():
  proc = run_cli("--model", LLAMA_DIR, "--prompt", "Hello, world!", "--temperature", "0",
                 "--max-new-tokens", "6", "--json")
  assert proc.returncode == 0, proc.stderr
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  assert len(lines) == 1
  out = json.loads(lines[0])
  assert set(out) == {"prompt_token_ids", "output_token_ids", "output_text"}
  model, tok = models.load(LLAMA_DIR, compute_dtype="float32")
  assert out["prompt_token_ids"] == tok.encode("Hello, world!")
  want = generate_dense(model, [out["prompt_token_ids"]], max_new_tokens=6,
                        stop_ids=tok.stop_ids).tokens[0]
  assert out["output_token_ids"] == want
  assert out["output_text"] == tok.decode(want, skip_special_tokens=True)


def test_embedded_model_chat_greedy_matches_transformers():
  fx = np.load(os.path.join(FIXTURES, "smollm2_gguf_hf.npz"))
  texts = json.loads(str(fx["texts"]))
  i = texts.index("What is the capital of France?")
  proc = run_cli("--prompt", texts[i], "--chat", "--temperature", "0", "--max-new-tokens",
                 "32", "--json")
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert out["prompt_token_ids"] == json.loads(str(fx["prompt_ids"]))[i]
  hf = fx["greedy"][i].tolist()
  assert out["output_token_ids"] == hf[:hf.index(2) + 1]  # Stops at <|im_end|> (id 2).
  assert "Paris" in out["output_text"] and "<|im_end|>" not in out["output_text"]


def test_sampling_is_reproducible_per_seed():
  model, tok = models.load(LLAMA_DIR, compute_dtype="float32")
  prompt = [tok.encode("Once upon a time")]
  runs = [generate_dense(model, prompt, max_new_tokens=12, temperature=1.0, seed=s).tokens[0]
          for s in (0, 0, 1)]
  assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_model_is_one_line_error_without_traceback():
  proc = run_cli("--model", "/no/such/dir", "--prompt", "x")
  assert proc.returncode == 2
  assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
  assert "/no/such/dir" in proc.stderr


def test_too_long_prompt_is_one_line_error():
  proc = run_cli("--model", LLAMA_DIR, "--prompt", "Hello, world! " * 200,
                 "--max-new-tokens", "8")
  assert proc.returncode == 2, proc.stderr
  assert "exceeds the model's context of 256 tokens" in proc.stderr
  assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ --prompts (batch)


def _write_lines(path, lines):
  path.write_text("".join(line + "\n" for line in lines))
  return str(path)


def _read_rows(path):
  return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_batch_greedy_matches_transformers_and_skips_bad_rows(tmp_path):
  fx = np.load(os.path.join(FIXTURES, "smollm2_gguf_hf.npz"))
  texts, chat = json.loads(str(fx["texts"])), fx["chat"]
  good = [json.dumps({"messages": [{"role": "user", "content": t}]} if c else {"prompt": t})
          for t, c in zip(texts, chat)]
  bad = ["{not json", json.dumps({"prompt": 7}), "[1, 2]", json.dumps({"messages": "hi"}),
         json.dumps({"prompt": "word " * 9000})]  # The last is over the 8192-token context.
  lines = good[:3] + bad[:2] + [""] + good[3:5] + bad[2:] + good[5:]
  out = tmp_path / "out.jsonl"
  proc = run_cli("--prompts", _write_lines(tmp_path / "in.jsonl", lines), "--out", str(out),
                 "--n", "2", "--temperature", "0", "--max-new-tokens", "32")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == (
      f"wrote 7 rows, 14 completions to {out}; skipped 5 rows (bad_messages=1, "
      "invalid_json=1, missing_field=1, not_an_object=1, too_long=1)")
  assert "completions 14/14" in proc.stderr
  rows = _read_rows(out)
  assert [r["line"] for r in rows] == [i + 1 for i, l in enumerate(lines) if l in good]
  for i, row in enumerate(rows):  # Input order: the fixture's order.
    assert row["prompt_token_ids"] == json.loads(str(fx["prompt_ids"]))[i]
    assert ("messages" in row) == bool(chat[i]) and ("prompt" in row) != bool(chat[i])
    hf = fx["greedy"][i].tolist()
    want, reason = (hf[:hf.index(2) + 1], "stop") if 2 in hf else (hf, "length")
    assert len(row["completions"]) == 2
    for c in row["completions"]:
      assert c["token_ids"] == want and c["finish_reason"] == reason, i
      assert len(c["logprobs"]) == len(want) and all(lp <= 0 for lp in c["logprobs"])
  assert {r["completions"][0]["finish_reason"] for r in rows} == {"stop", "length"}
  assert "Paris" in rows[4]["completions"][0]["text"]


def test_batch_sampling_draws_k_completions_per_row_seeded_by_its_line(tmp_path):
  lines = [json.dumps({"prompt": "Once upon a time"}),
           json.dumps({"question": "Once upon a time"})]
  out = tmp_path / "out.jsonl"
  proc = run_cli("--model", LLAMA_DIR, "--prompts", _write_lines(tmp_path / "in.jsonl", lines),
                 "--out", str(out), "--n", "3", "--temperature", "1", "--max-new-tokens", "6",
                 "--chat")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip().endswith("skipped 0 rows")
  _, tok = models.load(LLAMA_DIR, compute_dtype="float32")
  want_prompt = tok.encode_chat([{"role": "user", "content": "Once upon a time"}])
  rows = _read_rows(out)
  assert [(r["line"], r["prompt"]) for r in rows] == [(1, "Once upon a time"),
                                                       (2, "Once upon a time")]
  samples = []
  for row in rows:
    assert row["prompt_token_ids"] == want_prompt and len(row["completions"]) == 3
    for c in row["completions"]:
      n = len(c["token_ids"])
      assert len(c["logprobs"]) == n and all(lp <= 0 for lp in c["logprobs"])
      assert c["finish_reason"] == ("stop" if c["token_ids"][-1] in tok.stop_ids else "length")
      assert n == 6 or c["finish_reason"] == "stop"
      assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
      samples.append(tuple(c["token_ids"]))
  # Six draws: the three of a row differ, and the two rows (seeds 0 and 1) differ.
  assert len(set(samples)) == 6


def test_batch_input_and_output_mistakes_are_one_line_errors(tmp_path):
  proc = run_cli("--model", LLAMA_DIR, "--prompts", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "out.jsonl"))
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip() == f"error: {tmp_path / 'missing.jsonl'}: no such file (--prompts)"


@pytest.mark.parametrize("case", ["no_dir", "out_is_dir", "n_zero", "no_out", "all_bad", "json",
                                  "n_without_prompts"])
def test_batch_argument_mistakes_exit_2_with_one_line(case, tmp_path, capsys):
  prompts = _write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "hi"})])
  out = str(tmp_path / "out.jsonl")
  argv, want = {
      "no_dir": (["--out", str(tmp_path / "no" / "out.jsonl")], "does not exist (--out)"),
      "out_is_dir": (["--out", str(tmp_path)], "is a directory; --out takes a file path"),
      "n_zero": (["--out", out, "--n", "0"], "--n must be >= 1, got 0"),
      "no_out": ([], "--prompts needs --out FILE.jsonl"),
      "all_bad": (["--out", out], "no usable rows (invalid_json=1, missing_field=1)"),
      "json": (["--out", out, "--json"], "--json is for --prompt"),
      "n_without_prompts": (["--n", "2"], "--out, --n and --resume are for --prompts"),
  }[case]
  if case == "all_bad":
    prompts = _write_lines(tmp_path / "in.jsonl", ["{", json.dumps({"prompt": ""})])
  source = ["--prompt", "hi"] if case == "n_without_prompts" else ["--prompts", prompts]
  assert generate.main(["--model", LLAMA_DIR, *source, *argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and want in err, err
  assert not os.path.exists(out)


def test_batch_engine_decodes_every_completion_at_once_unless_num_slots_is_given():
  model, _ = models.load(LLAMA_DIR, compute_dtype="float32")
  # 40 rows x --n 2 of a short prompt: one slot per completion, the pool holding them all.
  eng = generate._engine_for(model, 12, 20, 1, sequences=80)
  assert eng.num_slots == 80 and eng.allocs[0].usable == 80 * eng.max_pages
  assert generate._engine_for(model, 12, 20, 1, sequences=80, num_slots=32).num_slots == 32
  assert generate._engine_for(model, 12, 20, 1, sequences=3, num_slots=32).num_slots == 3
  from jaxrl_post.rollout.engine import MAX_SLOTS
  assert generate._engine_for(model, 12, 20, 1, sequences=5000).num_slots == MAX_SLOTS


def test_the_batch_decode_and_first_token_programs_compile_on_a_thread_while_the_job_prefills():
  """The programs the decode calls run are the ones compiled ahead, on their own thread
  (compiled once: the calls find them): the first call's width, and for a job of more than
  one call (20 tokens, 16 per call) the next narrower one as well; so is the program that
  draws the first tokens after the prefill."""
  import jax

  from jaxrl_post.rollout import SamplingParams

  jax.clear_caches()  # Programs an earlier test compiled would not be compiled again.
  model, _ = models.load(LLAMA_DIR, compute_dtype="float32")
  eng = generate._engine_for(model, 6, 20, 1, sequences=5)
  rows = [generate.PromptRow(i + 1, {"prompt": "x"}, ids=list(range(3 + i, 9 + i)))
          for i in range(5)]
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  logging.getLogger("jax").addHandler(handler)  # jax's own handler does not propagate.
  jax.config.update("jax_log_compiles", True)  # Every thread (a `with` is this one's only).
  try:
    out = generate._decode_all(eng, rows, SamplingParams(temperature=0.0, max_tokens=20), 1,
                               0)
    eng._ahead.join()  # The narrower guess, which no call of this job needed.
  finally:
    jax.config.update("jax_log_compiles", False)
    logging.getLogger("jax").removeHandler(handler)
  compiled = [(r.threadName, program) for r in records for program in ("decode_loop",
              "sample_first") if f"compilation of jit({program})" in r.getMessage()]
  assert compiled == [("compile-ahead", "sample_first")] + [
      ("compile-ahead", "decode_loop")] * 2
  assert [len(c.tokens) for row in out for c in row] == [20] * 5


def test_without_memory_stats_the_pool_takes_a_share_of_the_hosts_free_memory(monkeypatch):
  """The CPU reports no memory stats: the batch engine's pool may take a quarter of what
  the host has free, where that is more than PoolConfig's fixed fallback."""
  from jaxrl_post.rollout import PoolConfig, pages

  model, _ = models.load(LLAMA_DIR, compute_dtype="float32")
  eng = generate._engine_for(model, 12, 20, 1, sequences=1)
  sequence = eng.max_pages * pages.page_bytes(model.config, eng.page_size, eng.kv_dtype)
  monkeypatch.setattr(PoolConfig, "fallback_bytes", 40 * sequence + sequence // 2)
  monkeypatch.setattr(pages, "host_available_bytes", lambda: 0)
  assert generate._engine_for(model, 12, 20, 1, sequences=80).num_slots == 40
  monkeypatch.setattr(pages, "host_available_bytes", lambda: 4 * 100 * sequence)
  assert generate._engine_for(model, 12, 20, 1, sequences=80).num_slots == 80


def test_num_slots_below_one_is_a_one_line_error(tmp_path, capsys):
  prompts = _write_lines(tmp_path / "in.jsonl", [json.dumps({"prompt": "hi"})])
  assert generate.main(["--model", LLAMA_DIR, "--prompts", prompts, "--out",
                        str(tmp_path / "out.jsonl"), "--num-slots", "0"]) == 2
  assert capsys.readouterr().err == "error: --num-slots must be >= 1, got 0\n"


# ------------------------------------- --top-k / --top-p, --resume, every local device


def _batch(tmp_path, name, lines, *flags):
  """In-process --prompts run on the tiny model (8 host devices); returns its rows."""
  out = str(tmp_path / f"{name}.jsonl")
  prompts = _write_lines(tmp_path / "in.jsonl", lines)
  assert generate.main(["--model", LLAMA_DIR, "--prompts", prompts, "--out", out,
                        "--max-new-tokens", "6", *flags]) == 0
  return out


_STORY = [json.dumps({"prompt": p}) for p in ("Once upon a time", "The cat", "Hello, world!",
                                              "In the beginning")]


@pytest.mark.parametrize("flag", [("--top-k", "1"), ("--top-p", "1e-6")])
def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_tokens_with_logprob_0(flag, tmp_path):
  """Drawn at temperature 1 from a kept set of one token: the greedy tokens, each with the
  behaviour logprob of a renormalised one-token set, exactly 0."""
  rows = _read_rows(_batch(tmp_path, "out", _STORY[:2], "--n", "2", "--temperature", "1",
                           *flag))
  model, tok = models.load(LLAMA_DIR, compute_dtype="float32")
  for row in rows:
    want = generate_dense(model, [row["prompt_token_ids"]], max_new_tokens=6,
                          stop_ids=tok.stop_ids).tokens[0]
    for c in row["completions"]:
      assert c["token_ids"] == want and c["logprobs"] == [0.0] * len(want)


def test_top_k_truncated_samples_differ_from_untruncated_ones_and_report_their_set(tmp_path):
  """--top-k 3: each first token is one of the three most likely, with its logprob over those
  three renormalised (not over the vocabulary), and the draws differ from --top-k 0's."""
  flags = ("--n", "4", "--temperature", "1.5")
  cut = _read_rows(_batch(tmp_path, "k3", _STORY[:1], *flags, "--top-k", "3"))[0]
  full = _read_rows(_batch(tmp_path, "k0", _STORY[:1], *flags))[0]
  model, _ = models.load(LLAMA_DIR, compute_dtype="float32")
  ids = np.asarray([cut["prompt_token_ids"]])
  hidden = model(ids, np.arange(ids.shape[1])[None])[0, -1]
  logits = np.asarray(model.logits(hidden), np.float64) / 1.5
  top3 = np.argsort(-logits)[:3]
  kept = logits[top3] - np.logaddexp.reduce(logits[top3])
  for c in cut["completions"]:  # The first token: one of the three, at its renormalised logprob.
    assert c["token_ids"][0] in top3
    assert c["logprobs"][0] == pytest.approx(kept[list(top3).index(c["token_ids"][0])],
                                             abs=1e-4)
  assert [c["token_ids"] for c in cut["completions"]] != [
      c["token_ids"] for c in full["completions"]]


@pytest.mark.parametrize("argv,want", [
    (["--top-k", "-1"], "--top-k must be >= 0 (0 keeps every token), got -1"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (1 keeps every token), got 0.0"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1] (1 keeps every token), got 1.5"),
    (["--top-p", "nan"], "--top-p must be in (0, 1] (1 keeps every token), got nan"),
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--resume"], "--out, --n and --resume are for --prompts FILE.jsonl"),
])
def test_bad_sampling_flags_are_one_line_errors(argv, want, capsys):
  assert generate.main(["--model", "/no/such/dir", "--prompt", "hi", *argv]) == 2
  assert capsys.readouterr().err == f"error: {want}\n"


def test_a_killed_batch_job_resumed_writes_every_line_once_as_an_uninterrupted_run(tmp_path):
  flags = ("--n", "2", "--temperature", "1", "--seed", "3")
  full = _batch(tmp_path, "full", _STORY, *flags)
  rows = open(full, encoding="utf-8").read().splitlines()
  assert [json.loads(r)["line"] for r in rows] == [1, 2, 3, 4]  # Input order at the end.
  # A kill: rows 3 and 1 had finished (in that order), row 2's line was half written.
  part = tmp_path / "part.jsonl"
  part.write_text(rows[2] + "\n" + rows[0] + "\n" + rows[1][:len(rows[1]) // 2])
  assert generate.main(["--model", LLAMA_DIR, "--prompts", str(tmp_path / "in.jsonl"),
                        "--out", str(part), "--max-new-tokens", "6", "--resume", *flags]) == 0
  assert part.read_text() == "".join(r + "\n" for r in rows)
  # Nothing left: the rerun loads no model (a bad --model would fail) and keeps the file.
  assert generate.main(["--model", "/no/such/dir", "--prompts", str(tmp_path / "in.jsonl"),
                        "--out", str(part), "--resume", *flags]) == 0
  assert part.read_text() == "".join(r + "\n" for r in rows)


def test_resume_refuses_an_out_file_of_another_prompts_file(tmp_path, capsys):
  out = tmp_path / "out.jsonl"
  out.write_text(json.dumps({"line": 2, "prompt": "something else", "completions": []}) + "\n")
  prompts = _write_lines(tmp_path / "in.jsonl", _STORY)
  assert generate.main(["--model", LLAMA_DIR, "--prompts", prompts, "--out", str(out),
                        "--resume"]) == 2
  assert capsys.readouterr().err == (
      f"error: {out}: its row for line 2 does not match that line of the --prompts file "
      "(--resume continues the same job)\n")


def test_batch_decodes_on_every_local_device_as_on_one(tmp_path, monkeypatch):
  """The 8 host devices each hold a share of the slots and pages; greedy completions are
  the ones a one-device engine gives, their logprobs to float32 rounding (a shard's batch
  is narrower, so XLA may sum in another order)."""
  import jax

  from jaxrl_post.rollout import SamplingParams

  engines = []
  build = generate._engine_for
  monkeypatch.setattr(generate, "_engine_for",
                      lambda *a, **k: engines.append(build(*a, **k)) or engines[-1])
  rows = _read_rows(_batch(tmp_path, "out", _STORY, "--n", "2", "--temperature", "0"))
  (eng,) = engines
  assert eng.shards == 8 and list(eng.layout.mesh.devices.flat) == jax.local_devices()
  model, tok = models.load(LLAMA_DIR, compute_dtype="float32")
  one = build(model, max(len(r["prompt_token_ids"]) for r in rows), 6, len(tok.stop_ids),
              sequences=8)
  assert one.shards == 1
  prompt_rows = [generate.PromptRow(r["line"], {}, ids=r["prompt_token_ids"]) for r in rows]
  want = generate._decode_all(one, prompt_rows, SamplingParams(
      temperature=0.0, max_tokens=6, stop_ids=tok.stop_ids), 2, 0)
  for row, completions in zip(rows, want):
    assert [c["token_ids"] for c in row["completions"]] == [list(c.tokens) for c in completions]
    np.testing.assert_allclose([c["logprobs"] for c in row["completions"]],
                               [c.logprobs for c in completions], rtol=1e-6, atol=0)
