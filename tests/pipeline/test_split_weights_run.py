"""A run whose engine holds its layers one buffer per layer (a GPU's form) keeps them
once: the weight sync writes that form and the engine decodes from the sync's buffers."""

import dataclasses

import jax
import pytest

from tests.pipeline.test_overlap import _experiment


def _ids(tree) -> list[int]:
  return [id(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_engine_decodes_from_the_syncs_own_per_layer_buffers(tmp_path, lora):
  from jaxrl_post.models import LoraConfig
  from jaxrl_post.pipeline.loop import RLRun
  from jaxrl_post.rollout.weights import is_split
  from jaxrl_post.telemetry import StepTimer

  exp = _experiment()
  engine = dataclasses.replace(exp.rollout.engine, split_layers=True)
  model = exp.model
  if lora:  # Only the adapters move; the per-layer base is made once.
    model = dataclasses.replace(model, lora=LoraConfig(rank=4, targets=("wq", "w_up")))
  exp = dataclasses.replace(exp, task=dataclasses.replace(exp.task, delay=0.0), model=model,
                            rollout=dataclasses.replace(exp.rollout, prompts_per_step=2,
                                                        max_new_tokens=8, engine=engine))
  run = RLRun(exp, str(tmp_path), log=lambda message: None)
  try:
    run.start()
    assert is_split(run.rollout.params) and is_split(run.engine.params)
    assert _ids(run.engine.params) == _ids(run.rollout.params)
    moved = "wq_lora_a" if lora else "wq"
    first, base = (run.rollout.params["layers"][0][name] for name in (moved, "wk"))
    timer = StepTimer()
    timer.start()
    metrics = run.step(1, timer)  # Trains, then syncs into the same buffers.
    assert metrics["sync/bytes"] > 0 and run.rollout.version == 1
    assert _ids(run.engine.params) == _ids(run.rollout.params)
    assert first.is_deleted()  # Donated to the new version, not kept beside it.
    assert (run.rollout.params["layers"][0]["wk"] is base) == lora  # LoRA keeps its base
  finally:
    run.close()
