"""Export of a run's policy to a Hugging Face directory, and generation from a checkpoint.

The trained run starts from the tiny Llama fixture (tests/fixtures/hf/tiny_llama, whose
expected.npz holds transformers' logits) with LoRA on every matrix: step 0 is the fixture
itself, so its export must give transformers' logits; step 1 has trained adapters (an
entropy bonus moves them even when no sample earns a reward), so its export checks the merge.
When a Python with transformers and torch exists at TRANSFORMERS_PYTHON (default
/work/peer-venv/bin/python), transformers itself also loads the exported directories.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from jaxrl_post import export, generate, models
from jaxrl_post.errors import UserError
from jaxrl_post.models.hf_export import merge_lora, parse_size, save_pretrained
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import init_lora, init_model, params_of, with_params
from jaxrl_post.pipeline.trained import load_trained
from tests.xla import host_flags

# One worker runs this file: its module fixture (a run or a pool) is built once, not
# once per worker (scripts/test.sh distributes by --dist loadgroup).
pytestmark = pytest.mark.xdist_group("export")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "tiny_llama")
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.gin")
LOGIT_TOL = 1e-4  # ours vs transformers, float32 (as in tests/models/test_hf_parity.py).
ROUND_TRIP_TOL = 1e-5  # ours vs ours reloaded from the export.
TRANSFORMERS_PYTHON = os.environ.get("TRANSFORMERS_PYTHON", "/work/peer-venv/bin/python")

RUN = ["Experiment.steps = 1", "SftConfig.steps = 0", f"ModelSpec.source = '{FIXTURE}'",
       "ModelSpec.tokenizer = ''", "ModelSpec.overrides = {'compute_dtype': 'float32'}",
       "ModelSpec.lora = @LoraConfig()",
       "LoraConfig.targets = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down')",
       "LossConfig.entropy_coef = 0.01", "OptimizerConfig.learning_rate = 0.01",
       "EvalSpec.num_problems = 8", "EvalSpec.every_n_steps = 0", "EvalSpec.samples = 4",
       "RolloutSpec.prompts_per_step = 4", "RolloutSpec.group_size = 4",
       "EngineConfig.num_slots = 16", "EngineConfig.group_slots = 4",
       "OptimizerConfig.total_steps = 10", "LogSpec.progress = False"]


def full_logits(model, ids):
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model.logits(model(ids, pos)))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A one-step LoRA run on the tiny Llama fixture (one device, in a subprocess)."""
  workdir = tmp_path_factory.mktemp("run")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=host_flags(1))
  cmd = [sys.executable, "-m", "jaxrl_post.train", f"--gin_file={QUICKSTART}",
         f"--workdir={workdir}"] + [f"--gin_param={p}" for p in RUN]
  done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  return str(workdir)


def _export(run_dir, out, *extra):
  assert export.main([run_dir, "--out", str(out), *extra]) == 0
  return str(out)


def _transformers_logits(model_dir: str, ids: np.ndarray, tmp_path) -> np.ndarray:
  """Runs transformers (in its own interpreter) on an exported directory."""
  ids_file, out_file = tmp_path / "ids.npy", tmp_path / "hf_logits.npy"
  np.save(ids_file, ids)
  script = ("import sys, numpy as np, torch, transformers\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], "
            "dtype=torch.float32, attn_implementation='eager')\n"
            "with torch.no_grad():\n"
            "  out = m(torch.tensor(np.load(sys.argv[2]))).logits.float().numpy()\n"
            "np.save(sys.argv[3], out)\n")
  # Not from the repository root (nor with its PYTHONPATH): its kernels/ folder would
  # shadow the `kernels` package that transformers imports.
  done = subprocess.run([TRANSFORMERS_PYTHON, "-c", script, model_dir, str(ids_file),
                         str(out_file)], capture_output=True, text=True, timeout=600,
                        cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
  assert done.returncode == 0, done.stderr[-3000:]
  return np.load(out_file)


def _has_transformers() -> bool:
  if not os.path.isfile(TRANSFORMERS_PYTHON):
    return False
  probe = ("import importlib.util as u, sys; "
           "sys.exit(0 if u.find_spec('torch') and u.find_spec('transformers') else 1)")
  done = subprocess.run([TRANSFORMERS_PYTHON, "-c", probe], capture_output=True, timeout=120)
  return done.returncode == 0


needs_transformers = pytest.mark.skipif(not _has_transformers(),
                                        reason=f"no transformers at {TRANSFORMERS_PYTHON}")


# ------------------------------------------------------------------ errors


def test_export_refuses_a_workdir_without_checkpoint(tmp_path, capsys):
  missing = str(tmp_path / "no_run")
  assert export.main([missing, "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(f"error: {missing}: no checkpoint"), err
  assert not os.path.exists(tmp_path / "x")


def test_export_refuses_a_step_that_was_not_saved(run_dir, tmp_path, capsys):
  assert export.main([run_dir, "--step", "999", "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert err == f"error: {run_dir}: no checkpoint at step 999 (steps saved: 0, 1)\n"


def test_export_of_a_corrupted_step_is_one_line_naming_what_is_wrong(run_dir, tmp_path, capsys):
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  for root, _, files in os.walk(copy / "checkpoints" / "1" / "state"):
    for name in files:  # The arrays' chunks cut short, the step's index intact.
      if os.sep + "d" in root:
        os.truncate(os.path.join(root, name), 10)
  assert export.main([str(copy), "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert err == f"error: {copy}/checkpoints/1/state: cannot read the checkpoint (the index " \
                "of its arrays is unreadable: cut short or corrupted)\n", err
  shutil.rmtree(copy / "checkpoints" / "1" / "state" / "d")  # Only the arrays' chunks now.
  shutil.copytree(os.path.join(run_dir, "checkpoints", "1", "state", "d"),
                  copy / "checkpoints" / "1" / "state" / "d")
  assert export.main([str(copy), "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(
      f"error: {copy}/checkpoints/1/state: cannot read the checkpoint (OUT_OF_RANGE: "), err
  assert "is not valid for value of size 10)" in err and "Traceback" not in err, err


def test_a_config_gin_edited_to_another_model_shape_is_one_line_naming_the_array(
    run_dir, tmp_path, capsys):
  model = tmp_path / "model"
  shutil.copytree(FIXTURE, model)
  cfg = json.loads((model / "config.json").read_text())
  (model / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  gin_text = (copy / "config.gin").read_text()
  assert FIXTURE in gin_text
  (copy / "config.gin").write_text(gin_text.replace(FIXTURE, str(model)))
  assert export.main([str(copy), "--out", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err
  assert re.fullmatch(
      rf"error: {copy}/checkpoints/1: checkpoint does not match the run's config.gin "
      r"\(params layers\.\w+ is \(3, (64, 112|112, 64)\) in the checkpoint, "
      r"\(3, (64, 96|96, 64)\) in its config.gin\)\n", err), err


# ------------------------------------------------------------------ parity


def test_step0_export_gives_transformers_logits(run_dir, tmp_path):
  out = _export(run_dir, tmp_path / "step0", "--step", "0")
  expected = np.load(os.path.join(FIXTURE, "expected.npz"))
  model, _ = models.load(out, compute_dtype="float32")
  diff = np.abs(full_logits(model, expected["input_ids"]) - expected["logits"]).max()
  assert diff <= LOGIT_TOL, diff


def test_trained_export_reloads_with_the_runs_logits(run_dir, tmp_path):
  policy = load_trained(run_dir)  # Newest: step 1.
  assert policy.step == 1 and policy.config.lora is not None
  adapters = [v for k, v in policy.params["layers"].items() if k.endswith("_lora_b")]
  assert max(float(np.abs(b).max()) for b in adapters) > 0  # Training moved the adapters.
  ours = with_params(models.abstract_model(policy.config),
                     {k: v for k, v in policy.params.items()})  # Unmerged: adapters live.
  out = _export(run_dir, tmp_path / "step1")
  reloaded, _ = models.load(out, compute_dtype="float32")
  ids = np.load(os.path.join(FIXTURE, "expected.npz"))["input_ids"]
  diff = np.abs(full_logits(ours, ids) - full_logits(reloaded, ids)).max()
  assert diff <= ROUND_TRIP_TOL, diff


@needs_transformers
def test_transformers_logits_on_the_trained_export_equal_ours(run_dir, tmp_path):
  policy = load_trained(run_dir)
  out = _export(run_dir, tmp_path / "step1")
  ids = np.load(os.path.join(FIXTURE, "expected.npz"))["input_ids"]
  diff = np.abs(full_logits(policy.model("float32"), ids) -
                _transformers_logits(out, ids, tmp_path)).max()
  assert diff <= LOGIT_TOL, diff


def test_export_tokenizer_files_reload(run_dir, tmp_path):
  out = _export(run_dir, tmp_path / "tok")
  _, ours = models.load(FIXTURE)
  _, back = models.load(out)
  raw = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
  text = "Hello, world! 12+7=19\n"
  assert raw.encode(text).ids == ours.encode(text) == back.encode(text)
  chat = [{"role": "user", "content": "hi"}]
  assert back.apply_chat_template(chat) == ours.apply_chat_template(chat)
  assert back.stop_ids == ours.stop_ids and back.bos_id == ours.bos_id
  with open(os.path.join(out, "tokenizer_config.json")) as f:
    assert json.load(f)["chat_template"] == ours.chat_template


@pytest.mark.parametrize("text,size", [("5GB", 5 * 1000**3), ("2GiB", 2 * 1024**3),
                                       ("200mb", 200 * 1000**2), ("60KiB", 60 * 1024),
                                       ("1.5GB", 1_500_000_000), ("1000000", 1_000_000)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
  assert parse_size(text) == size


@pytest.mark.parametrize("text,message", [("0", "must be at least one byte"),
                                          ("5 GBs", "expected a size like 5GB")])
def test_a_shard_size_of_nothing_or_no_size_is_a_user_error(text, message):
  with pytest.raises(UserError, match=message):
    parse_size(text)


def test_export_shards_large_weights_with_an_index(run_dir, tmp_path):
  out = _export(run_dir, tmp_path / "sharded", "--max-shard-size", "40KB")
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    files = set(json.load(f)["weight_map"].values())
  assert len(files) > 1 and not os.path.exists(os.path.join(out, "model.safetensors"))
  ids = np.load(os.path.join(FIXTURE, "expected.npz"))["input_ids"]
  single, _ = models.load(_export(run_dir, tmp_path / "single"), compute_dtype="float32")
  sharded, _ = models.load(out, compute_dtype="float32")
  assert np.array_equal(full_logits(single, ids), full_logits(sharded, ids))


# ------------------------------------------------------------------ generate


def test_generate_from_checkpoint_equals_generate_from_export(run_dir, tmp_path, capsys):
  out = _export(run_dir, tmp_path / "gen")
  capsys.readouterr()
  common = ["--prompt", "12+7=", "--temperature", "0", "--max-new-tokens", "6", "--json"]
  assert generate.main(["--checkpoint", run_dir, *common]) == 0
  from_run = json.loads(capsys.readouterr().out)
  assert generate.main(["--model", out, *common]) == 0
  assert json.loads(capsys.readouterr().out) == from_run
  assert len(from_run["output_token_ids"]) >= 1


def test_generate_refuses_a_missing_step(run_dir, capsys):
  assert generate.main(["--checkpoint", run_dir, "--step", "7", "--prompt", "1"]) == 2
  assert "no checkpoint at step 7 (steps saved: 0, 1)" in capsys.readouterr().err


# ------------------------------------------------------------------ library


def test_merged_lora_equals_the_adapter_forward(tmp_path):
  cfg = models.preset("tiny", compute_dtype="float32",
                      lora=models.LoraConfig(rank=4, targets=("wq", "wo", "w_down")))
  model = init_model(cfg, 0)
  init_lora(model, 1)
  params = params_of(model)
  for name in cfg.lora.targets:  # B starts at zero: give the adapters a real effect.
    b = params["layers"][f"{name}_lora_b"]
    params["layers"][f"{name}_lora_b"] = 0.05 * np.random.default_rng(0).normal(size=b.shape)
  model = with_params(model, params)
  merged_cfg, merged = merge_lora(cfg, params)
  plain = with_params(models.abstract_model(merged_cfg),
                      {k: v for k, v in merged.items()})
  ids = np.arange(24).reshape(2, 12)
  assert np.abs(full_logits(model, ids) - full_logits(plain, ids)).max() <= ROUND_TRIP_TOL


def test_char_tokenizer_preset_exports(tmp_path):
  cfg = models.preset("tiny", compute_dtype="float32", vocab_size=128)
  model, tok = init_model(cfg, 0), char_tokenizer()
  save_pretrained(str(tmp_path), cfg, params_of(model), tok)
  raw = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  back_model, back = models.load(str(tmp_path), compute_dtype="float32")
  text = "40+9=49\n"
  assert raw.encode(text).ids == tok.encode(text) == back.encode(text)
  assert back.decode(back.encode(text)) == text and back.stop_ids == tok.stop_ids
  ids = np.array([tok.encode(text)])
  assert np.abs(full_logits(model, ids) - full_logits(back_model, ids)).max() <= ROUND_TRIP_TOL


def test_gguf_model_exported_and_loaded_back_is_the_same_model(tmp_path):
  """The embedded GGUF model written as a sharded HF directory and loaded back: the same
  config and the same weights bit for bit (so the same tokens from any decode), and a
  tokenizer that encodes and templates as the GGUF's does."""
  model, tok = models.load("smollm2-135m-instruct", compute_dtype="float32")
  save_pretrained(str(tmp_path), model.config, params_of(model), tok,
                  max_shard_bytes=200 * 1000**2)
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  back, back_tok = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config == model.config
  want, got = params_of(model), params_of(back)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  chat = [{"role": "user", "content": "What is the capital of France?"}]
  assert back_tok.apply_chat_template(chat) == tok.apply_chat_template(chat)
  assert back_tok.stop_ids == tok.stop_ids
  prompts = [tok.encode("The capital of France is"), tok.encode_chat(chat)]
  assert [back_tok.encode("The capital of France is"), back_tok.encode_chat(chat)] == prompts


# ------------------------------------------------------------------ evaluate


def test_evaluate_without_a_config_says_what_is_missing(tmp_path, capsys):
  from jaxrl_post import evaluate

  capsys.readouterr()
  assert evaluate.main([]) == 2
  assert capsys.readouterr().err == "error: no config: pass --gin_file=configs/<name>.gin\n"
  assert evaluate.main(["--checkpoint", str(tmp_path)]) == 2
  assert capsys.readouterr().err == ("error: no config: pass --gin_file=configs/<name>.gin "
                                     f"({tmp_path} has no config.gin)\n")


@pytest.mark.parametrize("step,config", [(0, "--gin_file"), (1, None)])
def test_evaluate_on_its_own_gives_the_runs_eval_metrics(run_dir, step, config, capsys):
  """With the run's config.gin named, and without it (--checkpoint then reads it)."""
  from jaxrl_post import evaluate

  capsys.readouterr()
  named = [f"--gin_file={run_dir}/config.gin"] if config else []
  assert evaluate.main([*named, "--checkpoint", run_dir, "--step", str(step), "--json"]) == 0
  got = json.loads(capsys.readouterr().out)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    logged = [json.loads(line) for line in f]
  want = next(r for r in logged if r["step"] == step)
  assert got == {k: v for k, v in want.items() if k.startswith("eval/")}
  # 4 samples per problem: pass@k and maj@k beside greedy pass@1, the same in both.
  assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/maj@1", "eval/maj@4"} <= set(got)
  assert 0 <= got["eval/pass@1"] <= got["eval/pass@2"] <= got["eval/pass@4"] <= 1
