"""Prompt K/V reused across requests: whole prompt pages kept after their prefill.

Chat prompts open with the same template and system prompt. Once a prompt is prefilled,
its whole pages stay here, keyed by a digest of every token up to each page's end; a
later prompt with the same leading tokens takes those pages (shared, reference-counted,
never written again: samples write only after the prompt) and prefills only the rest.

The cache holds one reference per page. Pages that only the cache holds are evicted,
least recently used first, when the pool runs short. A page's K/V belongs to the weights
that wrote it, so the engine clears the cache when its weights change.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterator

import numpy as np

from jaxrl_post.rollout.pages import PageAllocator


class PrefixCache:
  """Whole prompt pages of one data shard's pool, by the tokens they complete."""

  def __init__(self, alloc: PageAllocator, page_size: int):
    self.alloc, self.page_size = alloc, page_size
    self._pages: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
    self.hit_tokens = 0  # Prompt tokens served from the cache instead of prefilled.

  def __len__(self) -> int:
    return len(self._pages)

  def _digests(self, prompt: np.ndarray, pages: int) -> Iterator[bytes]:
    """Digest of prompt[:(i + 1) * page_size] for i < pages (a running hash)."""
    h, ps = hashlib.blake2b(digest_size=16), self.page_size
    for i in range(pages):
      h.update(np.asarray(prompt[i * ps:(i + 1) * ps], np.int32).tobytes())
      yield h.digest()

  def match(self, prompt: np.ndarray) -> list[int]:
    """Cached pages holding the prompt's leading whole pages. The last prompt token is
    always left out: its prefill gives the logits of the first sampled token."""
    out = []
    for digest in self._digests(prompt, (len(prompt) - 1) // self.page_size):
      page = self._pages.get(digest)
      if page is None:
        break
      self._pages.move_to_end(digest)
      out.append(page)
    self.hit_tokens += len(out) * self.page_size
    return out

  def add(self, prompt: np.ndarray, pages: list[int]) -> None:
    """Keeps the whole pages of a prefilled prompt (pages[i] holds its page i)."""
    for digest, page in zip(self._digests(prompt, len(prompt) // self.page_size), pages):
      if digest in self._pages:
        self._pages.move_to_end(digest)
      else:
        self.alloc.share(page)
        self._pages[digest] = page

  def evict(self, n: int) -> int:
    """Frees up to n pages that only the cache holds, least recently used first; returns
    how many it freed."""
    freed = 0
    for digest, page in list(self._pages.items()):
      if freed == n:
        break
      if self.alloc.refcount[page] == 1:
        del self._pages[digest]
        self.alloc.release(page)
        freed += 1
    return freed

  def clear(self) -> None:
    """Drops every entry (pages still used by sequences stay theirs)."""
    for page in self._pages.values():
      self.alloc.release(page)
    self._pages.clear()
