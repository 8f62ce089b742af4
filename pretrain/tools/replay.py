"""`ayumi replay RUN_DIR --spike K`: was spike K the data or the state? PaLM's replay experiment, automated.

Three short trainings (arms) of the spike's window, each a real `ayumi train` in a scratch run that starts from one
of the run's checkpoints (checkpoint.load_from: read, never written) with the window's batches and LRs fed through
stability.inject.feed_sample and lr_set (the arms and the verdict: pretrain/stability/replay.py). The cost is
printed first; `--dry-run` stops there. Each arm's loss curve and the verdict are printed and written to
RUN_DIR/stability/replay_spike_K.json, which `ayumi report` shows. The run's own checkpoints and records are left
as they are. A replay refuses in one line (exit 2) when the ring no longer holds the checkpoints it needs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ARM_START_S = 15.0
"""Seconds an arm is assumed to take to start (processes, imports, the checkpoint load), for the stated cost."""
SET_BY_REPLAY = ("run_root", "name", "checkpoint.dir", "checkpoint.load_from", "checkpoint.resume", "checkpoint.interval",
                 "checkpoint.save_final", "checkpoint.save_initial", "stability.recovery.ring_interval",
                 "stability.action", "train.max_steps", "train.eval_interval", "logging", "stability/inject",
                 "stability.inject")
"""Keys an arm sets itself: the run's own overrides of them are left out (Hydra refuses a key given twice)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    from common.conf import config_help

    parser = argparse.ArgumentParser(prog="ayumi replay", description=__doc__.split("\n\n")[0], epilog=config_help(
        "no config from conf/: RUN_DIR's events.jsonl (the spike), metrics.jsonl (its LRs), config_history.jsonl "
        "(the overrides the arms are composed from) and its checkpoints", overrides=False))
    parser.add_argument("run_dir", type=Path, help="the run dir (holds events.jsonl with the spike)")
    parser.add_argument("--spike", type=int, required=True, help="the spike's number, counted from 1 in events.jsonl")
    parser.add_argument("--nproc", type=int, default=0,
                        help="processes per arm (default: as many as trained the spike)")
    parser.add_argument("--dry-run", action="store_true", help="print the arms and their cost, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the arms' scratch runs (RUN_DIR/stability/)")
    return parser.parse_args(argv)


def arm_overrides(run_overrides: list[str], arm, scratch: Path, action: str) -> list[str]:
    """The run's own overrides, with an arm's: its scratch run, its checkpoint, its window, feed and LRs."""
    from common.conf import override_key

    kept = [o for o in run_overrides if not any(override_key(o) == key or override_key(o).startswith(key + ".")
                                                for key in SET_BY_REPLAY)]
    lrs = ",".join(f"{step}:{lr!r}" for step, lr in sorted(arm.lr.items()))
    return [*kept, f"run_root={scratch}", f"name=arm_{arm.name}", f"checkpoint.load_from={arm.checkpoint}",
            "checkpoint.interval=0", "checkpoint.save_final=false", "stability.recovery.ring_interval=0",
            f"stability.action={action}", f"train.max_steps={arm.checkpoint_step + arm.steps}",
            "train.eval_interval=0", "logging=none", f"stability.inject.feed_sample={arm.feed_sample}",
            f"+stability.inject.lr_set={{{lrs}}}"]


def arm_action(action: str) -> str:
    """The arms keep the run's own detector and its calls; a flagged step's update is skipped as the run skipped it,
    and a spike is recorded, never rolled back from or stopped at (the window ends there): recover and stop become
    skip."""
    return action if action in ("skip", "log_only") else "skip"


def session_ranks(run_dir: Path) -> int:
    """The processes of the run's last session (its `session` event), 1 when none is recorded."""
    from pretrain.metrics import read_jsonl
    from pretrain.metrics import EVENTS_FILE

    sessions = [e for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("event") == "session"]
    return int(sessions[-1].get("world_size", 1)) if sessions else 1


def cost_lines(plan, nproc: int) -> list[str]:
    arms = plan.arms
    seconds = len(arms) * (plan.window * plan.step_seconds + ARM_START_S)
    lines = [f"replay of spike {plan.spike} (step {plan.step:,}): {len(arms)} arms of {plan.window} step(s) each on "
             f"{nproc} process(es), about {seconds:.0f} s (the run's {plan.step_seconds:.3f} s/step, "
             f"{ARM_START_S:.0f} s to start an arm)"]
    for arm in arms:
        lines.append(f"  ({arm.name}) {arm.question}: checkpoint step {arm.checkpoint_step:,}, global samples from "
                     f"{arm.feed_sample:,}, LR {min(arm.lr.values()):.3g}-{max(arm.lr.values()):.3g}")
    return lines


def curve_table(plan) -> str:
    """Each arm's loss at each step of the window, side by side; `*` marks a step its detector called a spike at,
    `!` one it flagged as an outlier."""
    head = ["window step", *[f"({arm.name}) step" for arm in plan.arms], *[f"({arm.name}) loss" for arm in plan.arms]]
    rows = []
    for offset in range(1, plan.window + 1):
        steps, losses = [], []
        for arm in plan.arms:
            step = arm.checkpoint_step + offset
            loss = dict((int(s), v) for s, v in arm.losses).get(step)
            mark = "*" if step in arm.spike_steps else ("!" if step in arm.outlier_steps else "")
            steps.append(f"{step:,}")
            losses.append("–" if loss is None else f"{loss:.4f}{mark}")
        rows.append([str(offset), *steps, *losses])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [head, *rows])


def run_arm(arm, overrides: list[str], nproc: int, log: Path) -> int:
    """One arm through the real `ayumi train` (its launcher and checks); its output goes to `log`."""
    command = [sys.executable, "-m", "pretrain.tools.cli", "train", "--nproc", str(nproc), *overrides]
    with open(log, "w", encoding="utf-8") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode


def suggest_exclusion(run_dir: Path, spike: int, path: Path) -> None:
    """A data.exclude file of the spike's suspect documents (pretrain/stability/replay.py's suspect_documents), and
    the line that uses it."""
    from pretrain.metrics import EVENTS_FILE
    from pretrain.metrics import read_jsonl
    from pretrain.stability.replay import SUSPECT_RATIO, suspect_documents
    from pretrain.step_samples import spike_events

    event = spike_events(read_jsonl(run_dir / EVENTS_FILE))[spike - 1][1]
    documents = suspect_documents(event)
    if not documents:
        print(f"no sample of the spike's batch stands {SUSPECT_RATIO:g}x above its median loss: read its batch "
              "(`ayumi report`, `ayumi batch`) before excluding anything")
        return
    lines = [f"# spike {spike} at step {event['step']:,}: documents of the samples >= {SUSPECT_RATIO:g}x the "
             "batch's median loss", *(f"{domain} {shard} {index}" for domain, shard, index in documents)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"suspects: {len(documents)} document(s) in {path}; to leave them out from the resume on: "
          f"ayumi train ... data.exclude={path}")


def main(argv: list[str] | None = None) -> int:
    from common.status import BAD_INPUT
    from pretrain.startup.record import config_for_step, run_overrides
    from pretrain.stability.replay import (
        REPLAY_DIR, ReplayError, judge, place_other_batches, plan_replay, read_arm, replay_file,
    )
    from pretrain.step_samples import StepSamplesError, open_source, step_config

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    run_dir = args.run_dir.resolve()
    try:
        if not run_dir.is_dir():
            raise ReplayError(f"run folder {args.run_dir} does not exist: give the RUN_DIR a training run wrote")
        plan = plan_replay(run_dir, args.spike)  # refusals first, before the data is opened
        try:
            cfg = step_config(run_dir, plan.step)
            place_other_batches(plan, open_source(cfg))
        except StepSamplesError as err:
            raise ReplayError(str(err)) from None
        version = config_for_step(run_dir, plan.step)
        if version is None or not version.overrides:
            raise ReplayError(f"{run_dir}/config_history.jsonl records no overrides for step {plan.step:,}: the arms "
                              "cannot be composed as the run was")
    except ReplayError as err:
        print(f"ayumi replay: {err}", file=sys.stderr)
        return BAD_INPUT
    nproc = args.nproc or session_ranks(run_dir)
    for line in cost_lines(plan, nproc):
        print(line, flush=True)
    if args.dry_run:
        return 0
    scratch = run_dir / REPLAY_DIR / f"replay_spike_{plan.spike}.scratch"
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    action = arm_action(cfg.stability.action)
    for arm in plan.arms:
        log = scratch / f"arm_{arm.name}.log"
        status = run_arm(arm, arm_overrides(run_overrides(version.overrides), arm, scratch, action), nproc, log)
        if status != 0:
            print(f"ayumi replay: arm ({arm.name}) stopped with status {status}; its output: {log}", file=sys.stderr)
            return status
        read_arm(arm, scratch / f"arm_{arm.name}")
        flagged = ", ".join(map(str, sorted({*arm.spike_steps, *arm.outlier_steps})))
        print(f"  ({arm.name}) done: {'flagged step(s) ' + flagged if arm.recurred else 'no step flagged'}", flush=True)
    judge(plan)
    print(curve_table(plan))
    print(f"verdict: {plan.verdict}: {plan.why}")
    out = replay_file(run_dir, plan.spike)
    out.write_text(json.dumps(plan.as_dict(), indent=1) + "\n", encoding="utf-8")
    print(f"written: {out} (`ayumi report` shows it)")
    if plan.verdict == "data-driven":
        suggest_exclusion(run_dir, plan.spike, out.with_suffix(".exclude.txt"))
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
