"""What keeps a long test worker alive and the suite fast; imports no jax at module level.

A test worker compiles thousands of XLA:CPU programs. Each compiled kernel is loaded as its
own small object file: three memory mappings (code, read-only data, data) per kernel, held
as long as the executable lives, and jax keeps every executable of a module-level jitted
function in its caches. Linux refuses a process more than vm.max_map_count mappings (65,530
by default); past that LLVM's loader fails with "Cannot allocate memory" and XLA crashes in
backend_compile_and_load (or in executable serialisation, which loads the program too). One
worker through tests/rollout alone reached 53,562 mappings; tests/conftest.py releases them.
"""

import gc
import os
import time

# Mappings past which a worker releases its compiled programs after a file: a third of the
# default limit, so that no file's compiles (about 10,000 mappings at most) reach it.
RELEASE_ABOVE = 22_000

# The budget of one test file's tests together, in seconds (setup, call and teardown, as
# measured in the default run on the 2-core host). A file past it is split, shares its runs
# through fixtures, or marks its long tests `slow(reason=...)`, which exempts them.
FILE_BUDGET_S = 90.0

# The same budget on a slower host: hosts of one kind differ by up to 2.7x on the same code
# (the suite of e76dd76 took 2,810 s of wall time where 7ed7276's, six tests fewer, took
# 1,020 s), so a fixed number of seconds fails a slow host's run for the host, not the
# tests. A run that finds a file over the budget first times a fixed XLA:CPU compile
# (host_seconds, about what the suite's end-to-end runs spend their time on) and scales the
# budget by how much slower than REFERENCE_HOST_S it is, never below FILE_BUDGET_S.
# REFERENCE_HOST_S: 0.25-0.46 s measured on the slow host above with the suite's flags
# (best of 3, seven runs, quiet and at a suite's end), its low end divided by the 2.7x the
# suite ran slower there than on the host the budget was set on: a budget that errs long,
# since the check is for a file that grows, not for the host.
REFERENCE_HOST_S = 0.09


def mapped_regions() -> int:
  """This process's memory mappings (0 where /proc is not there)."""
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def release_compiled_programs() -> None:
  """Drops jax's caches of compiled programs, so the executables no test holds any more are
  freed and their mappings returned."""
  import jax

  jax.clear_caches()
  gc.collect()


def slow_reason(item) -> str | None:
  """The reason a test gives for being slow: `@pytest.mark.slow(reason=...)`."""
  mark = item.get_closest_marker("slow")
  return None if mark is None else mark.kwargs.get("reason")


def host_seconds(repeats: int = 3, layers: int = 32) -> float:
  """The best of `repeats` compiles of one small fixed program (an unrolled attention-like
  loss of `layers` layers and its gradient) on XLA:CPU with this process's flags, the
  compilation cache off: this host's speed at the work the suite spends most of its time
  on. Each repeat traces anew (a lowering keeps its executable); about 4 s in all."""
  import jax
  import jax.numpy as jnp

  def layer(x, w):
    h = jnp.tanh(x @ w[0]) @ w[1]
    a = jax.nn.softmax(h @ h.T / 8.0, axis=-1) @ h
    return x + a * jax.lax.rsqrt(jnp.mean(a * a, axis=-1, keepdims=True) + 1e-6)

  def loss(weights, x):
    for w in weights:
      x = layer(x, w)
    return jnp.mean(x * x)

  weights = [(jnp.full((64, 128), 0.01), jnp.full((128, 64), 0.01)) for _ in range(layers)]
  cached = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # A stored program compiles nothing.
  try:
    best = float("inf")
    for i in range(repeats):
      lowered = jax.jit(jax.value_and_grad(loss)).lower(weights, jnp.full((32, 64), 1.0 + i))
      start = time.perf_counter()
      lowered.compile()
      best = min(best, time.perf_counter() - start)
  finally:
    jax.config.update("jax_enable_compilation_cache", cached)
  return best


def host_budget(seconds: float) -> float:
  """The file budget on a host whose host_seconds() took `seconds`."""
  return FILE_BUDGET_S * max(1.0, seconds / REFERENCE_HOST_S)


def files_over_budget(durations: dict[str, float], budget: float = FILE_BUDGET_S
                      ) -> list[tuple[str, float]]:
  """(file, seconds) for each file whose unexempt tests together took longer than budget,
  slowest first."""
  over = [(path, s) for path, s in durations.items() if s > budget]
  return sorted(over, key=lambda p: -p[1])
