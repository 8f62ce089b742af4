"""`ayumi data inspect DATA_ROOT`: what a prepared data root holds, per domain, with decoded samples."""
from __future__ import annotations

import os
from pathlib import Path

from data.integrity import repair_hint
from data.manifest import load_manifest, shard_prefix
from data.shards import ShardReader


def _number(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:g}"


def summary_table(manifest: dict) -> list[str]:
    """One line per domain: kept/dropped docs, train/val tokens, shards and bytes."""
    header = f"{'domain':<14}{'read':>9}{'kept':>9}{'dropped':>9}{'train tok':>11}{'val tok':>10}{'val docs':>9}{'shards':>7}{'bytes':>9}"
    lines = [header, "-" * len(header)]
    for name, record in manifest["domains"].items():
        splits = record["splits"]
        train, val = splits.get("train", {}), splits.get("val", {})
        lines.append(
            f"{name:<14}{_number(record['docs_read']):>9}{_number(record['docs_kept']):>9}"
            f"{_number(sum(record['dropped'].values())):>9}{_number(train.get('tokens', 0)):>11}"
            f"{_number(val.get('tokens', 0)):>10}{val.get('docs', 0):>9}"
            f"{sum(len(s['shards']) for s in splits.values()):>7}{_number(sum(s['bytes'] for s in splits.values())):>9}"
        )
    totals = manifest["totals"]
    lines.append(f"total: {totals['docs_kept']:,} docs, {totals['tokens']:,} tokens, {totals['shards']} shards, "
                 f"{totals['bytes'] / 2**20:.1f} MiB")
    return lines


def drop_lines(manifest: dict) -> list[str]:
    """Per domain, what was dropped (and what the reader skipped) and why, with the first location of each reason."""
    lines = []
    for name, record in manifest["domains"].items():
        for kind in ("dropped", "skipped"):
            for reason, count in record.get(kind, {}).items():
                where = record.get("drop_examples", {}).get(reason, [])
                label = "" if kind == "dropped" else " (skipped by the reader: not a document)"
                lines.append(f"  {name}: {reason}={count:,}{label}" + (f" (e.g. {where[0]})" if where else ""))
    return lines


def task_lines(root: Path, manifest: dict) -> list[str]:
    """The per-task table of a root made by `--tasks N --finish`, for the domains it still describes."""
    from data.finish import task_table
    from data.manifest import read_sealed
    from data.task_plan import SUMMARY_NAME, TASKS_DIR

    summary = read_sealed(root / TASKS_DIR / SUMMARY_NAME)
    if summary is None:
        return []
    current = {name: entry for name, entry in summary["domains"].items()
               if manifest["domains"].get(name, {}).get("fingerprint") == entry["fingerprint"]}
    return task_table({"domains": current})


def _decoder(manifest: dict, tokenizer_dir: str | None):
    """A decode function for the manifest's tokenizer (any declared kind), or (None, reason) when it is not available."""
    from tokenizer.declared import load_declared_tokenizer
    from tokenizer.info import TokenizerNotFoundError

    expected = manifest["tokenizer"]["sha256"]
    path = tokenizer_dir or manifest["tokenizer"]["model_path"]
    if not path:
        return None, "the manifest names no tokenizer (pass --tokenizer-dir): showing token ids"
    try:
        tokenizer = load_declared_tokenizer(path)
    except TokenizerNotFoundError as err:
        if tokenizer_dir:
            raise
        return None, f"{err} (pass --tokenizer-dir): showing token ids"
    if tokenizer.sha256 != expected:
        return None, (f"tokenizer {path} has sha256 {tokenizer.sha256[:12]}…, the shards were made with "
                      f"{str(expected)[:12]}…: showing token ids")
    return tokenizer.decode, None


def sample_lines(root: Path, manifest: dict, samples: int, chars: int, tokenizer_dir: str | None) -> list[str]:
    """The first `samples` documents of each domain's train and val shards, decoded (EOS shown as ⟨eos⟩)."""
    decode, note = _decoder(manifest, tokenizer_dir)
    lines = [f"({note})"] if note else []
    for name, record in manifest["domains"].items():
        eos = record["tokenizer"].get("eos_id")
        for split, info in record["splits"].items():
            if not info["shards"]:
                continue
            first = info["shards"][0]
            reader = ShardReader(shard_prefix(root, name, split, first), repair_hint(record, first))
            for index in range(min(samples, len(reader))):
                ids = reader[index].tolist()
                has_eos = bool(ids) and ids[-1] == eos
                body = ids[:-1] if has_eos else ids
                text = decode(body) if decode else " ".join(map(str, body[:64]))
                shown = text[:chars].replace("\n", "⏎") + ("…" if len(text) > chars else "")
                lines.append(f"  {name}/{split} #{index} ({len(ids)} tokens): {shown}{' ⟨eos⟩' if has_eos else ''}")
    return lines


def inspect_root(root: str | os.PathLike, samples: int = 2, chars: int = 160, tokenizer_dir: str | None = None) -> str:
    """The report `ayumi data inspect` prints."""
    root = Path(root)
    manifest = load_manifest(root)
    tokenizer = manifest["tokenizer"]
    overlap = manifest["overlap_check"]
    lines = [
        f"data root {root} ({manifest['name']}): tokenizer {tokenizer['model_path']} sha256 {str(tokenizer['sha256'])[:16]}… "
        f"vocab {tokenizer['vocab_size']}",
        "",
        *summary_table(manifest),
        "",
        f"train/val overlap check: passed ({overlap['val_docs']:,} val docs against {overlap['train_docs_checked']:,} train docs)",
    ]
    megatron = [f"  {name}: {len(info['shards'])} {split} prefix(es), e.g. {info['shards'][0]['prefix']}"
                + (" (EOD appended when read)" if info["shards"][0].get("append_eod") else "")
                for name, record in manifest["domains"].items()
                for split, info in record["splits"].items() if info["shards"] and info["shards"][0].get("prefix")]
    if megatron:
        lines += ["", "Megatron data (read in place):", *megatron]
    dropped = drop_lines(manifest)
    if dropped:
        lines += ["", "dropped:", *dropped]
    tasks = task_lines(root, manifest)
    if tasks:
        lines += ["", "per task (prepared as array tasks):", *tasks]
    if samples > 0:
        lines += ["", "samples:", *sample_lines(root, manifest, samples, chars, tokenizer_dir)]
    return "\n".join(lines)
