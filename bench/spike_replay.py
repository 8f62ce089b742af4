"""Benchmark: `ayumi replay` on two spikes whose answer is known, on a model larger than the tests' debug Llama.

Two real training runs (`ayumi train`, DeepSpeed, on this machine's devices or 2 CPU ranks), then `ayumi replay
--spike 1` on each (docs/stability.md, "Was it the data or the state?"):

  lr_x50     LR x50 for three steps at --spike-at of the run (stability.inject), action=recover: a spike of the
             state; the replay must say state-driven
  poisoned   four documents of ids the text never uses planted in en/part_00001 (byte-token text otherwise),
             a seed chosen (by reading the stream, no training) so that they land at separate steps past
             --spike-at; action=skip: each is called a spike where it lands; the replay must say data-driven,
             and `ayumi report`'s attribution must flag en/part_00001

The model is the debug preset widened (--hidden, --layers); fp32, so the replay's arm (a) retrains the logged
losses. Prints the verdict table and ends with one RESULT line per case: ours is the replay's seconds, the baseline
the run's own training seconds, and the line is ok when the verdict is the expected one (and, for the poisoned
run, the attribution flags en/part_00001 alone) and the replay costs at most REPLAY_COST_TARGET times the run.

    python bench/spike_replay.py                        # ~3 min on a 2-core box
    python bench/spike_replay.py --hidden 64 --layers 2 --steps 64   # the tests' size, quicker
    python bench/spike_replay.py --work WORK_DIR        # keep the corpus, runs and logs
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line, target_met  # noqa: E402  (first: it reads the load)

REPLAY_COST_TARGET = "<=2.0"
"""Three arms of the spike's window, each a fresh `ayumi train`, against the run that trained up to the spike."""

GARBAGE = (300, 500)
"""The poison's ids: never in the byte-token text (bytes and EOS 256)."""
POISON_DOCS = 4


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="keep everything here (default: a temp dir)")
    parser.add_argument("--hidden", type=int, default=256, help="model.hidden_size (the debug preset's 64 widened)")
    parser.add_argument("--layers", type=int, default=4, help="model.num_layers")
    parser.add_argument("--steps", type=int, default=96, help="steps of each run")
    parser.add_argument("--spike-at", type=float, default=0.4, help="where the spikes begin, as a share of the run")
    parser.add_argument("--nproc", type=int, default=1, help="ranks of each run and each replay arm")
    return parser.parse_args(argv)


def write_poisoned_corpus(root: Path) -> Path:
    """The tests' two-domain byte-token corpus, plus en/train/part_00001: POISON_DOCS documents of 63 garbage ids."""
    import numpy as np

    from data.token_root import TokenRoot
    from tests.helpers import EN_TEXT, EOS, JA_TEXT, byte_tokens

    rng = np.random.default_rng(0)
    with TokenRoot(root, vocab_size=512, eos_id=EOS, name="poisoned") as out:
        for name, text in (("ja", JA_TEXT), ("en", EN_TEXT)):
            for split, count in (("train", 40), ("val", 4)):
                with out.shard(name, split) as writer:
                    for _ in range(count):
                        writer.add_document(byte_tokens(text))
        with out.shard("en", "train") as writer:
            for _ in range(POISON_DOCS):
                writer.add_document(rng.integers(*GARBAGE, size=63).tolist() + [EOS])
    return root


def poison_seed(corpus: Path, global_batch: int, steps: int, first: int) -> tuple[int, list[int]]:
    """A seed whose stream brings the poison to three or more separate steps from `first` on (attribution needs
    more than one spike to tell a source from chance), and those steps (1-based)."""
    from data.domains import open_run_data
    from data.packed import ShuffledDomains
    from data.provenance import sample_pieces

    _, train, _ = open_run_data(corpus, None, 64, 512, "sizes", False)
    for seed in range(1000):
        source, hits = ShuffledDomains(train, seed=seed), []
        for index in range(global_batch * steps):
            name, _, sample, samples = source.origin(index)
            if name == "en" and any(p.shard == "part_00001" and p.stop - p.start > 2
                                    for p in sample_pieces(samples, sample)):
                hits.append(index // global_batch + 1)
        if len(hits) >= 3 and hits[0] >= first and all(b - a >= 6 for a, b in zip(hits, hits[1:])):
            return seed, hits
    raise SystemExit("no seed in 1000 puts the poison past --spike-at at separate steps: change --steps")


def ayumi(*args: str, log: Path) -> tuple[int, str, float]:
    """Run an ayumi command; (status, its output, seconds). The output is kept in `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout)
    return proc.returncode, proc.stdout, time.perf_counter() - started


def common(args, corpus: Path, runs: Path) -> list[str]:
    heads = max(1, args.hidden // 64)
    lr = 3e-3 * min(1.0, 64 / args.hidden)  # cpu_tiny's LR at the debug width; a wider model spikes on its own at it
    return ["experiment=cpu_tiny", f"optim.lr={lr:g}", f"optim.min_lr={lr / 10:g}", f"data.root={corpus}", f"run_root={runs}", "logging=none",
            "deepspeed.precision=fp32", f"model.hidden_size={args.hidden}", f"model.intermediate_size={args.hidden * 3}",
            f"model.num_layers={args.layers}", f"model.num_heads={heads}", f"model.num_kv_heads={heads}",
            "train.micro_batch_size=2", "train.global_batch_size=4", f"train.tokens={args.steps * 4 * 64}",
            "train.eval_interval=0", "stability.detector.warmup_steps=20", "stability.detector.min_history=10"]


def run_case(name: str, args, overrides: list[str], work: Path, planted: list[int]) -> dict:
    """Train the case, replay its spike at one of the `planted` steps (a wider model may spike on its own too)."""
    status, out, train_s = ayumi("train", "--nproc", str(args.nproc), *overrides, log=work / f"{name}_train.log")
    if status != 0:
        raise SystemExit(f"{name}: training stopped with status {status}; see {work / f'{name}_train.log'}")
    run_dir = work / name / "cpu_tiny"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    spikes = [e["step"] for e in events if e["event"] == "spike"]
    number = next((k for k, step in enumerate(spikes, 1) if step in planted), None)
    if number is None:
        raise SystemExit(f"{name}: no spike at the planted steps {planted} (spikes at {spikes}); see the log")
    status, out, replay_s = ayumi("replay", str(run_dir), "--spike", str(number), "--nproc", str(args.nproc),
                                  log=work / f"{name}_replay.log")
    if status != 0:
        raise SystemExit(f"{name}: replay stopped with status {status}; see {work / f'{name}_replay.log'}")
    record = json.loads((run_dir / "stability" / f"replay_spike_{number}.json").read_text())
    ayumi("report", str(run_dir), log=work / f"{name}_report.log")
    summary = (run_dir / "report" / "summary.md").read_text()
    flagged = [line.split("|")[1].strip() for line in summary.split("## Spike attribution")[-1].splitlines()
               if "more than chance" in line]
    return {"record": record, "train_s": train_s, "replay_s": replay_s, "flagged": flagged}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    print(machine_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="spike_replay-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = write_poisoned_corpus(work / "corpus")
    at = max(28, int(args.steps * args.spike_at))  # past the detector's warm-up and an earlier checkpoint
    seed, hits = poison_seed(corpus, 4, args.steps, at)
    print(f"model hidden {args.hidden} x {args.layers} layers, {args.steps} steps; the poison lands at steps {hits} "
          f"(seed {seed}); LR x50 at steps {at + 1}-{at + 3}", flush=True)
    cases = {
        "lr_x50": ("state-driven", [*common(args, corpus, work / "lr_x50"), "checkpoint.interval=0",
                                    "stability.recovery.ring_interval=4", "stability.recovery.rollback_steps=4",
                                    "stability.recovery.skip_batches=2", "stability.recovery.ring_keep=40",
                                    "stability.recovery.lr_cooldown_steps=4", f"train.max_steps={at + 8}",
                                    f"+stability.inject.lr_multiply={{{at}:50.0,{at + 1}:50.0,{at + 2}:50.0}}"]),
        "poisoned": ("data-driven", [*common(args, corpus, work / "poisoned"), f"train.seed={seed}",
                                     "checkpoint.interval=4", "checkpoint.keep_last=1000", "stability.action=skip",
                                     "stability.detector.large_loss_rise=0.15"]),
    }
    planted = {"lr_x50": list(range(at + 1, at + 9)), "poisoned": hits}
    rows = []
    for name, (expected, overrides) in cases.items():
        result = run_case(name, args, overrides, work, planted[name])
        record = result["record"]
        arms = " ".join(f"({a['name']}){'+' if a['recurred'] else '-'}" for a in record["arms"])
        rows.append((name, expected, record["verdict"], record["step"], record["window"], arms, result["flagged"],
                     result["train_s"], result["replay_s"]))
    print(f"\n{'case':<10} {'expected':<13} {'verdict':<17} {'spike':>5} {'window':>6}  {'arms':<15} "
          f"{'attribution flags':<22} {'train s':>7} {'replay s':>8}")
    for name, expected, verdict, step, window, arms, flagged, train_s, replay_s in rows:
        print(f"{name:<10} {expected:<13} {verdict:<17} {step:>5} {window:>6}  {arms:<15} "
              f"{', '.join(flagged) or '-':<22} {train_s:>7.1f} {replay_s:>8.1f}")
    print()
    ok_all = True
    for name, expected, verdict, _, _, _, flagged, train_s, replay_s in rows:
        right = verdict == expected and (name != "poisoned" or flagged == ["en/part_00001"])
        ok = right and target_met(REPLAY_COST_TARGET, replay_s, replay_s / train_s)
        ok_all &= ok
        print(f"verdict {name}: {verdict} (expected {expected}){'' if right else ': WRONG'}")
        print(result_line(f"spike_replay_{name}", replay_s, train_s, REPLAY_COST_TARGET, unit="s", ok=ok))
    print(f"(runs, logs and reports in {work})")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
