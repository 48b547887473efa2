"""Test set-up: 8 fake CPU devices, set once before jax is imported anywhere."""

import os

from tests.xla import host_flags  # Imports no jax.

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + host_flags(8)).strip()
# Many tests (and the training runs they start as subprocesses, which inherit this) compile
# the same programs: a persistent compilation cache compiles each once per machine. Keys
# cover the program, devices, flags and jax version, so a stale entry is never used.
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

# The test processes themselves neither read nor write the cache (the runs they start do):
# in these long-lived processes, which also load libtpu and compile hundreds of programs,
# XLA:CPU's executable serialisation crashed about once per suite run (a segfault in
# put/get_executable_and_time), never in a command's own process.
jax.config.update("jax_enable_compilation_cache", False)


@pytest.fixture(autouse=True)
def _commands_run_here_compile_without_the_cache(request, monkeypatch):
  """A command's main() called in this process (train.main, evaluate.main, ...) keeps the
  cache off too; tests marked `compilation_cache` exercise the cache itself."""
  if request.node.get_closest_marker("compilation_cache") is None:
    from jaxrl_post import compile_cache

    real = compile_cache.enable
    monkeypatch.setattr(compile_cache, "enable", lambda flag=None: real("off"))


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
