"""Where ayumi may write and delete under a checkpoint root: never through a symbolic link, never outside the root.

A run folder is writable by whoever can write it: a link planted as `checkpoints/`, `universal/` or a tag folder
would turn a delete or a write of ayumi's into one elsewhere (another run's checkpoints, a home folder). So every
folder ayumi writes into or removes under a checkpoint root is checked first: no part of it from the root down is a
link, and its resolved path stays inside the root's. A private folder (`private_folder`) takes what a conversion
writes: made fresh by mkdtemp (mode 0700), so nothing left there by anyone else is ever reused.

The checks answer with a problem line (None when there is none); the checkpointer raises it as a CheckpointError
on every rank alike. No torch here.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

LINK_FIX = "replace the link with a real folder (or point checkpoint.dir at the folder you meant)"


def first_link(root: Path, path: Path) -> Path | None:
    """The first of `root` and each part of `path` below it that is a symbolic link (None when none is).
    `path` must lie lexically under `root` (or be it); parts that do not exist yet are no links."""
    root, path = Path(root), Path(path)
    if root.is_symlink():
        return root
    here = root
    for part in path.relative_to(root).parts:
        here = here / part
        if here.is_symlink():
            return here
    return None


def escapes(root: Path, path: Path) -> bool:
    """Whether `path`, resolved, lies outside `root`, resolved."""
    return not Path(path).resolve().is_relative_to(Path(root).resolve())


def write_problem(root: Path, path: Path, doing: str = "writes") -> str | None:
    """Why ayumi must not write into or delete `path` under the checkpoint root `root` (None when it may): a part of
    it is a link, or it resolves outside the root. One line naming the path and the fix."""
    link = first_link(root, path)
    if link is not None:
        return (f"{link} is a symbolic link (to {os.readlink(link)}): ayumi {doing} under a checkpoint root only "
                f"through real folders, so nothing was written or deleted. Fix: {LINK_FIX}")
    if escapes(root, path):
        return (f"{path} resolves to {Path(path).resolve()}, outside the checkpoint root {Path(root).resolve()}: "
                f"ayumi {doing} only inside it. Fix: {LINK_FIX}")
    return None


def links_problem(root: Path, paths: list[Path]) -> str | None:
    """The first write_problem among `paths` (the folders a run writes or deletes under `root`)."""
    for path in paths:
        problem = write_problem(root, path)
        if problem:
            return problem
    return None


def remove_tree(root: Path, path: Path) -> None:
    """Delete the folder `path` under `root`, after write_problem allowed it (ValueError with its line otherwise).
    A missing folder is fine."""
    problem = write_problem(root, path, "deletes")
    if problem:
        raise ValueError(problem)
    shutil.rmtree(path, ignore_errors=True)


def discard(root: Path, path: Path) -> bool:
    """Delete the folder `path` under `root` when write_problem allows it; a link (or a path resolving outside the
    root) is left as it is, never followed. Whether it was deleted. For the clean-ups (pruning, the rollback ring,
    a failed save), which must never fail a run nor delete elsewhere."""
    if write_problem(root, path, "deletes"):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def private_folder(root: Path, parent: Path, prefix: str) -> Path:
    """A fresh folder under `parent` (itself under `root`, made if missing, mode 0700), made by mkdtemp: mode 0700,
    a name nobody chose, inside the root once resolved. ValueError with a one-line problem otherwise."""
    problem = write_problem(root, parent)
    if problem:
        raise ValueError(problem)
    Path(parent).mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    if escapes(root, folder):  # a link raced in after the check: leave it, write nothing
        raise ValueError(write_problem(root, folder) or f"{folder} lies outside {root}")
    return folder
