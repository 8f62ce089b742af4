"""torch files read without running code: every pickle checked before it is read, then read with `weights_only=True`.

A `.pt` file is a zip whose `data.pkl` is a pickle, and unpickling calls whatever functions the pickle names: a file
that someone else could write runs code as whoever loads it. Checksums do not help (whoever writes a file can write
its checksum too). Two gates, both closed unless a file passes:

- `unsafe_globals(path, allowed)`: a static look at the pickle (`pickletools` lists its opcodes and runs nothing).
  Every opcode must be one that torch's weights-only unpickler knows, every global one of TENSOR_GLOBALS or
  `allowed`. It needs no torch, so `ayumi checkpoint verify` checks files with it, and the checkpointer checks a whole
  folder with it (ranks sharing the files) before any rank reads one;
- `load(path, allowed)`: the same check, then `torch.load(weights_only=True)` with exactly `allowed` on torch's own
  allow-list (`torch.serialization.safe_globals`) for this one load. Third-party readers that pass
  `weights_only=False` themselves (DeepSpeed's converters) run under `forced_weights_only`.

Either gate refuses with UnsafeFile: one line naming the file and the names it holds beyond tensors and plain data.
Nothing here ever loads with `weights_only=False`.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickletools
import re
import struct
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

TENSOR_GLOBALS = frozenset([
    "torch._utils._rebuild_tensor_v2", "torch.Size", "collections.OrderedDict",
    # A tensor carrying Python attributes (ZeRO-3's partitions): rebuilt as a tensor, its attributes set from plain data.
    "torch._tensor._rebuild_from_type_v2", "torch.Tensor",
    "_codecs.encode",  # how protocol 2 pickles a bytes object
    *(f"torch.{kind}Storage" for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
                                          "Bool")),
    *(f"torch.{dtype}" for dtype in ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                                     "uint8", "bool")),
])
"""What a file of tensors and plain data names: the tensor rebuild, storages and dtypes (torch's defaults, narrowed
to the kinds of tensor a checkpoint holds), ordered dicts and bytes. Plain data (dicts, lists, tuples, numbers,
strings, None) needs no global at all."""

DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The objects DeepSpeed 0.19 pickles into its ZeRO optimizer states beyond tensors (found in the files of every ZeRO
stage and precision): the loss scaler (its attributes are numbers), the stage (an enum) and each parameter's place in
the flat partition (a dataclass of two ints). Rebuilding them sets attributes or looks up an enum member; none runs
code of the file's choosing."""

OPCODES = frozenset([
    "PROTO", "STOP", "GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "MARK", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "NONE", "NEWTRUE",
    "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID",
    "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT",
])
"""The opcodes torch's weights-only unpickler reads (torch 2.6+); any other (INST, OBJ, STACK_GLOBAL, EXT*) names
code by another route, and torch would refuse it too."""

FORCE_ENV = {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
"""torch's switch that turns every torch.load of a process into a weights-only one, even where the caller passes
`weights_only=False` (DeepSpeed's readers do)."""

_PICKLE = "data.pkl"
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # a zip entry's local header (signature, ..., name and extra lengths)


class UnsafeFile(ValueError):
    """A file holds objects other than tensors and plain data: loading it could run code. Nothing of it was read."""

    def __init__(self, path: Path, found: Iterable[str]):
        self.path = Path(path)
        self.found = sorted(set(found))
        super().__init__(describe(self.path, self.found))


def describe(path: Path | str, found: list[str]) -> str:
    """The one line saying why `path` is refused (`found`: the globals or opcodes beyond tensors and plain data)."""
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    return f"{path} holds objects other than tensors and plain data ({shown}): loading it could run code"


def pickle_bytes(path: Path) -> bytes:
    """The `data.pkl` record of a torch zip file, read from the zip's own offsets: ayumi's files carry no CRC32
    (pretrain/checkpoint/integrity.py), which Python's zipfile would insist on. ValueError when the file is not a
    torch zip holding exactly one pickle, stored uncompressed (what torch.save writes)."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = [info for info in archive.infolist() if info.filename.rsplit("/", 1)[-1] == _PICKLE]
    except (zipfile.BadZipFile, OSError) as err:
        raise ValueError(f"not a torch zip file ({err})") from None
    if len(entries) != 1 or entries[0].compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"not one stored {_PICKLE} but {len(entries)}")  # two could be read differently by torch
    entry = entries[0]
    with open(path, "rb") as handle:
        handle.seek(entry.header_offset)
        header = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
        if header[0] != b"PK\x03\x04":
            raise ValueError("a zip entry without its local header")
        handle.seek(header[-2] + header[-1], os.SEEK_CUR)  # past the entry's name and extra field
        data = handle.read(entry.file_size)
    if len(data) != entry.file_size:
        raise ValueError(f"{_PICKLE} is cut short")
    return data


def pickle_problems(data: bytes, allowed: frozenset[str]) -> list[str]:
    """The globals and opcodes of a pickle beyond tensors and plain data (empty when it is all tensors and plain
    data). Reads the opcodes only: nothing of the pickle runs."""
    found = []
    try:
        for opcode, argument, _ in pickletools.genops(data):
            if opcode.name not in OPCODES:
                found.append(f"pickle opcode {opcode.name}")
            elif opcode.name == "GLOBAL":
                name = str(argument).replace(" ", ".", 1)
                if name not in TENSOR_GLOBALS and name not in allowed:
                    found.append(name)
    except (ValueError, EOFError, TypeError, UnicodeDecodeError) as err:  # a pickle that does not even parse
        found.append(f"an unreadable pickle ({err})")
    return found


def unsafe_globals(path: Path, allowed: Iterable[str] = ()) -> list[str]:
    """What makes `path` unsafe to load (sorted; empty when it holds only tensors, plain data and `allowed`)."""
    try:
        data = pickle_bytes(Path(path))
    except ValueError as err:
        return [str(err)]
    return sorted(set(pickle_problems(data, frozenset(allowed))))


def check(path: Path, allowed: Iterable[str] = ()) -> None:
    """Refuse `path` (UnsafeFile) unless it holds only tensors, plain data and `allowed` globals."""
    found = unsafe_globals(path, allowed)
    if found:
        raise UnsafeFile(path, found)


def resolve(names: Iterable[str]) -> list[tuple[object, str]]:
    """(object, name) for each global name (`module.Name`) that this Python can import, for torch's allow-list: under
    the name the file spells (an alias module's, e.g. numpy.core for numpy._core), not the object's own."""
    import warnings

    objects = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core, an alias NumPy 2 still answers to
                objects.append((getattr(importlib.import_module(module), attribute), name))
        except (ImportError, AttributeError):  # not in this version: a file naming it is refused by torch
            continue
    return objects


def load(path: Path, allowed: Iterable[str] = (), map_location="cpu"):
    """`torch.load(path, weights_only=True)` with `allowed` globals on torch's allow-list for this load, after the
    static check; UnsafeFile (naming the file) from either."""
    import pickle

    import torch

    allowed = tuple(allowed)
    check(path, allowed)
    try:
        with _allowing(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's unpickler saw what the check did not: refused all the same
        raise UnsafeFile(path, refused_by_torch(err)) from None


def refused_by_torch(err: Exception) -> list[str]:
    """What torch's weights-only unpickler refused, from its message (the global it names, else its reason)."""
    text = str(err)
    named = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)", text)
    if named:
        return [named.group(1)]
    reason = re.search(r"WeightsUnpickler error: (.+)", text)
    return [(reason.group(1) if reason else text.splitlines()[0])[:200]]


def _allowing(names: Iterable[str]):
    """torch's allow-list plus `names` while inside. Only the entries not already there are added (and so removed on
    the way out): torch's list is one set per process, and a nested load must not take away what an outer one
    allowed."""
    import torch

    present = set(torch.serialization.get_safe_globals())
    return torch.serialization.safe_globals([entry for entry in resolve(names) if entry not in present])


@contextlib.contextmanager
def forced_weights_only(allowed: Iterable[str] = ()) -> Iterator[None]:
    """Every torch.load in this process is weights-only while inside (FORCE_ENV), with `allowed` on the allow-list:
    for readers that are not ours and pass `weights_only=False` (DeepSpeed's checkpoint loading and consolidation)."""
    kept = {key: os.environ.get(key) for key in FORCE_ENV}
    os.environ.update(FORCE_ENV)
    try:
        with _allowing(allowed):
            yield
    finally:
        for key, value in kept.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
