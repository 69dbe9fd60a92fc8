"""Pure ``jnp`` functions, the bottom layer: the convolutions in every implementation, their decode steps, and the math
of attention. Nothing here holds parameters; ``lconv.nn`` builds modules on top. How each is built: docs/kernels.md."""
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
