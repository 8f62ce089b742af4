"""`ayumi train` exits with what the ranks decided, through the real entry (`python -m pretrain.tools.cli train`).

A `model.init_from` folder whose tensors disagree with its config.json is refused by the launching process from
the safetensors headers (no rank, no torch); a refusal only the ranks can make (a shard whose bytes changed, a token
id outside the vocabulary read mid-run) ends the job with status 2, not torchrun's 1, and the ranks' one line is
repeated last, below torchrun's report of its failed children.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, tiny_overrides, write_tiny_corpus
from tests.pretrain.model.test_hf_import import save_random_llama
from tests.pretrain.tools.test_train_config_errors import ayumi_train, imported, messages

SHORT = ["train.max_steps=4", "train.eval_interval=0", "checkpoint.save_final=false"]


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("sharded, change, problem", [
    (False, {"num_hidden_layers": 3}, "tensors missing from its safetensors: model.layers.2."),
    (True, {"intermediate_size": 192}, "model.layers.0.mlp.gate_proj.weight has shape (176, 64), the model needs (192, 64)"),
])
def test_init_from_tensors_that_disagree_with_its_config_are_refused_before_any_rank_starts(tmp_path, sharded, change,
                                                                                             problem):
    """config.json says one shape, the safetensors hold another (one file, or shards listed by an index)."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    base = tmp_path / "base"
    save_random_llama(base, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (base / "model.safetensors.index.json").is_file() == sharded
    edit_config(base, **change)
    proc = ayumi_train(tmp_path, *tiny_overrides(corpus, tmp_path / "runs", f"model.init_from={base}", *SHORT),
                       importtime=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = messages(proc.stderr)
    assert line.startswith(f"ayumi train: model.init_from={base}: ") and problem in line, line
    assert proc.stdout == "" and not (tmp_path / "runs").exists()  # no "+ torchrun" line: no rank started
    assert not {"torch", "deepspeed", "safetensors"} & imported(proc.stderr)  # the headers, read as bytes


@pytest.mark.slow
def test_a_folder_that_fits_passes_the_check_and_trains(tmp_path):
    """The other side of the check: shards listed by an index, a tied (absent) lm_head and a vocabulary grown to
    576 rows (the folder's 512 and padding) are all accepted, and the ranks train from the folder."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    base = tmp_path / "base"
    save_random_llama(base, tie=True, max_shard_size="100KB")
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", f"model.init_from={base}", "model.vocab_size=576",
                                          "deepspeed.precision=fp32", "train.max_steps=1", "train.eval_interval=0"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "latest").read_text().strip() == "step_0000001"


def ayumi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)


def overwrite_tokens(bin_path: Path, value: int, indices) -> None:
    raw = bytearray(bin_path.read_bytes())
    for index in indices:
        raw[2 * index:2 * index + 2] = value.to_bytes(2, "little")  # vocabulary 512: uint16 ids
    bin_path.write_bytes(bytes(raw))


def ranks_said(stderr: str) -> list[str]:
    return [line.removeprefix("pretrain.train: ") for line in stderr.splitlines() if line.startswith("pretrain.train: ")]


@pytest.mark.slow
@pytest.mark.parametrize("damage, extra, said", [
    # A valid id in place of another: only the checksum every rank computes at start can tell (all ranks refuse).
    ((511, [100]), [], "is not the recorded"),
    # Ids outside the vocabulary with checksums off: the rank that reads one stops alone, mid-run.
    ((4000, range(0, 2000, 50)), ["data.verify=sizes"], "outside the vocabulary [0, 512)"),
])
def test_a_refusal_inside_the_ranks_ends_ayumi_train_with_status_2_and_its_line_last(tmp_path, damage, extra, said):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    bin_path = corpus / "en" / "train" / "part_00000.bin"
    overwrite_tokens(bin_path, *damage)  # after `ayumi data prepare`: its sizes and records still agree
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", *SHORT, *extra))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("+ ") and "torchrun" in proc.stdout.splitlines()[0]  # the ranks did start
    [line] = ranks_said(proc.stderr)
    assert str(bin_path) in line and said in line, proc.stderr[-3000:]
    assert proc.stderr.rstrip("\n").splitlines()[-1] == f"ayumi train: {line}"  # below torchrun's report


def test_without_ayumi_train_the_ranks_leave_no_status_file(tmp_path, monkeypatch):
    """A raw torchrun or a scheduler's script sets no status folder: record_exit writes nothing anywhere."""
    from pretrain.job.exit_status import STATUS_DIR_ENV, agreed_exit, read_exits, record_exit

    monkeypatch.delenv(STATUS_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_exit(2, "a message")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    record_exit(0)  # a clean exit says nothing
    record_exit(2, "the disk at /x is full")
    monkeypatch.setenv("RANK", "0")
    record_exit(2)  # a rank that followed: the status, no message
    assert sorted(os.listdir(tmp_path)) == ["rank_00000.json", "rank_00001.json"]
    assert agreed_exit(read_exits(tmp_path)) == (2, ["the disk at /x is full"])


def test_a_hang_recorded_first_ends_the_job_with_status_4_whatever_a_rank_says_after(tmp_path, capsys):
    """As in a drill that stopped rank 1 inside a checkpoint save: rank 0's watchdog records the hang (4) and writes
    its report; rank 1, resumed to dump its stack, then fails its save on the connection rank 0 closed and records
    2; torchrun reports 1. `ayumi train` (run_job, with a stand-in for the launcher) returns 4 and says why."""
    from pretrain.tools.launch import run_job

    run_dir = tmp_path / "run"
    launcher = f"""
import os, time
from pathlib import Path
from pretrain.job.exit_status import record_exit
os.environ["RANK"] = "0"
record_exit(4)
(Path({str(run_dir)!r}) / "hang").mkdir(parents=True)
(Path({str(run_dir)!r}) / "hang" / "report.txt").write_text("did not arrive: rank 1\\n")
time.sleep(0.01)
os.environ["RANK"] = "1"
record_exit(2, "saving step_0000040 failed on rank 1: Connection reset by peer")
raise SystemExit(1)
"""
    status = run_job([sys.executable, "-c", launcher], {**cpu_env(), "PYTHONPATH": str(REPO)}, str(run_dir))
    assert status == 4
    err = capsys.readouterr().err
    assert f"ayumi train: the job hung and was ended by the watchdog (exit status 4); report: {run_dir / 'hang' / 'report.txt'}" in err
    assert "Connection reset" not in err
