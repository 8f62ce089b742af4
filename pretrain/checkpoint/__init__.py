"""Checkpoints: what is saved, where, when it is complete, and how the run comes back from one.

- `checkpointer.py`: `Checkpointer` (save, load, keep_last, the `latest` pointer, a universal conversion when
  the job's size changed), tags and their folders, `resolve_checkpoint`, reading a checkpoint for export;
- `async_writer.py`: the background writer that lets training go on while a checkpoint is written;
- `ring.py`: the rollback ring, the frequent short-lived checkpoints that make a rollback always possible;
- `integrity.py`: every file's checksum, taken as it is written and recorded in `ayumi.json`, and the
  verification every load does first (no torch: `ayumi checkpoint verify` uses it alone);
- `layout.py`: the names in a checkpoint root (tags, `latest`, folders set aside as damaged), without torch;
- `paths.py`: where ayumi may write and delete under a checkpoint root (never through a link, never outside it) and
  the private folders conversions write into, without torch;
- `safety.py`: what each checkpoint file may hold (tensors and plain data, DeepSpeed's few objects) and a folder
  checked for anything else before any rank reads it, without torch (docs/checkpoints.md);
- `trust.py`: which checkpoint a resume or a rollback builds on: verified, its loaded state checked, a damaged
  one set aside for an older one or refused (`checkpoint.on_corrupt`), never silently the run's future.

May import: `pretrain.config`, `pretrain.model`, `pretrain.engine` (DeepSpeed's own save/load and formats),
`common`, `curriculum`. It never imports the trainer. `layout.py` imports no torch, nor does `integrity.py` but to
serialise a file it writes.
"""
