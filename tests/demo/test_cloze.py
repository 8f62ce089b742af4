"""The demo's cloze tasks (demo.cloze): the held-out documents never reach the training inputs (nor the shards
cut from them), the task files load as downstream tasks and tokenize, the build is deterministic and cached,
and `ayumi demo` hands the tasks to training as eval.downstream overrides.

The corpus here is small and made up: chapters and man pages built from a dozen recurring sentences, so
the continuation statistics have something to count (demo/cloze.py: MIN_COUNT, MIN_SHARE).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from data.clean import Cleaner, normalized_key
from data.config import CleanConfig
from demo import cloze
from demo import run as demo_run
from tests.helpers import REPO, read_jsonl

EN_SENTENCES = [
    "I dare say she was very happy to see him again", "As soon as the carriage was gone she went up to her room",
    "I beg your pardon for the trouble I have given you", "She could not help thinking of him all the evening",
    "He was not at all the sort of man she had expected", "They walked on together for some time in silence",
    "I do not know what I should have done without you", "Her sister was sitting by the fire with a book",
    "It would be impossible for me to say how much I owe to you", "The rest of the party were gone into the garden",
    "He had never been so much in love in his life", "There was a great deal of truth in what she said",
]
JA_SENTENCES = [
    "このオプションを指定すると詳細な情報を表示する", "ファイルが存在しない場合はエラーを返す",
    "設定ファイルを読み込むことができる", "環境変数が設定されている場合はその値を使う",
    "詳しくは関連するマニュアルを参照してください", "プログラムは標準入力からデータを読み込む",
    "管理者はこのコマンドを使ってシステムを設定する", "出力の形式はオプションによって変わる",
    "この機能はカーネルのバージョンによっては使えない", "引き数が省略された場合はカレントディレクトリを使う",
    "ログファイルは追加モードでオープンされる", "終了ステータスは処理が成功した場合にゼロとなる",
]
DOCS = 20


def paragraphs(rng: random.Random, sentences: list[str], end: str, count: int = 6, size: int = 5) -> list[str]:
    return [end.join(rng.choice(sentences) for _ in range(size)) + end.strip() for _ in range(count)]


def write_corpus(folder: Path) -> dict[str, Path]:
    """The demo corpus's five domains, small: ja_clean's pages are ja_raw's too, as the real corpus's are."""
    rng = random.Random(5)
    folder.mkdir(parents=True, exist_ok=True)
    en = [{"text": f"CHAPTER {n}\n\n" + "\n\n".join(paragraphs(rng, EN_SENTENCES, ". ")), "source": f"en:{n}"}
          for n in range(1, DOCS + 1)]
    clean = [{"text": f"名称\ncmd{n} - 試験用のコマンド\n\n解説\n" + "\n\n".join(paragraphs(rng, JA_SENTENCES, "。")),
              "source": f"manpages-ja:man1/cmd{n}.1"} for n in range(1, DOCS + 1)]
    noisy = [{"text": "SYNOPSIS\n" + "cmd --flag=value " * 30, "source": f"manpages-ja:man8/raw{n}.8"} for n in range(4)]
    docs = {"ja_raw": noisy[:2] + clean + noisy[2:], "ja_clean": clean, "en": en,
            "math": [{"text": "Let $x \\in \\mathbb{R}$ be a real number.", "source": "pari"}],
            "code": [{"text": "def f():\n    return 1\n", "source": "stdlib"}]}
    files = {}
    for domain, records in docs.items():
        files[domain] = folder / f"{domain}.jsonl"
        files[domain].write_text(cloze.jsonl(records), encoding="utf-8")
    return files


def keys_of(path: Path, normalize: str) -> set[bytes]:
    cleaner = Cleaner(CleanConfig(normalize=normalize))
    return {normalized_key(cloze.clean(cleaner, doc["text"])) for doc in read_jsonl(path)}


def heldout(out: Path, code: str) -> list[dict]:
    return read_jsonl(out / f"heldout_{code}.jsonl")


def tiny_tokenizer(folder: Path, inputs: dict[str, Path]) -> Path:
    """A SentencePiece tokenizer (ayumi's folder layout) trained on the training inputs, as the demo's is (with
    the data tests' English beside them: this corpus alone is too small for the tests' 600 pieces)."""
    from tests.data.helpers import english_texts, write_tokenizer

    texts = [doc["text"] for path in inputs.values() for doc in read_jsonl(path)]
    return write_tokenizer(folder, texts + english_texts())


# -- holding out ---------------------------------------------------------------------------------
def test_held_out_documents_are_absent_from_the_training_inputs(tmp_path):
    files = write_corpus(tmp_path / "corpus")
    out = tmp_path / "cloze"
    messages: list[str] = []
    inputs = cloze.hold_out(files, out, progress=messages.append)

    assert inputs["math"] == files["math"] and inputs["code"] == files["code"]  # untouched domains stay
    assert {inputs[d] for d in ("ja_raw", "ja_clean", "en")} == {out / cloze.TRAIN_INPUTS / f"{d}.jsonl"
                                                                 for d in ("ja_raw", "ja_clean", "en")}
    for code, domains in (("ja", ("ja_raw", "ja_clean")), ("en", ("en",))):
        held = heldout(out, code)
        assert len(held) == DOCS // 10  # never more than a tenth of the domain
        normal = "NFKC" if code == "ja" else "NFC"
        held_keys = {normalized_key(doc["text"]) for doc in held}
        for domain in domains:
            kept = read_jsonl(inputs[domain])
            assert len(kept) == len(read_jsonl(files[domain])) - len(held)
            assert not held_keys & keys_of(inputs[domain], normal), domain
            assert not {doc["source"] for doc in held} & {doc["source"] for doc in kept}
    assert "held out: 2 ja_raw document(s) (cloze_ja), 22 left for training" in messages

    # A copy that only data preparation's normalization equates (full-width letters and digits) goes too.
    page = heldout(out, "ja")[0]
    wide = page["text"].translate({ord(c): ord(c) + 0xFEE0 for c in "cmd0123456789"})
    assert wide != page["text"]
    records = read_jsonl(files["ja_raw"]) + [{"text": wide, "source": "manpages-ja:copy"}]
    files["ja_raw"].write_text(cloze.jsonl(records), encoding="utf-8")
    inputs = cloze.hold_out(files, out, progress=lambda _: None)
    assert "manpages-ja:copy" not in {doc["source"] for doc in read_jsonl(inputs["ja_raw"])}
    assert len(read_jsonl(inputs["ja_raw"])) == len(records) - 3


def test_the_demo_prepares_its_shards_from_the_inputs_without_them(tmp_path, monkeypatch):
    """Through `ayumi demo`'s own stage: no train or validation document of the shards is a held-out one."""
    from data import cli as data_cli
    from data.shards import ShardReader, find_shards

    files = write_corpus(tmp_path / "corpus")
    inputs = demo_run.hold_out_documents(files, tmp_path / "cloze")
    tokenizer_dir = tiny_tokenizer(tmp_path / "tok", inputs)
    real_main = data_cli.main
    # A validation split worth checking: the demo's 3% of 20 documents would usually be none.
    more_val = [f"data.domains.{d}.val_fraction=0.3" for d in ("ja_raw", "ja_clean", "en")]
    monkeypatch.setattr(data_cli, "main", lambda argv: real_main([*argv, *more_val, "workers=0"]))
    demo_run.prepare_shards(inputs, tokenizer_dir, tmp_path / "shards")

    from tokenizer.declared import load_declared_tokenizer

    tokenizer = load_declared_tokenizer(tokenizer_dir)
    held = {doc["text"] for code in ("ja", "en") for doc in heldout(tmp_path / "cloze", code)}
    for domain in ("ja_raw", "ja_clean", "en"):
        for split in ("train", "val"):
            folder = tmp_path / "shards" / domain / split
            docs = [tokenizer.decode([t for t in doc.tolist() if t != tokenizer.eod_id])
                    for prefix in find_shards(folder) for doc in ShardReader(prefix)]
            assert docs, f"{domain}/{split} is empty: the check would prove nothing"
            assert not held & set(docs), f"{domain}/{split}"
            assert all(text not in doc for text in held for doc in docs)


# -- the task files --------------------------------------------------------------------------------
@pytest.fixture
def built(tmp_path):
    """(corpus files, training inputs, output folder) after hold_out."""
    files = write_corpus(tmp_path / "corpus")
    out = tmp_path / "cloze"
    return files, cloze.hold_out(files, out, progress=lambda _: None), out


def test_task_files_load_as_cloze_tasks_and_tokenize(built, tmp_path):
    from downstream.config import TaskConfig
    from downstream.prompts import loglik_requests
    from downstream.tasks import load_task
    from tokenizer.declared import load_declared_tokenizer

    _, inputs, out = built
    tokenizer = load_declared_tokenizer(tiny_tokenizer(tmp_path / "tok", inputs))
    tasks = cloze.build_cloze_tasks(out, inputs, tokenizer, progress=lambda _: None)

    assert sorted(tasks) == ["cloze_en", "cloze_ja"]
    training = {code: "\x00".join(doc["text"] for doc in read_jsonl(inputs[domain]))
                for code, domain in (("ja", "ja_raw"), ("en", "en"))}
    for entry in cloze.task_configs(tasks):
        task = load_task(TaskConfig(**entry))
        code = task.name[-2:]
        assert task.kind == "cloze" and task.delimiter == ("" if code == "ja" else " ")
        assert 10 <= len(task.examples) <= cloze.EXAMPLES, (task.name, len(task.examples))
        held = "\x00".join(doc["text"] for doc in heldout(out, code))
        for example in task.examples:
            # A span of a held-out document, cut inside a sentence, whose whole text training never saw.
            assert example.context + task.delimiter + example.answer in held
            assert example.context + task.delimiter + example.answer not in training[code]
            assert not example.context.endswith(("。", ".", "\n")) and example.answer.strip() == example.answer
            requests = loglik_requests(task, example, [], tokenizer, [tokenizer.eod_id], cloze.MAX_TOKENS + 1)
            assert 1 <= len(requests[0].continuation) <= cloze.MAX_TARGET_TOKENS
        targets = [example.answer for example in task.examples]
        assert max(targets.count(t) for t in targets) <= cloze.MAX_PER_TARGET
        if code == "ja":
            assert all(2 <= len(t) <= max(cloze.JA_TARGET_CHARS) for t in targets)
        else:
            assert all(" " not in t and t.isalpha() for t in targets)


def test_without_a_tokenizer_japanese_targets_are_two_characters(built):
    _, inputs, out = built
    tasks = cloze.build_cloze_tasks(out, inputs, progress=lambda _: None)
    ja = read_jsonl(tasks["cloze_ja"])
    assert ja and all(len(example["target"]) == 2 for example in ja)


def test_a_context_starts_at_its_paragraph_or_at_a_boundary():
    ja, en = (next(lang for lang in cloze.LANGUAGES if lang.code == code) for code in ("ja", "en"))
    page = "名称\nこのオプションを指定する"
    assert cloze.context_start(ja, page, len(page)) == 0  # the document's first paragraph, from its first letter
    text = "First paragraph.\n\n" + "word " * 100 + "end"
    start = cloze.context_start(en, text, len(text))
    assert len(text) - start <= en.context_chars and text[start - 1] == " " and text[start:].startswith("word")
    clause = "前の段落。\n\n" + "あ" * 150 + "、" + "い" * 60
    assert clause[cloze.context_start(ja, clause, len(clause)):] == "い" * 60


def build_all(corpus: Path, out: Path) -> None:
    """The whole build (no tokenizer) from the corpus files in `corpus`, into `out`."""
    files = {domain: corpus / f"{domain}.jsonl" for domain in ("ja_raw", "ja_clean", "en", "math", "code")}
    cloze.build_cloze_tasks(out, cloze.hold_out(files, out, progress=lambda _: None), progress=lambda _: None)


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.jsonl"))}


def test_the_build_is_deterministic_and_cached(tmp_path):
    write_corpus(tmp_path / "corpus")
    build_all(tmp_path / "corpus", tmp_path / "a")
    # Another process with another string hash seed: nothing may hang on set or dict order.
    code = (f"from pathlib import Path; from tests.demo.test_cloze import build_all; "
            f"build_all(Path({str(tmp_path / 'corpus')!r}), Path({str(tmp_path / 'b')!r}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)
    first = file_bytes(tmp_path / "a")
    assert {"cloze_ja.jsonl", "cloze_en.jsonl", "heldout_ja.jsonl", "train_inputs/ja_raw.jsonl"} <= set(first)
    assert file_bytes(tmp_path / "b") == first

    # Again into the same folder: nothing rewritten (data preparation's fingerprint holds), the tasks reused.
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    messages: list[str] = []
    files = {domain: tmp_path / "corpus" / f"{domain}.jsonl" for domain in ("ja_raw", "ja_clean", "en", "math", "code")}
    tasks = cloze.build_cloze_tasks(tmp_path / "a", cloze.hold_out(files, tmp_path / "a", progress=messages.append),
                                    progress=messages.append)
    assert messages[-1].endswith("(cached)") and sorted(tasks) == ["cloze_en", "cloze_ja"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == stamps


# -- handing the tasks to training -------------------------------------------------------------------
def test_training_overrides_name_the_tasks_as_eval_downstream(tmp_path):
    from omegaconf import OmegaConf

    from pretrain.config import compose_config, total_steps

    folder = tmp_path / "it's a folder, with spaces"  # quotes, commas and spaces survive the override
    tasks = {"cloze_ja": folder / "cloze_ja.jsonl", "cloze_en": folder / "cloze_en.jsonl"}
    overrides = demo_run.training_overrides(tmp_path / "shards", tmp_path / "tok", tmp_path / "runs", tasks)
    composed = OmegaConf.to_object(compose_config(overrides))
    downstream = composed.eval.downstream
    assert [(t.path, t.name, t.kind, t.delimiter) for t in downstream.tasks] == [
        (str(tasks["cloze_ja"]), "cloze_ja", "cloze", ""), (str(tasks["cloze_en"]), "cloze_en", "cloze", " ")]
    assert 8 <= total_steps(composed.train) // downstream.interval <= 10  # ~8-10 points on the curve
    assert 0 < downstream.max_examples <= cloze.EXAMPLES
    assert composed.model.max_seq_len > cloze.MAX_TOKENS  # the prefix token and every example fit
    # Without tasks (a corpus that gave none) nothing is added: demo.yaml alone scores nothing.
    plain = demo_run.training_overrides(tmp_path / "shards", tmp_path / "tok", tmp_path / "runs")
    assert not [o for o in plain if o.startswith("eval.")]
