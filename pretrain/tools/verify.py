"""`ayumi checkpoint verify PATH`: every checkpoint of a run (or one) against the checksums recorded when it was saved.

PATH is a run dir, its `checkpoints/` folder, or one `step_XXXXXXX` folder. For a run, the long-term checkpoints and
the rollback ring's are checked, and the folders a run set aside as damaged are listed. One row per checkpoint:

    checkpoint                          step  files  verdict
    checkpoints/step_0000016              16      4  verified
    checkpoints/step_0000024              24      4  damaged: mp_rank_00_model_states.pt does not match ...
    checkpoints/step_0000008               8      -  unverifiable: no checksums (saved before ayumi recorded them)
    checkpoints/step_0000024.corrupt      24      -  set aside: a run found it damaged; never loaded again
    checkpoints/step_0000032              32      4  unsafe: ayumi_state.pt holds objects other than tensors ...

A checkpoint whose checksums hold is also checked to hold only tensors and plain data (pretrain/checkpoint/safety.py,
a static look at each pickle, read through torch's own zip reader as torch.load would read it: nothing of it runs); one that holds anything else is `unsafe`, since loading it could
run code, and a line on stderr names the file and the fix.

Exit status (common/status.py): 0 when no checkpoint a run could load is damaged or unsafe (verified, unverifiable,
set aside or incomplete ones do not count), 1 (the verdict is no) when one is damaged, 2 with one line when PATH holds
no checkpoint or when a checkpoint is unsafe (a run would refuse it with status 2 too). Hashes with the same streaming
xxh3_128 as the save (pretrain/checkpoint/integrity.py); imports torch only for its zip reader, never DeepSpeed.
`ayumi checkpoint convert` (pretrain/tools/convert.py) rewrites an older ayumi's RNG files once, when told to trust.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.conf import config_help
from common.safe_load import what_is_wrong, what_it_risks
from common.status import BAD_INPUT, DONE, REFUSED
from pretrain.checkpoint import integrity, safety
from pretrain.checkpoint.layout import RING_DIR, is_complete, is_tag, quarantined, step_of
from pretrain.tools.checkpoint_path import PATH_HELP, no_checkpoint

PROG = "ayumi checkpoint verify"
UNSAFE = "unsafe"
"""The verdict on a checkpoint with a file that holds more than tensors and plain data."""
READS = "no config from conf/: each checkpoint's ayumi.json (the checksums recorded at save)"


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    folder: Path
    step: int
    files: int | None
    """Files the record lists (None: no record to count from)."""
    verdict: str
    """verified | damaged | unverifiable | set aside | incomplete | unsafe."""
    detail: str = ""
    refusal: str = ""
    """unsafe: the one line naming the file and the fix (stderr)."""

    @property
    def counts_against(self) -> bool:
        """A damaged checkpoint a run could still load: the only verdict that makes the command say no."""
        return self.verdict == integrity.DAMAGED


def checkpoint_folders(path: Path) -> list[Path]:
    """The checkpoint folders PATH names: itself (a step folder), or every step folder of a run's checkpoint root and
    its ring, set-aside ones included, oldest step first. Empty when PATH holds none."""
    if is_complete(path):
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    folders: list[Path] = []
    for folder in (root, root / RING_DIR):
        if folder.is_dir():
            folders += [p for p in folder.iterdir() if p.is_dir() and is_tag(p.name)]
            folders += quarantined(folder)
    return sorted(folders, key=lambda p: (step_of(p.name.split(".")[0]), p.parent.name != root.name, p.name))


def check(folder: Path) -> Row:
    """Verify one folder (a set-aside or incomplete one is listed, not hashed: nothing will load it)."""
    step = step_of(folder.name.split(".")[0])
    if not is_tag(folder.name):
        return Row(folder, step, None, "set aside", "a run found it damaged; never loaded again")
    if not is_complete(folder):
        return Row(folder, step, None, "incomplete", "no ayumi.json: a save that did not finish; never loaded")
    verdict = integrity.verify(folder)
    files = None if verdict.status == integrity.UNVERIFIABLE else verdict.files
    unsafe = safety.first_unsafe(folder) if verdict.status != integrity.DAMAGED else None
    if unsafe:  # its bytes may be intact: whoever could write the file could write its checksum
        name, found = unsafe
        return Row(folder, step, files, UNSAFE, f"{name} {what_is_wrong(found)}: {what_it_risks(found)}",
                   safety.problem_line(folder, name, found))
    planted = planted_problem(folder) if verdict.status != integrity.DAMAGED else None
    if planted:  # intact and safe to unpickle, but a resume would refuse it: a writer of the folder planted it
        return Row(folder, step, files, UNSAFE, "a resume refuses it (see the line below)", planted)
    if verdict.status == integrity.UNVERIFIABLE:
        return Row(folder, step, None, verdict.status, "no checksums (saved before ayumi recorded them)")
    return Row(folder, step, verdict.files, verdict.status, verdict.problem)


def planted_problem(folder: Path) -> str | None:
    """What a resume refuses in a folder whose files are intact and hold only tensors and plain data (one line), or
    None: a link where ayumi writes or deletes (checkpoints/, universal/, the folder itself), an ayumi.json that
    records another number of ranks than DeepSpeed's files hold, a parameter name that is not the model's own (the
    universal conversion would make a path of it). Reads the files weights-only; imports no DeepSpeed."""
    import json

    from pretrain.checkpoint import paths
    from pretrain.checkpoint.checkpointer import CheckpointError, check_record, foreign_line
    from pretrain.checkpoint.layout import META
    from pretrain.engine.checkpoint_formats import foreign_name, optimizer_layout

    root = folder.parent
    problem = paths.links_problem(root, [root, folder, root / "universal"])
    if problem:
        return problem
    meta = json.loads((folder / META).read_text(encoding="utf-8"))
    layout = optimizer_layout(folder)
    try:
        if layout is not None:
            check_record(folder, meta, layout)
    except CheckpointError as err:
        return str(err)
    if "model" not in meta:  # no model recorded to hold the names against (a resume holds them against its config)
        return None
    try:
        own = model_names(meta)
    except (TypeError, ValueError) as err:
        return f"{folder / META} records a model ayumi cannot build ({err}): a resume or an export would refuse it"
    foreign = foreign_name(folder, own)
    return foreign_line(*foreign) if foreign else None


def model_names(meta: dict) -> set[str]:
    """The parameter and buffer names of the model ayumi.json records (built on the meta device: no memory, no init),
    the only names the folder's DeepSpeed files may use."""
    import torch

    from pretrain.checkpoint.checkpointer import model_config_from_meta
    from pretrain.model.llama import Llama

    with torch.device("meta"):
        model = Llama(model_config_from_meta(meta), init_weights=False)
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} | \
        {name for name, _ in model.named_buffers(remove_duplicate=False)}


def table(rows: list[Row], base: Path) -> str:
    """The rows as aligned text, folders relative to what the user named."""
    def name(folder: Path) -> str:
        try:
            return folder.relative_to(base).as_posix() or folder.name
        except ValueError:
            return str(folder)

    names = [name(row.folder) for row in rows]
    width = max(len("checkpoint"), *map(len, names))
    lines = [f"{'checkpoint':<{width}}  {'step':>8}  {'files':>5}  verdict"]
    for row, shown in zip(rows, names):
        verdict = f"{row.verdict}: {row.detail}" if row.detail else row.verdict
        files = "-" if row.files is None else str(row.files)
        lines.append(f"{shown:<{width}}  {row.step:>8}  {files:>5}  {verdict}")
    return "\n".join(lines)


def summary(rows: list[Row], seconds: float) -> str:
    counts = {verdict: sum(row.verdict == verdict for row in rows)
              for verdict in (integrity.VERIFIED, integrity.DAMAGED, UNSAFE, integrity.UNVERIFIABLE, "set aside",
                              "incomplete")}
    said = ", ".join(f"{count} {verdict}" for verdict, count in counts.items() if count)
    return f"{len(rows)} checkpoint folder(s): {said} ({seconds:.1f}s)"


def verify_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, epilog=config_help(READS, overrides=False),
        description="Check every file of a run's checkpoints (or of one) against the size and xxh3_128 checksum "
                    "recorded when it was saved, and that it holds only tensors and plain data (loading anything else "
                    "could run code). Exit status: 0 none damaged or unsafe, 1 a damaged checkpoint, 2 no checkpoint "
                    "at PATH or an unsafe one.")
    parser.add_argument("path", type=Path, help=PATH_HELP)
    args = parser.parse_args(argv)
    folders = checkpoint_folders(args.path) if args.path.is_dir() else []
    if not folders:
        return no_checkpoint(PROG, args.path)
    start = time.perf_counter()
    rows = [check(folder) for folder in folders]
    base = args.path.parent if is_complete(args.path) else args.path
    print(table(rows, base))
    print(summary(rows, time.perf_counter() - start))
    refusals = [row.refusal for row in rows if row.verdict == UNSAFE]
    for refusal in refusals:
        print(f"{PROG}: {refusal}", file=sys.stderr)
    if refusals:
        return BAD_INPUT
    return REFUSED if any(row.counts_against for row in rows) else DONE


USAGE = "usage: ayumi checkpoint verify PATH | ayumi checkpoint convert PATH --trust"


def main(argv: list[str]) -> int:
    """Entry of `ayumi checkpoint ...` (called by pretrain/tools/cli.py): verify, or convert (pretrain/tools/convert.py)."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) + chr(10))[0]}\n\n"
              f"{config_help(READS, overrides=False)}\n`ayumi checkpoint verify --help` and `ayumi checkpoint convert "
              "--help` say more.")
        return DONE
    if argv[0] == "verify":
        return verify_main(argv[1:])
    if argv[0] == "convert":
        from pretrain.tools.convert import convert_main  # the conversion's imports for this verb only

        return convert_main(argv[1:])
    print(f"ayumi checkpoint: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
    return BAD_INPUT
