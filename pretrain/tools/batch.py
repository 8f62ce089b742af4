"""`ayumi batch RUN_DIR --step N` (or `--spike K`): every sample step N trained on, named down to its documents.

One row per sample, in the order the ranks trained them: the data-parallel rank, the micro batch and its row,
the domain and the stream it was read from, the curriculum stage, the documents it holds (shard, document index
in the shard's .idx, the token span inside the document) and a short preview decoded with the run's own
tokenizer (RUN_DIR/tokenizer; token ids without one). `--text` prints each sample whole; `--json` prints it all
for tools, token ids included. How the samples are found: pretrain/step_samples.py.

`--step N` shows the batch step N holds on the run's present timeline. A rollback skips the batches around a
spike, so the step that spiked was trained again on other samples. `--spike K` shows the batch spike K was called
on, as trained then, with each sample's loss from the spike's event.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PREVIEW_CHARS = 60
"""Characters of decoded text in the table's preview column."""
PREVIEW_IDS = 12
"""Token ids in the preview column when the run keeps no tokenizer."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    from common.conf import config_help

    parser = argparse.ArgumentParser(prog="ayumi batch", description=__doc__.split("\n\n")[0], epilog=config_help(
        "no config from conf/: RUN_DIR's config_history.jsonl (the config that trained the step), events.jsonl, "
        "skipped_samples.json and the data root it names", overrides=False))
    parser.add_argument("run_dir", type=Path, help="the run dir (holds events.jsonl, config_history.jsonl)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int,
                       help="the step, counted from 1 as the progress line and events.jsonl count it: its batch as it "
                            "stands now (after a rollback, the batch trained again)")
    which.add_argument("--spike", type=int,
                       help="spike K (1-based, as `ayumi report` and `ayumi replay` count them): the batch it was called "
                            "on, with each sample's loss")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--text", action="store_true", help="each sample's whole decoded text after the table")
    shown.add_argument("--json", action="store_true", help="everything as JSON (token ids included), for tools")
    return parser.parse_args(argv)


def run_decoder(run_dir: Path):
    """A function from token ids to text with the run's own tokenizer copy; None when the run keeps none."""
    from tokenizer.info import MODEL_FILE

    kept = Path(run_dir) / "tokenizer"
    models = [kept / MODEL_FILE] if (kept / MODEL_FILE).is_file() else sorted(kept.glob("*.model"))
    if not models:
        return None
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(models[0]))
    size = processor.get_piece_size()
    return lambda ids: processor.decode([i for i in ids if 0 <= i < size])


def preview(ids: list[int], decode) -> str:
    """The start of a sample on one line: decoded text, else its first token ids."""
    if decode is None:
        return " ".join(str(i) for i in ids[:PREVIEW_IDS]) + (" …" if len(ids) > PREVIEW_IDS else "")
    text = decode(ids).replace("\n", "⏎").replace("\t", " ")
    return text[:PREVIEW_CHARS] + ("…" if len(text) > PREVIEW_CHARS else "")


def header(batch) -> str:
    layout = batch.layout
    called = f"spike {batch.spike} called on " if batch.spike is not None else ""
    lines = [f"{called}step {batch.step:,}: global samples [{batch.first_sample:,}, {batch.first_sample + layout.global_batch:,}) "
             f"on {layout.dp_size} data-parallel rank(s) x {layout.grad_accum} micro batch(es) of {layout.micro_batch}"]
    if batch.stage_weights:
        lines.append("stage weights: " + ", ".join(f"{name} {weight:g}" for name, weight in batch.stage_weights.items()))
    return "\n".join(lines)


def table(batch, decode) -> str:
    from data.provenance import describe

    head = ["rank", "micro", "row", "sample", "domain", "stream", "stage", *(["loss"] if batch.losses else []),
            "documents (shard:doc[start:stop])", "preview"]
    rows = [[str(s.rank), str(s.micro), str(s.row), f"{s.index:,}", s.domain, s.stream,
             "–" if s.stage is None else str(s.stage),
             *([f"{batch.losses[s.index]:.4f}" if s.index in batch.losses else "–"] if batch.losses else []),
             describe(s.pieces), preview(s.tokens[:-1].tolist(), decode)]
            for s in batch.samples]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)]
    return "\n".join("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]])
                     for row in [head, *rows])


def as_json(batch, decode) -> str:
    from dataclasses import asdict

    samples = []
    for sample in batch.samples:
        out = sample.as_dict()
        if sample.index in batch.losses:
            out["loss"] = batch.losses[sample.index]
        if decode is not None:
            out["text"] = decode(sample.tokens[:-1].tolist())
        samples.append(out)
    return json.dumps({"step": batch.step, "spike": batch.spike, "first_sample": batch.first_sample, "layout": asdict(batch.layout),
                       "stage_weights": batch.stage_weights, "samples": samples}, ensure_ascii=False)


def main(argv: list[str] | None = None) -> int:
    from common.status import BAD_INPUT
    from pretrain.step_samples import StepSamplesError, spike_step_batch, step_batch

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        batch = step_batch(args.run_dir, args.step) if args.spike is None else spike_step_batch(args.run_dir,
                                                                                                 args.spike)
    except StepSamplesError as err:
        print(f"ayumi batch: {err}", file=sys.stderr)
        return BAD_INPUT
    decode = run_decoder(args.run_dir)
    if args.json:
        print(as_json(batch, decode))
        return 0
    print(header(batch))
    print(table(batch, decode))
    if args.text:
        for sample in batch.samples:
            ids = sample.tokens[:-1].tolist()
            text = decode(ids) if decode is not None else " ".join(map(str, ids))
            print(f"\n--- rank {sample.rank}, micro batch {sample.micro}, row {sample.row} "
                  f"(sample {sample.index:,}, {sample.domain}) ---\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
