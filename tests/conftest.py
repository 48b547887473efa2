"""Test set-up: 8 fake CPU devices, set once before jax is imported anywhere."""

import os

from tests.xla import host_flags  # Imports no jax.

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + host_flags(8)).strip()
# Many tests (and the training runs they start as subprocesses, which inherit this) compile
# the same programs: a persistent compilation cache compiles each once per machine. Keys
# cover the program, devices, flags and jax version, so a stale entry is never used.
# Programs compiled in under 0.2 s are not stored: storing every one, as the commands do,
# starts a short warm run 1.5 s sooner (10.5 -> 9.0 s) but made the suite 2.9 min slower
# (1,349 -> 1,520 s on a fresh clone; 5,000 entries written and loaded under one lock).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# Bounded, so jax locks the directory around each entry's read and write: the test
# processes and the runs they start share it, and an unlocked entry read half-written
# crashes the reader (see jaxrl_post/compile_cache.py).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
# libtpu (the `tpu` extra) compiles for abstract TPU slices on this CPU host: let the
# test processes load it side by side, without looking for TPU hardware or metadata.
from jaxrl_post.plan.targets import compile_only_tpu_env  # noqa: E402  (read when jax starts)

compile_only_tpu_env()

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

from jaxrl_post import compile_cache  # noqa: E402

compile_cache.keep_collectives_ordered()  # These processes cache their own programs too.
compile_cache.evict_only_when_full()

from tests import suite_health  # noqa: E402

# The test processes read and write the cache too: a test's in-process run and the runs it
# starts as subprocesses (a straight run against a killed and resumed one) compile the same
# programs. (Their long life once crashed XLA:CPU while it serialised an executable: the
# process had run out of memory mappings, see tests/suite_health.py.)


_CACHE_OPTIONS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
                  "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(autouse=True)
def _cache_settings_restored_after_each_test():
  """A command run in this process (train.main with --compilation_cache=off, ...) sets the
  cache for the whole process: the next test gets the suite's settings back."""
  saved = {name: getattr(jax.config, name) for name in _CACHE_OPTIONS}
  yield
  if any(getattr(jax.config, name) != value for name, value in saved.items()):
    from jax.experimental.compilation_cache import compilation_cache

    for name, value in saved.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_after_each_file():
  """A worker keeps each executable jax caches, three memory mappings per kernel; past the
  kernel's limit on mappings (vm.max_map_count) XLA:CPU crashes while compiling. Releasing
  them after a file once they pass a third of that keeps a worker far below it (one file
  adds at most about 10,000), and later files still reuse what earlier ones compiled."""
  yield
  if suite_health.mapped_regions() > suite_health.RELEASE_ABOVE:
    suite_health.release_compiled_programs()


def pytest_collection_modifyitems(config, items):
  for item in items:  # Reaches the reports the controller of several workers reads.
    item.user_properties.append(("slow_reason", suite_health.slow_reason(item)))
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


_FILE_SECONDS: dict[str, float] = {}


def _budgeted(config) -> bool:
  """The default run (sweeps left out), in the process that sees every test's report."""
  return not hasattr(config, "workerinput") and "not sweep" in (config.option.markexpr or "")


_FILE_TOTALS: dict[str, float] = {}  # Slow tests included: where the suite's time goes.


def pytest_runtest_logreport(report):
  path = report.nodeid.split("::")[0]
  _FILE_TOTALS[path] = _FILE_TOTALS.get(path, 0.0) + report.duration
  if not dict(report.user_properties).get("slow_reason"):
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


_BUDGET: list[float] = []  # This host's file budget, timed once a file passes the nominal one.


def _over_budget(config) -> list[tuple[str, float]]:
  if not _budgeted(config) or not suite_health.files_over_budget(_FILE_SECONDS):
    return []
  if not _BUDGET:  # Timed after the tests, on a host they no longer load.
    _BUDGET.append(suite_health.host_budget(suite_health.host_seconds()))
  return suite_health.files_over_budget(_FILE_SECONDS, _BUDGET[0])


def pytest_sessionfinish(session, exitstatus):
  """A test file whose tests together take longer than this host's budget fails the run."""
  if exitstatus == 0 and _over_budget(session.config):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  if not hasattr(config, "workerinput") and len(_FILE_TOTALS) > 1:
    terminalreporter.section("the slowest test files (seconds of their tests together)")
    for path, seconds in sorted(_FILE_TOTALS.items(), key=lambda p: -p[1])[:15]:
      terminalreporter.line(f"{seconds:7.1f}  {path}")
  over = _over_budget(config)
  if _BUDGET:
    terminalreporter.line(f"test: this host's file budget {_BUDGET[0]:.0f} s "
                          f"({suite_health.FILE_BUDGET_S:.0f} s on the reference host)")
  if over:
    terminalreporter.section("test files over their time budget", red=True)
    for path, seconds in over:
      terminalreporter.line(f"{path}: {seconds:.0f} s of {_BUDGET[0]:.0f} s; "
                            "share its runs through fixtures, or mark its long tests "
                            "slow(reason=...)")
