"""Loading paths and bad input: every failure is one line naming the file, field or value."""

import json
import os
import shutil

import gguf
import numpy as np
import pytest

from jaxrl_post import models
from jaxrl_post.errors import UserError
from jaxrl_post.models.decode import generate_dense

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
LLAMA_DIR = os.path.join(FIXTURES, "hf", "tiny_llama")


def one_line_error(fn, *match):
  with pytest.raises(UserError) as info:
    fn()
  msg = str(info.value)
  assert "\n" not in msg
  for m in match:
    assert m in msg, msg
  return msg


def copy_llama(tmp_path):
  out = tmp_path / "model"
  shutil.copytree(LLAMA_DIR, out)
  return out


def _permute(w, n_head):  # llama.cpp's convert_hf_to_gguf row permutation for Q/K.
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def write_tiny_gguf(path, arch="llama"):
  """Converts the tiny Llama fixture to GGUF the way llama.cpp does (F32, permuted Q/K)."""
  from safetensors.numpy import load_file
  cfg = json.load(open(os.path.join(LLAMA_DIR, "config.json")))
  tok = json.load(open(os.path.join(LLAMA_DIR, "tokenizer.json")))
  w = load_file(os.path.join(LLAMA_DIR, "model.safetensors"))
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
  writer.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
  writer.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
  writer.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
  writer.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
  writer.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
  writer.add_float32(f"{arch}.rope.freq_base", cfg["rope_parameters"]["rope_theta"])
  writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
  vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
  merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
  writer.add_string("tokenizer.ggml.model", "gpt2")
  writer.add_string("tokenizer.ggml.pre", "default")
  writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
  writer.add_array("tokenizer.ggml.token_type", [3 if t in ("<s>", "</s>") else 1
                                                 for t, _ in vocab])
  writer.add_array("tokenizer.ggml.merges", merges)
  writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
  writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
  heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  # Llama 3 scaling lives in a rope_freqs tensor of per-frequency divisors in GGUF.
  from jaxrl_post.models.hf import config_from_hf
  from jaxrl_post.models.layers import rope_inv_freq
  ours = config_from_hf(cfg, "config.json")
  base = rope_inv_freq(ours.replace(rope_scaling=models.RopeScaling()))
  writer.add_tensor("rope_freqs.weight", (base / rope_inv_freq(ours)).astype(np.float32))
  writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
  writer.add_tensor("output_norm.weight", w["model.norm.weight"])
  writer.add_tensor("output.weight", w["lm_head.weight"])
  names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
           "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for i in range(cfg["num_hidden_layers"]):
    for hf, g in names.items():
      t = w[f"model.layers.{i}.{hf}.weight"]
      if g == "attn_q":
        t = _permute(t, heads)
      elif g == "attn_k":
        t = _permute(t, kv)
      writer.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def logits(model, ids):
  import jax.numpy as jnp
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model.logits(model(ids, pos)))


def test_gguf_with_permuted_qk_and_rope_freqs_matches_transformers(tmp_path):
  path = write_tiny_gguf(tmp_path / "tiny.gguf")
  model, tok = models.load(str(path), compute_dtype="float32")
  assert model.config.rope_scaling.kind == "factors"
  expected = np.load(os.path.join(LLAMA_DIR, "expected.npz"))
  assert np.abs(logits(model, expected["input_ids"]) - expected["logits"]).max() <= 1e-4
  strings = ["Hello, world!", "emoji: 😀🎉👍🏽 and 🇫🇷 flags", "日本語のテキストと中文字符"]
  want = json.loads(str(expected["token_ids"]))
  assert [tok.encode(s) for s in strings] == [want[0], want[4], want[3]]


def test_param_dtype_override_is_respected():
  model, _ = models.load(LLAMA_DIR, param_dtype="bfloat16")
  assert model.embed[...].dtype == np.dtype("bfloat16")


def test_an_override_of_what_the_weights_fix_names_the_field_and_both_values():
  one_line_error(lambda: models.load(LLAMA_DIR, num_layers=5), "tiny_llama/config.json: "
                 "override num_layers=5 differs from the model's 3, which its weights fix")
  one_line_error(lambda: models.load("smollm2-135m-instruct", vocab_size=128),
                 ".gguf: override vocab_size=128 differs from the model's 49152")
  model, _ = models.load(LLAMA_DIR, num_layers=3, param_dtype="bfloat16")  # A repeat is fine.
  assert model.config.num_layers == 3 and model.config.param_dtype == "bfloat16"


def test_unknown_model_name():
  one_line_error(lambda: models.load("no-such-model"), "no-such-model", "smollm2-135m-instruct")


def test_missing_config_file(tmp_path):
  d = copy_llama(tmp_path)
  os.remove(d / "config.json")
  one_line_error(lambda: models.load(str(d)), "config.json", "not found")


def test_missing_tensor_names_the_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  d = copy_llama(tmp_path)
  w = load_file(str(d / "model.safetensors"))
  del w["model.layers.1.mlp.up_proj.weight"]
  save_file(w, str(d / "model.safetensors"))
  one_line_error(lambda: models.load(str(d)), "model.layers.1.mlp.up_proj.weight")


def test_wrong_tensor_shape_names_the_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  d = copy_llama(tmp_path)
  w = load_file(str(d / "model.safetensors"))
  w["model.layers.0.self_attn.q_proj.weight"] = w["model.layers.0.self_attn.q_proj.weight"][:8]
  save_file(w, str(d / "model.safetensors"))
  one_line_error(lambda: models.load(str(d)), "q_proj.weight", "shape")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
  d = copy_llama(tmp_path)
  f = d / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
  one_line_error(lambda: models.load(str(d)), "model.safetensors", "corrupt or truncated")


def test_corrupt_sharded_index(tmp_path):
  d = tmp_path / "qwen"
  shutil.copytree(os.path.join(FIXTURES, "hf", "tiny_qwen2"), d)
  (d / "model.safetensors.index.json").write_text("{not json")
  one_line_error(lambda: models.load(str(d)), "model.safetensors.index.json", "JSON")


def test_unsupported_architecture(tmp_path):
  d = copy_llama(tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["model_type"] = "gpt_neox"
  (d / "config.json").write_text(json.dumps(cfg))
  one_line_error(lambda: models.load(str(d)), "config.json", "gpt_neox")


def test_unsupported_rope_scaling(tmp_path):
  d = copy_llama(tmp_path)
  cfg = json.loads((d / "config.json").read_text())
  cfg["rope_parameters"]["rope_type"] = "yarn"
  (d / "config.json").write_text(json.dumps(cfg))
  one_line_error(lambda: models.load(str(d)), "config.json", "yarn")


def test_truncated_gguf(tmp_path):
  path = write_tiny_gguf(tmp_path / "tiny.gguf")
  data = path.read_bytes()
  path.write_bytes(data[:len(data) * 2 // 3])
  one_line_error(lambda: models.load(str(path)), "tiny.gguf", "truncated")


def test_gguf_header_garbage(tmp_path):
  path = tmp_path / "bad.gguf"
  path.write_bytes(b"NOTAGGUF" + bytes(100))
  one_line_error(lambda: models.load(str(path)), "bad.gguf", "corrupt")


def test_unsupported_gguf_architecture(tmp_path):
  path = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
  one_line_error(lambda: models.load(str(path)), "falcon.gguf", "falcon")


def test_missing_gguf_file(tmp_path):
  one_line_error(lambda: models.load(str(tmp_path / "missing.gguf")), "missing.gguf")


def test_prompt_longer_than_context():
  model, _ = models.load(LLAMA_DIR)
  context = model.config.max_position_embeddings
  one_line_error(lambda: generate_dense(model, [[5] * (context - 3)], max_new_tokens=8),
                 f"{context - 3} tokens", f"context of {context}")


def test_chat_template_from_tokenizer_config(tmp_path):
  d = copy_llama(tmp_path)
  os.remove(d / "chat_template.jinja")
  cfg = json.loads((d / "tokenizer_config.json").read_text())
  cfg["chat_template"] = [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                           "[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"},
                          {"name": "tool_use", "template": "unused"}]
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  _, tok = models.load(str(d))
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi"


def test_chat_template_errors_are_one_line(tmp_path):
  d = copy_llama(tmp_path)
  (d / "chat_template.jinja").write_text("{{ raise_exception('only user turns') }}")
  _, tok = models.load(str(d))
  one_line_error(lambda: tok.encode_chat([{"role": "user", "content": "hi"}]),
                 "chat template", "only user turns")
  (d / "chat_template.jinja").write_text("{% for %}")
  _, tok = models.load(str(d))
  one_line_error(lambda: tok.encode_chat([{"role": "user", "content": "hi"}]), "chat template")
