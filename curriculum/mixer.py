"""The deterministic curriculum mixer: global sample index -> (domain, sample), per-domain cursors, skips.

Everything is a pure function of (curriculum, seq_len, seed, domain sizes) and the global sample
index g, so prefetching ahead, ranks reading slices of a global batch, resuming on another number
of ranks and re-reading after a rollback all see the same stream. The only mutable state is the
stream position the trainer reports (`advance`) and the recorded skip ranges.

How g maps to data:

1. Stage: `curriculum.schedule` (stage i = samples [start_i, start_{i+1}); rounding documented there).
2. Domain: each stage's weights are rounded to integer seat counts per PERIOD (10,000) samples
   (largest remainder; every positive weight keeps at least one seat), and the seats of one period
   are ordered by the Sainte-Lague divisor rule: domain d's k-th seat sits at (k + 1/2) / n_d of the
   period, ties to the lower domain index. That is Megatron's error-feedback blending (always pick
   the domain furthest behind its share) in closed form: every prefix of the period is within about
   one sample per domain of its exact share, the pattern repeats exactly, and the domain of any
   position is a table lookup, with no sequential pass.
3. Cursor: domain d's position in its own stream at g = picks of d in all earlier stages
   + picks of d in this stage before g, both O(1) from the seat table. Cursors thus persist across
   stages: a domain trained in stages 1 and 3 continues in stage 3 on data stage 1 did not see.
4. Sample: cursor c of domain d is sample `EpochPermutation(n_d, seed_d)(c)`: a fresh seeded shuffle
   per epoch, so running out of a domain repeats it in a new order (a `domain_repetition` event).

A stage with its own seq_len or document filter reads streams rather than domains (curriculum/mixture.py:
a domain at one sample shape, with its own order, cursor and epochs); g still counts train.seq_len-token
slots, a longer sample spanning several (`sample_slots`), so everything below holds in every stage.

Skips (spike recovery): skip ranges live in the global index space. `skip(n)` at position p
records [p, p + n * global_batch) and moves past it; the loader's `consumed_samples` moves the same
way (`BatchLoader.skip`), so skipped samples are consumed positions that are never trained on.
Stage boundaries and cursors do not move (the data after a skip is what it would have been), and
the ranges are kept in the state, so a resume from any later checkpoint never replays them;
`skip_due` tells the trainer when a restored, older position falls into a recorded range.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from curriculum.config import CurriculumConfig, CurriculumError, domains_used, max_repetition, validate
from curriculum.repetition import repetition_problems
from curriculum.schedule import stage_lr, step_in_stage
from data.domains import open_streams as open_shaped
from data.manifest import write_json_atomic
from data.packed import EpochPermutation, PackedSamples
from curriculum.mixture import MixtureSchedule, Stream, streams_of
STATE_FORMAT = "ayumi-curriculum-mixer"
STATE_VERSION = 1


def domain_seed(seed: int, name: str) -> int:
    """Per-domain shuffle seed from the run seed and the domain's *name*, so adding a domain changes no other's order."""
    return (int(seed) << 32) | zlib.crc32(name.encode("utf-8"))


def open_streams(cfg: CurriculumConfig, data_root: str | os.PathLike, seq_len: int,
                 vocab_size: int | None = None) -> dict[str, PackedSamples]:
    """The streams a stage reads at its own seq_len or document filter, opened once, by stream name (none when
    every stage reads at train.seq_len); the plan counts them and the mixer reads them."""
    shapes = {stream.name: (stream.domain, stream.seq_len, stream.min_document_tokens)
              for stream in streams_of(cfg, seq_len, domains_used(cfg)) if not stream.base}
    return open_shaped(data_root, shapes, vocab_size) if shapes else {}


# -- events ------------------------------------------------------------------------------------------
@dataclass
class CurriculumEvent:
    """Something the trainer should log to events.jsonl, W&B and the console."""

    kind: str
    """stage_switch | domain_repetition | batches_skipped."""
    sample: int
    """Global sample index where it happens."""
    message: str
    """One human-readable line."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Extra structured fields (stage, domain, epoch, skip range ...)."""


def batches_due(ranges: Sequence[Sequence[int]], position: int, global_batch: int) -> int:
    """Whole global batches to skip at stream `position` if it lies inside a recorded skip range, else 0."""
    for start, stop in ranges:
        if start <= position < stop:
            return -(-(stop - position) // global_batch)
    return 0


def merge_ranges(ranges: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping [start, stop) ranges covering the same samples."""
    merged: list[tuple[int, int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


# -- the mixer ---------------------------------------------------------------------------------------
class Mixer:
    """A `pretrain.loader.SampleSource` over a staged curriculum, with events, skips and resumable state.

    `domains` holds the samples of every stream the stages read, by stream name: each domain at train.seq_len
    under its own name, and the streams of a stage with its own seq_len or `min_document_tokens`
    (curriculum/mixture.py) as `open_streams` opens them."""

    def __init__(self, cfg: CurriculumConfig, domains: Mapping[str, PackedSamples], seq_len: int,
                 global_batch: int, seed: int):
        validate(cfg, known_domains=list(domains))
        names = domains_used(cfg)
        self.cfg = cfg
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.schedule = MixtureSchedule(cfg, seq_len, names, global_batch)
        self.domain_names = names
        self.streams = self.schedule.streams
        self._samples = [self._samples_of(stream, domains) for stream in self.streams]
        empty = [stream.name for stream, samples in zip(self.streams, self._samples) if len(samples) == 0]
        if empty:
            raise CurriculumError(
                f"curriculum {cfg.name!r} reads {', '.join(empty)}, which hold(s) no complete sample (of "
                f"seq_len + 1 tokens, from the documents it admits); prepare more data or drop them from the stages"
            )
        self.domain_samples = {stream.name: len(samples) for stream, samples in zip(self.streams, self._samples)}
        problems = repetition_problems(cfg, self.schedule, self.domain_samples)
        if problems:
            raise CurriculumError(f"curriculum {cfg.name!r} cannot be served:\n  " + "\n  ".join(problems))
        self._orders = [EpochPermutation(len(samples), domain_seed(seed, stream.name))
                        for stream, samples in zip(self.streams, self._samples)]
        self._sizes = np.array([len(samples) for samples in self._samples], dtype=np.int64)
        self._stream_domain = self.schedule.stream_domain
        self.position = 0
        self.skips: list[tuple[int, int]] = []
        self.exclusion = None
        """data.exclude's documents (data/exclude.py's Exclusion over the streams in order, set by
        pretrain/excluded.py; stages, cursors and every other sample stay where they are); None: every sample is
        trained."""

    @staticmethod
    def _samples_of(stream: Stream, domains: Mapping[str, PackedSamples]) -> PackedSamples:
        if stream.name not in domains:
            raise CurriculumError(f"stream {stream.name!r} (domain {stream.domain!r} at seq_len {stream.seq_len}) was "
                                  "not opened: open it with curriculum.mixer.open_streams")
        samples = domains[stream.name]
        if samples.seq_len != stream.seq_len:
            raise CurriculumError(f"domain {stream.domain!r} was cut at seq_len {samples.seq_len}, "
                                  f"the stream {stream.name!r} needs {stream.seq_len}")
        return samples

    # -- the stream (SampleSource) ------------------------------------------------------------------
    def get(self, global_index: int) -> tuple[np.ndarray, int]:
        """Sample `global_index`: (its stage's seq_len + 1 tokens, domain index); a pure function of the index."""
        stream, _, sample = self._locate(global_index)
        return self._samples[stream].sample(sample), self._stream_domain[stream]

    def stream_samples(self) -> list[tuple[str, PackedSamples]]:
        """(domain, samples) of each stream, in stream order: what data.exclude compiles its exclusions over."""
        return [(stream.domain, samples) for stream, samples in zip(self.streams, self._samples)]

    def origin(self, global_index: int) -> tuple[str, int, int, PackedSamples]:
        """Where sample `global_index` comes from: (stream name, epoch, sample id, the stream's samples); `get`
        reads it from there, and `ayumi batch` names its documents from it."""
        stream, epoch, sample = self._locate(global_index)
        return self.streams[stream].name, epoch, sample, self._samples[stream]

    def _locate(self, global_index: int) -> tuple[int, int, int]:
        stream, cursor = self.schedule.locate(global_index)
        epoch, sample = self._orders[stream](cursor)
        if self.exclusion is not None and self.exclusion.excluded(stream, sample, global_index):
            epoch, sample = self.exclusion.replacement(stream, cursor, global_index, self._orders[stream])
        return stream, epoch, sample

    def sample_slots(self, global_index: int) -> int:
        """Global indices one sample spans at `global_index`: its stage's seq_len / train.seq_len."""
        return self.schedule.factors[self.schedule.stage_of(global_index)]

    def sample_ids(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stream, epoch, sample id within the stream) of slots [first, first + count), vectorised."""
        domains, cursors = self.schedule.locate_many(first, count)
        epochs = cursors // self._sizes[domains]
        ids = np.empty(count, dtype=np.int64)
        for d in np.unique(domains):
            mine = domains == d
            order = self._orders[int(d)]
            for epoch in np.unique(epochs[mine]):
                rows = mine & (epochs == epoch)
                ids[rows] = order.permutation(int(epoch))[cursors[rows] - int(epoch) * order.num_samples]
        return domains, epochs, ids

    # -- where the run is ---------------------------------------------------------------------------
    def stage_at_sample(self, sample: int) -> int:
        return self.schedule.stage_of(sample)

    def stage_index(self) -> int:
        """Stage of the next sample to train."""
        return self.schedule.stage_of(self.position)

    def lr(self, scheduled_lr: float, min_lr: float, position: int | None = None) -> float:
        """The LR for the step starting at stream `position` (default: now), after the stage's LR policy."""
        position = self.position if position is None else position
        index = self.schedule.stage_of(position)
        end = self.schedule.ends[index]
        step, steps = step_in_stage(self.schedule.starts[index], end, position, self.global_batch)
        return stage_lr(scheduled_lr, min_lr, self.cfg.stages[index].lr, step, steps)

    def trained_samples(self, position: int | None = None) -> np.ndarray:
        """Per-stream samples trained on before `position`: consumed minus skipped."""
        position = self.position if position is None else position
        picks = self.schedule.picks_before(position)
        for start, stop in self.skips:
            if start >= position:
                break
            picks = picks - (self.schedule.picks_before(min(stop, position)) - self.schedule.picks_before(start))
        return picks

    def metrics(self) -> dict[str, Any]:
        """`curriculum/stage` (1-based) and `curriculum/tokens/<domain>` (trained tokens) at the current position."""
        out: dict[str, Any] = {"curriculum/stage": self.stage_index() + 1}
        tokens = dict.fromkeys(self.domain_names, 0)
        for stream, samples in zip(self.streams, self.trained_samples().tolist()):
            tokens[stream.domain] += samples * stream.seq_len
        for name, count in tokens.items():
            out[f"curriculum/tokens/{name}"] = count
        return out

    # -- advancing, skipping ------------------------------------------------------------------------
    def advance(self, position: int) -> list[CurriculumEvent]:
        """The trainer consumed samples up to `position` (the loader's consumed_samples); events on the way."""
        old = self.position
        if position < old:
            raise ValueError(f"the stream only moves forward: position {position} < {old} (use load_state_dict to go back)")
        events = self._stage_events(old, position) + self._repetition_events(old, position)
        self.position = position
        return sorted(events, key=lambda event: event.sample)

    def skip(self, num_batches: int) -> list[CurriculumEvent]:
        """Skip `num_batches` global batches from the current position; record the range. Call `BatchLoader.skip` too."""
        if num_batches <= 0:
            return []
        start, stop = self.position, self.position + num_batches * self.global_batch
        self.add_skips([(start, stop)])
        event = CurriculumEvent(
            "batches_skipped", start,
            f"skipped {num_batches} batch(es): global samples [{start:,}, {stop:,}) will never be trained on",
            {"skip_start": start, "skip_stop": stop, "batches": num_batches},
        )
        return [event] + self.advance(stop)

    def skip_due(self, position: int | None = None) -> int:
        """Whole batches to skip now because `position` lies in a recorded skip range (after restoring an older state)."""
        return batches_due(self.skips, self.position if position is None else position, self.global_batch)

    def add_skips(self, ranges: Sequence[Sequence[int]]) -> None:
        """Add skip ranges (from a checkpoint, a ledger, or `skip`); overlapping ranges merge."""
        self.skips = merge_ranges([*self.skips, *ranges])

    def _stage_events(self, old: int, new: int) -> list[CurriculumEvent]:
        events = []
        starts, stages = self.schedule.starts, self.cfg.stages
        for index, start in enumerate(starts):
            following = starts[index + 1] if index + 1 < len(starts) else None
            if not old <= start < new or following == start:  # an empty stage (budget < seq_len) is never entered
                continue
            stage = stages[index]
            mixture = ", ".join(f"{name} {weight:g}" for name, weight in stage.weights.items() if weight > 0)
            length = self.schedule.stage_seq_lens[index]
            shape = f" at seq_len {length}" if length != self.seq_len or stage.seq_len else ""
            events.append(CurriculumEvent(
                "stage_switch", start,
                f"stage {index + 1}/{len(stages)} {stage.name!r} begins at sample {start:,} "
                f"({start * self.seq_len:,} tokens): {stage.tokens:,} tokens of {mixture}{shape}",
                {"stage": index + 1, "stage_name": stage.name, "sample": start, "seq_len": length},
            ))
        return events

    def _repetition_events(self, old: int, new: int) -> list[CurriculumEvent]:
        before, after = self.schedule.picks_before(old), self.schedule.picks_before(new)
        events = []
        for d, stream in enumerate(self.streams):
            name = stream.name
            size = int(self._sizes[d])
            epochs_before, epochs_after = -(-int(before[d]) // size), -(-int(after[d]) // size)
            for epoch in range(max(epochs_before, 1), epochs_after):  # epoch e (0-based) begins: e-th repetition
                where = self._first_sample_with_picks(d, epoch * size + 1, old, new)
                stage = self.schedule.stage_of(where)
                limit = max_repetition(self.cfg, self.cfg.stages[stage], stream.domain)
                events.append(CurriculumEvent(
                    "domain_repetition", where,
                    f"domain {name!r} ran out of unseen data ({size:,} samples) and starts epoch {epoch + 1} "
                    f"at sample {where:,} (stage {stage + 1}, max_repetition {limit:g})",
                    {"domain": name, "epoch": epoch + 1, "max_repetition": limit, "over_limit": epoch + 1 > limit},
                ))
        return events

    def _first_sample_with_picks(self, domain: int, picks: int, low: int, high: int) -> int:
        """Smallest sample s in [low, high) after which `domain` has `picks` picks (binary search)."""
        while low < high:
            mid = (low + high) // 2
            if self.schedule.picks_before(mid + 1)[domain] >= picks:
                high = mid
            else:
                low = mid + 1
        return low

    # -- state --------------------------------------------------------------------------------------
    def _started_stages(self, position: int) -> list[dict[str, Any]]:
        """Fingerprints of the stages the stream has entered (the past and the present may not change)."""
        out = []
        for index, stage in enumerate(self.cfg.stages):
            if self.schedule.starts[index] >= position:
                break
            out.append({
                "name": stage.name,
                "start": self.schedule.starts[index],
                "end": self.schedule.ends[index],
                "seats": {name: int(n) for name, n in zip(self.schedule.stream_names, self.counts_of(index)) if n},
            })
        return out

    def counts_of(self, stage: int) -> list[int]:
        """Seats per PERIOD of each domain in a stage (the stage's effective weights)."""
        return self.schedule.counts[stage].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "curriculum": self.cfg.name,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "position": self.position,
            "skips": [list(r) for r in self.skips],
            "stages": self._started_stages(self.position),
            "domain_samples": dict(self.domain_samples),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved state; refuses if the past or current stage, seq_len, seed or used data changed.

        Skip ranges merge with those already known, so an in-process rollback to an older
        checkpoint keeps the ranges recorded since.
        """
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise CurriculumError(f"not a curriculum mixer state of version {STATE_VERSION}: {state.get('format')!r} "
                                  f"v{state.get('version')!r}")
        problems = self._resume_problems(state)
        if problems:
            raise CurriculumError(
                f"cannot resume curriculum {self.cfg.name!r} at sample {int(state['position']):,}:\n  "
                + "\n  ".join(problems)
                + "\n  Only stages that have not started may change; to change the mixture now, end the "
                  "current stage in a new run or restore the previous settings."
            )
        self.position = int(state["position"])
        self.add_skips(state.get("skips", []))

    def _resume_problems(self, state: Mapping[str, Any]) -> list[str]:
        problems = []
        for key in ("seq_len", "seed"):
            if state[key] != getattr(self, key):
                problems.append(f"{key} was {state[key]} when the run started, now {getattr(self, key)} "
                                "(the stream would be cut or shuffled differently)")
        saved = state["stages"]
        current = self._started_stages(int(state["position"]))
        if len(current) < len(saved):
            problems.append(f"{len(saved)} stage(s) had started, but the curriculum now has only {len(current)} "
                            "stage(s) beginning before the resume point")
        for index, (old, new) in enumerate(zip(saved, current)):
            for key in ("name", "start", "end", "seats"):
                if old[key] != new[key]:
                    what = "weights" if key == "seats" else ("tokens" if key in ("start", "end") else key)
                    problems.append(f"stage {index + 1} ({old['name']!r}) has started and its {what} changed "
                                    f"({key}: {old[key]} -> {new[key]})")
                    break
        used_before = {name for stage in saved for name in stage["seats"]}
        for name in sorted(used_before):
            was, now = state["domain_samples"].get(name), self.domain_samples.get(name)
            if was != now:
                problems.append(f"domain {name!r} had {was} samples when the run started, now {now}: its data changed "
                                "under a running curriculum (restore it, or start a new run)")
        return problems


class SkipLedger:
    """Skip ranges on disk in the run dir, so a restart from a checkpoint older than a skip still skips.

    Rank 0 writes (atomically); every rank reads at start and passes the ranges to `Mixer.add_skips`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> list[tuple[int, int]]:
        if not self.path.is_file():
            return []
        return merge_ranges(json.loads(self.path.read_text())["skips"])

    def save(self, ranges: Sequence[Sequence[int]]) -> None:
        write_json_atomic(self.path, {"skips": [list(r) for r in merge_ranges(ranges)]})
