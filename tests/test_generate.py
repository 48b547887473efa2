"""python -m jaxrl_post.generate: flags, JSON output, errors without stack traces."""

import json
import os
import subprocess
import sys

import numpy as np

from jaxrl_post import models
from jaxrl_post.models.decode import generate_dense

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA_DIR = os.path.join(FIXTURES, "hf", "tiny_llama")


def run_cli(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
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
