"""Hub ids as model sources (models.hub), read from a Hugging Face cache this test builds:
offline, an id resolves to its snapshot and loads as the directory does; an id that is not
cached is one error line naming it."""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "tests", "fixtures", "hf", "tiny_llama")

_SCRIPT = """
import json, sys
import numpy as np
from jaxrl_post.errors import UserError
from jaxrl_post.models import load, hub
from jaxrl_post.models.transformer import params_of
from jaxrl_post.pipeline.config import ModelSpec
from jaxrl_post.pipeline.trained import policy_config
by_id, tok_id = load("test-org/tiny-llama", compute_dtype="float32")
by_dir, tok_dir = load(sys.argv[1], compute_dtype="float32")
same = all(np.array_equal(a, b) for a, b in zip(
    __import__("jax").tree.leaves(params_of(by_id)), __import__("jax").tree.leaves(params_of(by_dir))))
cfg, tok = policy_config(ModelSpec(source="test-org/tiny-llama", tokenizer=""))
try:
  load("test-org/not-cached")
  error = None
except UserError as e:
  error = str(e)
print(json.dumps({"same_params": same, "config_equal": by_id.config == by_dir.config,
                  "tokens": tok_id.encode("Tom has 3 apples") == tok_dir.encode("Tom has 3 apples"),
                  "plan_config": cfg == by_dir.config.replace(compute_dtype=cfg.compute_dtype),
                  "snapshot": hub.snapshot("test-org/tiny-llama", weights=False),
                  "error": error}))
"""


def _cache(tmp_path) -> str:
  """A hub cache holding test-org/tiny-llama at one commit, laid out as huggingface_hub
  lays it out (refs/main names the snapshot)."""
  cache = tmp_path / "hub"
  repo = cache / "models--test-org--tiny-llama"
  commit = "0123456789abcdef0123456789abcdef01234567"
  shutil.copytree(TINY, repo / "snapshots" / commit,
                  ignore=shutil.ignore_patterns("expected.npz"))
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(commit)
  return str(cache)


def test_a_cached_hub_id_loads_as_its_directory_and_an_uncached_one_is_one_error(tmp_path):
  cache = _cache(tmp_path)
  env = dict(os.environ, HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT)
  done = subprocess.run([sys.executable, "-c", _SCRIPT, TINY], env=env, cwd=str(tmp_path),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert out["same_params"] and out["config_equal"] and out["tokens"] and out["plan_config"]
  assert out["snapshot"].startswith(cache)
  assert out["error"].startswith("model 'test-org/not-cached': not in the Hugging Face cache")
  assert "\n" not in out["error"]


def test_the_generate_command_takes_a_hub_id(tmp_path):
  env = dict(os.environ, HF_HUB_CACHE=_cache(tmp_path), HF_HUB_OFFLINE="1",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  cmd = [sys.executable, "-m", "jaxrl_post.generate", "--model", "test-org/tiny-llama",
         "--prompt", "Tom has", "--max-new-tokens", "4", "--temperature", "0", "--json"]
  done = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  missing = subprocess.run([*cmd[:4], "test-org/gone", *cmd[5:]], env=env, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=300)
  assert missing.returncode == 2
  assert missing.stderr.startswith("error: model 'test-org/gone': not in the Hugging Face cache")
