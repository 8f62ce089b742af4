"""Record demo_curve.json from an `ayumi demo` run dir (not a test).

Keeps the first timeline of the run (every train record up to the rollback): the loss and the
unclipped grad norm the detector was fed, and the 0-based steps at which a curriculum stage began
(the trainer's `note_stage_switch`). The stored file comes from `ayumi demo` before confirmation
existed (2-core CPU, 2 ranks; precision auto chose fp32 there), which skipped the updates of two clean steps
(the curve's 0-based steps 243 and 532) and caught the injected LR x50 (steps 600-602) at 603.

Run: python tests/pretrain/stability/data/record_demo_curve.py runs/demo
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pretrain.tools.report.timeline import read_jsonl

OUT = Path(__file__).with_name("demo_curve.json")


def first_timeline(run_dir: Path) -> list[dict]:
    """The train records of RUN_DIR/metrics.jsonl up to its first rollback (record_low_loss_curve.py uses it too)."""
    first: list[dict] = []
    for record in read_jsonl(run_dir / "metrics.jsonl").rows:
        if "train/loss" not in record:
            continue
        if first and record["step"] <= first[-1]["step"]:
            break  # a rollback: the replay is another timeline
        first.append(record)
    return first


def main(run_dir: Path) -> None:
    first = first_timeline(run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    switches = []
    for event in events:
        if event["event"] == "recovered":
            break
        if event["event"] == "stage_switch":
            switches.append(event["step"] - 1)  # events count steps from 1, the detector from 0
    OUT.write_text(json.dumps({
        "source": f"ayumi demo: metrics.jsonl records 1-{len(first)} (the timeline up to the rollback)",
        "stage_switch_steps": switches,
        "loss": [float(f"{r['train/loss']:.6g}") for r in first],
        "grad_norm": [float(f"{r['opt/grad_norm']:.6g}") for r in first],
    }) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
