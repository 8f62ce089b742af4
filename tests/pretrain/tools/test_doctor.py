"""`ayumi doctor` on this CPU machine: the report's key lines, --json, the checkpoint-size plan
check, and the failures that must turn the exit status to 1."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.tools import doctor
from pretrain.config import compose_config, to_object
from pretrain.model.flops import count_parameters
from tests.helpers import REPO, write_tiny_corpus

FAKE_DEEPSPEED = {"version": "0.0-test", "accelerator": "cpu",
                  "ops": {"cpu_adam": {"compatible": True, "prebuilt": False},
                          "async_io": {"compatible": False, "prebuilt": False}}}


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """Skip the deepspeed subprocess (~5 s) where a test is not about it."""
    monkeypatch.setattr(doctor, "deepspeed_facts", lambda: FAKE_DEEPSPEED)


@pytest.fixture
def prepared(tmp_path):
    """A data root that holds prepared shards (manifest.json and all), for runs whose data must be there."""
    return write_tiny_corpus(tmp_path / "prepared")


@pytest.fixture
def roots(tmp_path, monkeypatch):
    monkeypatch.setenv("AYUMI_DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setenv("AYUMI_RUN_ROOT", str(tmp_path / "runs"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return tmp_path


def test_report_on_this_machine_through_the_cli(roots):
    """The real thing: `python -m pretrain.tools.cli doctor` with the DeepSpeed probe subprocess."""
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "doctor"], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    import importlib.metadata

    import torch

    for expected in (f"torch            {torch.__version__}", "deepspeed        " + importlib.metadata.version("deepspeed"),
                     "CUDA build", "GPUs", "CPU", "RAM", "sentencepiece", "transformers", "datasets",
                     f"data root        {roots / 'data'}", f"run root         {roots / 'runs'}", "mode offline",
                     "ops buildable", "0 broken", "next steps:"):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    if not torch.cuda.is_available():
        assert "none: training runs on CPU" in out


def test_json_output_parses(roots, fake_deepspeed, capsys):
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    by_name = {check["name"]: check for check in report["checks"]}
    assert by_name["deepspeed"]["detail"] == "0.0-test, accelerator cpu"
    assert by_name["ops unavailable"]["detail"] == "async_io"
    assert {"torch", "CPU", "RAM", "data root", "run root", "W&B", "sentencepiece"} <= set(by_name)
    assert all(check["status"] in ("ok", "info", "warn", "FAIL") for check in report["checks"])
    assert report["next_steps"]


def test_plan_checkpoint_estimate(roots, prepared, fake_deepspeed, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "disk_free", lambda path: 1024**4)  # 1 TiB: room for a 1B run's checkpoints
    overrides = ["experiment=llama_1b_example", "checkpoint.keep_last=2", f"data.root={prepared}"]
    parameters = count_parameters(to_object(compose_config(overrides)).model)
    assert doctor.main(["--json", *overrides]) == 0
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["checkpoints"]
    # ZeRO-1 with precision auto counts the larger of bf16 (14 B) and fp32 (16 B: module + fp32 partition
    # + Adam moments); at the peak keep_last + 1 checkpoints and a recovery ring of ring_keep (3) + 2.
    gib = parameters * 16 * (3 + 5) / 1024**3
    assert check["status"] == "ok" and f"= {gib:.2f} GiB" in check["detail"], check["detail"]
    assert "x 3 + 5 in the recovery ring at peak" in check["detail"]
    assert 0.9e9 < parameters < 1.5e9


def test_plan_larger_than_the_disk_is_broken(roots, prepared, fake_deepspeed, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "disk_free", lambda path: 5 * 1024**3)  # 5 GiB left everywhere
    assert doctor.main(["experiment=llama_1b_example", f"data.root={prepared}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  checkpoints" in out and "lower checkpoint.keep_last" in out
    assert "warn  data root" in out  # under 20 GiB is flagged even without a plan


def test_online_wandb_without_a_key_is_broken(roots, fake_deepspeed, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL  W&B" in out and "mode online (from WANDB_MODE) but no API key" in out and "wandb login" in out
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert doctor.main([]) == 0
    assert "API key found" in capsys.readouterr().out


def test_bad_overrides_and_a_missing_deepspeed_are_reported(roots, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "deepspeed_facts", lambda: {"error": "No module named 'deepspeed'"})
    assert doctor.main(["train.no_such_key=1"]) == 2  # bad input: the overrides do not compose
    out = capsys.readouterr().out
    assert "FAIL  deepspeed" in out and "No module named 'deepspeed'" in out and "pip install deepspeed" in out
    assert "FAIL  config" in out and "no_such_key" in out


@pytest.mark.parametrize("make", ["nothing", "an empty folder"])
def test_a_run_whose_data_root_holds_no_data_is_broken(roots, prepared, fake_deepspeed, monkeypatch, capsys, make):
    """`ayumi doctor experiment=NAME` on a data root without prepared data: FAIL naming the folder and both fixes
    (training would refuse to start), not `ok` with its free disk."""
    monkeypatch.setattr(doctor, "disk_free", lambda path: 1024**4)
    root = roots / "shards" / "ja_en"
    if make == "an empty folder":
        root.mkdir(parents=True)
    assert doctor.main(["--json", "experiment=llama_1b_example", f"data.root={root}"]) == 1
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["data root"]
    what = "does not exist" if make == "nothing" else "holds no manifest.json (no data prepared there)"
    assert (check["status"], check["detail"]) == ("FAIL", f"{root} {what} (1024.0 GiB free on its disk)")
    assert check["fix"] == (f"write the shards there with `ayumi data prepare data=NAME data.root={root} "
                            "tokenizer_dir=DIR`, or set data.root=DIR (or AYUMI_DATA_ROOT) to where they are")
    assert doctor.main(["--json", "experiment=llama_1b_example", f"data.root={prepared}"]) == 0
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["data root"]
    assert (check["status"], check["detail"]) == ("ok", f"{prepared}: 1024.0 GiB free")


def test_without_a_run_a_missing_data_root_is_where_data_will_go(roots, fake_deepspeed, monkeypatch, capsys):
    """No experiment: the data root is AYUMI_DATA_ROOT, which `ayumi data prepare` creates; nothing is missing yet."""
    monkeypatch.setattr(doctor, "disk_free", lambda path: 1024**4)
    assert not (roots / "data").exists()
    assert doctor.main(["--json"]) == 0
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["data root"]
    assert (check["status"], check["detail"]) == ("ok", f"{roots / 'data'}: 1024.0 GiB free")
