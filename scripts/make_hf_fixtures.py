"""Writes the Hugging Face golden fixtures that tests/models compares against.

Development-only: needs torch (CPU), transformers, accelerate and gguf, which the test
suite itself does not install (PyPI's torch for Python 3.12 is a multi-GB CUDA build).
Run it once after changing what the fixtures cover, and commit tests/fixtures/:

  python scripts/make_hf_fixtures.py --gguf PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
  python scripts/make_hf_fixtures.py --tiny tiny_qwen3 tiny_qwen3_tied   # just those

Outputs:
  tests/fixtures/hf/tiny_{llama,qwen2,mistral,qwen3,qwen3_tied,qwen3_moe,gemma3,
                         gemma3_softcap}/   save_pretrained model + tokenizer dirs
  tests/fixtures/hf/tiny_*/expected.npz          input ids and transformers' f32 logits,
                                                 16-token greedy continuations of 3 prompts
                                                 (Gemma 3: also the chat-templated text and
                                                 ids of CHAT_PROMPTS)
  tests/fixtures/smollm2_gguf_hf.npz             SmolLM2 GGUF: prompt ids, last-position
                                                 log-softmax, 32-token greedy continuations,
                                                 tokenizer ids for a string set
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there",
                 "Q: What is 12 + 7?\nA:"]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "List three prime numbers."]
TOKENIZER_STRINGS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé — “quotes” and ‘apostrophes’", "日本語のテキストと中文字符",
    "emoji: 😀🎉👍🏽 and 🇫🇷 flags", "Ünïcödé Ωμέγα Привет мир", "tabs\tand\nnewlines\r\n",
    "def f(x):\n    return x ** 2  # square", "<|im_start|>user\nhi<|im_end|>",
    "price: $3.50, 12+7=19, 2024-11-22", "don't won't I'm you're",
]
# Whitespace runs before a digit: transformers' GGUF converter has no rule for the `smollm`
# pre-tokenizer and falls back to the GPT-2 regex; SmolLM2 (and llama.cpp) isolate digits.
DIGIT_WHITESPACE_STRINGS = ["a  1", "x   42 y", "\n\n3"]

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json): <bos> first, a system
# turn folded into the first user turn, "model" as the assistant's role, trimmed content.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Conversations whose templated ids the Gemma 3 fixtures store (a system turn, two turns).
GEMMA3_CHATS = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS] + [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "3+3?"}]]


def tiny_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = (TOKENIZER_STRINGS + PLAIN_PROMPTS + CHAT_PROMPTS) * 20
  tok.train_from_iterator(corpus, trainer)
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                              eos_token="</s>", chat_template=CHAT_TEMPLATE)


def gemma3_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
  """The tiny BPE with Gemma's special tokens, <bos> prepended, and Gemma 3's template."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=GEMMA3_SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator((TOKENIZER_STRINGS + PLAIN_PROMPTS + CHAT_PROMPTS) * 20, trainer)
  tok.post_processor = processors.TemplateProcessing(
      single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
      unk_token="<unk>", chat_template=GEMMA3_CHAT_TEMPLATE)


def gemma3_configs(vocab: int) -> dict:
  """Sliding and full layers with a window of 6 (well inside the 16-token continuations),
  head_dim 32 != hidden / heads, query_pre_attn_scalar 24 != head_dim, linear RoPE scaling
  on the global layers. The second is untied and soft-caps its logits; it also sets
  attn_logit_softcapping, which transformers' Gemma 3 attention does not apply."""
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=24, sliding_window=6, max_position_embeddings=256,
                layer_types=["sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1000000.0},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0}},
                rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=2, eos_token_id=[1, 5])
  return {
      "tiny_gemma3": transformers.Gemma3TextConfig(**common, tie_word_embeddings=True),
      "tiny_gemma3_softcap": transformers.Gemma3TextConfig(
          **common, tie_word_embeddings=False, attn_logit_softcapping=2.0,
          final_logit_softcapping=0.5),
  }


def tiny_configs(vocab: int) -> dict:
  common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
  # Qwen3: q/k norms, no biases, head_dim 32 where hidden / heads would be 16.
  qwen3 = dict(common, num_hidden_layers=2, intermediate_size=96, head_dim=32,
               rope_theta=1000000.0)
  return {
      "tiny_llama": transformers.LlamaConfig(
          **common, rope_theta=500000.0, tie_word_embeddings=False,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
      "tiny_qwen2": transformers.Qwen2Config(**common, rope_theta=1000000.0,
                                             tie_word_embeddings=True),
      "tiny_mistral": transformers.MistralConfig(**common, rope_theta=10000.0,
                                                 sliding_window=8, tie_word_embeddings=False),
      "tiny_qwen3": transformers.Qwen3Config(**qwen3, tie_word_embeddings=False),
      "tiny_qwen3_tied": transformers.Qwen3Config(**qwen3, tie_word_embeddings=True),
      # Qwen3-MoE: 8 experts, top-2, renormalised gates; every layer sparse.
      "tiny_qwen3_moe": transformers.Qwen3MoeConfig(
          **qwen3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
          tie_word_embeddings=False),
  }


def write_tiny_models(names=None) -> None:
  tok = tiny_tokenizer(320)
  vocab = len(tok)
  rng = np.random.default_rng(0)
  gemma_tok = gemma3_tokenizer(320)
  configs = {**tiny_configs(vocab), **gemma3_configs(len(gemma_tok))}
  for i, (name, cfg) in enumerate(configs.items()):
    is_gemma = name.startswith("tiny_gemma3")
    # Drawn for every fixture, so each gets the same ids whichever ones are written.
    ids = rng.integers(0, vocab, size=(2, 20)) % cfg.vocab_size
    if names and name not in names:
      continue
    torch.manual_seed(i)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them too.
      for pname, p in model.named_parameters():
        if "norm" in pname or "bias" in pname:
          p.add_(0.1 * torch.randn_like(p))
        if pname.endswith("mlp.gate.weight"):  # Routers: clear winners, no top-k near-ties.
          p.normal_(0.0, 0.5)
    out = FIXTURES / "hf" / name
    shard = "60KB" if name == "tiny_qwen2" else "50MB"  # qwen2 exercises the sharded index
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    model_tok = gemma_tok if is_gemma else tok
    model_tok.save_pretrained(out)
    with torch.no_grad():
      logits = model(torch.tensor(ids)).logits.float().numpy()
    token_ids = [model_tok.encode(s) for s in TOKENIZER_STRINGS]
    prompts = [model_tok.encode(p) for p in PLAIN_PROMPTS[:3]]
    conts = [greedy(model, p, 16) for p in prompts]
    extra = gemma3_chats(model_tok) if is_gemma else {}
    np.savez_compressed(out / "expected.npz", input_ids=ids, logits=logits,
                        token_ids=np.array(json.dumps(token_ids)),
                        greedy_prompts=np.array(json.dumps(prompts)), greedy=np.array(conts),
                        **extra)
    print(name, "written", logits.shape)


def gemma3_chats(tok) -> dict:
  texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
           for m in GEMMA3_CHATS]
  ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
  return dict(chats=np.array(json.dumps(GEMMA3_CHATS)), chat_texts=np.array(json.dumps(texts)),
              chat_ids=np.array(json.dumps(ids)))


def greedy(model, ids: list[int], steps: int) -> list[int]:
  seq = list(ids)
  with torch.no_grad():
    for _ in range(steps):
      logits = model(torch.tensor([seq])).logits[0, -1]
      seq.append(int(torch.argmax(logits)))
  return seq[len(ids):]


def write_smollm2(gguf_path: str) -> None:
  d, f = os.path.split(os.path.abspath(gguf_path))
  tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
  model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f,
                                                            torch_dtype=torch.float32)
  model.eval()
  prompts, chat_flags = [], []
  for p in PLAIN_PROMPTS:
    prompts.append(tok.encode(p, add_special_tokens=True)), chat_flags.append(False)
  chat_texts = []
  for p in CHAT_PROMPTS:
    msgs = [{"role": "user", "content": p}]
    chat_texts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    prompts.append(tok(chat_texts[-1], add_special_tokens=False)["input_ids"])
    chat_flags.append(True)
  logsm, conts = [], []
  with torch.no_grad():
    for ids in prompts:
      logits = model(torch.tensor([ids])).logits[0, -1].float()
      logsm.append(torch.log_softmax(logits, -1).numpy())
      conts.append(greedy(model, ids, 32))
  strings = TOKENIZER_STRINGS + DIGIT_WHITESPACE_STRINGS
  np.savez_compressed(
      FIXTURES / "smollm2_gguf_hf.npz",
      texts=np.array(json.dumps(PLAIN_PROMPTS + CHAT_PROMPTS)),
      chat=np.array(chat_flags), chat_rendered=np.array(json.dumps(chat_texts)),
      prompt_ids=np.array(json.dumps(prompts)), last_log_softmax=np.stack(logsm),
      greedy=np.array(conts), strings=np.array(json.dumps(strings)),
      string_ids=np.array(json.dumps([tok.encode(s, add_special_tokens=False)
                                      for s in strings])),
      versions=np.array(json.dumps({"transformers": transformers.__version__,
                                    "torch": torch.__version__})))
  print("smollm2 written;", [tok.decode(c) for c in conts])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF file (else no SmolLM2 "
                      "fixture is written)")
  parser.add_argument("--tiny", nargs="*", help="write only these tiny_* fixtures")
  args = parser.parse_args()
  write_tiny_models(args.tiny)
  if args.gguf:
    write_smollm2(args.gguf)


if __name__ == "__main__":
  main()
