"""lconv: lightweight and dynamic convolutions (Wu et al., ICLR 2019) and other self-attention replacements in JAX/Flax."""

__version__ = "0.1.0"
