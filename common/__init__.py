"""What every ayumi command shares, below the data flow (common → tokenizer → data → curriculum → pretrain).

- `common.corpus`: streaming corpus readers (jsonl/text/parquet/`datasets` folders) used by the
  tokenizer builder and data preparation alike;
- `common.files`: atomic run files and folders (temporary name, fsync, rename);
- `common.conf`: Hydra composition and the -h/--help text of every command;
- `common.status`: the exit statuses every command shares;
- `common.safe_load`: torch files read without running code (a static check of each pickle, then
  `weights_only=True` with a short allow-list), for checkpoints and anything else a command loads.

May import: nothing of ayumi (every other package imports this one).
"""
