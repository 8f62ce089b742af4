"""Atomic writes every command shares: a file or a whole folder appears complete or not at all.

In `common/`, below every other package (imports follow tokenizer → data → curriculum → pretrain), so that the
tokenizer builder, data preparation, checkpoints, the HF export and the run report all publish
their outputs the same way: write under a temporary name beside the target, fsync, rename.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temporary file, fsync, then rename: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # per process: concurrent writers never share it
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def replace_dir(new: Path, target: Path) -> None:
    """Put the finished folder `new` in `target`'s place.

    POSIX cannot replace a non-empty folder in one rename, so an existing target is first set
    aside under a hidden name and removed only once `new` is in place: at every moment the target
    is the old folder, the new one, or (between two renames) briefly absent, never half-written.
    """
    new, target = Path(new), Path(target)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    new.rename(target)
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
