"""The `ayumi` commands around training: each turns a command line into calls of the packages below it.

- `cli.py`: the `ayumi` dispatcher (subcommands load lazily);
- `launch.py`: `ayumi train` (checks the config and the plan, then starts the ranks with the right launcher);
- `plan.py`: `ayumi plan`; `doctor.py`: `ayumi doctor`; `export.py`: `ayumi export hf`;
- `verify.py`: `ayumi checkpoint verify` (checksums and the static check: torch's zip reader, no DeepSpeed);
- `report/`: `ayumi report` (timeline, plots, rendering).

May import: anything in `pretrain` and below. Only `doctor.py` imports DeepSpeed outside `pretrain/engine/`: it
reports DeepSpeed's versions and ops.
"""
