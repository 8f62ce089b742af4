"""Which objects each checkpoint file may hold, and a folder checked for anything else before any of it is read.

Every `.pt` file of a checkpoint is a pickle, and unpickling can run code (common/safe_load.py). ayumi's own files
hold tensors and plain data only; DeepSpeed's may also hold the few objects of common.safe_load.DEEPSPEED_GLOBALS,
each used only as DeepSpeed's files use it (common.safe_load.USES: no BUILD onto a shared enum member).
`folder_problem` checks every file of a folder against that (a static look at the pickle torch's own zip reader
gives, the one torch.load would read: nothing runs), ranks sharing the files like the checksums' verification; the
checkpointer refuses a folder with a problem on every rank, before any rank reads a file, and then reads each file
with `weights_only=True` all the same.

RNG files written before ayumi held NumPy's RNG state as a tensor name NumPy's array types (LEGACY_RNG_GLOBALS):
refused like any other, with the fix `ayumi checkpoint convert ... --trust` (pretrain/tools/convert.py), which
rewrites them once and records their new checksums.

Imports torch only to read a file's pickle (torch's zip reader), never DeepSpeed: `ayumi checkpoint verify` checks
files with it.
"""
from __future__ import annotations

from pathlib import Path

from common.safe_load import DEEPSPEED_GLOBALS, describe, unsafe_globals
from pretrain.checkpoint.layout import SHARED_STATE

RANK_STATE_PREFIX = "ayumi_rank"
"""ayumi_rankNNNNN.pt: one rank's RNG states (pretrain.checkpoint.layout.rank_state_name)."""

LEGACY_RNG_GLOBALS = (
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType",
)
"""What an RNG file of an older ayumi names: NumPy's state as a uint32 array (numpy.core under NumPy 1). Only
`ayumi checkpoint convert --trust` reads these, with `weights_only=True` and exactly these allowed."""


def is_own(name: str) -> bool:
    """Whether a checkpoint file is ayumi's own (trainer state, a rank's RNG) rather than DeepSpeed's."""
    base = Path(name).name
    return base == SHARED_STATE or base.startswith(RANK_STATE_PREFIX)


def is_legacy_rng(name: str, found: list[str]) -> bool:
    """A rank's RNG file of an older ayumi: it names NumPy's array types and nothing else beyond plain data."""
    return Path(name).name.startswith(RANK_STATE_PREFIX) and bool(found) and set(found) <= set(LEGACY_RNG_GLOBALS)


def allowed_for(name: str) -> tuple[str, ...]:
    """The globals a checkpoint file may name beyond tensors and plain data: none for ayumi's own files."""
    return () if is_own(name) else DEEPSPEED_GLOBALS


def pickled_files(tag_dir: Path) -> list[str]:
    """Every `.pt` file of a checkpoint folder (its subfolders too), relative to it and sorted (so ranks share them
    alike)."""
    return sorted(path.relative_to(tag_dir).as_posix() for path in Path(tag_dir).rglob("*.pt") if path.is_file())


def problem_line(tag_dir: Path, name: str, found: list[str]) -> str:
    """The one line on a file of the checkpoint that holds more than tensors and plain data, with what to do."""
    fix = fix_for(tag_dir, name, found)
    return f"{describe(Path(tag_dir) / name, found)}; nothing of the checkpoint was loaded. Fix: {fix}"


def first_unsafe(tag_dir: Path, share: tuple[int, int] = (0, 1)) -> tuple[str, list[str]] | None:
    """(file, what it names beyond tensors and plain data) of the first such file in this share of the folder's
    files (`share=(index, count)`: every count-th file from index); None when there is none."""
    index, count = share
    for name in pickled_files(tag_dir)[index::max(1, count)]:
        found = unsafe_globals(Path(tag_dir) / name, allowed_for(name))
        if found:
            return name, found
    return None


def fix_for(tag_dir: Path, name: str, found: list[str]) -> str:
    """The way out: the one-time conversion for an older ayumi's RNG file, otherwise a checkpoint from a source you
    trust (no conversion loads a file that names other code)."""
    if is_legacy_rng(name, found):
        return (f"it is an RNG file of an ayumi from before checkpoints held only tensors; if you trust where {tag_dir} "
                f"came from, `ayumi checkpoint convert {Path(tag_dir).parent} --trust` rewrites the RNG files of the "
                "checkpoints there once")
    return "do not load it; take the checkpoint again from a source you trust"


def folder_problem(tag_dir: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """The first file of a checkpoint folder that holds more than tensors and plain data, as one line; None when
    every file holds only those. `share=(index, count)`: this rank checks every count-th file from index."""
    unsafe = first_unsafe(tag_dir, share)
    return problem_line(tag_dir, *unsafe) if unsafe else None
