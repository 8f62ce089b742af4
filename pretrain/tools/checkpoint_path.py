"""The PATH that `ayumi checkpoint verify` and `ayumi checkpoint convert` take, and their refusal of one without a
checkpoint (one module, so neither command imports the other)."""
from __future__ import annotations

import sys
from pathlib import Path

from common.status import BAD_INPUT
from pretrain.checkpoint.layout import TAG_PREFIX

PATH_HELP = f"a run dir, its checkpoints/ folder, or one {TAG_PREFIX}XXXXXXX folder"
"""What the PATH of `ayumi checkpoint verify|convert` may be."""


def no_checkpoint(prog: str, path: Path) -> int:
    """Say on stderr, in one line, that PATH holds no checkpoint and what it should be; the exit status."""
    print(f"{prog}: no ayumi checkpoint at {path}: give a run dir, its checkpoints/ folder, or a {TAG_PREFIX}XXXXXXX "
          "folder", file=sys.stderr)
    return BAD_INPUT
