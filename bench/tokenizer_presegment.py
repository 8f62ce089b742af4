"""Study: Japanese pre-segmentation (tokenizer.domains.ja.presegment) vs none, on real text.

A study, not a gate (bench/README.md): presegment is off by default because it costs Japanese
chars/token (docs/tokenizer.md); this script shows by how much, and exits 0 whatever it finds.

The corpora of bench/tokenizer_build.py (Japanese: Debian's manpages-ja rendered with groff; English,
math, code as there), sampled once per size, so every build of a size sees the same documents:

  sizes   demo_8k = the demo preset (8k); 16k, 32k = the ~50k preset's shares and sample proportions
          scaled as bench/tokenizer_build.py's bench_overrides does, but with all the Japanese text
          (8.7 MB: a presegmented sample supports fewer pieces, at most ~26.8k here against ~81k);
  corpus  ja  = the Japanese sample alone (its share of the preset as total_vocab, the other domains
               disabled: the ja model merged with nothing else), mix = all four domains (the preset);
  ja model trained with presegment none (baseline) and each analyzer that imports here (ours).

Measured on the ja held-out documents of the same sample (never trained on): chars/token of the merged
model (tokenizer/evaluate.py, as `build` reports it), the share of its tokens that cross a word boundary
by each analyzer (a token whose text spans the end of one word and the start of the next), and the share
of the ja model's multi-character pieces in the merged vocabulary that each analyzer splits into two or
more words when given the piece alone (context-free, so not 0 even for presegmented training).
Also, per size: the ja model alone at its share trained plain, on word counts (what presegment does)
and through SentencePiece's pretokenization_delimiter (what it does not: tokenizer/presegment.py says
why), and the time to segment the sample and to train that model (interleaved rounds, medians).

    .venv/bin/python bench/tokenizer_presegment.py --work /tmp/tokbench [--sizes demo_8k,16k,32k]
        [--corpus ja,mix] [--analyzers fugashi,sudachi] [--threads 2] [--timing-rounds 3] [--no-mechanisms]
    # smallest setting (~30 s once the corpora are cached): one size, the ja model alone, one analyzer
    .venv/bin/python bench/tokenizer_presegment.py --sizes demo_8k --corpus ja --analyzers fugashi \\
        --timing-rounds 0 --no-mechanisms

Ends with one line per (size, corpus, analyzer), higher chars/token being better; ok=study, since the
figure is reported, not judged; the target is what presegment would have to reach to be turned on:
RESULT tokenizer_presegment_<analyzer>_<corpus>_<size> ours=<chars/token> baseline=<chars/token none>
       ratio=<r> target=>=1.0 ok=study spread=... n=1 load=... cpus=...
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

TARGET = ">=1.0"
"""Ja chars/token with presegment ÷ without: what would turn it on (it does not reach it: kept off)."""

SIZES = {"demo_8k": None, "16k": 16000, "32k": 32000}
"""Size name → total vocab of the scaled ~50k preset (None: the demo_8k preset as shipped)."""


def size_overrides(size: str, corpora: dict[str, Path], threads: int) -> list[str]:
    """Hydra overrides of the mixture build at this size."""
    from tokenizer_build import bench_overrides

    if SIZES[size] is None:
        return ["tokenizer=demo_8k", f"tokenizer.num_threads={threads}"] + \
               [f"tokenizer.inputs.{d}={p}" for d, p in corpora.items()]
    # All the Japanese text (~8.7 MB after the held-out share), not the preset's 40% of the sample bytes: a
    # presegmented sample supports fewer pieces (8.7 MB: at most ~26.8k with either analyzer; none: ~81k).
    return bench_overrides(corpora, SIZES[size] / 12000, threads) + ["tokenizer.domains.ja.sample_bytes=100000000"]


def config(overrides: list[str], work: Path):
    from tokenizer.cli import compose, to_object

    return to_object(compose(overrides + [f"output_dir={work}", "overwrite=true"])).tokenizer


def ja_only(cfg):
    """The mixture's config reduced to its ja model at the same size (nothing else to merge)."""
    # vocab_size=16: a dropped domain that counts for nothing, so the ja size is not rescaled (docs/tokenizer.md).
    others = {d: dataclasses.replace(c, enabled=False, vocab_size=16) for d, c in cfg.domains.items() if d != "ja"}
    return dataclasses.replace(cfg, total_vocab=cfg.domains["ja"].vocab_size, pad_to_multiple_of=0,
                               domains={"ja": cfg.domains["ja"], **others})


def with_presegment(cfg, analyzer: str):
    ja = dataclasses.replace(cfg.domains["ja"], presegment=analyzer)
    return dataclasses.replace(cfg, domains={**cfg.domains, "ja": ja})


# ----------------------------------------------------------------------------------------------
# Word-boundary measurements
# ----------------------------------------------------------------------------------------------


def byte_cuts(text: str, cuts: list[int]) -> list[int]:
    """Character offsets → UTF-8 byte offsets (SentencePiece reports token spans in bytes)."""
    positions, total = [], 0
    want = iter(cuts)
    nxt = next(want, None)
    for i, ch in enumerate(text):
        while nxt is not None and nxt == i:
            positions.append(total)
            nxt = next(want, None)
        total += len(ch.encode("utf-8"))
    return positions


def heldout_cuts(texts: list[str], analyzer: str) -> list[list[int]]:
    """Each held-out document's word boundaries by `analyzer`, as byte offsets."""
    from tokenizer.presegment import document_boundaries, load_analyzer

    analyze = load_analyzer(analyzer)
    return [byte_cuts(t, document_boundaries(t, analyze)) for t in texts]


def token_crossing_share(model: Path, texts: list[str], cuts: list[list[int]]) -> float:
    """Share of the model's tokens on `texts` whose span contains a word boundary."""
    import sentencepiece as spm

    from tokenizer.presegment import crossing_tokens

    sp = spm.SentencePieceProcessor(model_file=str(model))
    crossing = tokens = 0
    for text, doc_cuts in zip(texts, cuts):
        pieces = sp.encode(text, return_type="proto").pieces  # begin/end: byte offsets into text
        tokens += len(pieces)
        crossing += crossing_tokens(((p.begin, p.end) for p in pieces), doc_cuts)
    return crossing / max(1, tokens)


def ja_vocab_pieces(out: Path) -> list[str]:
    """The ja model's multi-character pieces that made it into the merged vocabulary (▁ read as a space)."""
    from tokenizer.merge import load_proto

    merged = {p.piece for p in load_proto(out / "tokenizer.model").pieces}
    ja = load_proto(out / "domains" / "ja.model")
    texts = [p.piece.replace("▁", " ").strip() for p in ja.pieces if p.type == p.NORMAL and p.piece in merged]
    return [t for t in texts if len(t) >= 2]


def chars_per_token(model: Path, texts: list[str]) -> float:
    from tokenizer import evaluate as ev

    return ev.measure(ev.spm_encoder("m", model), texts)["chars_per_token"]


def vocab_crossing_share(pieces: list[str], analyzer: str) -> float:
    """Share of pieces the analyzer, given the piece alone, splits into two or more words."""
    from tokenizer.presegment import load_analyzer, word_boundaries

    analyze = load_analyzer(analyzer)
    return sum(1 for p in pieces if word_boundaries(p, analyze)) / max(1, len(pieces))


DELIMITER = "\ue000"
"""Word boundary for SentencePiece's pretokenization_delimiter (private use: in no text, kept by every normaliser)."""


def delimiter_model(cfg, sample, analyzer: str, out: Path) -> Path:
    """The ja model at its share trained with `pretokenization_delimiter` between the analyzer's words."""
    from tokenizer.presegment import load_analyzer, split_words
    from tokenizer.train_spm import train_model, trainer_options

    analyze = load_analyzer(analyzer)
    path = sample.train_path.with_name(f"ja.train.{analyzer}.delimited.txt")
    chars = delimiters = 0
    with open(sample.train_path, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
        for line in src:
            words = split_words(line.rstrip("\n"), analyze)
            dst.write(DELIMITER.join(words) + "\n")
            chars, delimiters = chars + len(line), delimiters + len(words) - 1
    dcfg = cfg.domains["ja"]
    options = trainer_options(cfg, dcfg, dcfg.vocab_size)
    options["pretokenization_delimiter"] = DELIMITER
    # SentencePiece counts the delimiters among the characters it covers (and covers them first): keep the
    # real characters' uncovered mass, else ~60 more rare kanji fall to bytes at 0.9995 (alphabet 1054 vs 1113).
    coverage = options["character_coverage"]
    if coverage < 1.0:
        options["character_coverage"] = 1.0 - (1.0 - coverage) * chars / (chars + delimiters)
    return train_model([path], out / f"ja-{analyzer}-delimiter", options, f"ja {analyzer} delimiter")


def mechanism_rows(size, mix_cfg, samples, analyzers, work, ja_texts) -> list[dict]:
    """The ja model alone at its share, trained plain, on word counts (ours) and through the delimiter."""
    from tokenizer.train_spm import train_domain_model

    cfg, out = ja_only(mix_cfg), work / "mechanism"
    plain = chars_per_token(train_domain_model(cfg, cfg.domains["ja"], samples["ja"], out / "none", "ja"), ja_texts)
    rows = []
    for analyzer in analyzers:
        dcfg = with_presegment(cfg, analyzer).domains["ja"]
        words = chars_per_token(train_domain_model(cfg, dcfg, samples["ja"], out / analyzer, "ja"), ja_texts)
        try:
            delimited = chars_per_token(delimiter_model(cfg, samples["ja"], analyzer, out), ja_texts)
        except ValueError as err:  # the delimiter's seeds hold fewer pieces still (8.7 MB: ~17k)
            print(f"[bench] {size} ja {analyzer} through the delimiter: training failed: {err}")
            delimited = None
        rows.append(dict(size=size, analyzer=analyzer, vocab=cfg.domains["ja"].vocab_size, none=plain,
                         words=words, delimiter=delimited))
        print(f"[bench] {size} ja model alone at {cfg.domains['ja'].vocab_size}: none {plain:.4f}, {analyzer} word "
              f"counts {words:.4f}, {analyzer} delimiter " + (f"{delimited:.4f}" if delimited else "-"), flush=True)
    return rows


# ----------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------


def build_one(cfg, samples: dict, out: Path) -> dict:
    """Build into `out` from these samples; the figures of the merged model."""
    from tokenizer.build import build_tokenizer

    start = time.time()
    meta = build_tokenizer(cfg, out, overwrite=True, samples=samples, log=lambda _: None)
    seconds = time.time() - start
    results = json.loads((out / "eval.json").read_text(encoding="utf-8"))["results"]["merged"]
    return {"ja_cpt": results["domains"]["ja"]["chars_per_token"], "all_tokens": results["all"]["tokens"],
            "cpt": {d: m["chars_per_token"] for d, m in results["domains"].items()},
            "build_s": seconds, "train_domains_s": meta["timings"]["train_domains_s"]}


def build_row(size, corpus, analyzer, mix_cfg, samples, work, ja_texts, cuts, analyzers) -> dict | None:
    """Build one (corpus, presegment) tokenizer from the size's samples and measure it; None if it cannot be built."""
    from tokenizer.merge import load_proto

    cfg = with_presegment(mix_cfg if corpus == "mix" else ja_only(mix_cfg), analyzer)
    out = work / f"tok-{corpus}-{analyzer}"
    try:
        row = build_one(cfg, samples if corpus == "mix" else {"ja": samples["ja"]}, out)
    except ValueError as err:  # e.g. a vocab a sample cannot support
        print(f"[bench] {size} {corpus} {analyzer}: build failed: {err}")
        return None
    pieces = ja_vocab_pieces(out)
    row.update(size=size, corpus=corpus, analyzer=analyzer, ja_pieces=len(pieces),
               ja_model_size=len(load_proto(out / "domains" / "ja.model").pieces),
               token_cross={a: token_crossing_share(out / "tokenizer.model", ja_texts, cuts[a]) for a in analyzers},
               vocab_cross={a: vocab_crossing_share(pieces, a) for a in analyzers})
    print(f"[bench] {size} {corpus:<3} {analyzer:<8} ja chars/token {row['ja_cpt']:.4f} (ja model trained at "
          f"{row['ja_model_size']}); tokens crossing a word "
          + ", ".join(f"{a} {100 * v:.1f}%" for a, v in row["token_cross"].items())
          + "; ja pieces crossing " + ", ".join(f"{a} {100 * v:.1f}%" for a, v in row["vocab_cross"].items())
          + f"; build {row['build_s']:.1f}s", flush=True)
    return row


def run_size(size: str, corpora: dict, args, analyzers: list[str]) -> tuple[list[dict], list[dict], dict]:
    """Every build of one size from one sample: (build rows, mechanism rows, the ja model's timing)."""
    from tokenizer.build import _heldout_texts, sample_all
    from tokenizer.sample import presegment_sample

    work = args.work / "presegment" / size
    mix_cfg = config(size_overrides(size, corpora, args.threads), work / "tok")
    samples = sample_all(mix_cfg, work / "samples", log=lambda _: None)
    ja_texts = _heldout_texts({"ja": samples["ja"]})["ja"]
    print(f"[bench] {size}: ja sample {samples['ja'].train_bytes / 1e6:.2f} MB / {samples['ja'].train_lines} lines, "
          f"held out {len(ja_texts)} docs / {sum(map(len, ja_texts))} chars; mix total_vocab {mix_cfg.total_vocab}, "
          f"shares {', '.join(f'{d} {c.vocab_size}' for d, c in mix_cfg.domains.items())}")
    cuts = {a: heldout_cuts(ja_texts, a) for a in analyzers}
    for analyzer in analyzers:  # segmented once per size, before any build
        presegment_sample(samples["ja"], analyzer)
    rows = [build_row(size, corpus, analyzer, mix_cfg, samples, work, ja_texts, cuts, analyzers)
            for analyzer in ["none"] + analyzers for corpus in args.corpus]
    mechanisms = mechanism_rows(size, mix_cfg, samples, analyzers, work, ja_texts) if args.mechanisms else []
    times = timing(size, mix_cfg, samples, analyzers, args.timing_rounds, work) if args.timing_rounds else {}
    return [r for r in rows if r], mechanisms, times


def timing(size: str, mix_cfg, samples: dict, analyzers: list[str], rounds: int, work: Path) -> dict:
    """Median seconds to train the ja model at its share (and to segment its sample) per presegment, rounds
    interleaved so that other load on the machine hits every variant alike."""
    import statistics

    from tokenizer.presegment import write_word_counts
    from tokenizer.train_spm import train_domain_model

    cfg = ja_only(mix_cfg)
    ja = samples["ja"]
    train: dict[str, list[float]] = {a: [] for a in ["none"] + analyzers}
    segment: dict[str, list[float]] = {a: [] for a in analyzers}
    for _ in range(rounds):
        for analyzer in ["none"] + analyzers:
            if analyzer != "none":
                stats = write_word_counts(ja.train_path, work / f"timing.{analyzer}.tsv", analyzer, cfg.add_dummy_prefix)
                segment[analyzer].append(stats.seconds)
            dcfg = with_presegment(cfg, analyzer).domains["ja"]
            start = time.time()
            train_domain_model(cfg, dcfg, ja, work / "timing" / analyzer, analyzer)
            train[analyzer].append(time.time() - start)
    result = {a: {"train_s": statistics.median(t), "segment_s": statistics.median(segment[a]) if a in segment else 0.0}
              for a, t in train.items()}
    print(f"[bench] {size} time to make the ja model ({cfg.domains['ja'].vocab_size} pieces, "
          f"{ja.train_bytes / 1e6:.1f} MB; median of {rounds}): "
          + ", ".join(f"{a} {r['segment_s']:.1f}s segment + {r['train_s']:.1f}s train" for a, r in result.items()),
          flush=True)
    return result


# ----------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------


def table(rows: list[dict], analyzers: list[str]) -> str:
    """Markdown table of every build (the docs' table)."""
    head = ["size", "corpus", "presegment", "ja chars/token", "vs none"] + \
           [f"tokens crossing ({a})" for a in analyzers] + [f"ja pieces crossing ({a})" for a in analyzers] + \
           ["other domains chars/token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {(r["size"], r["corpus"]): r for r in rows if r["analyzer"] == "none"}
    for r in rows:
        b = base.get((r["size"], r["corpus"]))
        change = f"{100 * (r['ja_cpt'] / b['ja_cpt'] - 1):+.2f}%" if b and r is not b else ""
        cells = [r["size"], r["corpus"], r["analyzer"], f"{r['ja_cpt']:.4f}", change]
        cells += [f"{100 * r['token_cross'][a]:.1f}%" for a in analyzers]
        cells += [f"{100 * r['vocab_cross'][a]:.1f}%" for a in analyzers]
        cells += [", ".join(f"{d} {v:.3f}" for d, v in r["cpt"].items() if d != "ja") or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mechanism_table(rows: list[dict]) -> str:
    """Markdown table: the ja model alone at its share, word counts vs pretokenization_delimiter."""
    lines = ["| size | ja pieces | analyzer | none | word counts (ours) | pretokenization_delimiter |", "|---|---|---|---|---|---|"]
    for r in rows:
        delimited = f"{r['delimiter']:.4f} ({100 * (r['delimiter'] / r['none'] - 1):+.1f}%)" if r["delimiter"] else "cannot"
        lines.append(f"| {r['size']} | {r['vocab']} | {r['analyzer']} | {r['none']:.4f} | "
                     f"{r['words']:.4f} ({100 * (r['words'] / r['none'] - 1):+.1f}%) | {delimited} |")
    return "\n".join(lines)


def timing_table(times: dict, analyzers: list[str]) -> str:
    """Markdown table of the ja model's making time per size (medians of the interleaved rounds)."""
    lines = ["| size | " + " | ".join(["none: train s"] + [f"{a}: segment s + train s" for a in analyzers]) + " |",
             "|" + "---|" * (2 + len(analyzers))]
    for size, result in times.items():
        if result:
            cells = [f"{result['none']['train_s']:.1f}"]
            cells += [f"{result[a]['segment_s']:.1f} + {result[a]['train_s']:.1f}" for a in analyzers]
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def available(names: list[str]) -> list[str]:
    from tokenizer.presegment import PresegmentUnavailable, load_analyzer

    ok = []
    for name in names:
        try:
            load_analyzer(name)
            ok.append(name)
        except PresegmentUnavailable as err:
            print(f"[bench] skipping {name}: {err}")
    return ok


def main() -> int:
    from tokenizer_build import prepare_corpora

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench" / "tokenizer_build",
                        help="corpora (shared with bench/tokenizer_build.py) and builds; default .cache/bench/tokenizer_build")
    parser.add_argument("--sizes", default="demo_8k,16k,32k", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--corpus", default="ja,mix", type=lambda s: s.split(","),
                        help="ja (the ja model alone), mix (all four domains), or both")
    parser.add_argument("--analyzers", default="fugashi,sudachi", help="those that do not import here are skipped")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timing-rounds", type=int, default=3, help="interleaved rounds timing the ja model (0: none)")
    parser.add_argument("--no-mechanisms", dest="mechanisms", action="store_false",
                        help="skip the word counts vs pretokenization_delimiter comparison")
    args = parser.parse_args()
    print(machine_line())

    corpora = prepare_corpora(args.work)
    if "ja" not in corpora:
        print("[bench] no Japanese corpus (manpages-ja): nothing measured")
        return 0
    analyzers = available(args.analyzers.split(","))
    if not analyzers:
        print(f"[bench] none of the analyzers {args.analyzers} imports here: nothing measured")
        return 0
    rows, mechanisms, times = [], [], {}
    for size in args.sizes.split(","):
        size_rows, size_mechanisms, times[size] = run_size(size, corpora, args, analyzers)
        rows, mechanisms = rows + size_rows, mechanisms + size_mechanisms
    print(table(rows, analyzers))
    if mechanisms:  # --no-mechanisms and --timing-rounds 0 leave these empty: no bare headers
        print(mechanism_table(mechanisms))
    if any(times.values()):
        print(timing_table(times, analyzers))
    (args.work / "presegment" / "results.json").write_text(
        json.dumps({"rows": rows, "mechanisms": mechanisms, "timing": times}, indent=1), encoding="utf-8")
    print("[bench] a study: ok=study lines report presegment against none, they do not judge it "
          f"(it would be turned on at ja chars/token ratio {TARGET}; docs/tokenizer.md has the verdict)")
    print("\n".join(study_lines(rows)))
    return 0


def study_lines(rows: list[dict]) -> list[str]:
    """One ok=study RESULT line per presegmented build, against the same size and corpus without it."""
    base = {(r["size"], r["corpus"]): r["ja_cpt"] for r in rows if r["analyzer"] == "none"}
    # Chars/token of fixed models on fixed held-out text: one measurement (n=1) each.
    return [result_line(f"tokenizer_presegment_{r['analyzer']}_{r['corpus']}_{r['size']}", r["ja_cpt"],
                        base[(r["size"], r["corpus"])], TARGET, unit="chars/tok", study=True)
            for r in rows if r["analyzer"] != "none" and (r["size"], r["corpus"]) in base]


if __name__ == "__main__":
    sys.exit(main())
