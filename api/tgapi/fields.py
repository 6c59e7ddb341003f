"""Field metadata shared by the parser and the CRD schema generator.

Every spec dataclass declares its fields with :func:`spec_field`, which records the
camelCase wire name, a description, bounds and enums. The parser (``parse.py``) and
the OpenAPI generator (``crd.py``) both read this metadata, so the YAML a user
writes, the errors they get and the schema the API server enforces come from one
place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING
from typing import Any

_META_KEY = "tgapi"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FieldMeta:
    """What the parser and the schema generator know about one field."""

    name: str
    description: str
    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float | None = None
    enum: Sequence[str] | None = None
    pattern: str | None = None
    max_length: int | None = None
    int_or_string: bool = False
    free_form: bool = False
    """An object or list item whose content the API server preserves as-is."""
    bool_or_auto: bool = False
    """A field typed ``bool | str`` that takes true, false or the string "auto"."""


def spec_field(
    *,
    name: str,
    description: str,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    maximum: float | None = None,
    enum: Sequence[str] | None = None,
    pattern: str | None = None,
    max_length: int | None = None,
    int_or_string: bool = False,
    free_form: bool = False,
    bool_or_auto: bool = False,
) -> Any:
    """Declare a dataclass field with its wire name and schema constraints."""
    meta = FieldMeta(
        name=name,
        description=description,
        minimum=minimum,
        exclusive_minimum=exclusive_minimum,
        maximum=maximum,
        enum=tuple(enum) if enum is not None else None,
        pattern=pattern,
        max_length=max_length,
        int_or_string=int_or_string,
        free_form=free_form,
        bool_or_auto=bool_or_auto,
    )
    kwargs: dict[str, Any] = {"metadata": {_META_KEY: meta}}
    if default is not MISSING:
        kwargs["default"] = default
    if default_factory is not MISSING:
        kwargs["default_factory"] = default_factory
    return dataclasses.field(**kwargs)


def field_meta(field: dataclasses.Field[Any]) -> FieldMeta:
    """Return the metadata of a field declared with :func:`spec_field`."""
    meta = field.metadata.get(_META_KEY)
    if not isinstance(meta, FieldMeta):
        raise TypeError(f"field {field.name!r} was not declared with spec_field()")
    return meta


def has_default(field: dataclasses.Field[Any]) -> bool:
    return field.default is not MISSING or field.default_factory is not MISSING


def default_value(field: dataclasses.Field[Any]) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    raise KeyError(field.name)
