"""The benches' RESULT lines speak one language (bench/README.md): one regular expression, written here from the
README's form and not imported from the helper, parses every form the helper writes; every bench prints its
RESULT lines through that helper, never by hand; and a real bench's output parses."""
from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys

import pytest

from bench.result_form import machine_line, result_line, target_met
from tests.helpers import REPO

NUM = r"(?:[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan)"
UNIT = r"(?:[^\s\d.=][^\s=]*)?"
RESULT = re.compile(
    rf"^RESULT (?P<name>[\w.-]+) ours=(?P<ours>{NUM}){UNIT} baseline=(?P<baseline>{NUM}){UNIT} "
    rf"ratio=(?P<ratio>{NUM}) target=(?P<target>(?:<=|>=|<|>){NUM}{UNIT}|{NUM}\.\.{NUM}) "
    rf"ok=(?P<ok>true|false|study) spread=(?P<min>{NUM})/(?P<median>{NUM})/(?P<max>{NUM}){UNIT} n=(?P<n>\d+) "
    rf"load=(?P<load_start>\d+\.\d\d)/(?P<load_end>\d+\.\d\d) cpus=(?P<cpus>\d+)$"
)
HELPERS = {"result_form.py", "markov_corpus.py", "torchtitan_peer.py"}  # used by benches, measure nothing themselves
# (bench/README.md)
BENCHES = sorted(path for path in (REPO / "bench").glob("*.py") if path.name not in HELPERS)


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


# -- every bench --------------------------------------------------------------------------------------------------
def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring nodes (module, classes, functions): they may show the form, they print nothing."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def hand_written_results(path) -> list[str]:
    """Strings and f-strings in the code (not docstrings) that begin a RESULT line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstrings(tree)
    found = set()  # an f-string's first part is a string of its own too: one entry per line
    for node in ast.walk(tree):
        head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and head.value.startswith("RESULT") \
                and id(head) not in skip:
            found.add(f"{path.name}:{node.lineno}")
    return sorted(found)


def test_every_bench_prints_its_results_through_the_helper():
    assert len(BENCHES) >= 12, [p.name for p in BENCHES]
    for path in BENCHES:
        source = path.read_text(encoding="utf-8")
        assert "from bench.result_form import" in source and "result_line(" in source, path.name
        assert "machine_line()" in source, f"{path.name} does not print the load it starts under"
    assert [line for path in BENCHES for line in hand_written_results(path)] == []


def test_the_benches_pure_result_functions_write_the_form():
    """The GPU and multi-round paths that cannot run here, fed made-up figures."""
    from bench import data_prepare, gpu_speed, spike_recovery, step_overhead

    lines = gpu_speed.result_lines("1b", "off", "none", {"mfu": 0.43, "max_allocated": 40 * 2**30, "planned_peak": 42 * 2**30,
                                                         "seq_len": 2048, "micro_batch": 8, "checkpointing": "none"})
    lines += step_overhead.gpu_result_lines("1b", {"ours_tok_s": 9000.0, "bare_tok_s": 9100.0, "paired_ratios": [1.01, 1.02],
                                                   "ours_mfu": 0.41, "bare_mfu": 0.42, "ours_ms": 200.0,
                                                   "ours_times_ms": [190.0, 200.0, 210.0]})
    measured = {"baseline": (3.0, 8_000_000, 27_000_000, 2.0), "w1": (4.0, 7_990_000, {}, 2.7), "w2": (2.5, 7_990_000, {}, 3.3)}
    lines += data_prepare.result_lines(measured, [measured, measured], 27_000_000)
    run = {"val": 2.15, "rollbacks": [{"step": 404}]}
    lines += spike_recovery.result_lines({"val": 2.14}, {"val": 2.45}, run, 0.26, [0.05, 0.06])
    parsed = [parse(line) for line in lines]
    assert [m["n"] for m in parsed] == ["1", "1", "2", "3", "2", "2", "2", "2", "1", "1", "2"]
    assert parsed[0]["ok"] == "false" and parsed[1]["ok"] == "true"  # 43% < 55%; plan / measured 1.05 in the band


@pytest.mark.slow
def test_a_real_bench_ends_with_lines_the_regex_parses(tmp_path):
    """bench/tokenizer_indentation.py: two real tokenizer builds, ~5 s."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "tokenizer_indentation.py"), "--work", str(tmp_path)],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("[machine] ")
    m = parse(lines[-1])
    assert (m["name"], m["target"], m["n"]) == ("tokenizer_indentation", "<=1tok", "1")
