"""Build a contract's dataclass from a JSON object, field by field: a missing or mistyped field is named."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# Field annotations are strings here (postponed evaluation); these are the ones the contracts use.
_CHECKS: dict[str, Callable[[object], bool]] = {
    "str": lambda value: isinstance(value, str),
    "int": _int,
    "float": _number,
    "bool": lambda value: isinstance(value, bool),
    "int | None": lambda value: value is None or _int(value),
    "str | None": lambda value: value is None or isinstance(value, str),
    "dict[str, str]": _strings,
    "list[dict[str, str]]": lambda value: isinstance(value, list) and all(_strings(item) for item in value),
}


def from_fields(cls: type[T], document: Mapping[str, Any], what: str, error: type[Exception]) -> T:
    """`cls` built from the document's fields (others are ignored); raises `error` naming `what` and the field."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        if spec.name not in document:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise error(f"{what}: missing field {spec.name!r}")
            continue
        value = document[spec.name]
        if not _CHECKS[str(spec.type)](value):
            raise error(f"{what}: field {spec.name!r} has type {type(value).__name__}, not {spec.type}")
        values[spec.name] = float(value) if str(spec.type) == "float" else value
    return cls(**values)
