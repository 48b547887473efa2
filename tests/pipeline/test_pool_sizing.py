"""The KV pool of a colocated run is sized after the train step's compiled peak, by the
rule the planner predicts it with."""

import json
import subprocess
import sys

import pytest

from jaxrl_post import plan, train
from jaxrl_post.pipeline import loop
from jaxrl_post.rollout.pages import PoolConfig, pool_budget
from tests.pipeline.test_train import _argv

MB = 1 << 20


def test_pool_budget_leaves_the_train_steps_transient_memory_free():
  step = plan.TrainStepMemory(
      compiled=plan.CompiledMemory(argument_bytes=300 * MB, output_bytes=250 * MB,
                                   temp_bytes=400 * MB, generated_code_bytes=0,
                                   alias_bytes=250 * MB, flops=0.0),
      params_bytes=100 * MB, frozen_bytes=0, opt_state_bytes=200 * MB, batch_bytes=0)
  # Peak 700 MB, of which the 300 MB state is resident already: 400 MB must stay free.
  half = PoolConfig(memory_fraction=0.5)
  assert pool_budget(half, 1000 * MB, step.transient_bytes) == 300 * MB
  assert pool_budget(half, 300 * MB, step.transient_bytes) == 0


class _Captured(Exception):
  """Stops the run once the engine's config is known."""


def test_a_run_on_a_device_with_memory_stats_sizes_its_pool_after_the_train_step(
    tmp_path, capsys, monkeypatch):
  """CPU devices report no memory; pretend one has 64 MB free and check that the pool is
  what is left beside the compiled train step, not a share of the whole 64 MB."""
  monkeypatch.setattr(loop, "free_device_bytes", lambda device: 64 * MB)

  def capture(model_cfg, params, engine_cfg, **kwargs):
    raise _Captured(engine_cfg)

  monkeypatch.setattr(loop, "Engine", capture)
  with pytest.raises(_Captured) as caught:
    train.main(_argv(tmp_path / "run", ["PoolConfig.num_pages = None",
                                        "PoolConfig.memory_fraction = 0.5"]))
  pool = caught.value.args[0].pool
  assert pool.memory_bytes is None and 0 < pool.reserved_bytes < 64 * MB
  budget = pool_budget(pool, 64 * MB)  # What the engine takes with 64 MB free.
  assert 0 < budget < 32 * MB
  assert "kv pool:" in capsys.readouterr().out


def test_an_asynchronous_run_sets_its_weight_versions_in_flight_aside_before_the_pool(
    tmp_path, capsys, monkeypatch):
  """One-step-off keeps up to 3 rollout copies where the synchronous loop keeps 1: with
  64 MB free the pool is sized with the 2 more left aside, beside the train step's share."""
  monkeypatch.setattr(loop, "free_device_bytes", lambda device: 64 * MB)

  def capture(model_cfg, params, engine_cfg, **kwargs):
    raise _Captured(engine_cfg.pool, model_cfg)

  monkeypatch.setattr(loop, "Engine", capture)
  pools = {}
  for mode in ("sync", "one_step_off"):
    with pytest.raises(_Captured) as caught:
      train.main(_argv(tmp_path / mode, ["PoolConfig.num_pages = None",
                                         f"AsyncSpec.mode = '{mode}'"]))
    pools[mode], model_cfg = caught.value.args
  copy = 4 * model_cfg.num_params  # The quickstart's rollout weights: float32, one device.
  assert pools["one_step_off"].reserved_bytes - pools["sync"].reserved_bytes == 2 * copy
  assert pool_budget(pools["one_step_off"], 64 * MB) < pool_budget(pools["sync"], 64 * MB)
  assert "2 more rollout weight versions held in flight" in capsys.readouterr().out


def _run_pages(tmp_path, monkeypatch, params):
  """The pages per data shard the run's engine allocates (the run stops there)."""
  real = loop.Engine

  def capture(*args, **kwargs):
    engine = real(*args, **kwargs)
    raise _Captured(engine.allocs[0].num_pages, engine.page_size, len(engine.allocs))

  monkeypatch.setattr(loop, "Engine", capture)
  with pytest.raises(_Captured) as caught:
    train.main(_argv(tmp_path / "run", params))
  return caught.value.args


@pytest.mark.parametrize("params", [
    ["PoolConfig.num_pages = None"],  # CPU devices: the fallback budget over the shards
    ["PoolConfig.num_pages = None", "PoolConfig.fallback_bytes = 50000000",
     "PlacementConfig.num_devices = 8", "rollout_mesh/MeshConfig.data = 2",
     "rollout_mesh/MeshConfig.tensor = 4"],
], ids=["fallback", "tensor4_data2"])
def test_the_plan_predicts_the_pool_the_run_allocates(tmp_path, monkeypatch, params):
  """One sizing rule (rollout.pages.pool_pages) for the engine and the planner: plan's
  kv_tokens are the pages the run's engine allocates per data shard, times the page."""
  from tests.pipeline.test_train import FAST, QUICKSTART
  pages, page_size, shards = _run_pages(tmp_path, monkeypatch, params)
  out = subprocess.run([sys.executable, "-m", "jaxrl_post.plan", f"--gin_file={QUICKSTART}",
                        *[f"--gin_param={p}" for p in FAST + params], "--json"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  predicted = json.loads(out.stdout.strip().splitlines()[-1])
  assert predicted["kv_pages"] == pages and predicted["kv_tokens"] == pages * page_size
  assert shards == (2 if len(params) > 1 else 1)
