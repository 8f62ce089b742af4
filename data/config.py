"""Structured configs of data preparation: what a domain's corpus is and how it becomes shards.

`DataConfig` is the `data` group (`conf/data/*.yaml`): the data root and its domains. The trainer
reads the result, `DATA_ROOT/<domain>/{train,val}/` and `DATA_ROOT/manifest.json`, through its own
`data.root` (pretrain/config.py; both default to `.cache/shards/<name>`). `DataPrepareConfig` is the
primary config of `ayumi data prepare` (`conf/data_prepare.yaml`): the `data` group plus the
tokenizer and run-time knobs. All are registered in Hydra's ConfigStore, so an unknown key or a
value of the wrong type is rejected with the key's name.

Configs hold values only; the cross-checks live in `check_prepare_config`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common import corpus as sources

NORMALIZATIONS = ("none", "NFC", "NFKC")
SCRIPTS = ("none", "ja", "latin", "cjk", "hangul", "cyrillic")
DEDUP_MODES = ("exact", "normalized", "off")  # CleanConfig.dedup
START_METHODS = ("auto", "fork", "forkserver", "spawn")  # how data prepare starts its workers
FORMATS = ("auto", *sources.FORMATS)  # the readers are common.corpus'
TEXT_UNITS = sources.TEXT_UNITS


class ConfigError(ValueError):
    """A data-preparation setting is invalid; the message names the key, the value and the fix."""


@dataclass
class CleanConfig:
    """Per-domain cleaning: each filter is pure and counts what it drops (see data/clean.py)."""

    normalize: str = "NFC"
    """Unicode normalization of the text: none, NFC (canonical, lossless) or NFKC (also folds width/compatibility forms)."""
    tidy_whitespace: bool = True
    """Unix newlines, drop control characters, strip trailing spaces per line, at most one blank line in a row, trim the ends."""
    collapse_spaces: bool = False
    """Also squeeze whitespace runs inside lines to one space and trim line starts (prose only: code needs its indentation)."""
    min_chars: int = 1
    """Drop documents shorter than this many characters after cleaning (reason: too_short)."""
    max_chars: int = 0
    """Drop documents longer than this many characters after cleaning; 0 = no limit (reason: too_long)."""
    dedup: str = "exact"
    """Duplicate removal within and across the domain's files, by content key (reason: duplicate); the key also
    decides the validation split. exact: drop byte-identical texts after this domain's cleaning (indentation
    and width kept); normalized: also copies differing only in whitespace or NFKC width (ＡＢＣ１２３ = ABC123;
    case kept); off: keep every document (split by the exact key). Domains that share documents need the same
    mode and cleaning: only then does a shared document get the same key, split and overlap check everywhere."""
    script: str = "none"
    """The domain's script for the quality filter: none, ja (kana+kanji), latin, cjk, hangul, cyrillic."""
    min_script_share: float = 0.0
    """Drop documents whose letters are less than this share in `script` (0..1; reason: low_script_share)."""
    max_symbol_share: float = 1.0
    """Drop documents where non-letter, non-digit, non-space characters exceed this share (0..1; reason: too_many_symbols)."""


@dataclass
class DomainConfig:
    """One domain: its input files, how to read them, cleaning, validation split and shard size."""

    inputs: list[str] = field(default_factory=list)
    """Input files as globs (`**` allowed): jsonl (.gz/.zst), .txt, .parquet, or `datasets.save_to_disk` folders."""
    format: str = "auto"
    """Input format: auto (from the file name), jsonl, text, parquet, hf."""
    text_field: str = "text"
    """JSON key / parquet or datasets column holding the document text."""
    text_unit: str = "line"
    """What one document is in a plain-text file: a line, a blank-line separated paragraph, or the whole file."""
    val_fraction: float = 0.0
    """Share of documents held out for validation, chosen by content hash (stable when files are added)."""
    val_count: int = 0
    """Instead of val_fraction: hold out the N documents with the smallest content hashes (not stable when files are
    added); > 0 makes val_fraction 0, whatever the preset sets. Suits a small corpus (a fraction holds out none)."""
    shard_max_mb: float = 256.0
    """Size cap of one shard's .bin in MiB; a document is never split, so one longer document makes a bigger shard."""
    clean: CleanConfig = field(default_factory=CleanConfig)
    """Cleaning and quality filters of this domain."""
    megatron: str = ""
    """Existing Megatron shards instead of `inputs` (bring your own data): prefixes as in Megatron's --data-path,
    `"PREFIX PREFIX ..."` or weighted `"0.7 PREFIX 0.3 PREFIX"`, or a folder (every *.idx in it). They are checked
    against `tokenizer_dir` (the tokenizer they were made with) and recorded, never copied or re-tokenized."""
    megatron_val: str = ""
    """Megatron prefixes (same forms as `megatron`) to use as this domain's validation set, for a Megatron domain
    or a text domain (then instead of val_fraction/val_count; made with the same tokenizer)."""
    append_eod: bool = False
    """Megatron data only: true when its documents do not end with the tokenizer's EOS (preprocessed without
    --append-eod); training then reads an EOS after every document. false: every document must end with EOS."""


@dataclass
class DataConfig:
    """The `data` group: where the shards live and which domains there are."""

    name: str = "default"
    """Name of this data set; the default root ends with it."""
    root: str = "${oc.env:AYUMI_DATA_ROOT,.cache}/shards/${.name}"
    """DATA_ROOT: output of `ayumi data prepare`, input of training (`<domain>/{train,val}/`, manifest.json)."""
    domains: dict[str, Any] = field(default_factory=dict)
    """Domains by name (ja_raw, en, code, …): the name becomes the shard folder and the per-domain loss label."""


@dataclass
class DataPrepareConfig:
    """Primary config of `ayumi data prepare`."""

    data: DataConfig = field(default_factory=DataConfig)
    """The data set to prepare (pick a preset with `data=NAME`)."""
    tokenizer_dir: str = MISSING
    """The tokenizer: an `ayumi tokenizer build` folder, a SentencePiece .model, or a Hugging Face tokenizer folder
    (tokenizer.json; e.g. the base model's, for continued pretraining). It tokenizes the text domains and is the
    declared tokenizer of Megatron domains; shards record its identity either way."""
    workers: int = 2
    """Tokenizer worker processes; 0 = tokenize in this process. Output bytes are identical for any value."""
    strict: bool = False
    """Raise at the first bad input record or file instead of skipping and counting it."""
    chunk_mb: float = 1.0
    """Text per work unit sent to a worker, in MiB (throughput knob; does not change the output)."""
    encode_threads: int = 1
    """Threads sentencepiece uses inside each worker's batch encode (keep 1 when workers fill the cores)."""
    start_method: str = "auto"
    """How workers start: auto (fork when this process has no other thread, else forkserver), fork, forkserver, spawn."""
    progress: bool = True
    """Show a progress bar (docs/s, MB/s) on stderr."""
    force: bool = False
    """Redo every domain even when its finished output matches the config, inputs and tokenizer."""


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent); the YAML files extend them."""
    from hydra.core.config_store import ConfigStore  # here, so worker processes never import Hydra

    store = ConfigStore.instance()
    store.store(name="data_prepare_schema", node=DataPrepareConfig)
    store.store(group="data", name="data_schema", node=DataConfig)
    store.store(group="data_domain", name="schema", node=DomainConfig)


def domain_config(name: str, node: Any, where: str = "data.domains") -> DomainConfig:
    """One entry of `data.domains` (a dict or DictConfig) as a DomainConfig, defaults filled in.

    `domains` is typed as a plain dict so that new domains can be added from the command line
    (`+data.domains.NAME.inputs=[...]`; OmegaConf cannot add keys under a dict of dataclasses);
    this is where each entry gets its schema check, with errors naming the full key (under `where`:
    a curriculum's own domains are `curriculum.domains`).
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DomainConfig), node if node is not None else {})
        domain = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", None) or ""
        key = f"{where}.{name}{'.' + full_key if full_key else ''}"
        message = str(err).splitlines()[0]
        fix = f"set it, e.g. {key}=['/data/{name}/*.jsonl']" if "Missing mandatory" in message \
            else "see the fields of DomainConfig / CleanConfig in data/config.py"
        raise ConfigError(f"{key}: {message}. Fix: {fix}.") from None
    if domain.val_count > 0:
        # val_count replaces the fraction a preset sets (data=ja_en: 0.001), so setting it alone is enough.
        domain.val_fraction = 0.0
    return domain


def prepare_config(cfg: Any, tokenizer_required: bool = True) -> DataPrepareConfig:
    """A composed `data_prepare` DictConfig as a DataPrepareConfig with typed domains, interpolations resolved.
    `tokenizer_required=False` (for `--cfg job`) checks every value but lets tokenizer_dir be unset yet."""
    missing = OmegaConf.is_missing(cfg, "tokenizer_dir")
    if missing and tokenizer_required:
        raise ConfigError("tokenizer_dir is not set. Fix: tokenizer_dir=DIR (the folder holding tokenizer.model).")
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    if missing:
        plain["tokenizer_dir"] = ""  # only for the checks: unset, as the caller allowed
    domains = {str(name): domain_config(str(name), node) for name, node in plain["data"]["domains"].items()}
    plain["data"]["domains"] = {}
    result = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataPrepareConfig), plain))
    result.data.domains = domains
    return result


def check_domain_config(name: str, domain: DomainConfig, where: str = "data.domains") -> None:
    """Raise ConfigError for values Hydra's type check cannot catch (ranges, choices, exclusive options)."""
    key = f"{where}.{name}"
    if domain.megatron and domain.inputs:
        raise ConfigError(f"{key}: set inputs (corpus files to tokenize) or megatron (existing Megatron shards), not both.")
    if domain.megatron_val and (domain.val_fraction > 0 or domain.val_count > 0):
        raise ConfigError(f"{key}: megatron_val is this domain's validation set, so val_fraction/val_count must be 0 "
                          f"(got {domain.val_fraction}/{domain.val_count}). Fix: drop one of them.")
    if domain.append_eod and not (domain.megatron or domain.megatron_val):
        raise ConfigError(f"{key}.append_eod applies to Megatron data only (corpus documents always end with EOS).")
    if domain.megatron:
        return  # the prefixes are checked when they are read (data/megatron.py)
    if not domain.inputs:
        raise ConfigError(f"{key}.inputs is empty. Fix: {key}.inputs=['/path/to/*.jsonl'], or {key}.megatron=PREFIXES "
                          "for data already in Megatron's .bin/.idx format")
    _choice(f"{key}.format", domain.format, FORMATS)
    _choice(f"{key}.text_unit", domain.text_unit, TEXT_UNITS)
    if not 0.0 <= domain.val_fraction < 1.0:
        raise ConfigError(f"{key}.val_fraction={domain.val_fraction} must be in [0, 1).")
    if domain.val_count < 0:
        raise ConfigError(f"{key}.val_count={domain.val_count} must be >= 0.")
    if domain.val_fraction > 0 and domain.val_count > 0:
        raise ConfigError(
            f"{key}: set val_fraction ({domain.val_fraction}) or val_count ({domain.val_count}), not both. "
            "Fix: set the other one to 0."
        )
    if domain.shard_max_mb <= 0:
        raise ConfigError(f"{key}.shard_max_mb={domain.shard_max_mb} must be > 0.")
    clean = domain.clean
    _choice(f"{key}.clean.normalize", clean.normalize, NORMALIZATIONS)
    _choice(f"{key}.clean.script", clean.script, SCRIPTS)
    if clean.dedup in ("True", "False", "true", "false"):  # YAML/CLI true/false arrive as strings
        raise ConfigError(
            f"{key}.clean.dedup={clean.dedup} is a switch, but dedup is now a mode. Fix: exact (byte-identical "
            "after cleaning), normalized (what true used to mean: also whitespace/width-only differences) or off.")
    _choice(f"{key}.clean.dedup", clean.dedup, DEDUP_MODES)
    if clean.min_chars < 0 or clean.max_chars < 0:
        raise ConfigError(f"{key}.clean: min_chars/max_chars must be >= 0 (got {clean.min_chars}/{clean.max_chars}).")
    if clean.max_chars and clean.max_chars < clean.min_chars:
        raise ConfigError(f"{key}.clean.max_chars={clean.max_chars} is below min_chars={clean.min_chars}.")
    for share_key in ("min_script_share", "max_symbol_share"):
        value = getattr(clean, share_key)
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key}.clean.{share_key}={value} must be in [0, 1].")
    if clean.min_script_share > 0 and clean.script == "none":
        raise ConfigError(f"{key}.clean.min_script_share={clean.min_script_share} needs {key}.clean.script (one of {', '.join(SCRIPTS[1:])}).")


def check_prepare_config(cfg: DataPrepareConfig) -> None:
    """Cross-check a whole prepare config; raises ConfigError naming the key."""
    if not cfg.data.domains:
        raise ConfigError("data.domains is empty. Fix: pick a preset (data=NAME) or add +data.domains.NAME.inputs=[...]")
    if cfg.workers < 0:
        raise ConfigError(f"workers={cfg.workers} must be >= 0 (0 = no worker processes).")
    if cfg.chunk_mb <= 0:
        raise ConfigError(f"chunk_mb={cfg.chunk_mb} must be > 0.")
    if cfg.encode_threads < 1:
        raise ConfigError(f"encode_threads={cfg.encode_threads} must be >= 1.")
    _choice("start_method", cfg.start_method, START_METHODS)
    for name, domain in cfg.data.domains.items():
        check_domain_name(name)
        check_domain_config(name, domain)


def check_domain_name(name: str, where: str = "data.domains") -> None:
    """A domain's name becomes its folder under DATA_ROOT."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"{where}: {name!r} cannot be a folder name. Fix: use letters, digits, _ or -.")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}.")
