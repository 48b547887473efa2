"""Observations as tokens appended after a model turn (token-in/token-out).

The history is never re-tokenised: each observation's text is encoded on its own and its
ids appended after the ids the engine produced. With a chat template the observation is
wrapped as the template wraps a new user turn after an assistant turn, so the appended ids
are what the template would have rendered, minus the stop token the model already wrote.
"""

from __future__ import annotations

from jaxrl_post.errors import UserError
from jaxrl_post.models import Tokenizer

_REPLY, _OBS = "\x1dREPLY\x1d", "\x1dOBS\x1d"


class TurnFormat:
  """Encodes observations for one tokenizer, with or without its chat template."""

  def __init__(self, tokenizer: Tokenizer, chat_template: bool):
    self.tokenizer = tokenizer
    self.before, self.after = "", ""
    if chat_template:
      text = tokenizer.apply_chat_template(
          [{"role": "user", "content": "q"}, {"role": "assistant", "content": _REPLY},
           {"role": "user", "content": _OBS}], add_generation_prompt=True)
      if _REPLY not in text or _OBS not in text:
        raise UserError(f"{tokenizer.source}: the chat template drops turns; multi-turn "
                        "episodes need one that renders every message")
      start = text.index(_REPLY) + len(_REPLY)
      self.before = text[start:text.index(_OBS)]
      self.after = text[text.index(_OBS) + len(_OBS):]
    self._stops = {i: tokenizer.decode([i]) for i in tokenizer.stop_ids}

  def observation(self, text: str, last_token: int) -> list[int]:
    """The ids to append after a model turn that ended with `last_token`."""
    before = self.before
    stop = self._stops.get(int(last_token))
    if stop and before.startswith(stop):  # The model closed its turn itself.
      before = before[len(stop):]
    return self.tokenizer.encode(before + text + self.after, add_special_tokens=False)
