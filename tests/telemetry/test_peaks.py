"""telemetry.peaks: a device kind's figure is the first listed name it contains."""

from jaxrl_post.telemetry import peaks


def test_the_more_specific_name_wins_and_unknown_devices_have_none():
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "NVIDIA H100 PCIe") == 756e12
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "NVIDIA H100 80GB HBM3") == 989e12
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "NVIDIA H200") == 4.8e12
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "cpu") is None


def test_tpu_generations_as_jax_names_them():
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "TPU v4") == 275e12
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "TPU v5 lite") == 197e12  # v5e
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "TPU v5") == 459e12  # v5p
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "TPU v6 lite") == 918e12  # v6e
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "TPU v5 lite") == 8.19e11
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "TPU v5p") == 2.765e12
