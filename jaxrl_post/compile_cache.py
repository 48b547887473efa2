"""The persistent XLA compilation cache every command turns on before it compiles anything.

A run compiles the same programs each time it starts (a resume, a second seed, an
evaluation of the same config): jax's persistent cache stores each compiled executable on
disk under a key of the program, devices, compiler flags and jax version, so a later
process loads it instead of compiling. Processes on one machine, and hosts on a shared
filesystem, may use one directory: a key covers everything the executable depends on.

Where the cache lives, first match wins:
  1. the command's flag  `--compilation_cache=PATH|off`
  2. the environment     `JAXRL_COMPILATION_CACHE=PATH|off` ("0" or empty also mean off)
  3. jax's own           `JAX_COMPILATION_CACHE_DIR=PATH`, for whoever already set it
  4. the default         `$XDG_CACHE_HOME/jaxrl_post/xla` (`~/.cache/jaxrl_post/xla`)

Every program is stored, however small or quick to compile, so that a second run of the
same config compiles nothing; jax's own `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` and
`JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES`, when set, are kept instead. The directory is
bounded (DEFAULT_MAX_BYTES, least recently used entries go first; jax's own
`JAX_COMPILATION_CACHE_MAX_SIZE`, when set, wins). The bound is also what makes the cache
safe to share: only with one does jax take the directory's file lock around each read and
write. Unbounded, an entry is written in place with no lock, so another process (or a
second thread, as in the asynchronous driver) may read it half-written and hand XLA a
truncated executable to deserialise. Deleting the directory is always safe.

CPU programs over several devices are neither stored nor loaded (`keep_collectives_ordered`),
and a store scans the directory for entries to evict only once it is full
(`evict_only_when_full`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

ENV = "JAXRL_COMPILATION_CACHE"
_OFF = ("off", "0", "")
# jax reads these environment variables itself; set, they are the user's choice to keep.
_JAX_DIR = "JAX_COMPILATION_CACHE_DIR"
_JAX_MAX = "JAX_COMPILATION_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 8 << 30
_JAX_THRESHOLDS = {
    "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_persistent_cache_min_entry_size_bytes": "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
}


def default_dir() -> str:
  """The per-user cache directory: $XDG_CACHE_HOME/jaxrl_post/xla, else ~/.cache/..."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxrl_post", "xla")


def resolve(flag: Optional[str] = None) -> Optional[str]:
  """The cache directory a command uses given its flag's value (None: not given), or None
  when the cache is turned off."""
  for setting in (flag, os.environ.get(ENV)):
    if setting is not None:
      return None if setting.strip().lower() in _OFF else os.path.expanduser(setting)
  return os.environ.get(_JAX_DIR) or default_dir()


def add_cache_flag(parser: argparse.ArgumentParser) -> None:
  """Adds `--compilation_cache=PATH|off` to a command; pass its value to `enable`."""
  parser.add_argument(
      "--compilation_cache", default=None, metavar="PATH|off",
      help=f"persistent XLA compilation cache directory, or off (default: ${ENV}, "
           f"else {default_dir()})")


def enable(flag: Optional[str] = None) -> Optional[str]:
  """Turns jax's persistent compilation cache on (or off) for this process; returns the
  directory in use, or None. `flag` is the `--compilation_cache` value (None: not given).
  Call it before the first compilation; calling it again re-points the cache."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  path = resolve(flag)
  if path is not None and not _usable(path):
    path = None
  if path is not None:
    keep_collectives_ordered()
    evict_only_when_full()
  jax.config.update("jax_enable_compilation_cache", path is not None)
  if path is not None:
    jax.config.update("jax_compilation_cache_dir", path)
    for option, env in _JAX_THRESHOLDS.items():
      if env not in os.environ:
        jax.config.update(option, 0)
    if _JAX_MAX not in os.environ:
      jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
  compilation_cache.reset_cache()  # The cache decides once whether it is in use.
  return path


def keep_collectives_ordered() -> None:
  """Keeps XLA:CPU programs over several devices out of the cache, both ways. When XLA:CPU
  (jaxlib 0.11) compiles a program, its collectives share one resource that orders them,
  those inside loops and branches included; when it deserialises one, each thunk sequence
  (the entry, each loop body, each branch) gets a resource of its own, so a loop holding
  collectives is no longer ordered against the collectives beside it. Loaded from the
  cache, a program with such independent collectives (the MoE train step on 8 CPU
  devices: a layer scan of collectives and collectives around it) can start them in
  different orders on different devices, whose threads then wait in both until the pool
  has none left to join either, and XLA aborts the process after its rendezvous timeout;
  whether it does is a matter of timing. One device has no rendezvous; GPU and TPU
  executables keep their order.
  jax has no per-program switch for its cache: this wraps its read and write (jax is
  pinned, and tests/test_compile_cache.py fails if they move)."""
  from jax._src import compilation_cache as cache

  if getattr(cache.get_executable_and_time, "_keeps_order", False):
    return
  get, put = cache.get_executable_and_time, cache.put_executable_and_time

  def get_ordered(cache_key, compile_options, backend, executable_devices, *args, **kwargs):
    if backend.platform == "cpu" and len(executable_devices) > 1:
      return None, None
    return get(cache_key, compile_options, backend, executable_devices, *args, **kwargs)

  def put_ordered(cache_key, module_name, executable, backend, *args, **kwargs):
    if backend.platform == "cpu":
      # An executable compiled without loading has no devices to count: not stored.
      local = getattr(executable, "local_devices", None)
      if local is None or len(local()) > 1:
        return None
    return put(cache_key, module_name, executable, backend, *args, **kwargs)

  get_ordered._keeps_order = True
  cache.get_executable_and_time, cache.put_executable_and_time = get_ordered, put_ordered


def evict_only_when_full() -> None:
  """Makes a store into the bounded cache look for entries to evict only when the directory
  is full. jax's eviction pass reads every entry's size and access-time file on every
  store, holding the directory's lock: O(entries) file reads per program stored, which
  with a few thousand entries (the test suite's, or a long-lived service's) keeps every
  other process waiting on the lock. Summing the entries' sizes from one directory listing
  costs a small part of that, and the full pass (least recently used first) still runs
  whenever the new entry would take the directory past its bound. Remote directories keep
  jax's pass. jax is pinned, and tests/test_compile_cache.py fails if it moves."""
  from jax._src import lru_cache

  cls = lru_cache.LRUCache
  full_pass = cls._evict_if_needed
  if getattr(full_pass, "_when_full", False):
    return
  suffix = lru_cache._CACHE_SUFFIX

  def evict_if_needed(self, *, additional_size: int = 0) -> None:
    if self.eviction_enabled and self._is_local:
      with os.scandir(str(self.path)) as entries:
        size = sum(e.stat().st_size for e in entries if e.name.endswith(suffix))
      if size + additional_size <= self.max_size:
        return
    full_pass(self, additional_size=additional_size)

  evict_if_needed._when_full = True
  cls._evict_if_needed = evict_if_needed


def _usable(path: str) -> bool:
  """Whether the directory exists or can be made, and is writable; if not, says so in one
  line and the command goes on compiling without a cache (it is only a speed-up)."""
  if "://" in path:  # A remote store (gs://...): jax opens it itself.
    return True
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    reason = e.strerror or str(e)
  else:
    if os.access(path, os.W_OK | os.X_OK):
      return True
    reason = "not writable"
  print(f"warning: compilation cache {path}: {reason}; compiling without a cache "
        f"(--compilation_cache=off or {ENV}=off silences this)", file=sys.stderr)
  return False
