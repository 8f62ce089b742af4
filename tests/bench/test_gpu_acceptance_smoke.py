"""bench/gpu_acceptance.py --cpu-smoke: every part of the GPU acceptance run, with tiny shapes on the CPU, so
the script that a lent GPU runs for minutes is known to work before any GPU time is spent.

The figures (MFU, GEMM, memory, the async save's ratio) mean nothing on a CPU; the behaviour does: the
correctness comparisons, the kill -9 and resume, the spike recovery and the demo's training run must pass
here as they must there. Also: results.json is rewritten after every part (a killed run keeps what
finished), a part over its limit is recorded and the next one still runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.gpu_acceptance import DIE_AFTER_PARTIAL, PARTS, SCHEDULE
from tests.helpers import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "bench" / "gpu_acceptance.py"
BEHAVIOUR = {  # part -> checks that must pass on the CPU too
    "correctness": {"seeded_runs_identical", "zero_first_step", "zero0", "zero2", "zero3", "fp32", "compiled",
                    "plain_loss", "accum4"},
    "checkpoint_kill": {"latest_intact", "resumed_exactly"},
    "stability": {"spike_detected", "rolled_back", "batches_skipped", "no_false_alarm", "final_loss"},
    "demo_train": {"demo_exit"},
    "long_context": {"documents_alone", "document_kernels", "llama3_rope", "short_to_long"},
    "peer": {"peer_trained"},
    "peer_torchtitan": {"torchtitan_shape", "torchtitan_config"},  # torchtitan's trainer is CUDA-only
    "fp8_loss": {"fp8_loss_tensorwise", "fp8_loss_rowwise", "fp8_no_stability_event"},  # under torchao's emulation
}


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(root / "out"), "--work",
                           str(root / "work"), "--budget", "1500"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=1700)
    results = json.loads((root / "out" / "results.json").read_text())
    return proc, results, root


def test_every_part_runs_on_the_cpu(smoke):
    proc, results, root = smoke
    parts = results["parts"]
    assert list(parts) == [k for batch in SCHEDULE for k in batch], list(parts)
    assert set(parts) == set(PARTS)
    broken = {k: (p["status"], p.get("log_tail", "")[-800:]) for k, p in parts.items()
              if p["status"] not in ("passed", "failed")}
    assert not broken, broken
    table = (root / "out" / "results.md").read_text()
    for key in PARTS:
        assert f". {key} |" in table, key
    assert table.rstrip() in proc.stdout  # the table is printed at the end too, then the RESULT lines' place
    assert proc.stdout.rstrip().endswith("no RESULT (nothing measured on a GPU)")
    assert (root / "out" / "parts.log").read_text().count("=====") == 2 * len(PARTS)
    assert proc.returncode == 1  # the figures' targets are not met on a CPU


@pytest.mark.parametrize("part", sorted(BEHAVIOUR))
def test_the_behaviour_checks_pass_on_the_cpu(smoke, part):
    _, results, _ = smoke
    checks = {c["name"]: c for c in results["parts"][part]["checks"]}
    assert BEHAVIOUR[part] <= set(checks), sorted(checks)
    failed = {name: checks[name]["detail"] for name in BEHAVIOUR[part] if not checks[name]["ok"]}
    assert not failed, failed


def test_speed_parts_report_the_trainer_figures(smoke):
    _, results, _ = smoke
    for key in ("speed_1b_2048", "speed_7b_layers", "speed_1b_plan", "speed_1b_4096", "profile_1b", "speed_1b_plain_loss",
                "speed_1b_fp8", "speed_7b_layers_fp8"):
        figures = results["parts"][key]["figures"]
        assert figures["tokens_per_s"] > 0 and figures["compiled"] == "blocks" and figures["planned_peak"] > 0
        assert len(figures["step_seconds"]) == 2
    assert results["parts"]["speed_1b_plan"]["figures"]["micro_batch"] == 2 * \
        results["parts"]["speed_1b_2048"]["figures"]["micro_batch"]
    assert "model.loss_chunk_tokens=0" in results["parts"]["speed_1b_plain_loss"]["figures"]["overrides"]
    for fp8, bf16_target in (("speed_1b_fp8", ">=1.15"), ("speed_7b_layers_fp8", ">=1.25")):
        assert "model.fp8=tensorwise" in results["parts"][fp8]["figures"]["overrides"]  # emulated on the CPU
        row = next(row for row in results["parts"][fp8]["rows"] if row[0].startswith("tokens/s over bf16's"))
        assert row[2] == bf16_target and row[3] is None  # shown beside its bf16 part, judged only on a GPU


def test_the_peer_trains_the_tokens_a_step_of_speed_1b_2048_and_is_compared(smoke):
    """The plain PyTorch loop (eager on the CPU) ran its steps at speed_1b_2048's tokens a step, and that part's table
    shows ayumi's tokens/s over the peer's (not judged on a CPU)."""
    _, results, _ = smoke
    peer, ours = results["parts"]["peer"], results["parts"]["speed_1b_2048"]
    figures = peer["figures"]
    assert figures["tokens_per_s"] > 0 and len(figures["step_seconds"]) == 2 and figures["compiled"] is False
    assert figures["tokens_per_step"] == ours["figures"]["micro_batch"] * ours["figures"]["grad_accum"] * 64
    # Both layouts of the same tokens a step ran (the accumulation path too); the faster is the peer's figure.
    layouts = figures["layouts"]
    assert [(l["micro_batch"], l["grad_accum"]) for l in layouts] == [(1, 2), (2, 1)]
    assert {l["tokens_per_step"] for l in layouts} == {figures["tokens_per_step"]}
    assert figures["tokens_per_s"] == max(l["tokens_per_s"] for l in layouts)
    # Its attention: the registered causal SDPA, seen in a profile of one step (SDPA's CPU flash op here).
    assert figures["attention"] == "ayumi_peer_causal"
    assert all(any("scaled_dot_product" in name for name in l["attention_kernels"]) for l in layouts)
    row = next(row for row in ours["rows"] if row[0].startswith("tokens/s over the peer's"))
    assert row[2] == ">=1.25" and row[3] is None and "not comparable" not in row[1]


def test_torchtitan_builds_ayumis_1b_shape_from_its_own_parts(smoke):
    """The second peer, on the CPU: torchtitan (installed in its own folder by ./ayumi test) builds its Llama 3 model
    of the flavor registered for ayumi's 1b preset, with exactly the preset's parameters and FLOPs per token, and its
    trainer's config; it trains nothing there."""
    _, results, _ = smoke
    part = results["parts"]["peer_torchtitan"]
    shape = part["figures"]["shape"]
    assert shape["params_torchtitan"] == shape["params_ayumi"] == 1_174_497_280
    assert shape["flops_per_token_torchtitan"] == pytest.approx(shape["flops_per_token_ayumi"], rel=1e-3)
    ours, theirs = shape["shapes"]["ayumi"], shape["shapes"]["torchtitan"]
    assert ours and len(theirs) == len(ours) - 2  # Q, K, V fused into one
    # Its trainer's config builds, at speed_1b_2048's layout, and its data loader gives micro x seq batches.
    config = part["figures"]["config"]
    assert config["batch"] == {"input": [16, 2048], "positions": [16, 2048], "labels": [16, 2048]}
    assert (config["training"]["global_batch_size"], config["compile"]) == (32, ["model", "loss"])
    assert "tokens_per_s" not in part["figures"]


def test_the_speed_parts_record_start_up_and_the_kernels_chosen(smoke):
    """Each speed part records its start-up (process to build, the trainer's build, the first step) and the kernels the
    trainer's process chose; long_context records the kernels too."""
    _, results, _ = smoke
    figures = results["parts"]["speed_1b_2048"]["figures"]
    startup = figures["startup_seconds"]
    assert startup["process_to_build"] > 0 and startup["build_trainer"] > 0 and startup["first_step"] > 0
    assert set(figures["kernels"]) == {"document_attention", "fp32_output_gemm"}
    assert set(results["parts"]["long_context"]["figures"]["kernels"]) == {"document_attention", "fp32_output_gemm"}


def test_the_expected_total_is_printed_before_the_run(smoke):
    proc, _, _ = smoke
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[acceptance] ") and "parts (" in line)
    assert f"{len(PARTS)} parts (" in line and "budget 1500 s" in line


def test_the_profile_comes_back_beside_the_results(smoke):
    _, _, root = smoke
    profile = (root / "out" / "profile_1b.txt").read_text()
    assert profile.startswith("# 2 steps profiled:") and "Name" in profile


def test_a_part_killed_midway_keeps_what_it_measured(tmp_path):
    """The peer is killed (SIGKILL) right after its first layout: the table keeps that layout's rows, marked partial,
    and the run goes on to the next part."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), "--parts", "peer,env"], cwd=REPO,
                          env={**env(), DIE_AFTER_PARTIAL: "peer"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:]
    parts = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]
    peer = parts["peer"]
    assert peer["status"] == "error" and peer["partial"] is True and peer["exit"] == -signal.SIGKILL
    assert [(l["micro_batch"], l["grad_accum"]) for l in peer["figures"]["layouts"]] == [(1, 2)]
    assert peer["rows"][-1][0] == "partial result" and "failed" in peer["rows"][-1][1]
    assert parts["env"]["status"] == "passed"
    table = (tmp_path / "out" / "results.md").read_text()
    assert "micro 1 x accum 2: tokens/s per GPU" in table and "partial result" in table


def test_a_part_over_its_limit_is_recorded_and_the_next_still_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), "--parts", "env,checkpoint_save", "--part-limit", "env=0.5"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:]
    parts = json.loads((tmp_path / "out" / "results.json").read_text())["parts"]
    assert parts["env"]["status"] == "timeout"
    assert parts["checkpoint_save"]["status"] in ("passed", "failed") and parts["checkpoint_save"]["rows"]


def test_a_killed_run_keeps_every_finished_part(tmp_path):
    """kill -9 of the whole run once the first part is in: results.json is whole and holds that part."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), "--work", str(tmp_path / "work"),
                             "--parts", "env,speed_1b_2048"], cwd=REPO, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            results = out / "results.json"
            if results.is_file() and json.loads(results.read_text())["parts"].get("env", {}).get("status") == "passed":
                break
            assert proc.poll() is None
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    parts = json.loads((out / "results.json").read_text())["parts"]
    assert parts["env"]["status"] == "passed"
    assert parts.get("speed_1b_2048", {"status": "running"})["status"] == "running"  # started, never finished
    assert "a. env" in (out / "results.md").read_text()


def test_bad_arguments_get_one_line():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", "/nonexistent-never", "--parts", "env,warp"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "gpu_acceptance: unknown part(s) warp; choose from " + ", ".join(PARTS)]
