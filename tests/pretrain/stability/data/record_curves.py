"""Record the real loss / unclipped grad-norm curves in tiny_llama_curves.json (not a test).

ayumi's debug Llama (158k parameters, vocab 512) trained with torch AdamW (lr 3e-3, betas 0.9/0.95,
wd 0.1, clip 1.0, 20 warmup steps then cosine to 10%) for 800 steps of 8 x 64 tokens drawn from a
fixed sparse Markov chain (6 successors per token): the loss falls from ln(512) = 6.24 to ~1.45,
with ~3% step-to-step noise (a small batch). Three runs from the same seed, identical up to the
event:

- normal: no event;
- spike: the LR multiplied by 50 at steps 500-502 (the `stability/inject=demo` fault): the loss
  goes 1.41 -> 2.0 -> 2.8 -> 3.3 and stays above 2.5 for 30+ steps;
- switch: from step 500, a quarter of every batch comes from a second, unseen chain: a real
  domain switch, +150% and a slow fall (far bigger than a curriculum's +8%).

Run (about a minute on 1 CPU core): python tests/pretrain/stability/data/record_curves.py
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from bench.markov_corpus import markov_chain, sample_chain  # noqa: E402
from pretrain.model.config import ModelConfig  # noqa: E402
from pretrain.model.llama import Llama  # noqa: E402

VOCAB, SEQ, BATCH, STEPS, EVENT = 512, 64, 8, 800, 500
OUT = Path(__file__).with_name("tiny_llama_curves.json")


def run(lr_multiply: dict[int, float] | None = None, second_share: float = 0.0) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    first, second = markov_chain(VOCAB, 100), markov_chain(VOCAB, 200)
    model = Llama(ModelConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, norms = [], []
    for step in range(STEPS):
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / STEPS)))
        lr *= (lr_multiply or {}).get(step, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        other = round(BATCH * second_share) if step >= EVENT else 0
        tokens = torch.from_numpy(np.concatenate([sample_chain(rng, first, BATCH - other, SEQ + 1),
                                                  sample_chain(rng, second, other, SEQ + 1)]))
        out = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))  # the unclipped norm
        opt.step()
        losses.append(float(out.ce_loss))
    return losses, norms


def main() -> None:
    torch.set_num_threads(1)
    normal = run()
    spike = run(lr_multiply={EVENT: 50.0, EVENT + 1: 50.0, EVENT + 2: 50.0})
    switch = run(second_share=0.25)
    for name, (losses, _) in (("spike", spike), ("switch", switch)):
        assert losses[:EVENT] == normal[0][:EVENT], f"{name} diverged before step {EVENT}"
    curves = {"event_step": EVENT, "normal": _pack(normal)}
    # The variants equal `normal` before the event: store their tails only.
    curves["spike_tail"] = _pack(spike, EVENT)
    curves["switch_tail"] = _pack(switch, EVENT)
    OUT.write_text(json.dumps(curves, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}")


def _pack(curve: tuple[list[float], list[float]], start: int = 0) -> dict[str, list[float]]:
    losses, norms = curve
    return {"loss": [round(v, 4) for v in losses[start:]], "grad_norm": [float(f"{v:.4g}") for v in norms[start:]]}


if __name__ == "__main__":
    main()
