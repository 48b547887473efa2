"""The prompt stream: deterministic order, resumable position, overlong prompts counted."""

import pytest

from jaxrl_post.data.prompts import PromptConfig, PromptStream, encode_prompt
from jaxrl_post.errors import UserError
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.rewards import Problem

TOK = char_tokenizer()
PROBLEMS = [Problem(f"p{i}", "x" * (i % 7 + 1), str(i)) for i in range(50)]


def test_same_seed_same_order_and_state_resumes_exactly():
  a = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=3)
  b = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=3)
  assert a.next_batch(7)[0] == b.next_batch(7)[0]
  state = a.get_state()
  want = [a.next_batch(5)[0] for _ in range(15)]  # Crosses epochs.
  c = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=3)
  c.set_state(state)
  assert [c.next_batch(5)[0] for _ in range(15)] == want
  other = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=4)
  assert other.next_batch(7)[0] != PromptStream(PROBLEMS, TOK, PromptConfig(),
                                                seed=3).next_batch(7)[0]


def test_overlong_prompts_are_skipped_or_truncated_and_counted():
  skip = PromptStream(PROBLEMS, TOK, PromptConfig(max_prompt_tokens=4), seed=0)
  problems, ids = skip.next_batch(20)
  assert len(problems) == 20 and all(len(x) <= 4 for x in ids)
  assert all(len(p.prompt) <= 4 for p in problems)
  assert skip.counts["skipped_overlong"] > 0 and skip.counts["truncated"] == 0
  cut = PromptStream(PROBLEMS, TOK, PromptConfig(max_prompt_tokens=4, overlong="truncate"),
                     seed=0)
  problems, ids = cut.next_batch(20)
  assert cut.counts["skipped_overlong"] == 0 and cut.counts["truncated"] > 0
  assert all(len(x) <= 4 for x in ids)


def test_encode_keeps_the_end_when_truncating():
  ids, truncated = encode_prompt(TOK, Problem("a", "abcdef", "1"),
                                 PromptConfig(max_prompt_tokens=3, overlong="truncate"))
  assert truncated and TOK.decode(ids) == "def"


def test_everything_too_long_is_a_clear_error():
  with pytest.raises(UserError, match="longer than max_prompt_tokens"):
    PromptStream(PROBLEMS[1:7], TOK, PromptConfig(max_prompt_tokens=1), seed=0).next_batch(64)
