"""Device memory per role, and the rates MFU and bandwidth utilisation are measured against.

Memory: jax's `Device.memory_stats()` reports `bytes_in_use` and the process's high-water
mark `peak_bytes_in_use` on GPUs and TPUs, and nothing on the CPU (then no memory metric is
written: none is made up). A role's peak is the most `bytes_in_use` a background thread read
while the role ran (every `poll_s`), raised to the new high-water mark when that rose during
the role.

Peaks: the device's dense peak FLOP/s and HBM bandwidth come from `peaks`; a device the
table does not list (the CPU above all) is measured instead: the best FLOP/s of a square
matmul in the compute dtype, and the best bytes/s of an elementwise pass over a large
array. Metrics computed against a measured rate say so in their names
(`..._vs_cpu_measured_matmul`).

jax is imported inside the functions that need it, so the package stays importable
without it.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable, Optional, Sequence

from jaxrl_post.telemetry import peaks


class MemorySampler:
  """Reads device memory on a thread while a step runs; per-role peaks afterwards."""

  def __init__(self, devices: Sequence, poll_s: float = 0.005,
               clock: Callable[[], float] = time.perf_counter, stats=None):
    """Args:
      devices: this process's devices (memory_stats works for local devices only).
      poll_s: seconds between reads while a step runs; 0 reads at step ends only.
      clock: the StepTimer's clock, so samples line up with its spans.
      stats: device -> memory_stats dict or None (tests pass a fake).
    """
    self.devices, self.poll_s, self._clock = list(devices), poll_s, clock
    self._stats = stats or (lambda d: d.memory_stats())
    self.available = bool(self.devices) and self._read() is not None
    self._samples: list[tuple[float, int, int]] = []
    self._limit = 0
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None

  def _read(self) -> Optional[tuple[int, int, int]]:
    """(bytes in use, high-water mark, limit): the most loaded device's."""
    rows = []
    for d in self.devices:
      try:
        s = self._stats(d)
      except Exception:  # A backend without the call.
        return None
      if not s or "bytes_in_use" not in s:
        return None
      rows.append((int(s["bytes_in_use"]), int(s.get("peak_bytes_in_use", s["bytes_in_use"])),
                   int(s.get("bytes_limit", 0))))
    return max(r[0] for r in rows), max(r[1] for r in rows), max(r[2] for r in rows)

  def _sample(self) -> None:
    read = self._read()
    if read is not None:
      self._samples.append((self._clock(), read[0], read[1]))
      self._limit = read[2]

  def start(self) -> None:
    """Begins a step's sampling."""
    if not self.available:
      return
    self._samples = []
    self._sample()
    if self.poll_s > 0:
      self._stop.clear()
      self._thread = threading.Thread(target=self._poll, name="memory-sampler", daemon=True)
      self._thread.start()

  def _poll(self) -> None:
    while not self._stop.wait(self.poll_s):
      self._sample()

  def stop(self, spans: Iterable[tuple[str, float, float]]) -> dict[str, float]:
    """Ends the step's sampling; `memory/<role>/peak_bytes` per role of `spans`, and the
    high-water mark and limit of the most loaded device ({} where memory is not reported)."""
    if not self.available:
      return {}
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
    self._sample()
    samples = self._samples
    out: dict[str, float] = {}
    for role, begin, end in spans:
      inside = [s for s in samples if begin <= s[0] <= end]
      before = [s[2] for s in samples if s[0] < begin]
      peak = max((s[1] for s in inside), default=0)
      # The high-water mark rose during the role: read inside it, else across it.
      marks = [s[2] for s in inside] or [s[2] for s in samples if s[0] > end][:1]
      if before and marks and max(marks) > before[-1]:
        peak = max(peak, max(marks))
      if inside or peak:
        key = f"memory/{role}/peak_bytes"
        out[key] = float(max(out.get(key, 0.0), peak))
    out["memory/peak_bytes_in_use"] = float(samples[-1][2])
    if self._limit:
      out["memory/bytes_limit"] = float(self._limit)
    return out


def measured_matmul_flops_per_s(dtype: str = "float32", size: int = 1024,
                                repeats: int = 5) -> float:
  """The best FLOP/s of a [size, size] x [size, size] matmul on the default device."""
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.dtype(dtype))
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  best = min(_timed(lambda: jax.block_until_ready(f(a, b))) for _ in range(repeats))
  return 2.0 * size ** 3 / best


def measured_copy_bytes_per_s(megabytes: int = 64, repeats: int = 5) -> float:
  """The best bytes/s (read + write) of an elementwise pass over a large float32 array."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((megabytes * (1 << 20) // 4,), jnp.float32)
  f = jax.jit(lambda x: x * 1.5)
  jax.block_until_ready(f(x))
  best = min(_timed(lambda: jax.block_until_ready(f(x))) for _ in range(repeats))
  return 2.0 * x.nbytes / best


def _timed(fn) -> float:
  begin = time.perf_counter()
  fn()
  return time.perf_counter() - begin


class DeviceRates:
  """The FLOP/s and bytes/s that utilisations are fractions of, and what they are."""

  def __init__(self, device_kind: str, platform: str, compute_dtype: str,
               measure_matmul: Callable[[str], float] = measured_matmul_flops_per_s,
               measure_copy: Callable[[], float] = measured_copy_bytes_per_s):
    table = peaks.lookup(peaks.BF16_FLOPS_PER_S, device_kind)
    # The table's figures are bf16: a float32 model on a GPU/TPU is measured, not flattered.
    self.flops_per_s = table if compute_dtype == "bfloat16" else None
    self.flops_label = "peak"
    if self.flops_per_s is None:
      self.flops_per_s = measure_matmul(compute_dtype)
      self.flops_label = f"{_host(platform)}_measured_matmul"
    self.bytes_per_s = peaks.lookup(peaks.HBM_BYTES_PER_S, device_kind)
    self.bytes_label = "peak"
    if self.bytes_per_s is None:
      self.bytes_per_s = measure_copy()
      self.bytes_label = f"{_host(platform)}_measured_copy"

  def metric(self, base: str, label: str) -> str:
    """`base` against a table peak; `base_vs_<label>` against a measured rate."""
    return base if label == "peak" else f"{base}_vs_{label}"


def _host(platform: str) -> str:
  return "cpu" if platform == "cpu" else platform
