"""`owl_cl.testing.devices.cpu_devices_env`: the environment of a multi-device CPU subprocess."""

import pytest

from owl_cl.testing import devices


def test_device_count_replaced_other_flags_kept():
  base = {
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8",
    "HOME": "/h",
  }
  env = devices.cpu_devices_env(4, base, PYTHONUNBUFFERED="1")
  assert env == {
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4",
    "HOME": "/h",
    "JAX_PLATFORMS": "cpu",
    "PYTHONUNBUFFERED": "1",
  }
  assert base["XLA_FLAGS"].endswith("=8")  # not changed
  assert devices.cpu_devices_env(1, {})["XLA_FLAGS"] == "--xla_force_host_platform_device_count=1"
  with pytest.raises(ValueError, match="count must be >= 1"):
    devices.cpu_devices_env(0, {})
