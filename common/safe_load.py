"""torch files read without running code or changing the process: every pickle checked before it is read, then read
with `weights_only=True`.

A `.pt` file is a zip whose `data.pkl` is a pickle, and unpickling calls whatever functions the pickle names: a file
that someone else could write runs code as whoever loads it. Checksums do not help (whoever writes a file can write
its checksum too). Two gates, both closed unless a file passes:

- `unsafe_globals(path, allowed)`: a static look at the pickle (`pickletools` lists its opcodes and runs nothing),
  taken from the file through torch's own zip reader, so that it is the record torch.load would unpickle: a file
  that is not a zip archive (torch would read it as a legacy pickle stream), or that has not exactly one
  `data.pkl` record (torch matches that name whatever its case), is refused. Every opcode must be one of OPCODES,
  every global one of TENSOR_GLOBALS or `allowed`, and each global used only as USES says (called, made new,
  given state once); BUILD applies only to an object the pickle has just made. The checkpointer checks a whole
  folder with it (ranks sharing the files) before any rank reads one, and `ayumi checkpoint verify` with it;
- `load(path, allowed)`: the same check, then `torch.load(weights_only=True)` with exactly `allowed` on torch's own
  allow-list (`torch.serialization.safe_globals`) for this one load, both from one open file (what replaces the
  path after the check is never loaded). Third-party readers that call `torch.load` themselves with
  `weights_only=False` (DeepSpeed's loaders and converter) run under `forced_weights_only`: torch.load is then this
  `load`, so every file they read passes the same gate at the moment it is read.

What torch's allow-list holds for DeepSpeed's objects is never their class but a stand-in (`constructor`): torch's
unpickler applies BUILD to an allow-listed type with `__dict__.update`, which on an enum member would rewrite a
singleton the whole process shares. The stand-ins make every object anew from plain values, so torch refuses a BUILD
on anything else (the second gate for what the first already refuses).

Either gate refuses with UnsafeFile: one line naming the file and what it holds beyond tensors and plain data.
Nothing here ever loads with `weights_only=False`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import pickletools
import re
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
the flat partition (a dataclass of two ints). torch's allow-list gets stand-ins for them (`constructor`): an enum
member looked up by its int value, a new object given plain values; none runs code of the file's choosing, none
changes an object that is not new."""

OPCODES = frozenset([
    "PROTO", "STOP", "GLOBAL", "REDUCE", "NEWOBJ", "BUILD", "MARK", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE", "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT",
    "LONG_BINPUT",
])
"""The opcodes of ayumi's and DeepSpeed's files (torch.save's protocol 2), all of which torch's weights-only unpickler
reads. Any other is refused: INST, OBJ, STACK_GLOBAL, EXT* name code by another route (torch refuses them too), and
the few more torch reads (EMPTY_SET, SHORT_BINSTRING) no checkpoint of ayumi's holds."""

USES = {
    "torch._utils._rebuild_tensor_v2": frozenset({"REDUCE"}),
    "torch._tensor._rebuild_from_type_v2": frozenset({"REDUCE"}),
    "torch.Size": frozenset({"REDUCE"}),
    "_codecs.encode": frozenset({"REDUCE"}),
    "collections.OrderedDict": frozenset({"REDUCE", "BUILD"}),  # a state dict's `_metadata`, set on the new dict
    "deepspeed.runtime.zero.config.ZeroStageEnum": frozenset({"REDUCE"}),  # a member from its value; never BUILD
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": frozenset({"NEWOBJ", "BUILD"}),
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": frozenset({"NEWOBJ", "BUILD"}),
    "deepspeed.utils.tensor_fragment.fragment_address": frozenset({"NEWOBJ", "BUILD"}),
}
"""How a pickle may use each global (as ayumi's and DeepSpeed's files do): call it (REDUCE), make a new instance
(NEWOBJ), give what it made its state (BUILD, once, right after). Storages, dtypes and torch.Tensor are only ever
arguments. A global a caller allows without an entry here (an older ayumi's NumPy arrays, for the --trust conversion)
may be called and given state (LOOSE_USES)."""

LOOSE_USES = frozenset({"REDUCE", "BUILD"})

FORCE_ENV = {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}
"""torch's switch that turns every torch.load of a process into a weights-only one, even where the caller passes
`weights_only=False` (DeepSpeed's readers do)."""

_PICKLE = "data.pkl"


class UnsafeFile(ValueError):
    """A file holds objects other than tensors and plain data: loading it could run code. Nothing of it was read."""

    def __init__(self, path: Path, found: Iterable[str]):
        self.path = Path(path)
        self.found = sorted(set(found))
        super().__init__(describe(self.path, self.found))


def describe(path: Path | str, found: list[str]) -> str:
    """The one line saying why `path` is refused (`found`: what the gates found beyond tensors and plain data)."""
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    return f"{path} {what_is_wrong(found)} ({shown}): {what_it_risks(found)}"


_FORMAT = ("not a zip archive", "not one ", "not a torch zip file", "an unreadable pickle")
_MISUSE = ("pickle BUILD on ", "pickle REDUCE of ", "pickle NEWOBJ of ", " given ")


def what_is_wrong(found: list[str]) -> str:
    """What a refused file is, by the worst of what was found: not a file the check can read, objects beyond
    tensors and plain data, or allowed objects used otherwise than checkpoint files use them."""
    if any(item.startswith(_FORMAT) for item in found):
        return "is not a torch file ayumi can check"
    if found and all(item.startswith(_MISUSE[:3]) or _MISUSE[3] in item or item.endswith("made without its state")
                     for item in found):
        return "uses allowed objects otherwise than checkpoint files do"
    return "holds objects other than tensors and plain data"


def what_it_risks(found: list[str]) -> str:
    """What loading the file anyway could do (the end of `describe`'s line)."""
    wrong = what_is_wrong(found)
    if wrong.startswith("is not"):
        return "torch would read a pickle that was never checked"
    if wrong.startswith("uses"):
        return "loading it could change objects the whole process shares"
    return "loading it could run code"


def pickle_bytes(path: Path) -> bytes:
    """The pickle torch.load would unpickle from `path` (`pickle_record` of the open file)."""
    with open(path, "rb") as handle:
        return pickle_record(handle)


def pickle_record(handle) -> bytes:
    """The pickle torch.load would unpickle from an open file, read through torch's own zip reader (the one torch.load
    opens), not Python's zipfile: zipfile accepts data before an archive and matches names by case, torch does
    neither. ValueError when the file is not a zip archive (torch would read it as a legacy pickle stream), or when it
    has not exactly one `data.pkl` record, whatever the case of the name (two could be read differently)."""
    import torch

    handle.seek(0)
    if not torch.serialization._is_zipfile(handle):  # torch.load's own test: a legacy stream otherwise
        raise ValueError("not a zip archive (torch would unpickle it as a legacy stream)")
    try:
        reader = torch._C.PyTorchFileReader(handle)
        records = sorted(name for name in reader.get_all_records() if name.lower() == _PICKLE)
        if len(records) != 1:
            raise ValueError(f"not one {_PICKLE} record but {len(records)} ({', '.join(records) or 'none'})")
        return reader.get_record(_PICKLE)  # what torch.load reads: its lookup, whatever the name's case
    except RuntimeError as err:  # torch's reader: not a zip it can read
        raise ValueError(f"not a torch zip file ({str(err).splitlines()[0][:200]})") from None


def pickle_problems(data: bytes, allowed: frozenset[str]) -> list[str]:
    """The globals and opcodes of a pickle beyond tensors and plain data, then any global used otherwise than USES
    says (empty when it is all tensors, plain data and `allowed`). Reads the opcodes only: nothing of the pickle
    runs."""
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
    return found or misuses(data, allowed)


class _Item:
    """What the static check knows of one object on the pickle's stack: the global it is, or the global whose call
    made it (and whether that object has been given its state)."""

    __slots__ = ("name", "made_by", "built")

    def __init__(self, name: str | None = None, made_by: str | None = None):
        self.name, self.made_by, self.built = name, made_by, False


_PLAIN = _Item()  # a number, string, container or storage: nothing to call or to build
_PUSHES_PLAIN = frozenset(["EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "NONE", "NEWTRUE", "NEWFALSE", "BININT",
                           "BININT1", "BININT2", "LONG1", "BINFLOAT", "BINUNICODE"])


def misuses(data: bytes, allowed: frozenset[str]) -> list[str]:
    """Each global used otherwise than USES says, found by following the pickle's stack (a pickle of OPCODES only):
    a global called or made new that is not meant to be, a BUILD on anything but an object just made by a global
    that takes state (a shared enum member, a class, a second BUILD), an object made new and never given its state."""
    uses = {name: USES.get(name, LOOSE_USES if name in allowed else frozenset()) for name in (*USES, *allowed)}
    stack: list[_Item] = []
    marks: list[list[_Item]] = []
    memo: dict[int, _Item] = {}
    made_new: list[_Item] = []
    found: list[str] = []
    try:
        for opcode, argument, _ in pickletools.genops(data):
            op = opcode.name
            if op == "GLOBAL":
                stack.append(_Item(name=str(argument).replace(" ", ".", 1)))
            elif op in ("REDUCE", "NEWOBJ"):
                stack.pop()  # the arguments: plain data, tensors or allowed globals (checked as such)
                made = _Item(made_by=_called(stack.pop(), op, uses, found))
                made_new += [made] if op == "NEWOBJ" else []
                stack.append(made)
            elif op == "BUILD":
                stack.pop()  # the state
                _build(stack[-1], uses, found)
            elif op == "MARK":
                marks.append(stack)
                stack = []
            elif op in ("APPENDS", "SETITEMS", "TUPLE"):
                stack = marks.pop()  # the items went into the list, dict or tuple below the mark
                stack += [_PLAIN] if op == "TUPLE" else []
            elif op in ("TUPLE1", "TUPLE2", "TUPLE3", "APPEND", "SETITEM", "BINPERSID", "STOP"):
                del stack[len(stack) - {"TUPLE2": 2, "TUPLE3": 3, "SETITEM": 2}.get(op, 1):]
                stack += [_PLAIN] if op.startswith("TUPLE") or op == "BINPERSID" else []
            elif op in ("BINPUT", "LONG_BINPUT"):
                memo[argument] = stack[-1]
            elif op in ("BINGET", "LONG_BINGET"):
                stack.append(memo[argument])
            elif op in _PUSHES_PLAIN:
                stack.append(_PLAIN)
    except (IndexError, KeyError) as err:  # a stack or memo the pickle never filled: torch could not read it either
        return [f"an unreadable pickle (its stack: {type(err).__name__})"]
    return found + [f"a {item.made_by} made without its state" for item in made_new if not item.built]


def _called(item: _Item, op: str, uses: dict[str, frozenset[str]], found: list[str]) -> str | None:
    """The global `op` (REDUCE or NEWOBJ) calls, recording it in `found` unless USES lets it be called that way."""
    if item.name is None or op not in uses.get(item.name, ()):
        found.append(f"pickle {op} of {item.name or 'an object that is no global'}")
        return None
    return item.name


def _build(item: _Item, uses: dict[str, frozenset[str]], found: list[str]) -> None:
    """A BUILD on `item`: allowed once, on an object just made by a global that takes state; else in `found`."""
    if item.made_by is None or "BUILD" not in uses.get(item.made_by, ()) or item.built:
        what = item.name or item.made_by or "plain data"
        found.append(f"pickle BUILD on {what}{' again' if item.built else ''}")
    if item.made_by is not None:  # _PLAIN is shared: never marked
        item.built = True


def unsafe_globals(path: Path, allowed: Iterable[str] = ()) -> list[str]:
    """What makes `path` unsafe to load (sorted; empty when it holds only tensors, plain data and `allowed`)."""
    with open(path, "rb") as handle:
        return _problems_of(handle, frozenset(allowed))


def _problems_of(handle, allowed: frozenset[str]) -> list[str]:
    """What makes the open file `handle` unsafe to load (sorted; empty when it is safe)."""
    try:
        data = pickle_record(handle)
    except ValueError as err:
        return [str(err)]
    return sorted(set(pickle_problems(data, allowed)))


def check(path: Path, allowed: Iterable[str] = ()) -> None:
    """Refuse `path` (UnsafeFile) unless it holds only tensors, plain data and `allowed` globals."""
    found = unsafe_globals(path, allowed)
    if found:
        raise UnsafeFile(path, found)


def resolve(names: Iterable[str]) -> list[tuple[object, str]]:
    """(object, name) for each global name (`module.Name`) that this Python can import, for torch's allow-list: under
    the name the file spells (an alias module's, e.g. numpy.core for numpy._core), not the object's own. DeepSpeed's
    objects are their stand-ins (`constructor`), never their classes."""
    import warnings

    objects = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # numpy.core, an alias NumPy 2 still answers to
                found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):  # not in this version: a file naming it is refused by torch
            continue
        objects.append((constructor(name, found) if name in DEEPSPEED_GLOBALS else found, name))
    return objects


@functools.lru_cache(maxsize=None)
def constructor(name: str, cls: type) -> object:
    """What torch's unpickler gets for DeepSpeed's global `name` (class `cls`): for an enum, a function from a member's
    value to the member; for a class, a stand-in that NEWOBJ makes bare and BUILD fills with plain values, then turns
    into a `cls`. Neither is `cls`, so torch refuses a BUILD on anything but a stand-in just made (on a shared enum
    member, on a `cls` already built). One per name for the process, so that torch's allow-list sees the same
    entry in nested loads."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        return _member_of(cls)
    return _rebuilt(cls)


def _member_of(cls: type) -> object:
    """A function giving the member of the enum `cls` whose value is a given int, as pickle's REDUCE calls the enum."""
    def member(value):
        if type(value) is not int or value not in cls._value2member_map_:
            raise pickle.UnpicklingError(f"{cls.__name__} has no member {value!r}")
        return cls(value)

    member.__qualname__ = f"member_of_{cls.__name__}"
    return member


def _rebuilt(cls: type) -> type:
    """A stand-in for DeepSpeed's class `cls` that NEWOBJ makes bare and BUILD fills (`__setstate__`): only public
    attributes the class does not itself define (no method or property is shadowed), only plain values; the object
    then becomes a `cls` (its class swapped: same layout), which pickles and behaves as DeepSpeed's own."""
    class Rebuilt(cls):
        def __new__(kind, *args):
            if args:  # DeepSpeed's files make these with no arguments (pickle's __newobj__ of a plain class)
                raise pickle.UnpicklingError(f"{cls.__name__} made with arguments")
            return object.__new__(kind)

        def __setstate__(self, state):
            bad = _bad_state(cls, state)
            if bad:
                raise pickle.UnpicklingError(f"{cls.__name__} given {bad}")
            self.__dict__.update(state)
            self.__class__ = cls  # a later BUILD finds a `cls`, which is on no allow-list: refused

    Rebuilt.__qualname__ = Rebuilt.__name__ = f"Rebuilt{cls.__name__}"
    return Rebuilt


def _bad_state(cls: type, state: object) -> str | None:
    """What is wrong with `state` as the attributes of a new `cls` (None when it is a dict of plain values under
    public names that `cls` does not define itself)."""
    import torch

    if type(state) is not dict:
        return f"state of type {type(state).__name__}"
    for key, value in state.items():
        if type(key) is not str or not key.isidentifier() or key.startswith("_") or hasattr(cls, key):
            return f"the attribute {str(key)[:80]!r}"
        if not (value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.dtype)):
            return f"{key}={type(value).__name__}"
    return None


def load(path: Path, allowed: Iterable[str] = (), map_location="cpu", mapped: bool = False):
    """`torch.load(path, weights_only=True)` with `allowed` globals on torch's allow-list for this load (DeepSpeed's as
    their stand-ins), after the static check; UnsafeFile (naming the file) from either. The file is opened once and
    both read that one open file: a file put in `path`'s place after the check is never what torch loads.
    `mapped`: the tensors are mapped from the file, not read (torch's mmap), for a caller that only looks at names
    and shapes; torch maps the same open file (/dev/fd), never the path again."""
    with open(path, "rb") as handle:
        return _load_checked(handle, path, tuple(allowed), map_location, mapped)


def _load_checked(handle, name, allowed: tuple[str, ...], map_location, mapped: bool = False):
    """The static check of the open file `handle`, then torch's weights-only load of the same file object."""
    import torch

    found = _problems_of(handle, frozenset(allowed))
    if found:
        raise UnsafeFile(name, found)
    handle.seek(0)
    same_file = f"/dev/fd/{handle.fileno()}" if mapped and os.path.isdir("/dev/fd") else None
    try:
        with _allowing(allowed):  # torch.serialization.load: torch.load itself may be the gate (forced_weights_only)
            if same_file:
                return torch.serialization.load(same_file, map_location=map_location, weights_only=True, mmap=True)
            return torch.serialization.load(handle, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # torch's unpickler saw what the check did not: refused all the same
        raise UnsafeFile(name, refused_by_torch(err)) from None


def refused_by_torch(err: Exception) -> list[str]:
    """What torch's weights-only unpickler refused, from its message (the global it names, else its reason)."""
    text = str(err)
    named = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module \S+ is blocked)", text)
    if named:
        return [named.group(1)]
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)  # the reason may start on a later line
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
    """Every torch.load in this process goes through the gate while inside (`gate_torch_load`), is weights-only
    (FORCE_ENV, for processes it starts) and has `allowed` on the allow-list: for readers that are not ours and pass
    `weights_only=False` (DeepSpeed's checkpoint loading and consolidation)."""
    import torch

    kept = {key: os.environ.get(key) for key in FORCE_ENV}
    os.environ.update(FORCE_ENV)
    ungated = torch.load
    gate_torch_load(allowed)
    try:
        with _allowing(allowed):
            yield
    finally:
        torch.load = ungated
        for key, value in kept.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def gate_torch_load(allowed: Iterable[str] = (), then=None, refused=None) -> None:
    """Make `torch.load` this module's `load`: whatever a reader passes (`weights_only=False`, a pickle module), the
    file is opened once, checked, and loaded weights-only with `allowed` from that open file; UnsafeFile names it.
    `then(path, loaded)`, when given, looks at what was loaded before the reader gets it; `refused(line)`, when given,
    is called with UnsafeFile's line instead of raising (a process whose workers' exceptions may not survive the way
    back). A process that only converts (DeepSpeed's universal converter, a child of its own) calls this once at
    start; forked workers inherit it."""
    import torch

    allowed = tuple(allowed)

    def gated_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **pickle_load_args):
        name = Path(f) if isinstance(f, (str, os.PathLike)) else Path(getattr(f, "name", "an open file"))
        try:
            loaded = load(name, allowed, map_location) if isinstance(f, (str, os.PathLike)) else \
                _load_checked(f, name, allowed, map_location)
        except UnsafeFile as err:
            if refused is None:
                raise
            refused(str(err))
            raise
        if then is not None:
            then(name, loaded)
        return loaded

    gated_load.__doc__ = f"torch.load through common.safe_load's gate ({len(allowed)} globals allowed beyond tensors)"
    torch.load = gated_load
