"""PPO with a critic, DAPO and LoRA through the training command, shrunk to seconds on the CPU."""

import math
import os

import numpy as np
import pytest

from jaxrl_post import train
from jaxrl_post.errors import UserError
from jaxrl_post.pipeline import config as run_config
from jaxrl_post.pipeline import dynamic
from jaxrl_post.rewards import VerifierStats
from jaxrl_post.telemetry import read_metrics

pytestmark = pytest.mark.xdist_group("algorithms")  # One worker builds the DAPO run once.

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIGS = os.path.join(ROOT, "configs")
# As test_train.py shrinks the quickstart: few steps, small groups, a checkpoint every step;
# no warm-up and one minibatch, so fewer programs compile.
FAST = ["Experiment.steps = 2", "SftConfig.steps = 0", "TrainerConfig.minibatches = 1",
        "EvalSpec.every_n_steps = 0", "EvalSpec.num_problems = 8",
        "RolloutSpec.prompts_per_step = 4", "RolloutSpec.group_size = 4",
        "EngineConfig.num_slots = 16", "EngineConfig.group_slots = 4",
        "CheckpointConfig.every_n_steps = 1", "CheckpointConfig.keep = 2",
        "PlacementConfig.num_devices = 1", "OptimizerConfig.total_steps = 10",
        "LogSpec.progress = False", "LogSpec.tensorboard = False"]
TIMING = ("time/", "rollout/tokens_per_s", "compile/", "reward/wait_s",
          "verifier/seconds_per_sample", "train/tokens_per_s", "perf/", "alarm/step_time")
OFF_POLICY = ("train/off_policy/tis_truncated_frac", "train/off_policy/seq_dropped_frac",
              "train/off_policy/is_weight_mean")
DAPO = ("dapo/rounds", "dapo/groups_drawn", "dapo/groups_zero_variance", "dapo/groups_dropped",
        "dapo/groups_refilled", "dapo/groups_short", "dapo/overlong_frac",
        "dapo/overlong_penalty_mean", "dapo/train_reward_mean")


def _run(name, workdir, extra=()):
  argv = [f"--gin_file={os.path.join(CONFIGS, name)}", f"--workdir={workdir}"]
  assert train.main(argv + [f"--gin_param={p}" for p in FAST + list(extra)]) == 0
  return read_metrics(str(workdir / "metrics.jsonl"))


def _finite(record):
  for key, value in record.items():
    if isinstance(value, float):
      assert math.isfinite(value), key


def test_ppo_config_trains_a_critic_with_gae(tmp_path):
  """On every device (8 here): the value head is sharded with the policy."""
  records = _run("quickstart_ppo.gin", tmp_path / "ppo", ["PlacementConfig.num_devices = 0"])
  assert [r["step"] for r in records] == [0, 1, 2]
  for r in records[1:]:
    _finite(r)
    for key in ("train/loss", "train/value_loss", "reward/mean") + OFF_POLICY:
      assert key in r, key
  assert any(r["train/value_loss"] > 0 for r in records[1:])
  assert "eval/accuracy" in records[-1]


def test_lora_config_syncs_only_the_adapters(tmp_path):
  """On every device (8 here): adapters train and move, the engine's base stays put."""
  records = _run("quickstart_lora.gin", tmp_path / "lora", ["PlacementConfig.num_devices = 0"])
  assert [r["step"] for r in records] == [0, 1, 2]
  # Rank 16 on all 7 matrices of 3 layers: 38912 float32s a layer, a fifth of its weights.
  assert [r["sync/bytes"] for r in records[1:]] == [3 * 38912 * 4] * 2
  for r in records[1:]:
    _finite(r)
    assert "train/loss" in r
  assert records[-1]["weight_version"] == 2 and "eval/accuracy" in records[-1]


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory):
  return _run("quickstart_dapo.gin", tmp_path_factory.mktemp("dapo") / "straight")


def test_dapo_config_refills_and_shapes(dapo_run):
  records = dapo_run
  assert [r["step"] for r in records] == [0, 1, 2]
  for r in records[1:]:
    _finite(r)
    for key in DAPO + OFF_POLICY:
      assert key in r, key
    assert 1 <= r["dapo/rounds"] <= 4
    assert r["dapo/groups_drawn"] == 4 * r["dapo/rounds"]
    assert r["dapo/groups_dropped"] == r["dapo/groups_drawn"] - 4


def _deterministic(records):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.mark.slow(reason="a straight run against a run cut short and resumed")
def test_dapo_resume_gives_the_uninterrupted_metrics(tmp_path, dapo_run):
  straight = dapo_run
  _run("quickstart_dapo.gin", tmp_path / "cut", ["Experiment.steps = 1"])
  resumed = _run("quickstart_dapo.gin", tmp_path / "cut")
  # The cut run's last step (1) was also evaluated: a run always evaluates its last step.
  cut_eval = {k for k in resumed[1] if k.startswith("eval/")} - set(straight[1])
  resumed[1] = {k: v for k, v in resumed[1].items() if k not in cut_eval}
  assert cut_eval and _deterministic(resumed) == _deterministic(straight)


def _drawn(rewards, k):
  groups = [f"g{i}" for i in range(len(rewards) // k)]
  stats = VerifierStats(samples=1, error_types={"E": 1}, parts=(f"g{len(rewards)}",))
  return dynamic.Drawn(groups, np.asarray(rewards, np.float32), stats, 0.5)


def test_zero_variance_groups_are_refilled_deterministically():
  # K = 2. Round 0 has two varied groups (g1, g3), round 1 one (g2), round 2 two (g0, g1).
  rounds = {0: [0, 0, 1, 0, 1, 1, 0, 1], 1: [1, 1, 0, 0, 1, 0, 0, 0],
            2: [0, 1, 1, 0, 0, 0, 0, 0], 3: [1, 0, 1, 0, 1, 0, 1, 0]}
  calls = []

  def draw(r):
    calls.append(r)
    return _drawn(rounds[r], 2)

  batch, drawn, counts = dynamic.refill(draw, target=4, k=2, spec=dynamic.DynamicSamplingSpec(3))
  assert calls == [0, 1, 2]  # Stops as soon as 4 varied groups exist.
  assert batch.groups == ["g1", "g3", "g2", "g0"]  # Draw order; round 2's g1 is surplus.
  np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 1, 1, 0, 0, 1])
  assert counts == {"dapo/rounds": 3, "dapo/groups_drawn": 12, "dapo/groups_zero_variance": 7,
                    "dapo/groups_dropped": 8, "dapo/groups_refilled": 2, "dapo/groups_short": 0}
  assert drawn.stats.samples == 3 and drawn.seconds == 1.5
  assert drawn.stats.parts == ("g8",) * 3 and drawn.stats.error_types == {"E": 3}
  again = dynamic.refill(lambda r: _drawn(rounds[r], 2), 4, 2, dynamic.DynamicSamplingSpec(3))
  assert again[0].groups == batch.groups and again[2] == counts


def test_a_batch_still_short_after_the_cap_keeps_its_shape():
  batch, _, counts = dynamic.refill(lambda r: _drawn([1, 1, 0, 1, 0, 0], 2), 3, 2,
                                    dynamic.DynamicSamplingSpec(1))
  assert len(batch.groups) == 3 and len(batch.rewards) == 6
  assert counts["dapo/rounds"] == 2 and counts["dapo/groups_short"] == 1


def test_round_seeds_differ_per_round_and_keep_the_first():
  assert dynamic.round_seed(7, 0) == 7
  assert len({dynamic.round_seed(7, r) for r in range(5)}) == 5
  assert dynamic.round_seed(7, 2) == dynamic.round_seed(7, 2)


@pytest.mark.parametrize("bindings, field", [
    (['advantage/AdvantageConfig.name = "gae"'], "value_head"),
    (['ModelSpec.overrides = {"value_head": True}'], "advantage/AdvantageConfig.name"),
    (["Experiment.overlong = @OverlongConfig()", "OverlongConfig.max_length = 99",
      "OverlongConfig.buffer = 1"], "OverlongConfig.max_length"),
    (["Experiment.dynamic_sampling = @DynamicSamplingSpec()",
      "DynamicSamplingSpec.max_extra_rounds = -1"], "max_extra_rounds"),
])
def test_validation_errors_are_one_line_naming_the_field(bindings, field):
  run_config.parse([os.path.join(CONFIGS, "quickstart.gin")], bindings)
  with pytest.raises(UserError) as e:
    run_config.build_experiment()
  assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow(reason="the real SmolLM2-135M trains a step")
def test_smollm2_lora_config_trains_a_step_moving_under_4_percent_of_the_weights(tmp_path):
  """The shipped SmolLM2 LoRA config, on the real embedded model, for one small step."""
  records = _run("smollm2_arith_lora.gin", tmp_path / "smol",
                 ["Experiment.steps = 1", "RolloutSpec.prompts_per_step = 2",
                  "RolloutSpec.max_new_tokens = 8", "EvalSpec.num_problems = 2"])
  assert [r["step"] for r in records] == [0, 1]
  _finite(records[1])
  # Rank 16 on all 7 matrices of 30 layers: 162816 float32s a layer.
  assert records[1]["sync/bytes"] == 30 * 162816 * 4
  assert records[1]["rollout/tokens"] > 0 and records[1]["weight_version"] == 1
