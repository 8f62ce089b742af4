"""`ayumi demo corpus`: real Japanese, English, math and code text for the demo, built offline.

The demo trains on real text, never generated filler. Four openly licensed sources are fetched
from Debian's archive with `apt-get download` (never installed: `dpkg-deb -x` unpacks them into a
cache) or read from this machine (shared/CORPORA.md has the measurements behind the choices):

    domain    source                                   one document per
    ja_*      manpages-ja: troff man pages, groff     man page (symlinks and `.so` aliases skipped)
    en        r-cran-janeaustenr: R lazy-load database chapter of Jane Austen's six novels
    math      pari-doc: PARI/GP manual and tutorials   (sub)section, `$…$` formulas kept
    code      this Python's standard library           .py file (1 kB–500 kB, no tests)

Japanese comes in two domains, as a curation team would derive them from one crawl: `ja_raw` is
every rendered page, `ja_clean` the pages that pass a quality filter (share of kana/kanji among
the letters, length, symbol density; `JA_CLEAN_FILTER`). The curriculum trains on the noisier
domain first and the cleaner one later. `ja_clean` is a subset of `ja_raw` with identical texts,
so data preparation's train/val overlap check sees shared documents (give both the same
val_fraction).

Output, under `${AYUMI_DATA_ROOT:-.cache}/demo_corpus` unless `--out` says otherwise:

    ja_raw.jsonl ja_clean.jsonl en.jsonl math.jsonl code.jsonl   {"text": ..., "source": ...} per line
    corpus_manifest.json                                          docs/chars per domain, versions, filter
    licenses/<package>.copyright                                  each source's licence, beside its text

The folder is written whole into a temporary sibling and renamed into place, so a reader never
sees half a corpus; a complete corpus is reused by the next call (`--force` rebuilds it).

Without apt-get (not Debian/Ubuntu) or when a download fails, the code domain is still built and
the message says how to bring your own text: `--use DOMAIN=FILE.jsonl` (a `text` field per line).
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import json
import lzma
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from common.files import replace_dir

DOMAINS = ("ja_raw", "ja_clean", "en", "math", "code")
MANIFEST_NAME = "corpus_manifest.json"
FORMAT_VERSION = 1  # bump when the recipe changes so cached corpora are rebuilt

JA_PACKAGE, EN_PACKAGE, MATH_PACKAGE = "manpages-ja", "r-cran-janeaustenr", "pari-doc"
PACKAGES = (JA_PACKAGE, EN_PACKAGE, MATH_PACKAGE)

Progress = Callable[[str], None]


class DemoCorpusError(RuntimeError):
    """The demo corpus cannot be built; the message says why and what to do."""


class SourceUnavailable(DemoCorpusError):
    """A source (a Debian package, groff) cannot be had on this machine."""


class RFormatError(DemoCorpusError):
    """An R serialization stream holds something this reader does not understand."""


def default_out_dir() -> Path:
    """`${AYUMI_DATA_ROOT:-.cache}/demo_corpus`: the data root the rest of ayumi uses."""
    return Path(os.environ.get("AYUMI_DATA_ROOT", ".cache")) / "demo_corpus"


def own_data_hint(out_dir: Path) -> str:
    """How to point the demo at your own text instead of the Debian packages."""
    return (
        "To use your own text instead, give one JSONL file per domain (one JSON object per line with a "
        "\"text\" field):\n"
        f"  ayumi demo corpus --out {out_dir} --use ja_raw=ja.jsonl --use en=en.jsonl --use math=math.jsonl\n"
        "(ja_clean is then filtered from ja_raw unless you give it too; code comes from this Python's "
        "standard library unless you give --use code=...)."
    )


# --------------------------------------------------------------------------------------------
# Debian packages: apt-get download + dpkg-deb -x, never installed
# --------------------------------------------------------------------------------------------


@dataclass
class Package:
    """One unpacked Debian package."""

    name: str
    version: str
    deb: Path
    """The downloaded .deb (kept in the cache so a rebuild needs no network)."""
    root: Path
    """Where `dpkg-deb -x` unpacked it (paths below it mirror the installed ones)."""

    @property
    def copyright(self) -> Path:
        return self.root / "usr/share/doc" / self.name / "copyright"


def fetch_packages(names: Iterable[str], cache_dir: Path, progress: Progress = print) -> dict[str, Package]:
    """Download (once) and unpack the named packages under cache_dir; SourceUnavailable says why not."""
    names = list(names)
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SourceUnavailable(
                f"`{tool}` is not on PATH: this does not look like Debian/Ubuntu, so the demo's Japanese, "
                f"English and math text ({', '.join(names)}) cannot be downloaded from Debian's archive."
            )
    debs_dir = cache_dir / "debs"
    debs_dir.mkdir(parents=True, exist_ok=True)
    missing = [name for name in names if _cached_deb(debs_dir, name) is None]
    if missing:
        progress(f"downloading Debian packages {' '.join(missing)} (apt-get download) ...")
        _apt_download(missing, debs_dir)
    return {name: _unpack(_cached_deb(debs_dir, name), name, cache_dir / "unpacked") for name in names}


def _cached_deb(debs_dir: Path, name: str) -> Path | None:
    """The newest NAME_*.deb already downloaded, if any."""
    debs = sorted(debs_dir.glob(f"{name}_*.deb"), key=lambda path: path.stat().st_mtime)
    return debs[-1] if debs else None


def _apt_download(names: list[str], debs_dir: Path) -> None:
    """`apt-get download` into debs_dir; on failure refresh the package lists once (as root) and retry."""
    result = _run(["apt-get", "download", *names], cwd=debs_dir)
    if result.returncode != 0 and os.geteuid() == 0:
        # The usual cause is empty or stale package lists (fresh containers ship without them).
        _run(["apt-get", "update"], cwd=debs_dir)
        result = _run(["apt-get", "download", *names], cwd=debs_dir)
    if result.returncode != 0:
        detail = _last_lines(result.stdout + result.stderr)
        fix = "check the network/proxy to the Debian mirror" if os.geteuid() == 0 else "run `sudo apt-get update` first"
        raise SourceUnavailable(f"`apt-get download {' '.join(names)}` failed ({fix}):\n{detail}")


def _unpack(deb: Path, name: str, unpacked_dir: Path) -> Package:
    version = _run_checked(["dpkg-deb", "-f", str(deb), "Version"]).strip()
    root = unpacked_dir / deb.stem
    if not root.is_dir():
        unpacked_dir.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{deb.stem}.", dir=unpacked_dir))
        _run_checked(["dpkg-deb", "-x", str(deb), str(partial)])
        partial.rename(root)
    return Package(name=name, version=version, deb=deb, root=root)


def _run(cmd: list[str], cwd: Path | None = None, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=stdin is None)


def _run_checked(cmd: list[str]) -> str:
    result = _run(cmd)
    if result.returncode != 0:
        raise DemoCorpusError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{_last_lines(result.stderr)}")
    return result.stdout


def _last_lines(text: str, count: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join("  " + line for line in lines[-count:])


# --------------------------------------------------------------------------------------------
# R serialization (XDR) and lazy-load databases: the subset that holds character vectors
# --------------------------------------------------------------------------------------------
#
# An R package's `data/Rdata.rdx` is a gzipped serialization of
#     list(variables = list(NAME = c(offset, length), ...), references = list(), compressed = TRUE)
# and `data/Rdata.rdb` holds, at each (offset, length), one record: a 4-byte big-endian
# uncompressed size, then (compressed = TRUE) a zlib stream, or (compressed = 2 / 3) a type byte
# ('Z' xz, '2' bzip2, '1' zlib, '0' stored) and the stream. Each record decompresses to a
# serialization of the object.
#
# A serialization ("XDR" format, R Internals §1.8) is the magic "X\n", three big-endian ints
# (format version 2 or 3, writer's R version, oldest reader's R version), for version 3 the native
# encoding (int length + bytes), then one item. Every item starts with an int of flags:
# bits 0-7 the SEXP type, bit 8 "is object", bit 9 "has attributes", bit 10 "has tag",
# bits 12-27 the "levels" (for a CHARSXP its encoding). After the flags:
#   CHARSXP  int length (-1 = NA), then the bytes
#   STRSXP   int length, then that many CHARSXP items        (VECSXP/EXPRSXP: that many items)
#   INTSXP/LGLSXP  int length, then big-endian int32s (NA = -2^31); REALSXP: float64s
#   SYMSXP   one CHARSXP item (the name); the symbol joins the reference table
#   LISTSXP  (a pairlist cell) [attributes] [tag item] car item, cdr item
#   REFSXP   an index into the reference table (flags >> 8, or the next int when that is 0)
#   NILVALUE_SXP  NULL, nothing follows
# A vector's attributes (a pairlist of tag = value, e.g. names) follow its payload.
# A length of -1 on a vector means a long vector: two more ints (upper, lower 32 bits).

NILSXP, SYMSXP, LISTSXP = 0, 1, 2
CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP = 9, 10, 13, 14, 16, 19, 20
NILVALUE_SXP, REFSXP = 254, 255
HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
LATIN1_MASK, BYTES_MASK = 1 << 2, 1 << 1  # CHARSXP encoding bits in the levels
NA_INTEGER = -(2**31)
_SEXP_NAMES = {3: "CLOSXP", 4: "ENVSXP", 6: "LANGSXP", 24: "RAWSXP", 25: "S4SXP", 238: "ALTREP_SXP",
               239: "ATTRLISTSXP", 240: "ATTRLANGSXP", 242: "EMPTYENV_SXP", 248: "PERSISTSXP"}


class RSymbol(str):
    """An R symbol (a name, e.g. an attribute's tag)."""


class RVector(list):
    """An R vector as a Python list (NA as None), with its R type code and its attributes."""

    def __init__(self, values: Iterable[Any], rtype: int, attributes: dict[str, Any] | None = None):
        super().__init__(values)
        self.rtype = rtype
        self.attributes = attributes or {}

    @property
    def names(self) -> list[str] | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict[str, Any]:
        """A named list as {name: element}; RFormatError if the vector has no names."""
        if self.names is None or len(self.names) != len(self):
            raise RFormatError(f"expected a named R list, got an unnamed {_type_name(self.rtype)} of length {len(self)}")
        return dict(zip(self.names, self))


class RPairList(list):
    """An R pairlist as a list of (tag or None, value)."""


def _type_name(sxp: int) -> str:
    names = {SYMSXP: "SYMSXP", LISTSXP: "LISTSXP", CHARSXP: "CHARSXP", LGLSXP: "LGLSXP", INTSXP: "INTSXP",
             REALSXP: "REALSXP", STRSXP: "STRSXP", VECSXP: "VECSXP", EXPRSXP: "EXPRSXP"}
    return names.get(sxp) or _SEXP_NAMES.get(sxp, f"SEXP type {sxp}")


class RUnserializer:
    """Reads one XDR serialization stream (see the format notes above) into Python values."""

    def __init__(self, data: bytes, source: str = "<bytes>"):
        self.data = data
        self.source = source
        self.pos = 0
        self.references: list[Any] = []
        self.version = 0
        self.native_encoding = "UTF-8"

    def read(self) -> Any:
        self._read_header()
        return self._read_item()

    def _read_header(self) -> None:
        magic = self.data[:2]
        if magic != b"X\n":
            kind = {b"A\n": "ASCII", b"B\n": "native binary"}.get(magic, f"unknown ({magic!r})")
            raise RFormatError(f"{self.source}: {kind} R serialization; only the XDR format (magic 'X\\n') is supported")
        self.pos = 2
        self.version = self._read_int()
        self._read_int(), self._read_int()  # writer's and oldest reader's R versions: not needed
        if self.version == 3:
            self.native_encoding = self._read_bytes(self._read_int()).decode("ascii", "replace")
        elif self.version != 2:
            raise RFormatError(f"{self.source}: R serialization format version {self.version}; this reader knows 2 and 3")

    def _read_int(self) -> int:
        if self.pos + 4 > len(self.data):
            raise RFormatError(f"{self.source}: stream ends at byte {self.pos} in the middle of an item (truncated?)")
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _read_bytes(self, count: int) -> bytes:
        if count < 0 or self.pos + count > len(self.data):
            raise RFormatError(f"{self.source}: {count} bytes wanted at byte {self.pos}, {len(self.data) - self.pos} left")
        chunk = self.data[self.pos:self.pos + count]
        self.pos += count
        return chunk

    def _read_length(self) -> int:
        length = self._read_int()
        if length == -1:  # long vector: upper and lower 32 bits follow
            upper, lower = self._read_int(), self._read_int()
            length = (upper << 32) + (lower & 0xFFFFFFFF)
        return length

    def _read_item(self) -> Any:
        return self._read_item_with_flags(self._read_int())

    def _read_item_with_flags(self, flags: int) -> Any:
        sxp = flags & 0xFF
        if sxp == NILVALUE_SXP:
            return None
        if sxp == REFSXP:
            index = (flags >> 8) or self._read_int()
            if not 1 <= index <= len(self.references):
                raise RFormatError(f"{self.source}: reference #{index} at byte {self.pos}, only {len(self.references)} known")
            return self.references[index - 1]
        if sxp == SYMSXP:
            symbol = RSymbol(self._read_item() or "")
            self.references.append(symbol)
            return symbol
        if sxp == LISTSXP:
            return self._read_pairlist(flags)
        if sxp == CHARSXP:
            return self._read_charsxp(flags)
        if sxp in (LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, EXPRSXP):
            values = self._read_vector_payload(sxp)
            attributes = self._read_attributes() if flags & HAS_ATTR else {}
            return RVector(values, sxp, attributes)
        raise RFormatError(
            f"{self.source}: unsupported R object {_type_name(sxp)} at byte {self.pos - 4}; this reader handles "
            "character/numeric vectors, lists, pairlists and symbols (what lazy-loaded data sets hold)"
        )

    def _read_charsxp(self, flags: int) -> str | None:
        length = self._read_int()
        if length == -1:
            return None  # NA_character_
        raw = self._read_bytes(length)
        levels = flags >> 12
        if levels & LATIN1_MASK:
            return raw.decode("latin-1")
        # UTF-8 and ASCII strings, and "native" ones written in a UTF-8 session (the norm today).
        return raw.decode("utf-8", "replace" if levels & BYTES_MASK else "strict")

    def _read_vector_payload(self, sxp: int) -> list[Any]:
        length = self._read_length()
        if sxp in (STRSXP, VECSXP, EXPRSXP):
            return [self._read_item() for _ in range(length)]
        if sxp == REALSXP:
            return list(struct.unpack(f">{length}d", self._read_bytes(8 * length)))
        ints = struct.unpack(f">{length}i", self._read_bytes(4 * length))
        if sxp == LGLSXP:
            return [None if value == NA_INTEGER else bool(value) for value in ints]
        return [None if value == NA_INTEGER else value for value in ints]

    def _read_pairlist(self, flags: int) -> RPairList:
        # Iterative over the cdr chain: a long pairlist would otherwise recurse once per cell.
        cells = RPairList()
        while flags & 0xFF == LISTSXP:
            if flags & HAS_ATTR:
                self._read_attributes()  # attributes on a pairlist cell carry nothing we need
            tag = self._read_item() if flags & HAS_TAG else None
            cells.append((tag, self._read_item()))
            flags = self._read_int()
        self._read_item_with_flags(flags)  # the terminating NULL
        return cells

    def _read_attributes(self) -> dict[str, Any]:
        attributes = self._read_item()
        if not isinstance(attributes, RPairList):
            raise RFormatError(f"{self.source}: attributes at byte {self.pos} are not a pairlist")
        return {str(tag): value for tag, value in attributes}


def unserialize(data: bytes, source: str = "<bytes>") -> Any:
    """The object of one R XDR serialization (what `serialize(x, NULL)` writes)."""
    return RUnserializer(data, source).read()


def read_rds(path: Path) -> Any:
    """The object of an .rds/.rdx file (gzip, bzip2 or xz compressed, or plain)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    elif raw[:3] == b"BZh":
        raw = bz2.decompress(raw)
    elif raw[:6] == b"\xfd7zXZ\x00":
        raw = lzma.decompress(raw)
    return unserialize(raw, str(path))


def read_lazyload_db(rdx_path: Path) -> dict[str, Any]:
    """Every object of an R lazy-load database (`NAME.rdx` index + `NAME.rdb` records) by name."""
    rdx_path = Path(rdx_path)
    rdb_path = rdx_path.with_suffix(".rdb")
    index = read_rds(rdx_path)
    if not isinstance(index, RVector) or "variables" not in (index.names or []):
        raise RFormatError(f"{rdx_path}: not a lazy-load index (expected a list with 'variables', got {type(index).__name__})")
    fields = index.as_dict()
    compression = _compression_kind(fields.get("compressed"), rdx_path)
    rdb = rdb_path.read_bytes()
    objects = {}
    for name, (offset, length) in fields["variables"].as_dict().items():
        record = rdb[int(offset):int(offset) + int(length)]
        location = f"{rdb_path}[{name}]"
        objects[name] = unserialize(_decompress_record(record, compression, location), location)
    return objects


def _compression_kind(value: Any, rdx_path: Path) -> int:
    """0 = stored, 1 = zlib, 2/3 = typed records (R's `compress = 2 | 3`)."""
    if isinstance(value, RVector) and len(value) == 1 and value[0] is not None:
        return int(value[0])  # TRUE -> 1, FALSE -> 0, or the integer itself
    raise RFormatError(f"{rdx_path}: 'compressed' should be TRUE/FALSE/2/3, got {value!r}")


def _decompress_record(record: bytes, compression: int, location: str) -> bytes:
    if compression == 0:
        return record
    if len(record) < 5:
        raise RFormatError(f"{location}: record of {len(record)} bytes is too short")
    (size,) = struct.unpack(">I", record[:4])
    body = record[4:]
    kind = b"1"
    if compression in (2, 3):
        kind, body = body[:1], body[1:]
    codecs = {b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress, b"0": bytes}
    if kind not in codecs:
        raise RFormatError(f"{location}: unknown record compression type {kind!r}")
    data = codecs[kind](body)
    if len(data) != size:
        raise RFormatError(f"{location}: record decompressed to {len(data)} bytes, its header says {size}")
    return data


# --------------------------------------------------------------------------------------------
# Japanese: manpages-ja rendered with groff, plus the quality filter behind ja_clean
# --------------------------------------------------------------------------------------------

# Tables (-t), input encoding detection (-k), no justification (AD=l), one long page (cR=1) with
# long lines (LL) so paragraphs are not hard-wrapped, and no overstrike/colour/SGR (-P-cbou).
GROFF_COMMAND = ["groff", "-t", "-k", "-Tutf8", "-man", "-dAD=l", "-rLL=1000n", "-rcR=1", "-P-cbou"]
GROFF_TIMEOUT_S = 60

# Kana, kanji, the prolonged sound mark and Japanese punctuation / full-width forms: the characters
# between which a line join leaves a space that Japanese never writes.
_JA_CHAR = "\u3000-\u303f\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_JA_SINGLE_SPACE = re.compile(f"(?<=[{_JA_CHAR}]) (?=[{_JA_CHAR}])")
_KANA_KANJI = re.compile("[\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LETTER = re.compile(r"[^\W\d_]")
_SYMBOL = re.compile(r"[^\w\s]|_")
_BLANK_RUN = re.compile(r"\n{3,}")


def join_japanese_spaces(text: str) -> str:
    """Remove the single spaces left between two Japanese characters where lines were joined.

    troff joins source lines with a space; Japanese has no word spaces, so "場合、 要素" becomes
    "場合、要素". Spaces next to Latin text ("-l と合わせて") and runs of spaces (tables) stay.
    """
    return _JA_SINGLE_SPACE.sub("", text)


def is_alias_page(source: str) -> bool:
    """A man page that only points at another (`.so man3/other.3`): rendering it repeats the target."""
    lines = [line.strip() for line in source.splitlines()]
    content = [line for line in lines if line and not line.startswith(('.\\"', "'\\\""))]  # troff comments
    return bool(content) and all(line.startswith(".so ") for line in content)


def man_page_files(man_root: Path) -> list[Path]:
    """Every regular gzipped page under man_root (symlinks are other names for pages already listed)."""
    return sorted(path for path in man_root.rglob("*.gz") if path.is_file() and not path.is_symlink())


def render_man_page(source: bytes) -> str:
    """groff's UTF-8 text of one troff page (DemoCorpusError if groff fails)."""
    result = subprocess.run(GROFF_COMMAND, input=source, capture_output=True, timeout=GROFF_TIMEOUT_S)
    if result.returncode != 0:
        raise DemoCorpusError(f"groff exited {result.returncode}: {result.stderr.decode('utf-8', 'replace')[-300:]}")
    return result.stdout.decode("utf-8", "replace")


def clean_rendered_page(rendered: str) -> str:
    """Rendered page → document: no header/footer line, no indentation, NFC, Japanese spacing fixed."""
    lines = rendered.splitlines()
    content = [i for i, line in enumerate(lines) if line.strip()]
    if len(content) < 3:
        return ""
    body = lines[content[0] + 1:content[-1]]  # the first and last lines are the page header and footer
    text = "\n".join(line.strip() for line in body)
    text = join_japanese_spaces(unicodedata.normalize("NFC", text))
    return _BLANK_RUN.sub("\n\n", text).strip()


def _man_page_doc(path: Path, man_root: Path) -> dict | None:
    source = gzip.decompress(path.read_bytes())
    if is_alias_page(source.decode("utf-8", "replace")):
        return None
    text = clean_rendered_page(render_man_page(source))
    name = path.relative_to(man_root).as_posix().removesuffix(".gz")
    return {"text": text, "source": f"{JA_PACKAGE}:{name}"} if text else None


@dataclass(frozen=True)
class QualityFilter:
    """Document-level quality thresholds (a curation team's first pass over a Japanese crawl)."""

    min_chars: int = 400
    """Shorter pages are stubs: a name line and a pointer elsewhere."""
    max_chars: int = 60_000
    """Longer pages are mostly generated reference tables."""
    min_japanese_share: float = 0.5
    """Kana+kanji share among the letters; below it the page is mostly untranslated English or code."""
    max_symbol_share: float = 0.12
    """Punctuation/symbol share of all characters; above it the page is mostly option syntax and examples."""

    def reason(self, text: str) -> str | None:
        """Why the document fails the filter (too_short, too_long, low_japanese_share, too_many_symbols), or None."""
        if len(text) < self.min_chars:
            return "too_short"
        if len(text) > self.max_chars:
            return "too_long"
        if japanese_share(text) < self.min_japanese_share:
            return "low_japanese_share"
        if symbol_share(text) > self.max_symbol_share:
            return "too_many_symbols"
        return None


JA_CLEAN_FILTER = QualityFilter()


def japanese_share(text: str) -> float:
    """Share of the letters that are kana or kanji (0 when there are no letters)."""
    letters = len(_LETTER.findall(text))
    return len(_KANA_KANJI.findall(text)) / letters if letters else 0.0


def symbol_share(text: str) -> float:
    """Share of non-space characters that are punctuation or symbols (not letters or digits)."""
    visible = len(text) - sum(1 for char in text if char.isspace())
    return len(_SYMBOL.findall(text)) / visible if visible else 0.0


def split_by_quality(docs: list[dict], quality: QualityFilter = JA_CLEAN_FILTER) -> tuple[list[dict], dict[str, int]]:
    """(documents that pass, drop counts by reason)."""
    kept, dropped = [], {}
    for doc in docs:
        reason = quality.reason(doc["text"])
        if reason is None:
            kept.append(doc)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1
    return kept, dict(sorted(dropped.items()))


def ensure_groff(progress: Progress = print) -> None:
    """groff on PATH, installing Debian's groff-base if allowed (root + apt-get); else SourceUnavailable."""
    if shutil.which("groff"):
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        progress("groff is missing; installing Debian's groff-base to render the Japanese man pages "
                 "(apt-get install -y groff-base) ...")
        result = _run(["apt-get", "install", "-y", "--no-install-recommends", "groff-base"])
        if result.returncode == 0 and shutil.which("groff"):
            return
        raise SourceUnavailable(f"installing groff-base failed:\n{_last_lines(result.stdout + result.stderr)}")
    raise SourceUnavailable("groff is needed to render the Japanese man pages: install it "
                            "(Debian/Ubuntu: `sudo apt-get install groff-base`)")


# --------------------------------------------------------------------------------------------
# English: Jane Austen's novels from r-cran-janeaustenr, one document per chapter
# --------------------------------------------------------------------------------------------

AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_CHAPTER_HEADING = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\b\.?\s*$", re.IGNORECASE)
_VOLUME_HEADING = re.compile(r"^\s*volume\s+([0-9]+|[ivxlc]+)\b\.?\s*$", re.IGNORECASE)


def austen_rdx(package: Package) -> Path:
    return package.root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"


def split_chapters(lines: list[str | None]) -> list[str]:
    """A novel's lines → one text per chapter (front matter and volume headings dropped).

    The package stores a line per element, paragraphs separated by empty elements: lines of a
    paragraph are joined with spaces, paragraphs with a blank line; each chapter keeps its heading.
    """
    chapters: list[list[str]] = []
    for line in lines:
        line = (line or "").strip()
        if _CHAPTER_HEADING.match(line):
            chapters.append([line, ""])
        elif chapters and not _VOLUME_HEADING.match(line):
            chapters[-1].append(line)
    return [_join_paragraphs(chapter) for chapter in chapters]


def _join_paragraphs(lines: list[str]) -> str:
    paragraphs, current = [], []
    for line in lines + [""]:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def austen_docs(package: Package) -> list[dict]:
    books = read_lazyload_db(austen_rdx(package))
    docs = []
    for key, title in AUSTEN_TITLES.items():
        if key not in books:
            raise DemoCorpusError(f"{austen_rdx(package)}: no novel {key!r} (has {sorted(books)})")
        for number, chapter in enumerate(split_chapters(books[key]), start=1):
            docs.append({"text": chapter, "source": f"{EN_PACKAGE}:{key}:chapter{number}"})
    return docs


# --------------------------------------------------------------------------------------------
# Math: the PARI/GP manual and tutorials (TeX), one document per (sub)section
# --------------------------------------------------------------------------------------------

PARI_FILES = tuple(f"usersch{i}.tex" for i in range(1, 9)) + ("tutorial.tex", "tutorial-mf.tex")
_PARI_HEADING = re.compile(r"^\\(chapter|section|subsec|subsubsec)\b", re.MULTILINE)
_BRACED = r"\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}"  # a {...} argument, braces nested up to 3 deep
# Index and cross-reference macros print nothing in the running text: dropped with their argument.
_PARI_DROPPED = re.compile(r"\\(?:label|kbdsidx|sidx|secref|tetidx|kbdidx)" + _BRACED + r"|\\(?:noindent|smallskip|medskip|bigskip|vfill|hfill|newpage)\b\s?")
# Typographic macros whose argument is the text itself.
_PARI_UNWRAPPED = re.compile(r"\\(?:kbd|var|tet|emph|idx|teb|key|tev|sbr|bf|it|misctitle|subsec|subsubsec|section|chapter)" + _BRACED)
_PARI_FUN = re.compile(r"\\fun" + _BRACED + _BRACED + _BRACED)  # \fun{type}{name}{args} -> name(args)
_PARI_TYPE = re.compile(r"\\typ" + _BRACED)  # \typ{INT} -> t_INT
_PARI_PROGRAM = re.compile(r"\\bprog\s*|\s*@eprog")  # verbatim GP examples: keep the code, drop the markers


def pari_doc_dir(package: Package) -> Path:
    return package.root / "usr/share/pari/doc"


def detex_pari(text: str) -> str:
    """Light TeX→text for the PARI manual: unwrap its typographic macros, drop index entries, keep `$…$`."""
    text = _PARI_DROPPED.sub("", text)
    text = _PARI_FUN.sub(lambda m: f"{m.group(2)}({m.group(3)})", text)
    text = _PARI_TYPE.sub(lambda m: f"t_{m.group(1)}", text)
    text = _PARI_PROGRAM.sub("\n", text)
    for _ in range(2):  # macros nested in macros (\emph{\kbd{x}})
        text = _PARI_UNWRAPPED.sub(lambda m: m.group(1), text)
    return _BLANK_RUN.sub("\n\n", text.replace("\\_", "_")).strip()


def split_tex_sections(text: str) -> list[str]:
    """A TeX file → one chunk per \\chapter/\\section/\\subsec/\\subsubsec (the preamble dropped)."""
    starts = [match.start() for match in _PARI_HEADING.finditer(text)]
    return [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]


MIN_MATH_CHARS = 80  # headings with no body (a chapter title right before its first section)


def pari_docs(package: Package) -> list[dict]:
    docs = []
    for name in PARI_FILES:
        path = pari_doc_dir(package) / name
        for number, section in enumerate(split_tex_sections(path.read_text(encoding="utf-8", errors="replace"))):
            text = detex_pari(section)
            if len(text) >= MIN_MATH_CHARS:
                docs.append({"text": text, "source": f"{MATH_PACKAGE}:{name}#{number}"})
    return docs


# --------------------------------------------------------------------------------------------
# Code: this Python's standard library, one document per file
# --------------------------------------------------------------------------------------------

CODE_MIN_BYTES, CODE_MAX_BYTES = 1024, 500 * 1024
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The library's .py files, 1 kB–500 kB, outside site-packages, test packages and caches."""
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIPPED_DIRS.intersection(relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        if path.is_file() and CODE_MIN_BYTES <= path.stat().st_size <= CODE_MAX_BYTES:
            files.append(path)
    return files


def code_docs(root: Path) -> list[dict]:
    docs = []
    for path in stdlib_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append({"text": text, "source": f"python-stdlib:{path.relative_to(root).as_posix()}"})
    return docs


def python_license(root: Path) -> Path | None:
    """The PSF licence text next to the library (or Debian's copyright file for it)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (root / "LICENSE.txt", Path(f"/usr/share/doc/python{version}/copyright")):
        if candidate.is_file():
            return candidate
    return None


# --------------------------------------------------------------------------------------------
# User-supplied JSONL
# --------------------------------------------------------------------------------------------


def read_user_jsonl(domain: str, path: Path) -> list[dict]:
    """Documents of a user's JSONL file for `domain`; DemoCorpusError names the file, line and fix."""
    path = Path(path)
    if not path.is_file():
        raise DemoCorpusError(f"--use {domain}={path}: no such file")
    docs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DemoCorpusError(f"--use {domain}={path}:{number}: not JSON ({err.msg}); "
                                      "one JSON object per line, e.g. {\"text\": \"...\"}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DemoCorpusError(f"--use {domain}={path}:{number}: needs a string \"text\" field")
            if record["text"].strip():
                docs.append({"text": record["text"], "source": f"user:{path.name}:{number}"})
    if not docs:
        raise DemoCorpusError(f"--use {domain}={path}: no non-empty \"text\" records")
    return docs


# --------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------

DOMAIN_SOURCES = {
    "ja_raw": (JA_PACKAGE, "per page: GPL, BSD, Linux man-pages licences (licenses/manpages-ja.copyright)"),
    "ja_clean": (JA_PACKAGE, "per page: GPL, BSD, Linux man-pages licences (licenses/manpages-ja.copyright)"),
    "en": (EN_PACKAGE, "texts public domain; package MIT (licenses/r-cran-janeaustenr.copyright)"),
    "math": (MATH_PACKAGE, "GPL-2+ (licenses/pari-doc.copyright)"),
    "code": ("python-stdlib", "PSF-2.0 (licenses/python.LICENSE)"),
}


@dataclass
class BuildState:
    """What the build has so far: documents per domain, facts for the manifest, what is missing."""

    docs: dict[str, list[dict]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    packages: dict[str, dict] = field(default_factory=dict)
    licenses: dict[str, Path] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    ja_filter: dict = field(default_factory=dict)


def build_demo_corpus(out_dir: Path | None = None, force: bool = False, progress: Progress = print,
                      user_files: dict[str, Path] | None = None, cache_dir: Path | None = None) -> dict:
    """Build (or reuse) the demo corpus in out_dir and return its manifest.

    A complete corpus already in out_dir is returned at once unless `force`. `user_files` maps
    domains to the user's JSONL files, used instead of the built-in sources. Domains that cannot
    be built are listed in the manifest's `missing` (with the reason) and `complete` is False;
    such a corpus is rebuilt on the next call. Debian packages are cached in cache_dir (default:
    a `demo_packages` folder beside out_dir).
    """
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir()
    user_files = {domain: Path(path) for domain, path in (user_files or {}).items()}
    unknown = sorted(set(user_files) - set(DOMAINS))
    if unknown:
        raise DemoCorpusError(f"unknown domain(s) {unknown} in --use; the demo's domains are {', '.join(DOMAINS)}")
    cached = load_manifest(out_dir)
    if cached and cached.get("complete") and not force and not user_files:
        progress(f"demo corpus: {out_dir} (cached; --force rebuilds)")
        return cached
    started = time.perf_counter()
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / "demo_packages"
    state = BuildState()
    _collect_documents(state, cache_dir, user_files, progress)
    if state.missing and cached and cached.get("complete"):
        # A forced rebuild that cannot fetch its sources must not replace a complete corpus.
        reasons = "\n".join(sorted(set(state.missing.values())))
        progress(f"demo corpus: rebuild incomplete ({', '.join(sorted(state.missing))} unavailable); "
                 f"kept the existing complete corpus in {out_dir}:\n{reasons}")
        return cached
    manifest = _write_corpus(out_dir, state, time.perf_counter() - started)
    _report(manifest, out_dir, progress)
    return manifest


def load_manifest(out_dir: Path) -> dict | None:
    """The corpus manifest in out_dir, or None when absent, unreadable or of an older recipe."""
    try:
        manifest = json.loads((Path(out_dir) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("format_version") != FORMAT_VERSION:
        return None
    if not all((Path(out_dir) / info["file"]).is_file() for info in manifest.get("domains", {}).values()):
        return None
    return manifest


def _collect_documents(state: BuildState, cache_dir: Path, user_files: dict[str, Path], progress: Progress) -> None:
    for domain, path in user_files.items():
        state.docs[domain] = read_user_jsonl(domain, path)
        state.sources[domain] = f"user file {path.resolve()}"
    needed = _packages_needed(user_files)
    packages = _fetch_or_note_missing(state, needed, cache_dir, progress)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        # groff runs as subprocesses on the pool while this thread converts the other sources.
        ja_pending = _start_japanese(state, packages, pool, progress) if JA_PACKAGE in packages else None
        if EN_PACKAGE in packages:
            progress("English: reading Jane Austen's novels from the R lazy-load database ...")
            state.docs["en"] = austen_docs(packages[EN_PACKAGE])
        if MATH_PACKAGE in packages:
            progress("math: splitting the PARI/GP manual into sections ...")
            state.docs["math"] = pari_docs(packages[MATH_PACKAGE])
        if "code" not in user_files:
            progress(f"code: Python {sys.version.split()[0]} standard library ({stdlib_dir()}) ...")
            state.docs["code"] = code_docs(stdlib_dir())
            state.sources["code"] = f"Python {sys.version.split()[0]} standard library, {stdlib_dir()}"
            license_file = python_license(stdlib_dir())
            if license_file:
                state.licenses["python.LICENSE"] = license_file
        if ja_pending is not None:
            state.docs["ja_raw"] = [doc for doc in (future.result() for future in ja_pending) if doc]
    _derive_ja_clean(state, user_files)


def _packages_needed(user_files: dict[str, Path]) -> list[str]:
    """The Debian packages whose domains the user did not bring (a user's ja_raw replaces the man pages)."""
    replaced_by = {JA_PACKAGE: "ja_raw", EN_PACKAGE: "en", MATH_PACKAGE: "math"}
    return [name for name in PACKAGES if replaced_by[name] not in user_files]


def _fetch_or_note_missing(state: BuildState, names: list[str], cache_dir: Path, progress: Progress) -> dict[str, Package]:
    """The packages that could be had; the domains of the others go to state.missing with the reason."""
    if not names:
        return {}
    try:
        if JA_PACKAGE in names:
            ensure_groff(progress)
    except SourceUnavailable as err:
        _note_missing(state, [JA_PACKAGE], str(err))
        names = [name for name in names if name != JA_PACKAGE]
    try:
        packages = fetch_packages(names, cache_dir, progress)
    except SourceUnavailable as err:
        _note_missing(state, names, str(err))
        return {}
    for package in packages.values():
        state.packages[package.name] = {"version": package.version, "deb": package.deb.name}
        state.licenses[f"{package.name}.copyright"] = package.copyright
    for domain, (source, _) in DOMAIN_SOURCES.items():
        if source in packages and domain not in state.docs:
            state.sources[domain] = f"Debian {source} {packages[source].version}"
    return packages


def _note_missing(state: BuildState, package_names: list[str], reason: str) -> None:
    for domain, (source, _) in DOMAIN_SOURCES.items():
        if source in package_names and domain not in state.docs:
            state.missing[domain] = reason


def _start_japanese(state: BuildState, packages: dict[str, Package], pool: ThreadPoolExecutor, progress: Progress):
    man_root = packages[JA_PACKAGE].root / "usr/share/man/ja"
    pages = man_page_files(man_root)
    progress(f"Japanese: rendering {len(pages)} man pages with groff ...")
    return [pool.submit(_man_page_doc, path, man_root) for path in pages]


def _derive_ja_clean(state: BuildState, user_files: dict[str, Path]) -> None:
    if "ja_raw" not in state.docs:
        if "ja_clean" not in state.docs:
            state.missing.setdefault("ja_clean", state.missing.get("ja_raw", "no Japanese source"))
        return
    kept, dropped = split_by_quality(state.docs["ja_raw"])
    state.ja_filter = {"thresholds": asdict(JA_CLEAN_FILTER), "input_docs": len(state.docs["ja_raw"]),
                       "kept": len(kept), "dropped": dropped}
    if "ja_clean" not in user_files:
        state.docs["ja_clean"] = kept
        state.sources["ja_clean"] = state.sources.get("ja_raw", "ja_raw") + ", quality-filtered (ja_filter)"
    state.missing.pop("ja_clean", None)


def _write_corpus(out_dir: Path, state: BuildState, seconds_so_far: float) -> dict:
    """Write every domain, the licences and the manifest to a temporary sibling, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial.", dir=out_dir.parent))
    started = time.perf_counter()
    try:
        domains = {}
        for domain in DOMAINS:
            if domain in state.docs:
                domains[domain] = _write_domain(partial, domain, state)
        (partial / "licenses").mkdir()
        for name, path in state.licenses.items():
            shutil.copyfile(path, partial / "licenses" / name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "complete": not state.missing,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": round(seconds_so_far + time.perf_counter() - started, 1),
            "domains": domains,
            "missing": state.missing,
            "packages": state.packages,
            "python": {"version": sys.version.split()[0], "stdlib": str(stdlib_dir())},
            "ja_filter": state.ja_filter,
            "licenses": sorted(state.licenses),
        }
        (partial / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        replace_dir(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


def _write_domain(folder: Path, domain: str, state: BuildState) -> dict:
    docs = state.docs[domain]
    with open(folder / f"{domain}.jsonl", "w", encoding="utf-8") as handle:
        for doc in docs:
            handle.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return {"file": f"{domain}.jsonl", "docs": len(docs), "chars": sum(len(doc["text"]) for doc in docs),
            "source": state.sources.get(domain, ""), "license": DOMAIN_SOURCES[domain][1]}


def _report(manifest: dict, out_dir: Path, progress: Progress) -> None:
    progress(f"demo corpus written to {out_dir} in {manifest['build_seconds']} s:")
    for domain, info in manifest["domains"].items():
        progress(f"  {domain:<9} {info['docs']:>6,} docs {info['chars']:>12,} chars   {info['source']}")
    if manifest["ja_filter"]:
        jf = manifest["ja_filter"]
        drops = ", ".join(f"{reason} {count}" for reason, count in jf["dropped"].items()) or "none"
        progress(f"  ja_clean keeps {jf['kept']} of {jf['input_docs']} ja_raw pages (dropped: {drops})")
    for domain, reason in manifest["missing"].items():
        progress(f"  {domain:<9} MISSING: {reason.splitlines()[0]}")
    if manifest["missing"]:
        progress("\n".join(sorted(set(manifest["missing"].values()))))
        progress(own_data_hint(out_dir))


# --------------------------------------------------------------------------------------------
# CLI: `ayumi demo corpus`
# --------------------------------------------------------------------------------------------


def parse_use(values: list[str]) -> dict[str, Path]:
    """`DOMAIN=FILE` pairs from --use."""
    files = {}
    for value in values:
        domain, sep, path = value.partition("=")
        if not sep or not path:
            raise DemoCorpusError(f"--use {value!r}: expected DOMAIN=FILE.jsonl with DOMAIN one of {', '.join(DOMAINS)}")
        files[domain] = Path(path)
    return files


def main_corpus(argv: list[str]) -> int:
    """`ayumi demo corpus [--out DIR] [--force] [--use DOMAIN=FILE ...]`; 0 when complete, 1 otherwise."""
    from common.conf import config_help

    parser = argparse.ArgumentParser(prog="ayumi demo corpus", description=__doc__,
                                     epilog=config_help("no config from conf/: only the options above", overrides=False),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $AYUMI_DATA_ROOT/demo_corpus, "
                                                               "AYUMI_DATA_ROOT defaulting to .cache)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete corpus is there")
    parser.add_argument("--use", action="append", default=[], metavar="DOMAIN=FILE",
                        help=f"your own JSONL file (a \"text\" field per line) for a domain: {', '.join(DOMAINS)}")
    args = parser.parse_args(argv)
    try:
        manifest = build_demo_corpus(args.out, force=args.force, user_files=parse_use(args.use))
    except DemoCorpusError as err:
        print(f"ayumi demo corpus: {err}", file=sys.stderr)
        return 1
    return 0 if manifest.get("complete") else 1


if __name__ == "__main__":
    sys.exit(main_corpus(sys.argv[1:]))
