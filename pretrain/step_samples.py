"""Which samples a step trained on: every sample of step N as trained, named down to its documents.

The stream is a pure function of the global sample index (pretrain/stream.py, curriculum/mixer.py), so a step's
samples follow from three things the run records:

- where the step's global batch began in the stream: each session's first position and batch layout (the
  `session` event the trainer logs before its first step, and the `recovered` event after a rollback), then
  one global batch per step, jumping over the skip ledger's ranges (`skipped_samples.json`) exactly as the
  trainer does (`curriculum.mixer.batches_due`, checked before each step);
- the config that trained the step (`config_history.jsonl`, pretrain/startup/record.py): the curriculum, the
  seed, the sequence length and the data root, from which the stream is rebuilt with the same functions
  training uses (pretrain/stream.py);
- how the batch was cut over ranks: each data-parallel rank a contiguous slice, micro batch by micro batch
  (pretrain/stream.py's layout, which the loader itself calls).

Step numbers are 1-based, as the progress line and events.jsonl count them. A step trained twice (before and
after a rollback, or a resume from an older checkpoint) is the one on the run's present timeline. Imports no
torch: the trainer names a spike's documents with it, and `ayumi batch` (pretrain/tools/batch.py) prints it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from curriculum.mixer import Mixer, SkipLedger, batches_due
from data.provenance import Piece, sample_pieces
from pretrain.metrics import EVENTS_FILE, METRICS_FILE, read_jsonl
from pretrain.skips import LEDGER_FILE
from pretrain.stream import micro_batch_firsts, micro_batch_samples, open_training_data, sample_source


class StepSamplesError(ValueError):
    """A step's samples cannot be named; the message says which file or argument and what to do."""


@dataclass(frozen=True)
class Layout:
    """How a stretch of the run cut its global batches (a session, or what follows a rollback)."""

    from_step: int
    """0-based index of the first step this layout trained."""
    first_sample: int
    """The stream position (global sample index) before that step."""
    dp_size: int
    """Data-parallel ranks."""
    micro_batch: int
    """Samples of train.seq_len slots per micro batch."""
    grad_accum: int
    """Micro batches per rank per step."""
    global_batch: int
    """Global sample slots per step."""


@dataclass
class TrainedSample:
    """One sample of a step, where it came from and what it held."""

    rank: int
    """Data-parallel rank that trained it (every rank of a tensor- or sequence-parallel group read it)."""
    micro: int
    """Its micro batch on that rank (0-based)."""
    row: int
    """Its row in that micro batch (0-based)."""
    index: int
    """Its global sample index (the slot it begins at)."""
    domain: str
    stream: str
    """The stream it was read from: the domain, or a stage's own length or document filter of it."""
    stage: int | None
    """The curriculum stage (1-based) holding it; None without a curriculum."""
    epoch: int
    """How many times its stream had been read through before it."""
    sample: int
    """Its sample id within the stream."""
    pieces: list[Piece]
    """The documents it holds (data/provenance.py)."""
    tokens: np.ndarray
    """Its seq_len + 1 token ids: the model's inputs are all but the last, its labels all but the first."""

    def as_dict(self, with_tokens: bool = True) -> dict[str, Any]:
        out = {"rank": self.rank, "micro": self.micro, "row": self.row, "index": self.index, "domain": self.domain,
               "stream": self.stream, "stage": self.stage, "epoch": self.epoch, "sample": self.sample,
               "documents": [piece.as_dict() for piece in self.pieces]}
        if with_tokens:
            out["tokens"] = self.tokens.tolist()
        return out


@dataclass
class StepBatch:
    """Every sample of one step, in rank, micro batch and row order."""

    step: int
    """1-based."""
    first_sample: int
    """The stream position the step's global batch began at."""
    layout: Layout
    samples: list[TrainedSample] = field(default_factory=list)
    stage_weights: dict[str, float] = field(default_factory=dict)
    """The weights of the curriculum stage the step began in (empty without a curriculum)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Each sample's loss by global index, where the run recorded it (a spike's batch)."""
    spike: int | None = None
    """The spike (1-based) this batch was called on; None for a step's batch as it stands."""


# -- the record: where each step began -----------------------------------------------------------------------
def layouts(events: list[dict[str, Any]]) -> list[Layout]:
    """The layouts of the run's present timeline, by first step: a session, or a rollback within one, replaces
    every layout recorded from its first step on (that stretch was trained again)."""
    from pretrain.startup.record import timeline

    found: list[Layout] = []
    for event in events:
        kind = event.get("event")
        if kind == "session":
            found.append(Layout(int(event["step"]), int(event["first_sample"]), int(event["dp_size"]),
                                int(event["micro_batch"]), int(event["grad_accum"]), int(event["global_batch"])))
        elif kind == "recovered" and found and "first_sample" in event:
            found.append(replace(found[-1], from_step=int(event["step"]), first_sample=int(event["first_sample"])))
    return timeline(found)


def position_after(first_sample: int, steps: int, skips: list[tuple[int, int]], global_batch: int) -> int:
    """The stream position before the step `steps` steps after one that began at `first_sample`: each step takes
    one global batch, and before each the trainer jumps a recorded skip range it has reached (batches_due).
    Step by step, as the trainer goes: a closed form jumped a second range that began inside the batch the first
    jump landed in, which the trainer takes before it looks again (ranges less than a batch apart)."""
    position = first_sample
    for _ in range(steps):
        position += batches_due(skips, position, global_batch) * global_batch + global_batch
    return position + batches_due(skips, position, global_batch) * global_batch


def last_trained_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last training record (the run's progress); 0 when it has none."""
    trained = [int(record["step"]) for record in read_jsonl(Path(run_dir) / METRICS_FILE) if "train/loss" in record]
    return trained[-1] if trained else 0


def layout_of_step(events: list[dict[str, Any]], step: int, events_path: Path) -> Layout:
    """The layout that trained 1-based `step` on the timeline `events` record."""
    found = [layout for layout in layouts(events) if layout.from_step <= step - 1]
    if not found:
        raise StepSamplesError(f"{events_path} records no session that trained step {step:,} (a run trained before "
                               "ayumi logged `session` events): its batches cannot be placed")
    return found[-1]


def step_start(run_dir: Path, step: int) -> tuple[Layout, int]:
    """(the layout that trained 1-based `step`, the stream position its global batch began at)."""
    layout = layout_of_step(read_jsonl(Path(run_dir) / EVENTS_FILE), step, Path(run_dir) / EVENTS_FILE)
    skips = SkipLedger(Path(run_dir) / LEDGER_FILE).load()
    return layout, position_after(layout.first_sample, step - 1 - layout.from_step, skips, layout.global_batch)


def spike_events(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(position in events, event) of every spike the run's detector called, in order."""
    return [(at, event) for at, event in enumerate(events) if event.get("event") == "spike"]


def nth_spike(events: list[dict[str, Any]], spike: int, events_path: Path) -> tuple[int, dict[str, Any]]:
    """(position in events, event) of spike `spike` (1-based, as the run called them), its batch on record."""
    spikes = spike_events(events)
    if not spikes:
        raise StepSamplesError(f"{events_path} records no spike")
    if not 1 <= spike <= len(spikes):
        steps = ", ".join(f"{k} (step {e['step']:,})" for k, (_, e) in enumerate(spikes, 1))
        raise StepSamplesError(f"--spike {spike}: the run records {len(spikes)} spike(s): {steps}")
    at, event = spikes[spike - 1]
    if "batch_first_sample" not in event:
        raise StepSamplesError(f"{events_path}: spike {spike} (step {event['step']:,}) records no batch (a run "
                               "trained before ayumi recorded a spike's batch)")
    return at, event


# -- the stream: what those positions held -------------------------------------------------------------------
def step_config(run_dir: Path, step: int):
    """The config (AyumiConfig) that trained `step`, from the run's record."""
    from pretrain.config import ConfigError
    from pretrain.startup.record import HISTORY, config_for_step, last_version, run_settings
    from pretrain.startup.resume import config_of

    try:
        version = config_for_step(run_dir, step) or last_version(run_dir)
    except ConfigError as err:
        raise StepSamplesError(str(err)) from None
    if version is None:
        raise StepSamplesError(f"{run_dir} holds no {HISTORY} nor config.yaml: is it a run folder (RUN_DIR)?")
    cfg = config_of(run_settings(version.config))  # a session's own settings (a fire drill's) shape no data
    if cfg is None:
        raise StepSamplesError(f"{Path(run_dir) / HISTORY}: the config that trained step {step:,} does not fit this "
                               "version of ayumi's schema; read it with the version that trained the run")
    return cfg


def open_source(cfg, run_dir: Path | None = None):
    """The run's training stream rebuilt from its config (sizes checked, no checksums: nothing is trained), with the
    documents the run in `run_dir` excluded (data.exclude, pretrain/excluded.py) left out as it left them out."""
    from pretrain.excluded import apply_ledger

    try:
        train, _ = open_training_data(cfg, verify="sizes", validation=False)
        source = sample_source(cfg, train)
        if run_dir is not None:
            apply_ledger(source, run_dir)
        return source
    except (ValueError, OSError) as err:
        raise StepSamplesError(f"the run's data (data.root={cfg.data.root}) cannot be read as it was trained: "
                               f"{err}") from None


def trained_sample(source, index: int, rank: int, micro: int, row: int) -> TrainedSample:
    """Sample `index` of `source` as the loader reads it (`get`), with where it came from (`origin`)."""
    stream, epoch, sample, samples = source.origin(index)
    tokens, domain = source.get(index)
    stage = source.stage_at_sample(index) + 1 if isinstance(source, Mixer) else None
    return TrainedSample(rank, micro, row, index, source.domain_names[domain], stream, stage, epoch, sample,
                         sample_pieces(samples, sample), np.asarray(tokens, dtype=np.int64))


def batch_samples(source, position: int, layout: Layout) -> list[TrainedSample]:
    """Every sample of the global batch that begins at `position`, cut over ranks and micro batches as the loader
    cuts it."""
    out = []
    for rank in range(layout.dp_size):
        for micro, first in enumerate(micro_batch_firsts(position, rank, layout.micro_batch, layout.grad_accum)):
            for row, index in enumerate(micro_batch_samples(source, first, layout.micro_batch)):
                out.append(trained_sample(source, index, rank, micro, row))
    return out


def stage_weights(source, position: int) -> dict[str, float]:
    """The weights of the curriculum stage holding `position` (empty without a curriculum)."""
    if not isinstance(source, Mixer):
        return {}
    stage = source.cfg.stages[source.stage_at_sample(position)]
    return {name: float(weight) for name, weight in stage.weights.items() if weight > 0}


def step_batch(run_dir: str | Path, step: int) -> StepBatch:
    """Every sample 1-based `step` of the run in `run_dir` trained on (see the module doc)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StepSamplesError(f"run folder {run_dir} does not exist: give the RUN_DIR a training run wrote")
    if step < 1:
        raise StepSamplesError(f"--step {step}: steps count from 1, as the progress line and events.jsonl do")
    last = last_trained_step(run_dir)
    if step > last:
        raise StepSamplesError(f"--step {step:,}: {run_dir / METRICS_FILE} records training up to step {last:,} "
                               "only; give a step it has trained")
    layout, position = step_start(run_dir, step)
    source = open_source(step_config(run_dir, step), run_dir)
    return StepBatch(step, position, layout, batch_samples(source, position, layout), stage_weights(source, position))


def spike_step_batch(run_dir: str | Path, spike: int) -> StepBatch:
    """The batch spike `spike` (1-based) was called on, as trained then, with each sample's loss from its event:
    `step_batch` of the spike's step gives the batch that stands now, which a rollback's skip replaced."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StepSamplesError(f"run folder {run_dir} does not exist: give the RUN_DIR a training run wrote")
    events_path = run_dir / EVENTS_FILE
    events = read_jsonl(events_path)
    at, event = nth_spike(events, spike, events_path)
    step, position = int(event["step"]), int(event["batch_first_sample"])
    layout = layout_of_step(events[:at], step, events_path)  # the timeline as it stood when the spike was called
    source = open_source(step_config(run_dir, step), run_dir)
    samples = batch_samples(source, position, layout)
    recorded = {int(index): (domain, float(loss)) for index, domain, loss in event.get("batch_samples", [])}
    differ = [s.index for s in samples if s.index in recorded and recorded[s.index][0] != s.domain]
    if differ:  # the rebuilt stream is not the one trained then (an exclusion added later applies from before)
        raise StepSamplesError(f"{events_path}: spike {spike}'s batch as recorded does not match the run's data as "
                               f"rebuilt now (sample {differ[0]:,}: {recorded[differ[0]][0]} recorded)")
    return StepBatch(step, position, layout, samples, stage_weights(source, position),
                     {index: loss for index, (_, loss) in recorded.items()}, spike)


# -- a spike's batch ---------------------------------------------------------------------------------------------
SPIKE_TOP = 5
"""Samples a spike event names with their documents: the step's highest losses."""


def spike_batch_record(source, layout: Layout, first_sample: int, losses: dict[int, float],
                       top: int = SPIKE_TOP) -> dict[str, Any]:
    """What a spike event records of the step that confirmed it (the trainer hands the samples' losses, gathered
    from every rank, by global index): every sample's domain and loss, the `top` highest with their rank, micro
    batch and documents, and the batch's domain mix (its share of the step's tokens) against the stage's weights."""
    per_rank = layout.micro_batch * layout.grad_accum
    tokens: dict[str, int] = {}
    samples, named = [], []
    for index in sorted(losses):
        stream, epoch, sample, samples_of = source.origin(index)
        domain = stream_domain(source, stream)
        slots = source.sample_slots(index)
        tokens[domain] = tokens.get(domain, 0) + slots
        samples.append([index, domain, round(float(losses[index]), 4)])
        offset = index - first_sample
        named.append({"index": index, "domain": domain, "stream": stream, "loss": round(float(losses[index]), 4),
                      "rank": offset // per_rank, "micro": offset % per_rank // layout.micro_batch,
                      "row": offset % layout.micro_batch // slots, "epoch": epoch, "sample": sample,
                      "_samples": samples_of})
    named.sort(key=lambda item: -item["loss"])
    highest = []
    for item in named[:top]:
        item["documents"] = [piece.as_dict() for piece in sample_pieces(item.pop("_samples"), item["sample"])]
        highest.append(item)
    total = sum(tokens.values()) or 1
    weights = stage_weights(source, first_sample)
    mix = {name: {"share": round(tokens.get(name, 0) / total, 4), "weight": weights.get(name)}
           for name in sorted({*tokens, *weights})}
    return {"batch_first_sample": first_sample, "batch_samples": samples, "top_samples": highest, "domain_mix": mix}


def stream_domain(source, stream: str) -> str:
    """The domain a stream reads (the stream's own name without a curriculum)."""
    if isinstance(source, Mixer):
        return next(s.domain for s in source.streams if s.name == stream)
    return stream
