"""The run's config record: which config trained which steps, kept append-only.

    RUN_DIR/config.yaml               the config the run trains with now (resolved; what export and eval read)
    RUN_DIR/config_history.jsonl      one line per version: the step it trains from, the command line's overrides,
                                      the differences from the version before and the whole resolved config

A version is added only once every check before training has passed (pretrain.train.build_trainer, rank 0), and
only when the config differs from the last one; a refused start writes nothing. Lines are only ever appended: a
resume from a checkpoint older than a recorded version supersedes it in the timeline (`timeline`), and the line
stays. Imports no torch.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.conf import override_key

CONFIG = "config.yaml"
HISTORY = "config_history.jsonl"
TOKENIZER = "tokenizer"
"""The run's own copy of its tokenizer (`keep_tokenizer`): what its checkpoints record, export copies and eval reads."""

SESSION_KEYS = ("resume", "checkpoint.load_from", "checkpoint.resume", "train.max_steps", "stability.inject",
                "hang.inject_delay_s", "hang.inject_rank", "checkpoint.inject_write_delay_s")
"""Settings of one session, not of the run: this command's acknowledgement, where this session stops, a fire drill,
how a run starts (another run's checkpoint). A resume never replays them, and they never make a new version."""


def session_only(key: str) -> bool:
    """Whether the config key (or an override's key) `key` is one session's (SESSION_KEYS)."""
    return any(key == name or key.startswith(name + ".") for name in SESSION_KEYS)


def run_settings(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`config` without its session settings: what makes two versions of the run differ."""
    return {key: run_settings(value, f"{prefix}{key}.") if isinstance(value, dict) else value
            for key, value in config.items() if not session_only(f"{prefix}{key}")}


def run_overrides(overrides: list[str]) -> list[str]:
    """The overrides that are the run's (a session's own left out)."""
    return [override for override in overrides if not session_only(override_key(override))]


@dataclass
class ConfigVersion:
    """One version of the run's config."""

    from_step: int
    """The first step this version trained (0 for the run's start; the resume step after a change)."""
    config: dict[str, Any]
    """The whole resolved config, as the ranks hold it (paths absolute)."""
    overrides: list[str] = field(default_factory=list)
    """The command line's overrides that composed it (a resume replays those it leaves out; a session's own are
    recorded, never replayed)."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """The differences from the version before: {key, was, now, kind} (pretrain/startup/resume.py)."""
    written: str = ""
    """When it was recorded (local time)."""


def absolute_paths(cfg: Any) -> None:
    """The run dir, the checkpoint dir and the data root made absolute, in place: every rank of a job, and every
    later resume, names the same folders whatever its working directory. Links are kept, not resolved: the
    checkpointer must see a `checkpoints/` that is a link to refuse it (pretrain/checkpoint/paths.py)."""
    cfg.run_dir = os.path.abspath(cfg.run_dir)
    cfg.checkpoint.dir = os.path.abspath(cfg.checkpoint.dir)
    cfg.data.root = os.path.abspath(cfg.data.root)
    if getattr(cfg.data, "exclude", None):
        cfg.data.exclude = os.path.abspath(cfg.data.exclude)


def resolved_config(cfg: Any) -> dict[str, Any]:
    """The whole config as recorded: plain values, interpolations resolved, the run's folders absolute."""
    import copy

    from omegaconf import OmegaConf

    held = copy.deepcopy(cfg)
    absolute_paths(held)
    return OmegaConf.to_container(OmegaConf.structured(held), resolve=True)


def read_history(run_dir: str | Path) -> list[ConfigVersion]:
    """Every version in the order written; a line cut by a crash is skipped."""
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return []
    versions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            versions.append(ConfigVersion(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return versions


def timeline(versions: list) -> list:
    """The versions the run's present timeline holds, by first step: a version recorded at a resume from an older
    checkpoint supersedes those recorded from a later step (that future was abandoned). Anything with a `from_step`
    (a config version, a batch layout of pretrain/step_samples.py)."""
    kept: list[ConfigVersion] = []
    for version in versions:
        kept = [old for old in kept if old.from_step < version.from_step] + [version]
    return kept


def last_version(run_dir: str | Path) -> ConfigVersion | None:
    """The version the run trained with last: the history's newest, else (a run recorded before the history
    existed) its config.yaml with no overrides known; None for a run never started. A resume replays its overrides
    and compares its config, so a `${...}` in either (never recorded by ayumi, which records them resolved) is
    refused: ConfigError naming the file and the key."""
    versions = read_history(run_dir)
    if versions:
        return plain_version(versions[-1], Path(run_dir) / HISTORY)
    path = Path(run_dir) / CONFIG
    if path.is_file():
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            return None
        return plain_version(ConfigVersion(0, loaded), path) if isinstance(loaded, dict) else None
    return None


def plain_version(version: ConfigVersion, path: Path) -> ConfigVersion:
    """`version` (read from `path`) once neither its config nor its overrides hold an interpolation; ConfigError
    otherwise (a planted `${oc.env:...}` would be resolved by the resume's composition)."""
    from common.conf import PlantedInterpolation, plain_config
    from pretrain.config import ConfigError

    try:
        plain_config(version.config, str(path), "config")
        for override in version.overrides:
            plain_config(override, str(path),
                         f"override {override.split('=', 1)[0]} (name it on the command line to give it yourself)")
    except PlantedInterpolation as err:
        raise ConfigError(str(err)) from None
    return version


def config_for_step(run_dir: str | Path, step: int) -> ConfigVersion | None:
    """The version that trained step `step` (1-based, as the progress line and the events count), or None."""
    found = None
    for version in timeline(read_history(run_dir)):
        if version.from_step < max(step, 1):
            found = version
    return found


def is_new_version(previous: ConfigVersion | None, config: dict[str, Any], overrides: list[str]) -> bool:
    """Whether `config` composed from `overrides` differs from `previous` in anything but a session's settings."""
    return previous is None or run_settings(previous.config) != run_settings(config) or \
        run_overrides(previous.overrides) != run_overrides(overrides)


def kept_tokenizer(tokenizer_dir: str | None) -> Path | None:
    """Where the run keeps its copy of `tokenizer_dir` (keep_tokenizer), relative to the run dir, as its checkpoints
    record it (a run copied or moved elsewhere still finds it): `tokenizer`, or the file's name in it for a bare
    SentencePiece .model; None when the run names no tokenizer."""
    if not tokenizer_dir:
        return None
    source = Path(tokenizer_dir)
    return Path(TOKENIZER) / source.name if source.is_file() else Path(TOKENIZER)


def keep_tokenizer(run_dir: str | Path, tokenizer_dir: str | None) -> None:
    """Copy the run's tokenizer (its folder's files, not its subfolders; or the one file) into RUN_DIR/tokenizer.

    A checkpoint records this copy, never a path outside its run: a path recorded in a run folder is read only inside
    it (pretrain/checkpoint/recorded.py), and the run then exports and evaluates with its own tokenizer wherever the
    original lives. Written once, atomically; a copy that already holds the same files is left as it is.
    """
    import filecmp
    import shutil
    import tempfile

    if not tokenizer_dir:
        return
    source = Path(tokenizer_dir)
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    target = Path(run_dir) / TOKENIZER
    if target.is_dir() and all((target / f.name).is_file() and filecmp.cmp(f, target / f.name, shallow=False)
                               for f in files):
        return
    staged = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=run_dir))
    for file in files:
        shutil.copyfile(file, staged / file.name)
    staged.chmod(0o755)
    if target.exists():
        shutil.rmtree(target)
    staged.rename(target)


def commit(run_dir: str | Path, version: ConfigVersion, config_yaml: str) -> None:
    """Append `version` to the history (fsynced), then replace config.yaml with `config_yaml` atomically."""
    from common.files import write_text_atomic

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    version.written = version.written or time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(run_dir / HISTORY, "a", encoding="utf-8") as out:
        out.write(json.dumps(asdict(version), default=str) + "\n")
        out.flush()
        os.fsync(out.fileno())
    write_text_atomic(run_dir / CONFIG, config_yaml)
