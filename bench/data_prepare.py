"""Benchmark: `ayumi data prepare` throughput vs a plain sentencepiece encode loop, same run, same text.

    .venv/bin/python bench/data_prepare.py [--work /tmp/ayumi_bench_data] [--repeat 2] [--vocab 8000]

Corpus (real text, docs/demo-corpus.md): Debian packages manpages-ja (Japanese man pages,
rendered with groff), r-cran-janeaustenr (Jane Austen's novels, read from R's lazy-load
database), pari-doc (PARI/GP manual, TeX) and the Python standard library (code). Packages are
fetched with `apt-get download` into --work; where that fails the script says so and uses what
it can (the standard library is always there). A SentencePiece model (8k, unigram, byte
fallback) is trained on a sample of the same text.

Measured, on the same jsonl files:
- baseline: one process, read every jsonl line, json.loads, `sp.encode(text)` per document;
- ours: `data.prepare.prepare` with workers=1 and workers=2 (full pipeline: read, clean,
  de-dup, split, encode in workers, write shards, overlap check, manifest).
Runs are interleaved (baseline, 1 worker, 2 workers per round) and each figure is the best of
--repeat rounds: others share this machine. `ours` includes starting the worker processes
(start_method auto: fork here, as in `ayumi data prepare`; plus the model load; printed
separately). Ends with RESULT lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import unicodedata
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

MEGATRON_MB_PER_S = 1.05  # Megatron-LM preprocess_data.py, per worker (published figure)
PACKAGES = ("manpages-ja", "r-cran-janeaustenr", "pari-doc")
JA_CHAR = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uff66-\uff9f"


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


def fetch_packages(work: Path) -> dict[str, Path]:
    """Unpacked package roots by name (apt-get download + dpkg-deb -x); missing ones are reported."""
    debs = work / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    roots = {}
    for name in PACKAGES:
        root = work / "pkg" / name
        if not root.is_dir():
            found = sorted(debs.glob(f"{name}_*.deb"))
            if not found:
                result = subprocess.run(["apt-get", "download", name], cwd=debs, capture_output=True, text=True)
                found = sorted(debs.glob(f"{name}_*.deb"))
                if not found:
                    print(f"[bench] {name}: apt-get download failed ({result.stderr.strip()[-200:]}); domain skipped",
                          file=sys.stderr)
                    continue
            partial = root.with_name(name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(found[-1]), str(partial)], check=True)
            partial.rename(root)
        roots[name] = root
    return roots


def package_version(work: Path, name: str) -> str:
    found = sorted((work / "debs").glob(f"{name}_*.deb"))
    return found[-1].name.split("_")[1] if found else "?"


def japanese_man_pages(root: Path) -> list[str]:
    """Rendered Japanese man pages, one document each (symlinks and `.so` alias pages skipped)."""
    pages = [p for p in sorted((root / "usr/share/man/ja").glob("man*/*.gz")) if not p.is_symlink()]

    def render(path: Path) -> str | None:
        source = gzip.decompress(path.read_bytes())
        if source.lstrip().startswith(b".so "):
            return None
        out = subprocess.run(["groff", "-t", "-k", "-Tutf8", "-man", "-dAD=l", "-rLL=1000n", "-rcR=1", "-P-cbou"],
                             input=source, capture_output=True).stdout.decode("utf-8", "replace")
        lines = [line.rstrip() for line in out.splitlines()]
        while lines and not lines[0]:
            lines.pop(0)
        while lines and not lines[-1]:
            lines.pop()
        text = unicodedata.normalize("NFC", "\n".join(lines[1:-1]))  # drop header and footer lines
        text = re.sub(f"(?<=[{JA_CHAR}]) (?=[{JA_CHAR}])", "", text)  # spaces left where lines were joined
        return text.strip() or None

    if shutil.which("groff") is None:
        print("[bench] groff not found: Japanese man pages skipped", file=sys.stderr)
        return []
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return [text for text in pool.map(render, pages) if text]


class _RReader:
    """Just enough of R's serialization format (XDR) to pull character vectors out of a .rdb entry."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def int(self) -> int:
        value = struct.unpack_from(">i", self.data, self.pos)[0]
        self.pos += 4
        return value

    def header(self) -> None:
        assert self.data[:2] == b"X\n", "only XDR serialization is read"
        self.pos = 2
        version = self.int()
        self.int(), self.int()  # R version that wrote it, minimal version to read it
        if version == 3:
            length = self.int()  # native encoding name, skipped
            self.pos += length

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 242, 253, 251):  # NULL, empty env, global env, missing arg
            return None
        if kind == 255:  # reference to an earlier symbol
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == 1:  # symbol
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP
            length = self.int()
            if length == -1:
                return None
            text = self.data[self.pos:self.pos + length].decode("utf-8", "replace")
            self.pos += length
            return text
        if kind in (2, 6):  # pairlist / language: attr, tag, car, cdr
            if has_attr:
                self.item()
            if has_tag:
                self.item()
            return [self.item(), self.item()]
        if kind in (16, 19, 20):  # character vector, list, expression
            value = [self.item() for _ in range(self.int())]
        elif kind in (10, 13):  # logical, integer
            count = self.int()
            self.pos += 4 * count
            value = None
        elif kind == 14:  # double
            count = self.int()
            self.pos += 8 * count
            value = None
        else:
            raise ValueError(f"R type {kind} not supported")
        if has_attr:
            self.item()
        return value


def austen_chapters(root: Path) -> list[str]:
    """Jane Austen's novels from janeaustenr's lazy-load database, one document per chapter."""
    rdb = next(root.glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")).read_bytes()
    chapters: list[str] = []
    position = 0
    while position + 4 <= len(rdb):
        inflater = zlib.decompressobj()
        raw = inflater.decompress(rdb[position + 4:])
        position = len(rdb) - len(inflater.unused_data)
        reader = _RReader(raw)
        reader.header()
        lines = reader.item()
        if not isinstance(lines, list) or not all(isinstance(line, (str, type(None))) for line in lines):
            continue
        current: list[str] = []
        for line in lines:
            line = line or ""
            if re.match(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+", line) and current:
                chapters.append("\n".join(current).strip())
                current = []
            current.append(line)
        if current:
            chapters.append("\n".join(current).strip())
    return [re.sub(r"(?<!\n)\n(?!\n)", " ", chapter) for chapter in chapters if len(chapter) > 200]


def pari_sections(root: Path) -> list[str]:
    """PARI/GP manual and tutorials, one document per \\section / \\subsec."""
    doc = root / "usr/share/pari/doc"
    files = sorted(doc.glob("usersch*.tex")) + [doc / "tutorial.tex", doc / "tutorial-mf.tex"]
    sections = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text("utf-8", "replace")
        sections += [part.strip() for part in re.split(r"\n(?=\\(?:section|subsec|chapter)\b)", text) if len(part.strip()) > 100]
    return sections


def stdlib_files() -> list[str]:
    """Python standard-library modules (no tests, site-packages or caches), one document per file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.rglob("*.py")):
        parts = set(path.relative_to(stdlib).parts)
        if parts & {"site-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3"}:
            continue
        size = path.stat().st_size
        if 1000 <= size <= 500_000:
            texts.append(path.read_text("utf-8", "replace"))
    return texts


def build_corpus(work: Path) -> tuple[dict[str, Path], list[str]]:
    """jsonl files per domain under work/corpus (cached), and notes on where the text came from."""
    corpus = work / "corpus"
    notes = []
    roots = fetch_packages(work)
    builders = {
        "ja": ("manpages-ja", japanese_man_pages),
        "en": ("r-cran-janeaustenr", austen_chapters),
        "math": ("pari-doc", pari_sections),
    }
    files = {}
    corpus.mkdir(parents=True, exist_ok=True)
    for domain, (package, build) in builders.items():
        path = corpus / f"{domain}.jsonl"
        if package not in roots:
            continue
        if not path.is_file():
            _write_jsonl(path, build(roots[package]))
        files[domain] = path
        notes.append(f"{domain}: Debian {package} {package_version(work, package)}")
    path = corpus / "code.jsonl"
    if not path.is_file():
        _write_jsonl(path, stdlib_files())
    files["code"] = path
    notes.append(f"code: Python {sys.version.split()[0]} standard library")
    return files, notes


def _write_jsonl(path: Path, texts: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------
# Tokenizer and measurements
# ----------------------------------------------------------------------------------------------


def train_tokenizer(work: Path, files: dict[str, Path], vocab_size: int) -> Path:
    """An 8k SentencePiece model on a sample of every domain, laid out like `ayumi tokenizer build`'s folder."""
    import sentencepiece as spm

    out = work / f"tokenizer_{vocab_size}"
    if (out / "tokenizer_meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    sample = out / "sample.txt"
    with open(sample, "w", encoding="utf-8") as handle:
        for path in files.values():
            budget = 3_000_000  # characters per domain: enough for 8k pieces, quick to train
            for line in open(path, encoding="utf-8"):
                text = json.loads(line)["text"]
                for piece in text.split("\n"):
                    if piece.strip():
                        handle.write(piece[:4000] + "\n")
                        budget -= len(piece)
                if budget <= 0:
                    break
    spm.SentencePieceTrainer.train(
        input=str(sample), model_prefix=str(out / "tokenizer"), vocab_size=vocab_size, model_type="unigram",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, user_defined_symbols=["\n"], unk_id=0, bos_id=1, eos_id=2, pad_id=3,
        character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
        input_sentence_size=0, num_threads=os.cpu_count() or 2, minloglevel=2,
    )
    sample.unlink()
    meta = {"vocab_size": vocab_size, "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_text("{}", encoding="utf-8")  # not used by data/; load_tokenizer_info wants them
    (out / "tokenizer_meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return out


def cpu_seconds() -> float:
    """User + system CPU time of this process and its reaped children (the pool's workers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def baseline(files: list[Path], model_path: Path) -> tuple[float, int, int, float]:
    """(seconds, tokens, text bytes, CPU seconds) of the plain loop: read lines, json.loads, sp.encode per document."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model_path))
    tokens = text_bytes = 0
    cpu = cpu_seconds()
    start = time.perf_counter()
    for path in files:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                text = json.loads(line)["text"]
                text_bytes += len(text.encode("utf-8"))
                tokens += len(processor.encode(text)) + 1
    return time.perf_counter() - start, tokens, text_bytes, cpu_seconds() - cpu


def ours(files: dict[str, Path], tokenizer: Path, root: Path, workers: int) -> tuple[float, int, dict, float]:
    """(seconds, tokens, manifest, CPU seconds of parent + workers) of a full `prepare` run from scratch."""
    from data.config import CleanConfig, DataConfig, DataPrepareConfig, DomainConfig
    from data.prepare import prepare

    shutil.rmtree(root, ignore_errors=True)
    # Light cleaning (NFC, whitespace tidy, de-dup) so the pipeline does its real per-document work
    # while keeping nearly every document, which keeps the token counts comparable to the baseline.
    domains = {name: DomainConfig(inputs=[str(path)], val_fraction=0.01, clean=CleanConfig(min_chars=1))
               for name, path in files.items()}
    cfg = DataPrepareConfig(data=DataConfig(name="bench", root=str(root), domains=domains), tokenizer_dir=str(tokenizer),
                            workers=workers, progress=False)
    cpu = cpu_seconds()
    start = time.perf_counter()
    manifest = prepare(cfg)  # joins its workers before returning, so their CPU time is counted
    return time.perf_counter() - start, manifest["totals"]["tokens"], manifest, cpu_seconds() - cpu


def pool_startup(model_path: Path) -> float:
    """Seconds from starting 2 workers to both having answered a one-word chunk (a fixed cost per run, part of `ours`)."""
    from data.config import CleanConfig
    from data.workers import ChunkPool, encode_chunk

    clean = dataclasses.asdict(CleanConfig())
    start = time.perf_counter()
    pool = ChunkPool(2, str(model_path), 1, 2)
    list(pool.map_ordered([(index, (encode_chunk, clean, ["word"])) for index in range(2)]))
    elapsed = time.perf_counter() - start
    pool.close()
    return elapsed


def peak_rss_mb() -> tuple[float, float]:
    """Peak resident memory (MiB) of this process and of its finished children."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ayumi_bench_data"), help="scratch folder (cached corpus)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best counts")
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    print(machine_line())
    files, notes = build_corpus(work)
    sizes = {name: path.stat().st_size for name, path in files.items()}
    docs = {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in files.items()}
    print("[bench] corpus: " + "; ".join(notes))
    for name in files:
        print(f"[bench]   {name}: {docs[name]} docs, {sizes[name] / 1e6:.1f} MB jsonl")
    tokenizer = train_tokenizer(work, files, args.vocab)
    model = tokenizer / "tokenizer.model"

    # Interleave the measurements (baseline, 1 worker, 2 workers per round) and keep each one's best:
    # other jobs on this machine come and go, and interleaving spreads that over all three. Every round
    # is kept too: the RESULT lines' spread is the round-by-round figure.
    rounds: list[dict[str, tuple]] = []
    for _ in range(args.repeat):
        measure = {"baseline": lambda: baseline(list(files.values()), model),
                   "w1": lambda: ours(files, tokenizer, work / "out_w1", 1),
                   "w2": lambda: ours(files, tokenizer, work / "out_w2", 2)}
        rounds.append({name: run() for name, run in measure.items()})
    best = {name: min((r[name] for r in rounds), key=lambda measured: measured[0]) for name in rounds[0]}
    base_s, base_tokens, text_bytes, base_cpu = best["baseline"]
    print(f"[bench] baseline (1 process, encode loop): {base_s:.2f}s, {base_tokens:,} tokens, "
          f"{text_bytes / 1e6:.1f} MB, {base_tokens / base_s:,.0f} tok/s, {text_bytes / 1e6 / base_s:.2f} MB/s")
    runs = {1: best["w1"], 2: best["w2"]}
    print(f"[bench]   CPU time {base_cpu:.2f}s: {base_tokens / base_cpu:,.0f} tok per CPU-second")
    for workers, (seconds, tokens, manifest, cpu) in runs.items():
        print(f"[bench] ours workers={workers}: {seconds:.2f}s, {tokens:,} tokens (kept {manifest['totals']['docs_kept']:,} "
              f"docs), {tokens / seconds:,.0f} tok/s, {text_bytes / 1e6 / seconds:.2f} MB/s, "
              f"{text_bytes / 1e6 / seconds / workers:.2f} MB/s per worker")
        print(f"[bench]   CPU time {cpu:.2f}s (parent + workers): {tokens / cpu:,.0f} tok per CPU-second")
    print(f"[bench] worker start-up included above (start, model load, first answer): {pool_startup(model):.3f}s for 2 workers")
    same = all(
        (work / "out_w1" / rel).read_bytes() == (work / "out_w2" / rel).read_bytes()
        for rel in (p.relative_to(work / "out_w1") for p in (work / "out_w1").rglob("*") if p.is_file())
    )
    print(f"[bench] output of workers=1 and workers=2 byte-identical: {same}")
    rss_self, rss_children = peak_rss_mb()
    print(f"[bench] peak RSS: parent {rss_self:.0f} MiB, largest worker {rss_children:.0f} MiB "
          f"(corpus {sum(sizes.values()) / 2**20:.0f} MiB)")

    print(machine_line() + " (2-worker scaling needs 2 free cores)")
    for line in result_lines(best, rounds, text_bytes):
        print(line)
    return 0


def rate(measured: tuple) -> float:
    """Tokens per second of one measurement (seconds, tokens, ...)."""
    return measured[1] / measured[0]


def per_cpu(measured: tuple) -> float:
    """Tokens per CPU-second of one measurement (..., CPU seconds last)."""
    return measured[1] / measured[-1]


def result_lines(best: dict[str, tuple], rounds: list[dict[str, tuple]], text_bytes: int) -> list[str]:
    """The four RESULT lines: each figure from the best rounds, its spread from every round alike."""
    mb_per_worker = text_bytes / 1e6 / best["w1"][0]
    # Absolute target (>= 1 MB/s per worker) against Megatron's published ~1.05 MB/s per worker:
    # ratio = ours / 1.05, so the target ratio is 1.0 / 1.05.
    mb_target = f">={round(1.0 / MEGATRON_MB_PER_S, 3)}"
    return [
        result_line("data_prepare_tokens_per_s_per_worker", rate(best["w1"]), rate(best["baseline"]), ">=0.5",
                    unit="tok/s", spread=[rate(r["w1"]) / rate(r["baseline"]) for r in rounds]),
        result_line("data_prepare_scaling_2_workers", rate(best["w2"]), rate(best["w1"]), ">=1.7", unit="tok/s",
                    spread=[rate(r["w2"]) / rate(r["w1"]) for r in rounds]),
        result_line("data_prepare_mb_per_s_per_worker", mb_per_worker, MEGATRON_MB_PER_S, mb_target, unit="MB/s",
                    spread=[text_bytes / 1e6 / r["w1"][0] / MEGATRON_MB_PER_S for r in rounds]),
        # The same per-worker overhead target in CPU time (all of the pipeline's processes): unlike wall
        # time, it does not depend on how many cores other jobs leave free.
        result_line("data_prepare_tokens_per_cpu_s", per_cpu(best["w1"]), per_cpu(best["baseline"]), ">=0.5",
                    unit="tok/cpu-s", spread=[per_cpu(r["w1"]) / per_cpu(r["baseline"]) for r in rounds]),
    ]


if __name__ == "__main__":
    sys.exit(main())
