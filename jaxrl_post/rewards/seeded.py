"""Deterministic draws and lazily generated splits for the synthetic tasks.

Generated problems are a pure function of (seed, split, index), so a 100k-problem train
split costs nothing until an index is read, and two processes with the same seed agree.
Draws come from a hash rather than `random` or NumPy generators because neither promises
the same stream across versions, and a task's eval set should not change under an upgrade.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Callable, Hashable, Iterator, TypeVar

from jaxrl_post.errors import UserError
from jaxrl_post.rewards.base import Problem, check_split

T = TypeVar("T")

# How many redraws a train item may need before the problem space is declared exhausted.
# Configs keep eval to at most half the space, so a redraw succeeds with p >= 1/2 and this
# bound is only reached by a bug or a degenerate distribution.
MAX_REDRAWS = 1000


class Stream:
  """Uniform integers derived from a key by hashing a counter (blake2b)."""

  def __init__(self, *key: object):
    self._prefix = hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
    self._count = 0

  def below(self, n: int) -> int:
    """Uniform in [0, n); 128-bit hashes keep the modulo bias below n / 2**128."""
    data = self._prefix + self._count.to_bytes(8, "little")
    self._count += 1
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little") % n

  def integer(self, low: int, high: int) -> int:
    """Uniform in [low, high], both ends included."""
    return low + self.below(high - low + 1)

  def choice(self, items: Sequence[T]) -> T:
    return items[self.below(len(items))]

  def shuffle(self, items: list) -> None:
    """Fisher-Yates in place."""
    for i in range(len(items) - 1, 0, -1):
      j = self.below(i + 1)
      items[i], items[j] = items[j], items[i]


def draw_distinct(owner: str, draw: Callable[[Stream], T], key: Callable[[T], Hashable],
                  count: int, stream: Stream) -> tuple[T, ...]:
  """`count` draws with pairwise distinct keys (the eval set), in draw order.

  Raises:
    UserError: when distinct draws run out, i.e. the problem space is too small.
  """
  items: list[T] = []
  seen: set[Hashable] = set()
  budget = 20 * count + MAX_REDRAWS
  while len(items) < count and budget > 0:
    budget -= 1
    item = draw(stream)
    if key(item) not in seen:
      seen.add(key(item))
      items.append(item)
  if len(items) < count:
    raise UserError(f"{owner}: found only {len(items)} distinct problems for "
                    f"num_eval={count}; widen the number ranges or lower num_eval")
  return tuple(items)


def draw_avoiding(owner: str, draw: Callable[[Stream], T], key: Callable[[T], Hashable],
                  taken: set[Hashable] | frozenset[Hashable], stream: Stream) -> T:
  """The first draw whose key is not in `taken` (a train item avoiding the eval set)."""
  for _ in range(MAX_REDRAWS):
    item = draw(stream)
    if key(item) not in taken:
      return item
  raise UserError(f"{owner}: could not draw a train problem outside the eval set in "
                  f"{MAX_REDRAWS} tries; widen the number ranges or lower num_eval")


class LazySplit(Sequence):
  """A read-only sequence whose items are built on access by `get(index)`."""

  def __init__(self, length: int, get: Callable[[int], T]):
    self._length = length
    self._get = get

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return [self._get(i) for i in range(*index.indices(self._length))]
    index = int(index)  # NumPy integers from a sampler.
    if index < 0:
      index += self._length
    if not 0 <= index < self._length:
      raise IndexError(f"index {index} out of range for a split of {self._length}")
    return self._get(index)

  def __iter__(self) -> Iterator[T]:
    return (self._get(i) for i in range(self._length))


class GeneratedSplits:
  """The train and eval items of a generated task, with eval never leaking into train.

  Eval is `num_eval` draws with pairwise distinct keys, made eagerly (it is small, and a
  problem space too small for it then fails when the task is built). Train item i comes
  from its own stream, redrawn while its key is an eval key, so it costs nothing until read.

  Args:
    owner: the task's class name, for errors.
    task: the task's name, part of every stream's key.
    seed: the task's seed.
    draw: one random item from a stream.
    key: what makes two items the same problem.
    num_train: length of the train split.
    num_eval: length of the eval split.
  """

  def __init__(self, owner: str, task: str, seed: int, draw: Callable[[Stream], T],
               key: Callable[[T], Hashable], num_train: int, num_eval: int):
    self._owner, self._task, self._seed = owner, task, seed
    self._draw, self._key = draw, key
    self._lengths = {"train": num_train, "eval": num_eval}
    self.eval = draw_distinct(owner, draw, key, num_eval, Stream(seed, task, "eval"))
    self._eval_keys = frozenset(map(key, self.eval))

  def item(self, split: str, index: int) -> T:
    if split == "eval":
      return self.eval[index]
    stream = Stream(self._seed, self._task, "train", index)
    return draw_avoiding(self._owner, self._draw, self._key, self._eval_keys, stream)

  def split(self, name: str, make: Callable[[str, int, T], Problem]) -> LazySplit:
    """The named split, its items turned into Problems by `make(split, index, item)`."""
    check_split(self._owner, name)
    return LazySplit(self._lengths[name], lambda i: make(name, i, self.item(name, i)))
