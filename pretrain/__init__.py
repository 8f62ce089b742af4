"""ayumi pretraining: Llama on DeepSpeed, driven by Hydra configs (the last stop of the data flow).

Where things live (docs/design.md has the whole map):

- `train.py`: the rank's entry point (`deepspeed --module pretrain.train`): config, data, model, engine, trainer;
- `trainer.py`: the training loop; `evaluation.py` (validation loss) and `hooks.py` (per-step concerns:
  stragglers, histograms, telemetry) plug into it;
- `config.py`: the training config (documented dataclasses, Hydra schema); `ranges.py`: its range rules;
- `preflight.py`: every check that can run before launch (config, vocabulary, task files), shared by `ayumi plan`,
  `ayumi train` and `--cfg job`;
- `loader.py`: the rank's batches; `metrics.py`: metrics files and W&B (the only W&B importer);
- `engine/`: everything that talks to DeepSpeed (the only DeepSpeed importer);
- `checkpoint/`: the checkpointer, its background writer, the rollback ring;
- `job/`: signals, the hang watchdog, the launcher watch, the run-dir lock;
- `plan/`: the run plan, the memory model, the hardware it is checked against;
- `model/`: the Llama, its HF import and the tensor-parallel layout; `stability/`: spike detection and recovery;
- `tools/`: the `ayumi` commands (cli, train launcher, plan, doctor, export, report).

May import: `common`, `tokenizer`, `data`, `curriculum` (the flow runs one way: none of those imports `pretrain`).
"""
