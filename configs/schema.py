"""The config schema moved to ``lconv.run.schema`` (a library module, beneath training and every surface). This
name stays so that a config file written against it (``from lconv.configs import schema``) keeps working: it is
the same module object, not a copy."""
import sys

from lconv.run import schema

sys.modules[__name__] = schema
