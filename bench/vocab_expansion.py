"""Benchmark: chars/token on held-out Japanese (and English) before and after `ayumi tokenizer expand`.

    .venv/bin/python bench/vocab_expansion.py [--corpus .cache/demo_corpus] [--base-vocab 8000] [--add 1000,2800,8000]

No Llama 2 tokenizer can be downloaded here, so the base is a stand-in built the same way: a
SentencePiece BPE model with byte fallback trained on English (and code) only, as Llama 2's 32k
vocabulary is English-dominated. The source is a SentencePiece unigram model trained on Japanese,
as `ayumi tokenizer build` trains its per-domain models. Both are trained on 90% of the documents
(by a hash of each document); chars/token is measured on the other 10%, which neither saw.
The corpus is the demo's (Japanese man pages, Jane Austen, Python): a complete one in --corpus is reused
(`ayumi demo` and `ayumi demo corpus` write it there), else the bench builds it there as `ayumi demo corpus`
does (Debian packages fetched with `apt-get download` into a demo_packages folder beside it, ~1 min; where
that is impossible it says why and measures nothing).

Baseline = the base tokenizer; ours = base + N new pieces (ids of the base unchanged). Swallow went
from 32,000 to 43,176 pieces (+35%); `--add` sizes the expansion the same way at this scale.
Ends with RESULT lines (chars/token ratios; higher is better for Japanese, about 1.0 for English); chars/token
of fixed models on fixed held-out text is one measurement (n=1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

NEEDED = ("en", "code", "ja_clean", "ja_raw")
"""The demo corpus's domains this bench reads."""


def documents(path: Path) -> tuple[list[str], list[str]]:
    """(train, held-out) texts of a jsonl file, split 90/10 by a hash of each text."""
    train, held = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        (held if zlib.crc32(text.encode("utf-8")) % 10 == 0 else train).append(text)
    return train, held


def train_model(prefix: Path, texts: list[str], vocab: int, model_type: str) -> Path:
    import sentencepiece as spm

    corpus = prefix.with_suffix(".txt")
    corpus.write_text("\n".join(t.replace("\n", " ") for t in texts), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=vocab, model_type=model_type,
                                   byte_fallback=True, character_coverage=0.9995, max_sentence_length=1 << 16,
                                   input_sentence_size=200_000, shuffle_input_sentence=True, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2, num_threads=2)
    return prefix.with_suffix(".model")


def chars_per_token(model: Path, texts: list[str]) -> float:
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(model))
    return sum(len(t) for t in texts) / sum(len(ids) for ids in processor.encode(texts))


def demo_corpus(folder: Path) -> bool:
    """Whether `folder` holds the domains this bench reads, after building the demo corpus there if needed."""
    from demo.corpus import DemoCorpusError, build_demo_corpus, load_manifest

    manifest = load_manifest(folder)
    if not (manifest and manifest.get("complete")):
        print(f"[bench] no complete demo corpus in {folder}: building it (as `ayumi demo corpus --out {folder}`)")
        try:
            manifest = build_demo_corpus(folder)
        except DemoCorpusError as err:
            print(f"[bench] the demo corpus cannot be built here: {err}", file=sys.stderr)
            return False
    missing = [name for name in NEEDED if not (folder / f"{name}.jsonl").is_file()]
    if missing:
        reasons = "; ".join(sorted(set(manifest.get("missing", {}).values()))) or "not written"
        print(f"[bench] the demo corpus in {folder} lacks {', '.join(missing)} ({reasons}): nothing measured",
              file=sys.stderr)
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=None,
                        help="demo corpus folder, reused or built (default: $AYUMI_DATA_ROOT/demo_corpus, "
                             "AYUMI_DATA_ROOT defaulting to .cache, as `ayumi demo corpus`)")
    parser.add_argument("--base-vocab", type=int, default=8000)
    parser.add_argument("--source-vocab", type=int, default=8000)
    parser.add_argument("--add", default="1000,2800,8000", help="new pieces per expansion, comma-separated")
    args = parser.parse_args()
    print(machine_line())
    from tokenizer.expand import expand

    args.corpus = args.corpus or Path(os.environ.get("AYUMI_DATA_ROOT", REPO / ".cache")) / "demo_corpus"
    if not demo_corpus(args.corpus.resolve()):
        return 2
    en_train, en_held = documents(args.corpus / "en.jsonl")
    code_train, _ = documents(args.corpus / "code.jsonl")
    ja_train, ja_held = [], []
    for name in ("ja_clean", "ja_raw"):
        train, held = documents(args.corpus / f"{name}.jsonl")
        ja_train += train
        ja_held += held
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        base = train_model(work / "base", en_train + code_train, args.base_vocab, "bpe")
        source = train_model(work / "ja", ja_train, args.source_vocab, "unigram")
        before = {"ja": chars_per_token(base, ja_held), "en": chars_per_token(base, en_held)}
        print(f"[bench] held-out: {len(ja_held)} Japanese docs ({sum(map(len, ja_held)):,} chars), "
              f"{len(en_held)} English docs ({sum(map(len, en_held)):,} chars)")
        print(f"[bench] base (English+code BPE, {args.base_vocab:,} pieces): ja {before['ja']:.3f} chars/token, "
              f"en {before['en']:.3f}")
        results = []
        for added in (int(n) for n in args.add.split(",")):
            result = expand(base, source, args.base_vocab + added, work / f"expanded_{added}")
            model = work / f"expanded_{added}" / "tokenizer.model"
            after = {"ja": chars_per_token(model, ja_held), "en": chars_per_token(model, en_held)}
            print(f"[bench] + {result.added:,} pieces ({result.skipped_unreachable} unreachable left out) = "
                  f"{args.base_vocab + result.added:,}: ja {after['ja']:.3f} chars/token ({after['ja'] / before['ja']:.2f}x), "
                  f"en {after['en']:.3f} ({after['en'] / before['en']:.3f}x)")
            results.append((result.added, after))
        for added, after in results:
            print(result_line(f"ja_chars_per_token_plus_{added}", after["ja"], before["ja"], ">1.0", unit="chars/tok"))
            print(result_line(f"en_chars_per_token_plus_{added}", after["en"], before["en"], ">=0.999", unit="chars/tok"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
