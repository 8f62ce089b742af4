"""Curriculum config validation, the shipped YAML files, and the pure schedule functions."""

import pytest
from omegaconf import OmegaConf

from curriculum.config import CurriculumConfig, CurriculumError, LRPolicy, Stage, domains_used, enabled, validate
from curriculum.schedule import eval_due, stage_at, stage_at_sample, stage_ends, stage_lr, stage_starts, step_in_stage
from tests.helpers import REPO

CONF = REPO / "conf"


def load_group(name: str) -> CurriculumConfig:
    """A conf/curriculum file merged into the schema, as Hydra does for the `curriculum` group."""
    merged = OmegaConf.merge(OmegaConf.structured(CurriculumConfig), OmegaConf.load(CONF / "curriculum" / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def two(tokens=(100, 100), weights=({"a": 1.0}, {"a": 1.0, "b": 1.0})) -> CurriculumConfig:
    return CurriculumConfig(name="t", stages=[Stage(f"s{i}", t, dict(w)) for i, (t, w) in enumerate(zip(tokens, weights))])


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "curriculum").glob("*.yaml")))
def test_every_shipped_curriculum_loads_into_the_schema(name):
    cfg = load_group(name)
    validate(cfg)
    assert enabled(cfg) == (not name.startswith("none"))  # none.yaml, none_smoke.yaml: no stages


def test_four_stage_curriculum_matches_background_and_experiment():
    cfg = load_group("ja_en_4stage")
    assert [s.name for s in cfg.stages] == ["noisy_ja", "ja_en_math", "clean_ja_code", "cleanest_anneal"]
    assert set(domains_used(cfg)) == {"ja_raw", "ja_clean", "en", "math", "code"}
    assert all(any(d.startswith("ja") and w > 0 for d, w in s.weights.items()) for s in cfg.stages)  # ja every stage
    assert "math" not in cfg.stages[0].weights and cfg.stages[1].weights["math"] > 0  # math from mid-training
    assert cfg.stages[-1].lr.decay_to_min
    experiment = OmegaConf.load(CONF / "experiment" / "ja_en_4stage.yaml")
    validate(cfg, train_tokens=int(experiment.train.tokens))
    assert {"override /curriculum": "ja_en_4stage"} in list(experiment.defaults)


def test_tiny_curriculum_fits_cpu_tiny(tmp_path):
    """curriculum=tiny over experiment=cpu_tiny's run and the tests' corpus: the plan accepts it, with the figures
    its YAML promises (128 steps; the boundary at sample 375 falls inside step 47; both domains repeat, under 8x)."""
    from curriculum.plan import RunShape, available_samples, make_plan
    from tests.helpers import write_tiny_corpus

    train = OmegaConf.load(CONF / "experiment" / "cpu_tiny.yaml").train
    run = RunShape(int(train.tokens), int(train.seq_len), int(train.global_batch_size))
    tokens, samples = available_samples(write_tiny_corpus(tmp_path / "tiny"), run.seq_len)
    assert samples == {"ja": 167, "en": 234}
    plan = make_plan(load_group("tiny"), run, tokens, samples)
    assert plan.problems == [] and plan.warnings == []
    assert (run.total_steps, run.total_samples) == (128, 1024)
    assert [(s.name, s.first_sample, s.end_sample, s.steps) for s in plan.stages] == [
        ("ja_heavy", 0, 375, 46.875), ("en_heavy", 375, 1024, 81.125)]
    # samples per stage: ja 300 + 195, en 75 + 454 (0.8/0.2 of 375, 0.3/0.7 of 649); epochs are cumulative
    assert [(r.stage, r.domain, r.tokens // run.seq_len, round(r.epochs, 3), r.max_epochs) for r in plan.domains] == [
        (0, "ja", 300, round(300 / 167, 3), 8.0), (0, "en", 75, round(75 / 234, 3), 8.0),
        (1, "ja", 195, round(495 / 167, 3), 8.0), (1, "en", 454, round(529 / 234, 3), 8.0)]


@pytest.mark.parametrize("cfg, fragment", [
    (two(weights=({"a": 1.0}, {"a": -1.0, "b": 2.0})), "negative weight"),
    (two(weights=({"a": 1.0}, {"a": 0.0, "b": 0.0})), "all weights are zero"),
    (two(weights=({"a": 1.0}, {})), "all weights are zero"),
    (two(tokens=(100, 0)), "positive token budget"),
    (CurriculumConfig(stages=[Stage("x", 5, {"a": 1}), Stage("x", 5, {"a": 1})]), "duplicate stage name"),
    (CurriculumConfig(stages=[Stage("x", 5, {"a": 1}, max_repetition={"a": 0})]), "max_repetition.a=0"),
    (CurriculumConfig(stages=[Stage("x", 5, {"a": 1}, lr=LRPolicy(scale=0))]), "scale must be > 0"),
])
def test_invalid_stages_are_refused_with_the_field(cfg, fragment):
    with pytest.raises(CurriculumError, match=fragment):
        validate(cfg)


def test_unknown_domain_and_budget_mismatch_name_the_fix():
    cfg = two(weights=({"a": 1.0}, {"a": 1.0, "zz": 1.0}))
    with pytest.raises(CurriculumError) as err:
        validate(cfg, train_tokens=300, known_domains=["a", "b"])
    text = str(err.value)
    assert "unknown domain(s) zz" in text and "the prepared data has a, b" in text
    assert "add up to 200 tokens (100 + 100) but train.tokens=300" in text


def test_stage_boundaries_round_up_to_whole_samples():
    cfg = two(tokens=(100, 100))
    assert stage_starts(cfg.stages, 16) == [0, 7] and stage_ends(cfg.stages, 16) == [7, 13]  # ceil(100/16), ceil(200/16)
    for sample in range(20):  # sample g is in the stage in effect at its first token g*L
        assert stage_at_sample([0, 7], sample) == stage_at(cfg.stages, sample * 16)[0]
    assert stage_at(cfg.stages, 99)[0] == 0 and stage_at(cfg.stages, 100)[0] == 1 and stage_at(cfg.stages, 10**9)[0] == 1


def test_stage_lr_policies():
    assert stage_lr(1.0, 0.1, LRPolicy(), 5, 10) == 1.0
    assert stage_lr(1.0, 0.1, LRPolicy(scale=0.5), 5, 10) == 0.5
    warm = [stage_lr(1.0, 0.1, LRPolicy(rewarmup_steps=4), s, 10) for s in range(6)]
    assert warm == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    decay = [stage_lr(1.0, 0.1, LRPolicy(decay_to_min=True), s, 4) for s in range(4)]
    assert decay[0] < 1.0 and decay == sorted(decay, reverse=True) and decay[-1] == pytest.approx(0.1)
    assert step_in_stage(start=100, end=164, position=132, global_batch=8) == (4, 8)


def test_dense_early_evaluation():
    due = [s for s in range(1, 1001) if eval_due(s, interval=200, dense_interval=10, dense_until=200)]
    assert due[:3] == [10, 20, 30] and 200 in due and 210 not in due and due[-4:] == [400, 600, 800, 1000]
    assert [s for s in range(1, 101) if eval_due(s, interval=50)] == [50, 100]
    assert not any(eval_due(s, interval=0) for s in range(1, 50))
