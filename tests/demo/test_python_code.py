"""Code (demo.python_code): which standard-library files become documents."""
from __future__ import annotations

from demo import python_code
from tests.demo.helpers import write_fake_stdlib


def test_stdlib_extraction_keeps_library_files_only(tmp_path):
    root = write_fake_stdlib(tmp_path / "lib")
    assert [p.relative_to(root).as_posix() for p in python_code.stdlib_files(root)] == ["argparse.py", "pkg/mod.py"]
    docs = python_code.code_docs(root)
    assert docs[0]["source"] == "python-stdlib:argparse.py" and docs[0]["text"].startswith("def f():")


def test_real_stdlib_yields_hundreds_of_files():
    files = python_code.stdlib_files(python_code.stdlib_dir())
    names = {path.name for path in files}
    assert len(files) > 300 and {"argparse.py", "json"} & names == {"argparse.py"}
    assert not any("site-packages" in path.parts or "__pycache__" in path.parts for path in files)
