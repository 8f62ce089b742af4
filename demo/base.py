"""What the demo's source modules share: their errors, the progress callback, blank-line squeezing.

A leaf module: it imports nothing from ayumi, so every source module (and demo.corpus) can
import it without a cycle.
"""
from __future__ import annotations

import re
from typing import Callable

Progress = Callable[[str], None]
"""Where a build reports what it is doing (`print` by default; tests collect the messages)."""

_BLANK_RUN = re.compile(r"\n{3,}")


class DemoCorpusError(RuntimeError):
    """The demo corpus cannot be built; the message says why and what to do."""


class SourceUnavailable(DemoCorpusError):
    """A source (a Debian package, groff) cannot be had on this machine."""


def squeeze_blank_lines(text: str) -> str:
    """Runs of blank lines become one blank line (paragraph breaks survive, vertical padding does not)."""
    return _BLANK_RUN.sub("\n\n", text)
