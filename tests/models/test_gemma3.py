"""Gemma 3 (text): config.json fields and errors, parity with transformers, export and reload.

The fixtures (scripts/make_hf_fixtures.py, transformers 5.24) mix sliding-window and full
layers with a window of 6, so the window cuts into the 20-token logit rows and the 16-token
greedy continuations; tiny_gemma3_softcap is untied and soft-caps its logits.
"""

import dataclasses
import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import models
from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig
from jaxrl_post.models import layers as L
from jaxrl_post.models.decode import generate_dense
from jaxrl_post.models.hf import config_from_hf
from jaxrl_post.models.hf_export import save_pretrained
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import init_model, param_count, params_of, with_params
from tests.models.test_qwen3 import TRANSFORMERS_PYTHON, _has_transformers

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
GEMMA3 = ("tiny_gemma3", "tiny_gemma3_softcap")
LOGIT_TOL = 1e-4  # ours vs transformers, float32 (as in test_hf_parity.py).
ROUND_TRIP_TOL = 1e-5  # ours vs ours reloaded from the export (as in tests/test_export.py).
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")


def fixture_config(name="tiny_gemma3"):
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    return json.load(f)


def expected(name):
  return np.load(os.path.join(FIXTURES, name, "expected.npz"))


def full_logits(model, ids):
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model.logits(model(ids, pos)))


def load(name):
  return models.load(os.path.join(FIXTURES, name), compute_dtype="float32")


# ------------------------------------------------------------------ config


def test_config_reads_the_gemma3_architecture():
  cfg = config_from_hf(fixture_config(), "config.json")
  assert cfg.layer_types == LAYER_TYPES and cfg.sliding_window == 6
  assert cfg.layer_windows == (6, 6, None, 6) and cfg.mixed_windows
  assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
  assert cfg.rope_scaling == models.RopeScaling("linear", factor=8.0)
  assert cfg.qk_norm and cfg.norm_plus_one and cfg.sandwich_norms and cfg.scale_embeddings
  assert (cfg.query_pre_attn_scalar, cfg.mlp_activation, cfg.head_dim) == (24, "gelu_tanh", 32)
  assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
  capped = config_from_hf(fixture_config("tiny_gemma3_softcap"), "config.json")
  # transformers' Gemma 3 never applies attn_logit_softcapping: read as absent.
  assert capped.final_logit_softcapping == 0.5 and capped.attn_logit_softcapping is None
  assert param_count(models.abstract_model(cfg)) == cfg.num_params


def test_older_config_form_and_window_pattern_give_the_same_config():
  """transformers 4's rope_theta / rope_scaling / rope_local_base_freq, and layer_types
  left to sliding_window_pattern (every 6th layer full, as Gemma 3's own files say)."""
  c = fixture_config()
  old = {k: v for k, v in c.items() if k not in ("rope_parameters", "layer_types")}
  old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
             rope_scaling={"type": "linear", "factor": 8.0})
  cfg = config_from_hf(old, "config.json")
  assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention")
  assert cfg == config_from_hf(c, "config.json")


def test_multimodal_gemma3_directory_loads_its_text_model(tmp_path):
  """model_type gemma3: config under text_config (fields at their defaults left out) and
  the weights under the language model's prefix."""
  from safetensors.numpy import load_file, save_file
  src = os.path.join(FIXTURES, "tiny_gemma3")
  d = tmp_path / "mm"
  shutil.copytree(src, d)
  text = {k: v for k, v in fixture_config().items() if k not in ("rms_norm_eps",
                                                                 "tie_word_embeddings")}
  with open(d / "config.json", "w") as f:
    json.dump({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": text, "vision_config": {"hidden_size": 8}}, f)
  w = load_file(str(d / "model.safetensors"))
  save_file({"model.language_model." + k.removeprefix("model."): v for k, v in w.items()},
            str(d / "model.safetensors"), metadata={"format": "pt"})
  model, _ = models.load(str(d), compute_dtype="float32")
  ref, _ = load("tiny_gemma3")
  assert model.config == ref.config
  ids = expected("tiny_gemma3")["input_ids"]
  assert np.array_equal(full_logits(model, ids), full_logits(ref, ids))


@pytest.mark.parametrize("change,match", [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    ({"sliding_window": None}, "sliding_window"),
    ({"sliding_window": -2}, "sliding_window"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"query_pre_attn_scalar": "x"}, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding-window layers"),
    ({"model_type": "gemma3"}, "text_config"),
])
def test_bad_config_is_a_one_line_error_naming_file_and_field(change, match):
  c = {**fixture_config(), **change}
  with pytest.raises(UserError) as info:
    config_from_hf(c, "/m/config.json")
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("/m/config.json: ") and match in msg, msg


@pytest.mark.parametrize("change,match", [
    ({"mlp_activation": "relu"}, "mlp_activation"),
    ({"layer_types": ("full_attention",)}, "num_layers=2"),
    ({"layer_types": ("sliding_attention",) * 2}, "sliding_window is None"),
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
])
def test_model_config_refuses_bad_gemma_fields(change, match):
  base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
              num_kv_heads=1, head_dim=8)
  with pytest.raises(UserError, match=match) as info:
    ModelConfig(**base, **change)
  assert "\n" not in str(info.value)


# ------------------------------------------------------------------ parity


@pytest.mark.parametrize("name", GEMMA3)
def test_logits_match_transformers(name):
  model, _ = load(name)
  want = expected(name)
  diff = np.abs(full_logits(model, want["input_ids"]) - want["logits"]).max()
  assert diff <= LOGIT_TOL, diff


@pytest.mark.parametrize("change", [
    {"layer_types": ("full_attention",) * 4},  # No window anywhere.
    {"layer_types": ("sliding_attention",) * 4},  # Window on the global layer too.
    {"rope_local_base_freq": 1e6},  # The global base on the sliding layers.
    {"query_pre_attn_scalar": 32.0},
    {"norm_plus_one": False},
])
def test_each_gemma3_trait_changes_the_logits(change):
  """The parity above is not met by accident: dropping any one trait breaks it."""
  model, _ = load("tiny_gemma3")
  want = expected("tiny_gemma3")
  other = with_params(init_model(model.config.replace(**change)), params_of(model))
  assert np.abs(full_logits(other, want["input_ids"]) - want["logits"]).max() > 1e-2


@pytest.mark.parametrize("name", GEMMA3)
def test_greedy_tokens_identical_to_transformers(name):
  model, tok = load(name)
  want = expected(name)
  prompts = json.loads(str(want["greedy_prompts"]))
  assert [tok.encode(s) for s in ("The capital of France is", "def fibonacci(n):")] == \
      prompts[:2]  # <bos> prepended, as Gemma's tokenizer does.
  out = generate_dense(model, prompts, max_new_tokens=16, temperature=0.0, stop_ids=())
  assert out.tokens == want["greedy"].tolist()
  assert max(len(p) for p in prompts) + 16 > 2 * model.config.sliding_window


def test_long_rows_through_the_attention_kernel_pick_each_layers_window():
  """Rows past plain_max_len take the packed-attention kernel (its window static): each
  scanned layer runs the windowed or the full variant by its index (lax.cond)."""
  model, _ = load("tiny_gemma3")
  want = expected("tiny_gemma3")
  ids = jnp.asarray(want["input_ids"])
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  kernel = dataclasses.replace(L.TrainingAttention().kernel, jnp_block=8)  # Several tiles.
  attention = L.TrainingAttention(plain_max_len=8, kernel=kernel)
  logits = np.asarray(model.logits(model(ids, pos, attention=attention)))
  assert np.abs(logits - want["logits"]).max() <= LOGIT_TOL


def test_gradients_flow_through_the_per_layer_choice_with_remat():
  model, _ = load("tiny_gemma3")
  model = with_params(init_model(model.config.replace(remat="dots")), params_of(model))
  ids = jnp.asarray(expected("tiny_gemma3")["input_ids"])
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)

  def loss(params):
    m = with_params(model, params)
    return jnp.mean(jax.nn.log_softmax(m.logits(m(ids, pos)))[..., 3])

  grads = jax.jit(jax.grad(loss))(params_of(model))
  layers = grads["layers"]
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  for name in ("post_attn_norm", "post_mlp_norm", "q_norm", "wq"):
    assert (np.abs(np.asarray(layers[name])).reshape(4, -1).max(axis=1) > 0).all(), name


def test_training_refuses_final_logit_soft_capping():
  """The chunked logprob kernel computes uncapped logits: the trainer says so."""
  from jaxrl_post.rl.forward import completion_logprobs
  model, _ = load("tiny_gemma3_softcap")
  with pytest.raises(UserError, match="final_logit_softcapping"):
    completion_logprobs(model, params_of(model), None)


def test_chat_template_and_stop_ids_match_transformers():
  _, tok = load("tiny_gemma3")
  want = expected("tiny_gemma3")
  chats = json.loads(str(want["chats"]))
  for messages, text, ids in zip(chats, json.loads(str(want["chat_texts"])),
                                 json.loads(str(want["chat_ids"]))):
    assert tok.apply_chat_template(messages) == text
    assert tok.encode_chat(messages) == ids
  assert text.startswith("<bos><start_of_turn>user\n") and text.endswith("<start_of_turn>model\n")
  eot = tok.token_to_id("<end_of_turn>")
  assert tok.stop_ids == (tok.eos_id, eot)  # generation_config's eos_token_id list.
  with pytest.raises(UserError, match="alternate"):
    tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_bfloat16_forward_stays_close_to_float32():
  """Compute in bf16 (the rollout's dtype): embeddings scaled in bf16, (1 + w) norms in f32."""
  model, _ = load("tiny_gemma3")
  bf16, _ = models.load(os.path.join(FIXTURES, "tiny_gemma3"), compute_dtype="bfloat16")
  ids = expected("tiny_gemma3")["input_ids"]
  diff = np.abs(full_logits(bf16, ids) - full_logits(model, ids)).max()
  assert diff < 0.05, diff


# ------------------------------------------------------------------ export


def _export_fixture(name, out):
  model, tok = load(name)
  files = save_pretrained(str(out), model.config, params_of(model), tok, max_shard_bytes=100_000)
  return model, files


@pytest.mark.parametrize("name", GEMMA3)
def test_export_round_trip_gives_the_same_logits(name, tmp_path):
  model, files = _export_fixture(name, tmp_path)
  assert "model.safetensors.index.json" in files
  with open(tmp_path / "config.json") as f:
    c = json.load(f)
  assert (c["model_type"], c["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
  assert c["layer_types"] == list(LAYER_TYPES) and c["query_pre_attn_scalar"] == 24
  with open(tmp_path / "model.safetensors.index.json") as f:
    names = set(json.load(f)["weight_map"])
  assert {f"model.layers.3.{n}.weight" for n in (
      "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
      "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")} <= names
  assert ("lm_head.weight" in names) == name.endswith("softcap")
  back, tok = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config == model.config and tok.stop_ids == (1, 5)
  ids = expected(name)["input_ids"]
  ours = full_logits(model, ids)
  assert np.abs(full_logits(back, ids) - ours).max() <= ROUND_TRIP_TOL


@pytest.mark.parametrize("change,match", [
    ({"attn_logit_softcapping": 30.0}, "soft-cap attention"),
    ({"sandwich_norms": False}, "Gemma 3 set"),
    ({"qkv_bias": True}, "attention_bias"),
])
def test_export_refuses_what_transformers_gemma3_cannot_express(change, match, tmp_path):
  cfg = config_from_hf(fixture_config(), "config.json").replace(**change)
  with pytest.raises(UserError, match=match):
    save_pretrained(str(tmp_path), cfg, params_of(init_model(cfg)), char_tokenizer())


def test_export_refuses_gemma_only_fields_on_other_architectures(tmp_path):
  cfg = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4,
                    layer_types=("sliding_attention", "full_attention"))
  with pytest.raises(UserError, match="only in Gemma 3"):
    save_pretrained(str(tmp_path), cfg, params_of(init_model(cfg)), char_tokenizer())


_HF_SCRIPT = """
import sys, numpy as np, torch, transformers
ids = torch.tensor(np.load(sys.argv[1]))
for i, d in enumerate(sys.argv[3:]):
  m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                        attn_implementation="eager")
  assert type(m).__name__ == "Gemma3ForCausalLM", type(m).__name__
  with torch.no_grad():
    np.save(f"{sys.argv[2]}/{i}.npy", m(ids).logits.float().numpy())
"""


@pytest.mark.skipif(not _has_transformers(), reason=f"no transformers at {TRANSFORMERS_PYTHON}")
def test_transformers_loads_our_gemma3_exports_with_our_logits(tmp_path):
  ids = expected("tiny_gemma3")["input_ids"]
  ours, dirs = [], []
  for name in GEMMA3:
    model, _ = _export_fixture(name, tmp_path / name)
    ours.append(full_logits(model, ids))
    dirs.append(str(tmp_path / name))
  np.save(tmp_path / "ids.npy", ids)
  # Not from the repository root: its kernels/ folder would shadow the package transformers
  # imports under that name.
  done = subprocess.run([TRANSFORMERS_PYTHON, "-c", _HF_SCRIPT, str(tmp_path / "ids.npy"),
                         str(tmp_path), *dirs], capture_output=True, text=True, timeout=600,
                        cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
  assert done.returncode == 0, done.stderr[-3000:]
  for i, want in enumerate(ours):
    diff = np.abs(np.load(tmp_path / f"{i}.npy") - want).max()
    assert diff <= LOGIT_TOL, (dirs[i], diff)
