"""Stability telemetry: grad-norm percentiles, adaptive clipping, per-group norms, histograms.

The training playbook's advice, as small parts the trainer calls:
- log the full, *unclipped* gradient norm every step, with rolling p50/p90/p99 and a histogram
  (`RollingPercentiles`, `log10_histogram`);
- clip near the 90th percentile of observed norms, and if more than half the updates get
  clipped, lower the LR instead (`AdaptiveClip`);
- see which layers move (`group_grad_norms`, `update_to_weight_ratios` over
  `pretrain.model.llama.layer_groups`: embedding, block_i, final_norm, lm_head): Molybog et al.
  trace spikes to the embedding's gradients shrinking toward zero.

Nothing here talks to other ranks or to W&B: the trainer gathers ZeRO-partitioned tensors
(DeepSpeed's safe_get_full_grad / safe_get_full_fp32_param) and logs the returned dicts.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from pretrain.model.llama import layer_groups
from pretrain.stability.config import ClipConfig

PERCENTILES = (50, 90, 99)
HISTOGRAM_RANGE = (-4.0, 4.0)  # log10 of grad norms: 1e-4 .. 1e4; values outside land in the edge bins


class RollingPercentiles:
    """Percentiles of the newest `window` values (a ring buffer; np.percentile over it)."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"RollingPercentiles: window must be >= 1, got {window}")
        self.window = window
        self._buffer = np.zeros(window, dtype=np.float64)
        self._count = 0  # values ever pushed; the buffer holds the newest min(count, window)

    def __len__(self) -> int:
        return min(self._count, self.window)

    def push(self, value: float) -> None:
        """Add a value; non-finite values are ignored (they would poison every percentile)."""
        if math.isfinite(value):
            self._buffer[self._count % self.window] = value
            self._count += 1

    def values(self) -> np.ndarray:
        """The window's values, oldest first."""
        n = len(self)
        if self._count <= self.window:
            return self._buffer[:n].copy()
        split = self._count % self.window
        return np.concatenate([self._buffer[split:], self._buffer[:split]])

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self._buffer[:len(self)], q)) if len(self) else None

    def percentiles(self, qs: Iterable[float] = PERCENTILES) -> dict[float, float]:
        """{q: value} in one vectorised call; empty while no value was pushed."""
        qs = list(qs)
        if not len(self):
            return {}
        return dict(zip(qs, (float(v) for v in np.percentile(self._buffer[:len(self)], qs))))

    def metrics(self, prefix: str = "stability/grad_norm_p") -> dict[str, float]:
        """{"stability/grad_norm_p50": ..., "..._p90": ..., "..._p99": ...}."""
        return {f"{prefix}{q:g}": v for q, v in self.percentiles().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "values": self.values().tolist(), "count": self._count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        values = np.asarray(state["values"], dtype=np.float64)[-self.window:]
        # The lifetime count places the ring's write position; a changed window starts a fresh ring.
        self._count = int(state["count"]) if int(state["window"]) == self.window else len(values)
        self._buffer = np.zeros(self.window, dtype=np.float64)
        if self._count <= self.window:
            self._buffer[:len(values)] = values
        else:
            self._buffer = np.roll(values, self._count % self.window)


class AdaptiveClip:
    """Clip threshold = a percentile of recent unclipped grad norms, once warmed up.

    `threshold()` is the value to clip the *coming* step with: it depends only on earlier steps,
    so every rank computes the same one. Before clip.warmup_steps accepted norms (or with
    clip.enabled false) it is the static optim.grad_clip. `observe()` records a step's unclipped
    norm and whether it was clipped; only accepted steps should be observed, so a spike cannot
    raise the threshold that is meant to contain it.
    """

    def __init__(self, cfg: ClipConfig, static_clip: float):
        self.cfg = cfg
        self.static_clip = float(static_clip)
        self.norms = RollingPercentiles(cfg.window)
        self._clipped: list[bool] = []  # newest cfg.window flags
        self._observed = 0

    @property
    def adapting(self) -> bool:
        return self.cfg.enabled and self._observed >= self.cfg.warmup_steps and len(self.norms) > 0

    def threshold(self) -> float:
        """Clip value for the next step (0 = no clipping, as optim.grad_clip=0 means)."""
        if not self.adapting:
            return self.static_clip
        return self.norms.percentile(self.cfg.percentile)

    def observe(self, grad_norm: float) -> bool:
        """Record an accepted step's unclipped norm; returns whether it was clipped."""
        threshold = self.threshold()
        clipped = threshold > 0 and grad_norm > threshold
        if math.isfinite(grad_norm):
            self.norms.push(grad_norm)
            self._observed += 1
            self._clipped.append(clipped)
            if len(self._clipped) > self.cfg.window:
                del self._clipped[:len(self._clipped) - self.cfg.window]
        return clipped

    @property
    def clipped_share(self) -> float:
        """Share of the window's steps whose norm exceeded the threshold in force at that step."""
        return sum(self._clipped) / len(self._clipped) if self._clipped else 0.0

    @property
    def too_many_clipped(self) -> bool:
        """More than warn_share of a full-enough window clipped: lower the LR instead (the playbook).

        Judged only once the window holds warmup_steps values, so three clipped steps out of
        the first five do not raise the alarm.
        """
        enough = len(self._clipped) >= max(1, min(self.cfg.warmup_steps, self.cfg.window))
        return enough and self.clipped_share > self.cfg.warn_share

    def metrics(self) -> dict[str, float]:
        return {"opt/clip_threshold": self.threshold(), "stability/clipped_share": self.clipped_share}

    def state_dict(self) -> dict[str, Any]:
        return {"norms": self.norms.state_dict(), "clipped": list(self._clipped), "observed": self._observed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.norms.load_state_dict(state["norms"])
        self._clipped = [bool(c) for c in state["clipped"]][-self.cfg.window:]
        self._observed = int(state["observed"])


# -- per-group norms ----------------------------------------------------------------------------
GroupOf = Callable[[str], str]


def group_sq_sums(named_tensors: Iterable[tuple[str, torch.Tensor | None]],
                  group_of: GroupOf = layer_groups) -> dict[str, float]:
    """Sum of squares per group (fp64 accumulation), in the model's group order; None tensors skipped."""
    sums: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if tensor is None:
            continue
        group = group_of(name)
        # Accumulate on the tensors' device: one host sync per group, not one per parameter.
        value = torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64) ** 2
        sums[group] = sums[group] + value if group in sums else value
    return {group: float(total) for group, total in sums.items()}


def group_grad_norms(named_grads: Iterable[tuple[str, torch.Tensor | None]],
                     group_of: GroupOf = layer_groups) -> dict[str, float]:
    """L2 norm of the full (unclipped, unpartitioned) gradients per group: embedding, block_i, ...

    Feed full gradients (under ZeRO, gathered with safe_get_full_grad on every rank); the
    groups' norms combine to the global norm: sqrt(sum of squares).
    """
    return {group: math.sqrt(sq) for group, sq in group_sq_sums(named_grads, group_of).items()}


def update_to_weight_ratios(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                            group_of: GroupOf = layer_groups) -> dict[str, float]:
    """|w_after - w_before| / |w_before| per group, from {name: full fp32 weight} snapshots.

    A healthy ratio is ~1e-3 per step at a typical LR; a group far above the others is moving
    too fast. Names present in only one snapshot are ignored. A group whose weights are all zero
    reports inf if they moved, else 0.
    """
    diffs = group_sq_sums(((name, after[name].float() - tensor.float()) for name, tensor in before.items()
                           if name in after), group_of)
    weights = group_sq_sums(((name, tensor) for name, tensor in before.items() if name in after), group_of)
    ratios = {}
    for group, diff in diffs.items():
        weight = weights.get(group, 0.0)
        ratios[group] = math.sqrt(diff / weight) if weight > 0 else (math.inf if diff > 0 else 0.0)
    return ratios


def group_metrics(values: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Prefix group names for logging: group_metrics(norms, "opt/grad_norm/") -> {"opt/grad_norm/embedding": ...}."""
    return {f"{prefix}{group}": value for group, value in values.items()}


# -- histograms ---------------------------------------------------------------------------------
def log10_histogram(values: Iterable[float], bins: int = 64,
                    value_range: tuple[float, float] = HISTOGRAM_RANGE) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of log10(values) over a fixed range, for wandb.Histogram(np_histogram=...).

    The range is fixed so histograms of different steps share bins; values beyond it are counted
    in the edge bins rather than dropped, and non-positive or non-finite values are left out.
    """
    arr = np.asarray(list(values), dtype=np.float64)
    arr = arr[np.isfinite(arr) & (arr > 0)]
    logs = np.clip(np.log10(arr), value_range[0], value_range[1])
    return np.histogram(logs, bins=bins, range=value_range)
