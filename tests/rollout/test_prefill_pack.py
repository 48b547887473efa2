"""Packed prefill: several prompt chunks per row, each seeing only its own pages."""

import numpy as np

from jaxrl_post.rollout import SamplingParams, generate, prefill_pack
from jaxrl_post.rollout.pages import TRASH_PAGE
from tests.rollout import helpers as H


def _chunk(shard, n, start, pages):
  return prefill_pack.Chunk(shard, np.arange(100, 100 + n, dtype=np.int32), start, pages)


def _record_packs(monkeypatch, summary) -> list:
  """Patches prefill_pack.pack to record summary(chunks, kwargs, result) of every call."""
  seen, pack = [], prefill_pack.pack

  def recording(chunks, **kw):
    out = pack(chunks, **kw)
    seen.append(summary(chunks, kw, out))
    return out

  monkeypatch.setattr(prefill_pack, "pack", recording)
  return seen


def test_pack_lays_chunks_end_to_end_per_shard():
  chunks = [_chunk(0, 5, 0, [3, 4]), _chunk(1, 7, 0, [9, 10]), _chunk(0, 10, 6, [5, 6, 7, 8]),
            _chunk(0, 3, 0, [2])]
  out, last = prefill_pack.pack(chunks, shards=2, width=8, page_size=4)
  # Shard 0 holds 18 tokens: 3 rows of 8 per shard; shard 1's 7 tokens in its first row.
  assert out.tokens.shape == (6, 8) and out.key_pages.shape == (6, 6)  # 5 key pages, rounded.
  np.testing.assert_array_equal(out.segments[:3].ravel(),
                                [0] * 5 + [2] * 10 + [3] * 3 + [-1] * 6)
  np.testing.assert_array_equal(out.segments[3], [1] * 7 + [-1])
  assert np.all(out.segments[4:] == -1) and np.all(out.write_pages[4:] == TRASH_PAGE)
  # Chunk 2 (positions 6..15, pages 5: 4..7, 6: 8..11, 7: 12..15) runs from row 0 into
  # row 1; in each row its keys are its pages up to its last token there, from position 0.
  np.testing.assert_array_equal(out.positions[0], [0, 1, 2, 3, 4, 6, 7, 8])
  np.testing.assert_array_equal(out.positions[1], [9, 10, 11, 12, 13, 14, 15, 0])
  np.testing.assert_array_equal(out.write_pages[0], [3, 3, 3, 3, 4, 6, 6, 7])
  np.testing.assert_array_equal(out.key_pages[0, :5], [3, 4, 5, 6, 7])
  np.testing.assert_array_equal(out.key_segments[0], [0, 0, 2, 2, 2, -1])
  np.testing.assert_array_equal(out.key_starts[0, :5], [0, 4, 0, 4, 8])
  np.testing.assert_array_equal(out.key_pages[1, :5], [5, 6, 7, 8, 2])
  np.testing.assert_array_equal(out.key_segments[1], [2, 2, 2, 2, 3, -1])
  # Each chunk's last token, in call order, padded to 8 entries.
  assert last.shape == (8,)
  for i, c in enumerate(chunks):
    row, col = divmod(int(last[i]), 8)
    assert out.segments[row, col] == i and out.tokens[row, col] == c.tokens[-1]
    assert out.positions[row, col] == c.start + len(c.tokens) - 1


def test_row_and_key_counts_compile_few_shapes():
  assert [prefill_pack.row_count(t, 8) for t in (0, 1, 8, 9, 40, 72, 136, 1000)] == [
      1, 1, 1, 2, 5, 10, 20, 128]
  assert [prefill_pack.round_up(n, 4) for n in (1, 3, 5, 6, 7, 9, 13, 17)] == [
      1, 3, 6, 6, 8, 12, 16, 24]


def test_a_call_takes_a_compiled_shape_that_covers_it_with_little_waste():
  covering = prefill_pack.covering
  assert covering(10, 8, {(12, 12)}) == (12, 12)
  assert covering(10, 8, {(13, 12)}) == (10, 8)  # More than a quarter more rows.
  assert covering(10, 5, {(12, 12)}) == (10, 5)  # More than twice the key pages.
  assert covering(10, 8, {(9, 8)}) == (10, 8)  # Too small.
  assert covering(10, 8, {(12, 8), (10, 16), (11, 8)}) == (10, 16)  # Fewest rows first.
  chunks = [_chunk(0, 5, 0, [3, 4]), _chunk(0, 3, 0, [2])]
  plain, last = prefill_pack.pack(chunks, shards=1, width=8, page_size=4)
  assert plain.tokens.shape == (1, 8) and plain.key_pages.shape == (1, 3)
  wide, wide_last = prefill_pack.pack(chunks, shards=1, width=8, page_size=4, reuse={(1, 6)})
  assert wide.tokens.shape == (1, 8) and wide.key_pages.shape == (1, 6)
  np.testing.assert_array_equal(wide.key_pages[:, :3], plain.key_pages)
  assert np.all(wide.key_pages[:, 3:] == TRASH_PAGE) and np.all(wide.key_segments[:, 3:] == -1)
  np.testing.assert_array_equal(wide_last, last)


def test_a_smaller_later_call_runs_on_the_first_calls_program(monkeypatch):
  """The second call's 4 prompts need 4 rows and 8 key pages; it runs padded to the first
  call's 5 rows and 16 key pages (one program for both), with the full forward's logprobs."""
  pack = prefill_pack.pack
  shapes = _record_packs(monkeypatch, lambda chunks, kw, out: (
      out[0].tokens.shape, out[0].key_pages.shape,
      pack(chunks, **{**kw, "reuse": ()})[0].tokens.shape))
  prompts = H.prompts(np.random.default_rng(7), [30, 30, 30, 30, 20, 25, 20, 20])
  sampling = SamplingParams(temperature=0.9, max_tokens=3, seed=5)
  out = generate(H.engine(prefill_chunk=32, prefill_rows=4, num_slots=4), prompts, n=1,
                 sampling=sampling)
  assert shapes == [((5, 24), (5, 16), (5, 24)), ((5, 24), (5, 16), (4, 24))]
  assert H.check_behaviour_logprobs(prompts, out, 0.9) == 8 * 3


def test_packed_rows_equal_the_full_forward(monkeypatch):
  """Short prompts share rows, long ones run across rows and, past prefill_chunk, into a
  second call (whose chunk starts inside a page); every sampled token's logprob is the
  full forward's."""
  def placed(chunks, kw, out):
    segments = out[0].segments
    return (len(chunks), len(np.unique(segments[segments >= 0])),
            int(np.sum(np.any(segments >= 0, axis=1))))

  rows_seen = _record_packs(monkeypatch, placed)
  prompts = H.prompts(np.random.default_rng(7), [1, 3, 5, 9, 14, 6, 45, 2])
  sampling = SamplingParams(temperature=0.9, max_tokens=6, seed=5)
  out = generate(H.engine(prefill_chunk=32, prefill_rows=8, num_slots=8), prompts, n=1,
                 sampling=sampling)
  assert H.check_behaviour_logprobs(prompts, out, 0.9) == 8 * 6
  chunks, placed, rows = rows_seen[0]
  assert chunks == placed == 8 and rows < chunks  # Packed: fewer rows than chunks.
  assert len(rows_seen) == 2  # The long prompt's second chunk needed another call.
