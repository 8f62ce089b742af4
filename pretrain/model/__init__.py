"""ayumi's own Llama: layers, the model, presets, parameter and FLOP counts."""
