"""Observations appended as tokens: the chat template's text, never a re-tokenised history."""

import os

from jaxrl_post.envs import TurnFormat
from jaxrl_post.models.tokenizer import char_tokenizer, tokenizer_from_hf_dir

HF = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "tiny_qwen2")


def test_an_observation_continues_the_chat_template_after_the_models_turn():
  tok = tokenizer_from_hf_dir(HF)
  turns = TurnFormat(tok, chat_template=True)
  prompt = tok.encode_chat([{"role": "user", "content": "q"}])
  reply = tok.encode("A", add_special_tokens=False) + [tok.eos_id]  # Closed by the model.
  ids = prompt + reply + turns.observation("O", reply[-1])
  want = tok.apply_chat_template([{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": "A"},
                                  {"role": "user", "content": "O"}])
  assert tok.decode(ids) == want
  cut = tok.encode("A", add_special_tokens=False)  # Ended by the turn's token limit.
  assert tok.decode(prompt + cut + turns.observation("O", cut[-1])) == want


def test_without_a_template_an_observation_is_its_own_text():
  tok = char_tokenizer()
  turns = TurnFormat(tok, chat_template=False)
  assert turns.observation("+", tok.eos_id) == tok.encode("+", add_special_tokens=False)
