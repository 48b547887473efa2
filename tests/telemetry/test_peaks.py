"""telemetry.peaks: a device kind's figure is the first listed name it contains."""

from jaxrl_post.telemetry import peaks


def test_the_more_specific_name_wins_and_unknown_devices_have_none():
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "NVIDIA H100 PCIe") == 756e12
  assert peaks.lookup(peaks.BF16_FLOPS_PER_S, "NVIDIA H100 80GB HBM3") == 989e12
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "NVIDIA H200") == 4.8e12
  assert peaks.lookup(peaks.HBM_BYTES_PER_S, "cpu") is None
