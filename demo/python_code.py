"""Code: this Python's standard library, one document per .py file (1 kB–500 kB, no tests).

Read from this machine (`sysconfig`'s stdlib path), so the code domain is built even where the
Debian sources are not; the PSF licence is copied beside it when it can be found.
"""
from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

SOURCE = "python-stdlib"

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
        docs.append({"text": text, "source": f"{SOURCE}:{path.relative_to(root).as_posix()}"})
    return docs


def python_license(root: Path) -> Path | None:
    """The PSF licence text next to the library (or Debian's copyright file for it)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (root / "LICENSE.txt", Path(f"/usr/share/doc/python{version}/copyright")):
        if candidate.is_file():
            return candidate
    return None
