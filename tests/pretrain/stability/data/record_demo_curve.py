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

OUT = Path(__file__).with_name("demo_curve.json")


def main(run_dir: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    first = [train[0]]
    for record in train[1:]:
        if record["step"] <= first[-1]["step"]:
            break  # a rollback: the replay is another timeline
        first.append(record)
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
