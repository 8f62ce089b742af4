"""What a resume means, decided from the run's record before any rank starts.

A run resumes when checkpoint.resume is on, checkpoint.load_from is not set and the run's checkpoint folder holds a
complete checkpoint. Its `ayumi.json` (plain JSON) records the config that trained it, the run's lengths (the LR
schedule's history) and how many curriculum stages had begun; `RUN_DIR/config_history.jsonl` the command line's
overrides (pretrain/startup/record.py). From those, `settle`:

1. **replays what the command line left out.** An override the run was started with and this command line does not
   name again (`curriculum=mine`, `data.root=/corpus`) is taken from the run, and said in one line: a resume never
   falls back to a default without a word;
2. **sorts every difference** (a session's own settings aside: record.SESSION_KEYS) between the run's config and this one (`KINDS`):
   - `past`: it would make the trained steps not what the config says (a begun stage, the model's shape, the data,
     the tokenizer, the seed, the LR of a trained step): refused, one line each with both values and the fix;
   - `ack`: it changes the LR or the data stream from the resume step on (train.tokens, a stage not yet begun, the
     schedule's future): refused unless `resume.accept` names it;
   - `future`: it changes training from now on (eval tasks, checkpoint cadence, stability thresholds): accepted;
   - `harmless`: layout, logging, cadence of evaluation: accepted;
   the accepted ones are printed and recorded (a `config_change` event, the config history);
3. **says when there is nothing to do** (the run is already as long as this config asks): exit 0 before launch.

`ayumi train` (before its launcher), `ayumi plan`, `--cfg job` and every rank call it, so all of them decide the
same. Imports no torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from common.conf import absolute_file_overrides, override_key

from pretrain.checkpoint.layout import META, latest_tag
from pretrain.config import AyumiConfig, ConfigError, checked_config, composed_from_args, split_cli_args, total_steps
from pretrain.plan.lr_schedule import (
    LengthHistory, history_as_record, history_from_record, scheduled_lr, with_length,
)
from pretrain.startup.record import last_version, resolved_config, session_only

KINDS = ("past", "ack", "future", "harmless")
"""How a difference between the run's config and a resume's is treated (the module doc says what each means)."""

# Longest prefix wins. A key not listed is `future`: a new field is on record, never silently refused or ignored.
RULES: dict[str, str] = {
    "name": "harmless", "run_root": "harmless", "run_dir": "harmless", "resume": "harmless",
    "model": "past", "model.name": "harmless", "model.compile": "harmless", "model.loss_chunk_tokens": "harmless",
    "model.z_loss": "future", "model.embedding_grad_alpha": "future", "model.attention": "future",
    "model.restart_positions": "future", "model.fp8": "future", "model.fp8_emulate": "future",
    "optim": "future", "optim.lr": "lr", "optim.min_lr": "lr", "optim.schedule": "lr", "optim.warmup_steps": "lr",
    "optim.wsd_decay_fraction": "lr",
    "deepspeed": "harmless", "deepspeed.zero_stage": "past", "deepspeed.precision": "future", "deepspeed.initial_scale_power": "future",
    "deepspeed.loss_scale_window": "future", "deepspeed.hysteresis": "future", "deepspeed.min_loss_scale": "future",
    "deepspeed.bf16_skip_nonfinite": "future", "deepspeed.grad_accum_dtype": "future",
    "parallel": "harmless",
    "data": "past", "data.validation": "future", "data.verify": "harmless", "data.prefetch_batches": "harmless",
    "data.exclude": "future",
    "train": "harmless", "train.tokens": "ack", "train.seq_len": "past", "train.global_batch_size": "past",
    "train.seed": "past", "train.max_steps": "future",
    "checkpoint": "future", "checkpoint.resume": "harmless", "checkpoint.load_from": "harmless",
    "checkpoint.inject_write_delay_s": "harmless", "checkpoint.dir": "harmless",
    "logging": "harmless", "hang": "harmless", "stability": "future",
    "curriculum": "future", "curriculum.name": "harmless", "curriculum.domains": "past",
    "eval": "future", "eval.downstream.interval": "harmless",
}
"""Config key (or prefix) -> its kind on resume; `lr`: judged by the LR it gives each step (`resolve_lr_kind`)."""

WHY_PAST = {"deepspeed.zero_stage": "the checkpoint's optimizer state is laid out for its ZeRO stage (another number "
                                    "of ranks, or parallel.tensor, may change; the stage may not)"}
"""Why a refused key is refused, where the general reason would mislead."""

PATH_KEYS = ("run_dir", "checkpoint.dir", "data.root")
"""Recorded as absolute paths (the ranks resolve them): compared the same way."""


@dataclass
class Change:
    """One difference between the run's config and this resume's."""

    key: str
    was: Any
    now: Any
    kind: str
    """One of KINDS."""
    why: str = ""
    """For a refusal: what it would change, in words."""

    def shown(self) -> str:
        return f"{self.key}: {short(self.was)} -> {short(self.now)}"


@dataclass
class ResumeDecision:
    """What a resume of the run at `step` will do, decided before launch."""

    run_dir: str
    checkpoint: str
    """The checkpoint folder it resumes from."""
    step: int
    changes: list[Change] = field(default_factory=list)
    """The accepted differences (refused ones raise ConfigError)."""
    taken: list[str] = field(default_factory=list)
    """The run's own overrides this command line left out, replayed."""
    lengths: list = field(default_factory=list)
    """The run's length history after this resume (pretrain/plan/lr_schedule.py, as recorded)."""
    complete: str | None = None
    """Why there is nothing to do (the run is as long as this config asks), else None."""

    def lines(self) -> list[str]:
        """What is said before launch: the replayed overrides, each accepted change, or why nothing runs."""
        head = f"resume of {self.run_dir} at step {self.step:,}"
        said = []
        if self.taken:
            said.append(f"{head}: the run's own {' '.join(self.taken)} (left out of this command line)")
        for kind in ("ack", "future", "harmless"):
            changes = [change.shown() for change in self.changes if change.kind == kind]
            if changes:
                said.append(f"{head}: {KIND_WORDS[kind]}: " + "; ".join(changes))
        if self.complete:
            said.append(self.complete)
        return said

    def recorded(self) -> list[dict[str, Any]]:
        """The accepted changes as the config history and the config_change event record them."""
        return [{"key": c.key, "was": c.was, "now": c.now, "kind": c.kind} for c in self.changes]


KIND_WORDS = {"ack": "accepted (resume.accept), changes the run from this step on",
              "future": "accepted, applies from this step on", "harmless": "accepted, harmless"}


@dataclass
class Settled:
    """A command line's training config once the resume is decided."""

    cfg: AyumiConfig
    """The checked config."""
    overrides: list[str]
    """The overrides that compose it: the replayed ones first, then this command line's (what the ranks get)."""
    resume: ResumeDecision | None = None
    """None for a fresh start (or checkpoint.load_from)."""
    printed: bool = False
    """`--cfg job` printed the config: the command checks it and stops there."""


def settle(args: list[str]) -> Settled:
    """The training config of `args` (Hydra overrides, --cfg job) with its resume decided; raises ConfigError with
    one line per refused difference. `--cfg job` prints the config the run would train with (replays included)."""
    overrides, print_cfg = split_cli_args(args)
    overrides = absolute_file_overrides(overrides)  # `curriculum=./mine.yaml`: the same file for ranks and replays
    composed, cfg = compose_checked(overrides, print_cfg)
    point = resume_point(cfg)
    if point is None:
        return printed(Settled(cfg, overrides), composed, print_cfg)
    tag_dir, meta = point
    version = last_version(cfg.run_dir)
    taken = left_out(version.overrides if version else [], overrides)
    if taken:
        overrides = taken + overrides
        composed, cfg = compose_checked(overrides, print_cfg)
    recorded = meta.get("config") or (version.config if version else None)
    decision = decide(cfg, tag_dir, meta, recorded, taken)
    return printed(Settled(cfg, overrides, decision), composed, print_cfg)


def compose_checked(overrides: list[str], print_cfg: bool) -> tuple[DictConfig, AyumiConfig]:
    composed, _ = composed_from_args(overrides)
    try:
        return composed, checked_config(composed)
    except ConfigError:
        if print_cfg:  # what was asked, then why it is refused
            print(OmegaConf.to_yaml(composed, resolve=True), end="", flush=True)
        raise


def printed(settled: Settled, composed: DictConfig, print_cfg: bool) -> Settled:
    """`--cfg job`: the resolved config printed (the run's replayed overrides included)."""
    if print_cfg:
        print(OmegaConf.to_yaml(composed, resolve=True), end="", flush=True)
        settled.printed = True
    return settled


def resume_point(cfg: AyumiConfig) -> tuple[Path, dict] | None:
    """(the checkpoint folder a resume would start from, its ayumi.json) or None for a fresh start. A record that
    cannot be read is left to the ranks, which verify every checkpoint before loading it (and say why)."""
    ckpt = cfg.checkpoint
    if ckpt.load_from or not ckpt.resume:
        return None
    root = Path(ckpt.dir)
    tag = latest_tag(root)
    if tag is None:
        return None
    try:
        meta = json.loads((root / tag / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (root / tag, meta) if isinstance(meta, dict) else None


def left_out(recorded: list[str], given: list[str]) -> list[str]:
    """The run's own overrides whose key this command line does not name (in the run's order)."""
    named = {override_key(override) for override in given}
    return [override for override in recorded
            if override_key(override) not in named and not session_only(override_key(override))]


# -- the differences ---------------------------------------------------------------------------------------------
def decide(cfg: AyumiConfig, tag_dir: Path, meta: dict, recorded: dict | None, taken: list[str]) -> ResumeDecision:
    """Sort the differences, refuse the past and the unacknowledged, and settle the run's lengths."""
    step = int(meta.get("step", 0))
    decision = ResumeDecision(str(cfg.run_dir), str(tag_dir), step, taken=taken)
    new = resolved_config(cfg)
    old = recorded if isinstance(recorded, dict) else new  # a checkpoint from before the record: nothing to compare
    old_cfg = config_of(old) or cfg
    history = history_from_record(meta.get("lengths"), total_steps(old_cfg.train))
    begun = started_stages(meta, old_cfg, step)
    changes = differences(old, new, begun) + data_changes(meta.get("data"), old_cfg, begun, cfg.data.root)
    changes = [resolve_lr_kind(change, old_cfg, cfg, history, step) for change in changes]
    refusals = [refusal(change, cfg, step) for change in changes if change.kind == "past"]
    if refusals:
        raise ConfigError("\n".join(refusals))
    decision.complete = complete(cfg, step)
    if decision.complete:
        return decision
    accepted = cfg.resume.accept
    unacknowledged = [change for change in changes if change.kind == "ack" and not acknowledged(change.key, accepted)]
    if unacknowledged:
        raise ConfigError("\n".join(unacknowledged_line(change, cfg, step) for change in unacknowledged))
    decision.changes = changes
    decision.lengths = history_as_record(with_length(history, cfg.optim, step, total_steps(cfg.train)))
    return decision


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value}; a dict of free-form keys (weights, rope_scaling) and lists are values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name not in FREE_FORM and not name.endswith(FREE_FORM_TAILS):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


FREE_FORM = ("curriculum.domains", "data.domains", "model.rope_scaling")
FREE_FORM_TAILS = (".weights", ".max_repetition", ".min_document_tokens", ".rope_scaling")


def kind_of(key: str) -> str:
    """RULES' kind for `key`: its longest listed prefix; `future` when none is listed."""
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        kind = RULES.get(".".join(parts[:end]))
        if kind:
            return kind
    return "future"


def differences(old: dict, new: dict, started: int) -> list[Change]:
    """Every difference of `new` from `old`, with its kind; curriculum stages one by one (a begun stage is past)."""
    old_flat, new_flat = flatten(old), flatten(new)
    changes = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if key == "curriculum.stages" or session_only(key):
            continue
        was, now = comparable(key, old_flat.get(key)), comparable(key, new_flat.get(key))
        if was != now:
            changes.append(Change(key, old_flat.get(key), new_flat.get(key), kind_of(key), WHY_PAST.get(key, "")))
    return changes + stage_changes(old_flat.get("curriculum.stages") or [], new_flat.get("curriculum.stages") or [],
                                   started)


def comparable(key: str, value: Any) -> Any:
    """Paths compared resolved (the ranks record them absolute); everything else as it is."""
    if key in PATH_KEYS and isinstance(value, str) and value:
        return str(Path(value).resolve())
    return value


def stage_changes(old: list, new: list, started: int) -> list[Change]:
    """One change per stage that differs: past for a stage the run had begun, else `ack` (the data stream ahead)."""
    changes = []
    for index in range(max(len(old), len(new))):
        was = old[index] if index < len(old) else None
        now = new[index] if index < len(new) else None
        if was == now:
            continue
        name = (was or now or {}).get("name", "")
        kind = "past" if index < started else "ack"
        changes.append(Change(f"curriculum.stages.{index} ({name!r})", stage_summary(was, now), stage_summary(now, was),
                              kind, "a stage the run has begun" if kind == "past" else ""))
    return changes


def stage_summary(stage: dict | None, other: dict | None) -> Any:
    """The fields of `stage` that differ from `other` (the whole stage's absence as None)."""
    if stage is None:
        return None
    if other is None:
        return {"name": stage.get("name"), "tokens": stage.get("tokens")}
    return {key: value for key, value in stage.items() if other.get(key) != value}


def started_stages(meta: dict, old: AyumiConfig, step: int) -> int:
    """How many curriculum stages the run had begun at the checkpoint: its record, else from the stages' budgets
    (a checkpoint saved before the record existed; skipped batches aside)."""
    if "started_stages" in meta:
        return int(meta["started_stages"])
    trained = step * old.train.global_batch_size * old.train.seq_len
    begun, start = 0, 0
    for stage in old.curriculum.stages:
        if start >= trained:
            break
        begun, start = begun + 1, start + stage.tokens
    return begun


def data_identity(root: str) -> dict[str, str]:
    """{domain: what its training split holds} of a data root: each train shard's name, size and checksum (from the
    manifest: nothing is read but it), of the shards the split was first written in (a merge keeps them in the
    record: data/lineage.py); {} when the root has no readable manifest. Recorded in each checkpoint (ayumi.json:
    data), so a resume notices data changed under the run at the same path, and not a merge."""
    import hashlib

    from data.lineage import original_fields
    from data.manifest import load_manifest

    try:
        domains = load_manifest(root)["domains"]
        held = {name: original_fields(record, "train", ("name", "docs", "tokens", "sha256"))
                if "train" in (record.get("splits") or {}) else [] for name, record in domains.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # an unreadable manifest, or a damaged record: the data checks at the start say why
    return {name: hashlib.sha256(json.dumps([record.get("fingerprint"), held[name]]).encode()).hexdigest()[:16]
            for name, record in domains.items()}


def data_changes(recorded: dict | None, old: AyumiConfig, begun: int, root: str) -> list[Change]:
    """A domain the run has trained on whose training data changed (or is gone) since: past. Domains only a stage
    not yet begun reads may change; without a record (an older checkpoint) the ranks' own check stands."""
    if not recorded:
        return []
    current = data_identity(root)
    if not current:
        return []  # no readable manifest: the data checks say why
    stages = old.curriculum.stages
    used = {name for stage in stages[:begun] for name, weight in stage.weights.items() if weight} if stages \
        else set(old.data.domains or recorded)
    return [Change(f"data.root's domain {name!r}", "the shards trained on",
                   "missing" if name not in current else "other shards", "past",
                   f"its training data in {root} changed since the run trained on it (the manifest's shard records "
                   "differ)") for name in sorted(used) if name in recorded and current.get(name) != recorded[name]]


def config_of(recorded: dict) -> AyumiConfig | None:
    """A recorded config as dataclasses (None when it does not fit today's schema). ConfigError when a value holds
    `${...}`: a run records its config resolved, and merging would resolve what someone else planted there."""
    from omegaconf.errors import OmegaConfBaseException

    from common.conf import PlantedInterpolation, plain_config

    try:
        plain_config(recorded, "the config recorded with the checkpoint (its ayumi.json, else RUN_DIR/config.yaml)")
    except PlantedInterpolation as err:
        raise ConfigError(str(err)) from None
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AyumiConfig), recorded))
    except (OmegaConfBaseException, ValueError, TypeError):
        return None


# -- the LR ------------------------------------------------------------------------------------------------------
def resolve_lr_kind(change: Change, old: AyumiConfig, new: AyumiConfig, history: LengthHistory, step: int) -> Change:
    """An optim change that alters the LR of a trained step is past; one that leaves the past as it was, but
    jumps the LR at the resume step by more than one step's normal change, is past too (no silent jump); else ack."""
    if change.kind != "lr":
        return change
    trained = lr_difference(old, new, history, step)
    if trained:
        return Change(change.key, change.was, change.now, "past", trained)
    extended = with_length(history, new.optim, step, total_steps(new.train))
    before, usual = scheduled_lr(step, old.optim, history), lr_step_change(old, history, step)
    after = scheduled_lr(step, new.optim, extended)
    if abs(after - before) > usual + 1e-12 * max(abs(before), 1e-30):
        return Change(change.key, change.was, change.now, "past",
                      f"the LR would jump at step {step + 1:,} from {before:.3g} to {after:.3g}")
    return Change(change.key, change.was, change.now, "ack")


def lr_difference(old: AyumiConfig, new: AyumiConfig, history: LengthHistory, step: int) -> str:
    """How the new optim settings would change the LR of a step already trained ("" when none changes). Checks the
    warmup, both ends and 512 steps between (the schedules are smooth between)."""
    if step <= 0:
        return ""
    probes = set(range(min(step, old.optim.warmup_steps + 2, new.optim.warmup_steps + 2)))
    probes |= {round(i * (step - 1) / 511) for i in range(512)}
    for probe in sorted(probes):
        was, now = scheduled_lr(probe, old.optim, history), scheduled_lr(probe, new.optim, history)
        if not math.isclose(was, now, rel_tol=1e-9, abs_tol=0.0):
            return f"the LR of trained step {probe + 1:,} would change from {was:.3g} to {now:.3g}"
    return ""


def lr_step_change(cfg: AyumiConfig, history: LengthHistory, step: int) -> float:
    """The LR's change over one step around `step` under the run's schedule: the size a resume may move it."""
    if step <= 0:
        return 0.0
    return abs(scheduled_lr(step, cfg.optim, history) - scheduled_lr(step - 1, cfg.optim, history))


# -- refusals and the end ----------------------------------------------------------------------------------------
def refusal(change: Change, cfg: AyumiConfig, step: int) -> str:
    why = change.why or "the trained steps would no longer be what the config says"
    return (f"resume of {cfg.run_dir} at step {step:,}: {change.key} was {short(change.was)}, now {short(change.now)}: "
            f"{why}. Fix: restore {change.key} as the run has it, or start a new run from this checkpoint "
            f"(another name= with checkpoint.load_from={cfg.checkpoint.dir})")


def acknowledged(key: str, accepted: list[str]) -> bool:
    """Whether resume.accept names `key` or a prefix of it (`curriculum.stages` covers each stage)."""
    base = key.split(" ", 1)[0]
    return any(base == name or base.startswith(name + ".") for name in accepted)


def unacknowledged_line(change: Change, cfg: AyumiConfig, step: int) -> str:
    base = change.key.split(" ", 1)[0]
    accept = "curriculum.stages" if base.startswith("curriculum.stages.") else base
    return (f"resume of {cfg.run_dir} at step {step:,}: {change.shown()} changes the LR or the data stream from step {step + 1:,} on. "
            f"Fix: add resume.accept=[{accept}] to accept it, or restore the run's value")


def complete(cfg: AyumiConfig, step: int) -> str | None:
    """Why a resume at `step` has nothing to do, or None."""
    total = total_steps(cfg.train)
    if step >= total:
        return f"run {cfg.name} is already complete ({step:,} of {total:,} steps); nothing to do"
    if cfg.train.max_steps and step >= cfg.train.max_steps:
        return f"run {cfg.name} has reached train.max_steps={cfg.train.max_steps:,} (step {step:,}); nothing to do"
    return None


def short(value: Any, limit: int = 80) -> str:
    """A value in one short line."""
    text = json.dumps(value, default=str, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 1] + "…"

