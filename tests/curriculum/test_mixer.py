"""The mixer: window proportions, cursors across stages, exact boundaries, resume, skips, re-weighting."""
import copy

import numpy as np
import pytest
import torch

from curriculum.config import CurriculumConfig, CurriculumError, Stage
from curriculum.mixer import Mixer, SkipLedger
from curriculum.mixture import PERIOD, MixtureSchedule, interleave, period_counts
from pretrain.loader import BatchLoader
from tests.curriculum.helpers import packed, three_stage, write_domains
from tests.curriculum.test_config import load_group

SEQ = 16


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    # a: ~1000 samples, b: ~400, c: ~600 at seq_len 16 (three_stage reads b ~1.6 times).
    return write_domains(tmp_path_factory.mktemp("data"), {"a": 16_000, "b": 6_400, "c": 9_600})


def make_mixer(root, cfg=None, global_batch=8, seed=7):
    return Mixer(cfg or three_stage(SEQ), packed(root, SEQ), SEQ, global_batch, seed)


def window_errors(domains: np.ndarray, weights: np.ndarray, window: int) -> np.ndarray:
    """Max |share in window - weight| per domain over every window of `window` consecutive samples."""
    onehot = domains[:, None] == np.arange(len(weights))[None, :]
    cum = np.vstack([np.zeros((1, len(weights)), dtype=np.int64), np.cumsum(onehot, axis=0)])
    shares = (cum[window:] - cum[:-window]) / window
    return np.abs(shares - weights[None, :]).max(axis=0)


def random_curriculum(seed: int) -> CurriculumConfig:
    rng = np.random.default_rng(seed)
    names = [f"d{i}" for i in range(7)]
    stages = []
    for s in range(3):
        w = rng.dirichlet(np.full(7, 0.5))
        w[rng.integers(7)] = 0.002  # a rare domain in every stage
        stages.append(Stage(f"s{s}", 40_000, {n: float(x) for n, x in zip(names, w)}))
    return CurriculumConfig(name="random", stages=stages)


@pytest.mark.parametrize("cfg", [load_group("ja_en_4stage"), load_group("tiny"), three_stage(SEQ),
                                 random_curriculum(1), random_curriculum(2)], ids=lambda c: c.name)
def test_every_window_of_1000_samples_matches_the_stage_weights_within_1_percent(cfg):
    seq_len = 2048 if cfg.name == "ja_en_4stage" else 1 if cfg.name == "random" else SEQ
    schedule = MixtureSchedule(cfg, seq_len)
    for index, stage in enumerate(cfg.stages):
        start, end = schedule.starts[index], schedule.ends[index]
        # The interleave repeats every PERIOD samples, so three periods hold every window there is.
        count = min(end - start, 3 * PERIOD)
        domains, _ = schedule.locate_many(start, count)
        weights = np.array([stage.weights.get(n, 0.0) for n in schedule.domain_names])
        weights = weights / weights.sum()
        windows = [w for w in (1000, 1777, 5000) if w <= count]
        for window in windows:
            assert window_errors(domains, weights, window).max() <= 0.01, (stage.name, window)
        if not windows:  # a stage shorter than 1,000 samples: its whole length is the only window
            assert window_errors(domains, weights, count).max() <= max(0.01, 1.0 / count), stage.name
        assert set(np.unique(domains)) == set(np.flatnonzero(weights))  # a tiny weight still gets samples


def test_period_counts_and_interleave_are_exact():
    counts = period_counts([0.85, 0.15, 0.0, 1e-6])
    assert counts.tolist() == [8499, 1500, 0, 1] and counts.sum() == PERIOD
    domain, seat = interleave(period_counts([1, 1, 1]))
    for d in range(3):  # every domain's seats appear in order 0, 1, 2, ...
        assert seat[domain == d].tolist() == list(range(int((domain == d).sum())))


def test_scalar_and_vectorised_lookups_agree(data_root):
    mixer = make_mixer(data_root)
    domains, epochs, ids = mixer.sample_ids(0, 1200)
    for g in list(range(0, 1200, 7)) + [300, 301, 500, 501, 999, 1000, 1001]:
        tokens, d = mixer.get(g)
        assert d == domains[g]
        np.testing.assert_array_equal(tokens, mixer._samples[d].sample(int(ids[g])))
        assert tokens[0] // 1000 == ["a", "b", "c"].index(mixer.domain_names[d])  # the domain's token range


def test_cursors_persist_across_stages(data_root):
    mixer = make_mixer(data_root)
    s = mixer.schedule
    assert s.starts == [0, 301, 501]  # ceil((300*16+5)/16), ceil((500*16+5)/16)
    domains, cursors = s.locate_many(0, 1100)
    b = mixer.domain_names.index("b")
    # every domain reads its own stream in order, one cursor after the other, across all stages
    for d in range(len(mixer.domain_names)):
        assert cursors[domains == d].tolist() == list(range(int((domains == d).sum())))
    first_stage_b = int((domains[:301] == b).sum())
    assert cursors[301:501][domains[301:501] == b].size == 0  # b is not in stage 2
    assert cursors[501:][domains[501:] == b][0] == first_stage_b  # ...and resumes where stage 1 left it
    # stage 3's first samples of b are data stage 1 never saw (b has ~400 samples, stage 1 read 90)
    _, _, ids = mixer.sample_ids(0, 1100)
    seen = set(ids[:301][domains[:301] == b].tolist())
    later = ids[501:][domains[501:] == b][:200].tolist()
    assert not seen & set(later)


def test_stage_switches_are_exact_and_reported_once(data_root):
    mixer = make_mixer(data_root)
    loader = BatchLoader(mixer, 8, 1, 0, 1, torch.device("cpu"), prefetch=0)  # global batch 8
    events, domain_of_sample = [], {}
    for _ in range(130):
        for batch in loader.next_step():
            for row, g in enumerate(range(batch.first_sample, batch.first_sample + 8)):
                domain_of_sample[g] = mixer.domain_names[int(batch.domains[row])]
        events += mixer.advance(loader.consumed_samples)
    switches = [e for e in events if e.kind == "stage_switch"]
    assert [(e.sample, e.fields["stage"]) for e in switches] == [(0, 1), (301, 2), (501, 3)]
    assert "stage 2/3 'second' begins at sample 301 (4,816 tokens)" in switches[1].message
    # sample 300 (mid-step 37: samples 296..303) is still stage 1's mixture, 301 is stage 2's
    assert mixer.stage_at_sample(300) == 0 and mixer.stage_at_sample(301) == 1
    assert {domain_of_sample[g] for g in range(301, 501)} == {"a", "c"}
    assert {domain_of_sample[g] for g in range(0, 301)} == {"a", "b"}


def run_loaders(mixer_factory, world, steps, state=None, micro=2, accum=2):
    """Train-loop stand-in: `world` loaders (one per rank, each with its own mixer) for `steps` steps.

    Returns ({global sample: tokens}, state after the last step, events on rank 0).
    """
    mixers = [mixer_factory() for _ in range(world)]
    loaders = [BatchLoader(m, micro, accum, r, world, torch.device("cpu"), prefetch=2) for r, m in enumerate(mixers)]
    if state:
        for m, l in zip(mixers, loaders):
            m.load_state_dict(copy.deepcopy(state["mixer"]))
            l.load_state_dict(state["loader"])
    seen, events = {}, []
    for _ in range(steps):
        for mixer, loader in zip(mixers, loaders):
            for n in [mixer.skip_due()]:
                if n:  # a restored position inside a recorded skip range
                    events += mixer.skip(n)
                    loader.skip(n)
            for batch in loader.next_step():
                for row in range(batch.input_ids.shape[0]):
                    seen[batch.first_sample + row] = tuple(batch.input_ids[row, :4].tolist())
            new = mixer.advance(loader.consumed_samples)
            if mixer is mixers[0]:
                events += new
    out_state = {"mixer": mixers[0].state_dict(), "loader": loaders[0].state_dict()}
    for loader in loaders:
        loader.close()
    return seen, out_state, events


@pytest.mark.parametrize("world_before, world_after", [(1, 1), (2, 2), (2, 1)])
def test_resume_equals_the_uninterrupted_stream(data_root, world_before, world_after):
    factory = lambda: make_mixer(data_root, global_batch=8)  # noqa: E731 -- 8 = 2 micro x 2 accum x 2 ranks, or 2 x 4 x 1
    full, _, _ = run_loaders(factory, 1, 70, accum=4)
    part, state, _ = run_loaders(factory, world_before, 40, accum=8 // (2 * world_before))
    assert state["mixer"]["position"] == 320 and len(state["mixer"]["stages"]) == 2  # stopped inside stage 2
    rest, _, _ = run_loaders(factory, world_after, 30, state=state, accum=8 // (2 * world_after))
    assert sorted(part) == list(range(320)) and sorted(rest) == list(range(320, 560))
    assert {**part, **rest} == full


def test_skipped_ranges_are_never_replayed_after_a_restart(data_root, tmp_path):
    factory = lambda: make_mixer(data_root)  # noqa: E731
    early, early_state, _ = run_loaders(factory, 1, 3, accum=4)  # a checkpoint at sample 24
    mixers = [factory()]
    mixer, loader = mixers[0], BatchLoader(mixers[0], 2, 4, 0, 1, torch.device("cpu"), prefetch=2)
    for _ in range(5):
        loader.next_step()
        mixer.advance(loader.consumed_samples)
    events = mixer.skip(3)  # at sample 40: samples [40, 64) are skipped
    loader.skip(3)
    assert events[0].kind == "batches_skipped" and events[0].fields == {"skip_start": 40, "skip_stop": 64, "batches": 3}
    ledger = SkipLedger(tmp_path / "skipped_samples.json")
    ledger.save(mixer.skips)
    for _ in range(2):
        loader.next_step()
        mixer.advance(loader.consumed_samples)
    later_state = {"mixer": mixer.state_dict(), "loader": loader.state_dict()}
    loader.close()
    assert later_state["mixer"]["skips"] == [[40, 64]] and later_state["mixer"]["position"] == 80
    trained = mixer.trained_samples()
    assert int(trained.sum()) == 80 - 24 and mixer.metrics()["curriculum/stage"] == 1
    assert sum(v for k, v in mixer.metrics().items() if k.startswith("curriculum/tokens/")) == (80 - 24) * SEQ

    # Resume from the later checkpoint: the range is in the state, nothing before 80 is read again.
    after, _, _ = run_loaders(factory, 2, 3, state=later_state, accum=2)
    assert min(after) == 80
    # Restart from the *earlier* checkpoint (before the skip), with the ledger: the range is skipped again.
    def with_ledger():
        m = factory()
        m.add_skips(ledger.load())
        return m
    replay, _, events = run_loaders(with_ledger, 1, 6, state=early_state, accum=4)
    assert not set(replay) & set(range(40, 64))
    assert sorted(replay) == list(range(24, 40)) + list(range(64, 96))
    assert [e.fields["skip_start"] for e in events if e.kind == "batches_skipped"] == [40]


def test_reweighting_a_future_stage_on_resume(data_root):
    factory = lambda cfg=None: (lambda: make_mixer(data_root, cfg))  # noqa: E731
    old_full, _, _ = run_loaders(factory(), 1, 90, accum=4)
    _, state, _ = run_loaders(factory(), 1, 30, accum=4)  # sample 240: inside stage 1
    new_cfg = three_stage(SEQ)
    new_cfg.stages[2].weights = {"a": 0.1, "b": 0.8, "c": 0.1}
    new, _, _ = run_loaders(factory(new_cfg), 1, 60, state=state, accum=4)
    assert all(new[g] == old_full[g] for g in range(240, 501))  # stages 1-2 unchanged
    assert any(new[g] != old_full[g] for g in range(501, 720))  # stage 3 follows the new weights
    mixer = make_mixer(data_root, new_cfg)
    domains, cursors = mixer.schedule.locate_many(501, 1000)
    b = mixer.domain_names.index("b")
    assert abs((domains == b).mean() - 0.8) < 0.01
    assert cursors[domains == b][0] == make_mixer(data_root).schedule.picks_before(301)[b]  # b continues where stage 1 left it


@pytest.mark.parametrize("change, message", [
    (lambda c: c.stages[0].weights.update(a=0.5), "stage 1 ('first') has started and its weights changed"),
    (lambda c: setattr(c.stages[0], "tokens", 320 * SEQ), "stage 1 ('first') has started and its tokens changed"),
    (lambda c: setattr(c.stages[1], "tokens", 150 * SEQ), "stage 2 ('second') has started and its tokens changed"),
    (lambda c: c.stages[1].weights.update(a=0.9), "stage 2 ('second') has started and its weights changed"),
])
def test_changing_the_past_or_present_is_refused(data_root, change, message):
    _, state, _ = run_loaders(lambda: make_mixer(data_root), 1, 50, accum=4)  # sample 400: inside stage 2
    cfg = three_stage(SEQ)
    change(cfg)
    mixer = make_mixer(data_root, cfg)
    with pytest.raises(CurriculumError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mixer.load_state_dict(state["mixer"])


def test_resume_refuses_another_seed_seq_len_or_changed_data(data_root, tmp_path):
    _, state, _ = run_loaders(lambda: make_mixer(data_root), 1, 5, accum=4)
    with pytest.raises(CurriculumError, match="seed was 7 when the run started, now 8"):
        make_mixer(data_root, seed=8).load_state_dict(state["mixer"])
    other = write_domains(tmp_path / "d", {"a": 16_000, "b": 6_000, "c": 9_600})
    with pytest.raises(CurriculumError, match="domain 'b' had 399 samples when the run started, now 374") as err:
        make_mixer(other).load_state_dict(state["mixer"])
    assert "domain 'a'" not in str(err.value)  # a is unchanged


def test_repetition_events_and_the_max_repetition_bound(data_root):
    mixer = make_mixer(data_root)
    events = mixer.advance(1400)  # past the planned end (1000 samples) the last stage continues
    repeats = [e for e in events if e.kind == "domain_repetition"]
    assert [(e.fields["domain"], e.fields["epoch"]) for e in repeats] == [("b", 2)]
    # the event's sample is exactly where b's cursor reaches its size: the first sample of epoch 2
    domains, epochs, _ = mixer.sample_ids(0, 1400)
    b = mixer.domain_names.index("b")
    first_repeat = int(np.flatnonzero((domains == b) & (epochs == 1))[0])
    assert repeats[0].sample == first_repeat and not repeats[0].fields["over_limit"]
    tight = three_stage(SEQ)
    tight.stages[2].max_repetition = {"b": 0.8}  # b: 90 + 250 of 399 samples by the end of stage 3
    with pytest.raises(CurriculumError, match=r"domain 'b' would be read 0\.85 times by the end of stage 3"):
        make_mixer(data_root, tight)


def test_adding_a_domain_to_a_future_stage_leaves_other_domains_orders_alone(data_root):
    two = CurriculumConfig(name="x", default_max_repetition=50, stages=[
        Stage("one", 100 * SEQ, {"a": 1.0}), Stage("two", 100 * SEQ, {"a": 1.0})])
    three = copy.deepcopy(two)
    three.stages[1].weights["c"] = 1.0
    ids_two = make_mixer(data_root, two).sample_ids(0, 100)[2]
    ids_three = make_mixer(data_root, three).sample_ids(0, 100)[2]
    np.testing.assert_array_equal(ids_two, ids_three)
