"""Values from YAML and the command line, checked against a field's annotation and converted to it.

YAML has its own ideas about types (`1e-4` is text, `no` is false), so conversion follows what the field wants.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any, Literal

from finetune.errors import UserError


def coerce(value: Any, annotation: Any, key: str, where: str) -> Any:
    """Return `value` as the annotated type, or raise UserError saying what is allowed."""
    try:
        return _convert(value, annotation)
    except _Mismatch as mismatch:
        raise UserError(f"{where}: {key} {mismatch}, got {value!r}") from None


class _Mismatch(Exception):
    pass


def _convert(value: Any, annotation: Any) -> Any:
    if annotation is Any:
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums:  # `SchedulerType | str`: the string must name a member anyway
            return _convert(value, enums[0])
        # Strictest member first: for `str | int`, 3 stays the number 3 rather than becoming the string "3".
        errors = []
        for member in sorted((a for a in args if a is not type(None)), key=_strictness):
            try:
                return _convert(value, member)
            except _Mismatch as mismatch:
                errors.append(str(mismatch).removeprefix("must be "))
        raise _Mismatch("must be " + " or ".join(dict.fromkeys(errors)))
    if origin is Literal:
        if value in args:
            return value
        raise _Mismatch("must be one of " + ", ".join(map(str, args)))
    if origin in (list, tuple):
        items = value if isinstance(value, list) else None
        if items is None:
            raise _Mismatch("must be a list")
        return [_convert(item, args[0]) for item in items] if args else items
    if origin is dict or annotation is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch("must be a mapping of keys to values")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _Mismatch("must be true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise _Mismatch("must be a whole number")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads 1e-4 as a string; Python does not
            except ValueError:
                pass
        raise _Mismatch("must be a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch("must be a string")
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        allowed = [member.value for member in annotation]
        if value is False and "no" in allowed:
            return "no"  # YAML reads a bare `no` as false
        if value in allowed:
            return value
        raise _Mismatch("must be one of " + ", ".join(map(str, allowed)))
    return value  # types we do not check here (e.g. accelerate's ParallelismConfig); SFTConfig checks them


def _strictness(annotation: Any) -> int:
    order = [bool, int, float]
    if annotation in order:
        return order.index(annotation)
    return 5 if annotation is str else 3
