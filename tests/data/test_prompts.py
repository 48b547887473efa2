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


def test_the_order_and_state_are_grains_own_iterators():
  """Checkpoints written when the stream read grain's iterator resume on the same prompt."""
  import grain

  it = iter(grain.MapDataset.source(PROBLEMS).shuffle(seed=3).repeat())
  want = [next(it) for _ in range(120)]  # Over two epochs.
  stream = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=3)
  assert stream.next_batch(120)[0] == want
  assert stream.get_state()["iterator"] == it.get_state()
  it.set_state({"next_index": 77})
  resumed = PromptStream(PROBLEMS, TOK, PromptConfig(), seed=3)
  resumed.set_state({"iterator": {"next_index": 77}, "counts": dict(stream.counts)})
  assert resumed.next_batch(30)[0] == [next(it) for _ in range(30)]


def test_everything_too_long_is_a_clear_error():
  # A split of thousands: grain's shuffle reads a split of a few problems slowly (its
  # cycle walk over a 2^16 domain takes milliseconds a prompt), and the stream scans
  # thousands before it gives up.
  long = [Problem(f"q{i}", "xy", "1") for i in range(3000)]
  with pytest.raises(UserError, match="longer than max_prompt_tokens"):
    PromptStream(long, TOK, PromptConfig(max_prompt_tokens=1), seed=0).next_batch(64)
