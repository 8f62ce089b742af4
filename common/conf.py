"""Hydra's config tree and the Compose-API glue every ayumi command shares.

It lives in `common/`, below the data flow (tokenizer → data → curriculum → pretrain), because
`ayumi tokenizer`, `ayumi data` and training all compose through here,
so they find the same tree (AYUMI_CONF_DIR included) and report a bad override the same way.
The help helpers below make every command answer -h/--help alike: its usage and the config it reads.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import os
import re
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout ayumi runs from (installed editable, so conf/ sits beside the packages)."""

CONF_DIR = Path(os.environ.get("AYUMI_CONF_DIR", REPO_ROOT / "conf"))
"""Hydra's config root; AYUMI_CONF_DIR points elsewhere for a site-specific copy."""


class ConfigCompositionError(ValueError):
    """Hydra could not compose the config (unknown key, wrong type, missing group option)."""


def compose(config_name: str, overrides: Iterable[str], register: Callable[[], None], conf_dir: Path | None = None,
            schema: type | None = None, root: str = "the config", plain_entries: Mapping[str, str] | None = None):
    """conf/<config_name>.yaml with Hydra overrides, as a DictConfig: no output dir, no cwd change.

    `register` puts the command's structured schemas into Hydra's ConfigStore first. Raises
    ConfigCompositionError: given `schema` (the dataclass the composed config's top level is; `root`, how a
    message names that top level), one line for each usual mistake of the command line (every_problem: three
    typos are three lines, not one per rerun), else every message in Hydra's exception chain (the outer one often
    lacks the key, the value or the reason). plain_entries: {a list of sections' key: the field a plain entry fills}
    (entries_as_mappings).
    """
    register()
    conf_dir = Path(conf_dir or CONF_DIR)
    overrides, own = own_config_files(list(overrides), conf_dir)
    overrides, entries = entries_as_mappings(overrides, plain_entries or {})
    try:
        return compose_once(config_name, overrides, conf_dir)
    except Exception as err:  # Hydra and OmegaConf raise many types; all are configuration errors here
        located = composition_problem(err, overrides, schema, root, conf_dir) if schema is not None else None
        if located is None:
            raise ConfigCompositionError(as_typed(describe_error(err), own, conf_dir, entries)) from err
        problems = every_problem(config_name, overrides, located, schema, root, conf_dir)
        raise ConfigCompositionError(as_typed("\n".join(problems), own, conf_dir, entries)) from err


def entries_as_mappings(overrides: list[str], plain_entries: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """(the overrides with each plain entry of a listed key made a mapping, {override as rewritten: as typed}).

    `eval.downstream.tasks=[{path:A,delimiter:""},B]` mixes a task given in full with one given by its file alone;
    Hydra cannot merge a plain value into a list of sections, and its words were about a missing entry. With
    plain_entries {"eval.downstream.tasks": "path"}, B becomes {path:B}, in Hydra's own grammar (quotes kept)."""
    if not plain_entries:
        return overrides, {}
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override
    from hydra.errors import HydraException

    parser, rewritten, typed = OverridesParser.create(), [], {}
    for text in overrides:
        try:
            parsed = parser.parse_override(text)
        except HydraException:  # Hydra says what is wrong with it when it composes
            parsed = None
        field = plain_entries.get(parsed.key_or_group) if parsed is not None and not parsed.is_delete() else None
        value = getattr(parsed, "_value", None)  # as parsed, quotes kept: value() drops them ("" would be lost)
        if field is None or not isinstance(value, list) or all(isinstance(entry, dict) for entry in value):
            rewritten.append(text)
            continue
        entries = [entry if isinstance(entry, dict) else {field: entry} for entry in value]
        new = f"{text.split('=', 1)[0]}={Override._get_value_element_as_str(entries)}"
        rewritten.append(new)
        typed[new] = text
    return rewritten, typed


# -- a group option given as the path of a YAML file of one's own (`curriculum=./my_cur.yaml`) --------------------

YAML_SUFFIXES = (".yaml", ".yml")
"""What marks a group override's value as a file path rather than an option name of conf/GROUP/."""


def own_config_files(overrides: list[str], conf_dir: Path) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(the overrides with each `GROUP=PATH.yaml` made `GROUP=NAME`, {NAME: (GROUP, the override as typed)}).

    A user's own curriculum (or model, optim, ...) file should not have to be copied into conf/ or reached through
    `hydra.searchpath`: its content is stored in Hydra's ConfigStore as an option of the group, under a name made
    from its absolute path, so Hydra composes it exactly as it composes conf/GROUP/NAME.yaml (its `# @package`
    header included). The path is relative to the current folder; every rank starts there and composes alike.
    """
    rewritten, own = [], {}
    for text in overrides:
        prefix, group, value = _group_file_override(text, conf_dir)
        if value is None:
            rewritten.append(text)
            continue
        name = store_own_file(group, Path(value), text, conf_dir)
        own[name] = (group, text)
        rewritten.append(f"{prefix}{group}={name}")
    return rewritten, own


def absolute_file_overrides(overrides: list[str], conf_dir: Path | None = None) -> list[str]:
    """The overrides with each own file's path made absolute (`curriculum=./my_cur.yaml` -> `curriculum=/abs/
    my_cur.yaml`): the form to record, so a replay from another folder composes the same file."""
    conf_dir = Path(conf_dir or CONF_DIR)
    absolute = []
    for text in overrides:
        prefix, group, value = _group_file_override(text, conf_dir)
        absolute.append(text if value is None else f"{prefix}{group}={Path(value).resolve()}")
    return absolute


def _group_file_override(text: str, conf_dir: Path) -> tuple[str, str, str | None]:
    """(Hydra's prefix, the group, the file path) of `GROUP=PATH.yaml` where GROUP is a folder of conf_dir; the
    path is None for every other override (a key, an option name, a deletion)."""
    match = re.fullmatch(r"(\+{0,2})([A-Za-z_][\w/]*)=(.+)", text)
    if not match or not match.group(3).endswith(YAML_SUFFIXES) or not (conf_dir / match.group(2)).is_dir():
        return "", "", None
    return match.group(1), match.group(2), match.group(3).strip("'\"")


def store_own_file(group: str, path: Path, typed: str, conf_dir: Path) -> str:
    """Store the YAML file at `path` as an option of `group` in Hydra's ConfigStore; its option name.
    ConfigCompositionError, naming the file, when it is missing or not a YAML mapping."""
    from hydra.core.config_store import ConfigStore
    from hydra.plugins.config_source import ConfigSource
    from omegaconf import DictConfig, OmegaConf

    if not path.is_file():
        raise ConfigCompositionError(
            f"{typed}: no such file {path} (relative to {Path.cwd()}): give the path of a YAML file of yours, "
            f"or an option of {conf_label(conf_dir)}{group}/ ({', '.join(group_options(group, conf_dir))})")
    text = path.read_text(encoding="utf-8")
    try:
        node = OmegaConf.create(text)
    except Exception as err:  # OmegaConf wraps YAML's parser errors in several types
        raise ConfigCompositionError(f"{typed}: {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(node, DictConfig):
        raise ConfigCompositionError(f"{typed}: {path} must hold a YAML mapping (key: value lines), as the files "
                                     f"of {conf_label(conf_dir)}{group}/ do")
    # A hash of the absolute path keeps the name stable (ranks and reruns agree) and apart from conf/'s options.
    import hashlib
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    package = ConfigSource._get_header_dict(text).get("package")  # Hydra's own reading of `# @package X`
    ConfigStore.instance().store(group=group, name=name, node=node, package=package)
    return name


def as_typed(message: str, own: Mapping[str, tuple[str, str]], conf_dir: Path,
             entries: Mapping[str, str] | None = None) -> str:
    """A composition message with each own file's stored option name, and each override entries_as_mappings
    rewrote, put back as the user typed it."""
    for rewritten, typed in (entries or {}).items():
        message = message.replace(rewritten, typed)
    for name, (group, typed) in own.items():
        path = typed.split("=", 1)[1]
        message = message.replace(f"{conf_label(conf_dir)}{group}/{name}.yaml", path)
        message = message.replace(f"{group}/{name}", path).replace(f"{group}={name}", typed)
    return message


def compose_once(config_name: str, overrides: list[str], conf_dir: Path):
    """One Hydra composition, refused as a '+' that adds a key to a fixed section would be (see below)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # an earlier in-process command (or attempt) may have left it initialized
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        composed = hydra_compose(config_name=config_name, overrides=overrides)
    added = key_added_to_fixed_section(composed, overrides, conf_dir)
    if added is not None:
        raise added
    return composed


def every_problem(config_name: str, overrides: list[str], first: tuple[str, str | None], schema: type, root: str,
                  conf_dir: Path) -> list[str]:
    """The line of each override of the command line that Hydra refuses, in the order they were typed.

    Hydra stops at the first mistake. To name them all at once, the override a line is about is left out and the
    rest composed again, until the rest composes or a mistake cannot be tied to an override as typed (one set in a
    config file, or one with no one-line form): the lines found so far are then the answer.
    """
    found, rest = {}, list(overrides)
    line, override = first
    while override in rest:  # None (a mistake no override is tied to) never is
        found[override] = line
        rest.remove(override)
        try:
            compose_once(config_name, rest, conf_dir)
            break
        except Exception as err:  # as in compose: every exception here is about the configuration
            line, override = composition_problem(err, rest, schema, root, conf_dir) or (None, None)
    lines = [found[text] for text in overrides if text in found]
    return lines if lines else [first[0]]


def key_added_to_fixed_section(composed, overrides: list[str], conf_dir: Path):
    """OmegaConf's KeyError for the first `+key=value` (or `++`) that adds a key a config section does not have,
    else None.

    Hydra's '+' lifts struct mode, so `+train.foo=1` composes and the typed config then drops `foo` without a word:
    a misspelt key would silently do nothing. '+' is for the mappings that take any key (a stage's weights,
    rope_scaling, stability.inject.lr_multiply); a section that is a dataclass keeps its own keys. Config group
    overrides (`+experiment=NAME`, `+stability/inject=NAME`) are Hydra's, not keys, and are left alone.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import ConfigKeyError

    for override in overrides:
        key = override_key(override)
        if not override.startswith("+") or "/" in key or "@" in key or ("." not in key and (conf_dir / key).is_dir()):
            continue
        node, parts = composed, dotted(key).split(".")
        for depth, part in enumerate(parts):
            if isinstance(node, ListConfig):
                node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
                continue
            if not isinstance(node, DictConfig):
                break
            owner = OmegaConf.get_type(node)
            if dataclasses.is_dataclass(owner) and part not in {f.name for f in dataclasses.fields(owner)}:
                err = ConfigKeyError(f"Key '{part}' not in '{owner.__name__}' (added with '+')")
                err.full_key, err.key, err.object_type = ".".join(parts[:depth + 1]), part, owner
                return err
            node = node.get(part)
    return None


def error_lines(prefix: str, err: BaseException) -> str:
    """`err`'s message with `prefix` before each line: every mistake of a command line (compose names them all)
    reads as a line of its own that says which command refused it. An indented line continues the one above it
    (describe_error) and stays as it is."""
    return "\n".join(line if line[:1].isspace() else f"{prefix}{line}" for line in str(err).splitlines())


def describe_error(err: BaseException) -> str:
    """One message from an exception and its chained causes, each distinct text once."""
    parts: list[str] = []
    while err is not None:
        text = str(err).strip()
        if text and text not in parts and "$VALUE" not in text:
            parts.append(text)
        err = err.__cause__ or err.__context__
    return "invalid configuration: " + "\n  ".join(parts)


# -- a composition mistake in one line, the same in every command ---------------------------------

def composition_problem(err: BaseException | None, overrides: list[str] | tuple[str, ...], schema: type,
                        root: str = "the config", conf_dir: Path | None = None) -> tuple[str, str | None] | None:
    """One line for the usual composition mistakes: an unknown key ("did you mean", or that a key new to a mapping
    needs Hydra's '+'), a wrongly typed value, an unknown group option, each named as typed (or with the config file
    that set it), and the override as typed that the line is about (None when a config file set the value, or no
    override matches); None for other mistakes.

    err: the exception Hydra raised (ConfigCompositionError's cause). schema and root: the dataclass the composed
    config's top level is and how a message names that top level. conf_dir: the config root composed from."""
    top = str(err)
    missing = re.search(r"Could not find '([^'/]+)/([^']+)'", top)
    if missing:
        group, option = missing.groups()
        typed = next((text for text in overrides if override_key(text) == group), None)
        line = (f"{group}={option}: no such option in {conf_label(conf_dir)}{group}/; choose one of "
                f"{', '.join(group_options(group, conf_dir))}")
        if Path(f"{option}.yaml").is_file():  # a file of one's own named like an option: the path is the way
            line += f"; or give your file's path: {group}=./{option}.yaml"
        return line, typed
    cause = next((e for e in _chain(err) if getattr(e, "full_key", None)), None)
    if cause is None:
        return None
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = dotted(str(cause.full_key))
    typed = typed_override(top, key, overrides)
    in_file = re.match(r"In '([^']+)'", top)
    given = typed or (f"{key} (set in {conf_label(conf_dir)}{in_file.group(1)}.yaml)" if in_file else key)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return unknown_key_problem(cause, given, typed, schema, root), typed
    if getattr(cause, "object_type", None) is list and str(getattr(cause, "key", "")).isdigit():
        return missing_entry_problem(key, len(cause.parent_node or ()), given), typed
    first_line = str(getattr(cause, "msg", cause)).splitlines()[0]
    return f"{given}: {first_line}", typed


def dotted(key: str) -> str:
    """OmegaConf's `a.list[1].b` as Hydra's override grammar spells it, `a.list.1.b` (what a user types back)."""
    return re.sub(r"\[(\d+)\]", r".\1", key)


def typed_override(top: str, key: str, overrides: list[str] | tuple[str, ...]) -> str | None:
    """The override, as typed, that a composition error is about: the one Hydra names ("Could not override 'a.b'",
    "Error merging override a.b=..."), else one whose key is the error's key, a section of it, or inside it."""
    named = re.search(r"Could not override '([^']+)'|Error merging override ([^=\s]+)=", top)
    if named:
        wanted = named.group(1) or named.group(2)
        for override in overrides:
            if override_key(override) == wanted:
                return override
    typed_keys = [(override, dotted(override_key(override))) for override in overrides]
    for override, typed_key in typed_keys:  # the key itself first: `tokenizer=tiny +tokenizer.foo=1` is about foo
        if typed_key == key:
            return override
    for override, typed_key in typed_keys:
        if (key + ".").startswith(typed_key + ".") or (typed_key + ".").startswith(key + "."):
            return override
    return None


def override_key(override: str) -> str:
    """The key of an override as typed: `+a.b=1` -> `a.b` (Hydra's prefixes +, ++ and ~ dropped)."""
    return override.lstrip("+~").split("=", 1)[0]


def unknown_key_problem(cause: BaseException, given: str, typed: str | None, schema: type, root: str) -> str:
    """The line for a key the config lacks: "did you mean" among the section's own keys (a dataclass), or, for a
    mapping that takes any key (a stage's weights, rope_scaling), that a key new to it needs Hydra's '+'."""
    import difflib

    key = dotted(str(cause.full_key))
    leaf = str(getattr(cause, "key", None) or key.rpartition(".")[2])
    section = key[:-len(leaf) - 1] if key.endswith("." + leaf) else ""
    owner = getattr(cause, "object_type", None)
    if not section and owner not in (None, schema) and typed:
        # Inside a list given whole (stages=[{...}]): OmegaConf names the key from the entry, not the config.
        label, prefix = f"an entry of {override_key(typed)}", ""
    else:
        label, prefix = section or root, f"{section}." if section else ""
    if owner is dict:  # a mapping with no fixed keys: in struct mode Hydra adds one only when told to
        fix = f"+{typed}" if typed else f"+{key}=VALUE"
        return f"{given}: {label} has no key {leaf!r}: a new key needs Hydra's '+' ({fix})"
    names = ([f.name for f in dataclasses.fields(owner)] if dataclasses.is_dataclass(owner)
             else schema_keys(section, schema))
    close = difflib.get_close_matches(leaf, names, n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
    return f"{given}: {label} has no key {leaf!r}; {hint}"


def missing_entry_problem(key: str, entries: int, given: str) -> str:
    """The line for an override that names a list entry the list lacks (`curriculum.stages.7.seq_len=64` on four
    stages): OmegaConf's own words are a type error about an empty dict."""
    section, _, index = key.rpartition(".")
    has = f"has {entries} entries (0-{entries - 1})" if entries > 1 else ("has 1 entry (0)" if entries else "is empty")
    return (f"{given}: {section} {has}, so there is no entry {index}; an override changes an entry, it cannot add "
            f"one (give the whole list: {section}=[...])")


def _chain(err: BaseException | None):
    """An exception and the ones it was raised from, outermost first."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def schema_keys(section: str, schema: type) -> list[str]:
    """The field names of a config section (dotted path; '' = the top level) of a dataclass schema."""
    from omegaconf import DictConfig, OmegaConf

    tree = OmegaConf.structured(schema)
    node = OmegaConf.select(tree, section) if section else tree
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


ENV_ONLY = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")
"""An environment variable without a default (`${oc.env:NAME}`): the value must come from somewhere."""


def unset_environment(cfg) -> list[str]:
    """One line per value of a composed config taken from an environment variable that is not set.

    An experiment may name a required path as `${oc.env:NAME}` (conf/experiment/continue_ja.yaml);
    left unset, OmegaConf reports it as a KeyError, once per chained exception, without the key.
    Checked before anything resolves, so the user reads which key to give and which variable.
    """
    from omegaconf import OmegaConf

    problems: list[str] = []

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{key}[{index}]")
        elif isinstance(node, str):
            for name in ENV_ONLY.findall(node):
                if name not in os.environ:
                    hint = _placeholder(key)
                    problems.append(f"{key} is not set: give {key}={hint} on the command line, or set the "
                                    f"environment variable {name} (export {name}={hint})")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return problems


def _placeholder(key: str) -> str:
    """How a message names the value to give: DIR for a *_dir key, PATH for other paths, else VALUE."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf.endswith("_dir"):
        return "DIR"
    return "PATH" if leaf.endswith(("_from", "_path", "_file", "root")) else "VALUE"


class PlantedInterpolation(ValueError):
    """A config read back from a run (config.yaml, a checkpoint's record, the config history) holds `${...}`."""


def plain_config(data: Any, where: str, key: str = "") -> Any:
    """`data` (a config read back from a file: dicts, lists, scalars) unchanged, once no string in it holds an
    interpolation; PlantedInterpolation naming `where` and the key otherwise.

    ayumi records configs resolved, so a `${...}` there was written by someone else: resolving it would run
    OmegaConf's resolvers on their behalf (`${oc.env:SECRET}` copies the environment into the run's outputs)."""
    if isinstance(data, dict):
        for name, value in data.items():
            plain_config(value, where, f"{key}.{name}" if key else str(name))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            plain_config(value, where, f"{key}[{index}]")
    elif isinstance(data, str) and "${" in data:
        shown = data if len(data) <= 60 else data[:57] + "..."
        raise PlantedInterpolation(
            f"{where}: {key or 'a value'} holds an interpolation ({shown!r}); ayumi records configs resolved and "
            "resolves nothing read back from a run. Fix: write the value itself there, or take the run from a "
            "source you trust")
    return data


# -- help: every `ayumi` command answers -h/--help alike, and says which config it reads ----------

HELP_FLAGS = ("-h", "--help")


def asks_for_help(argv: Iterable[str]) -> bool:
    """-h or --help anywhere among the arguments.

    Commands check this before Hydra sees the arguments (it reads `--help` as a malformed
    override), so a command asked for help prints it and starts nothing.
    """
    return any(arg in HELP_FLAGS for arg in argv)


def group_options(group: str, conf_dir: Path | None = None) -> list[str]:
    """The options of a config group: the YAML names under conf/<group>/, sorted."""
    return sorted(path.stem for path in (Path(conf_dir or CONF_DIR) / group).glob("*.yaml"))


def conf_label(conf_dir: Path | None = None) -> str:
    """How help texts name the config root: `conf/` in the checkout, else its full path (AYUMI_CONF_DIR)."""
    root = Path(conf_dir or CONF_DIR)
    return "conf/" if root == REPO_ROOT / "conf" else f"{root}/"


def composed_from(config_name: str, group: str, conf_dir: Path | None = None) -> str:
    """'conf/NAME.yaml + GROUP=NAME from conf/GROUP/ (a, b, c)': what a Hydra command composes."""
    conf = conf_label(conf_dir)
    options = ", ".join(group_options(group, conf_dir))
    return f"{conf}{config_name}.yaml + {group}=NAME from {conf}{group}/ ({options})"


def config_help(reads: str, overrides: bool = True, cfg_job: bool = True) -> str:
    """The `config:` paragraph that ends every command's help, so each says alike what it reads.

    reads: what the command takes its settings from, e.g. composed_from(...), or for a command
    that composes nothing, "no config from conf/: RUN_DIR/metrics.jsonl ..." with overrides=False.
    cfg_job: whether the command takes `--cfg job`.
    """
    if not overrides:
        text = f"config: reads {reads}; takes no key=value overrides."
    else:
        text = f"config: reads {reads}; overrides key=value (e.g. a.b=3, list=[x,y])"
        text += "; `--cfg job` prints the resolved config and exits." if cfg_job else "."
    return textwrap.fill(text, width=100, subsequent_indent="  ", break_on_hyphens=False)


def command_help(usage: str, about: str, reads: str, overrides: bool = True) -> str:
    """The whole help of a command without an argparse parser: usage line, what it does, config."""
    return f"usage: {usage}\n\n{about.strip()}\n\n{config_help(reads, overrides)}"


# -- the documented fields of a dataclass config, for --help (as litgpt lists its arguments) -----------

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} of a dataclass: the string literal right below each field in the class source.

    Python keeps no such docstring at run time, so the source is read with `ast` (once per class, and each
    module parsed once: inspect.getsource would parse the whole module again for every class).
    """
    node = _class_nodes(inspect.getsourcefile(cls))[cls.__qualname__]
    docs = {}
    for field_node, after in zip(node.body, node.body[1:]):
        if isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name) and _is_string(after):
            docs[field_node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def _class_nodes(path: str) -> dict[str, ast.ClassDef]:
    """Every class definition of a source file by qualified name (Outer.Inner for a nested one)."""
    found: dict[str, ast.ClassDef] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                found[prefix + node.name] = node
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(Path(path).read_text(encoding="utf-8")).body, "")
    return found


def _is_string(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds (a nested section), else None."""
    return hint if dataclasses.is_dataclass(hint) and isinstance(hint, type) else None


def _entry_section(hint: Any) -> tuple[str, type] | None:
    """(how an entry is named, its dataclass) of a `dict[str, Section]` field (`.NAME`, e.g. tokenizer.domains)
    or a `list[Section]` field (`[N]`, e.g. curriculum.stages); None for any other field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and len(args) == 2 and _section_type(args[1]):
        return ".NAME", args[1]
    if origin is list and len(args) == 1 and _section_type(args[0]):
        return "[N]", args[0]
    return None


def default_text(f: dataclasses.Field) -> str:
    """A field's default as an override would spell it (true, null, [a, b]); ??? when it has none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "???"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False, default=_plain)
    return str(value) if value != "" else "''"


def _plain(value: Any) -> Any:
    """A dataclass inside a list or dict default as the mapping an override would give."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def config_fields(cls: type, prefix: str = "",
                  entries: Mapping[str, type] | None = None) -> list[tuple[str, str | None, str]]:
    """(dotted name, default or None for a section, docstring) of every field of a dataclass config, depth first.

    A nested dataclass is a section (its own row, then its fields); a `dict[str, Section]` field lists its
    entries' fields under `name.NAME.`, a `list[Section]` field under `name[N].`. `entries` names the entry
    dataclass of dict fields typed loosely (e.g. {"data.domains": DomainConfig} where the schema says
    dict[str, Any]).
    """
    entries = entries or {}
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    rows: list[tuple[str, str | None, str]] = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        section = _section_type(hints[f.name])
        if section is not None:
            rows.append((name, None, docs.get(f.name, "")))
            rows += config_fields(section, name + ".", entries)
            continue
        rows.append((name, default_text(f), docs.get(f.name, "")))
        entry = _entry_section(hints[f.name]) or ((".NAME", entries[name]) if name in entries else None)
        if entry is not None:
            rows += config_fields(entry[1], name + entry[0] + ".", entries)
    return rows


def fields_help(cls: type, schema: str, entries: Mapping[str, type] | None = None) -> str:
    """The `fields:` block of a command's help: every field of the config it reads, `name = default  — docstring`.

    schema: where the dataclasses live, e.g. "pretrain/config.py". The defaults are the schema's; the YAML
    files of conf/ (and experiment=) set many others, which `--cfg job` prints resolved.
    """
    lines = [f"fields ({schema}; defaults are the schema's: conf/ files change some, `--cfg job` prints the values):"]
    for name, default, doc in config_fields(cls, entries=entries):
        head = f"{name}.*" if default is None else f"{name} = {default}"
        text = f"{head}  — {doc}" if doc else head
        indent = "  " if default is None else "    "
        lines += textwrap.wrap(text, width=100, initial_indent=indent, subsequent_indent=indent + "    ",
                               break_on_hyphens=False, break_long_words=False)
    return "\n".join(lines)
