"""`ayumi checkpoint convert PATH --trust`: an older ayumi's checkpoints rewritten once, so that they load without
running code.

Before checkpoints held only tensors and plain data, each rank's RNG file held NumPy's RNG state as a NumPy array,
which pickles as NumPy objects; a run, `ayumi eval` and `ayumi export hf` refuse such a file like any file that holds
more than tensors and plain data (pretrain/checkpoint/safety.py). This command rewrites those RNG files as tensors and
plain data (pretrain.checkpoint.checkpointer.numpy_state_as_tensors) and records their new checksums in ayumi.json.
It reads them with `weights_only=True` and exactly NumPy's array types allowed (safety.LEGACY_RNG_GLOBALS): it never
unpickles anything else, and refuses a file that names other code, with --trust or without.

Why --trust, then: the new checksums vouch for the files from now on, and only the user knows where they came from.
Without it the command lists what it would rewrite and changes nothing. Every checkpoint is checked before any file
is written: a damaged one, or one with a file it will not read, stops it with nothing changed.

PATH: a run dir, its checkpoints/ folder (the recovery/ ring's checkpoints too), or one step folder. Exit status:
0 converted (or nothing to convert), 2 with one line: no checkpoint, no --trust, a damaged checkpoint, a file it will
not read.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from common.conf import config_help
from common.files import write_text_atomic
from common.safe_load import unsafe_globals
from common.status import BAD_INPUT, DONE
from pretrain.checkpoint import integrity, safety
from pretrain.checkpoint.layout import META, RING_DIR, complete_tags, is_complete
from pretrain.tools.checkpoint_path import PATH_HELP, no_checkpoint

PROG = "ayumi checkpoint convert"
READS = "no config from conf/: each checkpoint's ayumi.json (its checksums) and the files it names"


class NotConverted(ValueError):
    """A checkpoint this command will not convert (damaged, or a file it will not read): one line naming it."""


@dataclass
class Plan:
    """The RNG files of one checkpoint folder to rewrite."""

    folder: Path
    files: list[str]
    recorded: bool
    """Whether ayumi.json records checksums (then the new files' are recorded)."""


def checkpoint_folders(path: Path) -> list[Path]:
    """The complete checkpoint folders PATH names: itself, or a run's (or checkpoint root's) and its ring's."""
    if is_complete(path):
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return [folder / tag for folder in (root, root / RING_DIR) for tag in complete_tags(folder)]


def plan_folder(folder: Path) -> Plan:
    """What to rewrite in one checkpoint; NotConverted when it is damaged or holds a file that is not an older
    ayumi's RNG file and names more than tensors and plain data."""
    verdict = integrity.verify(folder)
    if verdict.status == integrity.DAMAGED:
        raise NotConverted(f"{integrity.damaged_line(folder, verdict.problem)}; nothing was converted. Fix: take an "
                           "intact copy (`ayumi checkpoint verify` lists which verify)")
    files = []
    for name in safety.pickled_files(folder):
        found = unsafe_globals(folder / name, safety.allowed_for(name))
        if found and not safety.is_legacy_rng(name, found):
            raise NotConverted(f"{safety.problem_line(folder, name, found)}; no conversion reads it, and nothing was "
                               "converted")
        if found:
            files.append(name)
    return Plan(folder, files, verdict.status == integrity.VERIFIED)


def convert_rng_file(path: Path) -> integrity.FileSum:
    """Rewrite an older ayumi's RNG file as tensors and plain data (atomically); the new file's size and hash."""
    from common.safe_load import load
    from pretrain.checkpoint.checkpointer import numpy_state_as_tensors

    state = load(path, safety.LEGACY_RNG_GLOBALS)  # weights-only: NumPy's array types allowed, nothing else
    state["numpy"] = numpy_state_as_tensors(state["numpy"])
    written = integrity.save_hashed(state, path, durable=True, atomic=True)
    leftover = unsafe_globals(path)
    if leftover:  # cannot happen with the state above; a file still not plain must never be vouched for
        raise NotConverted(f"{path} still names {', '.join(leftover)} after conversion; its old form is gone, "
                           "the checkpoint's record was left as it was")
    return written


def apply(plan: Plan) -> None:
    """Rewrite a folder's RNG files and, when ayumi.json records checksums, record theirs."""
    sums = {name: convert_rng_file(plan.folder / name) for name in plan.files}
    if not plan.recorded:
        return
    meta = integrity.read_meta(plan.folder)
    for name, written in sums.items():
        meta[integrity.RECORD_KEY]["files"][name] = written.to_json()
    write_text_atomic(plan.folder / META, json.dumps(meta, indent=2, default=str) + "\n")


def convert_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, epilog=config_help(READS, overrides=False),
        description="Rewrite the RNG files of checkpoints saved by an older ayumi (NumPy's RNG state as a "
        "NumPy array) as tensors and plain data, and record their new checksums, so that they load without running "
        "code. Reads them weights-only; refuses a damaged checkpoint or a file that names other code. Exit status: 0 "
        "converted or nothing to do, 2 no checkpoint, no --trust, or a checkpoint it will not convert.")
    parser.add_argument("path", type=Path, help=PATH_HELP)
    parser.add_argument("--trust", action="store_true",
                        help="you trust where these checkpoints came from: rewrite them and record their new checksums")
    args = parser.parse_args(argv)
    folders = checkpoint_folders(args.path) if args.path.is_dir() else []
    if not folders:
        return no_checkpoint(PROG, args.path)
    try:
        plans = [plan for plan in map(plan_folder, folders) if plan.files]  # every folder checked before any write
    except NotConverted as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return BAD_INPUT
    files = [plan.folder / name for plan in plans for name in plan.files]
    if not files:
        print(f"{len(folders)} checkpoint(s) at {args.path}: every file holds only tensors and plain data; nothing to "
              "convert")
        return DONE
    if not args.trust:
        print("\n".join(f"would rewrite {path}" for path in files))
        print(f"{PROG}: {len(files)} RNG file(s) of an older ayumi in {len(plans)} checkpoint(s); nothing was changed. "
              f"Fix: if you trust where {args.path} came from, run `{PROG} {args.path} --trust`", file=sys.stderr)
        return BAD_INPUT
    try:
        for plan in plans:
            apply(plan)
    except NotConverted as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return BAD_INPUT
    unrecorded = sum(not plan.recorded for plan in plans)
    note = f" ({unrecorded} without checksums stay so)" if unrecorded else ""
    print(f"converted {len(files)} RNG file(s) in {len(plans)} checkpoint(s) at {args.path}: tensors and plain data, "
          f"new checksums recorded in ayumi.json{note}")
    return DONE
