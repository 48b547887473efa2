"""Test set-up: 8 fake CPU devices, set once before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
