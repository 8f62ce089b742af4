"""Benchmark: the LM head's loss three ways, forward + backward of the head alone, side by side.

- `fused` (ayumi's, pretrain/model/chunked_loss.py): chunks of tokens, the gradients made in the forward pass,
  GEMMs in the training dtype with fp32 accumulation: three `tokens x hidden x vocab` GEMMs a step;
- `recompute` (ayumi's former chunked loss, kept here as the baseline): chunks, each chunk's logits recomputed
  in backward and its two backward GEMMs in fp32: four GEMMs, two of them off the tensor cores;
- `plain`: the whole `[tokens x vocab]` logits, `F.cross_entropy` in fp32 (what transformers does).

Each round times every variant once, in an order that alternates (ABC, CBA), and the ratios are the medians of
each round's paired ratios. On CUDA the peak memory of each variant's step is reported too.

    python bench/lm_head_loss.py [--tokens 4096 --hidden 512 --vocab 32000] [--dtype bf16|fp32] [--rounds 7]
    python bench/lm_head_loss.py --gpu-1b      # the 1b preset's head on a GPU: 16 x 2048 tokens, 2048 x 50176, bf16

Ends with RESULT lm_head_fused_vs_recompute (target <=1.0: never slower than recomputing) and
RESULT lm_head_fused_vs_plain (a study: what chunking costs against the whole logits, when they fit).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

IGNORE_INDEX = -100


def recompute_loss(hidden, weight, labels, chunk: int):
    """The former chunked loss: per-token CE saved per chunk, logits recomputed in backward (fp32 backward GEMMs)."""
    import torch
    import torch.nn.functional as F

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels):
            ce = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            lse = torch.zeros_like(ce)
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = F.linear(hidden[rows], weight).float()
                keep = labels[rows] != IGNORE_INDEX
                chunk_lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, labels[rows].clamp(min=0).unsqueeze(-1)).squeeze(-1)
                ce[rows] = torch.where(keep, chunk_lse - picked, 0.0)
                lse[rows] = chunk_lse
            ctx.save_for_backward(hidden, weight, labels, lse)
            return ce

        @staticmethod
        def backward(ctx, grad_ce):
            hidden, weight, labels, lse = ctx.saved_tensors
            grad_hidden = torch.zeros_like(hidden)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                keep = (labels[rows] != IGNORE_INDEX).float()
                dlogits = F.linear(hidden[rows], weight).float()
                dlogits.sub_(lse[rows].unsqueeze(-1)).exp_().mul_((grad_ce[rows].float() * keep).unsqueeze(-1))
                dlogits.scatter_add_(-1, labels[rows].clamp(min=0).unsqueeze(-1),
                                     -(grad_ce[rows].float() * keep).unsqueeze(-1))
                grad_hidden[rows] = (dlogits @ weight.float()).to(hidden.dtype)
                grad_weight += dlogits.t() @ hidden[rows].float()
            return grad_hidden, grad_weight.to(weight.dtype), None

    ce = Recompute.apply(hidden, weight, labels)
    return ce.sum() / (labels != IGNORE_INDEX).sum()


def variants(chunk: int):
    import torch.nn.functional as F

    from pretrain.model.chunked_loss import LMHead

    def fused(head, hidden, labels):
        scale = 1.0 / (labels != IGNORE_INDEX).sum().float()
        return head(hidden, labels, chunk, scale)[0]

    def recompute(head, hidden, labels):
        return recompute_loss(hidden, head.weight, labels, chunk)

    def plain(head, hidden, labels):
        return F.cross_entropy(F.linear(hidden, head.weight).float(), labels, ignore_index=IGNORE_INDEX)

    return {"fused": fused, "recompute": recompute, "plain": plain}, LMHead


def time_step(fn, head, hidden, labels, device) -> tuple[float, int]:
    """Seconds of one forward + backward, and (on CUDA) the peak memory it added, in bytes."""
    import torch

    hidden.grad = head.weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    fn(head, hidden, labels).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base
    return time.perf_counter() - start, 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gpu-1b", action="store_true", help="the 1b preset's head on CUDA (tokens, hidden, vocab, bf16)")
    args = p.parse_args(argv)
    import torch

    if args.gpu_1b:
        args.tokens, args.hidden, args.vocab, args.chunk, args.dtype = 16 * 2048, 2048, 50176, 4096, "bf16"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(machine_line(), flush=True)
    print(f"[lm_head_loss] {device.type}, {args.dtype}, tokens {args.tokens}, hidden {args.hidden}, vocab {args.vocab}, "
          f"chunk {args.chunk}, torch {torch.__version__}", flush=True)
    fns, head_class = variants(args.chunk)
    torch.manual_seed(0)
    head = head_class(args.hidden, args.vocab).to(device=device, dtype=dtype)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device)
    for fn in fns.values():  # warm-up: allocator, kernels, the fused head's compiled pass
        time_step(fn, head, hidden, labels, device)
    seconds = {name: [] for name in fns}
    peaks = {name: 0 for name in fns}
    order = list(fns)
    for round_index in range(args.rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            elapsed, peak = time_step(fns[name], head, hidden, labels, device)
            seconds[name].append(elapsed)
            peaks[name] = max(peaks[name], peak)
    for name in fns:
        memory = f", peak +{peaks[name] / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"[lm_head_loss] {name:9s} median {statistics.median(seconds[name]) * 1e3:.2f} ms{memory}", flush=True)
    median = {name: statistics.median(values) * 1e3 for name, values in seconds.items()}
    for baseline, target, study in (("recompute", "<=1.0", False), ("plain", "<=1.0", True)):
        paired = [f / b for f, b in zip(seconds["fused"], seconds[baseline])]
        print(result_line(f"lm_head_fused_vs_{baseline}", median["fused"], median[baseline], target, unit="ms",
                          ratio=statistics.median(paired), spread=paired, study=study), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
