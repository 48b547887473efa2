"""telemetry.resources and telemetry.profile: memory per role, measured rates, the profiler
window."""

import os

import jax
import jax.numpy as jnp
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.telemetry.profile import ProfileSpec, ProfileWindow
from jaxrl_post.telemetry.resources import DeviceRates, MemorySampler


def test_cpu_reports_no_memory_so_none_is_written():
  sampler = MemorySampler(jax.devices()[:1])
  assert not sampler.available
  sampler.start()
  assert sampler.stop([("train", 0.0, 1.0)]) == {}


def test_role_peaks_from_samples_and_the_high_water_mark():
  now = [0.0]
  readings = iter([(10, 10), (50, 50), (20, 50), (20, 90), (30, 90), (30, 90), (30, 90)])

  def stats(device):
    used, peak = next(readings)
    return {"bytes_in_use": used, "peak_bytes_in_use": peak, "bytes_limit": 1000}

  sampler = MemorySampler(["dev"], poll_s=0, clock=lambda: now[0], stats=stats)
  # The first reading was the availability probe.
  sampler.start()  # t=0: (50, 50)
  for t in (1.0, 2.0, 3.0):  # What a polling thread would read.
    now[0] = t
    sampler._sample()  # (20, 50), (20, 90), (30, 90)
  now[0] = 4.0
  out = sampler.stop([("rollout", 0.5, 1.5), ("train", 1.5, 2.5), ("sync", 3.5, 4.0)])
  assert out["memory/rollout/peak_bytes"] == 20
  assert out["memory/train/peak_bytes"] == 90  # The high-water mark rose 50 -> 90 inside.
  assert out["memory/sync/peak_bytes"] == 30
  assert out["memory/peak_bytes_in_use"] == 90 and out["memory/bytes_limit"] == 1000


def test_rates_are_the_table_peak_or_a_labelled_measurement():
  h100 = DeviceRates("NVIDIA H100 80GB HBM3", "gpu", "bfloat16", measure_matmul=None,
                     measure_copy=None)
  assert h100.flops_per_s == 989e12 and h100.bytes_per_s == 3.35e12
  assert h100.metric("perf/train_mfu", h100.flops_label) == "perf/train_mfu"
  cpu = DeviceRates("cpu", "cpu", "float32", measure_matmul=lambda dtype: 1e11,
                    measure_copy=lambda: 2e10)
  assert (cpu.flops_per_s, cpu.bytes_per_s) == (1e11, 2e10)
  assert cpu.metric("perf/train_mfu", cpu.flops_label) == \
      "perf/train_mfu_vs_cpu_measured_matmul"
  assert cpu.metric("perf/decode_hbm_util", cpu.bytes_label) == \
      "perf/decode_hbm_util_vs_cpu_measured_copy"
  # A float32 model on a listed GPU is measured too: the table's figure is bf16.
  f32 = DeviceRates("NVIDIA H100 80GB HBM3", "gpu", "float32", measure_matmul=lambda d: 5e13,
                    measure_copy=None)
  assert f32.flops_label == "gpu_measured_matmul" and f32.bytes_label == "peak"


def test_profile_window_captures_its_steps(tmp_path):
  lines = []
  window = ProfileWindow(ProfileSpec(steps=(2, 3)), str(tmp_path), log=lines.append)
  for step in (1, 2, 3, 4):
    window.before(step)
    jnp.ones(8).sum().block_until_ready()
    window.after(step)
  assert lines == [f"profile of steps 2-3 in {tmp_path / 'profile'}"]
  files = [f for _, _, fs in os.walk(tmp_path / "profile") for f in fs]
  assert any(f.endswith(".xplane.pb") for f in files)


@pytest.mark.parametrize("steps", [(3,), (0, 2), (5, 4), (1.0, 2)])
def test_bad_profile_windows_are_one_line_errors(steps):
  with pytest.raises(UserError, match="profile spec: steps"):
    ProfileSpec(steps=steps)
