"""`ayumi report RUN_DIR`: plots and a summary of a run, from its jsonl files alone.

- `timeline.py`: metrics.jsonl and events.jsonl read back as one timeline (rollbacks leave abandoned stretches);
- `plots.py`: the PNG plots; `render.py`: the summary's markdown and HTML;
- `eval_curve.py`: the curve `ayumi eval RUN_DIR --all` wrote (eval/downstream.json), read back and plotted;
- `build.py`: the command: reads, plots, renders, and swaps the report folder in whole.

May import: `pretrain.metrics` (file names and formats) and `common`; never the checkpoints, W&B or DeepSpeed.
"""
