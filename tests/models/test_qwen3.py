"""Qwen3 dense: config.json fields and errors, the q/k norm parameters, export and reload.

Logit and greedy parity with transformers on the loaded fixtures is in test_hf_parity.py;
here our export of those fixtures must reload with the same logits, in our loader and
(when a Python with torch and transformers exists at TRANSFORMERS_PYTHON) in transformers.
"""

import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl_post import models
from jaxrl_post.errors import UserError
from jaxrl_post.models.hf import config_from_hf
from jaxrl_post.models.hf_export import save_pretrained
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import (init_model, logical_axes, param_count, params_of,
                                           with_params)
from jaxrl_post.sharding import TRAINING_RULES, MeshConfig, logical_to_spec, make_mesh

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
QWEN3 = ("tiny_qwen3", "tiny_qwen3_tied")
LOGIT_TOL = 1e-4  # ours vs transformers, float32 (as in test_hf_parity.py).
ROUND_TRIP_TOL = 1e-5  # ours vs ours reloaded from the export (as in tests/test_export.py).
TRANSFORMERS_PYTHON = os.environ.get("TRANSFORMERS_PYTHON", "/work/peer-venv/bin/python")


def fixture_config(name="tiny_qwen3"):
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    return json.load(f)


def full_logits(model, ids):
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model.logits(model(ids, pos)))


# ------------------------------------------------------------------ config and parameters


def test_config_reads_head_dim_norms_and_tying():
  for name in QWEN3:
    cfg = config_from_hf(fixture_config(name), "config.json")
    assert (cfg.head_dim, cfg.hidden_size // cfg.num_heads) == (32, 16)
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None
    assert cfg.tie_word_embeddings == name.endswith("_tied")
  biased = config_from_hf({**fixture_config(), "attention_bias": True}, "config.json")
  assert biased.qkv_bias and biased.o_bias  # Qwen3's attention_bias covers o_proj too.


def test_qk_norm_params_are_replicated_head_dim_vectors_and_not_lora_targets():
  lora = models.LoraConfig(rank=2, targets=("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                            "w_down"))
  cfg = config_from_hf(fixture_config(), "config.json", lora=lora)
  model = models.abstract_model(cfg)
  axes = logical_axes(model)["layers"]
  assert axes["q_norm"] == axes["k_norm"] == ("layers", "head_dim")
  assert "q_norm" not in params_of(model, nnx.LoRAParam)["layers"]
  assert param_count(models.abstract_model(cfg.replace(lora=None))) == cfg.num_params
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices())
  shape = (cfg.num_layers, cfg.head_dim)
  assert logical_to_spec(axes["q_norm"], shape, TRAINING_RULES, mesh) == PartitionSpec(None,
                                                                                         None)


@pytest.mark.parametrize("change,match", [
    ({"head_dim": None}, "missing field 'head_dim'"),  # transformers would default to 128.
    ({"head_dim": 33}, "head_dim=33"),
    ({"num_key_value_heads": 3}, "num_kv_heads=3"),
    ({"num_attention_heads": "four"}, "'num_attention_heads'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "yarn"),
    ({"use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_config_is_a_one_line_error_naming_file_and_field(change, match):
  c = fixture_config()
  c.update(change)
  c = {k: v for k, v in c.items() if v is not None}
  with pytest.raises(UserError) as info:
    config_from_hf(c, "/m/config.json")
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("/m/config.json: ") and match in msg, msg


def test_sliding_window_on_every_layer_is_read():
  c = {**fixture_config(), "use_sliding_window": True, "sliding_window": 8}
  del c["layer_types"]
  assert config_from_hf({**c, "max_window_layers": 0}, "c").sliding_window == 8
  assert config_from_hf(c, "c").sliding_window is None  # Default max_window_layers 28 > 2.


@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_missing_or_misshapen_norm_tensor_names_it(tmp_path, damage):
  from safetensors.numpy import load_file, save_file
  d = tmp_path / "m"
  shutil.copytree(os.path.join(FIXTURES, "tiny_qwen3"), d)
  w = load_file(str(d / "model.safetensors"))
  name = "model.layers.1.self_attn.k_norm.weight"
  if damage == "missing":
    del w[name]
  else:
    w[name] = w[name][:16]
  save_file(w, str(d / "model.safetensors"))
  with pytest.raises(UserError, match=name.replace(".", r"\.")):
    models.load(str(d))


# ------------------------------------------------------------------ export


def _export_fixture(name, out):
  model, tok = models.load(os.path.join(FIXTURES, name), compute_dtype="float32")
  files = save_pretrained(str(out), model.config, params_of(model), tok, max_shard_bytes=100_000)
  return model, files


@pytest.mark.parametrize("name", QWEN3)
def test_export_round_trip_gives_the_same_logits(name, tmp_path):
  model, files = _export_fixture(name, tmp_path)
  assert "model.safetensors.index.json" in files  # Sharded at 100 KB.
  with open(tmp_path / "config.json") as f:
    c = json.load(f)
  assert (c["model_type"], c["architectures"], c["head_dim"]) == ("qwen3",
                                                                  ["Qwen3ForCausalLM"], 32)
  assert c["attention_bias"] is False and c["tie_word_embeddings"] == name.endswith("_tied")
  with open(tmp_path / "model.safetensors.index.json") as f:
    names = set(json.load(f)["weight_map"])
  assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} \
      <= names
  assert ("lm_head.weight" in names) != name.endswith("_tied")
  back, _ = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config == model.config
  expected = np.load(os.path.join(FIXTURES, name, "expected.npz"))
  ours = full_logits(model, expected["input_ids"])
  assert np.abs(full_logits(back, expected["input_ids"]) - ours).max() <= ROUND_TRIP_TOL
  assert np.abs(ours - expected["logits"]).max() <= LOGIT_TOL


def test_export_refuses_qk_norms_with_qkv_bias_only(tmp_path):
  cfg = config_from_hf(fixture_config(), "config.json").replace(qkv_bias=True)
  with pytest.raises(UserError, match="attention_bias"):
    save_pretrained(str(tmp_path), cfg, params_of(init_model(cfg)), char_tokenizer())


def _random_biased_windowed(tmp_path):
  """A random Qwen3 with attention biases and a sliding window, exported: its config."""
  cfg = config_from_hf({**fixture_config(), "attention_bias": True, "head_dim": 24,
                        "use_sliding_window": True, "sliding_window": 6,
                        "max_window_layers": 0, "layer_types": None, "vocab_size": 128},
                       "config.json", compute_dtype="float32")
  model = init_model(cfg, seed=2)
  rng = np.random.default_rng(0)  # Norms start at one and biases at zero: move them.
  params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape).astype(x.dtype),
                        params_of(model))
  model = with_params(model, params)
  save_pretrained(str(tmp_path), cfg, params, char_tokenizer())
  back, _ = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config == cfg
  return model


def test_biased_windowed_export_round_trip(tmp_path):
  model = _random_biased_windowed(tmp_path)
  back, _ = models.load(str(tmp_path), compute_dtype="float32")
  ids = np.arange(40).reshape(2, 20) % 128
  assert np.abs(full_logits(model, ids) - full_logits(back, ids)).max() <= ROUND_TRIP_TOL


def _has_transformers() -> bool:
  if not os.path.isfile(TRANSFORMERS_PYTHON):
    return False
  probe = ("import importlib.util as u, sys; "
           "sys.exit(0 if u.find_spec('torch') and u.find_spec('transformers') else 1)")
  return subprocess.run([TRANSFORMERS_PYTHON, "-c", probe], capture_output=True,
                        timeout=120).returncode == 0


_HF_SCRIPT = """
import sys, numpy as np, torch, transformers
ids = torch.tensor(np.load(sys.argv[1]))
for i, d in enumerate(sys.argv[3:]):
  m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                        attn_implementation="eager")
  assert type(m).__name__ == "Qwen3ForCausalLM", type(m).__name__
  with torch.no_grad():
    np.save(f"{sys.argv[2]}/{i}.npy", m(ids).logits.float().numpy())
"""


@pytest.mark.skipif(not _has_transformers(), reason=f"no transformers at {TRANSFORMERS_PYTHON}")
def test_transformers_loads_our_qwen3_exports_with_our_logits(tmp_path):
  ids = np.load(os.path.join(FIXTURES, "tiny_qwen3", "expected.npz"))["input_ids"] % 128
  ours, dirs = [], []
  for name in QWEN3:
    model, _ = _export_fixture(name, tmp_path / name)
    ours.append(full_logits(model, ids))
    dirs.append(str(tmp_path / name))
  ours.append(full_logits(_random_biased_windowed(tmp_path / "biased"), ids))
  dirs.append(str(tmp_path / "biased"))
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


# ------------------------------------------------------------------ GGUF


def _write_qwen3_gguf(path, name="tiny_qwen3"):
  """The fixture as llama.cpp converts Qwen3: F32, Q/K rows unpermuted, key_length=head_dim."""
  import gguf
  from safetensors.numpy import load_file
  c, arch = fixture_config(name), "qwen3"
  with open(os.path.join(FIXTURES, name, "tokenizer.json")) as f:
    tok = json.load(f)
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in [("block_count", c["num_hidden_layers"]),
                     ("context_length", c["max_position_embeddings"]),
                     ("embedding_length", c["hidden_size"]),
                     ("feed_forward_length", c["intermediate_size"]),
                     ("attention.head_count", c["num_attention_heads"]),
                     ("attention.head_count_kv", c["num_key_value_heads"]),
                     ("attention.key_length", c["head_dim"])]:
    writer.add_uint32(f"{arch}.{key}", value)
  writer.add_float32(f"{arch}.rope.freq_base", c["rope_parameters"]["rope_theta"])
  writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
  vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
  writer.add_string("tokenizer.ggml.model", "gpt2")
  writer.add_string("tokenizer.ggml.pre", "qwen2")
  writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
  writer.add_array("tokenizer.ggml.token_type", [3 if t in ("<s>", "</s>") else 1
                                                 for t, _ in vocab])
  writer.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m)
                                             for m in tok["model"]["merges"]])
  writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
  names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
  layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for i in range(c["num_hidden_layers"]):
    names.update({f"model.layers.{i}.{h}": f"blk.{i}.{g}" for h, g in layer.items()})
  for hf, t in load_file(os.path.join(FIXTURES, name, "model.safetensors")).items():
    writer.add_tensor(names[hf.removesuffix(".weight")] + ".weight", np.ascontiguousarray(t))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def test_qwen3_gguf_matches_transformers(tmp_path):
  model, tok = models.load(_write_qwen3_gguf(tmp_path / "q3.gguf"), compute_dtype="float32")
  cfg = model.config
  assert cfg.qk_norm and cfg.head_dim == 32 and not cfg.qkv_bias and not cfg.tie_word_embeddings
  expected = np.load(os.path.join(FIXTURES, "tiny_qwen3", "expected.npz"))
  diff = np.abs(full_logits(model, expected["input_ids"]) - expected["logits"]).max()
  assert diff <= LOGIT_TOL, diff
  want = json.loads(str(expected["token_ids"]))  # Strings with no digits or unicode.
  assert [tok.encode(s) for s in ("Hello, world!", "don't won't I'm you're")] == \
      [want[0], want[-1]]
