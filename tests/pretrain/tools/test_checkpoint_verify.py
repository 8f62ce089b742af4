"""`ayumi checkpoint verify`: the table, the exit statuses, and no DeepSpeed (the real runs of each ZeRO stage are checked
in tests/pretrain/checkpoint/test_checkpoint_trust_cpu.py)."""
import json
import subprocess
import sys
import textwrap

import pytest

from common.status import BAD_INPUT, DONE, REFUSED
from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import META, Checkpointer, tag_for
from pretrain.tools.cli import main
from tests.helpers import REPO

MODEL = "mp_rank_00_model_states.pt"


class Engine:
    def save(self, root, tag, client_state, collector=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        collector.save({"weights": list(range(512))}, str(root / tag / MODEL))


@pytest.fixture
def run_dir(tmp_path):
    """A run dir with checkpoints 10 (no checksums), 20 (damaged), 30 (intact), a ring checkpoint 25, a folder set
    aside as damaged and an unfinished save."""
    run = tmp_path / "run"
    saver = Checkpointer(run / "checkpoints", keep_last=0, rank=0, barrier=lambda: None)
    for step in (10, 20, 30):
        saver.save(Engine(), step, {"train": {}}, {})
    saver.sibling(run / "checkpoints" / "recovery", keep_last=0).save(Engine(), 25, {}, {})
    meta = json.loads((run / "checkpoints" / tag_for(10) / META).read_text())
    del meta[integrity.RECORD_KEY]
    (run / "checkpoints" / tag_for(10) / META).write_text(json.dumps(meta))
    data = bytearray((run / "checkpoints" / tag_for(20) / MODEL).read_bytes())
    data[100] ^= 1
    (run / "checkpoints" / tag_for(20) / MODEL).write_bytes(bytes(data))
    (run / "checkpoints" / "step_0000015.corrupt").mkdir()
    (run / "checkpoints" / "step_0000040").mkdir()
    return run


def test_a_run_is_checked_checkpoint_by_checkpoint_and_a_damaged_one_says_no(run_dir, capsys):
    assert main(["checkpoint", "verify", str(run_dir)]) == REFUSED
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(None, 3) for line in lines[1:-1]]
    assert [row[:3] for row in rows] == [
        ["checkpoints/step_0000010", "10", "-"], ["checkpoints/step_0000015.corrupt", "15", "-"],
        ["checkpoints/step_0000020", "20", "3"], ["checkpoints/recovery/step_0000025", "25", "3"],
        ["checkpoints/step_0000030", "30", "3"], ["checkpoints/step_0000040", "40", "-"]]
    assert [row[3] for row in rows] == [
        "unverifiable: no checksums (saved before ayumi recorded them)",
        "set aside: a run found it damaged; never loaded again",
        f"damaged: {MODEL} does not match the xxh3_128 checksum recorded at save",
        "verified", "verified", "incomplete: no ayumi.json: a save that did not finish; never loaded"]
    assert lines[-1].startswith("6 checkpoint folder(s): 2 verified, 1 damaged, 1 unverifiable, 1 set aside, "
                                "1 incomplete (")


def test_one_checkpoint_and_a_run_without_damage_pass(run_dir, capsys):
    assert main(["checkpoint", "verify", str(run_dir / "checkpoints" / tag_for(30))]) == DONE
    assert capsys.readouterr().out.splitlines()[1].split() == [tag_for(30), "30", "3", "verified"]
    (run_dir / "checkpoints" / tag_for(20)).rename(run_dir / "checkpoints" / "step_0000020.corrupt")
    assert main(["checkpoint", "verify", str(run_dir / "checkpoints")]) == DONE  # what a fallback resume leaves


@pytest.mark.parametrize("path", ["missing", "empty", "file"])
def test_a_path_without_checkpoints_is_one_line_and_status_2(tmp_path, capsys, path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    assert main(["checkpoint", "verify", str(tmp_path / path)]) == BAD_INPUT
    err = capsys.readouterr().err
    assert err == (f"ayumi checkpoint verify: no ayumi checkpoint at {tmp_path / path}: give a run dir, its "
                   "checkpoints/ folder, or a step_XXXXXXX folder\n")


def test_it_needs_no_deepspeed(run_dir):
    """torch, yes: each file's pickle is read through torch's own zip reader, the one torch.load reads it with
    (issue 49: Python's zipfile can be shown another pickle than torch reads)."""
    child = textwrap.dedent(f"""
        import sys
        from pretrain.tools.cli import main
        code = main(["checkpoint", "verify", {str(run_dir)!r}])
        print("CODE", code, "torch" in sys.modules, "deepspeed" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] == "CODE 1 True False", proc.stdout + proc.stderr
