"""Loss / grad-norm curves for the detector tests: real recordings and documented synthetic shapes.

Real (tests/pretrain/stability/data/tiny_llama_curves.json, made by data/record_curves.py): ayumi's debug
Llama on Markov-chain text, 800 steps, loss 6.24 -> ~1.45 with ~3% step noise; `spike` has LR x50
at steps 500-502; `switch` adds an unseen domain at step 500.

Synthetic (seeded, so every run sees the same arrays), shaped after a mid-sized LM run:
- loss(t) = 1.9 + 8.9 * (1 + t/40)^-0.55, times (1 + 0.8% noise with lag-1 correlation 0.3):
  10.8 (= ln 50k) at step 0, ~3.9 at step 300, ~2.6 at step 2000. The first ~200 steps fall fast.
- grad norm(t) = (0.25 + 1.5 * exp(-t/80) + 0.05 * t/steps) * exp(0.12 * noise): a large early
  hump, then a slow rise; log-normal noise.
- stage switch at step s: loss x (1 + 0.08 * exp(-(t-s)/5)) and grad norm x (1 + 0.8 * exp(-(t-s)/5)):
  +8% and +80% that fade within ~15 steps (the GENIAC curriculum's "jumped, then returned").
- PaLM-like spike at step s: the loss climbs +15%, +35%, +60%, +80% over four steps and decays
  back over ~300; the grad norm jumps x8 at once and decays over ~30 (BLOOM: the sharper signal).
- small batch (`small_batch_curve`): the noise of `ayumi demo` (8 samples of 128 tokens a step): 2%
  on the loss, 0.1 on log(grad norm), each Student-t (6 and 4 degrees of freedom) and independent of
  the other. The demo's own measurements: robust noise 2% and 0.105, the 99th percentile of the
  step-to-step changes 1.1x (loss) and 1.65-1.75x (grad norm) what a normal distribution gives, one
  clean step's loss +13% (6.7 sigma), one's grad norm 3.3x, and loss/grad z-scores uncorrelated.

Real, from `ayumi demo` (tests/pretrain/stability/data/demo_curve.json, made by data/record_demo_curve.py):
the run's first 604 steps, up to the rollback, with the stage switches at steps 0, 325 and 575; its
clean steps 243 (loss) and 532 (grad norm) were skipped as outliers before confirmation existed,
and LR x50 at steps 600-602 is the injected spike (caught at 603).

Real, with each domain's loss and sample count per step (data/demo_domains_curve.json, made by
data/record_demo_domains.py): a clean 1,000-step run of the demo's config in bf16 (stage switches at
0-based steps 0, 325, 575, 825) and the steps 600-624 of the same run with the demo's LR x50 at
600-602 (`demo_domains(injected=True)`), which that machine's old detector caught only through a grad
norm of 23x.

Real, low loss (data/low_loss_curve.json, made by data/record_low_loss_curve.py): issue 46's clean run, the tiny
corpus repeated on 2 ranks in fp32 for 512 steps, its loss down to 0.02-0.05 with single steps 4x apart. The
detector before issue 46 called five divergences on it.

Synthetic, low loss (`noisy_plateau`): a memorised corpus, the loss falling to a floor of 0.04 and staying there,
each step log-normal around its level with sigma 0.35 (as the recording: 0.025-0.10 around 0.04).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).with_name("data") / "tiny_llama_curves.json"
DEMO_DATA = Path(__file__).with_name("data") / "demo_curve.json"
DEMO_DOMAINS_DATA = Path(__file__).with_name("data") / "demo_domains_curve.json"
LOW_LOSS_DATA = Path(__file__).with_name("data") / "low_loss_curve.json"


@dataclass(frozen=True)
class Curve:
    loss: np.ndarray
    grad_norm: np.ndarray

    def __len__(self) -> int:
        return len(self.loss)


@lru_cache(maxsize=None)
def _recorded() -> dict:
    return json.loads(DATA.read_text())


def recorded(name: str) -> Curve:
    """'normal', 'spike' or 'switch' from the real recording (variants = normal before the event)."""
    data = _recorded()
    normal = data["normal"]
    if name == "normal":
        return Curve(np.array(normal["loss"]), np.array(normal["grad_norm"]))
    event, tail = data["event_step"], data[f"{name}_tail"]
    return Curve(np.array(normal["loss"][:event] + tail["loss"]),
                 np.array(normal["grad_norm"][:event] + tail["grad_norm"]))


RECORDED_EVENT = 500


@dataclass(frozen=True)
class DemoCurve(Curve):
    stage_switches: tuple[int, ...] = ()


@lru_cache(maxsize=None)
def demo() -> DemoCurve:
    """The loss / grad-norm curve of `ayumi demo` up to its rollback, with its stage switches."""
    data = json.loads(DEMO_DATA.read_text())
    return DemoCurve(np.array(data["loss"]), np.array(data["grad_norm"]), tuple(data["stage_switch_steps"]))


DomainRow = dict  # {"loss": float, "grad_norm": float, "domains": {name: [mean loss, samples]}}


@dataclass(frozen=True)
class DomainCurve:
    rows: tuple[DomainRow, ...]
    stage_switches: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def replaced(self, start: int, rows: list[DomainRow]) -> "DomainCurve":
        """This curve with rows[start:start + len(rows)] replaced."""
        new = list(self.rows)
        new[start:start + len(rows)] = rows
        return DomainCurve(tuple(new), self.stage_switches)


@lru_cache(maxsize=None)
def _demo_domains() -> dict:
    return json.loads(DEMO_DOMAINS_DATA.read_text())


def demo_domains(injected: bool = False) -> DomainCurve:
    """The demo config's clean bf16 run with per-domain losses; injected: with its LR x50 spike at 600-602."""
    data = _demo_domains()
    curve = DomainCurve(tuple(data["clean"]), tuple(data["stage_switch_steps"]))
    return curve.replaced(data["injected_from"], data["injected"]) if injected else curve


def scaled_row(row: DomainRow, loss: float, grad_norm: float) -> DomainRow:
    """A row with the total loss and grad norm given, every domain's loss scaled like the total (a damaged
    model raises them all)."""
    factor = loss / row["loss"]
    return {"loss": loss, "grad_norm": grad_norm,
            "domains": {name: [value * factor, count] for name, (value, count) in row["domains"].items()}}


DEMO_CLEAN_EXCURSIONS = (243, 532)  # loss +13% (z 6.7, grad z 2.5); grad norm 3.3x (z 11.3, loss z 1.9)
DEMO_SPIKE = 601  # LR x50 at steps 600-602: the first step on damaged weights; a spike at 603


def _ar1(rng: np.random.Generator, n: int, rho: float) -> np.ndarray:
    """Unit-variance noise with lag-1 correlation rho (consecutive LM batches are nearly independent)."""
    white = rng.standard_normal(n)
    out = np.empty(n)
    out[0] = white[0]
    for i in range(1, n):
        out[i] = rho * out[i - 1] + np.sqrt(1 - rho ** 2) * white[i]
    return out


def normal_curve(steps: int = 2000, seed: int = 0) -> Curve:
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    loss = (1.9 + 8.9 * (1 + t / 40) ** -0.55) * (1 + 0.008 * _ar1(rng, steps, 0.3))
    grad = (0.25 + 1.5 * np.exp(-t / 80) + 0.05 * t / steps) * np.exp(0.12 * rng.standard_normal(steps))
    return Curve(loss, grad)


def with_stage_switch(curve: Curve, at: int, loss_jump: float = 0.08, grad_jump: float = 0.8,
                      fade: float = 5.0) -> Curve:
    t = np.arange(len(curve), dtype=np.float64)
    bump = np.where(t >= at, np.exp(-(t - at) / fade), 0.0)
    return Curve(curve.loss * (1 + loss_jump * bump), curve.grad_norm * (1 + grad_jump * bump))


def with_palm_spike(curve: Curve, at: int) -> Curve:
    loss, grad = curve.loss.copy(), curve.grad_norm.copy()
    rise = np.array([0.15, 0.35, 0.60, 0.80])
    decay = 0.80 * np.exp(-np.arange(len(curve) - at - len(rise)) / 100)
    loss[at:] *= 1 + np.concatenate([rise, decay])[:len(curve) - at]
    jump = 1 + 7 * np.exp(-np.arange(len(curve) - at) / 10)
    grad[at:] *= jump
    return Curve(loss, grad)


def with_single_bad_batch(curve: Curve, at: int, loss_factor: float = 3.0, grad_factor: float = 5.0) -> Curve:
    """One batch of garbage (e.g. random tokens): a one-step jump, the weights untouched."""
    loss, grad = curve.loss.copy(), curve.grad_norm.copy()
    loss[at] *= loss_factor
    grad[at] *= grad_factor
    return Curve(loss, grad)


def small_batch_curve(steps: int = 1000, seed: int = 0) -> Curve:
    """A decaying loss and a grad norm with the heavy-tailed, independent noise of a small batch."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    loss = (4.0 + 5.0 * (1 + t / 40) ** -0.5) * (1 + 0.02 * rng.standard_t(6, steps))
    grad = (0.8 + 1.0 * np.exp(-t / 80)) * np.exp(0.10 * rng.standard_t(4, steps))
    return Curve(loss, grad)


@lru_cache(maxsize=None)
def _low_loss() -> dict:
    return json.loads(LOW_LOSS_DATA.read_text())


def low_loss() -> tuple[Curve, np.ndarray]:
    """Issue 46's clean low-loss run: (its curve, each step's clip threshold)."""
    data = _low_loss()
    return Curve(np.array(data["loss"]), np.array(data["grad_norm"])), np.array(data["clip_threshold"])


def noisy_plateau(steps: int = 3000, seed: int = 0, floor: float = 0.04, sigma: float = 0.35) -> Curve:
    """A loss that falls from 6 to `floor` over the first ~300 steps and stays there, log-normal step noise of
    `sigma`; the grad norm log-normal too (sigma 0.3) around 0.3."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps, dtype=np.float64)
    level = floor + (6.0 - floor) * np.exp(-t / 50)
    loss = level * np.exp(sigma * rng.standard_normal(steps))
    grad = 0.3 * np.exp(0.3 * rng.standard_normal(steps))
    return Curve(loss, grad)
