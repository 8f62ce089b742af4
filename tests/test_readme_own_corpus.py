"""README's "Train on your own corpus", run verbatim: every line of its bash block goes through bash as written, in
an empty folder holding the corpus and task file the section describes, with only the venv's bin first on PATH
(as after `source .venv/bin/activate`), so the documented path from JSONL to an exported model cannot rot.

The corpus is real text, nothing downloaded: Japanese from the tokenizer tests' fixture and the opening of "I Am a
Cat" (tests/helpers.py), its phrases recombined into a few hundred documents so the sample holds enough distinct
pieces for the tiny preset's Japanese share; English from the Python standard library's docstrings."""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import EN_TEXT, JA_TEXT, REPO, read_jsonl
from tests.tokenizer.conftest import FIXTURES, stdlib_docstrings

SECTION = "## Train on your own corpus"


def readme_section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    return text[start:text.index("\n## ", start + 1)]


def readme_commands() -> list[str]:
    """The section's one bash block, a command per line once continuation lines are joined."""
    blocks = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)
    assert len(blocks) == 1, f"{SECTION} should hold exactly one bash block, found {len(blocks)}"
    lines = [line.strip() for line in blocks[0].replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def japanese_documents(count: int = 400, phrases_per_doc: int = 40) -> list[str]:
    text = (FIXTURES / "ja.txt").read_text(encoding="utf-8") + JA_TEXT
    phrases = [p for p in re.split(r"(?<=[、。はがをにでとの])", text.replace("\n", "")) if p]
    rng = random.Random(0)
    return ["".join(rng.choice(phrases) for _ in range(phrases_per_doc)) for _ in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_inputs(folder: Path) -> None:
    """What the section tells a user to put in the folder: JSONL per domain with a "text" field, a cloze task."""
    write_jsonl(folder / "corpus" / "ja" / "part-000.jsonl", [{"text": d} for d in japanese_documents()])
    write_jsonl(folder / "corpus" / "en" / "part-000.jsonl", [{"text": d} for d in stdlib_docstrings() + [EN_TEXT]])
    write_jsonl(folder / "tasks" / "cloze.jsonl", [
        {"context": "吾輩は猫で", "target": "ある。"},
        {"context": "名前はまだ", "target": "無い。"},
        {"context": "It is a truth universally", "target": " acknowledged"},
    ])


def option(commands: list[str], program: str, key: str) -> str:
    """The value of `key=` on the command that starts with `program`."""
    for command in commands:
        if command.startswith(program):
            for arg in shlex.split(command):
                if arg.startswith(key + "="):
                    return arg.split("=", 1)[1]
    raise AssertionError(f"no {key}= on a `{program}` line of {SECTION}")


def test_the_section_describes_the_layout_it_runs_on():
    section = readme_section()
    for path in ("corpus/ja/*.jsonl", "corpus/en/*.jsonl", "tasks/cloze.jsonl"):
        assert path in section, path
    assert '"text"' in section  # the JSONL field the readers take by default
    commands = readme_commands()
    assert [shlex.split(c)[:2] for c in commands] == [
        ["ayumi", "tokenizer"], ["ayumi", "data"], ["ayumi", "plan"], ["ayumi", "train"], ["ayumi", "eval"],
        ["ayumi", "report"], ["ayumi", "export"]]
    assert all(not c.startswith("./") for c in commands)  # they run from the user's folder, not the repository


@pytest.mark.slow  # a tokenizer build and a 2-rank DeepSpeed run: about half a minute on 2 cores
def test_the_own_corpus_path_runs_verbatim(tmp_path):
    commands = readme_commands()
    write_inputs(tmp_path)
    # A user's folder holds anything, folders named like ayumi's packages too (an earlier tokenizer output called
    # tokenizer/): the ranks start in this folder, and Python put it first on their import path, so `from tokenizer
    # import ...` found this folder and every rank failed (pretrain/tools/launch.py: PYTHONSAFEPATH).
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(b"an older build")
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "ayumi").exists(), f"no ayumi entry point beside {sys.executable}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("AYUMI_RUN_ROOT", "AYUMI_DATA_ROOT", "PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", WANDB_MODE="offline", WANDB_SILENT="true")
    outputs = {}
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"$ {command}\nexit {proc.returncode}\n{out[-6000:]}"
        outputs[shlex.split(command)[1]] = out

    tokenizer = tmp_path / option(commands, "ayumi tokenizer build", "output_dir")
    meta = json.loads((tokenizer / "tokenizer_meta.json").read_text())
    assert set(meta["pieces_by_domain"]) == {"ja", "en"}
    assert (tokenizer / "tokenizer.model").exists() and (tokenizer / "tokenizer.json").exists()

    shards = tmp_path / option(commands, "ayumi data prepare", "data.root")
    manifest = json.loads((shards / "manifest.json").read_text())
    assert set(manifest["domains"]) == {"ja", "en"}, manifest.keys()
    assert manifest["tokenizer"]["sha256"] == meta["sha256"]
    # a validation split in every domain (issue 48, papercut 3: data=ja_en's 0.1% held out none of this corpus)
    assert all(record["splits"]["val"]["docs"] > 0 for record in manifest["domains"].values())

    assert "plan ok" in outputs["plan"]
    # model.vocab_size is not on the lines: it follows the tokenizer, padded to 128, as the section says the plan shows
    padded = -(-meta["vocab_size"] // 128) * 128
    assert f"vocabulary: model {padded:,} (tokenizer {meta['vocab_size']:,} ids, padded to a multiple of 128)" \
        in outputs["plan"]
    assert f"{padded:,}" in readme_section()

    run = tmp_path / "runs" / option(commands, "ayumi train", "name")
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    tokens = int(option(commands, "ayumi train", "train.tokens"))
    assert steps and steps[-1] == tokens // (8 * 64)  # cpu_tiny: global batch 8 x 64 tokens
    assert any("val/loss" in r for r in read_jsonl(run / "metrics.jsonl"))  # the run has its validation loss
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["vocab_size"] == padded  # the number, not 0
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "ayumi.json").exists()

    scores = json.loads((run / "eval" / "downstream.json").read_text())["scores"]
    assert [s["step"] for s in scores] == [steps[-1]]
    assert scores[0]["tasks"]["cloze"]["n"] == 3

    assert (run / "report" / "summary.html").stat().st_size > 0 and (run / "report" / "summary.md").exists()

    export = next(c for c in commands if c.startswith("ayumi export hf"))
    hf = tmp_path / shlex.split(export)[-1]
    config = json.loads((hf / "config.json").read_text())
    assert config["vocab_size"] == padded >= meta["vocab_size"]  # what the run recorded reaches the export
    assert (hf / "model.safetensors").exists() and (hf / "tokenizer.json").exists()
    # The run keeps its own copy of its tokenizer, and its checkpoints record that copy, never a folder outside the
    # run (a path recorded in a run is read only inside it: export and eval need no --tokenizer-dir).
    recorded = json.loads((run / "checkpoints" / latest / "ayumi.json").read_text())["tokenizer_dir"]
    assert recorded == "tokenizer"  # relative to the run: a copy of the run folder elsewhere finds it too
    for name in ("tokenizer.model", "tokenizer.json"):
        assert (run / "tokenizer" / name).read_bytes() == (tokenizer / name).read_bytes() == (hf / name).read_bytes()
