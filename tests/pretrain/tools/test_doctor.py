"""`ayumi doctor` on this CPU machine: the report's key lines, --json, the checkpoint-size plan
check, and the failures that must turn the exit status to 1."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from curriculum.plan import human_bytes
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
    cfg = to_object(compose_config(overrides))
    parameters = count_parameters(cfg.model)
    assert doctor.main(["--json", *overrides]) == 0
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["checkpoints"]
    # ZeRO-1, precision auto planned as bf16: 14 bytes a parameter (module + fp32 partition + Adam moments); at the
    # peak keep_last + 1 = 3 checkpoints and a recovery ring of ring_keep (3) + 2; 24,415 steps save 24 times.
    assert (cfg.deepspeed.zero_stage, cfg.deepspeed.precision) == (1, "auto") and parameters == 1_174_497_280
    each, needed = human_bytes(parameters * 14), human_bytes(parameters * 14 * (3 + 5))
    assert check["status"] == "ok" and check["fix"] == ""
    assert check["detail"] == (f"llama_1b_example: 1,174,497,280 parameters; 24 saves (+ up to 5 in the recovery "
                               f"ring) x {each} each; {needed} more needed at peak, 1.0 TiB free at {cfg.checkpoint.dir}")


def test_doctor_and_plan_count_the_same_checkpoint_disk_and_precision(roots, fake_deepspeed, monkeypatch, capsys):
    """`ayumi doctor` and `ayumi plan` on the same run print the same checkpoint line, from one rule, and the disk
    plan counts `auto` in the precision the memory plan does (bf16: the plan is for the GPUs)."""
    from curriculum.plan import BYTES_PER_PARAM, checkpoint_shape, planned_precision
    from pretrain.plan.memory import memory_shape
    from pretrain.tools import plan as plan_cli

    free = 3 * 1024**4
    monkeypatch.setattr(doctor, "disk_free", lambda path: free)
    overrides = ["experiment=llama_1b_example"]
    assert doctor.main(["--json", *overrides]) == 1  # its data root is missing here: a FAIL of its own
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert plan_cli.main([*overrides, f"--free-bytes={free}"]) == 1  # refused for the data alone
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("checkpoints: "))
    assert checks["checkpoints"]["detail"] == "llama_1b_example: 1,174,497,280 parameters; " + line[len("checkpoints: "):]
    cfg = to_object(compose_config(overrides))
    assert cfg.deepspeed.precision == "auto" and memory_shape(cfg, 8).precision == planned_precision("auto") == "bf16"
    assert checkpoint_shape(cfg, 1000).size == 1000 * BYTES_PER_PARAM[(1, "bf16")] == 14_000


def test_the_help_and_the_docs_quote_the_checkpoint_disk_rule(capsys):
    from curriculum.plan import DISK_RULE

    with pytest.raises(SystemExit):
        doctor.main(["--help"])
    flat = lambda text: " ".join(text.split())  # noqa: E731
    assert flat(DISK_RULE) in flat(capsys.readouterr().out)
    assert flat(DISK_RULE) in flat((REPO / "docs" / "multinode.md").read_text())


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
