"""Every `ayumi` command and verb answers -h/--help: its usage and the config it reads, exit 0, nothing started.

All commands run in one child process (through pretrain.tools.cli.main, the `ayumi` entry point), so
the test can also see that no command imported DeepSpeed or wrote anything; two more go through
the real executables (`ayumi tokenizer build --help`, where Hydra used to fail on `--help`, and
`python -m pretrain.train --help`, which answers before importing torch and DeepSpeed).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.conf import config_fields
from common.status import BAD_INPUT, DONE, EXIT_STATUSES, HANG, INTERRUPTED, REFUSED, STABILITY_STOP
from data.config import DataPrepareConfig, DomainConfig
from pretrain.config import EXIT_CONFIG_ERROR, AyumiConfig
from pretrain.job.hang_watchdog import EXIT_HANG
from pretrain.tools.cli import COMMANDS, OVERRIDE_COMMANDS, main, usage
from tests.helpers import REPO
from tokenizer.config import TokenizerBuildConfig

NO_CONF = "config: reads no config from conf/"
# (argv, what the help must say about the config it reads)
CASES: list[tuple[list[str], str]] = [
    (["train"], "config: reads conf/config.yaml + experiment=NAME from conf/experiment/"),
    (["demo"], "config: reads conf/experiment/demo.yaml (training), conf/tokenizer/demo_8k.yaml"),
    (["demo", "corpus"], NO_CONF),
    (["export"], NO_CONF + ": the checkpoint's ayumi.json"),
    (["export", "hf"], NO_CONF + ": the checkpoint's ayumi.json"),
    (["checkpoint"], NO_CONF + ": each checkpoint's ayumi.json (the checksums recorded at save)"),
    (["checkpoint", "verify"], NO_CONF + ": each checkpoint's ayumi.json (the checksums recorded at save)"),
    (["checkpoint", "convert"], NO_CONF + ": each checkpoint's ayumi.json (its checksums) and the files it names"),
    (["tokenizer"], "conf/tokenizer_build.yaml"),
    (["tokenizer", "build"], "config: reads conf/tokenizer_build.yaml + tokenizer=NAME from conf/tokenizer/"),
    (["tokenizer", "sweep"], "config: reads conf/tokenizer_build.yaml + tokenizer=NAME from conf/tokenizer/"),
    (["tokenizer", "eval"], NO_CONF),
    (["tokenizer", "export"], NO_CONF),
    (["tokenizer", "expand"], NO_CONF),
    (["data"], "config: prepare reads conf/data_prepare.yaml + data=NAME from conf/data/"),
    (["data", "prepare"], "config: reads conf/data_prepare.yaml + data=NAME from conf/data/"),
    (["data", "inspect"], NO_CONF + ": DATA_ROOT's manifest.json"),
    (["plan"], "config: reads conf/config.yaml + experiment=NAME from conf/experiment/"),
    (["report"], NO_CONF + ": RUN_DIR's metrics.jsonl"),
    (["batch"], NO_CONF + ": RUN_DIR's config_history.jsonl"),
    (["replay"], NO_CONF + ": RUN_DIR's events.jsonl"),
    (["eval"], "config: reads eval.downstream from the run's config.yaml"),
    (["doctor"], "config: reads conf/config.yaml + experiment=NAME from conf/experiment/"),
]
# Overrides given before the flag must not be composed (Hydra would read `--help` as an override).
WITH_OVERRIDES = [["train", "experiment=cpu_tiny", "optim.lr=-1"], ["tokenizer", "build", "tokenizer=tiny"],
                  ["data", "prepare", "data=tiny"], ["plan", "experiment=cpu_tiny"], ["doctor", "experiment=cpu_tiny"]]

CHILD = textwrap.dedent("""
    import contextlib, io, json, sys
    from pretrain.tools.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(argv)
            except SystemExit as stop:  # argparse's --help
                code = stop.code
        results.append({"argv": argv, "code": code, "out": out.getvalue()})
    print(json.dumps({"results": results, "deepspeed": "deepspeed" in sys.modules}))
""")


def child_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "AYUMI_RUN_ROOT": str(tmp_path / "runs"), "AYUMI_DATA_ROOT": str(tmp_path / "data")}


@pytest.fixture(scope="module")
def helped(tmp_path_factory):
    """{(argv..., flag): (exit code, output)} for every case, from one child process; checks nothing was started."""
    tmp_path = tmp_path_factory.mktemp("help")
    argvs = [[*argv, flag] for argv, _ in CASES for flag in ("-h", "--help")]
    argvs += [[*argv, "--help"] for argv in WITH_OVERRIDES]
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs)], cwd=tmp_path, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert not report["deepspeed"], "a command imported DeepSpeed to answer --help"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a command wrote files (run dir, data, cache)"
    return {tuple(r["argv"]): (r["code"], r["out"]) for r in report["results"]}


def test_every_command_is_covered():
    assert {argv[0] for argv, _ in CASES} == set(COMMANDS)


@pytest.mark.parametrize("flag", ["-h", "--help"])
@pytest.mark.parametrize("argv,config", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_help_names_the_command_and_its_config(helped, argv, config, flag):
    code, out = helped[(*argv, flag)]
    assert code == 0, out
    assert f"usage: ayumi {' '.join(argv)}" in out, out
    assert config in " ".join(out.split()), out  # argparse re-wraps the epilog: compare with single spaces


@pytest.mark.parametrize("argv", WITH_OVERRIDES, ids=[" ".join(argv) for argv in WITH_OVERRIDES])
def test_help_after_overrides_composes_nothing(helped, argv):
    code, out = helped[(*argv, "--help")]
    assert code == 0 and "usage: ayumi " + argv[0] in out and "config: reads" in out, out
    assert "LexerNoViableAlt" not in out and "must be > 0" not in out


def test_eval_help_says_one_checkpoint_never_replaces_the_curve(helped):
    """Issue 39 B3: the help said the JSON went to RUN_DIR/eval/downstream.json for a run, "none otherwise", while one
    checkpoint's scores replaced `--all`'s curve there."""
    text = flat(helped[("eval", "--help")][1])
    assert ("(default for a run: --all writes the curve, RUN_DIR/eval/downstream.json; one checkpoint writes "
            "RUN_DIR/eval/downstream.step_XXXXXXX.json beside it; an HF folder: none)") in text


def test_real_ayumi_executable_answers_help_for_a_hydra_verb(tmp_path):
    ayumi = Path(sys.executable).with_name("ayumi")
    cmd = [str(ayumi)] if ayumi.exists() else [sys.executable, "-m", "pretrain.tools.cli"]
    proc = subprocess.run([*cmd, "tokenizer", "build", "--help"], cwd=tmp_path, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: ayumi tokenizer build") and "conf/tokenizer_build.yaml" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_training_module_answers_help_before_importing_deepspeed(tmp_path, flag):
    """`python -m pretrain.train --help`, as under torchrun/deepspeed: usage and config, no torch or DeepSpeed."""
    child = ("import runpy, sys\nsys.argv = ['pretrain.train', %r]\ntry:\n    runpy.run_module('pretrain.train', "
             "run_name='__main__', alter_sys=True)\nexcept SystemExit as stop:\n    code = stop.code\n"
             "print('CODE', code, 'deepspeed' in sys.modules, 'torch' in sys.modules)" % flag)
    proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, env=child_env(tmp_path), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m pretrain.train") and "conf/config.yaml" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "CODE 0 False False"


def flat(text: str) -> str:
    """Text with every run of whitespace as one space: help is wrapped, the tests compare words."""
    return " ".join(text.split())


def test_top_level_help_lists_every_tokenizer_verb_and_the_exit_statuses():
    text = flat(usage())
    assert "tokenizer build | eval | sweep | export | expand: the merged SentencePiece tokenizer" in text
    for code, meaning in EXIT_STATUSES:
        assert flat(f"{code} {meaning}") in text, (code, meaning)


def test_one_exit_status_convention_in_code_help_and_readme():
    """The convention's numbers, the older names that alias them, and the README table that documents them."""
    assert (DONE, REFUSED, BAD_INPUT, STABILITY_STOP, HANG, INTERRUPTED) == (0, 1, 2, 3, 4, 130)
    assert [code for code, _ in EXIT_STATUSES] == [0, 1, 2, 3, 4, 130]
    assert EXIT_CONFIG_ERROR == BAD_INPUT and EXIT_HANG == HANG
    readme = (REPO / "README.md").read_text()
    for code, meaning in EXIT_STATUSES:
        assert f"| {code} | {meaning} |" in readme, (code, meaning)


def test_an_unknown_command_or_verb_is_bad_input(capsys):
    assert main(["trian"]) == BAD_INPUT
    assert main(["tokenizer", "bulid"]) == BAD_INPUT
    assert main(["data", "prepair"]) == BAD_INPUT
    assert "unknown command 'prepair'" in capsys.readouterr().err


# (argv, the config class its help lists, loosely typed dict entries, a field row written out by hand)
FIELD_CASES = [
    (["train"], AyumiConfig, None, "optim.lr = 0.0003 — Peak learning rate, reached at the end of warmup."),
    (["plan"], AyumiConfig, None, "checkpoint.keep_last = 3 — Keep this many newest checkpoints (older ones are "
                                  "deleted after a new one is complete); 0 = keep every one."),
    (["doctor"], AyumiConfig, None, "data.root = ${oc.env:AYUMI_DATA_ROOT,.cache}/shards/tiny — DATA_ROOT holding"),
    (["tokenizer", "build"], TokenizerBuildConfig, None,
     "tokenizer.domains.NAME.vocab_size = 8000 — The domain's share of the merged vocabulary, in pieces"),
    (["tokenizer", "sweep"], TokenizerBuildConfig, None, "tokenizer.total_vocab = 32000 — "),
    (["data", "prepare"], DataPrepareConfig, {"data.domains": DomainConfig},
     "data.domains.NAME.clean.dedup = exact — Duplicate removal within and across the domain's files"),
]


@pytest.mark.parametrize("argv,schema,entries,row", FIELD_CASES, ids=[" ".join(c[0]) for c in FIELD_CASES])
def test_help_lists_every_field_of_the_config_with_its_docstring(helped, argv, schema, entries, row):
    code, out = helped[(*argv, "--help")]
    text = flat(out)
    assert code == 0 and row in text, out[-3000:]
    fields = config_fields(schema, entries=entries)
    assert len(fields) > 25
    for name, default, doc in fields:
        assert doc, f"{name} has no docstring in its dataclass"  # the house rule: every field is documented
        shown = f"{name}.* — {doc}" if default is None else f"{name} = {default} — {doc}"
        assert flat(shown) in text, shown


@dataclass
class _Inner:
    """A section."""

    depth: int = 3
    """How deep,
    over two lines."""


@dataclass
class _Entry:
    weight: float = 0.5
    """An entry's weight."""


@dataclass
class _Outer:
    name: str = ""
    """The name."""
    undocumented: bool = False
    inner: _Inner = field(default_factory=_Inner)
    """The inner section."""
    by_name: dict[str, _Entry] = field(default_factory=dict)
    """Entries by name."""
    in_order: list[_Entry] = field(default_factory=lambda: [_Entry()])
    """Entries in order."""
    loose: dict[str, object] = field(default_factory=dict)
    """Entries the schema types loosely."""
    tags: list[str] = field(default_factory=lambda: ["a", "b"])
    """Tags."""


def test_config_fields_reads_the_docstring_under_each_field():
    assert config_fields(_Outer, entries={"loose": _Entry}) == [
        ("name", "''", "The name."),
        ("undocumented", "false", ""),
        ("inner", None, "The inner section."),
        ("inner.depth", "3", "How deep, over two lines."),
        ("by_name", "{}", "Entries by name."),
        ("by_name.NAME.weight", "0.5", "An entry's weight."),
        ("in_order", '[{"weight": 0.5}]', "Entries in order."),
        ("in_order[N].weight", "0.5", "An entry's weight."),
        ("loose", "{}", "Entries the schema types loosely."),
        ("loose.NAME.weight", "0.5", "An entry's weight."),
        ("tags", '["a", "b"]', "Tags."),
    ]


@pytest.mark.parametrize("argv", [argv for argv, _ in CASES if argv not in (["tokenizer"], ["data"])],
                         ids=[" ".join(argv) for argv, _ in CASES if argv not in (["tokenizer"], ["data"])])
def test_only_the_commands_that_compose_a_config_take_overrides(helped, argv):
    text = flat(helped[(*argv, "--help")][1])
    takes = " ".join(argv) in OVERRIDE_COMMANDS
    assert ("overrides key=value" in text) == takes and ("takes no key=value overrides" in text) == (not takes), text


def test_readme_names_the_commands_that_take_overrides():
    readme = flat((REPO / "README.md").read_text())
    start = readme.index("The commands that compose a config from `conf/` take Hydra overrides")
    sentence = readme[start:readme.index("The others", start)]
    named = re.findall(r"`ayumi ([a-z ]+)`", sentence)
    assert sorted(named) == sorted(OVERRIDE_COMMANDS)
    assert all(command in flat(usage()) for command in OVERRIDE_COMMANDS)
