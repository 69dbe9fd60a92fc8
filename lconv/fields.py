"""The config schema's building block: a dataclass field that carries its default, its rule (type and range) and a
one-line doc, so that each config field is written once (the sections: ``lconv.run.schema``). A rule checks, never
coerces; a broken one is one ``UserError`` line, ``config.<section>.<field>=<value>: must be <requirement>``."""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from lconv.errors import UserError


class Rule(NamedTuple):
    test: Callable[[Any], bool]
    requirement: str  # what is allowed, printed after "must be"


def is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (an integer where a number is asked for is fine; a bool is not a number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_split_name(value: Any) -> bool:
    """A split's name, as file names carry it (``<split>.hyp.txt``): no folder in it, no leading dot."""
    return isinstance(value, str) and bool(value) and not value.startswith(".") and "/" not in value \
        and "\\" not in value


def integer(minimum: int | None = None, note: str = "", *, maximum: int | None = None, reason: str = "") -> Rule:
    """An integer >= ``minimum``; with ``maximum`` also <= it, the requirement saying ``reason`` (why the bound)."""
    if minimum is None:
        return Rule(is_integer, "an integer")
    if maximum is None:
        return Rule(lambda v: is_integer(v) and v >= minimum, f"an integer >= {minimum}{note}")
    return Rule(lambda v: is_integer(v) and minimum <= v <= maximum,
                f"an integer in [{minimum}, {maximum:,}]{note}{f' ({reason})' if reason else ''}")


# Upper bounds on sizes, far above any real run: a typo (an extra zero, 1e20) is refused in one line up front.
MAX_WIDTH = 2**16  # model and FFN widths, heads
MAX_LAYERS = 1024
MAX_TOKENS = 2**20  # one sequence's tokens (lengths, positions, kernel taps)
MAX_ROWS = 2**20  # rows of a batch
MAX_VOCAB = 2**22
SIZE_REASON = "the upper bound is far above any real run; a larger value is taken for a typo"


def number(test: Callable[[float], bool], requirement: str) -> Rule:
    return Rule(lambda v: is_number(v) and test(v), requirement)


def choice(*allowed: str) -> Rule:
    return Rule(lambda v: isinstance(v, str) and v in allowed, f"one of {', '.join(allowed)}")


def anything(requirement: str) -> Rule:
    """A field whose value is checked elsewhere (the requirement is for the docs)."""
    return Rule(lambda v: True, requirement)


BOOL = Rule(lambda v: isinstance(v, bool), "True or False")
RATE = number(lambda v: 0 <= v < 1, "a number in [0, 1)")


def field(default: Any, doc: str, rule: Rule, *, to_config: Callable[[Any], Any] | None = None,
          placeholder: type | None = None) -> Any:
    """A schema field. ``to_config`` turns the default into its config spelling (``jnp.float32`` -> "float32");
    ``placeholder`` is the type of a field whose default is None (so the command line can still set it)."""
    metadata = {"doc": doc, "rule": rule, "to_config": to_config, "placeholder": placeholder}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def schema_fields(section: type) -> list[dataclasses.Field]:
    """The section's fields that have a default: those a config holds."""
    return [f for f in dataclasses.fields(section) if "rule" in f.metadata and _has_default(f)]


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def default_of(f: dataclasses.Field) -> Any:
    """The field's default as a config spells it."""
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    to_config = f.metadata.get("to_config")
    return to_config(value) if to_config else value


def defaults(section: type) -> dict[str, Any]:
    return {f.name: default_of(f) for f in schema_fields(section)}


def one_line(value: Any, limit: int = 200) -> str:
    """``repr(value)`` on one line, cut at ``limit`` characters, for a one-line error."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check(name: str, value: Any, rule: Rule) -> None:
    if not rule.test(value):
        raise UserError(f"{name}={one_line(value)}: must be {rule.requirement}")


def check_values(section: type, values: Mapping[str, Any], prefix: str) -> None:
    """Unknown fields (a typo would otherwise be ignored silently), then each value against its rule."""
    rules = {f.name: f.metadata["rule"] for f in dataclasses.fields(section) if "rule" in f.metadata}
    unknown = sorted(set(values) - set(rules))
    if unknown:
        raise UserError(f"{prefix} has unknown field(s) {unknown}; known: {sorted(rules)}")
    for name, value in values.items():
        check(f"{prefix}.{name}", value, rules[name])


def as_dict(config: Any) -> dict[str, Any]:
    """A ConfigDict, a mapping or a section dataclass -> a plain dict of its fields."""
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


def markdown_table(section: type, prefix: str) -> str:
    """The section's fields as a markdown table: field, default, what is allowed, what it does."""
    rows = ["| field | default | allowed | what it does |", "|---|---|---|---|"]
    for f in schema_fields(section):
        allowed = f.metadata["rule"].requirement.replace("|", "\\|")
        doc = f.metadata["doc"].replace("|", "\\|")
        rows.append(f"| `{prefix}.{f.name}` | `{default_of(f)!r}` | {allowed} | {doc} |")
    return "\n".join(rows)
