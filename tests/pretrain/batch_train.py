"""TEST-ONLY entry: pretrain.train, with every token id the model is given in a training step written down.

Each rank writes RUN_DIR/seen_tokens_rank<R>.json: {step (1-based): [[input ids + the last label] per row] per
micro batch}, the step as the progress line counts it. A step trained again (after a rollback, or a resume from an
older checkpoint) is overwritten, so the file holds the run's present timeline, which `ayumi batch` must
reconstruct. Validation forwards are left out (only the training step's own are recorded).
"""
import json
from pathlib import Path

import pretrain.train as train

_build = train.build_trainer


def build_recording(cfg, dist, resolved, watchdog=None, settled=None):
    trainer, logger = _build(cfg, dist, resolved, watchdog, settled)
    path = Path(cfg.run_dir) / f"seen_tokens_rank{dist.dp_rank}.json"
    seen = json.loads(path.read_text()) if path.is_file() else {}
    in_step = []
    forward, train_step = trainer.engine.forward, trainer.train_step

    def recording_forward(input_ids, labels):
        if in_step:
            rows = [ids + [last[-1]] for ids, last in zip(input_ids.tolist(), labels.tolist())]
            seen.setdefault(str(trainer.state.step + 1), []).append(rows)
        return forward(input_ids, labels)

    def recording_step():
        seen.pop(str(trainer.state.step + 1), None)  # trained again: the present timeline's batch replaces it
        in_step.append(True)
        try:
            return train_step()
        finally:
            in_step.clear()
            path.write_text(json.dumps(seen))

    trainer.engine.forward, trainer.train_step = recording_forward, recording_step
    return trainer, logger


train.build_trainer = build_recording

if __name__ == "__main__":
    train.exit_now(train.main())
