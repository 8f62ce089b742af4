"""ayumi pretraining: Llama on DeepSpeed, driven by Hydra configs (the last stop of the data flow)."""
