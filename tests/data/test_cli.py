"""`ayumi data prepare|inspect` as users run them: Hydra overrides in, shards + manifest + report out."""
import json
import subprocess
import sys
from pathlib import Path

from common.status import BAD_INPUT, INTERRUPTED
from data.manifest import MANIFEST_NAME
from pretrain.tools.cli import main as ayumi
from tests.data.helpers import JA_PARAGRAPHS, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_prepare_then_inspect_in_process(tmp_path, tokenizer_dir, en_texts, capsys):
    write_jsonl(tmp_path / "en" / "a.jsonl", en_texts[:60])
    (tmp_path / "ja").mkdir()
    (tmp_path / "ja" / "a.txt").write_text("\n\n".join(JA_PARAGRAPHS + ["English only paragraph here."]), encoding="utf-8")
    root = tmp_path / "root"
    code = ayumi(["data", "prepare", "data=tiny", f"tokenizer_dir={tokenizer_dir}", f"data.root={root}", "workers=0",
                  "progress=false", f"data.domains.en.inputs=['{tmp_path}/en/*.jsonl']",
                  f"data.domains.ja.inputs=['{tmp_path}/ja/*.txt']", "data.domains.ja.val_count=1",
                  "data.domains.ja.val_fraction=0"])
    assert code == 0
    out = capsys.readouterr().out
    assert "prepared 2 domains" in out
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    assert manifest["domains"]["ja"]["dropped"] == {"low_script_share": 1}
    assert manifest["domains"]["ja"]["splits"]["val"]["docs"] == 1
    assert ayumi(["data", "inspect", str(root), "--samples", "1"]) == 0
    report = capsys.readouterr().out
    rows = {line.split()[0] for line in report.splitlines() if line.strip()}
    assert {"ja", "en"} <= rows and "overlap check: passed" in report  # a table row per domain
    assert "low_script_share=1" in report
    assert "⟨eos⟩" in report and any(paragraph[:10] in report for paragraph in JA_PARAGRAPHS), report


def test_prepare_errors_are_one_clear_line(tmp_path, tokenizer_dir, capsys):
    code = ayumi(["data", "prepare", f"tokenizer_dir={tokenizer_dir}", f"data.root={tmp_path}/r", "progress=false",
                  f"data.domains.en.inputs=['{tmp_path}/missing/*.jsonl']", f"data.domains.ja.inputs=['{tmp_path}/x']"])
    assert code == BAD_INPUT
    err = capsys.readouterr().err
    assert "error: data.domains.en.inputs" in err and "Traceback" not in err
    assert ayumi(["data", "prepare", "bogus=1"]) == BAD_INPUT
    assert "bogus" in capsys.readouterr().err
    assert ayumi(["data", "prepare", "--cfg", "all"]) == BAD_INPUT
    assert capsys.readouterr().err.strip() == "ayumi data prepare: error: only `--cfg job` is supported"
    assert ayumi(["data", "inspect", str(tmp_path / "nothing")]) == BAD_INPUT
    assert "ayumi data prepare" in capsys.readouterr().err
    assert ayumi(["data", "verify", str(tmp_path / "nothing")]) == BAD_INPUT  # not a data root: nothing verified
    assert "ayumi data verify: error:" in capsys.readouterr().err


def test_cfg_job_and_worker_processes_through_the_real_command(tmp_path, tokenizer_dir, en_texts):
    """The console command in a fresh process, with 2 worker processes, as a user runs it."""
    write_jsonl(tmp_path / "en" / "a.jsonl", en_texts[:80])
    write_jsonl(tmp_path / "ja" / "a.jsonl", JA_PARAGRAPHS)
    args = [sys.executable, "-m", "pretrain.tools.cli", "data", "prepare", f"tokenizer_dir={tokenizer_dir}",
            f"data.root={tmp_path}/root", "workers=2", f"data.domains.en.inputs=['{tmp_path}/en/*.jsonl']",
            f"data.domains.ja.inputs=['{tmp_path}/ja/*.jsonl']", "data.domains.ja.text_unit=line"]
    shown = subprocess.run(args + ["--cfg", "job"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and f"root: {tmp_path}/root" in shown.stdout and "workers: 2" in shown.stdout
    assert not (tmp_path / "root").exists()
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "docs/s" in done.stderr  # the progress bar
    assert (tmp_path / "root" / MANIFEST_NAME).is_file()


def test_a_bad_override_says_why_and_a_site_conf_dir_is_honoured(tmp_path):
    # One composition path for every command: the reason behind Hydra's outer message is shown,
    # and AYUMI_CONF_DIR is read by `ayumi data` as by training.
    import os

    bad = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "data", "prepare", "workers=abc", "tokenizer_dir=x"],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == BAD_INPUT and "workers" in bad.stderr and "could not be converted to Integer" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "data", "prepare", "tokenizer_dir=x"], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "AYUMI_CONF_DIR": str(tmp_path / "none")})
    assert missing.returncode == BAD_INPUT and str(tmp_path / "none") in missing.stderr


def test_ctrl_c_with_worker_processes_stops_cleanly(tmp_path, tokenizer_dir, en_texts):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-run: exit 130 with
    the message, no manifest, nothing half-written, and no worker left behind."""
    import os
    import signal
    import time

    # ~100 MB of distinct documents: ~7 s of work on 2 cores, so the signal lands mid-stream even when
    # a busy machine delays this test's reading of the log line (with ~50 MB a loaded run once finished
    # first). The interrupted run stops at once, so the size costs only the file's writing.
    texts = [f"{i} {text}" for i in range(400) for text in en_texts]
    write_jsonl(tmp_path / "en" / "a.jsonl", texts)
    root = tmp_path / "root"
    args = [sys.executable, "-m", "pretrain.tools.cli", "data", "prepare", f"tokenizer_dir={tokenizer_dir}", f"data.root={root}",
            "workers=2", "progress=false", "chunk_mb=0.25", f"data.domains.en.inputs=['{tmp_path}/en/*.jsonl']",
            "~data.domains.ja"]
    # Ctrl-C reaches a command whose SIGINT is at its default, as in a terminal: the suite itself may run with
    # SIGINT ignored (started in the background), and a child would inherit that and never see the signal.
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stderr:  # the domain's writer opens when its first chunk comes back from a worker
        if "en: 1 input files" in line:
            break
    time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == INTERRUPTED == 130 and "interrupted" in err, err
    assert not (root / MANIFEST_NAME).exists() and not (root / "en").exists()
    assert not list(root.rglob("*.tmp")) and not (root / ".partial" / "en").exists()
    deadline = time.time() + 5
    while time.time() < deadline:  # the group is empty once every worker has gone
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("worker processes outlived the interrupted run")


def test_a_misspelt_key_gets_one_line_with_did_you_mean(capsys):
    """Issue 39, item 2: `ayumi data prepare` gave Hydra's raw five lines for a typo; now one line as `train` gives
    it, inside a domain too (its keys are DomainConfig's)."""
    cases = {
        "data.rot=x": "ayumi data prepare: error: data.rot=x: data has no key 'rot'; did you mean data.root?",
        "data.domains.en.val_fration=0.1": "ayumi data prepare: error: data.domains.en.val_fration=0.1: "
                                           "data.domains.en has no key 'val_fration'; did you mean "
                                           "data.domains.en.val_fraction?",
        "data=tny": "ayumi data prepare: error: data=tny: no such option in conf/data/; choose one of demo, ja_en, "
                    "ja_en_math_code, megatron, tiny",
    }
    for override, line in cases.items():
        capsys.readouterr()
        preset = [] if override.startswith("data=") else ["data=tiny"]
        assert ayumi(["data", "prepare", *preset, override, "--cfg", "job"]) == BAD_INPUT
        assert capsys.readouterr().err.splitlines() == [line]


def test_val_count_alone_holds_out_documents_and_a_run_without_them_is_named(tmp_path, tokenizer_dir, en_texts, capsys):
    """Issue 48, papercut 3: data=ja_en's val_fraction=0.001 holds out none of a small corpus, and
    data.domains.NAME.val_count=N was refused ("not both") unless the fraction was also set to 0. val_count alone now
    works; validation_notice (for `ayumi plan` and `ayumi train`) says when a run would have no validation loss."""
    from data.domains import validation_notice

    write_jsonl(tmp_path / "en" / "a.jsonl", en_texts[:60])
    rotations = [JA_PARAGRAPHS[i:] + JA_PARAGRAPHS[:i] for i in range(len(JA_PARAGRAPHS))]
    write_jsonl(tmp_path / "ja" / "a.jsonl", ["".join(paragraphs) for paragraphs in rotations])  # past min_chars
    common = ["data", "prepare", "data=ja_en", f"tokenizer_dir={tokenizer_dir}", "workers=0", "progress=false",
              f"data.domains.en.inputs=['{tmp_path}/en/*.jsonl']", f"data.domains.ja.inputs=['{tmp_path}/ja/*.jsonl']"]
    roots = {}
    for name, extra in {"none": [], "en": ["data.domains.en.val_count=5"],
                        "both": ["data.domains.en.val_count=5", "data.domains.ja.val_count=2"]}.items():
        roots[name] = tmp_path / name
        assert ayumi([*common, f"data.root={roots[name]}", *extra]) == 0, capsys.readouterr().err
    splits = json.loads((roots["en"] / MANIFEST_NAME).read_text())["domains"]["en"]["splits"]
    assert splits["val"]["docs"] == 5
    fix = "to get one, prepare the data again with data.domains.NAME.val_count=N"
    none = validation_notice(roots["none"], [])
    assert none.startswith(f"no validation loss: no domain of {roots['none']} has a validation split (en, ja); {fix}")
    assert validation_notice(roots["en"], []).startswith(
        f"validation loss on en only: ja of {roots['en']} has no validation split; {fix}")
    assert validation_notice(roots["en"], ["en"]) is None  # a run on en alone has its validation loss
    assert validation_notice(roots["both"], []) is None
    assert validation_notice(roots["both"], [], validation=False) == "no validation loss: data.validation=false"
    capsys.readouterr()
    plan = ["plan", "experiment=cpu_tiny", f"data.root={roots['none']}", f"data.tokenizer_dir={tokenizer_dir}",
            f"run_root={tmp_path / 'runs'}", "logging=none"]
    assert ayumi(plan) in (0, 1)  # ok or refused (the tiny run reads this corpus many times): said either way
    assert f"ayumi plan: {none}" in capsys.readouterr().out.splitlines()
