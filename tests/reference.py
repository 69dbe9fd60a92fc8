"""Independent float64 NumPy references for the conv ops (plain loops over the formula, no shared code)."""
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
