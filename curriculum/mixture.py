"""The pure mixture schedule: global sample index -> (stage, domain, domain cursor), from the curriculum alone.

Each stage's weights are rounded to integer seat counts per PERIOD (10,000) samples (largest remainder; every
positive weight keeps at least one seat), and the seats of one period are ordered by the Sainte-Lague divisor
rule, so the domain of any position is a table lookup and every prefix of a period is within about one sample
per domain of its exact share. Cursors persist across stages. No data is read here: the mixer
(`curriculum/mixer.py`) turns cursors into samples, and the plan and the repetition checks use the same schedule.

The columns of the schedule are streams: a domain read at one sample shape (seq_len, and the shortest
document it admits). A curriculum whose stages all read at train.seq_len has one stream per domain, named as
the domain; a stage at another seq_len, or with `min_document_tokens`, reads a stream of its own (its own
order, cursor and epochs), which later stages of the same shape continue. Global indices count slots of
train.seq_len tokens; a stage at L' = f x train.seq_len trains one sample per f slots.

May import: `curriculum.config`, `curriculum.schedule`, numpy.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from curriculum.config import CurriculumConfig, CurriculumError, Stage, domains_used
from curriculum.schedule import length_problem, stage_at_sample, stage_ends, stage_seq_lens, stage_starts

PERIOD = 10_000


# -- streams: a domain at one sample shape ---------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """One domain read at one sample shape; `base` streams (train.seq_len, no filter) are named as the domain."""

    domain: str
    seq_len: int
    min_document_tokens: int = 0
    base: bool = True

    @property
    def name(self) -> str:
        if self.base:
            return self.domain
        return f"{self.domain}@{self.seq_len}" + (f"/min{self.min_document_tokens}" if self.min_document_tokens else "")


def stage_stream(stage: Stage, domain: str, seq_len: int) -> Stream:
    """The stream `stage` reads `domain` from, given the run's seq_len."""
    length = int(stage.seq_len) or seq_len
    shortest = int(stage.min_document_tokens.get(domain, 0))
    return Stream(domain, length, shortest, base=length == seq_len and shortest == 0)


def streams_of(cfg: CurriculumConfig, seq_len: int, domain_names: Sequence[str]) -> list[Stream]:
    """The schedule's columns: one per domain while every stage reads at train.seq_len unfiltered (in
    `domain_names` order), else each stream in order of first use."""
    used = [stage_stream(stage, name, seq_len) for stage in cfg.stages for name, w in stage.weights.items() if w > 0]
    if all(stream.base for stream in used):
        return [Stream(name, seq_len) for name in domain_names]
    out: list[Stream] = []
    for stream in used:
        if stream not in out:
            out.append(stream)
    return out


# -- one stage's interleave ------------------------------------------------------------------------
def period_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Integer seats per `period` samples: largest remainder of weight shares, >= 1 for a positive weight."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or w.sum() <= 0:
        raise CurriculumError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    exact = w / w.sum() * period
    counts = np.floor(exact).astype(np.int64)
    # Largest remainders first; stable order keeps ties deterministic (lower index first).
    short = period - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:short]] += 1
    # A tiny positive weight would otherwise round to no samples at all: take its seat from the largest.
    for index in np.flatnonzero((w > 0) & (counts == 0)):
        counts[int(np.argmax(counts))] -= 1
        counts[index] = 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(domain, seat number) of each position of one period, Sainte-Lague order (see the module doc)."""
    domains, seats, keys = [], [], []
    for d, n in enumerate(int(c) for c in counts):
        if n == 0:
            continue
        k = np.arange(n, dtype=np.int64)
        domains.append(np.full(n, d, dtype=np.int16))
        seats.append(k)
        # (2k+1)/(2n) is correctly rounded, so equal fractions give equal floats and ties stay exact.
        keys.append((2 * k + 1) / (2.0 * n))
    domain, seat, key = np.concatenate(domains), np.concatenate(seats), np.concatenate(keys)
    order = np.lexsort((domain, key))
    return domain[order], seat[order].astype(np.int32)


# -- the pure schedule -------------------------------------------------------------------------------
class MixtureSchedule:
    """Global sample -> (stage, domain, domain cursor), from the curriculum alone (no data)."""

    def __init__(self, cfg: CurriculumConfig, seq_len: int, domain_names: Sequence[str] | None = None,
                 global_batch: int = 1):
        if not cfg.stages:
            raise CurriculumError("a mixture needs at least one stage (an empty curriculum means ShuffledDomains)")
        if seq_len < 1:
            raise CurriculumError(f"seq_len must be >= 1, got {seq_len}")
        self.cfg = cfg
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.domain_names = list(domain_names if domain_names is not None else domains_used(cfg))
        self.stage_seq_lens = stage_seq_lens(cfg.stages, seq_len)
        shape_problems = stage_length_problems(cfg, seq_len, global_batch)
        if shape_problems:
            raise CurriculumError(f"curriculum {cfg.name!r} is invalid:\n  " + "\n  ".join(shape_problems))
        self.factors = [length // seq_len for length in self.stage_seq_lens]
        """Slots (global indices) per sample of each stage: its seq_len / train.seq_len."""
        self.starts = stage_starts(cfg.stages, seq_len, global_batch)
        self.ends = stage_ends(cfg.stages, seq_len, global_batch)
        self.streams = streams_of(cfg, seq_len, self.domain_names)
        self.stream_names = [stream.name for stream in self.streams]
        self.stream_domain = [self.domain_names.index(stream.domain) for stream in self.streams]
        """Domain index (into domain_names) of each stream."""
        num_domains = len(self.streams)  # the columns are streams (one per domain in the usual case)
        self.counts = np.zeros((len(cfg.stages), num_domains), dtype=np.int64)
        self._domain = []  # per stage: [PERIOD] int16 stream of each position
        self._seat = []    # per stage: [PERIOD] int32 seat number (rank of the position among its stream's)
        self._prefix = []  # per stage: [PERIOD + 1, streams] picks of each stream before each position
        for index, stage in enumerate(cfg.stages):
            weights = [0.0] * num_domains
            for name, weight in stage.weights.items():
                if weight > 0:
                    weights[self.streams.index(stage_stream(stage, name, seq_len))] = float(weight)
            self.counts[index] = period_counts(weights)
            domain, seat = interleave(self.counts[index])
            prefix = np.zeros((PERIOD + 1, num_domains), dtype=np.int64)
            prefix[1:] = np.cumsum(domain[:, None] == np.arange(num_domains)[None, :], axis=0)
            self._domain.append(domain)
            self._seat.append(seat)
            self._prefix.append(prefix)
        # Python copies for the per-sample path: list indexing is several times faster than numpy scalars.
        self._domain_list = [d.tolist() for d in self._domain]
        self._seat_list = [s.tolist() for s in self._seat]
        self._counts_list = self.counts.tolist()
        self.cursor_start = np.zeros((len(cfg.stages), num_domains), dtype=np.int64)
        for index in range(1, len(cfg.stages)):
            previous = index - 1
            length = self.starts[index] - self.starts[previous]
            self.cursor_start[index] = self.cursor_start[previous] + self._picks_in_stage(previous, length)
        self._cursor_start_list = self.cursor_start.tolist()

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_of(self, sample: int) -> int:
        return stage_at_sample(self.starts, sample)

    def _picks_in_stage(self, stage: int, length: int) -> np.ndarray:
        """Per-stream picks among the samples of `stage` that begin in its first `length` slots."""
        full, rest = divmod(-(-int(length) // self.factors[stage]), PERIOD)
        return full * self.counts[stage] + self._prefix[stage][rest]

    def picks_before(self, position: int) -> np.ndarray:
        """Per-domain number of samples among global samples [0, position) (= each domain's cursor there)."""
        stage = self.stage_of(position)
        return self.cursor_start[stage] + self._picks_in_stage(stage, position - self.starts[stage])

    def longest_stage_within(self, stage: int, domain: int, cap: int) -> int | None:
        """The most samples `stage` may span while `domain` has at most `cap` picks by its end.

        None when the stage's length cannot help: the earlier stages alone take more than `cap`, or
        the stage does not read the domain. Picks within a stage grow with its length (whole periods,
        then the period's prefix), so the answer is read off the seat table.
        """
        room = cap - int(self.cursor_start[stage][domain])
        per_period = int(self.counts[stage][domain])
        if room < 0 or per_period == 0:
            return None
        full, rest = divmod(room, per_period)
        within = int(np.searchsorted(self._prefix[stage][:, domain], rest, side="right")) - 1
        return (full * PERIOD + within) * self.factors[stage]

    def locate(self, sample: int) -> tuple[int, int]:
        """(stream index, cursor in that stream) of global sample `sample` (a slot: the sample beginning
        there, or, in a stage of longer samples, the one holding it)."""
        stage = bisect.bisect_right(self.starts, sample) - 1
        full, offset = divmod((sample - self.starts[stage]) // self.factors[stage], PERIOD)
        domain = self._domain_list[stage][offset]
        cursor = (self._cursor_start_list[stage][domain] + full * self._counts_list[stage][domain]
                  + self._seat_list[stage][offset])
        return domain, cursor

    def locate_many(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """`locate` for slots [first, first + count), vectorised: (streams int16, cursors int64)."""
        domains = np.empty(count, dtype=np.int16)
        cursors = np.empty(count, dtype=np.int64)
        stop = first + count
        stage = self.stage_of(first)
        position = first
        while position < stop:
            end = stop if stage + 1 >= self.num_stages else min(stop, max(self.starts[stage + 1], position))
            if end > position:
                offsets = np.arange(position - self.starts[stage], end - self.starts[stage], dtype=np.int64)
                offsets //= self.factors[stage]  # the slots of one longer sample name that sample
                full, offsets = np.divmod(offsets, PERIOD)
                d = self._domain[stage][offsets]
                out = slice(position - first, end - first)
                domains[out] = d
                cursors[out] = self.cursor_start[stage][d] + full * self.counts[stage][d] + self._seat[stage][offsets]
            position = end
            stage += 1
        return domains, cursors

    def stage_picks(self, run_samples: int | None = None) -> np.ndarray:
        """[stages, streams] samples each stage takes from each stream (the last stage up to `run_samples`)."""
        out = np.zeros_like(self.counts)
        for index in range(self.num_stages):
            start = self.starts[index]
            end = self.ends[index] if index + 1 < self.num_stages or run_samples is None else max(run_samples, start)
            out[index] = self._picks_in_stage(index, end - start)
        return out


def stage_length_problems(cfg: CurriculumConfig, seq_len: int, global_batch: int) -> list[str]:
    """Stage seq_lens the slot index cannot express: not a multiple of train.seq_len, or not fitting a step."""
    problems = []
    for index, (stage, length) in enumerate(zip(cfg.stages, stage_seq_lens(cfg.stages, seq_len))):
        if problem := length_problem(index, length, seq_len):
            problems.append(problem)
        elif global_batch % (length // seq_len):
            problems.append(f"curriculum.stages.{index}.seq_len={length}: one step of {global_batch} samples of "
                            f"train.seq_len={seq_len} does not divide into samples of {length} tokens; make "
                            f"train.global_batch_size a multiple of {length // seq_len}")
    return problems
