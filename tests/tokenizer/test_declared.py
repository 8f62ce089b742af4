"""Declared tokenizers (tokenizer/declared.py): an ayumi folder, a bare SentencePiece .model, a Hugging Face folder.

Everything is real and built here, offline: a tiny SentencePiece BPE model trained on generated
English/Japanese lines (BPE, as Llama's, so transformers' Llama converter reproduces its ids), a
Hugging Face folder converted from it by transformers, and the session's ayumi build (conftest.py).
"""
from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenizer.declared import load_declared_tokenizer
from tokenizer.info import TokenizerNotFoundError, load_tokenizer_info

REPO = Path(__file__).resolve().parents[2]
SENTENCES = ["The quick brown fox jumps over the river.", "東京の猫です。", "the dog and the mountain",
             "Tokenizer data 日本語の学習データ train text."]
"""Text inside the tiny model's alphabet: an unknown character decodes as ' ⁇ ' and converts differently to HF."""
EN = "the quick brown fox jumps over lazy dog tokenizer model data shard train token text world river mountain".split()
JA = ["東京", "の", "は", "です", "ます", "日本語", "学習", "データ", "トークン", "猫", "犬", "山", "川", "を", "に"]


def train_tiny_spm(path: Path, vocab_size: int = 300, **options) -> Path:
    """A real SentencePiece BPE model from 800 generated lines (~0.1 s); `options` go to the trainer."""
    import sentencepiece as spm

    rng = random.Random(0)
    lines = []
    for _ in range(400):
        lines.append(" ".join(rng.choice(EN) for _ in range(rng.randint(5, 14))).capitalize() + ".")
        lines.append("".join(rng.choice(JA) for _ in range(rng.randint(5, 14))) + "。")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, num_threads=1, minloglevel=2, **options)
    path.write_bytes(model.getvalue())
    return path


def hf_folder_from_spm(model: Path, out: Path, added: list[str] = (), eos: str | None = None) -> Path:
    """A Hugging Face folder converted by transformers from `model` (optionally with added tokens / another EOS)."""
    from transformers import LlamaTokenizer

    # transformers 5: LlamaTokenizerFast(vocab_file=...) silently makes a 3-token tokenizer; from_pretrained on a
    # folder holding tokenizer.model runs the real SentencePiece → tokenizers conversion.
    source = out.parent / f"{out.name}.src"
    source.mkdir(parents=True)
    shutil.copy(model, source / "tokenizer.model")
    hf = LlamaTokenizer.from_pretrained(str(source), local_files_only=True)
    if added:
        hf.add_tokens(list(added))
    if eos:
        hf.add_special_tokens({"eos_token": eos})
    hf.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_tiny_spm(tmp_path_factory.mktemp("spm") / "tiny.model")


@pytest.fixture(scope="module")
def sp(spm_model):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(spm_model))


@pytest.fixture(scope="module")
def hf_dir(spm_model, tmp_path_factory) -> Path:
    return hf_folder_from_spm(spm_model, tmp_path_factory.mktemp("hf") / "llama")


# (b) a bare SentencePiece model

def test_sentencepiece_model(spm_model, sp):
    tok = load_declared_tokenizer(str(spm_model))
    assert tok.kind == "sentencepiece" and tok.path == spm_model
    assert tok.vocab_size == sp.get_piece_size() == 300
    assert (tok.eod_id, tok.bos_id) == (sp.eos_id(), sp.bos_id())
    for text in SENTENCES:
        assert tok.encode(text) == sp.encode(text)  # no BOS/EOS added
        assert tok.decode(tok.encode(text)) == text
    assert tok.sha256 == load_declared_tokenizer(spm_model).sha256 and len(tok.sha256) == 64


def test_sentencepiece_without_eos_or_bos_gives_none(tmp_path):
    import sentencepiece as spm

    model = train_tiny_spm(tmp_path / "noeos.model", eos_id=-1, bos_id=-1)
    tok = load_declared_tokenizer(model)
    assert tok.eod_id is None and tok.bos_id is None
    assert tok.vocab_size == spm.SentencePieceProcessor(model_file=str(model)).get_piece_size()


# (c) a Hugging Face folder

def test_huggingface_folder_agrees_with_sentencepiece(hf_dir, sp):
    tok = load_declared_tokenizer(hf_dir)
    assert tok.kind == "huggingface" and tok.path == hf_dir
    assert tok.vocab_size == sp.get_piece_size()
    assert (tok.eod_id, tok.bos_id) == (sp.eos_id(), sp.bos_id())
    for text in SENTENCES:
        assert tok.encode(text) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_huggingface_counts_added_tokens_and_reads_eos_from_config(spm_model, sp, tmp_path):
    from transformers import AutoTokenizer

    folder = hf_folder_from_spm(spm_model, tmp_path / "added", added=["<extra_0>"], eos="<|eot|>")
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok = load_declared_tokenizer(folder)
    assert tok.vocab_size == len(reference) == sp.get_piece_size() + 2  # the two added tokens need embedding rows
    assert tok.eod_id == reference.eos_token_id == reference.convert_tokens_to_ids("<|eot|>") != sp.eos_id()
    assert tok.bos_id == sp.bos_id()
    assert tok.encode("the dog <extra_0>") == reference.encode("the dog <extra_0>", add_special_tokens=False)


def test_huggingface_sha256_is_stable_and_follows_defining_files(hf_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(hf_dir, folder)
    first = load_declared_tokenizer(folder)
    assert first.sha256 == load_declared_tokenizer(folder).sha256 == load_declared_tokenizer(hf_dir).sha256
    assert first == load_declared_tokenizer(folder)  # the cached library is not part of equality

    (folder / "README.md").write_text("not part of the tokenizer\n")
    assert load_declared_tokenizer(folder).sha256 == first.sha256

    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}, indent=2))
    changed = load_declared_tokenizer(folder)
    assert changed.sha256 != first.sha256 and changed.eod_id == changed.bos_id

    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert load_declared_tokenizer(folder).sha256 not in (first.sha256, changed.sha256)


# (a) an ayumi folder (the session's real build, conftest.py)

def test_ayumi_folder_identity_matches_tokenizer_info(built):
    import sentencepiece as spm

    info = load_tokenizer_info(built)
    tok = load_declared_tokenizer(built)
    assert tok.kind == "ayumi" and tok.path == built
    assert (tok.sha256, tok.vocab_size, tok.eod_id, tok.bos_id) == (info.sha256, info.vocab_size, info.eos_id, info.bos_id)
    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    for text in SENTENCES:
        assert tok.encode(text) == sp.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_ayumi_folder_is_also_a_huggingface_folder(built, tmp_path):
    """Without tokenizer_meta.json the same folder reads as Hugging Face, with the same vocabulary, EOS and ids."""
    folder = tmp_path / "hf_only"
    shutil.copytree(built, folder)
    (folder / "tokenizer_meta.json").unlink()
    ayumi, hf = load_declared_tokenizer(built), load_declared_tokenizer(folder)
    assert hf.kind == "huggingface"
    assert (hf.vocab_size, hf.eod_id, hf.bos_id) == (ayumi.vocab_size, ayumi.eod_id, ayumi.bos_id)
    for text in SENTENCES:
        assert hf.encode(text) == ayumi.encode(text)


def test_import_and_load_stay_light(built):
    """Importing the module and loading an ayumi folder import no tokenizer library; encoding loads it."""
    code = (
        "import sys\n"
        "from tokenizer.declared import load_declared_tokenizer\n"
        "heavy = ('sentencepiece', 'transformers', 'tokenizers')\n"
        "assert not [m for m in heavy if m in sys.modules], sys.modules.keys()\n"
        f"tok = load_declared_tokenizer({str(built)!r})\n"
        "assert not [m for m in heavy if m in sys.modules]\n"
        "assert tok.decode(tok.encode('hello world')) == 'hello world'\n"
        "assert 'sentencepiece' in sys.modules and 'transformers' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# Errors: none of the three forms

def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer"
    with pytest.raises(TokenizerNotFoundError, match="does not exist") as err:
        load_declared_tokenizer(missing)
    assert str(missing) in str(err.value) and "SentencePiece .model" in str(err.value)


def test_empty_folder(tmp_path):
    with pytest.raises(TokenizerNotFoundError) as err:
        load_declared_tokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "tokenizer_meta.json" in message and "tokenizer.json" in message


@pytest.mark.parametrize("content", [b"not a tokenizer\n", b'{"version": "1.0"}', b""])
def test_random_file(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerNotFoundError) as err:
        load_declared_tokenizer(path)
    assert str(path) in str(err.value) and "not a SentencePiece model" in str(err.value)


def test_folder_with_a_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerNotFoundError) as err:
        load_declared_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)
