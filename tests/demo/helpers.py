"""Helpers shared by the demo tests: a tiny R XDR serializer (to make lazy-load databases), Japanese
prose that passes the ja_clean filter, a fake standard library."""
from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

from demo import rdata

JA_PROSE = ("termcap データベースは、文字単位で動作する端末やプリンタの機能を記述するための旧式の機構である。"
            "この機構は古いプログラムでの互換性のためだけに保持されているので、新しいプログラムは terminfo(5) "
            "データベースとそれに関連したライブラリを用いるべきである。") * 4


def write_fake_stdlib(root: Path) -> Path:
    """A standard library of nine files of which two are kept (argparse.py, pkg/mod.py)."""
    body = "def f():\n    return 1\n" * 60  # ~1.3 kB
    files = {"argparse.py": body, "tiny.py": "x = 1\n", "huge.py": "#" * (600 * 1024), "pkg/mod.py": body,
             "test/test_x.py": body, "pkg/tests/helper.py": body, "site-packages/dep.py": body,
             "__pycache__/argparse.py": body, "test_other.py": body}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# --------------------------------------------------------------------------------------------
# A tiny R XDR serializer, written from R Internals §1.8, to make test streams
# --------------------------------------------------------------------------------------------

HEADER_V3 = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
UTF8, LATIN1 = 1 << 3, 1 << 2


def xdr_int(value: int) -> bytes:
    return struct.pack(">i", value)


def charsxp(text: str | None, encoding: int = UTF8) -> bytes:
    if text is None:
        return xdr_int(rdata.CHARSXP) + xdr_int(-1)
    raw = text.encode("latin-1" if encoding == LATIN1 else "utf-8")
    return xdr_int(rdata.CHARSXP | (encoding << 12)) + xdr_int(len(raw)) + raw


class Serializer:
    """Writes symbols once and references them afterwards, as R does."""

    def __init__(self):
        self.symbols: list[str] = []

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:
            return xdr_int(((self.symbols.index(name) + 1) << 8) | rdata.REFSXP)
        self.symbols.append(name)
        return xdr_int(rdata.SYMSXP) + charsxp(name)

    def strsxp(self, values, attrs: dict[str, bytes] | None = None) -> bytes:
        body = xdr_int(len(values)) + b"".join(charsxp(v) if not isinstance(v, bytes) else v for v in values)
        return self._vector(rdata.STRSXP, body, attrs)

    def intsxp(self, values, attrs=None) -> bytes:
        body = xdr_int(len(values)) + b"".join(xdr_int(rdata.NA_INTEGER if v is None else v) for v in values)
        return self._vector(rdata.INTSXP, body, attrs)

    def lglsxp(self, values) -> bytes:
        return self._vector(rdata.LGLSXP, xdr_int(len(values)) + b"".join(xdr_int(int(v)) for v in values), None)

    def named_list(self, items: dict[str, bytes]) -> bytes:
        body = xdr_int(len(items)) + b"".join(items.values())
        return self._vector(rdata.VECSXP, body, {"names": self.strsxp(list(items))})

    def _vector(self, sxp: int, body: bytes, attrs: dict[str, bytes] | None) -> bytes:
        flags = sxp | (rdata.HAS_ATTR if attrs else 0)
        return xdr_int(flags) + body + (self.pairlist(attrs) if attrs else b"")

    def pairlist(self, items: dict[str, bytes]) -> bytes:
        out = b""
        for tag, value in items.items():
            out += xdr_int(rdata.LISTSXP | rdata.HAS_TAG) + self.symbol(tag) + value
        return out + xdr_int(rdata.NILVALUE_SXP)


def write_lazyload_db(folder: Path, objects: dict[str, bytes], compression: str = "zlib") -> Path:
    """Rdata.rdx/.rdb holding each serialized object (bytes after the header) under its name."""
    rdb, offsets = b"", {}
    for name, item in objects.items():
        stream = HEADER_V3 + item
        size = struct.pack(">I", len(stream))
        if compression == "zlib":
            record = size + zlib.compress(stream)
        elif compression == "xz":
            record = size + b"Z" + lzma.compress(stream)
        else:
            record = size + b"2" + bz2.compress(stream)
        offsets[name] = (len(rdb), len(record))
        rdb += record
    s = Serializer()
    variables = s.named_list({name: s.intsxp(list(span)) for name, span in offsets.items()})
    flag = s.lglsxp([True]) if compression == "zlib" else s.intsxp([3 if compression == "xz" else 2])
    index = s.named_list({"variables": variables, "references": xdr_int(rdata.VECSXP) + xdr_int(0), "compressed": flag})
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(HEADER_V3 + index))
    return folder / "Rdata.rdx"
