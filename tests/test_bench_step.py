"""scripts/bench_step.py: a smoke run of the GRPO step benchmark prints every key."""

import json

import pytest

from tests import scripts

PHASES = {"rollout", "reward", "advantage", "pack", "train", "sync", "waiting"}


def _bench_step():
  return scripts.load("bench_step")


def test_quick_run_prints_the_step_phases_flops_and_counts(capsys):
  assert _bench_step().main(["--quick", "--steps", "1", "--warmup", "1", "--devices", "1",
                             "--remat", "dots_no_batch", "--micro-batches", "2", "--plan",
                             "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["step_s"] > 0 and set(out["phase_s"]) == PHASES
  assert out["phase_s"]["rollout"] > 0 and out["phase_s"]["train"] > 0
  assert out["flops_per_step"] == sum(out["flops_per_phase"].values())
  assert out["flops_per_phase"]["train"] > 0 and out["flops_per_phase"]["rollout"] > 0
  # Loops counted by their trip counts: above XLA's count, which sees each body once.
  assert out["flops_per_step"] > out["xla_cost_analysis_flops_per_step"] > 0
  assert out["achievable_flops_per_s"] == max(m["flops_per_s"]
                                              for m in out["matmul_benchmark"])
  assert 0 < out["roofline_fraction"] < 1 and set(out["roofline_fraction_per_phase"]) == PHASES
  # The decode matmuls' ceiling weighs rates that are each at most the best one.
  ceilings = out["roofline_ceilings"]
  assert 0 < ceilings["rollout_decode_matmuls"] <= 1
  block = out["mlp_block_flops_per_s"] / out["achievable_flops_per_s"]
  assert ceilings["train_mlp_block"] == pytest.approx(block) and block > 0
  # The trainer's share: one program for the rollout batch, one fetch of its metrics.
  assert out["program_executions_per_phase"]["train"] == 1
  assert out["host_round_trips_per_phase"]["train"] == 1
  assert out["compiled_programs_per_step"] >= len({p["name"] for p in out["programs"]})
  assert out["program_executions_per_step"] == sum(p["calls"] for p in out["programs"])
  assert out["host_round_trips_per_step"] >= 1 and out["compilations_in_timed_steps"] == 0
  assert out["devices"] == 1 and out["workload"]["rollouts"] == 4
  assert out["workload"]["remat"] == "dots_no_batch" and out["workload"]["micro_batches"] == 2
  assert out["workload"]["train_tokens"] == 4 * 16
  assert out["peak_flops_per_s"] is None and out["mfu"] is None  # a CPU has no listed peak
  # The planner's prediction for the same workload beside what was measured.
  plan = out["plan"]
  assert plan["chip"]["name"] == "local cpu" and plan["chip"]["hbm_bytes_per_s"] > 0
  assert plan["measured_s"] == {**{k: out["phase_s"][k] for k in ("rollout", "train", "sync")},
                                "step": out["step_s"]}
  assert set(plan["predicted_s"]) == set(plan["predicted_over_measured"]) == {
      "rollout", "train", "sync", "step"}
  assert plan["predicted_s"]["train"] > 0 and plan["predicted_over_measured"]["train"] > 0
  assert plan["predicted_s"]["rollout"] == pytest.approx(
      sum(max(t["compute"], t["memory"], t["serial"]) + t["kernels"] + t["collective"]
          for role, t in plan["roofline_s"].items() if role in ("prefill", "decode")),
      abs=2e-4)  # The plan rounds each figure to 0.1 ms.
  assert 0 < plan["flops_utilisation"]["train"] <= 1
  assert plan["host_s"] == pytest.approx(sum(out["phase_s"][k] for k in
                                             ("reward", "advantage", "pack", "waiting")))


def test_mfu_is_against_the_devices_bfloat16_peak():
  bench = _bench_step()
  assert bench.peak_flops_per_s("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert bench.peak_flops_per_s("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert bench.peak_flops_per_s("NVIDIA H100 80GB HBM3", "float32") is None
  assert bench.peak_flops_per_s("cpu", "bfloat16") is None
  # 2 devices, 8 TFLOP in 2 s (rollout 1 in 0.5 s, train 6 in 1 s), 0.5 TFLOP/s achievable.
  out = {"achievable_flops_per_s": 0.5e12, "roofline_fraction": 4.0,
         "roofline_fraction_per_phase": {"rollout": 2.0, "train": 6.0, "reward": 0.0}}
  assert bench.model_flops_utilisation(out, 1e12) == {"step": 2.0, "rollout": 1.0, "train": 3.0}
  assert bench.model_flops_utilisation(out, None) is None
