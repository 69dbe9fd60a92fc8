"""The checks of a config's ``mixer_kwargs`` and ``ffn_kwargs`` values, which go to a module's constructor as they
are: a field the module lacks, a dtype that is none, or a value of another kind than the field's annotation is one
line with the config (flax would take it, and fail at the first trace or read it wrongly)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from lconv.errors import UserError
from lconv.fields import MAX_TOKENS, SIZE_REASON
from lconv.ops.activations import ACTIVATIONS


def check_field_dict(where: str, values: Any, fields: set[str], owner: str) -> None:
    """``values`` is a dict of ``owner``'s ``fields`` (no name it lacks), and a dtype field names a dtype."""
    if not isinstance(values, dict):
        raise UserError(f"{where}={values!r}: must be a dict of {owner}'s fields ({sorted(fields)})")
    unknown = sorted(set(values) - fields)
    if unknown:
        raise UserError(f"{where}: {owner} has no field(s) {unknown}; its fields are {sorted(fields)}")
    for name, value in values.items():  # flax takes a dtype field as it is: a bad name was a traceback at the trace
        if (name == "dtype" or name.endswith("_dtype")) and value is not None and not _is_float_dtype(value):
            raise UserError(f"{where}[{name!r}]={value!r}: not a floating-point dtype (e.g. 'float32', 'bfloat16')")


# lconv's modules' fields that name an entry of a table: another name was a KeyError traceback at the first trace.
# (A plugin's field of the same name may have its own table, so only lconv's own modules are checked.)
_NAMED_CHOICES = {"activation": tuple(ACTIVATIONS)}

# A field annotated with one of these takes only that kind of value (a bool is no int, an int is a float): a stored
# config's "false" for a boolean field was read as true without a word.
_KINDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def check_field_kinds(where: str, values: dict, cls: type | None) -> None:
    """Each value of ``values`` whose field ``cls`` annotates as bool, int, float or str (or one of them ``| None``)
    is of that kind, and one of lconv's own modules' named choices is one it has."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return
    annotations = {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
                   for f in dataclasses.fields(cls)}
    own_module = cls.__module__.startswith("lconv.")
    for name, value in values.items():
        if own_module and name in _NAMED_CHOICES and isinstance(value, str) and value not in _NAMED_CHOICES[name]:
            raise UserError(f"{where}[{name!r}]={value!r}: must be one of {', '.join(_NAMED_CHOICES[name])}")
        annotation = str(annotations.get(name, ""))
        optional = annotation.endswith(" | None")
        kinds = _KINDS.get(annotation.removesuffix(" | None"))
        if kinds is None or (optional and value is None):
            continue
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UserError(f"{where}[{name!r}]={value!r}: must be {'a' if annotation[0] != 'i' else 'an'} "
                            f"{annotation}")
        if own_module:
            _check_range(f"{where}[{name!r}]={value!r}", name, value)


# lconv's own modules' sizes and rates: out of range was a traceback from inside JAX at the first trace, or (a
# dropout above 1) a model silently wrong in training. A size of 0 elsewhere means "derived" (light_num_heads ...).
_AT_LEAST_ONE = {"conv_features", "qkv_features", "hidden_dim", "num_heads", "kernel_size", "max_len", "memory_size",
                 "num_neighbors", "router_iterations"}
_SIGNED = {"padding_left"}  # checked against the kernel by its module


def _check_range(shown: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, int) and name not in _SIGNED and value < (1 if name in _AT_LEAST_ONE else 0):
        raise UserError(f"{shown}: must be {'>= 1' if name in _AT_LEAST_ONE else '>= 0'}")
    # Past any real run a size is a typo or a handed-over run's trap: memory it cannot allocate, and a larger bound
    # on what its checkpoint may list (hashed at load)
    if isinstance(value, int) and name in _AT_LEAST_ONE and value > MAX_TOKENS:
        raise UserError(f"{shown}: must be at most {MAX_TOKENS:,} ({SIZE_REASON})")
    if name.endswith("dropout") and not 0.0 <= value < 1.0:  # NaN fails both comparisons
        raise UserError(f"{shown}: a dropout rate must be in [0, 1)")


def _is_float_dtype(value: Any) -> bool:
    """A module's parameters and activations are floating point: an integer dtype failed at the first trace."""
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except (TypeError, ValueError):
        return False
