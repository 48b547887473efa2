"""The training command on any device count, and across processes through jax.distributed.

Default placement (colocated: FSDP training mesh, data-parallel rollout mesh over every
device) must run unchanged on 1, 2 and 8 devices; 2 processes x 4 devices must write the
metrics 1 process x 8 devices writes, with only process 0 writing the run's files.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.telemetry import read_metrics
from tests.pipeline.test_train import QUICKSTART, ROOT, _deterministic, _wait_for_step
from tests.sharding.test_multiprocess import free_port
from tests.xla import host_flags

# The quickstart at its smallest: a few RL steps, no warm-up, a small evaluation.
SMALL = ["Experiment.steps = 2", "SftConfig.steps = 0", "EvalSpec.num_problems = 8",
         "EvalSpec.every_n_steps = 0", "RolloutSpec.prompts_per_step = 4",
         "RolloutSpec.group_size = 4", "EngineConfig.num_slots = 16",
         "EngineConfig.group_slots = 4", "OptimizerConfig.total_steps = 10",
         "LogSpec.progress = False"]


def _cmd(workdir, extra=(), config=QUICKSTART):
  return ([sys.executable, "-m", "jaxrl_post.train", f"--gin_file={config}",
           f"--workdir={workdir}"] + [f"--gin_param={p}" for p in SMALL] + list(extra))


def _env(devices: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = host_flags(devices)
  return env


def _run(workdir, devices: int, extra=(), config=QUICKSTART) -> list[dict]:
  done = subprocess.run(_cmd(workdir, extra, config), env=_env(devices), capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "held-out accuracy:" in done.stdout
  return read_metrics(str(workdir / "metrics.jsonl"))


# The train program's compiled memory is per device: it shrinks as FSDP shards it. How
# long the rollout ahead took and how far it had got are timing, not data.
PER_DEVICE = ("memory/", "async/rollout_", "async/queue")


def _close(got: list[dict], want: list[dict]) -> None:
  """Same steps and keys; numbers equal up to float32 reduction order."""
  strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(PER_DEVICE)}
                      for r in _deterministic(rs)]
  got, want = strip(got), strip(want)
  assert [r["step"] for r in got] == [r["step"] for r in want]
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for key in w:
      if isinstance(w[key], float):
        assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), (g["step"], key)
      else:
        assert g[key] == w[key], (g["step"], key)


def _two_processes(command, envs) -> list[tuple[str, str]]:
  """Runs command(extra flags) as processes 0 and 1 of one jax.distributed job, process i
  with envs[i]; their (stdout, stderr), once both exited 0."""
  port = free_port()
  procs = [subprocess.Popen(command([f"--coordinator_address=127.0.0.1:{port}",
                                     "--num_processes=2", f"--process_id={i}"]),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i, env in enumerate(envs)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=900))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("two-process run timed out")
    assert p.returncode == 0, outs[-1][1][-3000:]
  return outs


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """The default-placement run's metrics on n devices, each run once for this module."""
  runs = {}

  def get(n: int) -> list[dict]:
    if n not in runs:
      runs[n] = _run(tmp_path_factory.mktemp(f"baseline{n}"), n)
    return runs[n]

  return get


# The tests that compare with the module's one-device run share one worker, which runs it once.
BASELINE = pytest.mark.xdist_group("devices-baseline")


@BASELINE
@pytest.mark.slow
# The verifier test below runs the default placement on 8 devices (two processes of 4)
# against one device, and the GPU config's test runs one process of 8.
@pytest.mark.sweep
@pytest.mark.parametrize("devices", [2, 8])
def test_default_placement_gives_the_one_device_run_on(devices, baseline):
  runs = {n: baseline(n) for n in (1, devices)}
  for n, records in runs.items():
    assert [r["step"] for r in records] == [0, 1, 2], n
    assert records[-1]["weight_version"] == 2
  _close(runs[devices], runs[1])


@pytest.mark.slow(reason="the MoE quickstart on 1 device and with 8 expert shards")
def test_moe_quickstart_with_experts_over_8_devices_gives_the_one_device_run(tmp_path):
  """configs/quickstart_moe.gin puts its 8 experts on the "expert" axis of every device,
  and the tokens too: each device trains and decodes its own rows, and the expert block
  sends tokens to their experts' devices and back. The metrics (routing agreement and
  the logprob mismatch with and without replay included) are the one-device run's."""
  config = os.path.join(ROOT, "configs", "quickstart_moe.gin")
  runs = {n: _run(tmp_path / str(n), n, config=config) for n in (1, 8)}
  assert runs[8][-1]["train/routing/expert_agreement"] > 0.9
  _close(runs[8], runs[1])


SPLIT = ["--gin_param=PlacementConfig.mode = 'split'",
         "--gin_param=PlacementConfig.trainer_devices = 4",
         "--gin_param=rollout_mesh/MeshConfig.data = 2",
         "--gin_param=rollout_mesh/MeshConfig.tensor = 2"]


@pytest.mark.slow
@pytest.mark.sweep  # The cross-process split below runs this layout against one device too.
def test_split_placement_with_a_multi_device_rollout_mesh(tmp_path, baseline):
  """4 devices train (FSDP), 4 roll out (data 2 x tensor 2); sync reshards between them."""
  records = _run(tmp_path / "split", 8, SPLIT)
  assert records[-1]["weight_version"] == 2
  _close(records, baseline(1))


@pytest.mark.slow
@pytest.mark.sweep  # The verifier test below runs two processes against one as well.
def test_two_processes_write_the_metrics_of_one_process(tmp_path, baseline):
  workdir = tmp_path / "multi"
  outs = _two_processes(lambda extra: _cmd(workdir, extra), [_env(4), _env(4)])
  assert "held-out accuracy:" in outs[0][0] and "held-out accuracy:" not in outs[1][0]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["0", "2"]
  _close(read_metrics(str(workdir / "metrics.jsonl")), baseline(8))


@pytest.mark.slow(reason="two processes of the training command, then one against them")
def test_a_verifier_timing_out_on_one_process_is_one_value_on_both(tmp_path):
  """Process 1's verifier times out on every call, process 0's never does. Each process
  scores its groups (prompts) and the outcomes are gathered, so both train on the same
  rewards, and the run writes the metrics of one process (one device: its programs are
  the cached baseline's) whose verifier times out on exactly the problems process 1 scored."""
  task = "".join(f"SlowArithmeticTask.{line}\n" for line in (
      "min_operand = 0", "max_operand = 49", "operators = ('+',)",
      "template = '{a}{op}{b}='", "num_eval = 200"))
  gin_file = tmp_path / "slow.gin"
  gin_file.write_text(f"include '{QUICKSTART}'\nimport tests.pipeline.slow_verifier\n"
                      f"Experiment.task = @SlowArithmeticTask()\n{task}"
                      "RewardSpec.timeout_s = 1.0\nRewardSpec.workers = 4\n")
  cmd = lambda workdir, extra=(): [
      c if not c.startswith("--gin_file=") else f"--gin_file={gin_file}"
      for c in _cmd(workdir, ["--gin_param=Experiment.steps = 1", *extra])]
  multi = tmp_path / "multi"
  outs = _two_processes(lambda extra: cmd(multi, extra),
                        [_env(4), dict(_env(4), JAXRL_TEST_SLOW_VERIFIER="1")])
  # Process 0 alone prints and writes the run's files; checkpoints are written together.
  assert "held-out accuracy:" in outs[0][0] and "held-out accuracy:" not in outs[1][0]
  assert sorted(os.listdir(multi / "checkpoints")) == ["0", "1"]
  records = read_metrics(str(multi / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1]
  # 4 prompts x 4 samples; process 1 scores groups 1 and 3.
  assert (records[1]["verifier/samples"], records[1]["verifier/timeouts"]) == (16, 8)
  for r in records:  # Greedy pass@1 on 8 problems: 4 are process 1's.
    assert (r["eval/problems"], r["eval/timeouts"]) == (8, 4)
  dead = [json.loads(line) for line in
          (multi / "dead_letter.process1.jsonl").read_text().splitlines()]
  assert len(dead) == 8 + 2 * 4 and {d["type"] for d in dead} == {"timeout"}
  assert not (multi / "dead_letter.jsonl").exists() or \
      not (multi / "dead_letter.jsonl").read_text().strip()
  # One process whose verifier times out on those problems writes the same metrics.
  slow = ",".join(sorted({d["problem_id"] for d in dead}))
  env = dict(_env(1), JAXRL_TEST_SLOW_PROBLEMS=slow)
  done = subprocess.run(cmd(tmp_path / "single"), env=env, capture_output=True, text=True,
                        timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  _close(records, read_metrics(str(tmp_path / "single" / "metrics.jsonl")))


# Trainer devices 2 (process 0's first two) against a rollout mesh of 6 over both processes:
# each sync sends from the 2 trainer devices in 3 rounds.
SPLIT_UNEVEN = ["--gin_param=PlacementConfig.mode = 'split'",
                "--gin_param=PlacementConfig.trainer_devices = 2"]


@BASELINE
@pytest.mark.slow
@pytest.mark.sweep  # The asynchronous run below runs this split across processes, and resumes.
@pytest.mark.parametrize("split", [SPLIT, SPLIT_UNEVEN], ids=["4_and_4", "2_and_6"])
def test_split_placement_across_processes_writes_the_metrics_of_one_process(tmp_path,
                                                                            baseline, split):
  """Process 0's 4 devices train, process 1's 4 roll out: the rollouts reach the trainer's
  host, the train metrics the rollout's, and each sync moves the weights device to device
  between the processes (sharding/hosts.py). Both write the checkpoints, and a longer run
  resumes from them."""
  workdir = tmp_path / "multi"
  run = lambda extra: _two_processes(lambda flags: _cmd(workdir, [*split, *extra, *flags]),
                                     [_env(4), _env(4)])
  run([])
  records = read_metrics(str(workdir / "metrics.jsonl"))
  assert records[-1]["weight_version"] == 2
  _close(records, baseline(1))
  outs = run(["--gin_param=Experiment.steps = 3"])
  assert "resumed from" in outs[0][0] + outs[0][1]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]
  assert [r["step"] for r in read_metrics(str(workdir / "metrics.jsonl"))] == [0, 1, 2, 3]


ASYNC = ["--gin_param=AsyncSpec.mode = 'one_step_off'", "--gin_param=Experiment.steps = 4",
         "--gin_param=CheckpointConfig.every_n_steps = 2"]


BOUNDED = ["--gin_param=AsyncSpec.mode = 'bounded'", "--gin_param=AsyncSpec.max_staleness = 4"]


@pytest.mark.slow(reason="the asynchronous run on 1 process, and on 2 killed and resumed")
@pytest.mark.parametrize("placement,mode", [(SPLIT, []),
                                            pytest.param([], [], marks=pytest.mark.sweep),
                                            pytest.param(SPLIT, BOUNDED, marks=pytest.mark.sweep)],
                         ids=["split", "colocated", "split-bounded"])
def test_async_across_processes_writes_the_metrics_of_one_process_and_resumes(
    tmp_path, placement, mode):
  """split: process 0's 4 devices train, process 1's roll out the batches a step ahead,
  drawn in each process's main thread (pipelined._Inline); colocated: all 8 do both.
  Process 1 killed after step 3 (its launcher kills process 0 too) and both restarted: the
  run resumes from checkpoint 2, recomputes step 3 bit for bit, and writes the
  one-process run's metrics."""
  one = _run(tmp_path / "one", 1, [*ASYNC, *mode])  # One device: the cheapest reference.
  workdir = tmp_path / "multi"
  port = free_port()
  flags = [*placement, *ASYNC, *mode]
  procs = [subprocess.Popen(_cmd(workdir, [*flags, f"--coordinator_address=127.0.0.1:{port}",
                                           "--num_processes=2", f"--process_id={i}"]),
                            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  try:
    _wait_for_step(str(workdir / "metrics.jsonl"), 3, procs[0], timeout=600)
    for p in reversed(procs):
      p.send_signal(signal.SIGKILL)
  finally:
    for p in procs:
      p.communicate(timeout=60)
  before = {r["step"]: r for r in read_metrics(str(workdir / "metrics.jsonl"))}
  assert 3 in before and 4 not in before, sorted(before)
  outs = _two_processes(lambda extra: _cmd(workdir, [*flags, *extra]), [_env(4), _env(4)])
  assert "resumed from" in outs[0][0] and "(step 2)" in outs[0][0], outs[0][0][-2000:]
  records = read_metrics(str(workdir / "metrics.jsonl"))
  exact = lambda r: {k: v for k, v in _deterministic([r])[0].items()
                     if not k.startswith(PER_DEVICE)}
  assert exact(before[3]) == exact(records[3])  # Recomputed exactly.
  assert records[-1]["async/lag_steps"] == (2 if mode else 1)  # 2 minibatches a step
  _close(records, one)


def test_in_flight_weight_updates_stay_in_one_process():
  from jaxrl_post.pipeline.config import AsyncSpec
  from jaxrl_post.pipeline.pipelined import check_processes

  check_processes(AsyncSpec(mode="one_step_off"), 2)
  check_processes(AsyncSpec(mode="one_step_off", weight_updates="in_flight"), 1)
  with pytest.raises(UserError, match="weight_updates = 'in_flight' runs in one process "
                                      r"\(this job has 2\)"):
    check_processes(AsyncSpec(mode="one_step_off", weight_updates="in_flight"), 2)


def _gsm8k_files(directory) -> None:
  directory.mkdir()
  for name, first in (("train.jsonl", 0), ("test.jsonl", 50)):
    rows = [{"question": f"Tom has {a} apples and buys {a + 3} more. How many now?",
             "answer": f"{a} + {a + 3} = {2 * a + 3}\n#### {2 * a + 3}"}
            for a in range(first, first + 12)]
    (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow(reason="the shipped GPU config's whole run on 8 devices")
def test_hf_gsm8k_config_runs_unchanged_on_8_devices(tmp_path):
  """The shipped GPU config, on a tiny HF model directory and GSM8K-format files: only
  sizes are shrunk; placement, meshes and engine settings are the config's own."""
  data = tmp_path / "gsm8k"
  _gsm8k_files(data)
  params = [f'MODEL_DIR = "{os.path.join(ROOT, "tests", "fixtures", "hf", "tiny_llama")}"',
            f'DATA_DIR = "{data}"', "Experiment.steps = 2", "RolloutSpec.prompts_per_step = 4",
            "RolloutSpec.group_size = 4", "RolloutSpec.max_new_tokens = 16",
            "PromptConfig.max_prompt_tokens = 160", "TrainerConfig.row_tokens = 256",
            "TrainerConfig.minibatches = 2", "TrainerConfig.micro_batches = 2",
            "EngineConfig.num_slots = 16", "EngineConfig.prefill_chunk = 64",
            "EvalSpec.num_problems = 8", "CheckpointConfig.every_n_steps = 1",
            "LogSpec.progress = False"]
  cmd = [sys.executable, "-m", "jaxrl_post.train",
         f"--gin_file={os.path.join(ROOT, 'configs', 'hf_gsm8k_grpo.gin')}",
         f"--workdir={tmp_path / 'run'}"] + [f"--gin_param={p}" for p in params]
  done = subprocess.run(cmd, env=_env(8), capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
  assert [r["step"] for r in records] == [0, 1, 2]
  assert records[-1]["weight_version"] == 2
