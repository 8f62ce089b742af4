"""Atomic writes every command shares: a file or a whole folder appears complete or not at all.

In `common/`, below every other package (imports follow tokenizer → data → curriculum → pretrain), so that the
tokenizer builder, data preparation, checkpoints, the HF export and the run report all publish
their outputs the same way: write under a temporary name beside the target, fsync, rename.
"""
from __future__ import annotations

import os
import re
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


def process_umask() -> int:
    """The umask this process creates files under (022 is the usual one; 077 keeps everything private)."""
    try:  # Linux says it without changing it: no window in which another thread creates under a wrong mask
        found = re.search(r"^Umask:\s*([0-7]+)$", Path("/proc/self/status").read_text(), re.MULTILINE)
        if found:
            return int(found.group(1), 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, so set it straight back
    os.umask(mask)
    return mask


def modes_as_umask(folder: Path) -> None:
    """Give `folder` and everything in it the modes a plain mkdir and open would have: 0777 and 0666 under the umask.

    tempfile.mkdtemp makes its folder 0700 and some writers (safetensors) make their files 0600, whatever the
    umask; an output meant for others (an export) would then be readable by its owner alone. Applying the umask
    (never a fixed mode) keeps a private umask such as 077 private.
    """
    mask = process_umask()
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
    os.chmod(folder, 0o777 & ~mask)
