"""The KV pool of a colocated run is sized after the train step's compiled peak."""

import pytest

from jaxrl_post import plan, train
from jaxrl_post.pipeline import loop
from tests.pipeline.test_train import _argv

MB = 1 << 20


def test_pool_budget_leaves_the_train_steps_transient_memory_free():
  step = plan.TrainStepMemory(
      compiled=plan.CompiledMemory(argument_bytes=300 * MB, output_bytes=250 * MB,
                                   temp_bytes=400 * MB, generated_code_bytes=0,
                                   alias_bytes=250 * MB, flops=0.0),
      params_bytes=100 * MB, frozen_bytes=0, opt_state_bytes=200 * MB, batch_bytes=0)
  # Peak 700 MB, of which the 300 MB state is resident already: 400 MB must stay free.
  assert plan.pool_bytes_beside_train_step(1000 * MB, step, 0.5) == 300 * MB
  assert plan.pool_bytes_beside_train_step(300 * MB, step, 0.5) == 0


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
  budget = caught.value.args[0].pool.memory_bytes
  assert 0 < budget < 32 * MB
  assert "kv pool:" in capsys.readouterr().out
