"""The configs, one module per task family (``get_config(arg)``). In a clone this folder is the package
``configs``; ``lconv/configs`` links to it, so the same files are also ``lconv.configs`` (what a wheel installs,
and what ``python -m lconv.train --config=NAME`` finds by name). They import each other as ``lconv.configs.*``."""
