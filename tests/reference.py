"""Independent float64 NumPy references for the conv ops (plain loops over the formula, no shared code), and the
tolerances of comparisons with them by dtype and matmul precision (``tolerance``)."""
import jax
import numpy as np


def conv_reference(x_BTC, weight, padding_left, segment_ids=None):
    """``y[b,t,c] = sum_k w[b,t,h(c),k] * x[b, t+k-P, c]``, zero outside the sequence and across segments.

    ``weight`` is ``[H, K]`` (light) or ``[B, T, H, K]`` (dynamic); heads own contiguous channel blocks.
    """
    x = np.asarray(x_BTC, np.float64)
    B, T, C = x.shape
    w = np.asarray(weight, np.float64)
    if w.ndim == 2:
        w = np.broadcast_to(w, (B, T) + w.shape)
    H, K = w.shape[2:]
    head_of_channel = np.arange(C) // (C // H)
    y = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and segment_ids[b, t] == 0:
                continue
            for k in range(K):
                s = t + k - padding_left
                if not 0 <= s < T:
                    continue
                if segment_ids is not None and segment_ids[b, s] != segment_ids[b, t]:
                    continue
                y[b, t] += w[b, t, head_of_channel, k] * x[b, s]
    return y


def softmax(z, axis=-1):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


# --- tolerances ---------------------------------------------------------------------------------------------------
# How a dot rounds its float32 inputs, by backend and matmul precision (XLA's documented behaviour): CPU computes
# every float32 dot exactly; a GPU uses TF32 (10-bit mantissa) for "default" and "high"; a TPU one bfloat16 pass
# (7 bits) for "default" and three (about 16 bits) for "high". "highest" is exact float32 everywhere.
_DOT_ROUNDING = {"gpu": {"default": "tf32", "high": "tf32"}, "tpu": {"default": "bf16", "high": "bf16_3x"}}
_DTYPE_ROUNDING = {"bfloat16": "bf16", "float16": "fp16"}
# The smallest rtol and atol at each rounding: a few hundred units of it, as errors add over a dot's terms and
# over a model's layers. Coarser roundings rank later.
_FLOOR = {"exact": 0.0, "bf16_3x": 1e-4, "fp16": 1e-2, "tf32": 1e-2, "bf16": 2e-2}


def rounding(dtype=np.float32, precision="highest", backend=None):
    """The coarsest rounding a computation in ``dtype`` with dots at ``precision`` meets on ``backend``
    (default: JAX's default backend): ``"exact"`` (float32), ``"bf16_3x"``, ``"tf32"``, ``"fp16"`` or ``"bf16"``."""
    backend = backend or jax.default_backend()
    by_dot = _DOT_ROUNDING.get(backend, {}).get(precision, "exact")
    by_dtype = _DTYPE_ROUNDING.get(np.dtype(dtype).name, "exact")
    return max(by_dot, by_dtype, key=list(_FLOOR).index)


def tolerance(dtype=np.float32, precision="highest", *, rtol=1e-7, atol=0.0, backend=None):
    """``assert_allclose`` keyword arguments for a result computed in ``dtype`` with dots at ``precision``
    (``config.model.matmul_precision``), compared with a float64 reference or a float32 computation.

    ``rtol`` / ``atol`` are the test's own tolerances for what it computes (default: ``assert_allclose``'s); they
    are returned unchanged where the computation is exact float32 (CPU at any precision; "highest" anywhere) and
    otherwise raised to the floor of the rounding that the dtype and precision imply on the backend (never to
    what a backend happened to give).
    """
    floor = _FLOOR[rounding(dtype, precision, backend)]
    return {"rtol": max(rtol, floor), "atol": max(atol, floor)}
