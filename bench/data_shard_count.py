"""Benchmark: opening a data root of 10, 1,000 and 10,000 shards per domain at training start, and the merged root.

    .venv/bin/python bench/data_shard_count.py [--work DIR] [--repeat 3]

A root made by many tasks (`ayumi data prepare --tasks N`) or by Megatron's preprocess_data.py run per
file can hold thousands of `.bin/.idx` files per domain. The same tokens are cut three ways (2 domains,
--tokens per domain, 4 documents per shard at 10,000 shards, as `data.token_root.TokenRoot` writes them:
the shards, records and manifest `ayumi data prepare` writes); a fourth root is the 10,000-shard one after
`ayumi data merge` (data/merge.py, 256 MiB shards: one per domain here; the merge is timed). Each root is
opened in a fresh process exactly as training opens it (pretrain/stream.py: `open_training_data` and
`sample_source`, the cpu_tiny config), with data.verify=auto (every .bin's sha256 at this size) and with
data.verify=sizes (no checksums, as on data over 1 GiB), and a few global batches are drawn. Per root:
seconds to open, seconds to draw the batches, peak resident memory (the process's ru_maxrss), its
growth over the imports, and the file descriptors and memory maps the process holds after drawing.

Targets (issue 50, item 4): peak memory at 10,000 shards per domain within 2x of 10 shards; opening
10,000 shards per domain (data.verify=auto) in under 1 s. The open time against 10 shards' is a study
(each shard still costs two `stat`s, and its checksum with auto). Roots are cached under --work, and built
in child processes: on Linux a process's peak RSS (ru_maxrss) starts from its parent's at the fork.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

COUNTS = (10, 1000, 10000)
DOMAINS = ("en", "ja")
VOCAB = 32000
DOCS_PER_SHARD_AT_MOST = 4  # at 10,000 shards per domain: the smallest shards a many-task root holds
STEPS = 16
MERGED = "merged"
"""The key of the 10,000-shard root after `ayumi data merge`."""
VERIFY = ("auto", "sizes")


def build_root(root: Path, shards: int, tokens: int) -> None:
    """A data root of DOMAINS, each `tokens` tokens in `shards` shards (cached: kept when complete)."""
    import numpy as np

    from data.token_root import TokenRoot

    if (root / "manifest.json").is_file():
        return
    docs = max(COUNTS) * DOCS_PER_SHARD_AT_MOST  # the same documents in every cut
    doc_tokens = tokens // docs
    rng = np.random.default_rng(0)
    with TokenRoot(root, vocab_size=VOCAB, eos_id=2, name=f"shards_{shards}") as out:
        for domain in DOMAINS:
            ids = rng.integers(3, VOCAB, size=docs * doc_tokens, dtype=np.int64)
            ids[doc_tokens - 1::doc_tokens] = 2  # every document ends with EOS, as prepared ones do
            per_shard = docs // shards
            for shard in range(shards):
                with out.shard(domain) as writer:
                    part = slice(shard * per_shard * doc_tokens, (shard + 1) * per_shard * doc_tokens)
                    writer.add_packed(ids[part], np.full(per_shard, doc_tokens))


def build_merged(root: Path, source: Path) -> float | None:
    """`source` copied to `root` and merged by `ayumi data merge`'s function; the merge's seconds (None: cached)."""
    import shutil

    from data.merge import merge_root

    if (root / "manifest.json").is_file():
        return None
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root.with_name(root.name + ".tmp"), dirs_exist_ok=True)
    start = time.perf_counter()
    merge_root(root.with_name(root.name + ".tmp"))
    seconds = time.perf_counter() - start
    root.with_name(root.name + ".tmp").rename(root)
    return seconds


def measure(root: Path, verify: str) -> dict:
    """Open `root` as training does, draw STEPS global batches; runs in its own process (--measure)."""
    import resource

    from pretrain.config import compose_config
    from pretrain.stream import micro_batch_samples, open_training_data, sample_source

    cfg = compose_config(["experiment=cpu_tiny", f"data.root={root}", f"model.vocab_size={VOCAB}",
                          f"data.verify={verify}"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    train, _ = open_training_data(cfg)
    source = sample_source(cfg, train)
    opened = time.perf_counter()
    batch = cfg.train.global_batch_size
    drawn = 0
    for step in range(STEPS):
        for index in micro_batch_samples(source, step * batch, batch):
            drawn += int(source.get(index)[0].size)
    done = time.perf_counter()
    return {"open_s": opened - start, "draw_s": done - opened, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_imports_mb": before, "fds": len(os.listdir("/proc/self/fd")),
            "maps": sum(1 for _ in open("/proc/self/maps")), "tokens_drawn": drawn,
            "shards": sum(len(samples.readers) for samples in train.values())}


def build_fresh(root: Path, count: int | str, tokens: int):
    """`build_root` (or, for MERGED, `build_merged`) in a fresh interpreter; what it printed last, as JSON."""
    result = subprocess.run([sys.executable, __file__, "--build", str(root), str(count), "--tokens", str(tokens)],
                            capture_output=True, text=True, cwd=REPO, check=True)
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


def measure_fresh(root: Path, verify: str) -> dict:
    """`measure` in a fresh interpreter; its last stdout line is the JSON."""
    result = subprocess.run([sys.executable, __file__, "--measure", str(root), "--verify", verify],
                            capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ayumi_bench_shards"),
                        help="scratch folder (the roots are cached there)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per root; medians count")
    parser.add_argument("--tokens", type=int, default=4_000_000, help="tokens per domain, in every cut")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--verify", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.verify)))
        return 0
    if args.build:  # in a child: a process's peak RSS counts its parent's at the fork, so the parent stays small
        root, count = Path(args.build[0]), args.build[1]
        if count == MERGED:
            seconds = build_merged(root, root.with_name(root.name.removesuffix("_merged")))
            print(json.dumps(seconds))
        else:
            build_root(root, int(count), args.tokens)
        return 0
    print(machine_line())
    work = Path(args.work)
    roots = {}
    for count in COUNTS:
        roots[count] = work / f"tokens{args.tokens}_shards{count}"
        start = time.perf_counter()
        build_fresh(roots[count], count, args.tokens)
        print(f"[bench] root of {count:,} shards per domain ({len(DOMAINS)} domains, {args.tokens:,} tokens each): "
              f"ready in {time.perf_counter() - start:.1f}s")
    roots[MERGED] = work / f"tokens{args.tokens}_shards{max(COUNTS)}_merged"
    merged_s = build_fresh(roots[MERGED], MERGED, args.tokens)
    print(f"[bench] `ayumi data merge` of the {max(COUNTS):,}-shard root: "
          + (f"{merged_s:.1f}s" if merged_s is not None else "cached (remove it to time the merge again)"))
    rounds = {(root, verify): [] for root in roots for verify in VERIFY}
    for _ in range(args.repeat):  # interleaved: load from other jobs spreads over every cut
        for key in rounds:
            rounds[key].append(measure_fresh(roots[key[0]], key[1]))
    failed = {key: r["error"] for key, runs in rounds.items() for r in runs if "error" in r}
    for (root, verify), error in failed.items():
        print(f"[bench] {root} shards per domain, data.verify={verify}: failed: {error}")
    med = {key: {field: statistics.median(r[field] for r in runs) for field in runs[0]}
           for key, runs in rounds.items() if key not in failed}
    print(f"[bench] median of {args.repeat} fresh processes; open = open_training_data + sample_source, with "
          f"data.verify=auto (every .bin's sha256 at this size) and =sizes; draw = {STEPS} global batches (auto)")
    print(f"{'shards/domain':>14} {'shards':>7} {'open s auto':>12} {'open s sizes':>13} {'draw s':>8} "
          f"{'peak RSS MiB':>13} {'over imports':>13} {'fds':>6} {'maps':>6}")
    for root in roots:
        if (root, "auto") not in med or (root, "sizes") not in med:
            continue
        m, sizes = med[root, "auto"], med[root, "sizes"]
        label = f"{max(COUNTS):,} merged" if root == MERGED else f"{root:,}"
        print(f"{label:>14} {int(m['shards']):>7,} {m['open_s']:>12.3f} {sizes['open_s']:>13.3f} {m['draw_s']:>8.3f} "
              f"{m['rss_mb']:>13.1f} {m['rss_mb'] - m['rss_imports_mb']:>13.1f} {int(m['fds']):>6} {int(m['maps']):>6}")
    low, high = (min(COUNTS), "auto"), (max(COUNTS), "auto")
    if low in med and high in med:
        print(result_line("data_shard_count_peak_rss_10000_vs_10", med[high]["rss_mb"], med[low]["rss_mb"], "<=2",
                          unit="MiB", spread=[b["rss_mb"] / a["rss_mb"] for a, b in zip(rounds[low], rounds[high])]))
        print(result_line("data_shard_count_open_s_10000", med[high]["open_s"], med[low]["open_s"], "<1s", unit="s",
                          spread=[b["open_s"] for b in rounds[high]]))
        print(result_line("data_shard_count_open_s_10000_vs_10", med[high]["open_s"], med[low]["open_s"], "<=2",
                          unit="s", spread=[b["open_s"] / a["open_s"] for a, b in zip(rounds[low], rounds[high])],
                          study=True))
    else:
        print(result_line("data_shard_count_peak_rss_10000_vs_10", float("nan"), float("nan"), "<=2", unit="MiB"))
        print(result_line("data_shard_count_open_s_10000", float("nan"), float("nan"), "<1s", unit="s"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
