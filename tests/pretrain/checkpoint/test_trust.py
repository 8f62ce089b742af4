"""Which checkpoint a run builds on, without DeepSpeed: the fallback past damaged checkpoints (set aside, an event),
the refusal, the state check, a rollback's checkpoint, keep_last after a resume, and a stop right after one.
The real 2-rank runs are in test_checkpoint_trust_cpu.py."""
import json

import pytest

from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import LATEST, META, CheckpointError, Checkpointer, complete_tags, tag_for
from pretrain.checkpoint.layout import quarantined
from pretrain.checkpoint.ring import RunCheckpoints
from pretrain.checkpoint.trust import CORRUPT_EVENT, NOTICE, choose_start, report, resume_start
from pretrain.stability.config import DetectorConfig, RecoveryConfig, StabilityConfig
from pretrain.stability.recovery import StabilityMonitor

MODEL = "mp_rank_00_model_states.pt"


class Engine:
    """Writes one DeepSpeed-like file per save; records loads; reports a bad state for the tags in `bad_state`."""

    def __init__(self, bad_state=()):
        self.loads, self.bad_state, self.current = [], set(bad_state), None

    def save(self, root, tag, client_state, collector=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        collector.save({"weights": list(range(256)), **client_state}, str(root / tag / MODEL))

    def load(self, root, tag, universal=False):
        self.loads.append(tag)
        self.current = tag

    def state_problem(self):
        return "Adam exp_avg_sq of lm_head.weight holds non-finite values" if self.current in self.bad_state else None


def saved_run(tmp_path, steps=(10, 20, 30), keep=0):
    saver = Checkpointer(tmp_path / "checkpoints", keep_last=keep, rank=0, barrier=lambda: None)
    for step in steps:
        saver.save(Engine(), step, {"train": {"step": step}}, {"model": {}})
    return saver


def resume(saver, engine, on_corrupt="fallback", load_from=None):
    """What a run's start does: choose (verify) before the model is built, then load."""
    return resume_start(choose_start(load_from, True, on_corrupt, saver), saver, engine)


def damage(tag_dir, name=MODEL):
    data = bytearray((tag_dir / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tag_dir / name).write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_next_one_loads(tmp_path, monkeypatch):
    saver = saved_run(tmp_path)
    root = saver.root
    damage(root / tag_for(30))
    engine = Engine()
    hashed = []
    hash_file = integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda path: hashed.append(path) or hash_file(path))
    loaded = resume(saver, engine)
    assert sorted(p.name for p in hashed if p.parent.name == tag_for(20)) == sorted(
        ["ayumi_rank00000.pt", "ayumi_state.pt", MODEL]), "verified once, before the model is built, not again at load"
    assert loaded.tag == tag_for(20) and engine.loads == [tag_for(20)] and loaded.shared == {"train": {"step": 20}}
    assert [note.kind for note in loaded.notes] == [CORRUPT_EVENT]
    assert loaded.notes[0].message == (f"checkpoint {root / tag_for(30)} is damaged: {MODEL} does not match the xxh3_128 "
                                       "checksum recorded at save; set aside as step_0000030.corrupt (kept, never "
                                       "loaded again)")
    assert complete_tags(root) == [tag_for(10), tag_for(20)] and quarantined(root) == [root / "step_0000030.corrupt"]
    assert (root / LATEST).read_text().strip() == tag_for(20)


def test_refuse_stops_in_one_line_naming_the_checkpoint_and_file_and_renames_nothing(tmp_path):
    saver = saved_run(tmp_path)
    damage(saver.root / tag_for(30), "ayumi_state.pt")
    engine = Engine()
    with pytest.raises(CheckpointError) as refused:
        resume(saver, engine, "refuse")
    message = str(refused.value)
    assert message.startswith(f"checkpoint {saver.root / tag_for(30)} is damaged: ayumi_state.pt does not match the "
                              "xxh3_128 checksum recorded at save. Fix: resume from the newest checkpoint that verifies "
                              "with checkpoint.on_corrupt=fallback")
    assert "\n" not in message and engine.loads == [] and quarantined(saver.root) == []


def test_a_state_that_cannot_be_trained_from_is_set_aside_like_damaged_files(tmp_path):
    saver = saved_run(tmp_path)
    engine = Engine(bad_state={tag_for(30)})
    loaded = resume(saver, engine)
    assert engine.loads == [tag_for(30), tag_for(20)] and loaded.tag == tag_for(20)
    assert loaded.notes[0].fields["problem"] == ("the state it loads cannot be trained from: Adam exp_avg_sq of "
                                                 "lm_head.weight holds non-finite values")
    with pytest.raises(CheckpointError, match=r"step_0000020 is damaged: the state it loads cannot be trained from: "
                                              r"Adam exp_avg_sq of lm_head.weight .*\. Fix: "):
        resume(saver, Engine(bad_state={tag_for(20)}), "refuse")


def test_when_no_checkpoint_verifies_the_run_is_refused_not_started_afresh(tmp_path):
    saver = saved_run(tmp_path, steps=(10, 20))
    for step in (10, 20):
        damage(saver.root / tag_for(step))
    with pytest.raises(CheckpointError, match=r"no checkpoint to load verifies: step_0000020.corrupt, "
                                              r"step_0000010.corrupt set aside as damaged. Fix: start afresh"):
        resume(saver, Engine())


def test_another_runs_checkpoint_is_refused_when_damaged_never_renamed(tmp_path):
    other = saved_run(tmp_path / "other")
    damage(other.root / tag_for(30))
    mine = Checkpointer(tmp_path / "mine", keep_last=2, rank=0, barrier=lambda: None)
    with pytest.raises(CheckpointError, match=r"step_0000030 is damaged: .* Fix: name another checkpoint in "
                                              r"checkpoint.load_from"):
        resume(mine, Engine(), load_from=str(other.root))
    assert complete_tags(other.root) == [tag_for(10), tag_for(20), tag_for(30)]


def test_a_checkpoint_without_checksums_loads_with_a_notice(tmp_path):
    saver = saved_run(tmp_path, steps=(10,))
    meta_path = saver.root / tag_for(10) / META
    meta = json.loads(meta_path.read_text())
    del meta[integrity.RECORD_KEY]
    meta_path.write_text(json.dumps(meta))
    loaded = resume(saver, Engine())
    assert [(note.kind, note.message) for note in loaded.notes] == [
        (NOTICE, f"note: {saver.root / tag_for(10)} records no checksums (saved before ayumi recorded them): loaded "
                 "without verifying its files")]

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, message):
            self.lines.append(message)

    log = Log()
    report(loaded.notes, log, 10, 100)
    assert log.lines == [loaded.notes[0].message]


def verdict_spike(step):
    from pretrain.stability.detector import Verdict

    return Verdict(step=step, kind="spike", reason="spike", loss=9.0, grad_norm=9.0, episode_start=step)


def monitor(ring_interval=0, **detector):
    return StabilityMonitor(StabilityConfig(detector=DetectorConfig(**detector),
                                            recovery=RecoveryConfig(rollback_steps=20, ring_interval=ring_interval)),
                            1.0, 1.0)


def run_checkpoints(saver, stability, ring_interval=0):
    return RunCheckpoints(saver, True, lambda: None, lambda obj: obj, ring_interval, stability, "fallback")


def test_a_rollback_past_a_damaged_ring_checkpoint_loads_the_newest_older_one_that_verifies(tmp_path):
    saver = saved_run(tmp_path, steps=(10, 40))
    checkpoints = run_checkpoints(saver, monitor(ring_interval=10), ring_interval=10)
    for step in (20, 30):
        checkpoints.save_ring(Engine(), step, {"train": {"step": step}}, {}, lambda ring: [])
    damage(checkpoints.ring.root / tag_for(30))
    engine = Engine()
    loaded = checkpoints.load(engine, 30)
    assert loaded.step == 20 and loaded.root == checkpoints.ring.root and engine.loads == [tag_for(20)]
    assert loaded.notes[0].fields["set_aside_as"] == str(checkpoints.ring.root / "step_0000030.corrupt")
    assert checkpoints.steps == [10, 20, 40], "the damaged one is no rollback target any more"


def test_keep_last_deletes_nothing_while_a_stop_would_blame_the_resumed_checkpoint(tmp_path):
    saver = saved_run(tmp_path, steps=(10, 20), keep=2)
    stability = monitor(ring_interval=10, sustained_window=10)
    checkpoints = run_checkpoints(saver, stability, ring_interval=10)
    loaded = resume(saver, Engine())
    checkpoints.note_resume(loaded)
    checkpoints.save(Engine(), 25, {}, {})  # 5 steps after the resume: the way back is kept
    assert complete_tags(saver.root) == [tag_for(10), tag_for(20), tag_for(25)]
    checkpoints.save(Engine(), 30, {}, {})  # 10 steps after it: keep_last again
    assert complete_tags(saver.root) == [tag_for(25), tag_for(30)]


@pytest.mark.parametrize("ring_interval, kept", [(0, [10, 40]), (10, [40])])
def test_without_a_ring_keep_last_keeps_the_checkpoint_a_rollback_would_need(tmp_path, ring_interval, kept):
    """keep_last=1, rollback_steps=20: without a ring the one checkpoint a spike now would roll back to stays (the
    newest at least 20 steps back when it was last needed: 10); with a ring, the ring keeps rollback targets."""
    saver = saved_run(tmp_path, steps=(), keep=1)
    stability = monitor(ring_interval=ring_interval)
    checkpoints = run_checkpoints(saver, stability, ring_interval=ring_interval)
    for step in (10, 20, 30, 40):
        checkpoints.save(Engine(), step, {}, {})
    assert complete_tags(saver.root) == [tag_for(step) for step in kept]
    if not ring_interval:
        assert stability.policy.decide(verdict_spike(40), 40, checkpoints.steps).to_step == 10


def test_a_stop_right_after_a_resume_keeps_nothing_of_that_state_and_blames_the_checkpoint(tmp_path):
    saver = saved_run(tmp_path, steps=(10, 20), keep=2)
    stability = monitor(sustained_window=10)
    checkpoints = run_checkpoints(saver, stability)
    loaded = resume(saver, Engine())
    checkpoints.note_resume(loaded)
    checkpoints.save(Engine(), 22, {}, {})  # an interval save from the suspect state
    message = stability.policy.stop_message(23, "spike at 23", "stability.action=stop: stopping at the first spike.")
    assert f"this began 4 step(s) after resuming from {saver.root / tag_for(20)}: that checkpoint is the likely cause" \
        in message
    assert f"  - check it (`ayumi checkpoint verify {saver.root / tag_for(20)}`) and resume from an earlier" in message
    assert checkpoints.discard_if_blamed(24)
    assert complete_tags(saver.root) == [tag_for(10), tag_for(20)]
    assert (saver.root / LATEST).read_text().strip() == tag_for(20)
    assert not checkpoints.discard_if_blamed(31), "11 steps on, the stop is the data's or the settings' doing"
    assert "likely cause" in stability.policy.stop_message(29, "spike", "stop.")  # the 10th step after it
    assert "likely cause" not in stability.policy.stop_message(30, "spike", "stop.")
    stability.rewound(10)
    assert not stability.policy.blames_checkpoint(21), "a rollback replaced the resumed state"
