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
               kv_shards: int = 1, data_shards: int = 1, reserved_bytes: int = 0) -> int:
  """The page count, per data shard, of a pool: the one sizing rule the engine allocates
  by and the planner predicts with (jaxrl_post.plan), so the two agree.

  free_bytes: what the device has free before the pool (None: no memory stats).
  kv_shards: how many devices split the KV heads, so a device holds 1/kv_shards of a page.
  data_shards: how many data shards each hold that many pages. A backend without memory
    stats (the CPU) has one memory for all its devices, so its fallback budget is for the
    whole pool and is split between the shards.
  reserved_bytes: left free beside pool.reserved_bytes (see pool_budget).
  """
  if pool.num_pages is not None:
    return pool.num_pages
  budget = pool_budget(pool, free_bytes, reserved_bytes)
  if budget is None:
    budget = pool.fallback_bytes // (data_shards * kv_shards)
  n = budget * kv_shards // page_bytes(cfg, pool.page_size, dtype)
  if n < 2:
    raise UserError(f"pool config: a budget of {budget} bytes holds {n} KV pages of "
                    f"{pool.page_size} tokens; at least 2 are needed")
  return int(n)


def resolve_num_pages(pool: PoolConfig, cfg: ModelConfig, dtype, device=None,
                      kv_shards: int = 1, data_shards: int = 1) -> int:
  """pool_pages on `device` (default: the first device), with its free memory now."""
  free = None
  if pool.num_pages is None and pool.memory_bytes is None:
    free = free_device_bytes(device or jax.devices()[0])
  return pool_pages(pool, cfg, dtype, free, kv_shards=kv_shards, data_shards=data_shards)


class KVPool(NamedTuple):
  """The device pool of every layer's keys and values."""

  # KV head outermost, then layer: reshaped (for free) to [Hkv, L * num_pages, ...], every
  # layer's pages form one pool of the kernel's layout, and layer l's page p is page
  # l * num_pages + p, so the decode kernel reads the stacked pool without a per-layer copy.
  k: jax.Array  # [Hkv, L, num_pages, page_size, D]
  v: jax.Array  # [Hkv, L, num_pages, page_size, D]

  @classmethod
  def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> "KVPool":
    shape = (cfg.num_kv_heads, cfg.num_layers, num_pages, page_size, cfg.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def copy_pool_pages(pool: KVPool, src, dst) -> KVPool:  # src, dst [C] int32
  """Copies pages src[i] -> dst[i] in every layer and head (padding pairs use 0 -> 0)."""
  return KVPool(pool.k.at[:, :, dst].set(pool.k[:, :, src]),
                pool.v.at[:, :, dst].set(pool.v[:, :, src]))


copy_pages = jax.jit(copy_pool_pages, donate_argnums=0)


class PageAllocator:
  """Free list, reference counts and outstanding reservations of a pool's pages."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
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

  def share(self, page: int) -> None:
    assert self.refcount[page] > 0 and page != TRASH_PAGE, page
    self.refcount[page] += 1

  def release(self, page: int) -> None:
    assert self.refcount[page] > 0 and page != TRASH_PAGE, page
    self.refcount[page] -= 1
    if self.refcount[page] == 0:
      self._free.append(page)


class PagedSequence:
  """One sequence's pages, in token order, and the pages it may still take.

  Attributes:
    pages: page ids; token t lives in pages[t // page_size].
    reserved: pages promised to this sequence and not yet taken.
  """

  def __init__(self, alloc: PageAllocator, page_size: int, reserved: int = 0):
    self.alloc, self.page_size = alloc, page_size
    self.pages: list[int] = []
    self.reserved = reserved

  def grow(self, num_tokens: int) -> None:
    """Takes pages (from the reservation) until num_tokens tokens fit."""
    while len(self.pages) * self.page_size < num_tokens:
      assert self.reserved > 0, "sequence grew past its reservation"
      self.pages.append(self.alloc.take_reserved())
      self.reserved -= 1

  def share_leading(self, pages: list[int]) -> None:
    """Takes these pages (holding the same leading tokens, e.g. from a prefix cache) in
    place of its first len(pages), which it gives back."""
    for i, page in enumerate(pages):
      self.alloc.share(page)
      self.alloc.release(self.pages[i])
      self.pages[i] = page

  def fork(self, reserved: int) -> "PagedSequence":
    """A child sharing every page, with `reserved` pages moved from this reservation."""
    assert reserved <= self.reserved, (reserved, self.reserved)
    child = PagedSequence(self.alloc, self.page_size, reserved)
    self.reserved -= reserved
    for page in self.pages:
      if page != TRASH_PAGE:  # Given back behind a sliding window.
        self.alloc.share(page)
    child.pages = list(self.pages)
    return child

  def make_tail_writable(self, num_tokens: int) -> tuple[int, int] | None:
    """Copy on write: before appending after token num_tokens - 1, a shared partial last
    page is replaced by a private page. Returns the (src, dst) device copy to do, if any."""
    if num_tokens % self.page_size == 0 or not self.pages:
      return None
    last = self.pages[-1]
    if self.alloc.refcount[last] == 1:
      return None
    assert self.reserved > 0, "copy on write without a reservation"
    new = self.alloc.take_reserved()
    self.reserved -= 1
    self.alloc.release(last)
    self.pages[-1] = new
    return last, new

  def drop_reservation(self, n: int) -> None:
    assert n <= self.reserved, (n, self.reserved)
    self.reserved -= n
    self.alloc.unreserve(n)

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

  def free(self) -> None:
    """Returns the pages (dropping this sequence's references) and the reservation."""
    for page in self.pages:
      if page != TRASH_PAGE:
        self.alloc.release(page)
    self.pages = []
    self.drop_reservation(self.reserved)

  def table_row(self, width: int) -> np.ndarray:  # -> [width] int32
    row = np.full((width,), TRASH_PAGE, np.int32)
    row[:len(self.pages)] = self.pages
    return row


def sequences_held(num_pages: int, seq_pages: int) -> int:
  """Sequences of seq_pages pages each that a pool of num_pages holds at once (page 0 is
  the write sink, never handed out)."""
  return (num_pages - 1) // seq_pages
