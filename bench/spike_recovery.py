"""Benchmark: a loss spike with ayumi's recovery on, off, and no spike at all.

Three real 2-rank training jobs (torchrun, gloo, DeepSpeed on CPU), identical config and seeds:

  clean     no fault; the stability machinery on (recover), so any false alarm shows up here
  off       LR x K for a few steps mid-run; `stability.action=log_only`: the detector runs and
            logs the spike but nothing acts (non-finite steps would still be skipped)
  on        the same fault; `stability.action=recover`: skip the outlier updates, roll back to a
            ring checkpoint >= rollback_steps before the spike, skip batches, cool the LR

The fault is `stability.inject.lr_multiply` (fires once: a replay after the rollback runs clean),
so `off` and `on` are bitwise the same run as `clean` up to the spike (checked and printed).

Workload: the debug Llama (cpu_tiny experiment, vocab 512) on byte tokens of real text that is
on every machine with Python: two domains, `code` (the standard library's .py files) and `docs`
(their docstrings, extracted with `ast`), split into train/val *by file* (every 10th file by a
hash of its path is validation), so validation is unseen text, not the repeated tiny corpus.

Figures, read from each run's own files:
  final val loss   the last metrics.jsonl record with `val/loss` (the evaluation after the last
                   step: mean over the domains of the loss on the same `eval_samples` val samples)
  wasted steps     steps computed that are not in the final model's timeline: optimizer steps
                   computed (train records in metrics.jsonl) minus the run's steps, i.e. the steps
                   from the rollback target to the detection that were thrown away (cross-checked
                   against events.jsonl: detection step + 1 - to_step), plus the updates skipped
                   in the final timeline (`opt/skipped_steps` of the last record)
  steps lost       the val loss the run ends with, read off the clean run's val curve: how many
                   steps earlier the clean run had already been as good (0 = as good as clean)
  recovery latency `latency_s` of the `recovered` event (load checkpoint + skip data + rewind the
                   detector), plus the synchronous save the trainer does right after a rollback
                   before it trains again (parsed from the console: "saved checkpoint ... (after
                   rollback, X s)", 0.1 s resolution). Baseline: one checkpoint load of the same
                   run's checkpoint (ayumi's Checkpointer.load = DeepSpeed load + shared state +
                   RNG), timed in a separate 2-rank job on the `on` run's final checkpoint (median
                   of --load-repeats), + 5 s.

    python bench/spike_recovery.py                  # ~3-5 min on a 2-core box
    python bench/spike_recovery.py --work /tmp/sr   # keep corpus, runs and logs
    python bench/spike_recovery.py --spike-factor 100 --spike-step 500 --steps 700

Ends with:
  RESULT spike_recovery_val     ours=<val on>  baseline=<val clean> ratio=<on/clean>  target=<=1.02 ok=...
  RESULT spike_no_recovery_val  ours=<val off> baseline=<val clean> ratio=<off/clean> target=>1.02  ok=...
  RESULT recovery_latency       ours=<s>s      baseline=<load+5>s   ratio=...         target=<=1    ok=...
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line, target_met  # noqa: E402  (first: it reads the load at the start)

EOS = 256
VOCAB = 512
TARGET_ON = 1.02  # recovery on ends within 2% of clean
TARGET_OFF = 1.02  # recovery off ends visibly worse than that
LATENCY_SLACK_S = 5.0
RUNS = ("clean", "off", "on")


# ----------------------------------------------------------------------------------------------
# Corpus: real text that every Python installation has
# ----------------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                out.append(doc)
    return out


def write_corpus(root: Path, max_train_bytes: int, max_val_bytes: int) -> dict:
    """code/ and docs/ domains, train/ and val/ split by source file; returns byte counts."""
    import numpy as np

    from data.token_root import TokenRoot

    files = stdlib_files()
    if not files:
        raise SystemExit(f"no .py files under {sysconfig.get_paths()['stdlib']}: cannot build the corpus")
    base = Path(sysconfig.get_paths()["stdlib"])
    docs: dict[tuple[str, str], list[bytes]] = {(d, s): [] for d in ("code", "docs") for s in ("train", "val")}
    # A fixed pseudo-random file order, so the byte caps sample the whole library, not its first letters.
    for path in sorted(files, key=lambda p: zlib.crc32(str(p.relative_to(base)).encode() + b"#order")):
        split = "val" if zlib.crc32(str(path.relative_to(base)).encode()) % 10 == 0 else "train"
        raw = path.read_bytes()
        docs[("code", split)].append(raw)
        text = raw.decode("utf-8", "replace")
        docs[("docs", split)] += [d.encode("utf-8", errors="replace") for d in docstrings(text)]
    sizes = {}
    with TokenRoot(root, vocab_size=VOCAB, eos_id=EOS, name="stdlib") as out:
        for (domain, split), items in docs.items():
            cap = max_train_bytes if split == "train" else max_val_bytes
            total = 0
            with out.shard(domain, split) as writer:
                for item in items:
                    if total >= cap:
                        break
                    item = item[:cap - total]
                    writer.add_document(np.append(np.frombuffer(item, dtype=np.uint8).astype(np.int64), EOS))
                    total += len(item) + 1
            sizes[f"{domain}/{split}"] = total
    (root / "corpus.json").write_text(json.dumps(sizes))
    return sizes


# ----------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------


def common_overrides(args: argparse.Namespace, data: Path, run_root: Path) -> list[str]:
    """The workload, identical for the three runs (and the load-timing job)."""
    tokens = args.steps * args.global_batch * args.seq
    return [
        # model.vocab_size set: the worker composes with compose_config, which leaves cpu_tiny's 0 (follow the
        # tokenizer) unresolved; VOCAB is the byte corpus's vocabulary.
        "experiment=cpu_tiny", f"model.vocab_size={VOCAB}", f"data.root={data}", f"run_root={run_root}", "logging=none",
        f"train.tokens={tokens}", f"train.seq_len={args.seq}", f"model.max_seq_len={args.seq}",
        f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={args.global_batch // 2}",
        f"train.seed={args.seed}", f"train.eval_interval={args.eval_interval}",
        f"train.eval_samples={args.eval_samples}", f"optim.lr={args.lr}", f"optim.min_lr={args.lr / 10}",
        "checkpoint.interval=0", "checkpoint.resume=false",
        f"stability.detector.warmup_steps={args.detector_warmup}",
        f"stability.detector.min_history={args.min_history}",
        f"stability.recovery.ring_interval={args.ring_interval}",
        f"stability.recovery.rollback_steps={args.rollback_steps}",
        f"stability.recovery.skip_batches={args.skip_batches}",
        f"stability.recovery.lr_cooldown_steps={args.cooldown_steps}",
    ]


def run_overrides(kind: str, args: argparse.Namespace) -> list[str]:
    out = [f"name={kind}"]
    if kind != "clean":
        spike = ",".join(f"{args.spike_step + i}:{args.spike_factor}" for i in range(args.spike_len))
        out.append(f"+stability.inject.lr_multiply={{{spike}}}")
    out.append("stability.action=" + ("log_only" if kind == "off" else "recover"))
    return out


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(DS_ACCELERATOR="cpu", WANDB_MODE="disabled", WANDB_SILENT="true", OMP_NUM_THREADS="1",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    return e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(cmd: list[str], log: Path, timeout: int) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "w") as handle:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env(), stdout=handle, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - start


def train(kind: str, args: argparse.Namespace, work: Path) -> Path:
    from pretrain.tools.launch import launcher_command

    run_dir = work / "runs" / kind
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = common_overrides(args, work / "corpus", work / "runs") + run_overrides(kind, args)
    cmd = launcher_command("torchrun", 2, overrides, master_port=free_port())
    log = work / f"{kind}.log"
    print(f"[spike_recovery] run {kind:5s} ...", end=" ", flush=True)
    rc, wall = launch(cmd, log, args.timeout)
    print(f"rc {rc}, {wall:.0f}s (log {log})", flush=True)
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"run {kind} failed (rc {rc}):\n{' '.join(cmd)}\n{tail}")
    return run_dir


def time_checkpoint_load(args: argparse.Namespace, work: Path, checkpoint_root: Path) -> dict:
    """One checkpoint load of the `on` run's newest checkpoint, in a fresh 2-rank job."""
    out = work / "load.json"
    out.unlink(missing_ok=True)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve()), "--load-worker",
           "--out", str(out), "--checkpoint-root", str(checkpoint_root), "--load-repeats", str(args.load_repeats),
           "--", *common_overrides(args, work / "corpus", work / "runs"), "name=load_timing",
           "stability.action=recover"]
    log = work / "load.log"
    print("[spike_recovery] timing a checkpoint load ...", end=" ", flush=True)
    rc, wall = launch(cmd, log, args.timeout)
    print(f"rc {rc}, {wall:.0f}s", flush=True)
    if rc != 0 or not out.exists():
        raise SystemExit(f"load timing failed (rc {rc}):\n{log.read_text(errors='replace')[-3000:]}")
    return json.loads(out.read_text())


def load_worker(argv: list[str]) -> int:
    """Under torchrun: build the trainer as pretrain.train does, time Checkpointer.load."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-root", required=True)
    p.add_argument("--load-repeats", type=int, default=3)
    ns, overrides = p.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    from omegaconf import OmegaConf

    from pretrain.checkpoint.checkpointer import latest_tag
    from pretrain.config import check_config, compose_config, to_object
    from pretrain.engine.distributed import barrier, exit_process, init_distributed
    from pretrain.train import build_trainer

    cfg = to_object(compose_config(overrides))
    check_config(cfg)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    dinfo = init_distributed(cfg.train.device)
    trainer, logger = build_trainer(cfg, dinfo, resolved)
    root = Path(ns.checkpoint_root)
    tag = latest_tag(root)
    times = []
    for _ in range(ns.load_repeats):
        barrier()
        start = time.perf_counter()
        trainer.checkpoints.long_term.load(trainer.engine, tag, root=root)
        barrier()
        times.append(time.perf_counter() - start)
    size = sum(f.stat().st_size for f in (root / tag).rglob("*") if f.is_file())
    if dinfo.rank == 0:
        Path(ns.out).write_text(json.dumps({"times_s": times, "tag": tag, "bytes": size}))
    trainer.loader.close()
    logger.close()
    exit_process(0)  # not a plain return: gloo can abort in Python's shutdown (distributed.exit_process)


# ----------------------------------------------------------------------------------------------
# Reading a run
# ----------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyse(run_dir: Path, log: Path, total_steps: int) -> dict:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    train_recs = [r for r in metrics if "train/loss" in r]
    val_recs = [r for r in metrics if "val/loss" in r]
    final = val_recs[-1] if val_recs else {}
    # The val curve of the final timeline: after a rollback the earlier steps are evaluated again.
    curve: dict[int, float] = {}
    for r in val_recs:
        for step in [s for s in curve if s >= r["step"]]:
            del curve[step]
        curve[r["step"]] = r["val/loss"]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    recovered = [e for e in events if e["event"] == "recovered"]
    spikes = [e for e in events if e["event"] == "spike"]
    skips = [e for e in events if e["event"] == "skip_update"]
    computed = len(train_recs)
    rollback_wasted = computed - total_steps
    by_events = sum(e["step"] + 1 - e["to_step"] for e in rollbacks)
    skipped_final = int(train_recs[-1].get("opt/skipped_steps", 0)) if train_recs else 0
    saves = [float(s) for s in re.findall(r"\(after rollback, ([\d.]+)s\)", log.read_text(errors="replace"))]
    return {
        "val": final.get("val/loss", float("nan")),
        "val_domains": {k.split("/")[1]: v for k, v in final.items() if k.startswith("val/") and k.count("/") == 2},
        "val_step": final.get("step"), "curve": curve,
        "train": {r["step"]: r["train/loss"] for r in train_recs},  # final timeline (later records win)
        "train_all": [(r["step"], r["train/loss"]) for r in train_recs],
        "computed": computed, "rollback_wasted": rollback_wasted, "rollback_wasted_events": by_events,
        "skipped_final": skipped_final, "wasted": rollback_wasted + skipped_final,
        "spikes": spikes, "rollbacks": rollbacks, "recovered": recovered, "skip_events": skips,
        "latency_s": [e.get("latency_s") for e in recovered], "after_rollback_save_s": saves,
    }


def steps_lost(val: float, clean_curve: dict[int, float], total: int) -> float | None:
    """total - the step at which the clean run's val curve reached `val` (linear interpolation)."""
    points = sorted(clean_curve.items())
    if not math.isfinite(val) or not points:
        return None
    if val <= points[-1][1]:
        return 0.0
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v0 >= val >= v1 and v0 != v1:
            return total - (s0 + (v0 - val) / (v0 - v1) * (s1 - s0))
    return float(total)  # worse than the clean run's first evaluation


def first_divergence(a: dict[int, float], b: dict[int, float]) -> int | None:
    for step in sorted(set(a) & set(b)):
        if a[step] != b[step]:
            return step
    return None


def recovery_point(run: dict, clean: dict, after: int, tol: float, window: int = 20) -> int | None:
    """First step >= after where the run's `window`-step mean train loss is within tol of clean's."""
    steps = sorted(s for s in run["train"] if s in clean["train"] and s > after)
    for i in range(len(steps) - window + 1):
        chunk = steps[i:i + window]
        ours = statistics.fmean(run["train"][s] for s in chunk)
        ref = statistics.fmean(clean["train"][s] for s in chunk)
        if math.isfinite(ours) and ours <= ref * (1 + tol):
            return chunk[0]
    return None


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per run")
    p.add_argument("--spike-step", type=int, default=400, help="first step with the multiplied LR")
    p.add_argument("--spike-len", type=int, default=3, help="steps with the multiplied LR")
    p.add_argument("--spike-factor", type=float, default=50.0, help="K: LR x K during the spike")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16, help="samples per step (2 ranks, no accumulation)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak LR (cpu_tiny's); min LR = lr/10, cosine")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-samples", type=int, default=256, help="val samples per domain per evaluation")
    p.add_argument("--detector-warmup", type=int, default=100, help="stability.detector.warmup_steps (default 100)")
    p.add_argument("--min-history", type=int, default=50, help="stability.detector.min_history (default 50)")
    p.add_argument("--ring-interval", type=int, default=25, help="stability.recovery.ring_interval")
    p.add_argument("--rollback-steps", type=int, default=50, help="stability.recovery.rollback_steps")
    p.add_argument("--skip-batches", type=int, default=50, help="stability.recovery.skip_batches")
    p.add_argument("--cooldown-steps", type=int, default=50, help="stability.recovery.lr_cooldown_steps")
    p.add_argument("--max-train-bytes", type=int, default=3_000_000, help="per domain")
    p.add_argument("--max-val-bytes", type=int, default=300_000, help="per domain")
    p.add_argument("--load-repeats", type=int, default=5)
    p.add_argument("--work", default=None, help="keep corpus, run dirs and logs here (default: a temp dir)")
    p.add_argument("--reuse-runs", action="store_true", help="analyse existing runs under --work, do not train")
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    return p.parse_args(argv)


def fmt(x: float | None, spec: str = ".4f", missing: str = "n/a") -> str:
    return missing if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--load-worker":
        return load_worker(argv[1:])
    args = parse_args(argv)
    print(machine_line(), flush=True)
    if args.global_batch % 2:
        raise SystemExit("--global-batch must be even (2 ranks)")
    keep = args.work is not None
    work = Path(args.work).resolve() if keep else Path(tempfile.mkdtemp(prefix="ayumi_spike_recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return bench(args, work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def bench(args: argparse.Namespace, work: Path) -> int:
    corpus = work / "corpus"
    if not (corpus / "corpus.json").exists():
        shutil.rmtree(corpus, ignore_errors=True)
        write_corpus(corpus, args.max_train_bytes, args.max_val_bytes)
    sizes = json.loads((corpus / "corpus.json").read_text())
    total = args.steps
    print(f"[spike_recovery] corpus (byte tokens of the Python {sys.version_info.major}.{sys.version_info.minor} "
          f"stdlib, split by file): " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in sizes.items()))
    print(f"[spike_recovery] workload: debug Llama, 2 CPU ranks, {total} steps x {args.global_batch} x {args.seq} "
          f"tokens, LR {args.lr:g} cosine; spike: LR x{args.spike_factor:g} at steps {args.spike_step}.."
          f"{args.spike_step + args.spike_len - 1}; recovery: ring every {args.ring_interval}, rollback >= "
          f"{args.rollback_steps}, skip {args.skip_batches} batches, LR x0.5 cooling over {args.cooldown_steps}")
    walls = {}
    for kind in RUNS:
        if not args.reuse_runs:
            t = time.perf_counter()
            train(kind, args, work)
            walls[kind] = time.perf_counter() - t
    runs = {kind: analyse(work / "runs" / kind, work / f"{kind}.log", total) for kind in RUNS}
    clean, off, on = runs["clean"], runs["off"], runs["on"]
    load = time_checkpoint_load(args, work, work / "runs" / "on" / "checkpoints")
    load_s = statistics.median(load["times_s"])

    # -- sanity: same run up to the spike -------------------------------------------------------
    for kind in ("off", "on"):
        first_timeline: dict[int, float] = {}
        for step, loss in runs[kind]["train_all"]:
            first_timeline.setdefault(step, loss)  # before any rollback replays the step
        first = first_divergence(clean["train"], first_timeline)
        # metrics steps are 1-based (k+1 after step k): the spike step k shows first as record k+1
        same = first is None or first > args.spike_step
        print(f"  {kind}: train loss bitwise equal to clean up to record {first - 1 if first else total} "
              f"(spike at step {args.spike_step} = record {args.spike_step + 1}): {'yes' if same else 'NO'}")

    # -- table -------------------------------------------------------------------------------
    print()
    print(f"{'run':6s} {'final val':>9s} {'vs clean':>8s} {'code':>7s} {'docs':>7s} {'computed':>8s} "
          f"{'wasted':>6s} {'steps lost':>10s} {'spike seen':>10s} {'events'}")
    for kind in RUNS:
        r = runs[kind]
        lost = steps_lost(r["val"], clean["curve"], total)
        seen = ",".join(str(e["step"]) for e in r["spikes"]) or "-"
        ev = (f"{len(r['skip_events'])} skip_update, {len(r['rollbacks'])} rollback"
              + (f" -> {','.join(str(e['to_step']) for e in r['rollbacks'])}" if r["rollbacks"] else ""))
        d = r["val_domains"]
        print(f"{kind:6s} {fmt(r['val']):>9s} {fmt(r['val'] / clean['val'], '.3f'):>8s} {fmt(d.get('code')):>7s} "
              f"{fmt(d.get('docs')):>7s} {r['computed']:>8d} {r['wasted']:>6d} {fmt(lost, '.0f'):>10s} "
              f"{seen:>10s} {ev}")
    marks = sorted({s for s in clean["curve"] if s >= args.spike_step - 2 * args.eval_interval}
                   | {max(clean["curve"], default=0)})
    marks = [s for s in marks if s % (2 * args.eval_interval) == 0 or s == max(marks) or s == min(marks)]
    print("val loss at step: " + "  ".join(f"{s:>6d}" for s in marks))
    for kind in RUNS:
        print(f"  {kind:14s} " + "  ".join(f"{fmt(runs[kind]['curve'].get(s), '.3f'):>6s}" for s in marks))
    print()
    off_back = recovery_point(off, clean, args.spike_step + args.spike_len, 0.02)

    def peak(run: dict) -> float | None:
        return max((loss for step, loss in run["train"].items() if step > args.spike_step), default=None)

    print(f"off: the 20-step mean train loss is back within 2% of clean's at step "
          f"{off_back if off_back is not None else 'never (by the end of the run)'}; "
          f"peak train loss after the spike {fmt(peak(off), '.3f')} vs clean {fmt(peak(clean), '.3f')}")
    if on["rollbacks"]:
        rb = on["rollbacks"][0]
        print(f"on: spike detected at step {rb['step']} (spike began {on['spikes'][0].get('spike_start')}), rolled "
              f"back to {rb['to_step']}: {on['rollback_wasted']} steps recomputed (events say "
              f"{on['rollback_wasted_events']}), {on['skipped_final']} updates skipped in the final timeline, "
              f"{args.skip_batches} batches of data skipped")
    else:
        print("on: NO rollback happened (see the events column)")
    if clean["skip_events"] or clean["rollbacks"]:
        print(f"clean: FALSE ALARMS: {len(clean['skip_events'])} skipped updates, {len(clean['rollbacks'])} rollbacks "
              f"at steps {[e['step'] for e in clean['skip_events'] + clean['rollbacks']]}")
    if walls:
        print("wall time per run: " + ", ".join(f"{k} {v:.0f}s" for k, v in walls.items()))

    latency = on["latency_s"][0] if on["latency_s"] else None
    save = on["after_rollback_save_s"][0] if on["after_rollback_save_s"] else 0.0
    total_latency = latency + save if latency is not None else None
    print(f"latency: recovered.latency_s {fmt(latency, '.3f')} s (load + skip + rewind) + post-rollback save "
          f"{save:.1f} s = {fmt(total_latency, '.3f')} s; one checkpoint load of {load['tag']} "
          f"({load['bytes'] / 1e6:.1f} MB, both ranks' shards) in a separate job: median {load_s:.3f} s "
          f"(runs {', '.join(f'{t:.3f}' for t in load['times_s'])})")
    print()

    for line in result_lines(clean, off, on, total_latency, load["times_s"]):
        print(line)
    return 0


def result_lines(clean: dict, off: dict, on: dict, latency: float | None, load_times: list[float]) -> list[str]:
    """The three RESULT lines. The val losses are deterministic on the CPU (n=1); the latency's spread is the
    ratio against each timed load of the baseline."""
    nan = float("nan")
    on_target, off_target = f"<={TARGET_ON}", f">{TARGET_OFF}"
    r_on, r_off = on["val"] / clean["val"], off["val"] / clean["val"]
    # Recovery counts only if it really rolled back; a run without it that diverged (nan) is as bad as it gets.
    ok_on = target_met(on_target, on["val"], r_on) and bool(on["rollbacks"])
    ok_off = (not math.isfinite(off["val"])) or target_met(off_target, off["val"], r_off)
    base = statistics.median(load_times) + LATENCY_SLACK_S
    latency = nan if latency is None else latency
    return [result_line("spike_recovery_val", on["val"], clean["val"], on_target, ratio=r_on, ok=ok_on),
            result_line("spike_no_recovery_val", off["val"], clean["val"], off_target, ratio=r_off, ok=ok_off),
            result_line("recovery_latency", latency, base, "<=1", unit="s",
                        spread=[latency / (t + LATENCY_SLACK_S) for t in load_times])]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
