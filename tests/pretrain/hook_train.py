"""TEST-ONLY entry: pretrain.train with one more step hook, which records every call it gets.

The hook is appended to the trainer `pretrain.train.build_trainer` returns (where a concern such as
downstream evaluation will plug in); each rank writes what it saw to RUN_DIR/hook_calls_rank<R>.json
and adds `test/hook_calls` to the step's metrics.
"""
import json
from pathlib import Path

import pretrain.train as train
from pretrain.hooks import StepHook, StepReport


class RecordingHook(StepHook):
    def __init__(self, path: Path):
        self.path = path
        self.calls: list[list] = []

    def before_update(self, index: int) -> None:
        self.calls.append(["before_update", index])

    def after_step(self, report: StepReport) -> None:
        self.calls.append(["after_step", report.index, report.step, report.tokens, report.applied])
        report.metrics["test/hook_calls"] = len(self.calls)
        self.path.write_text(json.dumps(self.calls))


_build = train.build_trainer


def build_with_hook(cfg, dist, resolved, watchdog=None, settled=None):
    trainer, logger = _build(cfg, dist, resolved, watchdog, settled)
    trainer.hooks.append(RecordingHook(Path(cfg.run_dir) / f"hook_calls_rank{dist.rank}.json"))
    return trainer, logger


train.build_trainer = build_with_hook

if __name__ == "__main__":
    train.exit_now(train.main())
