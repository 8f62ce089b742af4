"""How a resume sorts each difference from the run's record (pretrain/startup/resume.py), decided from a
checkpoint's ayumi.json and the run's config history alone: no rank, no torch."""
from __future__ import annotations

import json

import pytest

from pretrain.config import ConfigError
from pretrain.startup.record import ConfigVersion, commit, resolved_config
from pretrain.startup.resume import data_identity, settle
from tests.helpers import tiny_overrides

STEP = 40


@pytest.fixture
def run(corpus, tmp_path):
    """A cpu_tiny run (WSD, 128 steps) recorded as started with `started` overrides and saved at step 40."""
    started = [*tiny_overrides(corpus, tmp_path / "runs"), "optim.schedule=wsd", "train.eval_interval=7",
               "train.max_steps=40", "stability.inject.nan_loss_steps=[3]"]
    cfg = settle(started).cfg
    resolved = resolved_config(cfg)
    commit(cfg.run_dir, ConfigVersion(0, resolved, started), "{}\n")
    tag = tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "step_0000040"
    tag.mkdir(parents=True)
    (tag / "ayumi.json").write_text(json.dumps({"step": STEP, "config": resolved, "lengths": [[0, 128, False]],
                                                "started_stages": 0, "data": data_identity(corpus)}))
    return tiny_overrides(corpus, tmp_path / "runs")


def test_left_out_overrides_are_the_run_s_own_but_a_session_s_are_not(run):
    settled = settle(run)
    assert settled.cfg.optim.schedule == "wsd" and settled.cfg.train.eval_interval == 7
    assert settled.resume.taken == ["optim.schedule=wsd", "train.eval_interval=7"]
    assert settled.cfg.train.max_steps == 0 and settled.cfg.stability.inject.nan_loss_steps == []
    assert settled.resume.changes == []  # the session's own overrides are not changes of the run


def test_each_difference_is_sorted(run):
    settled = settle([*run, "logging.console_interval=5", "checkpoint.keep_last=5", "parallel.tensor=1",
                      "eval.downstream.interval=9"])
    kinds = {change.key: change.kind for change in settled.resume.changes}
    assert kinds == {"logging.console_interval": "harmless", "checkpoint.keep_last": "future",
                     "eval.downstream.interval": "harmless"}  # parallel.tensor=1 is the run's value: no change
    lines = settled.resume.lines()
    assert any("accepted, applies from this step on: checkpoint.keep_last: 2 -> 5" in line for line in lines)


@pytest.mark.parametrize("edit, said", [
    ("train.seed=7", "train.seed was 1234, now 7: the trained steps would no longer be what the config says"),
    ("deepspeed=zero2", "deepspeed.zero_stage was 0, now 2: the checkpoint's optimizer state is laid out for its ZeRO "
                        "stage"),
    ("optim.warmup_steps=20", "optim.warmup_steps was 10, now 20: the LR of trained step 1 would change"),
    ("train.global_batch_size=16", "train.global_batch_size was 8, now 16"),
])
def test_the_past_is_refused_in_one_line(run, edit, said):
    with pytest.raises(ConfigError) as refused:
        settle([*run, edit])
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 and said in lines[0] and "Fix: restore" in lines[0], lines


def test_a_change_of_the_lr_ahead_needs_an_acknowledgement(run):
    """In WSD's stable phase a longer decay leaves every trained step's LR as it was: it changes only the future."""
    with pytest.raises(ConfigError, match=r"optim.wsd_decay_fraction: 0.2 -> 0.3 changes the LR or the data stream "
                                          r"from step 41 on. Fix: add resume.accept=\[optim.wsd_decay_fraction\]"):
        settle([*run, "optim.wsd_decay_fraction=0.3"])
    settled = settle([*run, "optim.wsd_decay_fraction=0.3", "resume.accept=[optim]"])
    assert [(c.key, c.kind) for c in settled.resume.changes] == [("optim.wsd_decay_fraction", "ack")]


def test_data_changed_under_the_run_at_the_same_path_is_refused(run, corpus, tmp_path):
    """The checkpoint records what each domain's training split held; the root at the same path now holds other
    shards for `ja` (prepared again, say): the resume is refused before launch, naming the domain."""
    meta_path = tmp_path / "runs" / "cpu_tiny" / "checkpoints" / "step_0000040" / "ayumi.json"
    meta = json.loads(meta_path.read_text())
    assert set(meta["data"]) == {"ja", "en"} and settle(run).resume.changes == []
    meta["data"]["ja"] = "0" * 16  # what the run trained on is not what the root holds now
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError) as refused:
        settle(run)
    assert str(refused.value).startswith(f"resume of {tmp_path / 'runs' / 'cpu_tiny'} at step 40: data.root's domain "
                                         f"'ja' was the shards trained on, now other shards: its training data in {corpus} changed")
