"""Record demo_domains_curve.json from two `ayumi demo`-configured runs (not a test).

The detector's mix-adjusted loss needs each domain's loss and sample count per step. The trainer feeds
them to the detector but logs only the losses (`train/loss/<domain>`), so the two runs were made with
a local one-line addition to pretrain/progress.py's step_metrics that also logs the counts as
`train/samples/<domain>` (the all-reduced counts it already has). Recorded on a 2-vCPU CPU with
AVX512-BF16 (precision auto: bf16), 2 ranks, the demo's config without cloze tasks:

  clean     `experiment=demo stability/inject=none`: 1,000 steps, no alarm
  injected  `experiment=demo stability.action=log_only train.max_steps=720`: the demo's LR x50 at
            0-based steps 600-602; bitwise the clean run before step 601 (checked here), so only its
            steps 601-625 (1-based) are stored

Run: python tests/pretrain/stability/data/record_demo_domains.py CLEAN_RUN_DIR INJECTED_RUN_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).with_name("demo_domains_curve.json")
INJECTED_STEPS = range(601, 626)  # 1-based, as metrics.jsonl counts


def train_records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "train/loss" in r}


def row(record: dict) -> dict:
    domains = {key[len("train/loss/"):]: [float(f"{record[key]:.6g}"), int(record["train/samples/" + key[11:]])]
               for key in sorted(record) if key.startswith("train/loss/")}
    return {"loss": float(f"{record['train/loss']:.6g}"), "grad_norm": float(f"{record['opt/grad_norm']:.6g}"),
            "domains": domains}


def main(clean_dir: Path, injected_dir: Path) -> None:
    clean, injected = train_records(clean_dir), train_records(injected_dir)
    same = all(clean[s]["train/loss"] == injected[s]["train/loss"] for s in range(1, INJECTED_STEPS[0]))
    assert same, "the injected run must match the clean run before the fault"
    events = [json.loads(line) for line in (clean_dir / "events.jsonl").read_text().splitlines()]
    OUT.write_text(json.dumps({
        "source": "ayumi demo config, bf16, 2 ranks; clean run and LR x50 at 0-based 600-602 (log_only)",
        "stage_switch_steps": [e["step"] - 1 for e in events if e["event"] == "stage_switch"],  # 0-based
        "clean": [row(clean[s]) for s in sorted(clean)],
        "injected_from": INJECTED_STEPS[0] - 1,  # 0-based index of the first injected row
        "injected": [row(injected[s]) for s in INJECTED_STEPS],
    }, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
