"""The suite's own upkeep: compiled programs released, files held to a time budget."""

import jax
import jax.numpy as jnp
import pytest

from tests import suite_health


@jax.jit
def _cached(x):  # Module-level: jax caches one executable per shape, as library code does.
  return jnp.tanh(x) * 2 + jnp.sum(x)


def test_released_programs_give_back_their_memory_mappings():
  if not suite_health.mapped_regions():
    pytest.skip("no /proc on this system")
  before = suite_health.mapped_regions()
  for n in range(1, 41):
    _cached(jnp.ones(n)).block_until_ready()
  grown = suite_health.mapped_regions() - before
  assert grown >= 40 * 3, grown  # At least code, rodata and data per program.
  suite_health.release_compiled_programs()
  assert suite_health.mapped_regions() - before < grown / 4


class _Item:
  def __init__(self, *marks):
    self.marks = marks

  def get_closest_marker(self, name):
    return next((m for m in self.marks if m.name == name), None)


def test_only_a_slow_mark_with_a_reason_exempts_a_test_from_its_files_budget():
  assert suite_health.slow_reason(_Item()) is None
  assert suite_health.slow_reason(_Item(pytest.mark.slow.mark)) is None
  assert suite_health.slow_reason(_Item(pytest.mark.slow(reason="two processes").mark)) \
      == "two processes"


def test_files_over_budget_are_named_slowest_first():
  seconds = {"tests/a.py": 30.0, "tests/b.py": 91.0, "tests/c.py": 200.0}
  assert suite_health.files_over_budget(seconds, budget=90) == [
      ("tests/c.py", 200.0), ("tests/b.py", 91.0)]
  assert suite_health.files_over_budget({"tests/a.py": 90.0}, budget=90) == []


def test_a_slower_host_gets_a_budget_as_much_larger_and_a_faster_one_no_smaller():
  ref = suite_health.REFERENCE_HOST_S
  assert suite_health.host_budget(ref / 2) == suite_health.FILE_BUDGET_S
  assert suite_health.host_budget(ref * 2.5) == pytest.approx(2.5 * suite_health.FILE_BUDGET_S)


def test_the_host_is_timed_on_a_real_compile_not_a_cached_one():
  was = jax.config.jax_enable_compilation_cache
  first, again = suite_health.host_seconds(repeats=1), suite_health.host_seconds(repeats=1)
  assert jax.config.jax_enable_compilation_cache == was
  assert min(first, again) > 0.02  # A program loaded from the cache takes a few ms.
