"""The one place the benches' RESULT line is written (bench/README.md documents the form), and the machine line.

    RESULT <name> ours=<v><unit> baseline=<v><unit> ratio=<r> target=<op><t> ok=<true|false|study>
           spread=<min>/<median>/<max> n=<k> load=<start>/<end> cpus=<c>

(one line). Every bench imports this module before it measures anything, so the load average read at import
is the machine's load when the bench started; each RESULT line reads it again at the end. Named
result_form, not common: benches that put bench/ on sys.path would otherwise hide the product's `common`
package.
"""
from __future__ import annotations

import math
import os
import re
import statistics
from collections.abc import Sequence

LOAD_AT_START = os.getloadavg()[0]
"""1-minute load average when the bench started (read at import, before any measurement)."""

_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TARGET = re.compile(rf"^(?P<op><=|>=|<|>)(?P<value>{_NUM})(?P<unit>[^\d\s.=][^\s=]*)?$|"
                     rf"^(?P<low>{_NUM})\.\.(?P<high>{_NUM})$")
_COMPARE = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def number(x: float) -> str:
    """Four significant digits (whole numbers from 10,000 up): enough to tell noise from a change, one style everywhere."""
    if x is None or not math.isfinite(x):
        return "nan"
    if abs(x) >= 1e4:
        return f"{x:.0f}"
    return f"{x:.4g}"


def _with_unit(x: float, unit: str) -> str:
    text = number(x)
    return text if text == "nan" else text + unit


def parse_target(target: str) -> tuple[str, float, float | None, str]:
    """'<=1.05' -> ('<=', 1.05, None, ''); '>=40%' -> ('>=', 40, None, '%'); '0.90..1.10' -> ('..', 0.9, 1.1, '')."""
    match = _TARGET.match(target)
    if not match:
        raise ValueError(f"target {target!r}: expected <op><value>[unit] with op one of <=, >=, <, >, or <low>..<high>")
    if match["low"] is not None:
        return "..", float(match["low"]), float(match["high"]), ""
    return match["op"], float(match["value"]), None, match["unit"] or ""


def judges_ours(target: str) -> bool:
    """A target with a unit applies to `ours` itself; one without applies to the ratio (bench/README.md)."""
    return bool(parse_target(target)[3])


def target_met(target: str, ours: float, ratio: float) -> bool:
    """Whether the judged figure (ours or the ratio, see judges_ours) meets the target; never for nan."""
    op, value, high, _ = parse_target(target)
    judged = ours if judges_ours(target) else ratio
    if judged is None or not math.isfinite(judged):
        return False
    if op == "..":
        return value <= judged <= high
    return _COMPARE[op](judged, value)


def _ratio(ours: float, baseline: float) -> float:
    try:
        return ours / baseline
    except (TypeError, ZeroDivisionError):
        return float("nan")


def result_line(name: str, ours: float, baseline: float, target: str, *, unit: str = "", ratio: float | None = None,
                spread: Sequence[float] | None = None, ok: bool | None = None, study: bool = False) -> str:
    """The RESULT line of one figure.

    target: '<=1.05' (on the ratio), '>=1000ms' (a unit: on ours), '0.90..1.10' (a range of the ratio).
    ratio: defaults to ours / baseline (benches with paired rounds pass their own).
    spread: the judged figure (ratio, or ours for a target with a unit) in each repeat or round; None for a
        single measurement (n=1), e.g. a deterministic quality figure.
    ok: the bench's own verdict when it needs more than the target (it should start from target_met).
    study: a study reports, it does not judge: ok=study, and the target is the bar a change would have to clear.
    """
    ratio = _ratio(ours, baseline) if ratio is None else ratio
    on_ours = judges_ours(target)
    values = [v for v in (spread if spread is not None else [ours if on_ours else ratio]) if v is not None]
    finite = sorted(v for v in values if math.isfinite(v))
    spread_unit = unit if on_ours else ""
    if finite:
        spread_text = "/".join(number(v) for v in (finite[0], statistics.median(finite), finite[-1])) + spread_unit
    else:
        spread_text = "nan/nan/nan"
    if study:
        verdict = "study"
    else:
        verdict = "true" if (target_met(target, ours, ratio) if ok is None else ok) else "false"
    return (f"RESULT {name} ours={_with_unit(ours, unit)} baseline={_with_unit(baseline, unit)} ratio={number(ratio)} "
            f"target={target} ok={verdict} spread={spread_text} n={len(values)} {load_fields()}")


def load_fields() -> str:
    """`load=<at start>/<now> cpus=<count>`: the 1-minute load average beside each figure, so noise shows."""
    return f"load={LOAD_AT_START:.2f}/{os.getloadavg()[0]:.2f} cpus={os.cpu_count()}"


def machine_line() -> str:
    """A line for the top of a bench's output: the CPUs and the load it starts under."""
    one, five, fifteen = os.getloadavg()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"[machine] {os.cpu_count()} CPUs ({usable} usable by this process); load average {one:.2f} "
            f"(5 min {five:.2f}, 15 min {fifteen:.2f}); at this bench's start {LOAD_AT_START:.2f}")
