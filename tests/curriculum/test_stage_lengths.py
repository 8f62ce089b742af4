"""A curriculum stage with its own seq_len and document filter (the short-to-long schedule), without DeepSpeed:
the slot index, the stage boundaries, the streams, the loader's micro-batch shapes, the length filter,
resume, and the refusals. The run itself (2 ranks, switch in-process, exact resume) is
tests/pretrain/test_stage_lengths_cpu.py."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from curriculum.config import CurriculumConfig, CurriculumError, Stage
from curriculum.mixer import Mixer, open_streams
from curriculum.plan import RunShape, format_plan, make_plan
from data.token_root import TokenRoot
from pretrain.loader import BatchLoader
from pretrain.model.config import ModelConfig
from pretrain.stages import model_in_stage, stage_problems

SEQ = 16
GLOBAL = 8
SHORT, LONG = 20, 120  # document lengths (tokens, end-of-document included)
EOS = 7999


def write_mixed_lengths(root: Path) -> Path:
    """Domains a and b; in each, short documents (tokens 100-199 of the domain's thousand) alternate with long
    ones (tokens 500-599), every document ending in EOS, so a sample tells which kind it came from."""
    with TokenRoot(root, vocab_size=8000, eos_id=EOS) as out:
        for k, name in enumerate(("a", "b")):
            with out.shard(name, "train") as writer:
                for doc in range(120):
                    long = doc % 2 == 1
                    body = k * 1000 + (500 if long else 100) + np.arange((LONG if long else SHORT) - 1) % 100
                    writer.add_document(np.append(body, EOS))
    return root


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return write_mixed_lengths(tmp_path_factory.mktemp("mixed"))


def short_to_long(filter_long: bool = True, long_tokens: int = 40 * 4 * SEQ) -> CurriculumConfig:
    """Stage 1 at SEQ (a budget that ends mid-step), stage 2 at 4 x SEQ, reading a's long documents only."""
    return CurriculumConfig(name="s2l", default_max_repetition=100.0, stages=[
        Stage("short", 45 * SEQ + 3, {"a": 0.5, "b": 0.5}),
        Stage("long", long_tokens, {"a": 0.5, "b": 0.5}, seq_len=4 * SEQ,
              min_document_tokens={"a": LONG} if filter_long else {}, rope_theta=40000.0),
    ])


def mixer_for(root: Path, cfg: CurriculumConfig, seed: int = 3) -> Mixer:
    from data.domains import open_run_data

    _, train, _ = open_run_data(root, None, SEQ, verify="sizes", validation=False)
    return Mixer(cfg, {**train, **open_streams(cfg, root, SEQ)}, SEQ, GLOBAL, seed)


def test_a_stage_of_another_length_starts_on_a_step_and_spans_its_slots(data_root):
    mixer = mixer_for(data_root, short_to_long())
    schedule = mixer.schedule
    # 45 x 16 + 3 tokens end inside sample 45, inside step 5 (samples 40-47): the long stage starts at step 6.
    assert schedule.starts == [0, 48] and schedule.factors == [1, 4]
    assert schedule.stage_seq_lens == [SEQ, 4 * SEQ]
    assert mixer.sample_slots(47) == 1 and mixer.sample_slots(48) == 4
    tokens, _ = mixer.get(48)
    assert tokens.shape == (4 * SEQ + 1,)
    # The 4 slots of one long sample name that sample; the next slot begins the next one.
    assert all(np.array_equal(mixer.get(48 + i)[0], tokens) for i in range(4))
    assert not np.array_equal(mixer.get(52)[0], tokens)
    # Stream names: a domain at train.seq_len keeps its own name (older states resume unchanged).
    assert schedule.stream_names == ["a", "b", f"a@{4 * SEQ}/min{LONG}", f"b@{4 * SEQ}"]


@pytest.mark.parametrize("rope", [{}, {"rope_theta": 40000.0}, {"rope_scaling": {"type": "linear", "factor": 2.0}}])
def test_a_stage_that_sets_its_rope_starts_on_a_step(rope):
    """Same length, another RoPE: one step's forward uses one RoPE table, so the stage begins on a step (45 x 16 + 3
    tokens end inside step 5: step 6 is sample 48); without a RoPE of its own it begins at its first slot, 46."""
    from curriculum.schedule import stage_starts

    stages = [Stage("first", 45 * SEQ + 3, {"a": 1.0}), Stage("second", 40 * SEQ, {"a": 1.0}, **rope)]
    assert stage_starts(stages, SEQ, GLOBAL) == [0, 48 if rope else 46]


def test_the_long_stage_reads_only_long_documents_where_asked(data_root):
    mixer = mixer_for(data_root, short_to_long())
    long_a = short_b = 0
    for slot in range(48, 48 + 4 * 40, 4):
        tokens, domain = mixer.get(slot)
        body = tokens[tokens != EOS] % 1000
        if mixer.domain_names[domain] == "a":
            assert np.all((body >= 500) & (body < 600)), body  # no short document of a
            long_a += 1
        else:
            short_b += int(np.any(body < 200))  # b is unfiltered: its short documents come too
    assert long_a > 10 and short_b > 0
    # Per-domain trained tokens count each stage's samples at their length.
    mixer.advance(48 + 4 * 8)
    metrics = mixer.metrics()
    assert metrics["curriculum/tokens/a"] + metrics["curriculum/tokens/b"] == (48 + 4 * 8) * SEQ


def test_the_loader_hands_micro_batches_of_the_stage_length(data_root):
    mixer = mixer_for(data_root, short_to_long())
    loaders = [BatchLoader(mixer, 4, 1, rank, 2, torch.device("cpu"), prefetch=0) for rank in range(2)]
    for loader in loaders:
        loader.load_state_dict({"consumed_samples": 40})
    shapes = []
    for _ in range(3):  # steps 6, 7, 8: the last short step, then two long ones
        batches = [loader.next_step() for loader in loaders]
        shapes.append({tuple(b.input_ids.shape) for rank in batches for b in rank})
        firsts = sorted(b.first_sample for rank in batches for b in rank)
        assert firsts == sorted({b.first_sample for rank in batches for b in rank})  # ranks take different slots
    assert shapes == [{(4, SEQ)}, {(1, 4 * SEQ)}, {(1, 4 * SEQ)}]


def test_resume_and_a_changed_length_of_a_started_stage(data_root):
    cfg = short_to_long()
    mixer = mixer_for(data_root, cfg)
    mixer.advance(64)
    state = mixer.state_dict()
    again = mixer_for(data_root, short_to_long())
    again.load_state_dict(state)
    assert again.position == 64 and np.array_equal(again.get(64)[0], mixer.get(64)[0])
    changed = short_to_long()
    changed.stages[1].seq_len = 2 * SEQ
    with pytest.raises(CurriculumError, match="stage 2 \\('long'\\) has started"):
        mixer_for(data_root, changed).load_state_dict(state)


def test_a_filter_no_document_passes_is_refused_naming_the_stream(data_root):
    cfg = short_to_long(filter_long=False)
    cfg.stages[1].min_document_tokens = {"b": LONG + 1}
    with pytest.raises(CurriculumError, match=f"reads b@{4 * SEQ}/min{LONG + 1}, which hold"):
        mixer_for(data_root, cfg)


def test_the_plan_shows_the_stage_length_and_each_stream():
    cfg = short_to_long()
    counts = {"a": 1000, "b": 1000, f"a@{4 * SEQ}/min{LONG}": 200, f"b@{4 * SEQ}": 250}
    plan = make_plan(cfg, RunShape(sum(s.tokens for s in cfg.stages), SEQ, GLOBAL), counts, counts)
    assert plan.problems == []
    assert [s.seq_len for s in plan.stages] == [SEQ, 4 * SEQ]
    text = format_plan(plan)
    assert f"samples [48, 208), seq_len {4 * SEQ}" in text
    assert f"a@{4 * SEQ}/min{LONG}" in text
    rows = {(r.stage, r.domain): r for r in plan.domains}
    assert rows[(1, f"b@{4 * SEQ}")].tokens == 20 * 4 * SEQ  # half of the stage's 40 long samples


@pytest.mark.parametrize("change, message", [
    ({"seq_len": 3 * SEQ // 2}, f"curriculum.stages.1.seq_len={3 * SEQ // 2} is not a multiple of train.seq_len={SEQ}"),
    ({"seq_len": 8 * SEQ}, f"curriculum.stages.1.seq_len={8 * SEQ} is 8 x train.seq_len, so train.micro_batch_size=4 "
                           "must be a multiple of 8"),
    ({"seq_len": 4 * SEQ, "rope_scaling": {"type": "yarn", "factr": 4}}, "curriculum.stages.1.rope_scaling: "),
    ({"seq_len": 4 * SEQ, "rope_scaling": {"type": "ntk"}}, "curriculum.stages.1.rope_scaling.type='ntk'"),
])
def test_stage_shapes_the_run_cannot_train_are_refused_in_one_line(change, message):
    cfg = short_to_long()
    for key, value in change.items():
        setattr(cfg.stages[1], key, value)
    problems = stage_problems(cfg.stages, ModelConfig(max_seq_len=8 * SEQ), SEQ, 4)
    assert len(problems) == 1 and problems[0].startswith(message), problems
    too_long_stages = cfg.stages[:1] + [Stage("x", 1, {"a": 1}, seq_len=16 * SEQ)]
    too_long = stage_problems(too_long_stages, ModelConfig(max_seq_len=8 * SEQ), SEQ, 16)
    assert too_long == [f"curriculum.stages.1.seq_len={16 * SEQ} exceeds model.max_seq_len={8 * SEQ}; raise "
                        f"model.max_seq_len (model.max_seq_len={16 * SEQ}) and give the stage a RoPE for that length "
                        "(curriculum.stages.1.rope_theta or rope_scaling)"]
    longer_rope = [*too_long_stages[:1], replace(too_long_stages[1], rope_theta=4e4)]
    assert stage_problems(longer_rope, ModelConfig(max_seq_len=8 * SEQ), SEQ, 16) == [  # its RoPE is the stage's own
        f"curriculum.stages.1.seq_len={16 * SEQ} exceeds model.max_seq_len={8 * SEQ}; raise model.max_seq_len "
        f"(model.max_seq_len={16 * SEQ})"]


def test_a_stage_rope_holds_until_a_later_stage_sets_another():
    stages = [Stage("a", 1, {"x": 1}), Stage("b", 1, {"x": 1}, rope_theta=5e5,
                                             rope_scaling={"type": "yarn", "factor": 4.0}),
              Stage("c", 1, {"x": 1}), Stage("d", 1, {"x": 1}, rope_theta=1e6)]
    model = ModelConfig(rope_theta=1e4)
    got = [(m.rope_theta, m.rope_scaling.type) for m in (model_in_stage(model, stages, i) for i in range(4))]
    assert got == [(1e4, "none"), (5e5, "yarn"), (5e5, "yarn"), (1e6, "yarn")]
