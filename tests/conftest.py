"""Test setup: 8 virtual CPU devices (for sharding tests) and float64 support for the NumPy references."""
import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)  # tests opt in to float64 explicitly with numpy references
