"""R serialization (XDR) and lazy-load databases: the subset that holds character vectors.

Enough of R's `unserialize` to read the data sets an R package ships (`data/Rdata.rdx` + `.rdb`)
without R: character, logical, integer and double vectors, lists, pairlists and symbols.
demo.austen reads Jane Austen's novels with it; nothing here knows about them. The format
notes below are from R Internals §1.8.
"""
from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable

from demo.base import DemoCorpusError


class RFormatError(DemoCorpusError):
    """An R serialization stream holds something this reader does not understand."""


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
