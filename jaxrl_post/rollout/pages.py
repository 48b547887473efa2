"""The KV page pool: device arrays sized from a memory budget, and their host-side allocator.

Device side, K and V are each ``[Hkv, L, num_pages, page_size, D]``: a page id means the same
tokens in every layer and head, so one page table per sequence serves the whole model.
Page 0 is never handed out: rows and tokens with nothing to write (free decode slots, the
padding of a prefill chunk) write there, so a stray write can never land in a live page.

Host side, pages carry reference counts. A group of samples of one prompt shares the
prompt's full pages by reference; the partial last page is copied per sample before its
first write (copy on write). Memory is promised before it is used: a sequence holds a
reservation for every page it may still need, so the allocator never runs dry mid-decode and
a request that does not fit waits instead of failing or overwriting a live page. A
sequence of a model whose every layer has a sliding window gives back the pages all
windows have left while it decodes (`PagedSequence.release_before`).

A model with both kinds of layer (Gemma 3: five sliding layers to one global) keeps its
sliding layers' K/V in a pool of their own (`WindowPages`): a page id still names a
sequence's tokens in every layer, but only the global layers store them in the main pool;
the sliding layers store them in the window page the id maps to, and a decoding sequence
gives back its window pages as its window passes them, so sliding layers hold about a
window's pages per sequence while global layers hold the whole sequence.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.models.config import ModelConfig

TRASH_PAGE = 0


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def pow2_at_least(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """How many KV pages to allocate; the first field set wins.

  Attributes:
    page_size: tokens per page.
    num_pages: an explicit page count (page 0, the write sink, included).
    memory_bytes: a budget in bytes for K and V together.
    memory_fraction: a share of the device memory still free, from device.memory_stats().
    fallback_bytes: the whole pool's budget where a backend reports no memory stats (the
      CPU, whose devices share the host's memory).
    reserved_bytes: device memory left free before memory_fraction is taken: what a
      colocated train step adds while it runs (the training loop sets it from the step's
      compiled peak).
  """

  page_size: int = 16
  num_pages: int | None = None
  memory_bytes: int | None = None
  memory_fraction: float = 0.8
  fallback_bytes: int = 1 << 30
  reserved_bytes: int = 0

  def __post_init__(self):
    if self.page_size < 1:
      raise UserError(f"pool config: page_size must be >= 1, got {self.page_size}")
    if self.num_pages is not None and self.num_pages < 2:
      raise UserError(f"pool config: num_pages must be >= 2 (page 0 is reserved), "
                      f"got {self.num_pages}")
    if self.reserved_bytes < 0:
      raise UserError(f"pool config: reserved_bytes must be >= 0, got {self.reserved_bytes}")
    if not 0.0 < self.memory_fraction <= 1.0:
      raise UserError(f"pool config: memory_fraction must be in (0, 1], "
                      f"got {self.memory_fraction}")


def page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
  """Bytes of one page across all layers, K and V together."""
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
  return per_token * page_size


def split_kv(cfg: ModelConfig) -> bool:
  """Whether sliding-window layers keep their K/V in a window pool of their own: models
  with both sliding and global layers (every layer windowed, as in Mistral, gives whole
  pages back instead: PagedSequence.release_before)."""
  return cfg.mixed_windows  # Layers have either no window or the model's sliding_window.


def window_layers(cfg: ModelConfig) -> int:
  """Layers whose K/V live in the window pool (0 without one)."""
  return sum(w is not None for w in cfg.layer_windows) if split_kv(cfg) else 0


def window_span(cfg: ModelConfig, page_size: int, decode_steps: int) -> int | None:
  """Most window pages one decoding sequence holds at once (None: no window pool): the
  pages its window covers, and those grown ahead of it for two decode calls in flight
  and a few pages more (Engine._grow_pages)."""
  if not split_kv(cfg):
    return None
  ahead = 2 * decode_steps + 3 * page_size
  return cdiv(cfg.sliding_window - 1 + ahead, page_size) + 2


def window_share(cfg: ModelConfig, page_size: int, max_pages: int, decode_steps: int) -> float:
  """Window pages per main page a pool is sized with: a sequence of max_pages pages holds
  at most window_span of them in the window pool (1.0 without a window pool)."""
  span = window_span(cfg, page_size, decode_steps)
  return 1.0 if span is None else min(1.0, span / max_pages)


def pool_page_bytes(cfg: ModelConfig, page_size: int, dtype, share: float = 1.0) -> float:
  """Bytes a main page costs with its share of window pages (page_bytes without a window
  pool)."""
  per_layer = page_bytes(cfg, page_size, dtype) / cfg.num_layers
  windowed = window_layers(cfg)
  return per_layer * (cfg.num_layers - windowed + share * windowed)


def window_pool_pages(num_pages: int, share: float, max_pages: int, span: int) -> int:
  """Window pages beside a main pool of num_pages (page 0, the sink, in both): its share,
  but never fewer than one sequence of max_pages needs while it is prefilled and starts
  decoding (a prompt's pages all take window pages until its samples' windows pass them),
  nor more than the main pool's."""
  shared = int(np.ceil((num_pages - 1) * share)) + 1
  return max(2, min(num_pages, max(shared, max_pages + span + 1)))


def host_available_bytes() -> int:
  """Memory the host can still give without swapping (Linux's MemAvailable; 0 where
  unknown): what CPU devices, which report no memory stats, have left."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def free_device_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def pool_budget(pool: PoolConfig, free_bytes: int | None, reserved_bytes: int = 0):
  """Bytes of KV a PoolConfig asks for on one device (None: the backend reports no free
  memory): memory_bytes if set, else memory_fraction of what is free once
  pool.reserved_bytes and `reserved_bytes` (what a colocated train step adds while it
  runs) are set aside."""
  if pool.memory_bytes is not None:
    return pool.memory_bytes
  if free_bytes is None:
    return None
  reserved = reserved_bytes + pool.reserved_bytes
  return int(pool.memory_fraction * max(free_bytes - reserved, 0))


def pool_pages(pool: PoolConfig, cfg: ModelConfig, dtype, free_bytes: int | None, *,
               kv_shards: int = 1, data_shards: int = 1, reserved_bytes: int = 0,
               window: float = 1.0) -> int:
  """The page count, per data shard, of a pool: the one sizing rule the engine allocates
  by and the planner predicts with (jaxrl_post.plan), so the two agree.

  free_bytes: what the device has free before the pool (None: no memory stats).
  kv_shards: how many devices split the KV heads, so a device holds 1/kv_shards of a page.
  data_shards: how many data shards each hold that many pages. A backend without memory
    stats (the CPU) has one memory for all its devices, so its fallback budget is for the
    whole pool and is split between the shards.
  reserved_bytes: left free beside pool.reserved_bytes (see pool_budget).
  window: window pages per main page (window_share), whose bytes the budget pays too.
  """
  if pool.num_pages is not None:
    return pool.num_pages
  budget = pool_budget(pool, free_bytes, reserved_bytes)
  if budget is None:
    budget = pool.fallback_bytes // (data_shards * kv_shards)
  n = int(budget * kv_shards // pool_page_bytes(cfg, pool.page_size, dtype, window))
  if n < 2:
    raise UserError(f"pool config: a budget of {budget} bytes holds {n} KV pages of "
                    f"{pool.page_size} tokens; at least 2 are needed")
  return int(n)


def resolve_num_pages(pool: PoolConfig, cfg: ModelConfig, dtype, device=None,
                      kv_shards: int = 1, data_shards: int = 1, window: float = 1.0) -> int:
  """pool_pages on `device` (default: the first device), with its free memory now."""
  free = None
  if pool.num_pages is None and pool.memory_bytes is None:
    free = free_device_bytes(device or jax.devices()[0])
  return pool_pages(pool, cfg, dtype, free, kv_shards=kv_shards, data_shards=data_shards,
                    window=window)


class KVPool(NamedTuple):
  """The device pool of every layer's keys and values."""

  # KV head outermost, then layer: reshaped (for free) to [Hkv, L * num_pages, ...], every
  # layer's pages form one pool of the kernel's layout, and layer l's page p is page
  # l * num_pages + p, so the decode kernel reads the stacked pool without a per-layer copy.
  k: jax.Array  # [Hkv, L, num_pages, page_size, D] (split_kv: the global layers only)
  v: jax.Array  # [Hkv, L, num_pages, page_size, D]
  # split_kv models: the sliding layers' pool, [Hkv, Lw, window_pages, page_size, D],
  # addressed through WindowPages.map; None otherwise.
  wk: jax.Array | None = None
  wv: jax.Array | None = None

  @classmethod
  def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype,
            window_pages: int = 0) -> "KVPool":
    windowed = window_layers(cfg)
    shape = lambda n_layers, n_pages: (cfg.num_kv_heads, n_layers, n_pages, page_size,
                                       cfg.head_dim)
    full = shape(cfg.num_layers - windowed, num_pages)
    pool = cls(jnp.zeros(full, dtype), jnp.zeros(full, dtype))
    if not windowed:
      return pool
    window = shape(windowed, window_pages)
    return pool._replace(wk=jnp.zeros(window, dtype), wv=jnp.zeros(window, dtype))


def copy_pool_pages(pool: KVPool, src, dst, wsrc=None, wdst=None) -> KVPool:  # [C] int32
  """Copies pages src[i] -> dst[i] in every layer and head (padding pairs use 0 -> 0), and
  window pages wsrc[i] -> wdst[i] in a window pool."""
  out = KVPool(pool.k.at[:, :, dst].set(pool.k[:, :, src]),
               pool.v.at[:, :, dst].set(pool.v[:, :, src]))
  if pool.wk is None:
    return out
  return out._replace(wk=pool.wk.at[:, :, wdst].set(pool.wk[:, :, wsrc]),
                      wv=pool.wv.at[:, :, wdst].set(pool.wv[:, :, wsrc]))


class PageAllocator:
  """Free list, reference counts and outstanding reservations of a pool's pages."""

  def __init__(self, num_pages: int, window_pages: int = 0):
    self.num_pages = num_pages
    # split_kv models: the window pages behind these pages' ids.
    self.window = WindowPages(window_pages, num_pages) if window_pages else None
    self.refcount = np.zeros((num_pages,), np.int32)
    self.refcount[TRASH_PAGE] = 1  # Never free, never handed out.
    self._free = list(range(num_pages - 1, TRASH_PAGE, -1))  # Pops the lowest ids first.
    self.reserved = 0
    self.peak_in_use = 0

  @property
  def usable(self) -> int:
    """Pages a request can ever use (all but the write sink)."""
    return self.num_pages - 1

  @property
  def available(self) -> int:
    """Free pages not promised to any sequence."""
    return len(self._free) - self.reserved

  @property
  def in_use(self) -> int:
    return self.usable - len(self._free)

  def reserve(self, n: int) -> bool:
    """Promises n pages; False (and no change) when fewer are available."""
    if n > self.available:
      return False
    self.reserved += n
    return True

  def unreserve(self, n: int) -> None:
    assert 0 <= n <= self.reserved, (n, self.reserved)
    self.reserved -= n

  def take_reserved(self) -> int:
    """A fresh page, paid from an earlier reservation."""
    assert self.reserved > 0 and self._free, "page taken without a reservation"
    self.reserved -= 1
    page = self._free.pop()
    self.refcount[page] = 1
    self.peak_in_use = max(self.peak_in_use, self.in_use)
    return page

  def share(self, page: int, window: bool = True) -> None:
    """One more holder of `page`; with `window`, of its window page too (a holder whose
    window has passed the page shares only its main part)."""
    assert self.refcount[page] > 0 and page != TRASH_PAGE, page
    self.refcount[page] += 1
    if window and self.window is not None:
      self.window.share(page)

  def release(self, page: int, window: bool = True) -> None:
    assert self.refcount[page] > 0 and page != TRASH_PAGE, page
    self.refcount[page] -= 1
    if window and self.window is not None:
      self.window.drop(page)
    if self.refcount[page] == 0:
      assert self.window is None or self.window.map[page] == TRASH_PAGE, page
      self._free.append(page)


class WindowPages:
  """The window pool's pages of one data shard, behind the main pool's page ids.

  Main page p's sliding-layer K/V live in window page map[p] (TRASH_PAGE: none, or given
  back). refs[p] counts the holders of p that may still read that part: the sequences
  whose window has not passed p, and the prefix cache. When none is left the window page
  goes back while p itself may live on for the global layers.
  """

  def __init__(self, num_pages: int, main_pages: int):
    self.alloc = PageAllocator(num_pages)
    self.map = np.zeros((main_pages,), np.int32)
    self.refs = np.zeros((main_pages,), np.int32)
    self.dirty = True  # The devices have not seen `map` yet.

  def attach(self, page: int) -> None:
    """A fresh window page for a freshly taken main page, paid from a reservation."""
    assert self.refs[page] == 0, page
    self.map[page] = self.alloc.take_reserved()
    self.refs[page] = 1
    self.dirty = True

  def share(self, page: int) -> None:
    assert self.refs[page] > 0, f"page {page} has no window part left to share"
    self.refs[page] += 1

  def drop(self, page: int) -> bool:
    """One holder less; True when the window page went back to the pool."""
    assert self.refs[page] > 0, page
    self.refs[page] -= 1
    if self.refs[page]:
      return False
    self.alloc.release(int(self.map[page]))
    self.map[page] = TRASH_PAGE
    self.dirty = True
    return True


class PagedSequence:
  """One sequence's pages, in token order, and the pages it may still take.

  Attributes:
    pages: page ids; token t lives in pages[t // page_size].
    reserved: pages promised to this sequence and not yet taken.
    wreserved: with a window pool (split_kv), window pages promised: each page taken
      takes one, and a running sequence gives them back as its window passes, so it
      needs at most `span` at once (see window_span).
    passed: its leading pages whose window parts it no longer holds.
  """

  def __init__(self, alloc: PageAllocator, page_size: int, reserved: int = 0,
               wreserved: int = 0, span: int | None = None):
    self.alloc, self.page_size = alloc, page_size
    self.pages: list[int] = []
    self.reserved, self.wreserved, self.span = reserved, wreserved, span
    self.passed = 0

  def _take(self) -> int:
    page = self.alloc.take_reserved()
    self.reserved -= 1
    window = self.alloc.window
    if window is not None:
      if not self.wreserved:  # Past the span's bound (more calls in flight): ask the pool.
        if not window.alloc.reserve(1):
          raise RuntimeError("the window KV pool ran out of pages mid-decode")
        self.wreserved += 1
      window.attach(page)
      self.wreserved -= 1
    return page

  def grow(self, num_tokens: int) -> None:
    """Takes pages (from the reservation) until num_tokens tokens fit."""
    while len(self.pages) * self.page_size < num_tokens:
      assert self.reserved > 0, "sequence grew past its reservation"
      self.pages.append(self._take())

  def share_leading(self, pages: list[int]) -> None:
    """Takes these pages (holding the same leading tokens, e.g. from a prefix cache) in
    place of its first len(pages), which it gives back."""
    assert self.passed == 0
    for i, page in enumerate(pages):
      self.alloc.share(page)
      self.alloc.release(self.pages[i])
      self.pages[i] = page

  def window_share(self, reserved: int) -> int:
    """Window pages a sample with `reserved` main pages to take is promised."""
    return 0 if self.span is None else min(reserved, self.span)

  def fork(self, reserved: int) -> "PagedSequence":
    """A child sharing every page, with `reserved` pages moved from this reservation."""
    assert reserved <= self.reserved, (reserved, self.reserved)
    wreserved = self.window_share(reserved) if reserved < self.reserved else self.wreserved
    child = PagedSequence(self.alloc, self.page_size, reserved, wreserved, self.span)
    self.reserved -= reserved
    self.wreserved -= wreserved
    for i, page in enumerate(self.pages):
      if page != TRASH_PAGE:  # Given back behind a sliding window.
        self.alloc.share(page, window=i >= self.passed)
    child.pages, child.passed = list(self.pages), self.passed
    return child

  def make_tail_writable(self, num_tokens: int) -> tuple[int, int] | None:
    """Copy on write: before appending after token num_tokens - 1, a shared partial last
    page is replaced by a private page. Returns the (src, dst) device copy to do, if any
    (a window pool copies the window pages these pages map to)."""
    if num_tokens % self.page_size == 0 or not self.pages:
      return None
    last = self.pages[-1]
    if self.alloc.refcount[last] == 1:
      return None
    assert self.reserved > 0, "copy on write without a reservation"
    new = self._take()
    self.alloc.release(last, window=len(self.pages) - 1 >= self.passed)
    self.pages[-1] = new
    return last, new

  def drop_reservation(self, n: int) -> None:
    """Gives back n promised pages (all of them: the window pages promised too; else a
    sample's share, window_share(n))."""
    assert n <= self.reserved, (n, self.reserved)
    w = self.wreserved if n == self.reserved else min(self.window_share(n), self.wreserved)
    self.reserved -= n
    self.alloc.unreserve(n)
    self.wreserved -= w
    if w:
      self.alloc.window.alloc.unreserve(w)

  def release_before(self, first_token: int) -> int:
    """Gives back the pages wholly before token `first_token`, which no attention will read
    again (they fall behind every layer's sliding window); their places in `pages` become
    the sink page, so later tokens keep their page index. Returns how many were given."""
    given = 0
    for i in range(min(max(first_token, 0) // self.page_size, len(self.pages))):
      if self.pages[i] != TRASH_PAGE:
        self.alloc.release(self.pages[i])
        self.pages[i] = TRASH_PAGE
        given += 1
    return given

  def pass_window(self, first_token: int) -> None:
    """Window pool: drops the window parts of the pages wholly before `first_token`,
    which no sliding layer reads again (the pages stay for the global layers). Each window
    page that goes back is promised again while the sequence may still take pages, so its
    reservation stays within its span."""
    window, n = self.alloc.window, min(max(first_token, 0) // self.page_size, len(self.pages))
    for i in range(self.passed, n):
      if window.drop(self.pages[i]) and self.wreserved < self.reserved:
        promised = window.alloc.reserve(1)  # The page just freed.
        assert promised
        self.wreserved += 1
    self.passed = max(self.passed, n)

  def free(self) -> None:
    """Returns the pages (dropping this sequence's references) and the reservation."""
    for i, page in enumerate(self.pages):
      if page != TRASH_PAGE:
        self.alloc.release(page, window=i >= self.passed)
    self.pages = []
    self.passed = 0
    self.drop_reservation(self.reserved)

  def table_row(self, width: int) -> np.ndarray:  # -> [width] int32
    row = np.full((width,), TRASH_PAGE, np.int32)
    row[:len(self.pages)] = self.pages
    return row


def sequences_held(num_pages: int, seq_pages: int) -> int:
  """Sequences of seq_pages pages each that a pool of num_pages holds at once (page 0 is
  the write sink, never handed out)."""
  return (num_pages - 1) // seq_pages
