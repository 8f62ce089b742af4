"""Recovery policy: what to do about a detector verdict or a loss-scale watchdog alarm.

Escalation (stability.action = recover, the default):

    ok                  -> none
    nonfinite / outlier -> skip_update (the weights and Adam's moments stay as they were)
    spike               -> rollback to the newest good checkpoint >= rollback_steps before the
                           spike began, skip skip_batches of data past it, cool the LR, reset the
                           fp16 loss scale, optionally change Adam eps / beta1 from then on;
                           a spike within recovery_window_steps of an earlier recovery also lowers
                           the LR for good (lr_repeat_factor)
    spike, but max_recoveries already within recovery_window_steps
                        -> stop, with a message saying what was tried and what to change

Other actions: `skip` (skip updates only; stop once an episode skipped max_skips_per_episode),
`stop` (stop at the first spike), `log_only` (record events, never act). With `enabled=false`
or `log_only`, non-finite steps are still skipped when skip_nonfinite_loss is set: applying a
NaN update loses the model.

The policy is a plain object with `state_dict`: events, recoveries, the steps flagged as bad
(never rollback targets), the cool-down window and the optimizer overrides survive a restart.
It decides only; the trainer acts, after all ranks fed the detector the same numbers.

Right after a resume the checkpoint is the likeliest cause of a divergence (`note_resume`,
`blames_checkpoint`): a stop then says so, and the checkpoints keep nothing of the state
(pretrain/checkpoint/ring.py asks `protected_checkpoints` before keep_last deletes any).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Container, Iterable, Mapping

from pretrain.stability.config import StabilityConfig
from pretrain.stability.detector import Verdict

ACTION_KINDS = ("none", "skip_update", "rollback", "stop")
MAX_EVENTS = 1000  # events kept in the state (and so in checkpoints); older ones are counted, not kept


@dataclass(frozen=True)
class Action:
    """What the trainer should do at this step."""

    kind: str = "none"
    """none | skip_update | rollback | stop."""
    reason: str = ""
    """Why (the detector's or watchdog's reason)."""
    to_step: int | None = None
    """rollback: the checkpoint step to load."""
    skip_batches: int = 0
    """rollback: global batches to skip past that checkpoint's data position."""
    lr_factor: float = 1.0
    """rollback: LR multiplier at the start of the cool-down (see RecoveryPolicy.lr_factor_at)."""
    cooldown_steps: int = 0
    """rollback: length of the LR cool-down."""
    reset_loss_scale: float | None = None
    """rollback: fp16 loss scale to set after loading (None: leave it)."""
    new_eps: float | None = None
    """rollback: Adam epsilon to set after loading (None: leave it)."""
    new_beta1: float | None = None
    """rollback: Adam beta1 to set after loading (None: leave it)."""
    message: str = ""
    """stop: what was tried and what to change; rollback: a note when the target is closer than asked."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NONE = Action()


@dataclass(frozen=True)
class RollbackChoice:
    """The rollback target (None: there is none) and a note when it is not the ideal one."""

    step: int | None
    note: str = ""


class StepRanges:
    """Closed step ranges (merged), e.g. the steps flagged during outlier episodes; `k in ranges`."""

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        self._ranges: list[list[int]] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        start, end = min(start, end), max(start, end)
        merged = [start, end]
        kept = []
        for lo, hi in self._ranges:
            if hi + 1 < merged[0] or lo - 1 > merged[1]:
                kept.append([lo, hi])
            else:
                merged = [min(lo, merged[0]), max(hi, merged[1])]
        self._ranges = sorted(kept + [merged])

    def __contains__(self, step: object) -> bool:
        return isinstance(step, int) and any(lo <= step <= hi for lo, hi in self._ranges)

    def to_list(self) -> list[list[int]]:
        return [list(r) for r in self._ranges]


def choose_rollback_checkpoint(checkpoints: Iterable[int], spike_start: int, rollback_steps: int,
                               bad_steps: Container[int] = ()) -> RollbackChoice:
    """The newest good checkpoint <= spike_start - rollback_steps.

    Good: taken before the spike began and not during an earlier outlier episode (`bad_steps`).
    Checkpoint k holds the weights step k runs on, so k = spike_start is already suspect. If no
    good checkpoint lies far enough back, the oldest good one is used with a note; if there is
    no good checkpoint at all, step is None (the caller stops).
    """
    good = sorted(k for k in set(checkpoints) if k < spike_start and k not in bad_steps)
    if not good:
        listed = ", ".join(map(str, sorted(set(checkpoints)))) or "none"
        return RollbackChoice(None, f"no checkpoint before step {spike_start} outside a spike "
                                    f"(available: {listed})")
    eligible = [k for k in good if k <= spike_start - rollback_steps]
    if eligible:
        return RollbackChoice(eligible[-1])
    oldest = good[0]
    return RollbackChoice(oldest, f"no good checkpoint >= {rollback_steps} steps before the spike at step "
                                  f"{spike_start}; using step {oldest}, {spike_start - oldest} steps before it")


def ring_checkpoints_to_delete(ring: Iterable[int], keep: int, current_step: int, rollback_steps: int,
                               bad_steps: Container[int] = (), low_point: int | None = None) -> list[int]:
    """Recovery-ring checkpoints to delete after saving one at current_step.

    Kept: the `keep` newest good ones, plus the newest good one <= current_step - rollback_steps
    (the rollback target if a spike began now), so a rollback that far back stays possible
    whatever the interval, plus the newest good one <= low_point (the detector's lowest loss baseline:
    a divergence rolls back before its climb, which may have begun long before). Checkpoints taken
    during an outlier episode are deleted: they are never rollback targets. The newest good checkpoint
    is never deleted (keep >= 1).
    """
    ring = sorted(set(ring))
    good = [k for k in ring if k not in bad_steps]
    kept = set(good[-max(1, keep):])
    reachable = [k for k in good if k <= current_step - rollback_steps]
    if reachable:
        kept.add(reachable[-1])
    elif good:
        kept.add(good[0])  # nothing is far enough back yet: the oldest comes closest
    before_low = [k for k in good if low_point is not None and k <= low_point]
    if before_low:
        kept.add(before_low[-1])
    return [k for k in ring if k not in kept]


# Knobs the stop message suggests: (config key, "already stabilising?" test, advice). Evidence in docs/stability.md.
_KNOBS: list[tuple[str, Any, str]] = [
    ("optim.lr", lambda v: False, "lower the peak LR (optim.lr={v} -> {half}): OPT and the GENIAC run had to"),
    ("optim.warmup_steps", lambda v: False, "lengthen the LR warmup (optim.warmup_steps={v}; keep it <= ~10% of the run)"),
    ("stability.clip.enabled", lambda v: bool(v), "clip at the p90 of recent grad norms (stability.clip.enabled=true)"),
    ("optim.eps", lambda v: v is not None and v <= 1e-10,
     "lower Adam's epsilon (optim.eps={v}, or stability.recovery.adam_eps; Molybog et al.)"),
    ("model.embedding_grad_alpha", lambda v: v is not None and v < 1.0,
     "shrink the embedding gradient (model.embedding_grad_alpha=0.1, GLM-130B)"),
    ("model.z_loss", lambda v: bool(v), "add the z-loss (model.z_loss=1e-4, PaLM)"),
    ("model.qk_norm", lambda v: bool(v), "normalise queries and keys (model.qk_norm=true)"),
]


class RecoveryPolicy:
    """Turns verdicts and watchdog alarms into actions; remembers recoveries across restarts."""

    def __init__(self, cfg: StabilityConfig, knobs: Mapping[str, Any] | None = None):
        """knobs: current values of the keys in the stop message's advice (e.g. {"optim.lr": 3e-4}),
        so it names only what is not yet set; None gives the generic advice."""
        self.cfg = cfg
        self.knobs = dict(knobs or {})
        self.events: list[dict[str, Any]] = []
        self.dropped_events = 0
        self.recoveries: list[dict[str, Any]] = []
        self.bad_steps = StepRanges()
        self.skipped_updates = 0
        self.cooldown: tuple[int, int] | None = None  # [start, end) after the latest rollback
        self.lasting_lr_factor = 1.0  # lowered by lr_repeat_factor at each repeated spike, for the rest of the run
        self.overrides_active = False  # adam_eps / adam_beta1 apply from the first recovery on
        self._new_events = 0
        self._logged_episode: int | None = None  # log_only: one spike event per episode
        self._skip_episode: tuple[int, int] | None = None  # action=skip: (episode start, skips)
        self.resumed: tuple[int, str] | None = None  # (step, checkpoint) this session resumed from; never saved

    # -- decisions -------------------------------------------------------------------------------
    def decide(self, verdict: Verdict, step: int, checkpoints: Iterable[int],
               spike_start_step: int | None = None) -> Action:
        """The action for `verdict` at `step`. checkpoints: steps of the complete checkpoints
        (recovery ring and long-term) a rollback may load. spike_start_step defaults to the
        verdict's episode start."""
        if verdict.kind == "ok":
            return NONE
        start = spike_start_step if spike_start_step is not None else (verdict.episode_start or step)
        self.bad_steps.add(start, step)
        if not self.cfg.enabled or self.cfg.action == "log_only":
            return self._observe_only(verdict, step, start)
        if verdict.kind in ("nonfinite", "outlier"):
            return self._skip(step, verdict.reason)
        self._event("spike", step, verdict.reason, spike_start=start, loss=_finite(verdict.loss),
                    grad_norm=_finite(verdict.grad_norm), score=_finite(verdict.score))
        if self.cfg.action == "skip":
            return self._skip_in_episode(step, start, verdict.reason)
        if self.cfg.action == "stop":
            return self._stop(step, verdict.reason, "stability.action=stop: stopping at the first spike.")
        return self._recover(step, start, checkpoints, verdict.reason, lasting=verdict.divergence)

    def on_watchdog_rollback(self, step: int, checkpoints: Iterable[int], reason: str,
                             overflow_start: int | None = None) -> Action:
        """The loss-scale watchdog gave up resetting: roll back (or stop) like for a spike."""
        start = overflow_start if overflow_start is not None else step
        self.bad_steps.add(start, step)
        self._event("loss_scale_alarm", step, reason, spike_start=start)
        if not self.cfg.enabled or self.cfg.action in ("log_only", "skip"):
            return NONE  # DeepSpeed already skips overflow steps
        if self.cfg.action == "stop":
            return self._stop(step, reason, "stability.action=stop: stopping at the first alarm.")
        return self._recover(step, start, checkpoints, reason)

    def _observe_only(self, verdict: Verdict, step: int, start: int) -> Action:
        if verdict.kind == "spike" and self._logged_episode != start:
            self._logged_episode = start
            self._event("spike", step, verdict.reason + " (not acted on: log_only/disabled)", spike_start=start)
        if verdict.kind == "nonfinite" and self.cfg.skip_nonfinite_loss:
            return self._skip(step, verdict.reason)
        return NONE

    def _skip(self, step: int, reason: str) -> Action:
        self.skipped_updates += 1
        self._event("skip_update", step, reason)
        return Action("skip_update", reason=reason)

    def _skip_in_episode(self, step: int, start: int, reason: str) -> Action:
        episode, skips = self._skip_episode if self._skip_episode and self._skip_episode[0] == start else (start, 0)
        limit = self.cfg.recovery.max_skips_per_episode
        if skips >= limit:
            return self._stop(step, reason, f"stability.action=skip skipped {skips} updates since step {start} and "
                                            "the spike persists: skipping alone cannot repair the weights.")
        self._skip_episode = (episode, skips + 1)
        return self._skip(step, reason)

    def _recover(self, step: int, start: int, checkpoints: Iterable[int], reason: str, lasting: bool = False) -> Action:
        """Roll back, or stop once max_recoveries are spent. lasting: lower the LR for good even if this is the first
        spike (a divergence: a slow climb is the LR's doing, never one batch's)."""
        rec = self.cfg.recovery
        recent = self._recent_recoveries(step)
        if len(recent) >= rec.max_recoveries:
            return self._stop(step, reason, f"{len(recent)} recoveries within {rec.recovery_window_steps} steps "
                                            "did not stop the spikes.")
        choice = choose_rollback_checkpoint(checkpoints, start, rec.rollback_steps, self.bad_steps)
        if choice.step is None:
            return self._stop(step, reason, f"cannot roll back: {choice.note}.")
        if recent or lasting:  # the spike came back, or the loss climbed: lower the LR for good, not only for the cool-down
            self.lasting_lr_factor *= rec.lr_repeat_factor
        action = Action(
            "rollback", reason=reason, to_step=choice.step, skip_batches=rec.skip_batches,
            lr_factor=rec.lr_cooldown_factor, cooldown_steps=rec.lr_cooldown_steps if rec.lr_cooldown_factor < 1 else 0,
            reset_loss_scale=float(2 ** rec.loss_scale_reset_power) if rec.reset_loss_scale else None,
            new_eps=rec.adam_eps, new_beta1=rec.adam_beta1, message=choice.note,
        )
        self.recoveries.append({"step": step, "spike_start": start, "to_step": choice.step,
                                "skip_batches": rec.skip_batches, "reason": reason})
        if action.cooldown_steps:
            self.cooldown = (choice.step, choice.step + action.cooldown_steps)
        self.overrides_active = self.overrides_active or rec.adam_eps is not None or rec.adam_beta1 is not None
        self._event("rollback", step, self.describe(action), **{k: v for k, v in action.to_dict().items()
                                                                 if k not in ("kind", "reason", "message")})
        return action

    def _recent_recoveries(self, step: int) -> list[dict[str, Any]]:
        # Distance, not order: after a rollback the step counter replays lower steps, and a spike
        # there is a repeat of the one that caused the rollback.
        window = self.cfg.recovery.recovery_window_steps
        return [r for r in self.recoveries if abs(r["step"] - step) <= window]

    def _stop(self, step: int, reason: str, headline: str) -> Action:
        message = self.stop_message(step, reason, headline)
        self._event("stop", step, message)
        return Action("stop", reason=reason, message=message)

    # -- messages --------------------------------------------------------------------------------
    def describe(self, action: Action) -> str:
        """One line for the console and events.jsonl."""
        if action.kind != "rollback":
            return f"{action.kind}: {action.reason}"
        parts = [f"roll back to step {action.to_step}", f"skip {action.skip_batches} batches"]
        if action.cooldown_steps:
            parts.append(f"LR x{action.lr_factor:g} for {action.cooldown_steps} steps "
                         f"({self.cfg.recovery.lr_cooldown_shape})")
        if self.lasting_lr_factor < 1:
            parts.append(f"LR x{self.lasting_lr_factor:g} from then on (a repeated spike or a divergence)")
        if action.reset_loss_scale is not None:
            parts.append(f"fp16 loss scale -> {action.reset_loss_scale:g}")
        if action.new_eps is not None:
            parts.append(f"Adam eps -> {action.new_eps:g}")
        if action.new_beta1 is not None:
            parts.append(f"Adam beta1 -> {action.new_beta1:g}")
        text = "; ".join(parts) + f" (because: {action.reason})"
        return text + (f"; note: {action.message}" if action.message else "")

    def stop_message(self, step: int, reason: str, headline: str) -> str:
        """What happened, what was tried, and which knobs to change (docs/stability.md). Right after a resume
        (blames_checkpoint) it names the checkpoint as the likely cause and what to do about it first."""
        lines = [f"stopping at step {step}: {reason}", headline]
        blamed = self.blames_checkpoint(step)
        if blamed:
            at, checkpoint = self.resumed
            lines.append(f"this began {step - at + 1} step(s) after resuming from {checkpoint}: that checkpoint is the "
                         "likely cause, not the data or the settings. Nothing was saved from this state and `latest` "
                         "still names that checkpoint")
        if self.recoveries:
            lines.append("recoveries tried:")
            lines += [f"  - spike at step {r['step']} (began {r['spike_start']}): rolled back to step "
                      f"{r['to_step']}, skipped {r['skip_batches']} batches" for r in self.recoveries]
            lines.append(f"  each with: {self._recovery_settings()}")
        lines.append("what to do, then resume:" if blamed else "what to change, then resume (the run's state is saved):")
        if blamed:
            lines.append(f"  - check it (`ayumi checkpoint verify {self.resumed[1]}`) and resume from an earlier "
                         "checkpoint (checkpoint.load_from=<an earlier step folder>); if that diverges too:")
        lines += [f"  - {advice}" for advice in self._advice()]
        lines.append("  see docs/stability.md for the evidence behind each knob")
        return "\n".join(lines)

    def _recovery_settings(self) -> str:
        rec = self.cfg.recovery
        parts = [f"rollback >= {rec.rollback_steps} steps", f"skip {rec.skip_batches} batches"]
        if rec.lr_cooldown_factor < 1:
            parts.append(f"LR x{rec.lr_cooldown_factor:g} for {rec.lr_cooldown_steps} steps")
        if self.lasting_lr_factor < 1:
            parts.append(f"LR now x{self.lasting_lr_factor:g} for good (x{rec.lr_repeat_factor:g} a repeated spike)")
        if rec.reset_loss_scale:
            parts.append(f"fp16 loss scale reset to 2^{rec.loss_scale_reset_power}")
        if rec.adam_eps is not None:
            parts.append(f"Adam eps {rec.adam_eps:g}")
        if rec.adam_beta1 is not None:
            parts.append(f"Adam beta1 {rec.adam_beta1:g}")
        return ", ".join(parts)

    def _advice(self) -> list[str]:
        advice = []
        for key, already, text in _KNOBS:
            value = self.knobs.get(key)
            if key in self.knobs and already(value):
                continue
            half = f"{value / 2:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "half"
            advice.append(text.format(v=value if key in self.knobs else "?", half=half))
        rec = self.cfg.recovery
        advice.append(f"roll back further / skip more data (stability.recovery.rollback_steps={rec.rollback_steps}, "
                      f"skip_batches={rec.skip_batches}) or cool the LR longer (lr_cooldown_steps={rec.lr_cooldown_steps})")
        return advice

    # -- what the trainer applies every step -----------------------------------------------------
    def lr_factor_at(self, step: int) -> float:
        """LR multiplier at `step`: the lasting factor (1 until a spike repeats) times the cool-down's.

        Outside the cool-down that follows the latest rollback the cool-down's factor is 1.

        Inside [start, start + cooldown_steps): `linear` ramps from lr_cooldown_factor back to 1
        (no sudden LR jump when it ends), `constant` holds lr_cooldown_factor and returns to 1 at
        the end. It multiplies the schedule's LR (lr_at(step) x lr_factor_at(step)).
        """
        return self.lasting_lr_factor * self._cooldown_factor_at(step)

    def _cooldown_factor_at(self, step: int) -> float:
        if self.cooldown is None:
            return 1.0
        start, end = self.cooldown
        if not start <= step < end:
            return 1.0
        factor = self.cfg.recovery.lr_cooldown_factor
        if self.cfg.recovery.lr_cooldown_shape == "constant":
            return factor
        return factor + (1.0 - factor) * (step - start) / (end - start)

    def optimizer_overrides(self) -> dict[str, float]:
        """Adam settings to (re)apply after any load, once a recovery has switched them on:
        {"eps": ..., "beta1": ...} (only the configured ones; empty before the first recovery)."""
        if not self.overrides_active:
            return {}
        rec = self.cfg.recovery
        out = {}
        if rec.adam_eps is not None:
            out["eps"] = rec.adam_eps
        if rec.adam_beta1 is not None:
            out["beta1"] = rec.adam_beta1
        return out

    # -- right after a resume ------------------------------------------------------------------------
    def note_resume(self, step: int, checkpoint: str) -> None:
        """This session resumed at `step` from `checkpoint` (not saved: the next session has its own)."""
        self.resumed = (step, checkpoint)

    def blames_checkpoint(self, step: int) -> bool:
        """Whether a stop at `step` (0-based) blames the checkpoint resumed from: within detector.sustained_window
        steps of it, and no rollback since (a rollback replaced that state). A state that cannot be trained from
        shows from the first step after the resume (non-finite gradients at once; a spike that begins there is
        confirmed within the window); a run that trained longer from it had a sound start."""
        return self.resumed is not None and 0 <= step - self.resumed[0] < self.cfg.detector.sustained_window

    def protected_checkpoints(self, step: int, steps: Iterable[int], ring: bool) -> set[int]:
        """Checkpoints keep_last must not delete after a save at `step` (steps done): all of them while a stop in a
        step still to come would blame the checkpoint resumed from (it may be bad: the older ones are the way back),
        and, when no recovery ring keeps rollback targets, the one a rollback would need if a spike began now."""
        steps = sorted(set(steps))
        if self.blames_checkpoint(step):
            return set(steps)
        if ring or not self.cfg.enabled or self.cfg.action != "recover":
            return set()
        target = choose_rollback_checkpoint(steps, step, self.cfg.recovery.rollback_steps, self.bad_steps).step
        return set() if target is None else {target}

    def is_bad_checkpoint(self, step: int) -> bool:
        """True when checkpoint `step` was taken during an outlier episode (never a rollback target)."""
        return step in self.bad_steps

    # -- events ----------------------------------------------------------------------------------
    def record_event(self, kind: str, step: int, message: str, **data: Any) -> dict[str, Any]:
        """Add an event from outside the policy (e.g. a watchdog loss-scale reset, an injected fault)."""
        return self._event(kind, step, message, **data)

    def _event(self, kind: str, step: int, message: str, **data: Any) -> dict[str, Any]:
        event = {"event": kind, "step": step, "message": message, **data}
        self.events.append(event)
        self._new_events += 1
        if len(self.events) > MAX_EVENTS:
            self.dropped_events += len(self.events) - MAX_EVENTS
            del self.events[:len(self.events) - MAX_EVENTS]
        return event

    def new_events(self) -> list[dict[str, Any]]:
        """Events since the last call: the trainer writes them to events.jsonl, W&B and the console."""
        count = min(self._new_events, len(self.events))
        self._new_events = 0
        return [dict(e) for e in self.events[len(self.events) - count:]] if count else []

    def metrics(self, step: int) -> dict[str, float]:
        """`stability/*` counters and the cool-down factor at `step`, for every log step."""
        return {"stability/recoveries": float(len(self.recoveries)),
                "stability/skipped_updates": float(self.skipped_updates),
                "stability/lr_factor": self.lr_factor_at(step)}

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: events, recoveries, bad steps, cool-down, overrides, counters."""
        return {
            "events": [dict(e) for e in self.events],
            "dropped_events": self.dropped_events,
            "recoveries": [dict(r) for r in self.recoveries],
            "bad_steps": self.bad_steps.to_list(),
            "skipped_updates": self.skipped_updates,
            "cooldown": list(self.cooldown) if self.cooldown else None,
            "lasting_lr_factor": self.lasting_lr_factor,
            "overrides_active": self.overrides_active,
            "logged_episode": self._logged_episode,
            "skip_episode": list(self._skip_episode) if self._skip_episode else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.events = [dict(e) for e in state["events"]]
        self.dropped_events = int(state["dropped_events"])
        self.recoveries = [dict(r) for r in state["recoveries"]]
        self.bad_steps = StepRanges(state["bad_steps"])
        self.skipped_updates = int(state["skipped_updates"])
        self.cooldown = tuple(state["cooldown"]) if state["cooldown"] else None
        self.lasting_lr_factor = float(state.get("lasting_lr_factor", 1.0))  # absent before repeated spikes lowered it
        self.overrides_active = bool(state["overrides_active"])
        self._logged_episode = state["logged_episode"]
        self._skip_episode = tuple(state["skip_episode"]) if state["skip_episode"] else None
        self._new_events = 0  # restored events were already written by the run that made them


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: store them as None."""
    return value if value is not None and math.isfinite(value) else None
