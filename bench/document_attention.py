"""Benchmark: document masking (`model.attention=document`) against plain causal attention, one training step, for
two document-length regimes.

The same Llama twice (same weights): forward, loss and backward of the same packed batch, once with
`attention=sdpa` (causal) and once with `attention=document`, documents ending with an end-of-document token:

  short  documents of about --short-mean tokens (half to 1.5 times it; 512 by default), many per sample: document
         masking should cost less than causal attention, its kernel skipping the attention between documents;
  long   documents of T/2 to 2T tokens, one or two per sample: it should cost no more than causal attention, its
         kernel being causal attention's.

On CUDA (`--device cuda`): 1b-like layers (hidden 2048, 16 heads, 4 KV heads, 4 layers, vocab 32000), bf16, micro
batch 2 x seq 4096; document masking runs torch's flash varlen kernel, causal attention SDPA's flash kernel;
targets: short <=1.00, long <=1.03. On the CPU (the default): hidden 256, 4 layers, 8 heads, 2 KV heads, vocab
8192, fp32, micro batch 4 x seq 1024; document masking runs SDPA with a [B, 1, T, T] mask (no causal shortcut);
target <=1.5 for both.

The two models alternate in rounds (ABBA); a round times --steps consecutive steps with one device sync at the
end, so document masking's one wait for the device per forward costs what it costs in training. The ratio is
the median of the rounds' paired ratios. Models run eager (the GPU acceptance run compiles blocks elsewhere).

    python bench/document_attention.py [--device cpu|cuda] [--documents short,long] [--rounds 6] [--steps N]
                                       [--seq N] [--batch N] [--short-mean 512] [--restart-positions]

Ends with one line per regime: RESULT document_attention_<device>_<short|long> ours=<ms>ms baseline=<ms>ms ...
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
SHAPES = {
    "cpu": dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=2),
    "cuda": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=4, num_heads=16,
                 num_kv_heads=4),
}
"""The model per device: a small Llama on the CPU, the 1b preset's layers (4 of them) on CUDA."""
RUN = {"cpu": dict(seq=1024, batch=4, dtype="float32", steps=1, targets={"short": "<=1.5", "long": "<=1.5"}),
       "cuda": dict(seq=4096, batch=2, dtype="bfloat16", steps=3, targets={"short": "<=1.00", "long": "<=1.03"})}
"""Batch, dtype, steps per round and targets per device."""


def packed_batch(batch: int, seq: int, vocab: int, seed: int = 0, lengths: tuple[int, int] = (64, 448)):
    """[batch, seq + 1] tokens: documents of lengths[0]..lengths[1] tokens (uniform), each ending with END."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (batch, seq + 1), generator=generator)
    for row in range(batch):
        at = -1  # the last end token so far
        while True:
            at += int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
            if at >= seq:
                break
            tokens[row, at] = END
    return tokens


def regime_lengths(regime: str, seq: int, short_mean: int) -> tuple[int, int]:
    """Document lengths of a regime: short ~short_mean tokens; long T/2..2T (one or two documents a sample)."""
    if regime == "short":
        return max(1, short_mean // 2), max(1, 3 * short_mean // 2)
    if regime == "long":
        return max(1, seq // 2), 2 * seq
    raise ValueError(f"unknown regime {regime!r}: short or long")


def steps_ms(model, tokens, steps: int) -> float:
    """Mean ms of `steps` consecutive training steps, the device idle before and synced after."""
    import torch

    synchronize = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def compare(masked, causal, tokens, rounds: int, steps: int, label: str = "") -> tuple[list, list, list]:
    """ABBA rounds after one warm-up step each: (document ms, causal ms, paired ratios) per round."""
    for model in (causal, masked):  # gradients allocated, kernels chosen
        steps_ms(model, tokens, 1)
    ours, baseline, ratios = [], [], []
    for round_ in range(rounds):
        order = (causal, masked) if round_ % 2 == 0 else (masked, causal)
        times = {id(model): steps_ms(model, tokens, steps) for model in order}
        ours.append(times[id(masked)])
        baseline.append(times[id(causal)])
        ratios.append(ours[-1] / baseline[-1])
        print(f"[{label}round {round_}] document {ours[-1]:.1f} ms, causal {baseline[-1]:.1f} ms, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    return ours, baseline, ratios


def models(shape: dict, seq: int, device: str, dtype, restart_positions: bool = False):
    """(document-masked, causal) Llamas of `shape` with the same weights, in training mode on `device`."""
    import torch

    from pretrain.model.config import ModelConfig
    from pretrain.model.llama import Llama

    torch.manual_seed(0)
    with torch.device(device):  # initialized where they run: a 1b-like init takes seconds on a CPU
        causal = Llama(ModelConfig(**shape, max_seq_len=seq)).to(device, dtype).train()
        masked = Llama(ModelConfig(**shape, max_seq_len=seq, attention="document", document_end_id=END,
                                   restart_positions=restart_positions)).to(device, dtype).train()
    masked.load_state_dict(causal.state_dict())
    return masked, causal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--documents", default="short,long", help="regimes, comma-separated: short, long")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="steps per round (default: 1 on the CPU, 3 on CUDA)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--short-mean", type=int, default=512, help="the short regime's mean document length")
    p.add_argument("--restart-positions", action="store_true", help="model.restart_positions=true")
    args = p.parse_args(argv)
    import torch

    print(machine_line(), flush=True)
    run = RUN[args.device]
    seq, batch, steps = args.seq or run["seq"], args.batch or run["batch"], args.steps or run["steps"]
    shape = SHAPES[args.device]
    masked, causal = models(shape, seq, args.device, getattr(torch, run["dtype"]), args.restart_positions)
    for regime in args.documents.split(","):
        lengths = regime_lengths(regime, seq, args.short_mean)
        tokens = packed_batch(batch, seq, shape["vocab_size"], lengths=lengths).to(args.device)
        ours, baseline, ratios = compare(masked, causal, tokens, args.rounds, steps, f"{regime} ")
        print(result_line(f"document_attention_{args.device}_{regime}", statistics.median(ours),
                          statistics.median(baseline), run["targets"][regime], unit="ms",
                          ratio=statistics.median(ratios), spread=ratios), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
