"""Start-up: everything decided before a rank trains, in the order check -> decide -> act.

- `checks.py`: every check that can run before launch (the config's rules, the data's vocabulary, the task files,
  FP8 against the hardware);
- `resume.py`: what a resume means, from the run's record: the difference between the run's config and this
  command's, sorted into refused (the past), accepted on acknowledgement (the future) and harmless;
- `record.py`: the run's config record, append-only, so it can always say which config trained step N.

May import: `pretrain.config`, `pretrain.model` (its config and the safetensors header reader), `pretrain.plan`,
`pretrain.checkpoint.layout`, `downstream`, `curriculum`, `data`, `tokenizer`, `common`. Never torch or DeepSpeed:
`ayumi plan`, `--cfg job` and `ayumi train` answer before any rank starts.
"""
