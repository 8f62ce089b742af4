"""The exit statuses of every `ayumi` command: one convention, so scripts and schedulers can act on them.

A status says what to do next, not which command ran: 1 is a verdict to read (the plan, the shards,
the machine), 2 is input to fix before rerunning, 3 and 4 are a training job's own stops (a scheduler
requeues on 4, not on 3). `ayumi --help` and the README print EXIT_STATUSES.
"""
from __future__ import annotations

import textwrap

DONE = 0
"""The command did what it was asked (a training run also exits 0 when a signal stopped it after saving)."""
REFUSED = 1
"""The command ran and its verdict is "no": `ayumi plan` refused the plan, `ayumi data verify` found damaged
shards, `ayumi checkpoint verify` found a damaged checkpoint, `ayumi eval --all` left a damaged checkpoint out of
the curve it wrote, `ayumi doctor` found a blocking problem."""
BAD_INPUT = 2
"""Bad input: a config value, an argument, or a file or folder the user named is missing or invalid."""
STABILITY_STOP = 3
"""The stability machinery stopped training after repeated spikes (state saved; events.jsonl says what was tried)."""
HANG = 4
"""The hang watchdog ended a job whose ranks stopped making progress (RUN_DIR/hang/report.txt); requeue it."""
INTERRUPTED = 130
"""Interrupted (Ctrl-C) before the command finished; what was complete is kept, rerun to continue."""

EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (DONE, "done"),
    (REFUSED, "the command ran and its verdict is no: `ayumi plan` refused, `ayumi data verify` found damaged "
              "shards, `ayumi checkpoint verify` a damaged checkpoint, `ayumi eval --all` left one out of its curve, "
              "`ayumi doctor` found a blocking problem"),
    (BAD_INPUT, "bad input (config, arguments, a missing or invalid file or folder you named): fix it and rerun"),
    (STABILITY_STOP, "training stopped by the stability machinery (state saved)"),
    (HANG, "the hang watchdog ended the job (requeue it)"),
    (INTERRUPTED, "interrupted"),
)
"""(status, meaning) of every status an `ayumi` command exits with, in the words the help and README use."""


def exit_status_help() -> str:
    """The `exit status:` block of `ayumi --help`, one status a line."""
    lines = ["exit status:"]
    for code, meaning in EXIT_STATUSES:
        lines += textwrap.wrap(f"{code:<4} {meaning}", width=100, initial_indent="  ", subsequent_indent=" " * 7)
    return "\n".join(lines)
