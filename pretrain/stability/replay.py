"""Was it the data or the state? PaLM's replay experiment, planned from a run's record and judged.

PaLM replayed the batches around a spike from an earlier checkpoint and the spike did not recur: spikes come
from a batch meeting a parameter state. `ayumi replay RUN_DIR --spike K` (pretrain/tools/replay.py) asks that
question of one spike, with three short trainings (arms), each in a scratch run that starts from a checkpoint of
the run and trains the spike's window (the steps from the pre-spike checkpoint C to the spike step S):

- (a) reproducibility: checkpoint C, the window's own batches, the LR each of its steps had;
- (b) data: an earlier checkpoint E, the window's batches, the LR the run's schedule gave those steps (an injected
  LR fault taken out: it belongs to the state, not to the data);
- (c) state: checkpoint C, as many other batches of the spike's stage (those right after the window, else those
  right before it), the LR each step of the window had (an injected fault included). The spike's stage is the one
  its own batch was in: a window that crosses a stage switch is compared with batches of the stage it spiked in.

"The state" is everything but the batch: the weights, the optimizer's moments and the step size the run applied.
So an LR the run multiplied at the spike (stability.inject, a fire drill) stays with arms (a) and (c), and arm (b)
trains at the LR the schedule and the run's recoveries gave those steps. The spike recurs in an arm when the run's
own detector (its thresholds, its history as the checkpoint holds it) flags a step of the window: a spike, an
outlier (a step it would skip), or an unconfirmed crossing (one signal over its thresholds, z and minimum rise,
without the other confirming it). The lesser flags count: judged against another checkpoint's history, a bad batch
may stand as far out of the noise in one signal and not cross the spike's other bars (measured: a poisoned batch at
+54%, loss z 11.4, grad z 2.3, where the run's own step had both). The arms skip a flagged step's update and
never roll back (stability.action=skip; log_only stays log_only), so up to the spike step arm (a) trains as the run
did. The verdict:

- not reproducible: (a) does not spike (the spike needs something the record does not hold: nondeterminism,
  hardware, a cause outside the step);
- data-driven: (b) spikes and (c) does not: the batches spike another state too, and this state survives others;
- state-driven: (c) spikes and (b) does not: the state spikes on other batches, and the batches are harmless to
  another state;
- mixed: (b) and (c) agree: both spike (either alone suffices) or neither does (only this state with these
  batches: PaLM's finding).

This module plans the arms and judges them; it imports no torch and starts nothing.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretrain.checkpoint.layout import RING_DIR, complete_tags, step_of
from pretrain.metrics import METRICS_FILE, read_jsonl
from pretrain.step_samples import StepSamplesError, nth_spike

REPLAY_DIR = "stability"
"""RUN_DIR/stability/: where each spike's replay verdict is written (replay_spike_<K>.json), the report reads it."""
VERDICTS = ("data-driven", "state-driven", "not reproducible", "mixed")
ARMS = {"a": "same checkpoint, same batches: does the spike recur?",
        "b": "earlier checkpoint, the spike's batches: does it recur? (data)",
        "c": "same checkpoint, other batches of the stage: does it recur? (state)"}


class ReplayError(ValueError):
    """A replay cannot be planned; the message names the file or argument and what to do (exit 2)."""


@dataclass
class Arm:
    """One of the three trainings, and what it showed."""

    name: str
    """a, b or c."""
    question: str
    checkpoint: str
    """The checkpoint folder it starts from."""
    checkpoint_step: int
    """The steps that checkpoint had trained."""
    feed_sample: int
    """The stream position its first step reads from."""
    lr: dict[int, float]
    """0-based step -> the LR it trains that step at."""
    steps: int
    """Steps it trains."""
    losses: list[list[float]] = field(default_factory=list)
    """[1-based step, loss] of each step it trained."""
    spike_steps: list[int] = field(default_factory=list)
    """The steps its detector called a spike at (1-based)."""
    outlier_steps: list[int] = field(default_factory=list)
    """The other steps its detector flagged (1-based): outliers, non-finite steps, and unconfirmed crossings (the
    loss or the grad norm over its thresholds without the other signal confirming it)."""

    @property
    def recurred(self) -> bool:
        """The spike recurred in this arm: its detector flagged a step of the window."""
        return bool(self.spike_steps or self.outlier_steps)


@dataclass
class ReplayPlan:
    """What a replay of spike K runs."""

    spike: int
    """K: the spike's number in events.jsonl (1-based)."""
    step: int
    """S: the step the detector called the spike at (1-based)."""
    window: int
    """Steps from the pre-spike checkpoint to S."""
    first_sample: int
    """The stream position of the window's first batch."""
    global_batch: int
    step_seconds: float
    """The run's median step time (metrics.jsonl), for the cost stated before running."""
    arms: list[Arm]
    verdict: str = ""
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for arm, data in zip(self.arms, out["arms"]):
            data["recurred"] = arm.recurred
            data["lr"] = {str(k): v for k, v in arm.lr.items()}
        return out


# -- the record ---------------------------------------------------------------------------------------------
def checkpoint_folders(root: Path) -> dict[int, Path]:
    """step -> complete checkpoint folder, long-term and ring alike. A ring one wins a tie: a long-term one of the
    same step may be the state saved after a rollback, its skip and cool-down already in it."""
    found: dict[int, Path] = {}
    for folder in (root, root / RING_DIR):
        found.update({step_of(tag): folder / tag for tag in complete_tags(folder)})
    return found


def pre_spike_step(events: list[dict[str, Any]], at: int, spike: dict[str, Any], have: dict[int, Path]) -> int:
    """C: the checkpoint the run rolled back to after the spike; for a spike not rolled back, the newest checkpoint
    before its episode began."""
    for event in events[at + 1:]:
        if event.get("event") == "rollback":
            return int(event["to_step"])
        if event.get("event") in ("spike", "session"):
            break
    began = int(spike.get("spike_start", spike["step"]))
    older = [step for step in have if step < began]
    if not older:
        raise ReplayError(f"no checkpoint of the run is older than the spike's episode (step {began:,}); a replay "
                          "starts from one (stability.recovery.ring_interval keeps them)")
    return max(older)


def window_lrs(metrics: list[dict[str, Any]], events_before: list[dict[str, Any]], spike_step: int,
               first_step: int, metrics_path: Path) -> list[float]:
    """The LR each step of (first_step, spike_step] had on the spike's timeline: the records right before the
    spike's own (its n-th record of that step, the n-th spike at it), as metrics.jsonl wrote them."""
    nth = sum(1 for event in events_before if event.get("event") == "spike" and event.get("step") == spike_step)
    seen = -1
    for line, record in enumerate(metrics):
        if record.get("step") == spike_step and "opt/lr" in record:
            seen += 1
            if seen == nth:
                break
    else:
        raise ReplayError(f"{metrics_path} holds no record of step {spike_step:,}: the spike's LRs are unknown")
    lrs, expected = [], spike_step
    for record in reversed(metrics[:line + 1]):
        if "opt/lr" not in record:
            continue
        if record["step"] != expected:
            break
        lrs.append(float(record["opt/lr"]))
        expected -= 1
        if expected == first_step:
            return lrs[::-1]
    raise ReplayError(f"{metrics_path} lacks the LR of step {expected:,} (train.log_interval > 1, or a cut file): "
                      f"a replay needs every step from {first_step + 1:,} to {spike_step:,}")


INJECTED_LR = re.compile(r"^lr x([0-9.eE+-]+)$")


def injected_factors(events_before: list[dict[str, Any]]) -> dict[int, float]:
    """1-based step -> the LR factor stability.inject applied there (the last time the step was trained)."""
    out: dict[int, float] = {}
    for event in events_before:
        if event.get("event") == "fault_injected":
            factor = 1.0
            for fault in event.get("faults", []):
                match = INJECTED_LR.match(fault)
                if match:
                    factor *= float(match.group(1))
            out[int(event["step"])] = factor
    return out


def median_step_seconds(metrics: list[dict[str, Any]]) -> float:
    times = [float(r["perf/step_time"]) for r in metrics if "perf/step_time" in r]
    return statistics.median(times) if times else 0.0


def other_batches(source, first: int, window: int, global_batch: int) -> int:
    """Arm (c)'s first sample: `window` batches of the spike's stage other than the window's own (those right after
    it, else those right before it); ReplayError when the stage holds neither. The spike's stage is its own batch's
    (the window's last): a window that crosses a stage switch is compared with batches of the stage it spiked in."""
    stage_of = getattr(source, "stage_at_sample", None)
    length = window * global_batch
    spiked_in = stage_of(first + length - global_batch) if stage_of is not None else None
    for start in (first + length, first - length):
        if start < 0:
            continue
        if stage_of is None or stage_of(start) == spiked_in == stage_of(start + length - 1):
            return start
    raise ReplayError(f"the spike's stage holds no {window} batches besides the window's own (samples [{first:,}, "
                      f"{first + length:,})): arm (c) has no other batches of that stage to train on")


def plan_replay(run_dir: Path, spike: int) -> ReplayPlan:
    """The three arms of spike `spike` (1-based) of the run in `run_dir` (see the module doc), from its record alone:
    arm (c) takes the batches right after the window until `place_other_batches` looks at the stream's stages."""
    from pretrain.metrics import EVENTS_FILE

    run_dir = Path(run_dir)
    events = read_jsonl(run_dir / EVENTS_FILE)
    try:
        at, event = nth_spike(events, spike, run_dir / EVENTS_FILE)
    except StepSamplesError as err:
        raise ReplayError(f"{err}: nothing to replay") from None
    cfg = run_config(run_dir, int(event["step"]))
    root = run_dir / "checkpoints"  # the default checkpoint.dir; a run copied elsewhere holds its own
    root = root if root.is_dir() else Path(cfg.checkpoint.dir)
    have = checkpoint_folders(root)
    step = int(event["step"])
    pre = pre_spike_step(events, at, event, have)
    window = step - pre
    earlier = [s for s in have if s < pre and s >= cfg.stability.detector.warmup_steps]
    missing = [f"step {pre:,} (the pre-spike checkpoint)"] if pre not in have else []
    if not earlier:
        missing.append(f"a checkpoint older than step {pre:,} from step {cfg.stability.detector.warmup_steps:,} on "
                       "(the detector's warm-up)")
    if missing:
        held = ", ".join(f"{s:,}" for s in sorted(have)) or "none"
        raise ReplayError(f"{root}: the checkpoints a replay of spike {spike} needs are gone: {' and '.join(missing)}; "
                          f"it holds step(s) {held} (keep more: stability.recovery.ring_keep, checkpoint.keep_last)")
    early = max(earlier)
    global_batch = cfg.train.global_batch_size
    first = int(event["batch_first_sample"]) - (window - 1) * global_batch
    metrics = read_jsonl(run_dir / METRICS_FILE)
    lrs = window_lrs(metrics, events[:at], step, pre, run_dir / METRICS_FILE)
    factors = injected_factors(events[:at])
    scheduled = [lr / factors.get(pre + 1 + i, 1.0) for i, lr in enumerate(lrs)]
    after = first + window * global_batch
    arms = [Arm("a", ARMS["a"], str(have[pre]), pre, first, {pre + i: lr for i, lr in enumerate(lrs)}, window),
            Arm("b", ARMS["b"], str(have[early]), early, first,
                {early + i: lr for i, lr in enumerate(scheduled)}, window),
            Arm("c", ARMS["c"], str(have[pre]), pre, after, {pre + i: lr for i, lr in enumerate(lrs)}, window)]
    return ReplayPlan(spike, step, window, first, global_batch, median_step_seconds(metrics), arms)


def place_other_batches(plan: ReplayPlan, source) -> None:
    """Arm (c)'s batches in the run's sample stream `source` (pretrain/step_samples.open_source): of the spike's
    stage (`other_batches`)."""
    plan.arms[2].feed_sample = other_batches(source, plan.first_sample, plan.window, plan.global_batch)


def run_config(run_dir: Path, step: int):
    """The config that trained `step` (pretrain/step_samples.step_config), ReplayError when it cannot be read."""
    from pretrain.step_samples import StepSamplesError, step_config

    try:
        return step_config(run_dir, step)
    except StepSamplesError as err:
        raise ReplayError(str(err)) from None


# -- judging ------------------------------------------------------------------------------------------------
def read_arm(arm: Arm, arm_dir: Path) -> None:
    """An arm's losses and its detector's calls within its window, from the scratch run it trained."""
    from pretrain.metrics import EVENTS_FILE

    first, last = arm.checkpoint_step + 1, arm.checkpoint_step + arm.steps
    window = [r for r in read_jsonl(arm_dir / METRICS_FILE) if first <= int(r.get("step", -1)) <= last]
    arm.losses = [[int(r["step"]), float(r["train/loss"])] for r in window if "train/loss" in r]
    events = read_jsonl(arm_dir / EVENTS_FILE)
    arm.spike_steps = [int(e["step"]) for e in events if e.get("event") == "spike" and first <= e["step"] <= last]
    arm.outlier_steps = [int(r["step"]) for r in window
                         if (r.get("stability/outlier", 0) > 0 or r.get("stability/unconfirmed", 0) > 0)
                         and int(r["step"]) not in arm.spike_steps]


def verdict(a: bool, b: bool, c: bool) -> tuple[str, str]:
    """(verdict, why) from whether arms (a), (b), (c) spiked (the rule in the module doc)."""
    if not a:
        return "not reproducible", "the same checkpoint on the same batches at the same LR did not spike again"
    if b and not c:
        return "data-driven", "the spike's batches spiked an earlier checkpoint too; other batches did not spike this one"
    if c and not b:
        return "state-driven", "this checkpoint spiked on other batches too; the spike's batches did not spike an earlier one"
    if b and c:
        return "mixed", "the batches spiked an earlier checkpoint and this checkpoint spiked on other batches: either alone"
    return "mixed", "only this checkpoint with these batches spiked (PaLM's finding): skipping them was enough"


def judge(plan: ReplayPlan) -> None:
    a, b, c = (arm.recurred for arm in plan.arms)
    plan.verdict, plan.why = verdict(a, b, c)


SUSPECT_RATIO = 2.0
"""A data-driven spike's suspects: its samples with at least this many times the batch's median loss."""


def suspect_documents(spike: dict[str, Any]) -> list[tuple[str, str, int]]:
    """The documents (domain, shard, index) of a spike's highest-loss samples (the event's top_samples) whose loss
    is at least SUSPECT_RATIO times its batch's median: what a data-driven verdict suggests excluding."""
    losses = sorted(loss for _, _, loss in spike.get("batch_samples", []))
    if not losses:
        return []
    median = statistics.median(losses)
    out: list[tuple[str, str, int]] = []
    for sample in spike.get("top_samples", []):
        if sample["loss"] >= SUSPECT_RATIO * median:
            for document in sample.get("documents", []):
                named = (sample["domain"], document["shard"], int(document["document"]))
                if named not in out:
                    out.append(named)
    return out


def replay_file(run_dir: Path, spike: int) -> Path:
    return Path(run_dir) / REPLAY_DIR / f"replay_spike_{spike}.json"


def read_replays(run_dir: Path) -> dict[int, dict[str, Any]]:
    """spike step -> its replay record, for the report."""
    out = {}
    for path in sorted((Path(run_dir) / REPLAY_DIR).glob("replay_spike_*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, OSError):
            continue
        out[int(record["step"])] = record
    return out
