"""fp16 loss-scale watchdog: reset a collapsing loss scale before DeepSpeed hits its floor.

OPT-175B spent weeks with "gradient overflow errors / loss scale hitting the minimum threshold";
DeepSpeed raises when an overflow happens at min_loss_scale, and a tiny scale lets shallow-layer
gradients underflow (which feeds the Adam instability behind spikes). Each step the trainer
reports (loss scale, whether the update was applied); the watchdog answers:

- ``reset_scale(value)`` when the scale is within 2**floor_margin_power of the floor, or after
  max_consecutive_skips overflow-skipped steps in a row;
- ``rollback`` when overflows continue although max_resets resets were made within
  reset_window_steps: the weights, not the scale, are the problem (the policy then decides
  between rollback and stop, counting it as a recovery).

Pure: no DeepSpeed import; the trainer applies the reset (TrainEngine.reset_loss_scale) on every
rank. The reported scale and applied flag are identical on all ranks (the overflow check is
all-reduced inside DeepSpeed), so are the answers.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from pretrain.stability.config import WatchdogConfig


@dataclass(frozen=True)
class WatchdogAction:
    """The watchdog's answer for one step."""

    kind: str = "none"
    """none | reset_scale | rollback."""
    value: float | None = None
    """reset_scale: the loss scale to set."""
    reason: str = ""
    """Why, for events.jsonl and the console."""
    overflow_start: int | None = None
    """First step of the current run of overflow-skipped steps (rollback: where trouble began)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LossScaleWatchdog:
    """Tracks consecutive skipped steps and recent resets; see the module docstring."""

    def __init__(self, cfg: WatchdogConfig, min_loss_scale: float):
        self.cfg = cfg
        self.min_loss_scale = float(min_loss_scale)
        self.consecutive_skips = 0
        self.total_skips = 0
        self.skip_run_start: int | None = None
        self.resets: deque[int] = deque()  # steps of recent resets

    @property
    def reset_value(self) -> float:
        return float(2 ** self.cfg.reset_scale_power)

    @property
    def floor_margin(self) -> float:
        """A scale at or below this is close enough to the floor to reset."""
        return self.min_loss_scale * 2 ** self.cfg.floor_margin_power

    def observe(self, step: int, loss_scale: float | None, step_applied: bool) -> WatchdogAction:
        """Call after every optimizer step with the scale DeepSpeed holds after it."""
        if not self.cfg.enabled or loss_scale is None:
            return WatchdogAction()
        self._count(step, step_applied)
        trouble = self._trouble(loss_scale)
        if trouble is None:
            return WatchdogAction()
        self._forget_old_resets(step)
        if len(self.resets) >= self.cfg.max_resets:
            return WatchdogAction("rollback", reason=f"{trouble} after {len(self.resets)} loss-scale resets within "
                                                     f"{self.cfg.reset_window_steps} steps",
                                  overflow_start=self.skip_run_start if self.skip_run_start is not None else step)
        self.resets.append(step)
        # A fresh count: the reset scale gets max_consecutive_skips more steps to recover.
        self.consecutive_skips = 0
        return WatchdogAction("reset_scale", value=self.reset_value,
                              reason=f"{trouble}: resetting the loss scale to {self.reset_value:g}",
                              overflow_start=self.skip_run_start)

    def _count(self, step: int, applied: bool) -> None:
        if applied:
            self.consecutive_skips = 0
            self.skip_run_start = None
            return
        if self.consecutive_skips == 0 and self.skip_run_start is None:
            self.skip_run_start = step
        self.consecutive_skips += 1
        self.total_skips += 1

    def _trouble(self, loss_scale: float) -> str | None:
        """Why the scale needs a reset now, or None."""
        if loss_scale <= self.floor_margin:
            return (f"loss scale {loss_scale:g} is within 2^{self.cfg.floor_margin_power} of the floor "
                    f"{self.min_loss_scale:g}")
        if self.consecutive_skips >= self.cfg.max_consecutive_skips:
            return f"{self.consecutive_skips} overflow-skipped steps in a row"
        return None

    def _forget_old_resets(self, step: int) -> None:
        # abs(): after a rollback the step counter replays lower steps.
        self.resets = deque(s for s in self.resets if abs(step - s) < self.cfg.reset_window_steps)

    def rewind(self) -> None:
        """After a rollback: the restored weights deserve a fresh start (resets are forgotten;
        the policy counts the rollback itself toward max_recoveries)."""
        self.consecutive_skips = 0
        self.skip_run_start = None
        self.resets.clear()

    def metrics(self) -> dict[str, float]:
        """`stability/*` metrics (the scale itself is `opt/loss_scale`, logged by the trainer)."""
        return {"stability/consecutive_skips": float(self.consecutive_skips),
                "stability/loss_scale_resets": float(len(self.resets))}

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive_skips": self.consecutive_skips, "total_skips": self.total_skips,
                "skip_run_start": self.skip_run_start, "resets": list(self.resets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.total_skips = int(state["total_skips"])
        self.skip_run_start = state["skip_run_start"]
        self.resets = deque(int(s) for s in state["resets"])
