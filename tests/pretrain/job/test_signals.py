"""Fault drills through the real launchers: SIGTERM reaches every rank (saved, resumed exactly), a killed
launcher leaves no rank behind, and a run dir serves one job at a time.

Each job is a real `ayumi train` (torchrun underneath) or `deepspeed` launcher process with 2 CPU ranks,
signalled the way a scheduler or a person does it: a signal to the process that was started.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, cpu_env, free_port, read_jsonl, run_training, tiny_overrides, train_losses

pytestmark = pytest.mark.slow

AYUMI = REPO / ".venv" / "bin" / "ayumi"
LONG = ["train.tokens=1000000", "checkpoint.interval=0"]  # long enough that a signal lands mid-run


def command(launcher: str, overrides: list[str]) -> list[str]:
    import sys

    if launcher == "ayumi":
        return [sys.executable, "-m", "pretrain.tools.cli", "train", *overrides]
    return [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--no_local_rank",
            "--master_port", str(free_port()), "--module", "pretrain.train", *overrides]


def start_and_wait(launcher: str, overrides: list[str], run_dir: Path, log: Path, steps: int = 5):
    """Start a job and return it once it has logged `steps` steps, with its rank processes."""
    handle = open(log, "w")
    proc = subprocess.Popen(command(launcher, overrides), cwd=REPO, env=cpu_env(), stdout=handle, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            break
        if proc.poll() is not None:
            pytest.fail(f"the job ended early ({proc.returncode}): " + log.read_text()[-3000:])
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the job never reached step 5: " + log.read_text()[-3000:])
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
             if "pretrain.train" in " ".join(p.cmdline()) and "RANK" in p.environ()]
    assert len(ranks) == 2
    return proc, ranks, handle


def saved_stop(run_dir: Path) -> int:
    [stop] = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "signal_stop"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stop['step']:07d}"
    return stop["step"]


def assert_resumes_exactly(corpus: Path, runs: Path, tmp_path: Path, saved: int) -> None:
    """Resume 3 steps past the save; they equal an uninterrupted run's steps (same schedule, same data)."""
    # The resumed and the whole run are plain training (the launcher's part ended with the signal): forked ranks.
    resumed = run_training(tiny_overrides(corpus, runs, *LONG, f"train.max_steps={saved + 3}"), launcher="fork")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    whole_runs = tmp_path / "whole"
    whole = run_training(tiny_overrides(corpus, whole_runs, *LONG, f"train.max_steps={saved + 3}"), launcher="fork")
    assert whole.returncode == 0, whole.stdout[-3000:]
    got, expected = train_losses(runs / "cpu_tiny"), train_losses(whole_runs / "cpu_tiny")
    assert sorted(got) == list(range(1, saved + 4))
    assert [got[s] for s in range(saved + 1, saved + 4)] == [expected[s] for s in range(saved + 1, saved + 4)]


def test_sigterm_through_ayumi_train_saves_exits_0_and_resumes_exactly(corpus, tmp_path):
    runs = tmp_path / "runs"
    proc, ranks, log = start_and_wait("ayumi", tiny_overrides(corpus, runs, *LONG), runs / "cpu_tiny", tmp_path / "log")
    proc.send_signal(signal.SIGTERM)  # to `ayumi train` only, as a scheduler signals the job's process
    assert proc.wait(timeout=120) == 0  # the documented status after a handled SIGTERM
    log.close()
    output = (tmp_path / "log").read_text()
    assert "ayumi train: SIGTERM passed to 2 training process(es)" in output
    assert "stop requested (SIGTERM received)" in output
    assert_resumes_exactly(corpus, runs, tmp_path, saved_stop(runs / "cpu_tiny"))


def test_sigterm_to_the_deepspeed_launcher_saves_and_resumes_exactly(corpus, tmp_path):
    """DeepSpeed's runner has no SIGTERM handler and dies of it at once (status -15): the ranks notice their
    launcher is gone, agree, save and exit, so nothing trains on and the save resumes exactly."""
    runs = tmp_path / "runs"
    proc, ranks, log = start_and_wait("deepspeed", tiny_overrides(corpus, runs, *LONG), runs / "cpu_tiny", tmp_path / "log")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    _, alive = psutil.wait_procs(ranks, timeout=60)
    assert alive == []
    log.close()
    output = (tmp_path / "log").read_text()  # whichever rank's watch saw it first
    assert "stop requested (its launcher 'python deepspeed" in output or "stop requested (asked on another rank" in output
    assert_resumes_exactly(corpus, runs, tmp_path, saved_stop(runs / "cpu_tiny"))


@pytest.mark.parametrize("launcher", ["ayumi", "deepspeed"])
def test_kill_9_of_the_launcher_leaves_no_rank_running(corpus, tmp_path, launcher):
    runs = tmp_path / "runs"
    proc, ranks, log = start_and_wait(launcher, tiny_overrides(corpus, runs, *LONG), runs / "cpu_tiny", tmp_path / "log")
    killed_at = time.time()
    proc.kill()
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=30)
    for rank in alive:
        rank.kill()
    assert alive == [], f"ranks still running 30 s after the launcher's kill -9: {[r.pid for r in alive]}"
    assert time.time() - killed_at < 30
    log.close()
    saved_stop(runs / "cpu_tiny")  # they agreed, saved, and exited cleanly
    assert not (runs / "cpu_tiny" / ".ayumi.lock").exists()


def test_a_second_job_on_a_running_jobs_run_dir_is_refused(corpus, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "cpu_tiny"
    first, ranks, log = start_and_wait("ayumi", tiny_overrides(corpus, runs, *LONG), run_dir, tmp_path / "log")
    try:
        holder = json.loads((run_dir / ".ayumi.lock").read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] in [r.pid for r in ranks]
        # Through `ayumi train`: one line before anything starts.
        second = subprocess.run(command("ayumi", tiny_overrides(corpus, runs, *LONG)), cwd=REPO, env=cpu_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"run dir {run_dir} is in use by another job: pid {holder['pid']}" in second.stderr
        assert "Traceback" not in second.stderr + second.stdout
        # Through torchrun straight to the ranks: they refuse too, with the same line once.
        direct = run_training(tiny_overrides(corpus, runs, *LONG))
        assert direct.returncode != 0 and direct.stdout.count("is in use by another job") == 1
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        log.close()
    assert not (run_dir / ".ayumi.lock").exists()  # released at the end


def test_a_stale_lock_of_a_killed_job_is_taken_over(corpus, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "cpu_tiny"
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    run_dir.mkdir(parents=True)
    (run_dir / ".ayumi.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0,
                                                     "command": "old job", "locked_at": "2026-01-01T00:00:00"}))
    done = run_training(tiny_overrides(corpus, runs, "train.max_steps=2"), launcher="fork")  # the ranks take the lock
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"took over a stale lock of pid {dead.pid}" in done.stdout
    assert not (run_dir / ".ayumi.lock").exists()
