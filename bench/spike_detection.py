"""Benchmark: is an LR spike detected and recovered from, right after a curriculum stage switch and far from one?

Real 2-rank runs (torchrun, gloo, DeepSpeed on CPU) of `ayumi demo`'s own configuration
(conf/experiment/demo.yaml on the demo's corpus, tokenizer and shards; built into --data-root on first use,
as `ayumi demo` does), without the cloze tasks. The fault is the demo's fire drill, LR xF for three steps
(`stability.inject.lr_multiply`, fires once), injected `offset` steps after a stage switch (--switch, 0-based
first step of a stage; the demo's stage 2 begins at 325, stage 3 at 575) or at --far, a step at least 100
steps from any switch. For each precision (`deepspeed.precision`, bf16 and fp32) and case:

  clean/seed S  no fault, stability on (recover): any spike, skip or rollback is a false alarm
  off           the fault, `stability.action=log_only`: the detector runs and logs (no rollback), so this
                run shows whether and when it would call a spike, and how far the loss rose
  on            the fault, `stability.action=recover`: rolled back?, final val loss against clean (seed 0)

Detected: a `spike` event in the off run whose spike_start lies within 10 steps after the fault.
Loss rise: the largest ratio of the off run's train loss to the clean run's (same seed, so the same batches and,
before the fault, bitwise the same weights) over the 15 steps after the fault, minus 1: the fault's own effect,
without the batch noise or a stage switch's change of mix. Without a clean run of the precision: the largest
train loss of those steps over the median of the 20 before the fault (the switch's bump then counts too).
Targets (issue 38): every x50 detected and recovered within 2% of clean; x10 detected wherever its loss
rises >= 20%; no alarm on the clean runs.

    python bench/spike_detection.py --work /tmp/sd                 # everything: hours on 2 CPU cores
    python bench/spike_detection.py --precisions bf16 --factors 50 --offsets 5 --far none --seeds 0 \\
        --modes off --max-steps 400                                # one case, detection only: ~3 min

--max-steps stops every run early (the LR schedule stays the 1,000-step demo's); the final val loss is the
evaluation after the last step. A case's runs are cached in --work by name: a rerun with more cases only runs
the new ones (--fresh reruns all). Writes <work>/spike_detection.json and prints a table and RESULT lines.

--low-loss runs the false-alarm table across loss levels instead (issue 46): clean runs whose loss goes low or
quiet, each of --precisions and --seeds, recovery on, nothing injected; any spike, skipped update, rollback or stop
is a false alarm. The debug Llama (`experiment=cpu_tiny`, 2 ranks, 8 x 64 tokens a step unless said) on:

  repeated     the tiny corpus of the tests repeated (two short documents, 40 copies each, ~20 epochs), 1,024
               steps: the loss is below 0.1 from step ~250 on, single steps 4x apart (issue 46's case, twice as long)
  narrow       one domain: one document of 376 tokens, 40 copies, memorised over ~35 epochs (1,400 readings of the
               text) in 1,024 steps
  late_cosine  seeded Markov text, 32 samples a step (quiet: half the noise), 1,536 steps, cosine to a hundredth of
               the LR: the last ~300 steps run below a tenth of the peak LR on a flat loss

Each row also replays the run's curve through the detector with the rules before issue 46 (the relative climb
alone, +50% or 8x alone without a z), which shows the false alarms this table would have had.

    python bench/spike_detection.py --low-loss --work /tmp/sd_low      # 18 runs, ~40 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)
from bench.spike_recovery import env, free_port  # noqa: E402  (the same 2-rank CPU runs)

DETECT_WITHIN = 10  # steps after the fault in which the spike must begin
RISE_WINDOW, LEVEL_WINDOW = 15, 20
FAULT_STEPS = 3
TARGET_VAL = 1.02
TARGET_RISE = 0.20  # x10 must be detected wherever its loss rises this much


@dataclass(frozen=True)
class Case:
    precision: str
    factor: float  # 0 = clean
    at: int  # 0-based first faulty step (clean: -1)
    where: str  # "switch+5", "far", "seed 1"
    seed: int = 0

    def name(self, mode: str) -> str:
        if not self.factor:
            return f"{self.precision}_clean_s{self.seed}"
        return f"{self.precision}_x{self.factor:g}_at{self.at}_{mode}"


# ----------------------------------------------------------------------------------------------
# Data and runs
# ----------------------------------------------------------------------------------------------


def demo_data(root: Path) -> tuple[Path, Path]:
    """(shards, tokenizer dir): the demo's, built under `root` by the demo's own stages when missing."""
    from demo import run as demo_run

    shards, tokenizer = root / "shards" / demo_run.DATA_PRESET, root / "tokenizers" / demo_run.TOKENIZER_PRESET
    if not (shards / "manifest.json").exists():
        files = demo_run.hold_out_documents(demo_run.build_corpus(root / "demo_corpus"), root / demo_run.HELDOUT_DIR)
        demo_run.build_tokenizer(files, tokenizer)
        demo_run.prepare_shards(files, tokenizer, shards)
    return shards, tokenizer


def overrides(case: Case, mode: str, shards: Path, tokenizer: Path, runs: Path, max_steps: int) -> list[str]:
    from demo.run import training_overrides

    out = training_overrides(shards, tokenizer, runs) + [
        f"name={case.name(mode)}", "logging=none", "stability/inject=none", f"deepspeed.precision={case.precision}",
        f"train.seed={case.seed}", f"train.max_steps={max_steps}", "checkpoint.resume=false"]
    if case.factor:
        fault = ",".join(f"{case.at + i}:{case.factor}" for i in range(FAULT_STEPS))
        action = "log_only" if mode == "off" else "recover"
        out += [f"+stability.inject.lr_multiply={{{fault}}}", f"stability.action={action}"]
    return out


def train_logged(name: str, cmd: list[str], log: Path) -> tuple[int, float]:
    """Run one training launch, its output into `log`; (exit status, wall seconds), both printed on one line."""
    print(f"[spike_detection] {name:32s} ...", end=" ", flush=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        rc = subprocess.run(cmd, cwd=REPO, env=env(), stdout=handle, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    print(f"rc {rc}, {wall:.0f}s", flush=True)
    return rc, wall


def train(case: Case, mode: str, args: argparse.Namespace, data: tuple[Path, Path]) -> Path:
    """The run's dir, after running it unless a finished run of that name is there already."""
    from pretrain.tools.launch import launcher_command

    runs = args.work / "runs"
    run_dir, log = runs / case.name(mode), args.work / f"{case.name(mode)}.log"
    done = run_dir / "done.json"
    if done.exists() and not args.fresh:
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = launcher_command("torchrun", 2, overrides(case, mode, *data, runs, args.max_steps), master_port=free_port())
    rc, wall = train_logged(case.name(mode), cmd, log)
    if rc != 0:
        raise SystemExit(f"{case.name(mode)} failed (rc {rc}); log {log}:\n{log.read_text(errors='replace')[-3000:]}")
    done.write_text(json.dumps({"wall_s": wall}))
    return run_dir


# ----------------------------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events(run_dir: Path, *kinds: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] in kinds]


def final_val(run_dir: Path) -> float:
    vals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/loss" in r]
    return vals[-1]["val/loss"] if vals else float("nan")


def train_losses(run_dir: Path) -> dict[int, float]:
    """step (from 1) -> train loss of the run's first timeline (a rollback's replay is left out)."""
    return {r["step"]: r["train/loss"] for r in first_timeline(run_dir)}


def first_timeline(run_dir: Path) -> list[dict]:
    """The train records of a run up to its first rollback (metrics count steps from 1)."""
    out: list[dict] = []
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if "train/loss" in r:
            if out and r["step"] <= out[-1]["step"]:
                break
            out.append(r)
    return out


def loss_rise(run_dir: Path, at: int, clean: Path | None) -> float:
    """The fault's loss rise (module docstring). Metrics count steps from 1: the faulty step `at` is record at + 1,
    its damage shows from at + 2."""
    train = train_losses(run_dir)
    after = [s for s in range(at + 2, at + 2 + RISE_WINDOW) if s in train]
    if clean is not None:
        reference = train_losses(clean)
        return max(train[s] / reference[s] for s in after if s in reference) - 1.0
    level = statistics.median(train[s] for s in range(at + 1 - LEVEL_WINDOW, at + 1) if s in train)
    return max(train[s] for s in after) / level - 1.0


def alarms(run_dir: Path) -> list[str]:
    """The false alarms of a clean run: every spike, skipped update and rollback."""
    return [f"{e['event']}@{e['step']}" for e in events(run_dir, "spike", "skip_update", "rollback", "stop")]


def judge_case(case: Case, off: Path | None, on: Path | None, clean: Path | None) -> dict:
    row: dict = {**asdict(case)}
    if off is not None:
        spikes = events(off, "spike")
        # spike_start counts from 0 like the fault: the faulty step's update damages the weights of the next one.
        hit = next((e for e in spikes if case.at < e.get("spike_start", -1) <= case.at + DETECT_WITHIN), None)
        row.update(detected=hit is not None, detected_at=hit["step"] if hit else None,
                   spike_start=hit.get("spike_start") if hit else None, rise=loss_rise(off, case.at, clean),
                   rise_vs="clean run" if clean is not None else "level before",
                   off_val=final_val(off), reason=(hit or {}).get("message", "")[:160])
    if on is not None:
        clean_val = final_val(clean) if clean is not None else float("nan")
        rollbacks = events(on, "rollback")
        row.update(rolled_back=bool(rollbacks), to_step=rollbacks[0]["to_step"] if rollbacks else None,
                   on_val=final_val(on), on_ratio=final_val(on) / clean_val, stopped=bool(events(on, "stop")))
    return row


def meets(row: dict) -> bool | None:
    """This case's target; None when its runs do not decide it."""
    if row["factor"] >= 50:
        parts = [row.get("detected"), row.get("rolled_back") and row.get("on_ratio", 9) <= TARGET_VAL]
        return None if any(p is None for p in parts) else all(parts)
    if "detected" not in row:
        return None
    return row["detected"] or row["rise"] < TARGET_RISE


# ----------------------------------------------------------------------------------------------
# Low-loss clean runs (--low-loss)
# ----------------------------------------------------------------------------------------------

LOW_CASES = ("repeated", "narrow", "late_cosine")
LOW_LEVEL = 0.1  # a step counts as low-loss below this loss
OLD_RULES = {"divergence_z": 0.0, "loss_alone_z": 0.0, "grad_alone_z": 0.0}
"""The detector before issue 46: a relative climb alone is a divergence; +50% or 8x alone needs no z beyond
loss_z or grad_z."""


def low_corpus(work: Path, case: str) -> Path:
    """The case's DATA_ROOT under work/corpora (written on first use)."""
    from data.manifest import MANIFEST_NAME

    root = work / "corpora" / case
    if (root / MANIFEST_NAME).is_file():
        return root
    if case == "repeated":
        from tests.helpers import write_tiny_corpus

        write_tiny_corpus(root)
    elif case == "narrow":
        from data.token_root import TokenRoot
        from tests.helpers import EN_TEXT, EOS, VOCAB, byte_tokens

        with TokenRoot(root, vocab_size=VOCAB, eos_id=EOS, name="narrow") as out:
            for split, count in (("train", 40), ("val", 4)):
                with out.shard("en", split) as writer:
                    for _ in range(count):
                        writer.add_document(byte_tokens(EN_TEXT))
    else:
        from bench.markov_corpus import write_markov_corpus

        write_markov_corpus(root, 512, tokens_per_domain=1_000_000)
    return root


def low_overrides(case: str, precision: str, seed: int, work: Path) -> list[str]:
    """`ayumi train` overrides of one low-loss clean run."""
    name = f"low_{case}_{precision}_s{seed}"
    out = ["experiment=cpu_tiny", f"name={name}", f"run_root={work / 'runs'}", f"data.root={low_corpus(work, case)}",
           "logging=none", f"deepspeed.precision={precision}", f"train.seed={seed}", "checkpoint.resume=false",
           "checkpoint.interval=40", "checkpoint.save_final=false", "stability/inject=none"]
    if case in ("repeated", "narrow"):
        out += ["train.tokens=524288"]  # 1,024 steps of 8 x 64 tokens
    else:
        out += ["train.tokens=3145728", "train.global_batch_size=32", "optim.min_lr=3e-5", "data.validation=false",
                "curriculum.default_max_repetition=inf", "train.eval_interval=0"]  # 1,536 steps of 32 x 64 tokens
    return out


def train_low(case: str, precision: str, seed: int, args: argparse.Namespace) -> Path:
    """The run's dir, after running it unless a finished run of that name is there already."""
    from pretrain.tools.launch import launcher_command

    name = f"low_{case}_{precision}_s{seed}"
    run_dir, log = args.work / "runs" / name, args.work / f"{name}.log"
    done = run_dir / "done.json"
    if done.exists() and not args.fresh:
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = launcher_command("torchrun", 2, low_overrides(case, precision, seed, args.work), master_port=free_port())
    rc, wall = train_logged(name, cmd, log)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps({"wall_s": wall, "rc": rc}))  # rc 3: the stability machinery stopped it (an alarm)
    return run_dir


def replayed(run_dir: Path, records: list[dict], **rules: float) -> tuple[list[str], float]:
    """(the alarms, the largest climb z) of the run's first timeline (`records`) replayed through a fresh detector of
    the run's detector config with `rules` changed. Outlier steps fed back in are not withheld from the replay's
    training, so this is what the detector would say of this curve, not of the run it would have made."""
    import yaml

    from pretrain.stability.config import DetectorConfig
    from pretrain.stability.detector import SpikeDetector

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    fields = set(DetectorConfig.__dataclass_fields__)
    detector = SpikeDetector(DetectorConfig(**{**{k: v for k, v in config["stability"]["detector"].items()
                                                   if k in fields}, **rules}))
    found, climb = [], 0.0
    for step, record in enumerate(records):
        domains = {k.split("/", 2)[2]: (v, 1.0) for k, v in record.items() if k.startswith("train/loss/")}
        verdict = detector.observe(step, record["train/loss"], record.get("opt/grad_norm"), domains,
                                   clip_threshold=record.get("opt/clip_threshold", 0.0))
        climb = max(climb, verdict.climb_z or 0.0)
        if verdict.kind != "ok":
            found.append(f"{'divergence' if verdict.divergence else verdict.kind}@{step + 1}")
    return found, climb


def low_row(case: str, precision: str, seed: int, run_dir: Path) -> dict:
    """One clean low-loss run's line of the table."""
    records = first_timeline(run_dir)
    losses = [r["train/loss"] for r in records]
    tail = sorted(losses[-100:])
    old, _ = replayed(run_dir, records, **OLD_RULES)
    again, climb = replayed(run_dir, records)  # the final detector on the same curve: its alarms count too
    return {"case": case, "precision": precision, "seed": seed, "steps": len(records),
            "low_steps": sum(1 for x in losses if x < LOW_LEVEL), "median_last_100": tail[len(tail) // 2],
            "spread_last_100": tail[-1] / tail[0],
            "max_loss_z": max((r.get("stability/loss_z", 0.0) for r in records), default=0.0),
            "max_grad_z": max((r.get("stability/grad_z", 0.0) for r in records), default=0.0),
            "max_climb_z": climb, "alarms": alarms(run_dir) + [f"replayed {alarm}" for alarm in again],
            "old_rules": old,
            "rc": json.loads((run_dir / "done.json").read_text())["rc"]}


def low_loss_main(args: argparse.Namespace) -> int:
    """--low-loss: the clean runs of LOW_CASES, the table and a RESULT line."""
    rows = []
    for case in args.low_cases:
        for precision in args.precisions:
            for seed in args.seeds:
                rows.append(low_row(case, precision, seed, train_low(case, precision, seed, args)))
    (args.work / "low_loss.json").write_text(json.dumps(rows, indent=1))
    print("\n| case | precision | seed | steps (< 0.1) | loss, last 100 steps: median (max/min) | largest z: loss / "
          "grad norm / climb | alarms | rules before issue 46, replayed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['precision']} | {r['seed']} | {r['steps']} ({r['low_steps']}) | "
              f"{r['median_last_100']:.3g} ({r['spread_last_100']:.1f}x) | {r['max_loss_z']:.1f} / "
              f"{r['max_grad_z']:.1f} / {r['max_climb_z']:.1f} | {', '.join(r['alarms']) or 'none'} | "
              f"{', '.join(r['old_rules']) or 'none'} |")
    false_alarms = sum(len(r["alarms"]) for r in rows) + sum(r["rc"] != 0 for r in rows)
    print(result_line("spike_detection_low_loss_false_alarms", false_alarms, 0, "<=0", ratio=float(false_alarms),
                      ok=false_alarms == 0))
    return 0


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    for precision in args.precisions:
        out += [Case(precision, 0.0, -1, f"seed {seed}", seed) for seed in args.seeds]
        for factor in args.factors:
            out += [Case(precision, factor, args.switch + offset, f"switch+{offset}") for offset in args.offsets]
            if args.far is not None:
                out.append(Case(precision, factor, args.far, "far"))
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/ayumi_spike_detection"))
    p.add_argument("--data-root", type=Path, default=None, help="the demo's data (default: $AYUMI_DATA_ROOT or .cache)")
    p.add_argument("--precisions", type=lambda s: s.split(","), default=["bf16", "fp32"])
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 50.0])
    p.add_argument("--switch", type=int, default=575, help="0-based first step of the stage whose switch is used")
    p.add_argument("--offsets", type=lambda s: [int(x) for x in s.split(",")], default=[0, 5, 20, 45])
    p.add_argument("--far", type=lambda s: None if s == "none" else int(s), default=450,
                   help="0-based fault step far from any switch (demo: >= 100 steps from 325 and 575); none = skip")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")] if s else [], default=[0, 1, 2])
    p.add_argument("--modes", type=lambda s: s.split(","), default=["off", "on"])
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--fresh", action="store_true", help="rerun cases already in --work")
    p.add_argument("--low-loss", action="store_true", help="the clean low-loss runs instead (see above)")
    p.add_argument("--low-cases", type=lambda s: s.split(","), default=list(LOW_CASES))
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print(machine_line(), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.low_loss:
        return low_loss_main(args)
    from demo.run import data_root

    data = demo_data(args.data_root or data_root())
    rows, clean_rows, clean_dirs = [], [], {}
    for case in cases(args):
        if not case.factor:
            run_dir = train(case, "clean", args, data)
            clean_rows.append({**asdict(case), "alarms": alarms(run_dir), "val": final_val(run_dir)})
            if case.seed == 0:
                clean_dirs[case.precision] = run_dir
            continue
        off = train(case, "off", args, data) if "off" in args.modes else None
        on = train(case, "on", args, data) if "on" in args.modes else None
        rows.append(judge_case(case, off, on, clean_dirs.get(case.precision)))
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "clean": clean_rows, "cases": rows}
    (args.work / "spike_detection.json").write_text(json.dumps(report, indent=1))
    print_table(clean_rows, rows)
    for line in result_lines(clean_rows, rows):
        print(line)
    return 0


def print_table(clean_rows: list[dict], rows: list[dict]) -> None:
    print("\n| precision | LR | at (0-based) | where | loss rise | detected (spike_start) | rolled back to "
          "| val on/clean | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        detected = "—" if "detected" not in r else (f"yes, step {r['detected_at']} ({r['spike_start']})"
                                                     if r["detected"] else "**no**")
        rise = f"{100 * r['rise']:+.0f}%" if "rise" in r else "—"
        ratio = f"{r['on_ratio']:.4f}" if "on_ratio" in r else "—"
        back = r.get("to_step", "—") if r.get("rolled_back", True) else "**none**"
        verdict = {True: "met", False: "**missed**", None: "—"}[meets(r)]
        print(f"| {r['precision']} | x{r['factor']:g} | {r['at']} | {r['where']} | {rise} | {detected} | {back} | "
              f"{ratio} | {verdict} |")
    for r in clean_rows:
        found = ", ".join(r["alarms"]) or "none"
        print(f"| {r['precision']} | clean | — | {r['where']} | — | alarms: {found} | — | "
              f"val {r['val']:.4f} | {'met' if not r['alarms'] else '**missed**'} |")


def result_lines(clean_rows: list[dict], rows: list[dict]) -> list[str]:
    lines = []
    judged = [r for r in rows if meets(r) is not None]
    if judged:
        met = sum(bool(meets(r)) for r in judged)
        lines.append(result_line("spike_detection_cases_met", met, len(judged), ">=1", ok=met == len(judged)))
    if clean_rows:
        false_alarms = sum(len(r["alarms"]) for r in clean_rows)
        lines.append(result_line("spike_detection_false_alarms", false_alarms, 0, "<=0", ratio=float(false_alarms),
                                 ok=false_alarms == 0))
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
