"""Record low_loss_curve.json from a clean run dir of issue 46's case (not a test).

The case: `ayumi train experiment=cpu_tiny` on the tiny corpus repeated (tests.helpers.write_tiny_corpus), 2 CPU
ranks, fp32, `train.tokens=262144` (512 steps), `checkpoint.interval=40`, nothing injected. The stored file comes
from that run with `stability.action=log_only` (the detector judged every step, nothing was acted on, so the
curve is the clean run's) on the detector before issue 46: its relative divergence rule called five spikes
(steps 374, 384, 403, 438 and 483, as the console counts) on a loss of 0.03-0.04 whose single steps vary 4x.
Kept per step: the loss and the unclipped grad norm the detector was fed, and the clip threshold.

Run: python tests/pretrain/stability/data/record_low_loss_curve.py RUN_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from record_demo_curve import first_timeline  # beside this script (run as one, its folder is on sys.path)

OUT = Path(__file__).with_name("low_loss_curve.json")


def main(run_dir: Path) -> None:
    """Write OUT from RUN_DIR/metrics.jsonl (its first timeline)."""
    first = first_timeline(run_dir)
    OUT.write_text(json.dumps({
        "source": "issue 46's case (cpu_tiny, tiny corpus repeated, 2 ranks, fp32, 512 steps), stability.action="
                  f"log_only: metrics.jsonl records 1-{len(first)}",
        "loss": [float(f"{r['train/loss']:.6g}") for r in first],
        "grad_norm": [float(f"{r['opt/grad_norm']:.6g}") for r in first],
        "clip_threshold": [float(r.get("opt/clip_threshold", 0.0)) for r in first],
    }) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
