"""Prompt K/V reused across requests: whole prompt pages kept after their prefill.

Chat prompts open with the same template and system prompt. Once a prompt is prefilled,
its whole pages stay here, keyed by a digest of every token up to each page's end; a
later prompt with the same leading tokens takes those pages (shared, reference-counted,
never written again: samples write only after the prompt) and prefills only the rest.

Shared prefixes rarely end on a page boundary (a 24-token template fills one 16-token page
and half the next), so matching goes on inside the first page that differs: among the
cached pages that follow the same whole pages, the one whose leading tokens match the
prompt's longest is named in the match, and the engine copies it into the prompt's own
page (copy on write) and prefills from the first token that differs.

Each page may carry a per-token record beside its K/V (a MoE model's expert choices,
which routing replay needs for every prompt token); a match hands back the record of the
tokens it supplies, so a cached prompt is never a gap in it.

The cache holds one reference per page. Pages that only the cache holds are evicted,
least recently used first, when the pool runs short. A page's K/V belongs to the weights
that wrote it, so the engine clears the cache when its weights change.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterator, NamedTuple, Optional

import numpy as np

from jaxrl_post.rollout.pages import PageAllocator

_ROOT = b""  # The parent of every prompt's first page.


class PrefixMatch(NamedTuple):
  """What a prompt takes from the cache.

  pages: cached pages holding its leading whole pages, to share as they are.
  partial: a cached page whose first `partial_tokens` tokens are the prompt's next ones,
    to copy into the prompt's own page len(pages); None when no page starts that way.
  record: the per-token records of the supplied tokens ([tokens, ...]), when the pages
    were added with one; else None.
  """
  pages: list[int]
  partial: Optional[int]
  partial_tokens: int
  record: Optional[np.ndarray] = None

  def tokens(self, page_size: int) -> int:
    """Prompt tokens whose K/V the match supplies."""
    return len(self.pages) * page_size + self.partial_tokens


class PrefixCache:
  """Whole prompt pages of one data shard's pool, by the tokens they complete."""

  def __init__(self, alloc: PageAllocator, page_size: int):
    self.alloc, self.page_size = alloc, page_size
    self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
    # The pages that follow each cached page (or the root), with their tokens, for
    # matching inside a page; _parent inverts it for eviction.
    self._children: dict[bytes, dict[bytes, np.ndarray]] = {}
    self._parent: dict[bytes, bytes] = {}
    self._records: dict[bytes, np.ndarray] = {}  # Per-token records of a page, if added.
    self.hit_tokens = 0  # Prompt tokens served from the cache instead of prefilled.

  def __len__(self) -> int:
    return len(self._pages)

  def _digests(self, prompt: np.ndarray, pages: int) -> Iterator[bytes]:
    """Digest of prompt[:(i + 1) * page_size] for i < pages (a running hash)."""
    h, ps = hashlib.blake2b(digest_size=16), self.page_size
    for i in range(pages):
      h.update(np.asarray(prompt[i * ps:(i + 1) * ps], np.int32).tobytes())
      yield h.digest()

  def match(self, prompt: np.ndarray) -> PrefixMatch:
    """The longest cached start of the prompt: whole pages, then a page's leading tokens.
    The last prompt token is always left out: its prefill gives the logits of the first
    sampled token."""
    limit, ps = len(prompt) - 1, self.page_size
    pages, parent, used = [], _ROOT, []
    for digest in self._digests(prompt, limit // ps):
      page = self._pages.get(digest)
      if page is None:
        break
      self._pages.move_to_end(digest)
      pages.append(page)
      used.append((digest, ps))
      parent = digest
    at = len(pages) * ps
    child, n = self._longest_start(parent, np.asarray(prompt[at:min(at + ps, limit)]))
    partial = None if child is None else self._pages[child]
    if child is not None:
      used.append((child, n))
    found = PrefixMatch(pages, partial, n, self._record_of(used))
    self.hit_tokens += found.tokens(ps)
    return found

  def _record_of(self, used: list[tuple[bytes, int]]) -> Optional[np.ndarray]:
    """The leading tokens' records of these (page digest, tokens) pairs, or None."""
    parts = [self._records.get(digest) for digest, _ in used]
    if not parts or any(p is None for p in parts):
      return None
    return np.concatenate([p[:n] for p, (_, n) in zip(parts, used)])

  def _longest_start(self, parent: bytes, tokens: np.ndarray) -> tuple[Optional[bytes], int]:
    """The child page (digest) of `parent` whose leading tokens match `tokens` longest
    (ties: the first cached), and how many match."""
    children = self._children.get(parent)
    if not children or not len(tokens):
      return None, 0
    digests = list(children)
    rows = np.stack([children[d][:len(tokens)] for d in digests])
    matched = np.cumprod(rows == tokens[None, :], axis=1).sum(axis=1)
    best = int(np.argmax(matched))
    if matched[best] == 0:
      return None, 0
    self._pages.move_to_end(digests[best])
    return digests[best], int(matched[best])

  def add(self, prompt: np.ndarray, pages: list[int],
          record: Optional[np.ndarray] = None) -> None:
    """Keeps the whole pages of a prefilled prompt (pages[i] holds its page i), with each
    token's record ([P, ...]) when given."""
    parent, ps = _ROOT, self.page_size
    for i, (digest, page) in enumerate(zip(self._digests(prompt, len(prompt) // ps), pages)):
      if digest in self._pages:
        self._pages.move_to_end(digest)
      else:
        self.alloc.share(page)
        self._pages[digest] = page
        self._parent[digest] = parent
        self._children.setdefault(parent, {})[digest] = np.array(prompt[i * ps:(i + 1) * ps],
                                                                 np.int32)
        if record is not None:
          self._records[digest] = np.array(record[i * ps:(i + 1) * ps])
      parent = digest

  def _forget(self, digest: bytes) -> None:
    page = self._pages.pop(digest)
    parent = self._parent.pop(digest)
    self._records.pop(digest, None)
    siblings = self._children[parent]
    del siblings[digest]
    if not siblings:
      del self._children[parent]
    self.alloc.release(page)

  def evict(self, n: int) -> int:
    """Frees up to n pages that only the cache holds, least recently used first; returns
    how many it freed. With a window pool, a page whose window part only the cache still
    holds frees that part."""
    freed = 0
    window = self.alloc.window
    for digest, page in list(self._pages.items()):
      if freed == n:
        break
      if self.alloc.refcount[page] == 1 or (window is not None and window.refs[page] == 1):
        self._forget(digest)
        freed += 1
    return freed

  def clear(self) -> None:
    """Drops every entry (pages still used by sequences stay theirs)."""
    for page in self._pages.values():
      self.alloc.release(page)
    self._pages.clear()
    self._children.clear()
    self._parent.clear()
    self._records.clear()
