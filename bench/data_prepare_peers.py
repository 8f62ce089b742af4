"""Benchmark: `ayumi data prepare` against the field's tools, per worker, on the same corpus and tokenizer.

    .venv/bin/python bench/data_prepare_peers.py [--work DIR] [--repeat 2] [--profile]
    .venv/bin/python bench/data_prepare_peers.py --mb 200 --tools ayumi --repeat 5   # the 1 -> 2 worker scaling

Corpus: the demo corpus (.cache/demo_corpus, `ayumi demo` makes it; ~33 MB of jsonl: Japanese man
pages, Jane Austen, PARI/GP's manual, Python's standard library), its documents in file order
re-cut into PARTS files of about equal size, so that every tool can share them over 2 workers.
Tokenizer: the demo's 8k SentencePiece model (.cache/tokenizers/demo_8k), and for datatrove its
export `tokenizer.json` (Hugging Face `tokenizers`). Cleaning and de-duplication are off, so all
four must produce the same token ids, which the bench checks:

- ayumi: `data.prepare.prepare`, one domain of the PARTS files, clean off (normalize none, no
  whitespace tidying, dedup off), no validation split, workers=W (shards, records, keys, manifest);
- datatrove 0.10: `JsonlReader` + `MegatronDocumentTokenizer` (EOS by its post-processor) under
  `LocalPipelineExecutor`, tasks=W. Installed on first use with `pip --target .venv/datatrove-site
  --no-deps` (datatrove, loguru, humanize; the rest is ayumi's environment), never into ayumi's
  environment. With W=2 it runs as W processes of one task each (`local_tasks=1`,
  `local_rank_offset=r`): the executor's own pool of 2 workers hung on this 2-CPU machine (see
  `--datatrove-pool`);
- Megatron's `tools/preprocess_data.py` design, written here: a `multiprocessing.Pool` of W
  workers over the lines (`imap`, chunks of 32 lines, `json.loads` and encode in the worker, as
  its Encoder), megatron-core's `IndexedDatasetBuilder` in the parent, one prefix per input file;
- bare: one process, `json.loads` and `sp.encode` per line (the floor of any tool).

--mb N cycles the corpus up to N MB, each copy's documents made distinct (a first line `copy K`), so
fixed costs (starting workers, the manifest) weigh little: 33 MB took 2 workers 0.9 s.

Each run is a fresh process (its imports not timed), runs interleaved over --repeat rounds, the
best of each counts. Throughput is input MB (jsonl bytes) per second per worker; CPU seconds
(the run's process and its children) are printed beside, the figure that does not depend on what
else runs here. The scaling from 1 to 2 workers is the median over rounds of each round's
(2-worker MB/s) / (2 x 1-worker MB/s), and per CPU-second of (1-worker CPU s) / (2-worker CPU s).
--profile, or any target missed, adds a cProfile of ayumi's worker and parent (workers=0: the
parent encodes in-process, so one profile holds both), then ayumi at 1 and 2 workers under
AYUMI_PREPARE_PROFILE (data/prepare_profile.py): the parent's fixed costs, its reading, waiting and
writing, and each worker's working and idle time.
"""
from __future__ import annotations

import argparse
import array
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)
from data.prepare_profile import PROFILE_ENV  # noqa: E402

PARTS = 8
DATATROVE = ("datatrove==0.10.1", "loguru==0.7.3", "humanize==4.17.0")
SITE = REPO / ".venv" / "datatrove-site"
TOOLS = ("ayumi", "datatrove", "megatron", "bare")
MEGATRON_CHUNK_LINES = 32  # preprocess_data.py's imap chunk size


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def recut_corpus(corpus: Path, out: Path, megabytes: float = 0) -> list[Path]:
    """The corpus's documents (its *.jsonl by name, in order) cut into PARTS files of about equal bytes (cached).

    megabytes > 0: the corpus cycled until it holds that many MB, each cycle's documents made distinct by a first
    line naming the cycle (so de-duplication keeps them all, as it would a larger corpus of distinct documents).
    """
    files = sorted(corpus.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"bench: no *.jsonl in {corpus}. Fix: run `./ayumi demo` once (it builds the demo corpus), "
                         "or pass --corpus")
    parts = [out / f"part_{index:02d}.jsonl" for index in range(PARTS)]
    if all(path.is_file() for path in parts):
        return parts
    out.mkdir(parents=True, exist_ok=True)
    source = sum(path.stat().st_size for path in files)
    cycles = max(1, math.ceil(megabytes * 1e6 / source)) if megabytes else 1
    total = megabytes * 1e6 if megabytes else source
    index, written, handle = 0, 0, open(parts[0].with_suffix(".tmp"), "wb")
    for line in _cycled_lines(files, cycles):
        if megabytes and written >= total:
            break
        if written >= total * (index + 1) / PARTS and index < PARTS - 1:
            handle.close()
            index += 1
            handle = open(parts[index].with_suffix(".tmp"), "wb")
        handle.write(line)
        written += len(line)
    handle.close()
    for path in parts:
        path.with_suffix(".tmp").replace(path)
    return parts


def _cycled_lines(files: list[Path], cycles: int):
    """The files' jsonl lines, `cycles` times over; from the second cycle on, each text starts with `copy N` on a line
    of its own, so no document repeats an earlier one."""
    for cycle in range(cycles):
        for path in files:
            with open(path, "rb") as lines:
                for line in lines:
                    if cycle:
                        record = json.loads(line)
                        record["text"] = f"copy {cycle}\n{record['text']}"
                        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
                    yield line


def ensure_datatrove() -> None:
    """datatrove in .venv/datatrove-site (pip --target, no dependencies: it never touches ayumi's environment)."""
    if (SITE / "datatrove").is_dir():
        return
    print(f"[bench] installing {', '.join(DATATROVE)} into {SITE} (its own folder, no dependencies)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(SITE), *DATATROVE],
                   check=True)


# ----------------------------------------------------------------------------------------------
# The four runs (each in a fresh process: `--run TOOL`)
# ----------------------------------------------------------------------------------------------


def run_ayumi(parts: list[Path], tokenizer: Path, out: Path, workers: int) -> float:
    from data.config import CleanConfig, DataConfig, DataPrepareConfig, DomainConfig
    from data.prepare import prepare

    off = CleanConfig(normalize="none", tidy_whitespace=False, min_chars=0, dedup="off")
    domain = DomainConfig(inputs=[str(path) for path in parts], clean=off)
    cfg = DataPrepareConfig(data=DataConfig(name="peers", root=str(out), domains={"all": domain}),
                            tokenizer_dir=str(tokenizer), workers=workers, progress=False)
    start = time.perf_counter()
    prepare(cfg)
    return time.perf_counter() - start


def run_datatrove(parts: list[Path], tokenizer: Path, out: Path, workers: int, pool: bool) -> float:
    sys.path.insert(0, str(SITE))
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import MegatronDocumentTokenizer
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).id_to_token(_eos_id(tokenizer))

    def executor(rank_offset: int, local_tasks: int, pool_workers: int) -> LocalPipelineExecutor:
        steps = [JsonlReader(str(parts[0].parent), glob_pattern="part_*.jsonl"),
                 MegatronDocumentTokenizer(str(out), tokenizer_name_or_path=str(tokenizer / "tokenizer.json"),
                                           eos_token=eos)]
        return LocalPipelineExecutor(steps, tasks=workers, workers=pool_workers, local_tasks=local_tasks,
                                     local_rank_offset=rank_offset, logging_dir=str(out / "logs"),
                                     skip_completed=False)

    start = time.perf_counter()
    if pool or workers == 1:
        executor(0, workers, workers).run()
    else:  # one process per task (module doc): what a cluster's array job does too
        children = []
        for rank in range(workers):
            child = os.fork()
            if child == 0:
                try:
                    executor(rank, 1, 1).run()
                finally:
                    os._exit(0)
            children.append(child)
        for child in children:
            os.waitpid(child, 0)
    return time.perf_counter() - start


_encoder = {}


def _megatron_init(model: str, eos: int) -> None:
    import sentencepiece as spm

    _encoder["sp"], _encoder["eos"] = spm.SentencePieceProcessor(model_file=model), eos


def _megatron_encode(line: bytes) -> tuple[list[int], int]:
    """preprocess_data.py's Encoder.encode: one json line -> its ids with EOD appended (--append-eod)."""
    ids = _encoder["sp"].encode(json.loads(line)["text"])
    ids.append(_encoder["eos"])
    return ids, len(line)


def run_megatron(parts: list[Path], tokenizer: Path, out: Path, workers: int) -> float:
    import multiprocessing

    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    out.mkdir(parents=True, exist_ok=True)
    eos = _eos_id(tokenizer)
    dtype = DType.optimal_dtype(_vocab_size(tokenizer))
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(workers, _megatron_init, (str(tokenizer / "tokenizer.model"), eos)) as pool:
        for path in parts:
            builder = IndexedDatasetBuilder(str(out / f"{path.stem}.bin"), dtype=dtype)
            with open(path, "rb") as lines:
                for ids, _ in pool.imap(_megatron_encode, lines, MEGATRON_CHUNK_LINES):
                    builder.add_document(np.array(ids, dtype=dtype), [len(ids)])
            builder.finalize(str(out / f"{path.stem}.idx"))
    return time.perf_counter() - start


def run_bare(parts: list[Path], tokenizer: Path, out: Path, workers: int) -> float:
    import numpy as np
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(tokenizer / "tokenizer.model"))
    eos = _eos_id(tokenizer)
    flat = array.array("H")  # the ids, for the comparison: 2 bytes each, where lists of ints took ~36 (--mb 200)
    start = time.perf_counter()
    for path in parts:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                ids = processor.encode(json.loads(line)["text"])
                ids.append(eos)
                flat.fromlist(ids)
    elapsed = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    np.frombuffer(flat, dtype=np.uint16).tofile(out / "tokens.u16")
    return elapsed


def _eos_id(tokenizer: Path) -> int:
    return int(json.loads((tokenizer / "tokenizer_meta.json").read_text())["eos_id"])


def _vocab_size(tokenizer: Path) -> int:
    return int(json.loads((tokenizer / "tokenizer_meta.json").read_text())["vocab_size"])


def import_tool(tool: str) -> None:
    """The tool's modules, imported before the CPU clock starts (megatron-core imports torch: seconds of CPU)."""
    if tool == "ayumi":
        import data.prepare  # noqa: F401
    elif tool == "datatrove":
        sys.path.insert(0, str(SITE))
        import datatrove.executor  # noqa: F401
        import datatrove.pipeline.tokens  # noqa: F401
    elif tool == "megatron":
        import megatron.core.datasets.indexed_dataset  # noqa: F401
    import sentencepiece  # noqa: F401


def run_one(tool: str, parts: list[Path], tokenizer: Path, out: Path, workers: int, pool: bool) -> dict:
    """One run in this (fresh) process: wall seconds of the tool's call, CPU seconds of this process and its children
    (both after the imports)."""
    shutil.rmtree(out, ignore_errors=True)
    import_tool(tool)
    before = _cpu()
    if tool == "datatrove":
        seconds = run_datatrove(parts, tokenizer, out, workers, pool)
    else:
        seconds = {"ayumi": run_ayumi, "megatron": run_megatron, "bare": run_bare}[tool](parts, tokenizer, out, workers)
    return {"seconds": seconds, "cpu": _cpu() - before}


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_fresh(tool: str, args, out: Path, workers: int, timeout: float, profile: Path | None = None) -> dict:
    command = [sys.executable, __file__, "--run", tool, "--workers", str(workers), "--out", str(out),
               "--work", args.work, "--corpus", args.corpus, "--tokenizer", args.tokenizer, "--mb", str(args.mb)]
    if args.datatrove_pool:
        command.append("--datatrove-pool")
    try:
        env = {**os.environ, PROFILE_ENV: str(profile)} if profile else None
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout:.0f}s (hung?)"}
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# Token ids of each output
# ----------------------------------------------------------------------------------------------


def output_documents(tool: str, out: Path) -> list[bytes]:
    """Every document's ids (as bytes of uint16) in the order the tool wrote them."""
    import numpy as np

    from data.shards import ShardReader, find_shards

    if tool == "bare":
        return [np.fromfile(out / "tokens.u16", dtype=np.uint16).tobytes()]
    folder = {"ayumi": out / "all" / "train", "datatrove": out, "megatron": out}[tool]
    documents = []
    for prefix in find_shards(folder):
        reader = ShardReader(prefix)
        documents += [reader.document(index).astype(np.uint16).tobytes() for index in range(reader.num_docs)]
    return documents


def compare_ids(work: Path, workers: tuple[int, ...], tools: list[str]) -> list[str]:
    """Lines saying whether every output holds the bare loop's ids: in order for one worker; for datatrove's W
    tasks, whose files interleave the inputs (files[rank::W]), as the same documents in another order."""
    reference = output_documents("bare", work / "out_bare_1")[0]
    lines = []
    for tool in [tool for tool in ("ayumi", "datatrove", "megatron") if tool in tools]:
        for count in workers:
            out = work / f"out_{tool}_{count}"
            if not out.is_dir():
                continue
            documents = output_documents(tool, out)
            same_order = b"".join(documents) == reference
            if same_order or tool != "datatrove" or count == 1:
                verdict = "identical" if same_order else "DIFFERENT"
            else:
                ordered = sorted(documents)
                verdict = "the same documents, in task order" if sum(map(len, ordered)) == len(reference) and \
                    ordered == sorted(output_documents("datatrove", work / "out_datatrove_1")) else "DIFFERENT"
            lines.append(f"[bench] token ids, {tool} workers={count} vs bare loop: {verdict} "
                         f"({sum(map(len, documents)) // 2:,} tokens, {len(documents):,} documents)")
    return lines


# ----------------------------------------------------------------------------------------------
# Profile of ayumi's pipeline
# ----------------------------------------------------------------------------------------------


def profile_ayumi(parts: list[Path], tokenizer: Path, out: Path) -> None:
    """cProfile of `prepare` with workers=0 (parent and worker work in one process); the top functions by own time."""
    import cProfile
    import pstats

    from data.config import CleanConfig, DataConfig, DataPrepareConfig, DomainConfig
    from data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    off = CleanConfig(normalize="none", tidy_whitespace=False, min_chars=0, dedup="off")
    cfg = DataPrepareConfig(data=DataConfig(name="peers", root=str(out), domains={
        "all": DomainConfig(inputs=[str(path) for path in parts], clean=off)}),
        tokenizer_dir=str(tokenizer), workers=0, progress=False)
    profiler = cProfile.Profile()
    profiler.enable()
    prepare(cfg)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = stats.total_tt
    print(f"[profile] ayumi, workers=0 (one process does the workers' and the parent's work): {total:.2f}s")
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:12]
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        print(f"[profile]   {own:6.2f}s own ({100 * own / total:4.1f}%) {calls:>9,} calls  {Path(path).name}:{line} {name}")


def profile_ayumi_workers(args, work: Path, megabytes: float) -> None:
    """ayumi at 1 and 2 workers under AYUMI_PREPARE_PROFILE (fresh processes): where the wall time of each went, in the
    parent (reading, waiting on the workers, routing and writing, the fixed costs) and in each worker (working, idle)."""
    for count in (1, 2):
        path = work / f"profile_ayumi_{count}.json"
        run = measure_fresh("ayumi", args, work / "out_profile_workers", count, timeout=600, profile=path)
        if "error" in run:
            print(f"[profile] ayumi workers={count}: failed: {run['error']}")
            continue
        profile = json.loads(path.read_text())
        wall, phases, stream = profile["wall"], profile["phases"], profile["stream"]
        print(f"[profile] ayumi workers={count}: {wall:.2f}s, {megabytes / wall:.1f} MB/s, CPU {run['cpu']:.2f}s")
        fixed = {name: phases.get(name, 0.0) for name in ("start", "closing_pool", "overlap_and_manifest")}
        fixed["finishing_domains"] = stream["finishing_domains"]
        print("[profile]   fixed costs: " + ", ".join(f"{name} {seconds:.3f}s" for name, seconds in fixed.items()))
        print("[profile]   parent during the stream: " + ", ".join(
            f"{name} {stream[name]:.2f}s" for name in ("reading", "waiting_on_workers", "routing_and_writing")))
        for index, worker in enumerate(profile["workers"]):
            print(f"[profile]   worker {index}: {worker['items']} items, working {worker['busy']:.2f}s "
                  f"({100 * worker['busy'] / wall:.0f}% of the wall; CPU {worker['cpu']:.2f}s), idle between items "
                  f"{worker['idle_between_items']:.2f}s, first item at {worker['first_item_at']:.3f}s, done at "
                  f"{worker['done_at']:.2f}s")


# ----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ayumi_bench_peers"), help="scratch folder")
    parser.add_argument("--corpus", default=str(REPO / ".cache" / "demo_corpus"), help="folder of *.jsonl")
    parser.add_argument("--mb", type=float, default=0,
                        help="cycle the corpus up to this many MB (distinct documents), e.g. 200 for the steady rate "
                             "of the scaling; default: the corpus once")
    parser.add_argument("--tokenizer", default=str(REPO / ".cache" / "tokenizers" / "demo_8k"),
                        help="an `ayumi tokenizer build` folder (tokenizer.model and its tokenizer.json export)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds; the best run of each tool counts")
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--datatrove-pool", action="store_true",
                        help="run datatrove's W tasks in its executor's own pool (hung here with 2 workers on 2 CPUs)")
    parser.add_argument("--profile", action="store_true", help="also profile ayumi's pipeline (where the time goes)")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="the tools to run, comma-separated (e.g. ayumi,bare for the scaling alone)")
    parser.add_argument("--run", choices=TOOLS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work, tokenizer = Path(args.work), Path(args.tokenizer)
    parts = recut_corpus(Path(args.corpus), work / (f"corpus_{args.mb:g}mb" if args.mb else "corpus"), args.mb)
    if args.run:
        print(json.dumps(run_one(args.run, parts, tokenizer, Path(args.out), args.workers, args.datatrove_pool)))
        return 0
    print(machine_line())
    if not (tokenizer / "tokenizer.json").is_file() or not (tokenizer / "tokenizer.model").is_file():
        print(f"bench: {tokenizer} needs tokenizer.model and tokenizer.json. Fix: run `./ayumi demo` once, or pass "
              "--tokenizer", file=sys.stderr)
        return 2
    ensure_datatrove()
    megabytes = sum(path.stat().st_size for path in parts) / 1e6
    print(f"[bench] corpus: {args.corpus} cut into {PARTS} files, {megabytes:.1f} MB of jsonl; tokenizer {tokenizer}")
    chosen = [tool for tool in TOOLS if tool in args.tools.split(",")]
    if "bare" not in chosen:
        chosen.append("bare")  # the ids are compared with the bare loop's
    plan = [(tool, count) for count in (1, 2) for tool in chosen if not (tool == "bare" and count == 2)]
    rounds: dict[tuple[str, int], list[dict]] = {key: [] for key in plan}
    for _ in range(args.repeat):
        for tool, count in plan:
            rounds[(tool, count)].append(measure_fresh(tool, args, work / f"out_{tool}_{count}", count, timeout=600))
    best = {}
    for (tool, count), runs in rounds.items():
        good = [run for run in runs if "error" not in run]
        if not good:
            print(f"[bench] {tool} workers={count}: failed: {runs[0]['error']}")
            continue
        best[(tool, count)] = min(good, key=lambda run: run["seconds"])
    print(f"{'tool':>10} {'workers':>7} {'seconds':>8} {'MB/s':>7} {'MB/s/worker':>12} {'CPU s':>7} {'MB per CPU-s':>13}")
    for (tool, count), run in best.items():
        print(f"{tool:>10} {count:>7} {run['seconds']:>8.2f} {megabytes / run['seconds']:>7.2f} "
              f"{megabytes / run['seconds'] / count:>12.2f} {run['cpu']:>7.2f} {megabytes / run['cpu']:>13.2f}")
    for line in compare_ids(work, (1, 2), chosen):
        print(line)
    lines = result_lines(best, rounds, megabytes)
    if args.profile or any(" ok=false " in line for line in lines):  # a target missed: say where the time goes
        profile_ayumi(parts, tokenizer, work / "out_profile")
        profile_ayumi_workers(args, work, megabytes)
    print(machine_line() + " (2-worker figures need 2 free cores)")
    for line in lines:
        print(line)
    return 0


def per_worker(run: dict | None, count: int, megabytes: float) -> float:
    return megabytes / run["seconds"] / count if run else float("nan")


def result_lines(best: dict, rounds: dict, megabytes: float) -> list[str]:
    """Per-worker throughput of ayumi against each peer at 1 worker (and datatrove and Megatron at 2), and ayumi's
    scaling from 1 to 2 workers."""
    def rate(tool: str, count: int) -> float:
        return per_worker(best.get((tool, count)), count, megabytes)

    def spread(tool: str, peer: str, count: int, peer_count: int | None = None) -> list[float]:
        peer_count = peer_count or count
        return [per_worker(a, count, megabytes) / per_worker(b, peer_count, megabytes)
                for a, b in zip(rounds[(tool, count)], rounds[(peer, peer_count)]) if "error" not in a and "error" not in b]

    lines = []
    for peer, target in (("datatrove", ">=1.2"), ("megatron", ">=1.2"), ("bare", ">=0.8")):
        if (peer, 1) in rounds:
            lines.append(result_line(f"data_prepare_vs_{peer}_per_worker", rate("ayumi", 1), rate(peer, 1), target,
                                     unit="MB/s", spread=spread("ayumi", peer, 1)))
    for peer in [tool for tool in ("datatrove", "megatron") if (tool, 2) in rounds]:
        lines.append(result_line(f"data_prepare_vs_{peer}_per_worker_2_workers", rate("ayumi", 2), rate(peer, 2), ">=1.2",
                                 unit="MB/s", spread=spread("ayumi", peer, 2)))
    lines.append(scaling_line("data_prepare_scaling_1_to_2_workers", rounds, lambda run: megabytes / run["seconds"],
                              "MB/s"))
    # The same comparisons per CPU-second (every process of the run, after imports): what a core does, whatever
    # else runs on the machine. Scaling: the CPU time 2 workers spend on the corpus against 1 worker's.
    def per_cpu(tool: str, count: int) -> float:
        run = best.get((tool, count))
        return megabytes / min(r["cpu"] for r in rounds[(tool, count)] if "error" not in r) if run else float("nan")

    def cpu_spread(ours: tuple, peer: tuple) -> list[float]:
        return [b["cpu"] / a["cpu"] for a, b in zip(rounds[ours], rounds[peer]) if "error" not in a and "error" not in b]

    for peer, target in [(t, v) for t, v in (("datatrove", ">=1.2"), ("megatron", ">=1.2"), ("bare", ">=0.8"))
                         if (t, 1) in rounds]:
        lines.append(result_line(f"data_prepare_vs_{peer}_per_cpu_s", per_cpu("ayumi", 1), per_cpu(peer, 1), target,
                                 unit="MB/cpu-s", spread=cpu_spread(("ayumi", 1), (peer, 1))))
    lines.append(scaling_line("data_prepare_scaling_1_to_2_workers_cpu", rounds, lambda run: megabytes / run["cpu"],
                              "MB/cpu-s", per_worker=False))
    return lines


def scaling_line(name: str, rounds: dict, rate, unit: str, per_worker: bool = True) -> str:
    """ayumi's scaling from 1 to 2 workers, median of the rounds: per round, the 2-worker rate over twice the 1-worker
    rate of the same round (rounds interleave the runs, so a round's pair saw about the same load). `ours` and
    `baseline` are the median rates per worker. Per CPU-second (per_worker=False) the rates are not halved: 2 workers
    that do the corpus in as much CPU time as 1 scale perfectly."""
    pairs = [(rate(one), rate(two) / (2 if per_worker else 1))
             for one, two in zip(rounds.get(("ayumi", 1), []), rounds.get(("ayumi", 2), []))
             if "error" not in one and "error" not in two]
    if not pairs:
        return result_line(name, float("nan"), float("nan"), ">=0.9", unit=unit)
    ratios = [two / one for one, two in pairs]
    return result_line(name, statistics.median(two for _, two in pairs), statistics.median(one for one, _ in pairs),
                       ">=0.9", unit=unit, ratio=statistics.median(ratios), spread=ratios)


if __name__ == "__main__":
    sys.exit(main())
