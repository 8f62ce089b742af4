"""FaultInjector: off by default, fires once per step unless replay, survives restarts."""
import numpy as np

from pretrain.stability.config import InjectConfig
from pretrain.stability.inject import FaultInjector


def run(injector, steps):
    fired = {}
    for step in steps:
        if faults := injector.faults_at(step):
            fired[step] = faults
        injector.step_done(step)
    return fired


def test_off_by_default():
    injector = FaultInjector(InjectConfig())
    assert not injector.active
    assert run(injector, range(1000)) == {}
    assert injector.lr_multiplier(5) == 1.0


def test_faults_fire_at_their_steps():
    cfg = InjectConfig(lr_multiply={300: 50.0, 301: 50.0}, random_batch_steps=[250], nan_loss_steps=[120],
                       fp16_overflow_steps=[7])
    injector = FaultInjector(cfg)
    assert injector.active
    assert run(injector, range(400)) == {7: ["fp16 overflow"], 120: ["NaN loss"], 250: ["random batch"],
                                         300: ["lr x50"], 301: ["lr x50"]}


def test_a_replay_after_rollback_runs_clean_unless_replay_is_set():
    cfg = InjectConfig(lr_multiply={300: 50.0}, nan_loss_steps=[310])
    once = FaultInjector(cfg)
    run(once, range(0, 320))
    assert run(once, range(200, 400)) == {}  # rolled back to 200 and replayed
    again = FaultInjector(InjectConfig(lr_multiply={300: 50.0}, replay=True))
    run(again, range(0, 320))
    assert run(again, range(200, 400)) == {300: ["lr x50"]}


def test_a_restarted_job_does_not_reinject():
    injector = FaultInjector(InjectConfig(nan_loss_steps=[120]))
    run(injector, range(150))
    restarted = FaultInjector(InjectConfig(nan_loss_steps=[120]))
    restarted.load_state_dict(injector.state_dict())
    assert not restarted.should_nan_loss(120)


def test_random_tokens_are_reproducible_per_step_and_rank():
    injector = FaultInjector(InjectConfig(seed=3))
    a = injector.random_tokens((4, 65), 512, step=250, rank=0)
    assert a.dtype == np.int64 and a.shape == (4, 65) and 0 <= a.min() and a.max() < 512
    assert np.array_equal(a, injector.random_tokens((4, 65), 512, step=250, rank=0))
    assert not np.array_equal(a, injector.random_tokens((4, 65), 512, step=250, rank=1))


def test_the_announcement_names_steps_as_the_console_counts_them():
    """Config keys are 0-based indices; the start-up line speaks the console's 1-based steps."""
    injector = FaultInjector(InjectConfig(lr_multiply={600: 50.0, 601: 50.0}, nan_loss_steps=[120]))
    assert injector.describe() == ("LR x50 at step(s) 601, 602; NaN loss at step(s) 121, "
                                   "each firing once (a replay after a rollback runs clean)")
