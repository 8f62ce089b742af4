"""DeepSpeed's just-in-time built ops, and the lock a killed build leaves behind.

ZeRO-Offload runs DeepSpeed's CPU Adam, which torch compiles on first use into its extensions
folder (`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions/py<ver>_<cpu|cuXY>/`). The
build takes a lock file there. When the building process is killed (kill -9, a preempted job,
a test timeout) the lock stays, and every later start waits on it forever without a word: the
job looks hung before its first step. torch's lock holds no owner to ask, so ayumi judges by age:
a build writes its objects within a few minutes, so a lock in a folder where nothing has changed
for `STALE_AFTER_S` is left over, and is removed with one line saying so. A younger lock is
another process building now; ayumi says what it waits for and which file to delete if nothing
is building.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

# A CPU Adam build takes about a minute on 2 cores; ten leaves room for a loaded machine.
STALE_AFTER_S = 600.0


def build_folder(op_name: str) -> Path | None:
    """The folder torch builds `op_name` in (the same rule torch applies; None if torch lacks it)."""
    from torch.utils import cpp_extension

    locate = getattr(cpp_extension, "_get_build_directory", None)
    return Path(locate(op_name, False)) if locate else None


def last_change(folder: Path) -> float:
    """The newest modification time of `folder` and anything in it."""
    times = [folder.stat().st_mtime]
    for entry in folder.iterdir():
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:  # removed while we looked (a build finishing)
            pass
    return max(times)


def clear_stale_build_lock(op_name: str, stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Remove `op_name`'s build lock if nothing in its folder changed for `stale_after_s`.

    Returns the line it printed (to stderr), or None when there was no lock.
    """
    folder = build_folder(op_name)
    lock = folder / "lock" if folder else None
    if lock is None or not lock.exists():
        return None
    idle_s = time.time() - last_change(folder)
    if idle_s >= stale_after_s:
        lock.unlink(missing_ok=True)
        line = (f"ayumi: removed {lock}, the build lock of DeepSpeed's {op_name} left by a build that was "
                f"killed ({idle_s / 60:.0f} min without a change); the op is built again")
    else:
        line = (f"ayumi: waiting for another process building DeepSpeed's {op_name} (lock {lock}); "
                f"if none is building, delete that file")
    print(line, file=sys.stderr, flush=True)
    return line


def prepare_ops(offload_optimizer: bool) -> None:
    """Clear what would stall the ops this run builds (CPU Adam, for offloaded optimizer states)."""
    if offload_optimizer:
        clear_stale_build_lock("cpu_adam")
