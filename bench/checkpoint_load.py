"""Benchmark: reading a checkpoint without running code costs a resume nothing that matters.

A resume (and a rollback) reads every `.pt` file of a checkpoint folder. ayumi checks the folder statically first
(`pretrain.checkpoint.safety.folder_problem`: each file's pickle opcodes and globals, nothing run) and then reads each
file with `torch.load(weights_only=True)` and its allow-list (`common.safe_load.load`). The baseline is what a resume
read before: `torch.load(weights_only=False)` of the same files, no check. Both read the same folder of a real
checkpoint, in alternating order over --repeats rounds (the page cache warm for both), in one run.

The checkpoint: the 125m preset (vocabulary 50,176; 162 M parameters; fp32 master weights and Adam moments, ZeRO-1,
one rank) after two steps on the CPU, written once into --work.

    python bench/checkpoint_load.py --work /tmp/ckload        # about 3 minutes on 2 CPU cores

Target: safe / unchecked <= 1.05 (the median of the rounds' ratios).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

TARGET = 1.05


def make_checkpoint(work: Path) -> Path:
    """A 125m checkpoint after two steps (cached in --work); returns its step folder."""
    from bench.gpu_acceptance import run_overrides
    from bench.step_overhead import write_corpus
    from data.manifest import MANIFEST_NAME

    run_dir = work / "runs" / "ck125m"
    done = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() else []
    if done:
        return done[-1]
    corpus = work / "corpus"
    if not (corpus / MANIFEST_NAME).is_file():
        write_corpus(corpus, 50176, min_tokens=50_000)
    overrides = run_overrides(work, "ck125m", "cpu", "experiment=cpu_tiny", "model=125m", "model.vocab_size=50176", "model.max_seq_len=64",
                              "deepspeed=zero1", "deepspeed.precision=fp32", "train.tokens=1024", "train.max_steps=2",
                              "train.micro_batch_size=8", "train.eval_interval=0", "checkpoint.interval=0",
                              "checkpoint.save_final=true", "checkpoint.async_save=false", "model.compile=off",
                              root=corpus)
    subprocess.run([sys.executable, "-m", "pretrain.train", *overrides], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def read_safe(tag_dir: Path) -> float:
    """Seconds for ayumi's read: the folder's static check, then each file weights-only with its allow-list."""
    from common.safe_load import load
    from pretrain.checkpoint.safety import allowed_for, folder_problem, pickled_files

    start = time.perf_counter()
    problem = folder_problem(tag_dir)
    if problem:
        raise SystemExit(problem)
    for name in pickled_files(tag_dir):
        load(tag_dir / name, allowed_for(name))
    return time.perf_counter() - start


def read_unchecked(tag_dir: Path) -> float:
    """Seconds for the former read: each file with torch.load(weights_only=False), no check (the baseline only)."""
    import torch

    from pretrain.checkpoint.safety import pickled_files

    start = time.perf_counter()
    for name in pickled_files(tag_dir):
        torch.load(tag_dir / name, map_location="cpu", weights_only=False)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/ayumi_checkpoint_load"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(machine_line())
    tag_dir = make_checkpoint(args.work)
    from pretrain.checkpoint.safety import pickled_files

    size = sum((tag_dir / name).stat().st_size for name in pickled_files(tag_dir)) / 2 ** 30
    read_safe(tag_dir), read_unchecked(tag_dir)  # warm the page cache for both
    safe, unchecked = [], []
    for round_ in range(args.repeats):
        pair = (read_safe, read_unchecked) if round_ % 2 == 0 else (read_unchecked, read_safe)
        times = {fn.__name__: fn(tag_dir) for fn in pair}
        safe.append(times["read_safe"])
        unchecked.append(times["read_unchecked"])
    ratios = [s / u for s, u in zip(safe, unchecked)]
    print(f"checkpoint {tag_dir} ({len(pickled_files(tag_dir))} files, {size:.2f} GiB)")
    print(f"safe read (static check + weights_only): median {statistics.median(safe) * 1e3:,.0f} ms; "
          f"unchecked torch.load(weights_only=False): median {statistics.median(unchecked) * 1e3:,.0f} ms")
    print(result_line("checkpoint_load_safe_vs_unchecked", statistics.median(safe) * 1e3,
                      statistics.median(unchecked) * 1e3, f"<={TARGET}", unit="ms", ratio=statistics.median(ratios),
                      spread=ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
