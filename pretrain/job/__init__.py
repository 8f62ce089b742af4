"""The job around the training loop: how it is stopped, watched and kept to itself.

- `signals.py`: SIGTERM/SIGINT and a dead launcher become a clean stop (save, exit 0);
- `hang_watchdog.py`: heartbeats, a stuck rank ends the job with a report (exit 4), straggler verdicts;
- `launcher_watch.py`: notices when the process that started this rank is gone;
- `run_lock.py`: one job per run dir;
- `exit_status.py`: the status the ranks chose, handed to `ayumi train` past the launcher (which reports 1).

May import: `pretrain.ranges` and the standard library; nothing here imports torch's training or DeepSpeed.
"""
