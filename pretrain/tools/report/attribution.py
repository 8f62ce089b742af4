"""Attribution across a run: which domains and shards the spike batches hold more of than chance would put there.

For each domain, and each shard of the run's data, the report compares two shares:

- its share of the samples of every spike batch (each spike event records its batch's samples and their domains,
  pretrain/step_samples.py; the shards a sample holds are read back from the run's data when it is readable), and
- its share of the samples the run trains: the stage's weight in a curriculum (the spike's own stage), else the
  domain's share of the training tokens (the manifest's counts); a shard's share is its share of its domain's tokens
  times the domain's.

If the stream does not favour a source at spikes, the count of spike-batch samples holding it is binomial: n (the
spike batches' samples) draws at its share p. The table gives the chance of at least the count seen, P(X >= k),
computed exactly in pure Python, and flags a row when it is below ALPHA divided by the rows tested (Bonferroni: many
shards are tested at once). A sample holding two documents counts for each of their shards, so a shard's share is a
close approximation there. Imports no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALPHA = 0.01
"""The family-wise level the flag is judged at."""


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact (log-space terms)."""
    if k <= 0:
        return 1.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0 or k > n:
        return 1.0 if p >= 1.0 and k <= n else 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass
class Row:
    """One source: how many spike-batch samples held it, and what chance would give."""

    source: str
    """A domain, or `domain/shard`."""
    count: int
    """Spike-batch samples holding it."""
    total: int
    """Spike-batch samples."""
    expected: float
    """Its share of the samples the run trains."""
    tail: float
    """P(X >= count) under that share."""
    flagged: bool = False


def spike_batches(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "spike" and e.get("batch_samples")]


def domain_shares(event: dict[str, Any], tokens: dict[str, dict[str, int]]) -> dict[str, float]:
    """Each domain's expected share at a spike: its stage weight (a curriculum), else its share of the training
    tokens (`tokens`: domain -> shard -> tokens)."""
    weights = {name: m.get("weight") for name, m in event.get("domain_mix", {}).items()}
    if weights and all(w is not None for w in weights.values()):
        total = sum(weights.values()) or 1.0
        return {name: float(w) / total for name, w in weights.items()}
    sums = {domain: sum(shards.values()) for domain, shards in tokens.items()}
    total = sum(sums.values()) or 1
    return {domain: count / total for domain, count in sums.items()}


def attribution(events: list[dict[str, Any]], tokens: dict[str, dict[str, int]],
                shards_of: dict[int, dict[int, set[str]]] | None = None) -> list[Row]:
    """The rows (domains, then shards when `shards_of` names each spike batch's samples' shards: spike number ->
    sample index -> {"domain/shard"}), flagged as the module doc says."""
    spikes = spike_batches(events)
    if not spikes:
        return []
    total = sum(len(e["batch_samples"]) for e in spikes)
    counts: dict[str, int] = {}
    expected: dict[str, float] = {}
    for number, event in enumerate(spikes):
        shares = domain_shares(event, tokens)
        size = len(event["batch_samples"])
        for name, share in shares.items():
            expected[name] = expected.get(name, 0.0) + share * size / total
            for shard, shard_tokens in tokens.get(name, {}).items():
                key = f"{name}/{shard}"
                domain_tokens = sum(tokens[name].values()) or 1
                expected[key] = expected.get(key, 0.0) + share * shard_tokens / domain_tokens * size / total
        for index, domain, _ in event["batch_samples"]:
            counts[domain] = counts.get(domain, 0) + 1
            for key in (shards_of or {}).get(number, {}).get(int(index), set()):
                counts[key] = counts.get(key, 0) + 1
    keys = [k for k in expected if "/" not in k] + ([k for k in expected if "/" in k] if shards_of else [])
    rows = [Row(key, counts.get(key, 0), total, expected[key], binomial_tail(counts.get(key, 0), total, expected[key]))
            for key in keys]
    for row in rows:
        row.flagged = row.tail < ALPHA / len(rows)
    return rows


def training_tokens(data_root: str | Path) -> dict[str, dict[str, int]]:
    """domain -> train shard -> tokens, from the data root's manifest; empty when it cannot be read."""
    from data.manifest import load_manifest

    try:
        manifest = load_manifest(Path(data_root))
    except Exception:  # the report is made where the data may not be: attribution by domain weight only
        return {}
    out: dict[str, dict[str, int]] = {}
    for name, record in manifest.get("domains", {}).items():
        shards = record.get("splits", {}).get("train", {}).get("shards", [])
        out[name] = {str(s.get("name")): int(s.get("tokens", 0)) for s in shards if s.get("name")}
    return out


def spike_shards(run_dir: Path, events: list[dict[str, Any]]) -> dict[int, dict[int, set[str]]] | None:
    """Spike number -> sample index -> the `domain/shard`s it holds, read back from the run's data (the stream the
    run trained, pretrain/step_samples.py); None when the data cannot be read."""
    from data.provenance import sample_pieces
    from pretrain.step_samples import StepSamplesError, open_source, step_config, stream_domain

    out: dict[int, dict[int, set[str]]] = {}
    sources: dict[str, Any] = {}  # one per config the spikes trained under: opening the data reads every index
    try:
        for number, event in enumerate(spike_batches(events)):
            cfg = step_config(run_dir, int(event["step"]))
            if repr(cfg) not in sources:
                sources[repr(cfg)] = open_source(cfg, run_dir)
            source = sources[repr(cfg)]
            held: dict[int, set[str]] = {}
            for index, _, _ in event["batch_samples"]:
                stream, _, sample, samples = source.origin(int(index))
                domain = stream_domain(source, stream)
                held[int(index)] = {f"{domain}/{piece.shard}" for piece in sample_pieces(samples, sample)}
            out[number] = held
    except (StepSamplesError, ValueError, OSError, KeyError):
        return None
    return out


# -- the report's blocks ------------------------------------------------------------------------------------
def attribution_blocks(run_dir: Path, config: dict[str, Any], events: list[dict[str, Any]]) -> list:
    """"Spike attribution": the table of the module doc (shards too when the run's data is readable here)."""
    if not spike_batches(events):
        return []
    tokens = training_tokens((config.get("data") or {}).get("root", ""))
    shards = spike_shards(run_dir, events) if tokens else None
    rows = attribution(events, tokens, shards)
    how = ("domains and shards (the samples' shards read back from the run's data)" if shards else
           "domains only (the run's data is not readable here: shards are not named)")
    table = [[row.source, f"{row.count:,} of {row.total:,}", f"{100 * row.count / row.total:.1f}%",
              f"{100 * row.expected:.1f}%", f"{row.tail:.2g}", "more than chance" if row.flagged else ""]
             for row in rows]
    return [("h2", "Spike attribution"),
            ("p", f"Each source's share of the samples of the {len(spike_batches(events))} spike batch(es) against its "
                  f"share of what the run trains, by {how}. P(X >= k): the chance of at least that many under the "
                  f"source's share (binomial); flagged below {ALPHA:g} / {len(rows)} rows."),
            ("table", (["source", "spike-batch samples", "share", "expected", "P(X >= k)", ""], table))]


def replay_blocks(replays: dict[int, dict[str, Any]]) -> list:
    """"Was it the data or the state?": each replayed spike's verdict and its arms' loss curves (`ayumi replay`)."""
    if not replays:
        return []
    blocks: list = [("h2", "Was it the data or the state? (ayumi replay)"),
                    ("p", "Each replayed spike's three arms: (a) the pre-spike checkpoint on the same batches, (b) an "
                          "earlier checkpoint on the spike's batches, (c) the pre-spike checkpoint on other batches of "
                          "the stage. `*`: a step the arm's detector called a spike at, `!`: one it flagged as an outlier.")]
    for record in sorted(replays.values(), key=lambda r: r["spike"]):
        blocks.append(("p", f"Spike {record['spike']} at step {record['step']:,}: **{record['verdict']}**: "
                            f"{record['why']}."))
        rows = []
        for arm in record["arms"]:
            losses = ", ".join(f"{loss:.3f}{'*' if step in arm['spike_steps'] else '!' if step in arm['outlier_steps'] else ''}"
                               for step, loss in arm["losses"])
            rows.append([f"({arm['name']})", f"{arm['checkpoint_step']:,}", f"{arm['feed_sample']:,}",
                         "yes" if arm["recurred"] else "no", losses])
        blocks.append(("table", (["arm", "checkpoint step", "first sample", "recurred", "loss per step"], rows)))
    return blocks
