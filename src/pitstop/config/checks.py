"""The one family of range checks: a value that is not what its key needs is one ``ConfigError`` line naming
the key, what it must be and what it got. ``bool`` is never a number here (``True`` is an ``int`` to Python,
not to a config). Each returns the value, so a constructor can check and keep in one line."""

from __future__ import annotations

from typing import Any

from pitstop.errors import ConfigError


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(key: str, value: object, *, at_least: int = 1, optional: bool = False, note: str = "") -> Any:
    """An integer >= ``at_least`` ("a positive integer" when 1); None passes when ``optional``."""
    if value is None and optional:
        return None
    if not is_integer(value) or value < at_least:
        what = "a positive integer" if at_least == 1 else f"an integer >= {at_least}"
        raise ConfigError(f"{key} must be {what}{note}, got {value!r}")
    return value


def positive(
    key: str, value: object, *, optional: bool = False, what: str = "a positive number", or_null: bool = False
) -> Any:
    """A number > 0; None passes when ``optional`` (``or_null``: the message says so)."""
    if value is None and optional:
        return None
    if not is_number(value) or not value > 0:
        raise ConfigError(f"{key} must be {what}{' or null' if or_null else ''}, got {value!r}")
    return value


def at_least_zero(key: str, value: object, *, what: str = "a number >= 0") -> Any:
    """A number >= 0."""
    if not is_number(value) or value < 0:
        raise ConfigError(f"{key} must be {what}, got {value!r}")
    return value
