"""lconv: lightweight and dynamic convolutions (Wu et al., ICLR 2019) and other self-attention replacements in JAX/Flax
(the layers: README "Layout"). ``lconv.load(workdir)`` returns a trained run as an ``lconv.api.Model``,
``lconv.ensemble`` several decoding together; ``lconv.register_mixer`` adds a token mixer and
``lconv.testing.check_mixer`` checks one against the mixer contract."""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``load`` / ``Model`` come from the top layer (lconv.api) on first use, so ``import lconv`` stays light (no
    # JAX) and the root imports nothing above it (tests/test_layout.py).
    import importlib

    if name in ("load", "Model", "ensemble"):
        return getattr(importlib.import_module("lconv.api"), name)
    if name in ("register_mixer", "register_ffn"):
        return getattr(importlib.import_module("lconv.nn.mixers"), name)
    if name in ("testing", "export", "api"):  # submodules, imported on first use as attributes
        return importlib.import_module(f"lconv.{name}")
    raise AttributeError(f"module 'lconv' has no attribute {name!r}")
