"""The benches' RESULT lines speak one language (bench/README.md): one regular expression, written here from the
README's form and not imported from the helper, parses every form the helper writes."""
from __future__ import annotations

import math
import re

import pytest

from bench.result_form import machine_line, result_line, target_met

NUM = r"(?:[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan)"
UNIT = r"(?:[^\s\d.=][^\s=]*)?"
RESULT = re.compile(
    rf"^RESULT (?P<name>[\w.-]+) ours=(?P<ours>{NUM}){UNIT} baseline=(?P<baseline>{NUM}){UNIT} "
    rf"ratio=(?P<ratio>{NUM}) target=(?P<target>(?:<=|>=|<|>){NUM}{UNIT}|{NUM}\.\.{NUM}) "
    rf"ok=(?P<ok>true|false|study) spread=(?P<min>{NUM})/(?P<median>{NUM})/(?P<max>{NUM}){UNIT} n=(?P<n>\d+) "
    rf"load=(?P<load_start>\d+\.\d\d)/(?P<load_end>\d+\.\d\d) cpus=(?P<cpus>\d+)$"
)


def parse(line: str) -> re.Match:
    match = RESULT.match(line)
    assert match, line
    return match


def test_a_ratio_target_is_judged_on_the_ratio_and_its_spread_is_over_the_rounds():
    m = parse(result_line("step_overhead", 180.44, 172.1, "<=1.05", unit="ms", ratio=1.0481, spread=[0.98, 1.2, 1.0481]))
    assert (m["ours"], m["baseline"], m["ratio"], m["ok"]) == ("180.4", "172.1", "1.048", "true")
    assert (m["min"], m["median"], m["max"], m["n"]) == ("0.98", "1.048", "1.2", "3")
    assert parse(result_line("x", 2.0, 1.0, "<=1.05"))["ok"] == "false"  # ratio 2 by default: ours / baseline


def test_a_target_with_a_unit_is_judged_on_ours_and_the_spread_carries_the_unit():
    line = result_line("demo_corpus_cached", 0.17, 31478, "<=1000ms", unit="ms", spread=[0.12, 0.17, 0.35])
    m = parse(line)
    assert m["ok"] == "true" and m["target"] == "<=1000ms" and "spread=0.12/0.17/0.35ms " in line
    assert parse(result_line("mixer_index", 9e5, 8e4, ">=1000000samples/s", unit="samples/s"))["ok"] == "false"


def test_a_band_a_strict_bound_and_a_percentage_parse_and_judge():
    assert parse(result_line("mem", 12.3, 12.0, "0.90..1.10", unit="GiB"))["ok"] == "true"
    assert parse(result_line("mem", 14.0, 12.0, "0.90..1.10", unit="GiB"))["ok"] == "false"
    assert parse(result_line("ja", 3.0, 2.0, ">1.0", unit="chars/tok"))["ok"] == "true"
    assert parse(result_line("ja", 2.0, 2.0, ">1.0", unit="chars/tok"))["ok"] == "false"
    assert parse(result_line("mfu", 42.5, 40.0, ">=40%", unit="%"))["ok"] == "true"


def test_a_study_reports_without_judging():
    m = parse(result_line("tokenizer_presegment_fugashi_ja_demo_8k", 2.9, 3.3, ">=1.0", unit="chars/tok", study=True))
    assert m["ok"] == "study" and m["n"] == "1" and m["min"] == m["median"] == m["max"] == m["ratio"]


def test_nothing_measured_is_nan_and_never_ok():
    nan = float("nan")
    m = parse(result_line("step_overhead", nan, nan, "<=1.05", unit="ms", ratio=nan))
    assert (m["ours"], m["ratio"], m["ok"], m["min"]) == ("nan", "nan", "false", "nan")
    assert not target_met("<=1.05", 1.0, nan)
    assert parse(result_line("zero", 1.0, 0.0, "<=1.05"))["ratio"] == "nan"


def test_small_and_large_numbers_keep_one_style():
    m = parse(result_line("demo", 0.1325, 35677.4, "<=1000ms", unit="ms"))
    assert (m["baseline"], m["ratio"]) == ("35677", "3.714e-06")
    assert math.isclose(float(m["ratio"]), 0.1325 / 35677.4, rel_tol=1e-3)


def test_the_load_and_cpu_count_stand_beside_every_figure():
    m = parse(result_line("x", 1.0, 1.0, "<=1.05"))
    assert int(m["cpus"]) >= 1 and float(m["load_start"]) >= 0 and float(m["load_end"]) >= 0
    assert machine_line().startswith("[machine] ") and "load average" in machine_line()


def test_a_malformed_target_is_refused():
    with pytest.raises(ValueError, match="target"):
        result_line("x", 1.0, 1.0, "1.05")
