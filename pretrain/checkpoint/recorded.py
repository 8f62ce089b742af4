"""Paths a checkpoint records (ayumi.json's `tokenizer_dir`), used only inside the run that holds it.

Whoever can write a run folder can write any path into its ayumi.json (and re-sign it): `ayumi export hf` would copy
the tokenizer files of any folder on this machine into the export, and `ayumi eval` would read that tokenizer. A
recorded path is therefore read only when it lies inside the run (links resolved); anything else must be named on
the command line by the user, who knows where it came from. Imports no torch.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from pretrain.checkpoint.layout import META, RING_DIR


class RecordedPathOutside(ValueError):
    """A path recorded in a checkpoint points outside its run; the message names the file, the path and the flag."""


def run_of(tag_dir: Path) -> Path:
    """The run a checkpoint folder belongs to: the folder holding its `checkpoints/` (through the rollback ring's
    `recovery/`), else the checkpoint root itself (a checkpoint.dir of another name)."""
    root = Path(tag_dir).parent
    if root.name == RING_DIR:
        root = root.parent
    return root.parent if root.name == "checkpoints" else root


def recorded_tokenizer(tag_dir: Path, recorded: str | None, flag: str = "--tokenizer-dir") -> Path | None:
    """The tokenizer path `tag_dir`'s ayumi.json records, when it lies inside the checkpoint's run (None when it
    records none); RecordedPathOutside otherwise, with the flag that names it."""
    if not recorded:
        return None
    run = run_of(tag_dir).resolve()
    path = Path(recorded) if Path(recorded).is_absolute() else run / recorded
    if path.resolve().is_relative_to(run):
        return path
    raise RecordedPathOutside(
        f"{Path(tag_dir) / META} records tokenizer_dir {recorded}, outside the run {run}: a path recorded in a run is "
        f"read only inside it. Fix: name the tokenizer yourself, e.g. {flag} {shlex.quote(str(recorded))} if you "
        "trust that folder")
