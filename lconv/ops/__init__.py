"""Pure ``jnp`` functions, the bottom layer: the convolutions in every implementation, their decode steps, and
the math of attention. Nothing here holds parameters; ``lconv.nn`` builds modules on top.

- ``lconv.ops.conv``: ``light_conv``, ``dynamic_conv`` (impls conv / band / shift / unfold / pallas), decode steps.
- ``lconv.ops.pallas_conv``: the fused Pallas kernels, forward, dx and dw (Triton on GPU; interpret mode on CPU).
- ``lconv.ops.shift``: the fused shifted multiply-add conv with its custom VJP (the CPU default).
- ``lconv.ops.attention``: masks, logits and the masked softmax shared by every attention-family module.
- ``lconv.ops.precision``: ``config.model.matmul_precision`` names -> ``jax.lax.Precision``, and
  ``CONV_PRECISION`` (HIGHEST), the precision of every dot the conv ops do, so they are exact float32 on GPU and
  TPU as on CPU.
"""
from lconv.ops.conv import (
                            DYNAMIC_IMPLS,
                            LIGHT_IMPLS,
                            choose_impl,
                            dynamic_conv,
                            dynamic_conv_step,
                            init_conv_state,
                            light_conv,
                            light_conv_step,
                            tap_mask,
)

__all__ = ["DYNAMIC_IMPLS", "LIGHT_IMPLS", "choose_impl", "dynamic_conv", "dynamic_conv_step", "init_conv_state",
           "light_conv", "light_conv_step", "tap_mask"]
