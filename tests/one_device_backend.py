"""A pytest plugin that makes the CPU host look like a one-GPU machine to the suite, for checking on CPU that the
tests hold on any default backend (issue 38: a GPU run found four tests that assumed eight default devices).

    PYTHONPATH=tests python -m pytest -p one_device_backend -n 2 tests

The default backend's devices (``jax.devices()``, the device counts, ``jax.make_mesh`` without devices) are the
first CPU device only, as on a single-GPU host; ``jax.devices("cpu")`` still gives conftest's 8 virtual CPUs, as it
does there. Placement and numerics are the CPU's: it finds tests that ask the default backend for devices it may
not have, not differences in numerics.
"""
import jax

_all_devices, _make_mesh = jax.devices, jax.make_mesh


def _devices(backend=None):
    return _all_devices(backend) if backend is not None else _all_devices()[:1]


def _mesh(axis_shapes, axis_names, *args, devices=None, **kwargs):
    return _make_mesh(axis_shapes, axis_names, *args, devices=_devices() if devices is None else devices, **kwargs)


jax.devices, jax.make_mesh = _devices, _mesh
jax.device_count = jax.local_device_count = lambda backend=None: len(_devices(backend))
jax.local_devices = lambda process_index=None, backend=None: _devices(backend)
