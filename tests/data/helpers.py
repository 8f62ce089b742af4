"""Helpers for the data tests: a small real SentencePiece tokenizer and corpus builders.

The tokenizer is trained (once per session) on real text: docstrings of Python standard-library
modules for English, and a few hand-written Japanese paragraphs. Its options mirror the
tokenizer builder's (identity normalization, no whitespace squeezing, byte fallback, "\\n" as a
piece) so decoding the tokens gives back the cleaned text exactly.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from data.config import CleanConfig, DataConfig, DataPrepareConfig, DomainConfig

JA_PARAGRAPHS = [
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    "東京は日本の首都であり、多くの人々が暮らしている。電車は朝早くから夜遅くまで走っている。",
    "今日は天気が良いので、公園を散歩しました。桜の花がきれいに咲いていました。",
    "この文書は、データ準備の試験のために書かれた短い日本語の文章です。",
    "機械学習のモデルは大量のテキストから言葉の使い方を学ぶ。質の良いデータが大切である。",
    "山田さんは毎朝コーヒーを飲みながら新聞を読む。週末には図書館へ行く。",
    "富士山は日本で一番高い山です。夏になると多くの登山者が頂上を目指します。",
    "彼女はピアノを弾くのが好きで、毎日一時間練習している。来月には発表会がある。",
]
STDLIB_MODULES = ["json", "collections", "argparse", "pathlib", "subprocess", "logging", "unittest",
                  "functools", "itertools", "shutil", "tarfile", "zipfile", "csv", "datetime", "decimal"]


def english_texts() -> list[str]:
    """Real English prose: the docstrings of standard-library modules and their public callables."""
    texts = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for obj in [module] + [getattr(module, attr) for attr in sorted(dir(module)) if not attr.startswith("_")]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 80 and doc not in texts:
                texts.append(doc.strip())
    return texts


def write_tokenizer(directory: Path, lines: list[str], vocab_size: int = 600) -> Path:
    """Train a SentencePiece model on `lines` into `directory` laid out like `ayumi tokenizer build`'s output."""
    import sentencepiece as spm

    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(line.replace("\n", " ") for line in lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=vocab_size,
        model_type="unigram", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, user_defined_symbols=["\n"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, character_coverage=0.9995, minloglevel=2, num_threads=1,
    )
    (directory / "tokenizer.vocab").unlink()
    corpus.unlink()
    meta = {"vocab_size": vocab_size, "unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
    (directory / "tokenizer_meta.json").write_text(json.dumps(meta), encoding="utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).write_text("{}", encoding="utf-8")  # the HF export is not used by data/
    return directory


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({field: text, "meta": "x"}, ensure_ascii=False) + "\n")
    return path


def make_config(root: Path, tokenizer: Path, domains: dict[str, DomainConfig], workers: int = 0, **kwargs) -> DataPrepareConfig:
    """A DataPrepareConfig for tests: no progress bar, in-process tokenization unless told otherwise."""
    return DataPrepareConfig(
        data=DataConfig(name="test", root=str(root), domains=domains),
        tokenizer_dir=str(tokenizer), workers=workers, progress=False, **kwargs,
    )


def domain(inputs, **kwargs) -> DomainConfig:
    clean = kwargs.pop("clean", None) or CleanConfig()
    return DomainConfig(inputs=[str(path) for path in inputs], clean=clean, **kwargs)


def die_after_writes(documents: int) -> None:
    """Make this process kill itself with SIGKILL once its shard writers have been handed `documents` documents:
    no cleanup, no finally, as a crash or the OOM killer would end it (for a child process of a test)."""
    import os
    import signal

    import data.prepare as prepare_module

    written = 0
    original = prepare_module.ShardSequence._write

    def write_then_die(self, writer, keys, lengths, tokens):
        nonlocal written
        written += len(lengths)
        if written >= documents:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, writer, keys, lengths, tokens)

    prepare_module.ShardSequence._write = write_then_die


def losses_on_roots(roots: dict[str, Path], runs: Path, steps: int) -> dict[str, list[float]]:
    """name -> the train losses of `steps` cpu_tiny steps on 2 forked ranks over each data root: two roots that
    must give the same training stream (one task and five, before and after a merge) give the same losses."""
    from tests.helpers import run_training, tiny_overrides, train_losses

    losses = {}
    for name, root in roots.items():
        proc = run_training(tiny_overrides(root, runs / f"run_{name}", f"train.max_steps={steps}",
                                           "checkpoint.interval=0", "train.eval_interval=0"), nproc=2, launcher="fork")
        assert proc.returncode == 0, proc.stdout[-4000:]
        losses[name] = train_losses(runs / f"run_{name}" / "cpu_tiny")
    return losses
