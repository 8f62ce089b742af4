"""The run's training stream: its domains opened from the config, and the source the loader reads them through.

Training (pretrain/train.py) and the commands that say what a step trained on (pretrain/step_samples.py) build the
stream with these two functions, so both see the same samples at the same global index: the curriculum's mixer
over each stage's streams, or every domain in one shuffled stream. Imports no torch.
"""
from __future__ import annotations

from pathlib import Path

from curriculum.config import enabled as curriculum_enabled
from curriculum.mixer import Mixer, open_streams
from data.domains import open_run_data
from data.packed import PackedSamples, ShuffledDomains


def open_training_data(cfg, verify: str | None = None,
                       validation: bool | None = None) -> tuple[dict[str, PackedSamples], dict[str, PackedSamples]]:
    """(train samples by stream name, validation samples by domain) of a run's config; `verify` and `validation`
    default to the config's data.verify and data.validation."""
    root = Path(cfg.data.root)
    _, train, val = open_run_data(root, cfg.data.domains or None, cfg.train.seq_len, cfg.model.vocab_size,
                                  cfg.data.verify if verify is None else verify,
                                  cfg.data.validation if validation is None else validation)
    if curriculum_enabled(cfg.curriculum):  # stages at their own seq_len or document filter read streams of their own
        train.update(open_streams(cfg.curriculum, root, cfg.train.seq_len, cfg.model.vocab_size))
    return train, val


def sample_source(cfg, train: dict[str, PackedSamples]) -> ShuffledDomains | Mixer:
    """The global sample stream over `train`: the curriculum's mixer, or all domains shuffled."""
    if curriculum_enabled(cfg.curriculum):
        return Mixer(cfg.curriculum, train, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.seed)
    return ShuffledDomains(train, seed=cfg.train.seed)


def micro_batch_firsts(consumed: int, rank: int, micro_batch: int, grad_accum: int) -> list[int]:
    """The first global index of each micro batch data-parallel rank `rank` trains in the step that begins at
    stream position `consumed`: the rank's contiguous slice of the global batch, micro batch by micro batch."""
    start = consumed + rank * micro_batch * grad_accum
    return [start + micro * micro_batch for micro in range(grad_accum)]


def micro_batch_samples(source, first: int, micro_batch: int) -> list[int]:
    """The global indices of the samples of the micro batch at `first`: each of its slots, or in a stage of
    longer samples (f slots each, `source.sample_slots`) every f-th."""
    return list(range(first, first + micro_batch, source.sample_slots(first)))
