"""The persistent compilation cache: where it lives, and that a second run compiles nothing."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post import compile_cache
from jaxrl_post.pipeline.compiles import CompileCounter
from jaxrl_post.telemetry import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..")
_JAX_ENV = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


@pytest.fixture
def clean_env(monkeypatch):
  """No cache settings from the surroundings (the test suite sets jax's own)."""
  for name in (compile_cache.ENV, "XDG_CACHE_HOME") + _JAX_ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_flag_wins_over_environment_which_wins_over_the_default(clean_env, tmp_path):
  clean_env.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.resolve() == str(tmp_path / "home" / ".cache" / "jaxrl_post" / "xla")
  clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.resolve() == str(tmp_path / "xdg" / "jaxrl_post" / "xla")
  clean_env.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
  assert compile_cache.resolve() == str(tmp_path / "jax")
  clean_env.setenv(compile_cache.ENV, str(tmp_path / "env"))
  assert compile_cache.resolve() == str(tmp_path / "env")
  assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert compile_cache.resolve("off") is None
  for off in ("off", "OFF", "0", ""):
    clean_env.setenv(compile_cache.ENV, off)
    assert compile_cache.resolve() is None
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")


def test_enable_points_jax_at_the_directory_and_off_turns_it_off(
    clean_env, tmp_path):
  path = str(tmp_path / "made" / "here")
  assert compile_cache.enable(path) == path and os.path.isdir(path)
  assert jax.config.jax_enable_compilation_cache
  assert jax.config.jax_compilation_cache_dir == path
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  assert compile_cache.enable("off") is None
  assert not jax.config.jax_enable_compilation_cache


def test_jax_thresholds_set_by_the_user_are_kept(clean_env, tmp_path):
  clean_env.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  compile_cache.enable(str(tmp_path))
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.5


def test_an_unwritable_directory_warns_and_compiles_without_a_cache(
    clean_env, tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  assert compile_cache.enable(str(blocker / "xla")) is None
  err = capsys.readouterr().err
  assert err.startswith(f"warning: compilation cache {blocker / 'xla'}: ") and err.count("\n") == 1
  assert not jax.config.jax_enable_compilation_cache


def test_cpu_programs_over_several_devices_are_neither_stored_nor_loaded(clean_env, tmp_path):
  """XLA:CPU deserialises each collective with an ordering resource of its own: loaded from
  the cache on 8 CPU devices, the MoE quickstart's train step started its collectives in
  different orders on different devices and deadlocked. One-device programs are cached."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  compile_cache.enable(str(tmp_path))
  mesh = jax.make_mesh((8,), ("x",))
  x = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P("x")))
  sharded = jax.jit(lambda v: jnp.sum(v * 2.0) + jnp.max(v))  # Two collectives.
  single = jax.jit(lambda v: jnp.cumsum(v * 5.0))
  for _ in range(2):  # The second time from disk, as a new process would.
    with CompileCounter() as counts:
      assert float(sharded(x)) == 255.0
      single(np.arange(4, dtype=np.float32)).block_until_ready()
    jax.clear_caches()
  assert (counts.total, counts.cache_hits) == (1, 1)  # The 8-device program compiled again.
  assert len([f for f in os.listdir(tmp_path) if f.endswith("-cache")]) == 1


def test_a_store_evicts_only_when_full_and_then_the_least_recently_used(tmp_path, monkeypatch):
  """jax's eviction pass (every entry onto a heap by access time) runs only for a store
  that would take the directory past its bound, and then evicts as jax does."""
  from jax._src import lru_cache

  compile_cache.evict_only_when_full()
  cache = lru_cache.LRUCache(str(tmp_path), max_size=3000)
  for key in ("a", "b"):
    cache.put(key, b"x" * 1000)
  assert cache.get("a") == b"x" * 1000  # "b" is now the least recently used.
  pushed = []  # The entries jax's pass looked at.
  push = lru_cache.heapq.heappush
  monkeypatch.setattr(lru_cache.heapq, "heappush",
                      lambda heap, item: (pushed.append(item[1]), push(heap, item)))
  cache.put("c", b"x" * 1000)  # Fits: no pass over the entries.
  assert pushed == []
  cache.put("d", b"x" * 1000)  # Past the bound: jax's pass evicts "b".
  assert sorted(pushed) == ["a", "b", "c"]
  names = {f.removesuffix("-cache") for f in os.listdir(tmp_path) if f.endswith("-cache")}
  assert names == {"a", "c", "d"}


def test_a_program_loaded_from_the_cache_is_not_counted_as_compiled(
    clean_env, tmp_path):
  compile_cache.enable(str(tmp_path))
  f = jax.jit(lambda x: jnp.cumsum(x * 3.0 + 1.0) - 7.0)
  x = np.arange(5, dtype=np.float32)
  with CompileCounter() as first:
    f(x).block_until_ready()
  assert (first.total, first.cache_hits) == (1, 0)
  jax.clear_caches()  # Forget the executable in memory, as a new process would not have it.
  with CompileCounter() as second:
    np.testing.assert_allclose(f(x), np.cumsum(x * 3 + 1) - 7)
  assert (second.total, second.cache_hits, second.seconds) == (0, 1, 0.0)


# The quickstart shrunk to seconds (tests/pipeline/test_train.py's shapes): no warm-up, two
# RL steps.
_FAST = ["Experiment.steps = 2", "SftConfig.steps = 0", "EvalSpec.every_n_steps = 2",
         "EvalSpec.num_problems = 16", "RolloutSpec.prompts_per_step = 4",
         "RolloutSpec.group_size = 4", "EngineConfig.num_slots = 16",
         "EngineConfig.group_slots = 4", "CheckpointConfig.every_n_steps = 1",
         "PlacementConfig.num_devices = 1", "OptimizerConfig.total_steps = 10",
         "LogSpec.progress = False"]


def _train(workdir, env, extra=()):
  argv = [sys.executable, "-m", "jaxrl_post.train",
          f"--gin_file={os.path.join(ROOT, 'configs', 'quickstart.gin')}",
          f"--workdir={workdir}", *[f"--gin_param={p}" for p in _FAST], *extra]
  subprocess.run(argv, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  return read_metrics(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.slow(reason="three runs of the training command")
def test_a_second_run_and_its_resume_compile_nothing_the_first_compiled(tmp_path):
  cache = tmp_path / "xla"
  env = {k: v for k, v in os.environ.items() if k not in _JAX_ENV}
  longer = ["--gin_param=Experiment.steps = 3"]
  # The first run, then resumed for a third step. Its flag wins over an environment that
  # turns the cache off.
  flag = dict(env, **{compile_cache.ENV: "off"}), [f"--compilation_cache={cache}"]
  _train(tmp_path / "a", flag[0], flag[1])
  first = _train(tmp_path / "a", flag[0], flag[1] + longer)
  assert first[1]["compile/new_programs"] > 0 and first[1]["compile/cached_programs"] == 0
  assert os.listdir(cache)
  # The same two commands in a new workdir, the cache from the environment: every program
  # comes from disk.
  env[compile_cache.ENV] = str(cache)
  second = _train(tmp_path / "b", env)
  assert [r["step"] for r in second] == [0, 1, 2]
  assert [r["compile/new_programs"] for r in second[1:]] == [0, 0]
  resumed = _train(tmp_path / "b", env, longer)
  assert [r["step"] for r in resumed] == [0, 1, 2, 3]
  assert [r["compile/new_programs"] for r in resumed[1:]] == [0, 0, 0]
  # What the first run's processes compiled or loaded, step by step, this one loaded.
  assert ([r["compile/cached_programs"] for r in resumed[1:]] ==
          [r["compile/new_programs"] + r["compile/cached_programs"] for r in first[1:]])
