"""Parity with Hugging Face transformers (PyTorch, CPU, float32).

The expected values are golden fixtures written by scripts/make_hf_fixtures.py, which runs
transformers once: tiny random Llama (llama3 RoPE scaling), Qwen2 (qkv bias, tied, sharded
safetensors), Mistral (sliding window) and Qwen3 (q/k norms, head_dim 32 != hidden / heads,
untied and tied), Qwen3-MoE (8 experts, top-2) saved with save_pretrained, and the embedded SmolLM2-135M-Instruct GGUF
loaded by transformers with gguf_file=....
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import models
from jaxrl_post.models.decode import generate_dense

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
TINY = ("tiny_llama", "tiny_qwen2", "tiny_mistral", "tiny_qwen3", "tiny_qwen3_tied",
        "tiny_qwen3_moe")
# Their fixtures also hold greedy continuations.
QWEN3 = ("tiny_qwen3", "tiny_qwen3_tied", "tiny_qwen3_moe")
LOGIT_TOL = 1e-4  # Issue target for tiny models in float32.
LOG_SOFTMAX_TOL = 1e-3  # Issue target for SmolLM2's last position in float32.


def tiny_dir(name):
  return os.path.join(FIXTURES, "hf", name)


def full_logits(model, ids):
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return np.asarray(model.logits(model(ids, pos)))


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_logits_match_transformers(name):
  model, _ = models.load(tiny_dir(name), compute_dtype="float32")
  expected = np.load(os.path.join(tiny_dir(name), "expected.npz"))
  diff = np.abs(full_logits(model, expected["input_ids"]) - expected["logits"]).max()
  assert diff <= LOGIT_TOL, diff


@pytest.mark.parametrize("name", TINY)
def test_tiny_tokenizer_ids_match_transformers(name):
  _, tok = models.load(tiny_dir(name), compute_dtype="float32")
  expected = np.load(os.path.join(tiny_dir(name), "expected.npz"))
  strings = json.loads(str(np.load(os.path.join(FIXTURES, "smollm2_gguf_hf.npz"))["strings"]))
  want = json.loads(str(expected["token_ids"]))
  assert [tok.encode(s) for s in strings[:len(want)]] == want
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
      "<|user|>hi</s><|assistant|>"
  assert tok.stop_ids == (1,)


@pytest.mark.parametrize("name", QWEN3)
def test_tiny_qwen3_greedy_tokens_identical_to_transformers(name):
  model, tok = models.load(tiny_dir(name), compute_dtype="float32")
  assert model.config.qk_norm and model.config.head_dim == 32
  assert model.config.tie_word_embeddings == name.endswith("_tied")
  expected = np.load(os.path.join(tiny_dir(name), "expected.npz"))
  prompts = json.loads(str(expected["greedy_prompts"]))
  assert [tok.encode(s) for s in ("The capital of France is", "def fibonacci(n):")] == \
      prompts[:2]
  out = generate_dense(model, prompts, max_new_tokens=16, temperature=0.0, stop_ids=())
  assert out.tokens == expected["greedy"].tolist()


@pytest.fixture(scope="module")
def smollm2():
  model, tok = models.load("smollm2-135m-instruct", compute_dtype="float32")
  return model, tok, np.load(os.path.join(FIXTURES, "smollm2_gguf_hf.npz"))


def test_smollm2_config_from_gguf(smollm2):
  model, tok, _ = smollm2
  cfg = model.config
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
  assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 100000.0, True)
  assert tok.vocab_size == 49152 and tok.bos_id == 1 and 2 in tok.stop_ids


def test_smollm2_prompt_ids_and_chat_template_match_transformers(smollm2):
  _, tok, fx = smollm2
  texts, chat = json.loads(str(fx["texts"])), fx["chat"]
  rendered = iter(json.loads(str(fx["chat_rendered"])))
  for text, is_chat, want in zip(texts, chat, json.loads(str(fx["prompt_ids"]))):
    if is_chat:
      messages = [{"role": "user", "content": text}]
      assert tok.apply_chat_template(messages) == next(rendered)
      assert tok.encode_chat(messages) == want
    else:
      assert tok.encode(text) == want


def test_smollm2_last_position_log_softmax_matches_transformers(smollm2):
  model, _, fx = smollm2
  diffs = []
  for i, ids in enumerate(json.loads(str(fx["prompt_ids"]))):
    logp = jax.nn.log_softmax(full_logits(model, [ids])[0, -1])
    diffs.append(float(np.abs(np.asarray(logp) - fx["last_log_softmax"][i]).max()))
  assert max(diffs) <= LOG_SOFTMAX_TOL, diffs


def test_smollm2_greedy_32_tokens_identical_to_transformers(smollm2):
  model, _, fx = smollm2
  prompts = json.loads(str(fx["prompt_ids"]))  # Plain and chat-templated, ragged lengths.
  out = generate_dense(model, prompts, max_new_tokens=32, temperature=0.0, stop_ids=())
  for i, tokens in enumerate(out.tokens):
    assert tokens == fx["greedy"][i].tolist(), i
  assert out.finish_reasons == ["length"] * len(prompts)


def test_smollm2_tokenizer_ids_match_transformers_on_unicode_and_emoji(smollm2):
  _, tok, fx = smollm2
  strings, want = json.loads(str(fx["strings"])), json.loads(str(fx["string_ids"]))
  checked = 0
  for s, ids in zip(strings, want):
    if any(c.isdigit() for c in s) and any(c.isspace() for c in s):
      continue  # Whitespace next to digits: see the next test.
    assert tok.encode(s, add_special_tokens=False) == ids, s
    assert tok.decode(ids) == s
    checked += 1
  assert checked >= 8


def test_smollm2_tokenizer_isolates_digits_like_the_original_model(smollm2):
  """transformers reads the GGUF pre-tokenizer `smollm` as GPT-2's regex; SmolLM2 and
  llama.cpp split every digit first. Ours follows the model, so the two differ exactly
  where whitespace runs precede a digit."""
  _, tok, fx = smollm2
  strings, hf_ids = json.loads(str(fx["strings"])), json.loads(str(fx["string_ids"]))
  for s, theirs in zip(strings, hf_ids):
    ours = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ours) == s
    pieces = [tok.encode(p, add_special_tokens=False) for p in _split_digits(s)]
    assert ours == [i for p in pieces for i in p], s
    if s in ("a  1", "x   42 y", "\n\n3"):
      assert ours != theirs, s


def _split_digits(s):
  out, cur = [], ""
  for c in s:
    if c.isdigit():
      out += [cur, c] if cur else [c]
      cur = ""
    else:
      cur += c
  return out + ([cur] if cur else [])
