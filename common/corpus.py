"""Streaming corpus readers: jsonl / plain text / parquet / `datasets` folders → `Document`s.

Shared by the tokenizer builder and the data-preparation package (both import this module,
never the reverse). Nothing here loads a whole file into memory: jsonl and text are read line by
line (gzip / zstd decompressed on the fly), parquet one row group at a time, and a `datasets`
folder through `load_from_disk`, which memory-maps its Arrow files.

Bad records are skipped and counted in a `ReadStats` (by reason, with the first few locations),
or, with `strict=True`, the first one raises `CorpusError` naming the file and line.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, NamedTuple

# Reasons a record or a file is skipped; `ReadStats.skipped` is keyed by these.
SKIP_REASONS = (
    "malformed_json",
    "invalid_utf8",
    "missing_field",
    "empty_file",
    "unreadable_file",
    "not_a_string",
    "empty_text",
)
MAX_EXAMPLES = 5  # locations kept per skip or drop reason: enough to find the problem, bounded in memory
# What reading a broken file raises: gzip/zstd/arrow corruption, permissions, a file gone mid-read.
READ_ERRORS = (OSError, EOFError, ValueError)
JSONL_BLOCK_BYTES = 1 << 20  # jsonl is read in blocks of whole lines this large (streaming, few system calls)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
FORMATS = ("jsonl", "text", "parquet", "hf")
TEXT_UNITS = ("line", "paragraph", "file")
# Files a `datasets.save_to_disk` folder holds at its top level (Dataset vs DatasetDict).
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Document:
    """One document read from a corpus."""

    text: str
    """The document's text, exactly as stored (no normalisation)."""
    location: str
    """Where it came from: "path:line" (jsonl/text, 1-based), "path:row" (parquet, 0-based), "dir:index" (datasets)."""


def count_reason(counts: dict[str, int], examples: dict[str, list[str]], reason: str, locations: list[str],
                 count: int = 1) -> None:
    """Add `count` to counts[reason] and keep the first MAX_EXAMPLES of `locations` in examples[reason].

    The one tally behind `ReadStats` (records skipped while reading) and `data.clean.DropCounts`
    (documents dropped by cleaning).
    """
    counts[reason] = counts.get(reason, 0) + count
    seen = examples.setdefault(reason, [])
    seen.extend(locations[:max(0, MAX_EXAMPLES - len(seen))])


@dataclass
class ReadStats:
    """What reading saw: files and documents read, and what was skipped, by reason."""

    files_read: int = 0
    """Files (or `datasets` folders) opened and read to the end."""
    docs_read: int = 0
    """Documents yielded."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Records (or whole files, for empty_file / unreadable_file) skipped, by reason."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """The first few locations skipped, by reason."""

    def skip(self, reason: str, location: str) -> None:
        """Count one skipped record (or file) at `location`."""
        count_reason(self.skipped, self.examples, reason, [location])

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def merge(self, other: "ReadStats") -> None:
        """Add `other`'s counts into this one (examples stay capped)."""
        self.files_read += other.files_read
        self.docs_read += other.docs_read
        for reason, count in other.skipped.items():
            count_reason(self.skipped, self.examples, reason, other.examples.get(reason, []), count)

    def to_dict(self) -> dict:
        return {
            "files_read": self.files_read,
            "docs_read": self.docs_read,
            "skipped": dict(self.skipped),
            "examples": {k: list(v) for k, v in self.examples.items()},
        }

    def summary(self) -> str:
        """One line for the console, e.g. '3 files, 120 docs, skipped: malformed_json=2 (a.jsonl:7, …)'."""
        line = f"{self.files_read} files, {self.docs_read} docs"
        if self.skipped:
            parts = [f"{r}={n} ({', '.join(self.examples.get(r, [])[:2])})" for r, n in sorted(self.skipped.items())]
            line += ", skipped: " + "; ".join(parts)
        return line


class CorpusError(ValueError):
    """A corpus input cannot be read; the message names the file/location, the problem and the fix."""


# ----------------------------------------------------------------------------------------------
# Finding files
# ----------------------------------------------------------------------------------------------


def expand_inputs(patterns: list[str] | str) -> list[Path]:
    """Glob patterns (`**` allowed) → sorted, de-duplicated paths.

    A pattern naming a `datasets` folder yields that folder; one naming another directory yields
    the readable files below it. A pattern that matches nothing raises `CorpusError`.
    """
    if isinstance(patterns, (str, Path)):
        patterns = [str(patterns)]
    found: dict[str, Path] = {}
    for pattern in patterns:
        pattern = str(Path(str(pattern)).expanduser())
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        paths = [p for m in matches for p in _files_for(Path(m))]
        if not paths:
            raise CorpusError(
                f"input pattern {pattern!r} matches no readable file. Fix: check the path (globs like "
                f"'/data/ja/**/*.jsonl' are allowed; formats: {', '.join(FORMATS)})."
            )
        for p in paths:
            found.setdefault(str(p.resolve()), p)
    return sorted(found.values(), key=lambda p: str(p))


def _files_for(path: Path) -> list[Path]:
    """The readable inputs a matched path stands for (itself, or the files below a plain directory)."""
    if not path.exists():
        return []
    if path.is_dir():
        if _is_hf_dir(path):
            return [path]
        return _walk_inputs(path)
    return [path]


def _walk_inputs(root: Path) -> list[Path]:
    """Readable files and `datasets` folders below a plain directory (a datasets folder is one input)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in list(dirnames):
            if _is_hf_dir(here / name):
                found.append(here / name)
                dirnames.remove(name)  # its Arrow/json files are not separate inputs
        found += [here / f for f in filenames if _format_by_suffix(here / f) is not None]
    return sorted(found)


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in HF_MARKERS)


def _format_by_suffix(path: Path) -> str | None:
    name = path.name.lower()
    for comp in COMPRESSION_SUFFIXES:
        if name.endswith(comp):
            name = name[: -len(comp)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def detect_format(path: str | Path) -> str:
    """"jsonl" / "text" / "parquet" / "hf" from the name (compression suffixes .gz/.zst allowed)."""
    path = Path(path)
    if _is_hf_dir(path):
        return "hf"
    fmt = _format_by_suffix(path)
    if fmt is None:
        raise CorpusError(
            f"{path}: cannot tell the format from the name. Fix: use .jsonl/.json/.ndjson, .txt, .parquet "
            f"(optionally .gz/.zst), a folder saved by datasets.save_to_disk, or set the format explicitly "
            f"(one of {', '.join(FORMATS)})."
        )
    return fmt


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def iter_documents(
    patterns: list[str] | str,
    fmt: str = "auto",
    text_field: str = "text",
    strict: bool = False,
    stats: ReadStats | None = None,
    text_unit: str = "line",
) -> Iterator[Document]:
    """Documents from every file the patterns match, file by file in sorted order."""
    for path in expand_inputs(patterns):
        yield from iter_file(path, fmt=fmt, text_field=text_field, strict=strict, stats=stats, text_unit=text_unit)


def iter_file(
    path: str | Path,
    fmt: str = "auto",
    text_field: str = "text",
    strict: bool = False,
    stats: ReadStats | None = None,
    text_unit: str = "line",
) -> Iterator[Document]:
    """Documents of one file (or `datasets` folder), streamed.

    `text_field` is the jsonl key / parquet column / dataset column holding the text; `text_unit`
    says what a document is in a plain-text file: a "line", a blank-line-separated "paragraph", or
    the whole "file". Skips are counted in `stats`; with `strict` the first bad record raises.
    """
    path = Path(path)
    stats = stats if stats is not None else ReadStats()
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise CorpusError(f"{path}: unknown format {fmt!r}. Fix: use one of auto, {', '.join(FORMATS)}.")
    if text_unit not in TEXT_UNITS:
        raise CorpusError(f"text_unit={text_unit!r} is not one of {', '.join(TEXT_UNITS)}.")
    reader = {"jsonl": _iter_jsonl, "text": _iter_text, "parquet": _iter_parquet, "hf": _iter_hf}[fmt]
    recorder = Recorder(path, stats, strict)
    try:
        if fmt == "text":
            docs = reader(path, recorder, text_unit)
        else:
            docs = reader(path, recorder, text_field)
        count = 0
        for doc in docs:
            count += 1
            stats.docs_read += 1
            yield doc
    except CorpusError:
        raise
    except READ_ERRORS as err:
        recorder.unreadable(err)
        return
    recorder.file_done(count)


class Recorder:
    """Counts skips for one file, or raises at the first one when strict."""

    def __init__(self, path: Path, stats: ReadStats, strict: bool):
        self.path, self.stats, self.strict = path, stats, strict

    def record(self, reason: str, location: str, problem: str, fix: str) -> None:
        if self.strict:
            raise CorpusError(f"{location}: {problem}. Fix: {fix} (or set strict=false to skip and count such records).")
        self.stats.skip(reason, location)

    def bad_file(self, reason: str, problem: str, fix: str) -> None:
        self.record(reason, str(self.path), problem, fix)

    def unreadable(self, err: BaseException) -> None:
        """The file broke off while being read (one of READ_ERRORS)."""
        self.bad_file("unreadable_file", f"cannot be read ({type(err).__name__}: {err})",
                      "check the file is complete and of the format its name says")

    def file_done(self, documents: int) -> None:
        """The file was read to its end and held `documents` documents."""
        self.stats.files_read += 1
        if documents == 0:
            self.bad_file("empty_file", "holds no documents", "remove it from the inputs or check its contents")


def _open_binary(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed on the fly by suffix."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith((".zst", ".zstd")):
        import zstandard

        raw = open(path, "rb")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")


def _decoded_lines(path: Path, recorder: Recorder) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text without the newline) per line; None where the line is not UTF-8."""
    with _open_binary(path) as raw:
        for number, line in enumerate(raw, start=1):
            line = line.rstrip(b"\n").rstrip(b"\r")
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError as err:
                recorder.record("invalid_utf8", f"{path}:{number}", f"invalid UTF-8 at byte {err.start}",
                                "re-encode the file as UTF-8")
                yield number, None


def _iter_jsonl(path: Path, recorder: Recorder, text_field: str) -> Iterator[Document]:
    # The same blocks and parser as data preparation's workers: one way to read jsonl.
    for first_line, block in read_jsonl_blocks(path, JSONL_BLOCK_BYTES):
        texts, numbers, skips, _ = parse_jsonl_block(block, first_line, text_field)
        for number, skip in skips:
            recorder.record(skip.reason, f"{path}:{number}", skip.problem, skip.fix)
        for text, number in zip(texts, numbers):
            yield Document(text, f"{path}:{number}")


@dataclass(frozen=True)
class Skip:
    """Why one record is not a document: a SKIP_REASONS key, what is wrong, and what to do."""

    reason: str
    problem: str
    fix: str


def parse_jsonl_line(line: bytes, text_field: str) -> str | Skip | None:
    """One jsonl line (with or without its line ending) → its text, a Skip, or None for a blank line."""
    try:
        decoded = line.rstrip(b"\n").rstrip(b"\r").decode("utf-8")
    except UnicodeDecodeError as err:
        return Skip("invalid_utf8", f"invalid UTF-8 at byte {err.start}", "re-encode the file as UTF-8")
    if not decoded.strip():
        return None  # blank lines are not records
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as err:
        return Skip("malformed_json", f"malformed JSON ({err.msg})", "fix or drop the line; each line must be one JSON object")
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
        return Skip("missing_field", f"no {text_field!r} field (has {keys})", "set text_field to the key that holds the text")
    text = record[text_field]
    if not isinstance(text, str):
        return Skip("not_a_string", f"{text_field!r} is a {type(text).__name__}, not a string",
                    "set text_field to a field holding strings")
    if not text:
        return Skip("empty_text", f"{text_field!r} is empty", "drop empty records")
    return text


def read_jsonl_blocks(path: Path, block_bytes: int, span: tuple[int, int] | None = None) -> Iterator[tuple[int, bytes]]:
    """A jsonl file as (number of its first line, ~block_bytes of whole lines), undecoded.

    For pipelines that parse in worker processes (`parse_jsonl_block`): reading stays a few
    system calls per block however small the documents are. Raises one of READ_ERRORS when the
    file cannot be read to its end. `span`: only bytes [start, stop) of an uncompressed file, both at
    line starts (data/task_plan.py cuts them); its lines are numbered from 1 at `start`.
    """
    start, stop = span or (0, None)
    with _open_binary(path) as raw:
        if start:
            raw.seek(start)
        number, position = 1, start
        while stop is None or position < stop:
            block = raw.read(block_bytes if stop is None else min(block_bytes, stop - position))
            if not block:
                return
            if not block.endswith(b"\n"):
                block += raw.readline()  # finish the line the block cut (a span ends at a line start)
            yield number, block
            number += block.count(b"\n")
            position += len(block)


class ParsedBlock(NamedTuple):
    """The records of one jsonl block (`parse_jsonl_block`)."""

    texts: list[str]
    numbers: list[int]
    """The line number of each text."""
    skips: list[tuple[int, Skip]]
    """(line number, why) per record that is not a document."""
    lines: int
    """How many lines the block holds, counted while it was split (the next block's first line follows them)."""


def parse_jsonl_block(block: bytes, first_line: int, text_field: str) -> ParsedBlock:
    """The records of a `read_jsonl_blocks` block, its lines numbered from `first_line`."""
    lines = block.split(b"\n")
    if block.endswith(b"\n") or not block:
        lines.pop()  # after the last line ending: not a line
    texts: list[str] = []
    numbers: list[int] = []
    skips: list[tuple[int, Skip]] = []
    for number, line in enumerate(lines, start=first_line):
        parsed = parse_jsonl_line(line, text_field)
        if isinstance(parsed, str):
            texts.append(parsed)
            numbers.append(number)
        elif parsed is not None:
            skips.append((number, parsed))
    return ParsedBlock(texts, numbers, skips, len(lines))


def _iter_text(path: Path, recorder: Recorder, text_unit: str) -> Iterator[Document]:
    lines = _decoded_lines(path, recorder)
    if text_unit == "line":
        for number, line in lines:
            if line is not None and line.strip():
                yield Document(line, f"{path}:{number}")
        return
    if text_unit == "file":
        text = "\n".join(line for _, line in lines if line is not None)
        if text.strip():
            yield Document(text, f"{path}:1")
        return
    block: list[str] = []
    start = 0
    for number, line in lines:
        if line is None:
            continue
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield Document("\n".join(block), f"{path}:{start}")
            block = []
    if block:
        yield Document("\n".join(block), f"{path}:{start}")


def _iter_parquet(path: Path, recorder: Recorder, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        recorder.bad_file("missing_field", f"has no column {text_field!r} (columns: {parquet.schema_arrow.names[:8]})",
                          "set text_field to the column that holds the text")
        return
    row = 0
    for group in range(parquet.num_row_groups):
        column = parquet.read_row_group(group, columns=[text_field]).column(0)
        for value in column.to_pylist():
            yield from _checked_value(value, f"{path}:{row}", text_field, recorder)
            row += 1


def _iter_hf(path: Path, recorder: Recorder, text_field: str) -> Iterator[Document]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
    for split, dataset in splits:
        prefix = str(path) if split is None else f"{path}[{split}]"
        if text_field not in dataset.column_names:
            recorder.record("missing_field", prefix, f"has no column {text_field!r} (columns: {dataset.column_names[:8]})",
                            "set text_field to the column that holds the text")
            continue
        index = 0
        for batch in dataset.select_columns([text_field]).iter(batch_size=1000):
            for value in batch[text_field]:
                yield from _checked_value(value, f"{prefix}:{index}", text_field, recorder)
                index += 1


def _checked_value(value: object, location: str, text_field: str, recorder: Recorder) -> Iterator[Document]:
    """A column value as a Document, or a counted skip when it is not a non-empty string."""
    if value is None:
        recorder.record("missing_field", location, f"{text_field!r} is null", "drop null rows")
    elif not isinstance(value, str):
        recorder.record("not_a_string", location, f"{text_field!r} is a {type(value).__name__}, not a string",
                        "set text_field to a column holding strings")
    elif not value:
        recorder.record("empty_text", location, f"{text_field!r} is empty", "drop empty rows")
    else:
        yield Document(value, location)
