"""Which checkpoint a run builds on: verified before use, so a damaged one never becomes the run's future.

- `choose_start`: the checkpoint a run starts from (`latest`, or `checkpoint.load_from`), its files verified
  before the model is even built (a refusal costs seconds, and the run's precision comes from the checkpoint
  it will really load); `resume_start` then loads it;
- `load_trusted`: the walk both a resume and a rollback take over their candidates, newest first. Each is
  verified against its checksums before anything is read (Checkpointer.load), then loaded, then its state
  checked (finite weights and Adam moments, non-negative second moments: TrainEngine.state_problem), since a
  checkpoint can match its checksums and still hold a state no step should start from. A damaged one is
  set aside as `<tag>.corrupt` and the next tried (`checkpoint.on_corrupt=fallback`), or the run refused
  (`refuse`): CheckpointError, one line naming the checkpoint and the file or tensor, exit status 2. A file that
  holds more than tensors and plain data is no damage but a file that could run code when loaded: the verification
  raises CheckpointUnsafe on every rank, whatever `on_corrupt` says (never set aside: an older checkpoint is no
  answer to a planted file), and the run stops with status 2 (pretrain/checkpoint/safety.py);
- `Note` and `report`: what happened on the way, as `checkpoint_corrupt` events (at the damaged checkpoint's own
  step, the run's beside it) and console notices.

All ranks call these together and every decision is agreed first (the verdict and the state check go through
Checkpointer.first_problem), so all ranks load, set aside or refuse alike; only rank 0 renames. A checkpoint
named by `load_from` belongs to another run: it is refused when damaged, never renamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.files import write_text_atomic
from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import (
    LATEST, Checkpointer, CheckpointCorrupt, CheckpointError, latest_tag, resolve_checkpoint, step_of,
)
from pretrain.checkpoint.layout import is_tag, older_tags
from pretrain.metrics import LOGGED_AT_STEP

CORRUPT_EVENT = "checkpoint_corrupt"
"""The events.jsonl kind of a damaged checkpoint set aside."""
NOTICE = "notice"
"""A Note that is a console line, not an event."""

OWN_FIX = ("resume from the newest checkpoint that verifies with checkpoint.on_corrupt=fallback (it sets this one "
           "aside), or name one with checkpoint.load_from (`ayumi checkpoint verify RUN_DIR` lists which verify)")
LOAD_FROM_FIX = "name another checkpoint in checkpoint.load_from (`ayumi checkpoint verify DIR` lists which verify)"


@dataclass
class Note:
    """Something a load met on its way, for the run's log: an event (kind CORRUPT_EVENT) or a notice."""

    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    """The step the note is about when it is not the run's (a damaged checkpoint's own): the event's step."""


@dataclass
class Loaded:
    """A checkpoint loaded into the engine, verified and checked."""

    root: Path
    tag: str
    shared: dict[str, Any]
    """The trainer's shared state (counters, data position, stability history)."""
    meta: dict[str, Any]
    """Its ayumi.json (with `verified`, and `resharded_from` after a universal conversion)."""
    notes: list[Note]
    """Checkpoints set aside before this one loaded, and notices (no checksums to verify)."""

    @property
    def step(self) -> int:
        return step_of(self.tag)

    @property
    def path(self) -> Path:
        return self.root / self.tag


@dataclass
class Start:
    """The checkpoint a run starts from, chosen before the model is built (choose_start)."""

    candidates: list[tuple[Path, str]]
    """(root, tag) newest first: the first verified (or without checksums), older ones to fall back to."""
    verdict: integrity.Verdict
    """The first candidate's verdict (its load does not hash it again)."""
    meta: dict[str, Any]
    """The first candidate's ayumi.json (its precision, model, world size)."""
    fallback: bool
    fix: str
    notes: list[Note]
    """Checkpoints set aside on the way."""


def _refuse_or_set_aside(checkpointer: Checkpointer, err: CheckpointCorrupt, fallback: bool, fix: str) -> Note:
    """A damaged checkpoint: refused (one line with the fix), or set aside (the note says as what)."""
    if not fallback:
        raise CheckpointError(f"{err}. Fix: {fix}") from None
    aside = checkpointer.set_aside(err.tag_dir)
    return Note(CORRUPT_EVENT, f"{err}; set aside as {aside.name} (kept, never loaded again)",
                {"checkpoint": str(err.tag_dir), "set_aside_as": str(aside), "problem": err.problem},
                step=step_of(err.tag_dir.name) if is_tag(err.tag_dir.name) else None)


def _none_left(notes: list[Note]) -> CheckpointError:
    set_aside = ", ".join(Path(note.fields["set_aside_as"]).name for note in notes if note.kind == CORRUPT_EVENT)
    return CheckpointError(f"no checkpoint to load verifies: {set_aside or 'none was left'} set aside as damaged. Fix: "
                           "start afresh with checkpoint.resume=false (the damaged folders stay for a look), or put an "
                           "intact copy of one back")


def load_trusted(checkpointer: Checkpointer, engine, candidates: list[tuple[Path, str]], fallback: bool,
                 fix: str, first_verdict: integrity.Verdict | None = None) -> Loaded:
    """Load the first of `candidates` ((root, tag), newest first) that verifies and whose state is sound.

    A damaged one is set aside when `fallback` (a CORRUPT_EVENT note) and the next is tried; otherwise the run is
    refused with the damage and `fix` in one line. Raises CheckpointError when none is left. `first_verdict`: the
    first candidate was verified already (choose_start)."""
    notes: list[Note] = []
    for index, (root, tag) in enumerate(candidates):
        try:
            shared, meta = checkpointer.load(engine, tag, root=root, verdict=first_verdict if index == 0 else None)
            problem = checkpointer.first_problem(engine.state_problem())
            if problem:
                raise CheckpointCorrupt(root / tag, f"the state it loads cannot be trained from: {problem}")
        except CheckpointCorrupt as err:
            notes.append(_refuse_or_set_aside(checkpointer, err, fallback, fix))
            continue
        if not meta.get("verified"):
            notes.append(Note(NOTICE, f"note: {root / tag} records no checksums (saved before ayumi recorded them): "
                                      "loaded without verifying its files"))
        return Loaded(root, tag, shared, meta, notes)
    raise _none_left(notes)


def newest_first(root: Path) -> list[str]:
    """The tags a resume tries in order: the one `latest` names, then every older complete one, newest first."""
    latest = latest_tag(root)
    if latest is None:
        return []
    return [latest] + older_tags(root, latest)


def choose_start(load_from: str | None, resume: bool, on_corrupt: str, checkpointer: Checkpointer) -> Start | None:
    """The checkpoint a run starts from (checkpoint.load_from, else the run's own newest when checkpoint.resume),
    its files verified: damaged ones are set aside or refused first. None for a fresh start. Needs no model.
    A checkpoint root whose folders are links is refused first (Checkpointer.check_paths), fresh start or not."""
    checkpointer.check_paths()
    if load_from:
        candidates, fallback, fix = [resolve_checkpoint(load_from)], False, LOAD_FROM_FIX
    else:
        tags = newest_first(checkpointer.root) if resume else []
        candidates, fallback, fix = [(checkpointer.root, tag) for tag in tags], on_corrupt == "fallback", OWN_FIX
    if not candidates:
        return None
    notes: list[Note] = []
    for index, (root, tag) in enumerate(candidates):
        verdict = checkpointer.verify(root / tag)
        if verdict.status != integrity.DAMAGED:
            return Start(candidates[index:], verdict, integrity.read_meta(root / tag), fallback, fix, notes)
        notes.append(_refuse_or_set_aside(checkpointer, CheckpointCorrupt(root / tag, verdict.problem), fallback, fix))
    raise _none_left(notes)


def resume_start(start: Start | None, checkpointer: Checkpointer, engine) -> Loaded | None:
    """Load the checkpoint choose_start chose (or, when its state cannot be trained from, an older one); None for a
    fresh start. After a fallback, `latest` names the checkpoint loaded."""
    if start is None:
        return None
    loaded = load_trusted(checkpointer, engine, start.candidates, start.fallback, start.fix, start.verdict)
    loaded.notes[:0] = start.notes
    own = loaded.root == checkpointer.root
    if own and checkpointer.rank == 0 and any(note.kind == CORRUPT_EVENT for note in loaded.notes):
        write_text_atomic(checkpointer.root / LATEST, loaded.tag + "\n")
    return loaded


def report(notes: list[Note], logger, step: int, tokens: int) -> None:
    """Notes into the run's log: events (events.jsonl, console, W&B) and notices (console). `step` and `tokens`: the
    run's when it found them. An event about a checkpoint of its own step is logged at that step (a damaged step 8
    found on resuming at 4 reads "at step 8"), the run's step kept beside it (LOGGED_AT_STEP)."""
    for note in notes:
        if note.kind == NOTICE:
            logger.info(note.message)
        elif note.step is None:
            logger.event(note.kind, step, tokens, note.message, **note.fields)
        else:
            logger.event(note.kind, note.step, tokens, note.message, **note.fields, **{LOGGED_AT_STEP: step})
