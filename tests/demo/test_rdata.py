"""The R reader (demo.rdata) on XDR streams and lazy-load databases made by the serializer in
tests/demo/helpers.py, in every record compression R uses, and what it refuses to read."""
from __future__ import annotations

import struct

import pytest

from demo import rdata
from tests.demo.helpers import HEADER_V3, LATIN1, Serializer, charsxp, write_lazyload_db, xdr_int


@pytest.mark.parametrize("compression", ["zlib", "xz", "bzip2"])
def test_lazyload_reader_returns_character_vectors(tmp_path, compression):
    s = Serializer()
    novel = s.strsxp(["CHAPTER 1", "", "It is a truth universally acknowledged,", None, "caf\u00e9", "吾輩は猫である"])
    latin = Serializer().strsxp([charsxp("na\u00efve", LATIN1)])
    rdx = write_lazyload_db(tmp_path, {"book": novel, "latin": latin}, compression)

    objects = rdata.read_lazyload_db(rdx)

    assert sorted(objects) == ["book", "latin"]
    assert list(objects["book"]) == ["CHAPTER 1", "", "It is a truth universally acknowledged,", None, "caf\u00e9", "吾輩は猫である"]
    assert objects["book"].rtype == rdata.STRSXP
    assert list(objects["latin"]) == ["na\u00efve"]


def test_unserialize_resolves_symbol_references_and_attributes():
    s = Serializer()
    # Two vectors both named: the second "names" tag is written as a reference to the first.
    item = s.named_list({"a": s.strsxp(["x"], {"names": s.strsxp(["first"])}), "b": s.intsxp([1, None, 3])})
    value = rdata.unserialize(HEADER_V3 + item)
    assert value.names == ["a", "b"]
    assert value.as_dict()["a"].names == ["first"]
    assert list(value.as_dict()["b"]) == [1, None, 3]
    assert s.symbols == ["names"]  # written once, referenced afterwards


def test_unserialize_rejects_what_it_cannot_read():
    with pytest.raises(rdata.RFormatError, match="XDR"):
        rdata.unserialize(b"A\n3\n")
    with pytest.raises(rdata.RFormatError, match="truncated"):
        rdata.unserialize(HEADER_V3 + Serializer().strsxp(["abc"])[:-6])
    with pytest.raises(rdata.RFormatError, match="CLOSXP"):
        rdata.unserialize(HEADER_V3 + xdr_int(3))


def test_lazyload_reader_checks_record_sizes(tmp_path):
    rdx = write_lazyload_db(tmp_path, {"book": Serializer().strsxp(["a line"])})
    rdb = bytearray((tmp_path / "Rdata.rdb").read_bytes())
    rdb[:4] = struct.pack(">I", 9999)  # header claims another size
    (tmp_path / "Rdata.rdb").write_bytes(bytes(rdb))
    with pytest.raises(rdata.RFormatError, match=r"Rdata.rdb\[book\].*9999"):
        rdata.read_lazyload_db(rdx)
