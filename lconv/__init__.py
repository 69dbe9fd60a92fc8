"""lconv: lightweight and dynamic convolutions (Wu et al., ICLR 2019) and other self-attention replacements in
JAX/Flax. The layers, bottom to top: ``constants``/``errors``, ``ops`` and ``data``, ``nn``, ``infer``, ``train``,
``cli`` (README "Layout"); the shape letters in names are ``lconv.constants``' legend."""

__version__ = "0.1.0"
