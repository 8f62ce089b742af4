"""Allowed ranges of numeric config fields, declared inside each config dataclass and checked at once.

A config dataclass lists its rules in a class variable beside its fields (a ClassVar is no
field, so Hydra and OmegaConf never see it):

    lr: float = 3e-4
    RANGES: ClassVar[dict[str, Range]] = {"lr": above(0), "min_lr": at_least(0)}

`range_problems(cfg)` walks a composed config (nested dataclasses included) and returns one line
per value outside its range, e.g. `optim.lr=-0.001 must be > 0`. Hydra already refused wrong
types at composition, so what is left here is sign, zero and bounds, and with `one_of` a string
field's choices. This module imports nothing from ayumi, so every config module (model, stability,
training) can declare its rules with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; None on a side means unbounded there."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """True: low itself is not allowed (> low), else >= low."""
    high_open: bool = False
    """True: high itself is not allowed (< high), else <= high."""
    note: str = ""
    """What a boundary value means, appended to the message (e.g. '0 = keep every checkpoint')."""

    def allows(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class OneOf:
    """A fixed set of allowed values (a string field's choices), checked like a Range."""

    values: tuple[Any, ...]
    note: str = ""
    """What the choices mean, appended to the message."""

    def allows(self, value: Any) -> bool:
        return value in self.values

    def __str__(self) -> str:
        text = f"one of {', '.join(str(v) for v in self.values)}"
        return f"{text} ({self.note})" if self.note else text


Rule = Range | OneOf
"""What a RANGES entry may be."""


def one_of(*values: Any, note: str = "") -> OneOf:
    """value is one of `values`."""
    return OneOf(tuple(values), note)


def at_least(low: float, note: str = "") -> Range:
    """value >= low."""
    return Range(low, note=note)


def above(low: float, note: str = "") -> Range:
    """value > low."""
    return Range(low, low_open=True, note=note)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False, note: str = "") -> Range:
    """value in [low, high], each side open when asked."""
    return Range(low, high, low_open, high_open, note)


def range_problems(cfg: Any, prefix: str = "") -> list[str]:
    """One line per field outside its class's RANGES, walking nested config dataclasses.

    None values pass (an optional setting left unset); `prefix` is the node's dotted path with a
    trailing dot, as the user types it on the command line.
    """
    problems: list[str] = []
    rules: dict[str, Rule] = getattr(type(cfg), "RANGES", {})
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            problems += range_problems(value, key + ".")
        elif f.name in rules and value is not None and not rules[f.name].allows(value):
            problems.append(f"{key}={value} must be {rules[f.name]}")
    return problems


def unknown_rule_keys(cls: type) -> list[str]:
    """RANGES keys that name no field of cls (a typo there would silently check nothing)."""
    names = {f.name for f in fields(cls)}
    return [key for key in getattr(cls, "RANGES", {}) if key not in names]
