"""The demo's cloze tasks: a few documents per language held out of training, cut into cloze examples.

The demo scores downstream tasks while it trains (`eval.downstream`, docs/downstream-eval.md). Its tasks
are made here from its own corpus, in two steps, because the second one needs the tokenizer that the
first one's output trains:

1. `hold_out` (before the tokenizer and data preparation read the corpus): a seeded draw of a few
   documents per language is set aside (Japanese: man pages of ja_clean, the filtered Japanese;
   English: chapters of Austen). The tokenizer and data preparation read copies of the corpus files
   without them, and data preparation cuts the train and validation splits from those copies, so
   neither split holds a held-out document. ja_clean's pages are ja_raw's pages too: both lose them,
   and so does any other copy that data preparation's `normalized` dedup key would equate.
2. `build_cloze_tasks`: examples cut from the held-out documents. The context is a span of one
   paragraph that ends inside a sentence; the target is what comes next: the next word in English
   (delimiter " "), the next few characters in Japanese (delimiter "").

Which targets: the demo's model (2.8 M parameters, ~1,000 steps on CPU, ~1 M tokens of which a few
hundred thousand per language) can learn frequent phrases, not facts. So an example is kept only where
the training text makes its target the usual continuation: the key before the cut (the two words before
it in English, the four characters before it in Japanese) is followed by the target in at least
MIN_SHARE of its MIN_COUNT or more occurrences in the training inputs ("I dare" -> "say", "as soon" ->
"as", "とに注意" -> "して"). A model that learns the training text's short-range statistics gets these
right, a fresh one does not, and the share it gets right rises as it learns: a curve over ~1,000 steps,
not a floor at zero. The full text of an example (context and target) must not occur in the training
inputs either: copies of boilerplate would test memory, not the language.

With the tokenizer, both ends of the target must fall where the tokenizer cuts the text anyway (the
context's tokens are the first tokens of context + target, and those of the example the first of the
example with the text after it), the target is at most MAX_TARGET_TOKENS tokens and the whole example
at most MAX_TOKENS. Otherwise exact match would ask the model for a split of the text it never saw
in training (the demo's tokenizer has pieces like "することができる"). Japanese targets are the
shortest continuation of 2 to 5 characters that passes.

Everything is seeded (SEED) and read in file order, so a corpus gives the same files byte for byte.
Files are rewritten only when their text changes: the data preparation's fingerprint (sizes and mtimes)
then still matches and a second demo reuses its shards.
"""
from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from data.clean import Cleaner, normalized_key
from data.config import CleanConfig
from demo.base import Progress

SEED = 26
"""Seeds the draw of held-out documents and the order of the examples (issue 26 brought the tasks)."""
EXAMPLES = 96
"""Examples per task file at most (the in-loop evaluation scores the first eval.downstream.max_examples)."""
MIN_COUNT = 10
"""A target's key must be followed by it at least this often in the training inputs."""
MIN_SHARE = 0.3
"""... and in at least this share of the key's occurrences."""
MAX_PER_TARGET = 3
"""Examples with one target string at most: "of" and "to" would otherwise be half the English task."""
MAX_TOKENS = 96
"""Context and target together at most, in tokens: room under the demo model's 128 positions
(conf/experiment/demo.yaml) for the prefix token, checked in tests/demo/test_cloze.py."""
MAX_TARGET_TOKENS = 3
"""A target's tokens at most."""
RECIPE = 1
"""Bump when the way examples are chosen changes: cached task files are then rebuilt."""
STAMP_FILE = "cloze_tasks.json"
"""What the task files were built from (build_stamp), beside them."""
TRAIN_INPUTS = "train_inputs"
"""The folder (under the output folder) of the corpus files without the held-out documents."""

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_JAPANESE = re.compile(r"[\u3041-\u309f\u30a0-\u30ff\u4e00-\u9fff\u3005\u30fc]+")
"""Hiragana, katakana, kanji, 々 and ー: the letters a Japanese key and target are made of."""
_SPACE = re.compile(r"\s")
"""Where an English context may start (after it): a word boundary."""
_JA_CLAUSE_END = re.compile(r"[。、．，！？\s]")
"""Where a Japanese context may start (after it): a clause boundary."""


@dataclass(frozen=True)
class Language:
    """How one language's documents are held out and cut into a cloze task."""

    code: str
    """ja | en: names the files (heldout_<code>.jsonl, cloze_<code>.jsonl)."""
    draw_from: str
    """The corpus domain the held-out documents are drawn from."""
    domains: tuple[str, ...]
    """The training domains that lose them; the first one's text gives the continuation statistics."""
    heldout_docs: int
    """Documents held out (at most a tenth of the domain's)."""
    min_doc_chars: int
    """Only documents this long are drawn (long ones give many examples from few documents)."""
    delimiter: str
    """Between context and target (TaskConfig.delimiter)."""
    normalize: str
    """The Unicode form data preparation gives these domains (conf/data/demo.yaml: NFKC for Japanese,
    the schema's NFC otherwise): contexts read as the training text does."""
    context_chars: int
    """A context's characters at most (it starts at a word or clause boundary within them)."""
    min_context_chars: int
    """... and at least."""

    @property
    def task(self) -> str:
        return f"cloze_{self.code}"


LANGUAGES = (
    Language("ja", "ja_clean", ("ja_raw", "ja_clean"), heldout_docs=8, min_doc_chars=3000, delimiter="",
             normalize="NFKC", context_chars=100, min_context_chars=20),
    Language("en", "en", ("en",), heldout_docs=6, min_doc_chars=8000, delimiter=" ", normalize="NFC",
             context_chars=240, min_context_chars=60),
)
JA_KEY_CHARS = 4
"""Japanese: the characters before the cut that the statistics condition on."""
JA_TARGET_CHARS = (2, 3, 4, 5)
"""Japanese: the target lengths tried, shortest first."""


class Tokenizer(Protocol):
    """What the checks need of the demo's tokenizer (tokenizer.declared.DeclaredTokenizer is one)."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Candidate:
    """A place a cloze example could be cut: the text before `cut` continues with `target`."""

    doc: int
    """Index of the held-out document."""
    cut: int
    """Where the context ends (a character offset into the cleaned document)."""
    key: str
    """What the statistics condition on (the words or characters just before the cut)."""
    target: str


# -- step 1: hold documents out ---------------------------------------------------------------------
def hold_out(files: dict[str, Path], out_dir: Path, seed: int = SEED, progress: Progress = print) -> dict[str, Path]:
    """`files` (domain -> corpus JSONL) with each language's held-out documents taken out.

    Writes out_dir/heldout_<code>.jsonl (the held-out documents, cleaned as data preparation cleans them)
    and out_dir/train_inputs/<domain>.jsonl (the domains that lost documents); the returned mapping
    points those domains there and leaves the others as they were.
    """
    out_dir = Path(out_dir)
    inputs = dict(files)
    for lang in LANGUAGES:
        if lang.draw_from not in files or any(domain not in files for domain in lang.domains):
            continue
        docs = read_docs(files[lang.draw_from])
        chosen = choose_heldout(docs, lang, seed)
        cleaner = Cleaner(CleanConfig(normalize=lang.normalize))
        held = [{"text": clean(cleaner, doc["text"]), "source": doc.get("source", "")} for doc in chosen]
        write_if_changed(out_dir / f"heldout_{lang.code}.jsonl", jsonl(held))
        keys = {normalized_key(doc["text"]) for doc in held}
        for domain in lang.domains:
            kept, removed = without(read_docs(inputs[domain]), keys, cleaner)
            inputs[domain] = out_dir / TRAIN_INPUTS / f"{domain}.jsonl"
            write_if_changed(inputs[domain], jsonl(kept))
            progress(f"held out: {removed} {domain} document(s) ({lang.task}), {len(kept):,} left for training")
    return inputs


def choose_heldout(docs: list[dict], lang: Language, seed: int) -> list[dict]:
    """A seeded draw of the language's held-out documents, in file order (never more than a tenth of them)."""
    count = min(lang.heldout_docs, len(docs) // 10)
    eligible = [i for i, doc in enumerate(docs) if len(doc["text"]) >= lang.min_doc_chars]
    if len(eligible) < count:  # a small corpus of your own (--use): the longest documents qualify
        eligible = sorted(range(len(docs)), key=lambda i: -len(docs[i]["text"]))[:count]
    return [docs[i] for i in sorted(random.Random(f"{seed}:{lang.code}").sample(sorted(eligible), count))]


def without(docs: list[dict], keys: set[bytes], cleaner: Cleaner) -> tuple[list[dict], int]:
    """The documents whose cleaned text is none of `keys` (normalized_key), and how many were left out."""
    kept = [doc for doc in docs if normalized_key(clean(cleaner, doc["text"])) not in keys]
    return kept, len(docs) - len(kept)


def clean(cleaner: Cleaner, text: str) -> str:
    """The text as data preparation cleans it (normal form, whitespace); as it was if the cleaner drops it."""
    return cleaner(text)[0] or text


# -- step 2: cut the held-out documents into cloze examples -----------------------------------------
def build_cloze_tasks(out_dir: Path, train_files: dict[str, Path], tokenizer: Tokenizer | None = None,
                      examples: int = EXAMPLES, seed: int = SEED, progress: Progress = print) -> dict[str, Path]:
    """out_dir/cloze_<code>.jsonl for each language `hold_out` held documents out of; task name -> file.

    `train_files` is what `hold_out` returned (the statistics come from it); without a tokenizer the token
    checks are skipped (tests). A language with no example left gets no file. Tasks built from the same
    inputs (held-out and training files unchanged, the same tokenizer) are reused, as the demo's other stages are.
    """
    out_dir = Path(out_dir)
    langs = [lang for lang in LANGUAGES
             if (out_dir / f"heldout_{lang.code}.jsonl").is_file() and lang.domains[0] in train_files]
    stamp = build_stamp(out_dir, langs, train_files, tokenizer, examples, seed)
    cached = cached_tasks(out_dir, stamp)
    if cached is not None:
        progress(f"cloze tasks: {', '.join(map(str, cached.values())) or 'none'} (cached)")
        return cached
    tasks = {}
    for lang in langs:
        held = [doc["text"] for doc in read_docs(out_dir / f"heldout_{lang.code}.jsonl")]
        cleaner = Cleaner(CleanConfig(normalize=lang.normalize))
        training = [clean(cleaner, doc["text"]) for doc in read_docs(train_files[lang.domains[0]])]
        chosen, considered = cloze_examples(lang, held, training, tokenizer, examples, seed)
        progress(f"{lang.task}: {len(chosen)} examples from {len(held)} held-out documents "
                 f"({considered:,} places with a usual continuation)")
        path = out_dir / f"{lang.task}.jsonl"
        if chosen:
            write_if_changed(path, jsonl(chosen))
            tasks[lang.task] = path
        elif path.exists():
            path.unlink()  # a stale file from an earlier corpus must not be scored
    write_if_changed(out_dir / STAMP_FILE, json.dumps({**stamp, "tasks": {k: v.name for k, v in tasks.items()}},
                                                      indent=1) + "\n")
    return tasks


def build_stamp(out_dir: Path, langs: list[Language], train_files: dict[str, Path], tokenizer: Tokenizer | None,
                examples: int, seed: int) -> dict:
    """What the task files depend on: the recipe, its settings, the tokenizer and the input files (size, mtime)."""
    files = [out_dir / f"heldout_{lang.code}.jsonl" for lang in langs] + [train_files[lang.domains[0]] for lang in langs]
    return {"recipe": RECIPE, "examples": examples, "seed": seed,
            "tokenizer": getattr(tokenizer, "sha256", None) if tokenizer is not None else "none",
            "inputs": [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in files]}


def cached_tasks(out_dir: Path, stamp: dict) -> dict[str, Path] | None:
    """The task files of an earlier build with this stamp, or None when there is none (or a file is gone)."""
    try:
        recorded = json.loads((out_dir / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    tasks = {name: out_dir / file for name, file in recorded.pop("tasks", {}).items()}
    if recorded != stamp or not all(path.is_file() for path in tasks.values()):
        return None
    return tasks


def cloze_examples(lang: Language, held: list[str], training: list[str], tokenizer: Tokenizer | None,
                   examples: int, seed: int) -> tuple[list[dict], int]:
    """(up to `examples` cloze examples, the number of places with a usual continuation)."""
    candidates = list(english_candidates(held) if lang.code == "en" else japanese_candidates(held))
    if lang.code == "en":
        counts, totals = english_counts(training, {cand.key for cand in candidates})
    else:
        counts, totals = japanese_counts(training, {(cand.key, cand.target) for cand in candidates})
    places: dict[tuple[int, int], list[Candidate]] = {}
    for cand in candidates:  # in generation order: a place's shorter targets first
        if counts[cand.key, cand.target] >= max(MIN_COUNT, MIN_SHARE * totals[cand.key]):
            places.setdefault((cand.doc, cand.cut), []).append(cand)
    order = list(places)
    random.Random(f"{seed}:{lang.task}").shuffle(order)
    seen = "\x00".join(training)
    chosen: list[dict] = []
    per_target: Counter[str] = Counter()
    for place in order:
        if len(chosen) >= examples:
            break
        for cand in places[place]:
            example = None if per_target[cand.target] >= MAX_PER_TARGET else make_example(lang, held[cand.doc], cand,
                                                                                          tokenizer)
            if example is not None and example["context"] + lang.delimiter + cand.target not in seen:
                chosen.append(example)
                per_target[cand.target] += 1
                break  # one example per place, with its shortest target that passes
    return chosen, len(places)


def english_places(text: str) -> Iterator[tuple[int, str, str]]:
    """(cut, key, target) for every word that follows two words with one space between each (inside a
    sentence: punctuation or a line break in between rules a place out); the key is the two words lowercased."""
    words = [(m.start(), m.end(), m.group()) for m in _WORD.finditer(text)]
    for (_, end0, word0), (start1, end1, word1), (start2, _, word2) in zip(words, words[1:], words[2:]):
        if start1 == end0 + 1 and start2 == end1 + 1 and text[end0] == " " and text[end1] == " ":
            yield end1, f"{word0.lower()} {word1.lower()}", word2


def english_candidates(texts: list[str]) -> Iterator[Candidate]:
    """english_places of every held-out document."""
    for doc, text in enumerate(texts):
        for cut, key, target in english_places(text):
            yield Candidate(doc, cut, key, target)


def japanese_candidates(texts: list[str]) -> Iterator[Candidate]:
    """Every cut with JA_KEY_CHARS Japanese letters before it and a target of Japanese letters after it,
    one candidate per target length (JA_TARGET_CHARS, shortest first)."""
    for doc, text in enumerate(texts):
        for run in _JAPANESE.finditer(text):
            start, end = run.span()
            for cut in range(start + JA_KEY_CHARS, end):
                for length in JA_TARGET_CHARS:
                    if cut + length <= end:
                        yield Candidate(doc, cut, text[cut - JA_KEY_CHARS:cut], text[cut:cut + length])


def english_counts(training: list[str], keys: set[str]) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """(how often each key is followed by each word, how often each key is followed by a word) in the training text."""
    counts: Counter[tuple[str, str]] = Counter()
    totals: Counter[str] = Counter()
    for text in training:
        for _, key, target in english_places(text):
            if key in keys:
                totals[key] += 1
                counts[key, target] += 1
    return counts, totals


def japanese_counts(training: list[str], wanted: set[tuple[str, str]]) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """(how often each wanted key is followed by its target, how often each key occurs) in the training text."""
    keys = {key for key, _ in wanted}
    joined = {key + target for key, target in wanted}
    longest = JA_KEY_CHARS + max(JA_TARGET_CHARS)
    counts: Counter[tuple[str, str]] = Counter()
    totals: Counter[str] = Counter()
    for text in training:
        # Keys are Japanese letters: only runs of them can hold one (man pages are much ASCII). Only what
        # some held-out place needs is counted.
        for run in _JAPANESE.finditer(text):
            for at in range(run.start(), run.end() - JA_KEY_CHARS + 1):
                key = text[at:at + JA_KEY_CHARS]
                if key in keys:
                    totals[key] += 1
                    window = text[at:at + longest]
                    for length in JA_TARGET_CHARS:
                        if window[:JA_KEY_CHARS + length] in joined:
                            counts[key, window[JA_KEY_CHARS:JA_KEY_CHARS + length]] += 1
    return counts, totals


def make_example(lang: Language, text: str, cand: Candidate, tokenizer: Tokenizer | None) -> dict | None:
    """The example cut at `cand`, or None when its context is too short or the tokenizer disagrees."""
    context = text[context_start(lang, text, cand.cut):cand.cut].strip()
    if len(context) < lang.min_context_chars:
        return None
    if tokenizer is not None and not token_aligned(tokenizer, context, lang.delimiter + cand.target,
                                                   text[cand.cut + len(cand.target):][:20]):
        return None
    return {"context": context, "target": cand.target}


def context_start(lang: Language, text: str, cut: int) -> int:
    """Where a context ending at `cut` begins: in its paragraph, at most context_chars back, at a word
    (English) or clause (Japanese) boundary."""
    paragraph = text.rfind("\n\n", 0, cut)
    start = max(paragraph + 2 if paragraph >= 0 else 0, cut - lang.context_chars)
    if start == 0 or text[start - 1].isspace():
        return start
    boundary = (_SPACE if lang.code == "en" else _JA_CLAUSE_END).search(text, start, cut)
    return boundary.end() if boundary else start


def token_aligned(tokenizer: Tokenizer, context: str, continuation: str, after: str) -> bool:
    """Whether the continuation starts and ends on the tokenizer's own cuts, and the example fits."""
    head = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    longer = tokenizer.encode(context + continuation + after)
    return (whole[:len(head)] == head and 0 < len(whole) - len(head) <= MAX_TARGET_TOKENS
            and longer[:len(whole)] == whole and len(whole) <= MAX_TOKENS)


# -- the eval.downstream tasks ----------------------------------------------------------------------
def task_configs(tasks: dict[str, Path]) -> list[dict]:
    """eval.downstream.tasks entries (downstream.config.TaskConfig fields) for the files build_cloze_tasks wrote."""
    delimiters = {lang.task: lang.delimiter for lang in LANGUAGES}
    return [{"path": str(path), "name": name, "kind": "cloze", "delimiter": delimiters[name]}
            for name, path in tasks.items()]


# -- files ------------------------------------------------------------------------------------------
def read_docs(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file (the corpus's and this module's own: a `text` field each)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def write_if_changed(path: Path, text: str) -> None:
    """Write `text` to `path` unless it holds exactly that (its mtime then stays: data prep's cache holds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)  # a reader sees the old file or the new one, never half of it
