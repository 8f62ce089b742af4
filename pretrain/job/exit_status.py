"""The ranks' exit status, handed to `ayumi train` past the launcher.

torchrun reports any failed rank as status 1, so the status the ranks chose (2: bad input, 3: a
stability stop) would reach a scheduler as 1, and the one line that says why would sit above the
launcher's own report of its failed children. `ayumi train` names an empty folder in
STATUS_DIR_ENV; a rank that exits non-zero on purpose first writes `rank_NNNNN.json` there (its
status and the message it printed, if it printed one); when the launcher fails, `ayumi train`
returns the status the ranks wrote and prints their message again, last. Outside `ayumi train`
(a raw torchrun, a scheduler's script) the variable is unset and nothing is written.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

STATUS_DIR_ENV = "AYUMI_EXIT_STATUS_DIR"
"""Set by `ayumi train` for the ranks it starts: the folder their deliberate exit statuses go to."""


@dataclass(frozen=True)
class RankExit:
    """What one rank said as it left."""

    status: int
    """Its exit status (never 0: a clean exit writes nothing)."""
    rank: int
    message: str
    """The refusal it printed (one line per problem), or "" when another rank said it."""
    written: float
    """time.time() when it wrote the record: the first to leave is the one that stopped the job."""


def record_exit(status: int, message: str = "") -> None:
    """Leave `status` (and the `message` this rank printed) for `ayumi train`, just before exiting with it on purpose.

    Best effort: if the folder cannot be written, the launcher's own status stands.
    """
    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder or status == 0:
        return
    rank = int(os.environ.get("RANK", 0))
    record = {"status": status, "rank": rank, "message": message, "written": time.time()}
    path = Path(folder) / f"rank_{rank:05d}.json"
    aside = path.with_suffix(".tmp")  # written aside, then renamed: the launcher never reads half a record
    try:
        aside.write_text(json.dumps(record) + "\n")
        os.replace(aside, path)
    except OSError:
        pass


def read_exits(folder: str | Path) -> list[RankExit]:
    """Every rank's record in `folder`, the first to leave first (a record that cannot be read is skipped)."""
    exits = []
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            exits.append(RankExit(int(record["status"]), int(record["rank"]), str(record.get("message", "")),
                                  float(record["written"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(exits, key=lambda left: (left.written, left.rank))


def agreed_exit(exits: list[RankExit]) -> tuple[int, list[str]] | None:
    """(the status the job ends with, the distinct messages given with it) or None when no rank wrote one.

    Ranks refusing the same input all write the same status and one of them the message. Where they differ,
    the first rank to leave decides: the others stopped because it did.
    """
    if not exits:
        return None
    status = exits[0].status
    messages: list[str] = []
    for left in exits:
        if left.status == status and left.message and left.message not in messages:
            messages.append(left.message)
    return status, messages
