"""Test setup: the backend the user chose (CPU by default), 8 virtual CPU devices for the sharding tests, and
float64 support for the NumPy references.

``JAX_PLATFORMS=cuda python -m pytest tests`` runs the suite on the GPU: the user's platforms come first (the
default backend), and ``cpu`` is added after them so that tests about CPU virtual devices can still ask for
``jax.devices("cpu")``. Tolerances follow the dtype and matmul precision under test (``reference.tolerance``).
"""
import os

import pytest

# Must happen before jax is imported anywhere.
_DEVICE_COUNT = "--xla_force_host_platform_device_count"
if _DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT}=8".strip()
_platforms = [p for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p]
os.environ["JAX_PLATFORMS"] = ",".join(_platforms + ["cpu"] * ("cpu" not in _platforms))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)  # tests opt in to float64 explicitly with numpy references


def pytest_report_header(config):
    return f"jax {jax.__version__}, default backend {jax.default_backend()}: {jax.devices()}"


@pytest.fixture
def lconv_log(caplog):
    """``lconv_log()``: the messages lconv logged so far in the test, in order, as its programs print them."""
    import log_capture

    with log_capture.attached(caplog.handler):
        yield lambda: [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "lconv"]
