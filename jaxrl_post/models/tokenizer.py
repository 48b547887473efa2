"""Tokenizers from a Hugging Face directory or from GGUF metadata, plus chat templates.

Chat templates are the model's own Jinja templates, rendered with jinja2 in a sandbox the
way transformers renders them (trim_blocks, lstrip_blocks, raise_exception, tojson).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional, Sequence

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxrl_post.errors import UserError

# Split patterns of llama.cpp's pre-tokenizers, as in the models' own tokenizer.json files.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# GGUF token_type values for tokens that must match whole in text (control, user-defined).
_SPECIAL_TOKEN_TYPES = (3, 4)


class Tokenizer:
  """Text <-> ids, special tokens, stop ids and the model's chat template."""

  def __init__(self, tok: tokenizers.Tokenizer, *, source: str, bos_token: Optional[str],
               eos_token: Optional[str], chat_template: Optional[str],
               extra_stop_ids: Sequence[int] = ()):
    self._tok = tok
    self.source = source
    self.bos_token, self.eos_token = bos_token, eos_token
    self.chat_template = chat_template
    self.bos_id = tok.token_to_id(bos_token) if bos_token else None
    self.eos_id = tok.token_to_id(eos_token) if eos_token else None
    stops = {self.eos_id, *extra_stop_ids} - {None}
    self.stop_ids = tuple(sorted(stops))

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> Optional[int]:
    return self._tok.token_to_id(token)

  def to_json(self) -> str:
    """The whole tokenizer as tokenizer.json text (what exports write)."""
    return self._tok.to_str()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    if not self.chat_template:
      raise UserError(f"{self.source}: the model has no chat template (drop --chat)")
    return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                source=self.source)

  def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
    # The template already holds every special token, so none are added again.
    return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def render_chat_template(template: str, messages: list[dict[str, str]],
                         add_generation_prompt: bool, *, source: str, **special) -> str:
  try:
    return _compiled_template(template, source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special)
  except jinja2.TemplateError as e:
    raise UserError(f"{source}: cannot render the chat template ({e})") from None


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str, source: str):
  """The template compiled once: compiling took most of the 5 ms a chat prompt took to
  encode (1.5 s for the generate CLI's 300 prompts)."""
  def raise_exception(message):
    raise UserError(f"{source}: chat template error: {message}")

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                 indent=indent)
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template)
  except jinja2.TemplateError as e:
    raise UserError(f"{source}: cannot render the chat template ({e})") from None


def _token_content(value: Any) -> Optional[str]:
  if isinstance(value, dict):
    return value.get("content")
  return value


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path}: cannot read JSON ({e})") from None


def _chat_template_from_dir(model_dir: str, cfg: dict[str, Any]) -> Optional[str]:
  jinja_file = os.path.join(model_dir, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    with open(jinja_file, encoding="utf-8") as f:
      return f.read()
  template = cfg.get("chat_template")
  if isinstance(template, list):  # Named templates: use "default".
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  return template


def tokenizer_from_hf_dir(model_dir: str) -> Tokenizer:
  path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.isfile(path):
    raise UserError(f"{path}: file not found")
  try:
    tok = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises bare Exceptions on malformed files.
    raise UserError(f"{path}: cannot parse tokenizer ({e})") from None
  cfg_path = os.path.join(model_dir, "tokenizer_config.json")
  cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
  gen_path = os.path.join(model_dir, "generation_config.json")
  gen_eos = _read_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
  extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
  return Tokenizer(tok, source=model_dir, bos_token=_token_content(cfg.get("bos_token")),
                   eos_token=_token_content(cfg.get("eos_token")),
                   chat_template=_chat_template_from_dir(model_dir, cfg), extra_stop_ids=extra)


def _gguf_pre_tokenizer(pre: str, path: str):
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  split = lambda pattern: pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
  if pre in ("default", "gpt2"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":  # SmolLM2 isolates every digit before the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
  if pre in ("llama-bpe", "llama3", "smaug-bpe"):
    return pre_tokenizers.Sequence([split(_LLAMA3_SPLIT), byte_level])
  if pre == "qwen2":
    return pre_tokenizers.Sequence([split(_QWEN2_SPLIT), byte_level])
  raise UserError(f"{path}: GGUF field tokenizer.ggml.pre={pre!r} is not supported "
                  "(supported: gpt2, smollm, llama-bpe, qwen2)")


def tokenizer_from_gguf(meta: dict[str, Any], path: str) -> Tokenizer:
  """Builds the byte-level BPE tokenizer that a GGUF file describes in its metadata."""
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise UserError(f"{path}: GGUF field tokenizer.ggml.model={kind!r} is not supported "
                    "(only byte-level BPE, 'gpt2'); load the Hugging Face directory instead")
  tokens = meta["tokenizer.ggml.tokens"]
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  pre = meta.get("tokenizer.ggml.pre", "default")
  bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                   ignore_merges=pre in ("llama-bpe", "llama3"))
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = _gguf_pre_tokenizer(pre, path)
  tok.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type", [])
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES]
  tok.add_special_tokens(special)
  name = lambda key: tokens[meta[key]] if key in meta else None
  bos = name("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
  extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if k in meta]
  return Tokenizer(tok, source=path, bos_token=bos, eos_token=name("tokenizer.ggml.eos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"), extra_stop_ids=extra)


# Printable ASCII: enough for arithmetic, countdown and short English prompts.
DEFAULT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
CHAR_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def char_tokenizer(chars: str = DEFAULT_CHARS) -> Tokenizer:
  """One id per character, for models trained from scratch (the quickstart's tiny model).

  Ids 0-3 are <pad>, <s>, </s>, <unk>; characters follow in the given order. Decoding
  concatenates (no spaces between tokens); unknown characters become <unk>.
  """
  if len(set(chars)) != len(chars):
    raise UserError("char tokenizer: the character set has duplicates")
  vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS)}
  vocab.update({c: len(CHAR_SPECIALS) + i for i, c in enumerate(chars)})
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.add_special_tokens(list(CHAR_SPECIALS))
  tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  return Tokenizer(tok, source="chars", bos_token=None, eos_token="</s>", chat_template=None)
