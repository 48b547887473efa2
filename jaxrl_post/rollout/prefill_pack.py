"""Prompt chunks packed into prefill rows (host side, numpy).

A prefill call used to give every prompt chunk a row of its own, padded to the call's
longest chunk: after a prefix-cache hit the chunks are short and uneven, and a third of
the positions computed were padding. Here a data shard's chunks are laid end to end and
cut into rows of a fixed width, so only the tail of the last row is padding. A token sees
the keys of its own chunk's pages up to its position (forward.prefill_packed,
attention.paged_prefill_attention). A chunk may run on into the next row: every row's
K/V is written to the pages before any row attends, so its later tokens still see the
earlier ones, through the pages.

Each shard's chunks go to that shard's rows (its pages live there); every shard gets the
same number of rows: enough for the fullest shard, rounded up so that only a few shapes
compile. A caller that passes the shapes it has already run (`reuse`) gets one of those
instead of a new shape when it wastes little (see `covering`): a compile costs seconds,
the extra padded rows of one call far less.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Collection, NamedTuple, Sequence

import numpy as np

from jaxrl_post.rollout.pages import TRASH_PAGE, cdiv, pow2_at_least

NO_SEGMENT = -1  # Padding tokens and unused key pages.


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Tokens [start, start + len(tokens)) of one prompt (at least one), in pages `pages`."""

  shard: int
  tokens: np.ndarray
  start: int
  pages: Sequence[int]


class PackedRows(NamedTuple):
  """One prefill call's rows; R rows per shard, shard s in rows [s*R, (s+1)*R). Host
  arrays from `pack`; the same fields, placed on the devices, are the prefill's operand.

  Attributes:
    tokens, positions: [shards*R, T] int32 (padding: token 0 at position 0).
    segments: [shards*R, T] int32 the chunk (index in the call) of each token, or NO_SEGMENT.
    write_pages: [shards*R, T] int32 shard-local page each token's K/V goes to (padding:
      the trash page); the slot in it is position % page_size.
    key_pages: [shards*R, K] int32 pages the row's queries read: for each chunk in the row,
      its pages up to its last token in the row.
    key_segments: [shards*R, K] int32 the chunk a key page belongs to, or NO_SEGMENT.
    key_starts: [shards*R, K] int32 position of the first token of each key page.
  """

  tokens: np.ndarray
  positions: np.ndarray
  segments: np.ndarray
  write_pages: np.ndarray
  key_pages: np.ndarray
  key_segments: np.ndarray
  key_starts: np.ndarray


def round_up(n: int, parts: int) -> int:
  """n rounded up to a multiple of 1/parts of the next power of two (at least 1): little
  padding, and `parts` compiled shapes per doubling."""
  n = max(int(n), 1)
  step = max(1, pow2_at_least(n) // parts)
  return cdiv(n, step) * step


def row_count(tokens: int, width: int) -> int:
  """Rows of `width` for `tokens` tokens, at most an eighth of them padding."""
  return round_up(-(-max(tokens, 1) // width), 8)


def covering(rows: int, keys: int, shapes: Collection[tuple[int, int]]) -> tuple[int, int]:
  """The smallest of `shapes` ((rows, key pages) per shard) that holds `rows` x `keys` with
  at most a quarter more rows and twice the key pages, else (rows, keys) itself. Rows are
  what a prefill computes (every row runs the whole model); key pages only widen the
  attention's reads."""
  fits = [s for s in shapes if rows <= s[0] <= rows + rows // 4 and keys <= s[1] <= 2 * keys]
  return min(fits, default=(rows, keys))


def pack(chunks: Sequence[Chunk], *, shards: int, width: int, page_size: int,
         reuse: Collection[tuple[int, int]] = ()) -> tuple[PackedRows, np.ndarray]:
  """Lays each shard's chunks, in call order, end to end in rows of `width` tokens; the
  key pages per row are rounded up to a multiple of a quarter of a power of two. `reuse`:
  (rows, key pages) shapes at this width already compiled, which the call takes when one
  `covering` allows.

  Returns:
    (rows, last): last is [C] int32, the flat index (row * T + column) of each chunk's
    last token, in call order, padded with 0 to a multiple of 8.
  """
  per_shard = [[(i, c) for i, c in enumerate(chunks) if c.shard == s] for s in range(shards)]
  r = row_count(max(sum(len(c.tokens) for _, c in mine) for mine in per_shard), width)
  pieces = [_pieces(mine, width) for mine in per_shard]  # Per shard: (row, col, i, a, b).
  key_cols = collections.Counter()
  for s, mine in enumerate(pieces):
    for row, _, i, _, b in mine:
      key_cols[s * r + row] += cdiv(chunks[i].start + b, page_size)
  r, k = covering(r, round_up(max(key_cols.values()), 4), reuse)
  out = PackedRows(
      tokens=np.zeros((shards * r, width), np.int32),
      positions=np.zeros((shards * r, width), np.int32),
      segments=np.full((shards * r, width), NO_SEGMENT, np.int32),
      write_pages=np.full((shards * r, width), TRASH_PAGE, np.int32),
      key_pages=np.full((shards * r, k), TRASH_PAGE, np.int32),
      key_segments=np.full((shards * r, k), NO_SEGMENT, np.int32),
      key_starts=np.zeros((shards * r, k), np.int32))
  last = np.zeros((cdiv(len(chunks), 8) * 8,), np.int32)
  used = collections.Counter()  # Key columns filled, per row.
  for s, mine in enumerate(pieces):
    for row, col, i, a, b in mine:
      _place(out, last, s * r + row, col, i, chunks[i], a, b, used, page_size)
  return out, last


def _pieces(mine, width: int) -> list[tuple[int, int, int, int, int]]:
  """(row, column, chunk index, first, end) of each piece of the chunks, end to end."""
  out, at = [], 0
  for i, c in mine:
    a = 0
    while a < len(c.tokens):
      row, col = divmod(at, width)
      b = min(len(c.tokens), a + width - col)
      out.append((row, col, i, a, b))
      at, a = at + b - a, b
  return out


def _place(out: PackedRows, last: np.ndarray, row: int, col: int, i: int, c: Chunk, a: int,
           b: int, used: collections.Counter, page_size: int) -> None:
  """Writes tokens [a, b) of chunk i at (row, col), and its pages up to them as keys."""
  n = b - a
  pos = c.start + np.arange(a, b, dtype=np.int32)
  pages = np.asarray(c.pages, np.int32)
  out.tokens[row, col:col + n] = c.tokens[a:b]
  out.positions[row, col:col + n] = pos
  out.segments[row, col:col + n] = i
  out.write_pages[row, col:col + n] = pages[pos // page_size]
  m, key = cdiv(c.start + b, page_size), used[row]
  out.key_pages[row, key:key + m] = pages[:m]
  out.key_segments[row, key:key + m] = i
  out.key_starts[row, key:key + m] = np.arange(m, dtype=np.int32) * page_size
  used[row] += m
  if b == len(c.tokens):
    last[i] = row * out.tokens.shape[1] + col + n - 1
