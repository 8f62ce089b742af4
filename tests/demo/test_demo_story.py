"""The demo's closing line (demo.run.story) says what the run's events.jsonl says happened, rollback or not."""
import json
from pathlib import Path

from demo.run import story

SWITCHES = [{"event": "stage_switch", "step": s} for s in (1, 326, 576, 826)]
FAULTS = [{"event": "fault_injected", "step": s} for s in (601, 602, 603)]
SPIKE = {"event": "spike", "step": 604, "spike_start": 601}
ROLLBACK = {"event": "rollback", "step": 604, "to_step": 500}
RECOVERED = {"event": "recovered", "step": 500, "latency_s": 0.34}


def run_dir(tmp_path: Path, events: list[dict]) -> Path:
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


def test_a_detected_and_rolled_back_spike(tmp_path):
    line = story(run_dir(tmp_path, [*SWITCHES, *FAULTS, SPIKE, ROLLBACK, RECOVERED]))
    assert line.startswith("Events: 4 stage switches, a fault injected at steps 601-603, detected as a spike at step "
                           "604 (began at 601), rolled back to step 500 and recovered in 0.3s")


def test_an_undetected_spike_says_no_rollback_happened(tmp_path):
    line = story(run_dir(tmp_path, [*SWITCHES, *FAULTS]))
    assert "NOT detected" in line and "no rollback" in line and "rolled back to" not in line


def test_a_spike_that_was_not_rolled_back_says_so_and_why(tmp_path):
    stop = {"event": "stop", "step": 604, "message": "stability.action=stop"}
    line = story(run_dir(tmp_path, [*SWITCHES, *FAULTS, SPIKE, stop]))
    assert "NOT rolled back: the run stopped at step 604" in line


def test_a_run_without_a_fault_or_events(tmp_path):
    assert story(run_dir(tmp_path, SWITCHES[:2])).startswith("Events: 2 stage switches, no fault injected")
    assert "no fault injected" in story(tmp_path / "missing")
