"""The one family of range checks: a value that is not what its key needs is one ``ConfigError`` line naming
the key, what it must be and what it got. ``bool`` is never a number here (``True`` is an ``int`` to Python,
not to a config). Each returns the value, so a constructor can check and keep in one line. A schema declares a key
with :func:`key`: its default, its one-line doc and one of these checks."""

from __future__ import annotations

import copy
from dataclasses import field
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


class Check:
    """A key's allowed values, declared next to its schema field (``schema.key(default, doc, check=...)``) and
    applied to the composed config once (``pitstop.config.validate``). ``text`` is the range in the reference."""

    text = ""

    def __call__(self, key: str, value: object) -> None:
        raise NotImplementedError


class Integer(Check):
    """An integer >= ``at_least``; null passes when ``optional``."""

    def __init__(self, at_least: int = 1, *, optional: bool = False, note: str = ""):
        self.at_least, self.optional, self.note = at_least, optional, note
        self.text = f"integer >= {at_least}" + (" or null" if optional else "")

    def __call__(self, key: str, value: object) -> None:
        integer(key, value, at_least=self.at_least, optional=self.optional, note=self.note)


class Positive(Check):
    """A number > 0; null passes when ``optional`` (and the message says "or null")."""

    def __init__(self, *, optional: bool = False, what: str = "a positive number"):
        self.optional, self.what = optional, what
        self.text = "> 0" + (" or null" if optional else "")

    def __call__(self, key: str, value: object) -> None:
        positive(key, value, optional=self.optional, what=self.what, or_null=self.optional)


class AtLeastZero(Check):
    """A number >= 0."""

    def __init__(self, *, what: str = "a number >= 0"):
        self.what, self.text = what, ">= 0"

    def __call__(self, key: str, value: object) -> None:
        at_least_zero(key, value, what=self.what)


class Above(Check):
    """A number > ``bound`` (e.g. a factor that must be above 1)."""

    def __init__(self, bound: float):
        self.bound, self.text = bound, f"> {bound:g}"

    def __call__(self, key: str, value: object) -> None:
        if not is_number(value) or not value > self.bound:
            raise ConfigError(f"{key} must be a number > {self.bound:g}, got {value!r}")


class OneOf(Check):
    """One of a few values."""

    def __init__(self, *choices: object, say: str = ""):
        self.choices, self.say = choices, say
        self.text = " | ".join(str(c) for c in choices)

    def __call__(self, key: str, value: object) -> None:
        if value not in self.choices:
            if self.say:
                raise ConfigError(f"{key}={value!r}: {self.say}")
            raise ConfigError(f"{key} must be {' or '.join(repr(c) for c in self.choices)}, got {value!r}")


def key(default: Any, doc: str, check: Check | None = None) -> Any:
    """A key's default (its one home: the YAML options set only what differs), its one-line doc and its range."""
    meta = {"doc": doc, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)
