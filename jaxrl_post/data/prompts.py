"""The prompt pipeline: a task's training split, shuffled per epoch by grain, tokenized.

Grain's shuffled, repeated dataset is read by index, so the position is one integer saved in
every checkpoint (in the form grain's own iterator states it): a resumed run draws exactly
the prompts the uninterrupted run would have. Reading by index rather than through grain's
iterator keeps its prefetch threads (16, reading 500 prompts ahead) from competing with the
compiler and the verifiers for the host's cores; a step reads a few dozen prompts.
Prompts over the token budget are truncated or skipped (per config) and counted; a step
always gets its full number of prompts, so shapes stay fixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import grain

from jaxrl_post.errors import UserError
from jaxrl_post.models import Tokenizer
from jaxrl_post.rewards import Problem
from jaxrl_post.rewards.base import SYSTEM

OVERLONG = ("skip", "truncate")


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  """Attributes:
    max_prompt_tokens: the prompt token budget.
    overlong: "skip" drops a longer prompt; "truncate" keeps its last max_prompt_tokens
      tokens (the end holds the chat template's generation prompt).
    chat_template: wrap the prompt as a user turn of the model's chat template.
    system_prompt: optional system turn (with chat_template). A problem's own system turn
      (Problem.meta["system"], from a verl row) takes its place.
  """

  max_prompt_tokens: int = 256
  overlong: str = "skip"
  chat_template: bool = False
  system_prompt: Optional[str] = None

  def __post_init__(self):
    if self.max_prompt_tokens < 1:
      raise UserError(f"prompt config: max_prompt_tokens must be >= 1, "
                      f"got {self.max_prompt_tokens}")
    if self.overlong not in OVERLONG:
      raise UserError(f"prompt config: overlong={self.overlong!r} is not one of {OVERLONG}")


def prompt_text(tokenizer: Tokenizer, problem: Problem, cfg: PromptConfig) -> str:
  system = problem.meta.get(SYSTEM) or cfg.system_prompt
  if not cfg.chat_template:
    # The row's own system turn is part of its data: without a template it still leads
    # the prompt, rather than being dropped. The config's is a chat-template option only.
    own = problem.meta.get(SYSTEM)
    return f"{own}\n\n{problem.prompt}" if own else problem.prompt
  messages = [{"role": "system", "content": system}] if system else []
  return tokenizer.apply_chat_template(messages + [{"role": "user", "content": problem.prompt}])


def encode_prompt(tokenizer: Tokenizer, problem: Problem,
                  cfg: PromptConfig) -> tuple[Optional[list[int]], bool]:
  """(ids, was_truncated); ids is None when the prompt is skipped as too long or empty."""
  ids = tokenizer.encode(prompt_text(tokenizer, problem, cfg),
                         add_special_tokens=not cfg.chat_template)
  if not ids:
    return None, False
  if len(ids) <= cfg.max_prompt_tokens:
    return ids, False
  if cfg.overlong == "skip":
    return None, False
  return ids[-cfg.max_prompt_tokens:], True


class PromptStream:
  """Endless shuffled training prompts with a checkpointable position.

  Args:
    problems: the training split.
    tokenizer: the policy's tokenizer.
    cfg: prompt budget and formatting.
    seed: shuffle seed (each epoch is a different permutation).
  """

  def __init__(self, problems: Sequence[Problem], tokenizer: Tokenizer, cfg: PromptConfig,
               seed: int):
    if len(problems) == 0:
      raise UserError("the task's training split is empty")
    self.tokenizer, self.cfg = tokenizer, cfg
    self._dataset = grain.MapDataset.source(problems).shuffle(seed=seed).repeat()
    self._next = 0  # The index of the next prompt in the endless shuffled dataset.
    self.counts = {"skipped_overlong": 0, "truncated": 0}

  def next_batch(self, n: int) -> tuple[list[Problem], list[list[int]]]:
    """The next n usable prompts (problems and token ids)."""
    problems, ids = [], []
    scanned = 0
    while len(problems) < n:
      problem = self._dataset[self._next]
      self._next += 1
      encoded, truncated = encode_prompt(self.tokenizer, problem, self.cfg)
      scanned += 1
      if encoded is None:
        self.counts["skipped_overlong"] += 1
        if scanned > 1000 + 100 * n and len(problems) < n // 10 + 1:
          raise UserError(f"almost every prompt is longer than max_prompt_tokens="
                          f"{self.cfg.max_prompt_tokens} (skipped {scanned - len(problems)})")
        continue
      self.counts["truncated"] += int(truncated)
      problems.append(problem)
      ids.append(encoded)
    return problems, ids

  def get_state(self) -> dict[str, Any]:
    return {"iterator": {"next_index": self._next}, "counts": dict(self.counts)}

  def set_state(self, state: dict[str, Any]) -> None:
    self._next = int(state["iterator"]["next_index"])
    self.counts = dict(state["counts"])
