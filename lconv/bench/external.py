"""Baselines outside JAX for the ``mixers`` suite's op rows: PyTorch's depthwise ``F.conv1d`` and fairseq's CUDA kernels
where importable, skipped with the reason without them (docs/benchmarks.md, "Baselines outside JAX")."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lconv.bench import timing

# (row label, builder name, dynamic): the labels follow lconv's op rows ("LightConv op, <impl>").
BASELINES = (("LightConv op, PyTorch conv1d", "depthwise", False),
             ("LightConv op, fairseq lightconv_cuda", "fairseq", False),
             ("DynamicConv op, fairseq dynamicconv_cuda", "fairseq", True))


def torch_or_reason() -> tuple[Any, str | None]:
    """``(torch, None)``, or ``(None, why the PyTorch rows are skipped)``."""
    try:
        return importlib.import_module("torch"), None
    except ImportError:
        return None, "torch is not installed (pip install 'lconv[fairseq]')"


def device_name(torch: Any) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def depthwise(torch: Any, B: int, T: int, C: int, H: int, K: int, pad: int, dtype: Any) -> tuple[Callable, tuple]:
    """LightConv as PyTorch's grouped ``conv1d``, one group per channel: ``(fn(x, w), (x [B,C,T], w [H,K]))``."""
    F, device = torch.nn.functional, device_name(torch)

    def fn(x_BCT, w_HK):
        w_C1K = w_HK.repeat_interleave(C // H, dim=0)[:, None, :]  # head h -> its C/H channels
        x_BCT = F.pad(x_BCT, (pad, K - 1 - pad))
        return F.conv1d(x_BCT, w_C1K, groups=C)  # cross-correlation: y[t] = sum_k w[k] x[t + k - pad]

    x = torch.randn(B, C, T, device=device, dtype=dtype)
    w = torch.softmax(torch.randn(H, K, device=device, dtype=torch.float32), -1).to(dtype)
    return fn, (x, w)


def fairseq_kernel(torch: Any, dynamic: bool, B: int, T: int, C: int, H: int, K: int, pad: int,
                   dtype: Any) -> tuple[Callable, tuple]:
    """fairseq's CUDA op as its autograd function does it (``forward(x, w, pad)[0]``; ``backward`` -> dx, dw)."""
    if device_name(torch) != "cuda":
        raise ImportError("fairseq's CUDA kernels need a CUDA device")
    module = importlib.import_module("dynamicconv_cuda" if dynamic else "lightconv_cuda")

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return module.forward(x, w, pad)[0]

        @staticmethod
        def backward(ctx, grad):
            return tuple(module.backward(grad.contiguous(), pad, *ctx.saved_tensors))

    x = torch.randn(B, C, T, device="cuda", dtype=dtype)
    shape = (B, H, K, T) if dynamic else (H, K)
    w = torch.softmax(torch.randn(*shape, device="cuda", dtype=torch.float32), -2 if dynamic else -1).to(dtype)
    return Op.apply, (x, w)


def measure(torch: Any, fn: Callable, args: tuple, *, backward: bool, budget_s: float) -> timing.Measurement:
    """Seconds per call of ``fn(*args)`` (with ``backward``: and the gradients of ``<fn(*args), g>``)."""
    cuda = device_name(torch) == "cuda"
    leaves = [a.detach().requires_grad_(backward) for a in args]
    g = torch.randn_like(fn(*leaves)) if backward else None

    def call():
        if backward:
            for leaf in leaves:
                leaf.grad = None
            fn(*leaves).backward(g)
        else:
            with torch.no_grad():
                fn(*leaves)
        if cuda:
            torch.cuda.synchronize()

    call()  # warm-up: cuDNN's algorithm choice, allocations
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    stats, runs = timing.budgeted_runs(call, budget_s)
    memory = torch.cuda.max_memory_allocated() if cuda else None
    return timing.Measurement(stats["median_s"], stats["min_s"], runs, None, memory,
                              "torch.cuda.max_memory_allocated" if cuda else None)


def build(torch: Any, builder: str, dynamic: bool, B: int, T: int, C: int, H: int, K: int,
          dtype_name: str = "float32") -> tuple[Callable, tuple]:
    dtype = getattr(torch, dtype_name)
    if builder == "depthwise":
        return depthwise(torch, B, T, C, H, K, K // 2, dtype)
    return fairseq_kernel(torch, dynamic, B, T, C, H, K, K // 2, dtype)
