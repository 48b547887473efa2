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

# Mappings past which a worker releases its compiled programs after a file: a third of the
# default limit, so that no file's compiles (about 10,000 mappings at most) reach it.
RELEASE_ABOVE = 22_000

# The budget of one test file's tests together, in seconds (setup, call and teardown, as
# measured in the default run on the 2-core host). A file past it is split, shares its runs
# through fixtures, or marks its long tests `slow(reason=...)`, which exempts them.
FILE_BUDGET_S = 90.0


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


def files_over_budget(durations: dict[str, float], budget: float = FILE_BUDGET_S
                      ) -> list[tuple[str, float]]:
  """(file, seconds) for each file whose unexempt tests together took longer than budget,
  slowest first."""
  over = [(path, s) for path, s in durations.items() if s > budget]
  return sorted(over, key=lambda p: -p[1])
