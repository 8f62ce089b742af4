"""`ayumi doctor` on this CPU machine: the report's rows (status, detail, fix), --json, the checkpoint-disk
and data-root checks of a run, and the failures that turn the exit status to 1 (a blocking problem) or 2
(overrides that do not compose)."""
from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
import time

import pytest

from curriculum.plan import existing_parent, human_bytes
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


ROW = re.compile(r"^  (ok|info|warn|FAIL)\s+(\S+(?: \S+)*?)  +(\S.*)$")
"""A row of the table: `  STATUS  NAME  DETAIL` (names hold single spaces, the columns two or more)."""

OFFLINE = "mode offline (from ayumi's default): runs log under RUN_DIR/wandb; `wandb sync` uploads them later"


def table_rows(out: str) -> dict[str, tuple[str, str]]:
    """{name: (status, detail)} of the printed table."""
    return {m[2]: (m[1], m[3]) for m in map(ROW.match, out.splitlines()) if m}


def json_checks(capsys) -> dict[str, tuple[str, str, str]]:
    """{name: (status, detail, fix)} of the JSON report just printed."""
    return {c["name"]: (c["status"], c["detail"], c["fix"]) for c in json.loads(capsys.readouterr().out)["checks"]}


def disk_status(path) -> str:
    """What a root's row says about its disk here: warn under doctor's LOW_DISK_GIB, else ok."""
    return "warn" if shutil.disk_usage(existing_parent(path)).free < doctor.LOW_DISK_GIB * 1024**3 else "ok"


def test_report_on_this_machine_through_the_cli(roots):
    """The real thing: `python -m pretrain.tools.cli doctor` with the DeepSpeed probe subprocess."""
    import torch

    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "doctor"], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["python"] == ("ok", f"{platform.python_version()} ({sys.executable})")
    assert rows["torch"] == ("ok", torch.__version__)
    deepspeed = importlib.metadata.version("deepspeed")
    assert rows["deepspeed"][0] == "ok" and rows["deepspeed"][1].startswith(f"{deepspeed}, accelerator ")
    for name in doctor.LIBRARIES:
        assert rows[name] == ("ok", importlib.metadata.version(name)), name
    for name, root in (("data root", roots / "data"), ("run root", roots / "runs")):
        status, detail = rows[name]
        assert status == disk_status(root) and re.fullmatch(rf"{re.escape(str(root))}: [\d.]+ GiB free", detail), rows[name]
    assert rows["W&B"] == ("ok", OFFLINE)
    if not torch.cuda.is_available():
        cpu = "none: training runs on CPU (DS_ACCELERATOR=cpu, gloo), fine for the demo and tests"
        assert rows["GPUs"] == ("warn" if torch.version.cuda else "info", cpu)
    statuses = [status for status, _ in rows.values()]
    assert "FAIL" not in statuses
    assert f"\n0 broken, {statuses.count('warn')} warning(s)\nnext steps:\n" in proc.stdout


def test_json_output_parses(roots, fake_deepspeed, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "disk_free", lambda path: 1024**4)
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and all(check["status"] in ("ok", "info", "warn") for check in report["checks"])
    rows = {c["name"]: (c["status"], c["detail"], c["fix"]) for c in report["checks"]}
    assert rows["deepspeed"] == ("ok", "0.0-test, accelerator cpu", "")
    assert rows["ops prebuilt"] == ("info", "none (ops compile on first use)", "")
    assert rows["ops buildable"] == ("info", "cpu_adam", "")
    assert rows["ops unavailable"] == ("info", "async_io", "")
    assert rows["data root"] == ("ok", f"{roots / 'data'}: 1024.0 GiB free", "")
    assert rows["run root"] == ("ok", f"{roots / 'runs'}: 1024.0 GiB free", "")
    assert rows["W&B"] == ("ok", OFFLINE, "")
    assert "checkpoints" not in rows and "memory" not in rows  # no run given: nothing of a plan
    assert report["next_steps"][-2:] == [
        "ready: `ayumi demo` runs the whole pipeline on real text; `ayumi train experiment=NAME` trains",
        "`ayumi doctor experiment=NAME` also checks that run's checkpoint size against the free disk"]


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
    rows = table_rows(out)
    each = human_bytes(1_174_497_280 * 14)
    problem = (f"checkpoints need {human_bytes(9 * 1_174_497_280 * 14)} more on {roots} (9 x {each} at peak with "
               "checkpoint.keep_last=3 and 5 recovery-ring checkpoints) but only 5.0 GiB is free; free space, lower "
               "checkpoint.keep_last or stability.recovery.ring_keep, or point checkpoint.dir at a larger disk")
    assert rows["checkpoints"][0] == "FAIL" and f"-> {problem}" in out
    assert rows["data root"] == ("warn", f"{prepared}: 5.0 GiB free")  # under 20 GiB is flagged even when it fits
    assert "-> under 20 GiB free: point it at a larger disk" in out
    assert rows["run root"][0] == "warn"  # both roots are on the same small disk
    warned = [status for status, _ in rows.values()].count("warn")
    assert f"\n1 broken, {warned} warning(s)\n" in out  # broken: the checkpoints alone
    assert f"  - checkpoints: {problem}" in out  # repeated as a next step


def test_online_wandb_without_a_key_is_broken(roots, fake_deepspeed, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "disk_free", lambda path: 1024**4)
    monkeypatch.setenv("WANDB_MODE", "online")
    assert doctor.main(["--json"]) == 1
    assert json_checks(capsys)["W&B"] == ("FAIL", "mode online (from WANDB_MODE) but no API key", "`wandb login` or "
                                          "export WANDB_API_KEY=...; or WANDB_MODE=offline and `wandb sync` later")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert doctor.main(["--json"]) == 0
    assert json_checks(capsys)["W&B"] == ("ok", "mode online (from WANDB_MODE), API key found", "")


def test_bad_overrides_and_a_missing_deepspeed_are_reported(roots, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "deepspeed_facts", lambda: {"error": "No module named 'deepspeed'"})
    assert doctor.main(["--json", "train.no_such_key=1"]) == 2  # bad input: the overrides do not compose
    rows = json_checks(capsys)
    assert rows["deepspeed"] == ("FAIL", "cannot import deepspeed: No module named 'deepspeed'",
                                 "pip install deepspeed into this venv; `ds_report` shows the details")
    status, detail, fix = rows["config"]
    assert status == "FAIL" and detail.startswith("train.no_such_key=1: train has no key 'no_such_key'; known keys: ")
    assert fix == "fix the overrides (`ayumi train --cfg job ...` prints the resolved config)"
    assert "checkpoints" not in rows and "memory" not in rows  # no config: no plan to check


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


@pytest.mark.slow
@pytest.mark.parametrize("simulated", [False, True], ids=["host", "avx2"])
def test_refresh_precision_replaces_an_old_measurement(roots, simulated):
    """The real `python -m pretrain.tools.cli doctor`, the cache under tmp_path: an entry measured on a busy day
    (bf16 20x slower in every pair) is shown with its date, and `--refresh-precision` measures again: a new
    date and new ratios in the file, and in the precision row."""
    from pretrain.engine.precision import MEASURE_PAIRS, MEASUREMENT_METHOD
    from tests.pretrain.engine.test_precision import AVX2_ONLY, WHEN, child_env, host_has_bf16, write_cache_entry

    env = AVX2_ONLY if simulated else {}
    old = {"method": MEASUREMENT_METHOD, "ratios": [20.0] * MEASURE_PAIRS, "slowdown": 20.0, "measured_at": WHEN}
    path = write_cache_entry(roots, old, **env)

    def precision_row(*flags: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "doctor", "--json", *flags], cwd=REPO,
                              env=child_env(roots, **env), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return {check["name"]: check for check in json.loads(proc.stdout)["checks"]}["precision"]

    cached = precision_row()
    assert cached["detail"].startswith("fp32 ") and f"measured {WHEN})" in cached["detail"], cached
    if host_has_bf16() and not simulated:  # native bf16 vetoed by that measurement: a warning says what to do
        assert cached["status"] == "warn" and "--refresh-precision" in cached["fix"]
    assert list(json.loads(path.read_text()).values()) == [old]  # read, not replaced

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    refreshed = precision_row("--refresh-precision")
    [entry] = json.loads(path.read_text()).values()
    assert entry["method"] == MEASUREMENT_METHOD and entry["measured_at"] >= started
    assert len(entry["ratios"]) == MEASURE_PAIRS and entry["ratios"] != old["ratios"]
    assert f"measured {entry['measured_at']})" in refreshed["detail"] and WHEN not in refreshed["detail"]
    expected = "bf16" if host_has_bf16() and not simulated else "fp32"
    assert refreshed["detail"].startswith(f"{expected} (deepspeed.precision=auto: ") and refreshed["status"] == "ok"
