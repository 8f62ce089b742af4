"""Benchmark: document masking (`model.attention=document`) against plain causal attention, one training step.

The same Llama (hidden 256, 4 layers, 8 heads, 2 KV heads, vocab 8192), fp32, micro batch 4 x seq 1024, on
the CPU in this process: forward, loss and backward of a packed batch whose documents are 64-448 tokens long
(ending with an end-of-document token), once with `attention=sdpa` (causal) and once with
`attention=document` (SDPA with a [B, 1, T, T] mask on the CPU; FlexAttention on CUDA is the GPU
acceptance run's to measure). The two alternate in rounds (ABBA), and the ratio is the median of each round's
paired ratio. The mask costs a boolean T x T per sample and a kernel without its causal shortcut.

    python bench/document_attention.py [--rounds 6] [--seq 1024] [--restart-positions]

Ends with: RESULT document_attention_cpu ours=<ms>ms baseline=<ms>ms ratio=<r> target=<=1.5 ok=<true|false>
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

END = 1


def packed_batch(batch: int, seq: int, vocab: int, seed: int = 0):
    """[batch, seq + 1] tokens: documents of 64-448 tokens, each ending with END."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (batch, seq + 1), generator=generator)
    for row in range(batch):
        at = 0
        while True:
            at += int(torch.randint(64, 449, (1,), generator=generator))
            if at >= seq:
                break
            tokens[row, at] = END
    return tokens


def step_seconds(model, tokens) -> float:
    start = time.perf_counter()
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--restart-positions", action="store_true", help="model.restart_positions=true")
    args = p.parse_args(argv)
    import torch

    from pretrain.model.config import ModelConfig
    from pretrain.model.llama import Llama

    print(machine_line(), flush=True)
    shape = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=2,
                 max_seq_len=args.seq)
    torch.manual_seed(0)
    plain = Llama(ModelConfig(**shape)).train()
    masked = Llama(ModelConfig(**shape, attention="document", document_end_id=END,
                               restart_positions=args.restart_positions)).train()
    masked.load_state_dict(plain.state_dict())
    tokens = packed_batch(args.batch, args.seq, shape["vocab_size"])
    for model in (plain, masked):  # warm-up: gradients allocated, kernels chosen
        step_seconds(model, tokens)
    ours, baseline, ratios = [], [], []
    for round_ in range(args.rounds):
        order = (plain, masked) if round_ % 2 == 0 else (masked, plain)
        times = {id(model): step_seconds(model, tokens) for model in order}
        ours.append(times[id(masked)])
        baseline.append(times[id(plain)])
        ratios.append(ours[-1] / baseline[-1])
        print(f"[round {round_}] document {ours[-1] * 1e3:.1f} ms, causal {baseline[-1] * 1e3:.1f} ms, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(result_line("document_attention_cpu", statistics.median(ours) * 1e3, statistics.median(baseline) * 1e3,
                      "<=1.5", unit="ms", ratio=statistics.median(ratios), spread=ratios), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
