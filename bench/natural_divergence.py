"""Benchmark: a natural divergence (an LR past the stable edge, nothing injected) is recovered, and without
recovery it is not.

As the tuning playbook's instability test: the debug Llama (the cpu_tiny run, one process, DeepSpeed ZeRO-2 on
the CPU) on seeded Markov-chain text (bench/markov_corpus.py), --steps steps with a linear LR warmup of --warmup
steps to the peak LR, then cosine to a tenth of it.

1. The sweep: one run per peak LR in --lrs with `stability.action=log_only` (the detector judges and logs, nothing
   is acted on). A run *diverged* when its detector called a spike or its last 20 steps' mean loss stands 10% or
   more above its lowest 20-step mean. The edge is the largest LR below the first that diverged.
2. At --times x the edge (several times it): once with recovery (`stability.action=recover`, the default) and
   once without (`log_only`).

Targets (issue 38, item 4): the recovered run's last 20 steps' mean loss within --target of the edge run's
(a stable-LR run); the run without recovery diverged. Writes <work>/natural_divergence.json and each run's
report (`ayumi report`: its loss plot marks the spike and the rollbacks) under <work>/runs/<name>/report.

    python bench/natural_divergence.py --work /tmp/nd      # about 10 minutes on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

DIVERGED_RISE = 0.10  # the last 20 steps' mean this far above the lowest 20-step mean: diverged
TAIL = 20
DETECTOR = ["stability.detector.warmup_steps=40", "stability.detector.min_history=30",
            "stability.recovery.ring_interval=20", "stability.recovery.rollback_steps=20",
            "stability.recovery.skip_batches=10", "stability.recovery.lr_cooldown_steps=50"]
"""Detector and recovery sized for a 400-step run (the defaults are sized for thousands of steps)."""


def run(work: Path, name: str, lr: float, args, action: str) -> Path:
    """One training run (cached by name in --work); returns its run dir."""
    from bench.gpu_acceptance import markov_corpus, run_overrides

    run_dir = work / "runs" / name
    if (run_dir / "done").is_file() and not args.fresh:
        return run_dir
    tokens = args.steps * 8 * 64
    overrides = run_overrides(
        work, name, "cpu", "experiment=cpu_tiny", "deepspeed=zero2", f"train.tokens={tokens}",
        f"train.max_steps={args.steps}", "checkpoint.interval=0", "checkpoint.save_final=false", "model.compile=off",
        "train.eval_interval=0", "checkpoint.resume=false", f"optim.lr={lr:g}", f"optim.min_lr={lr / 10:g}",
        f"optim.warmup_steps={args.warmup}", f"stability.action={action}", *DETECTOR, root=markov_corpus(work))
    log = work / f"{name}.log"
    print(f"[natural_divergence] {name:24s} ...", end=" ", flush=True)
    with open(log, "w") as handle:
        rc = subprocess.run([sys.executable, "-m", "pretrain.train", *overrides], cwd=REPO, stdout=handle,
                            stderr=subprocess.STDOUT).returncode
    print(f"rc {rc}", flush=True)
    if rc not in (0, 3):  # 3: the stability machinery stopped it (a verdict, not a failure of the bench)
        raise SystemExit(f"{name} failed (rc {rc}); log {log}:\n{log.read_text(errors='replace')[-3000:]}")
    (run_dir / "done").write_text(str(rc))
    subprocess.run([sys.executable, "-m", "pretrain.tools.report.build", str(run_dir)], cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return run_dir


def summary(run_dir: Path) -> dict:
    """Final and lowest 20-step mean losses, and the stability events that matter here."""
    from bench.gpu_acceptance import events, losses

    curve = losses(run_dir)
    values = [curve[s] for s in sorted(curve)]
    means = [statistics.mean(values[i:i + TAIL]) for i in range(0, len(values) - TAIL + 1)]
    kinds = [e for e in events(run_dir) if e["event"] in ("spike", "rollback", "stop")]
    final, lowest = means[-1], min(means)
    return {"final": final, "lowest": lowest, "steps": len(values), "stopped": int((run_dir / "done").read_text()) == 3,
            "spikes": [e["step"] for e in kinds if e["event"] == "spike"],
            "rollbacks": [(e["step"], e.get("to_step")) for e in kinds if e["event"] == "rollback"],
            "diverged": bool([e for e in kinds if e["event"] == "spike"]) or final >= lowest * (1 + DIVERGED_RISE)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/ayumi_natural_divergence"))
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[0.01, 0.03, 0.1, 0.3, 1.0])
    p.add_argument("--times", type=float, default=3.0, help="the high LR: this many times the edge")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--target", type=float, default=0.05, help="recovered final loss within this of the edge run's")
    p.add_argument("--fresh", action="store_true", help="rerun the runs already in --work")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    print(machine_line())
    sweep = {lr: summary(run(args.work, f"sweep_{lr:g}", lr, args, "log_only")) for lr in args.lrs}
    stable = [lr for lr in args.lrs if not any(sweep[x]["diverged"] for x in args.lrs if x <= lr)]
    if not stable or len(stable) == len(args.lrs):
        raise SystemExit(f"no edge in the sweep {args.lrs}: diverged {[lr for lr in args.lrs if sweep[lr]['diverged']]}")
    edge = stable[-1]
    high = edge * args.times
    on = summary(run(args.work, f"high_{high:g}_recover", high, args, "recover"))
    off = summary(run(args.work, f"high_{high:g}_off", high, args, "log_only"))
    base = sweep[edge]
    ratio = on["final"] / base["final"]
    print(f"\n| run | peak LR | spikes | rollbacks | lowest | final (last {TAIL} steps) | diverged |\n|---|---|---|---|---|---|---|")
    for name, lr, s in [*((f"sweep", lr, sweep[lr]) for lr in args.lrs), ("high, recovery on", high, on),
                        ("high, recovery off", high, off)]:
        print(f"| {name} | {lr:g} | {s['spikes'] or '-'} | {s['rollbacks'] or '-'} | {s['lowest']:.3f} | "
              f"{s['final']:.3f}{' (stopped)' if s['stopped'] else ''} | {'yes' if s['diverged'] else 'no'} |")
    print(f"\nedge {edge:g}; high {high:g} = {args.times:g}x; recovered final / edge final = {ratio:.3f}")
    print(result_line("natural_divergence_recovered", on["final"], base["final"], f"<={1 + args.target:g}",
                      ok=bool(on["rollbacks"]) and not on["stopped"] and ratio <= 1 + args.target))
    print(result_line("natural_divergence_without_recovery", off["final"], base["final"], f">={1 + DIVERGED_RISE:g}",
                      ok=off["diverged"]))
    (args.work / "natural_divergence.json").write_text(json.dumps(
        {"edge": edge, "high": high, "sweep": {f"{k:g}": v for k, v in sweep.items()}, "on": on, "off": off,
         "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
