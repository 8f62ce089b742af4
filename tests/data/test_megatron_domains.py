"""Existing Megatron data registered as a domain by `ayumi data prepare`: the checks that do not trust the
declaration, weights and folders of prefixes, append_eod, validation prefixes, a declared Hugging Face
tokenizer, the commands downstream (inspect, plan) treating the domain like any other, the sampled id check of
large prefixes, and fixes that send a damaged prefix back to whoever owns it."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from curriculum.config import CurriculumConfig
from curriculum.declared import register_curriculum_domains
from curriculum.plan import available_samples
from data.cli import verify_main
from data.config import DomainConfig
from data.domains import open_run_data
from data.inspect import inspect_root
from data.integrity import verify_root
from data.megatron import MegatronDataError, parse_prefixes
from data.packed import CorruptShardError
from data.prepare import prepare
from data.shards import ShardWriter
from tests.data.helpers import domain, make_config, write_jsonl
from tokenizer.declared import load_declared_tokenizer

EOS = 2


def write_prefix(prefix: Path, documents: list[list[int]], vocab: int = 600) -> Path:
    with ShardWriter(prefix, vocab) as writer:
        writer.add_documents(documents)
    return prefix


def encoded(tokenizer_dir: Path, texts: list[str], eos: bool = True) -> list[list[int]]:
    tokenizer = load_declared_tokenizer(tokenizer_dir)
    return [tokenizer.encode(text) + ([EOS] if eos else []) for text in texts]


def megatron(spec: str, **kwargs) -> DomainConfig:
    return DomainConfig(megatron=spec, **kwargs)


def test_prefix_forms_follow_megatrons_data_path(tmp_path):
    a, b = write_prefix(tmp_path / "a", [[1, EOS]]), write_prefix(tmp_path / "b", [[3, EOS]])
    assert parse_prefixes(f"{a} {b}", "k") == [(None, a), (None, b)]
    assert parse_prefixes(f"0.3 {a}.bin 0.7 {b}", "k") == [(0.3, a), (0.7, b)]  # a suffix is accepted
    assert parse_prefixes(str(tmp_path), "k") == [(None, a), (None, b)]  # a folder: every *.idx in it
    with pytest.raises(MegatronDataError, match="before every prefix or before none"):
        parse_prefixes(f"{a} 0.5 {b}", "data.domains.web.megatron")
    with pytest.raises(MegatronDataError, match="alternate a weight and a prefix"):
        parse_prefixes(f"0.5 {a} 0.5", "k")


def test_registered_in_place_and_read_like_any_domain(tmp_path, tokenizer_dir, en_texts):
    docs = encoded(tokenizer_dir, en_texts[:60])
    a = write_prefix(tmp_path / "meg" / "a_text_document", docs[:30])
    b = write_prefix(tmp_path / "meg" / "b_text_document", docs[30:50])
    val = write_prefix(tmp_path / "meg" / "val_text_document", docs[50:])
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "web": megatron(f"0.25 {a} 0.75 {b}", megatron_val=str(val)),
        "en": domain([write_jsonl(tmp_path / "en.jsonl", en_texts[60:120])], val_fraction=0.1),
    })
    manifest = prepare(cfg)
    record = manifest["domains"]["web"]
    shards = record["splits"]["train"]["shards"]
    assert [(s["prefix"], s["weight"], s["docs"]) for s in shards] == [(str(a), 0.25, 30), (str(b), 0.75, 20)]
    assert all(s["ids_checked"] == "full" and s["max_id"] < 600 and len(s["sha256"]) == 64 for s in shards)
    assert sorted(p.name for p in (tmp_path / "root" / "web").iterdir()) == ["domain.json"]  # nothing copied
    _, train, val_sets = open_run_data(tmp_path / "root", None, seq_len=32, vocab_size=640)
    web = train["web"]
    assert len(web) == sum(web.counts) and web.counts[1] == pytest.approx(3 * web.counts[0], abs=1)
    assert set(val_sets) == {"web", "en"}
    assert available_samples(tmp_path / "root", 32)[1]["web"] == len(web)  # `ayumi plan` counts it
    report = inspect_root(tmp_path / "root", samples=1, chars=40)
    assert "Megatron data (read in place)" in report and str(a) in report
    first = load_declared_tokenizer(tokenizer_dir).decode(docs[0][:-1])[:40].replace("\n", "⏎")
    assert f"web/train #0 ({len(docs[0])} tokens): {first}" in report  # decoded with the declared tokenizer
    # Re-running with nothing changed skips the check; touching a prefix re-checks it.
    again = prepare(cfg)
    assert again["domains"]["web"] == record


def test_ids_beyond_the_declared_vocabulary_are_refused_naming_the_prefix(tmp_path, tokenizer_dir):
    bad = write_prefix(tmp_path / "bad_text_document", [[5, 7, EOS], [650, EOS]], vocab=1000)
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"web": megatron(str(bad))})
    with pytest.raises(MegatronDataError, match=rf"data\.domains\.web\.megatron: {bad}\.bin holds id 650, outside the "
                                                r"vocabulary \[0, 600\)"):
        prepare(cfg)
    assert not (tmp_path / "root" / "manifest.json").exists()


def test_documents_without_eod_need_append_eod(tmp_path, tokenizer_dir, en_texts):
    plain = write_prefix(tmp_path / "plain_text_document", encoded(tokenizer_dir, en_texts[:20], eos=False))
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"web": megatron(str(plain))})
    with pytest.raises(MegatronDataError, match=r"20 of 20 documents checked .* do not end with EOD id 2.*"
                                                r"data\.domains\.web\.append_eod=true"):
        prepare(cfg)
    cfg.data.domains["web"].append_eod = True
    prepare(cfg)
    _, train, _ = open_run_data(tmp_path / "root", None, seq_len=16, vocab_size=640)
    stream = np.concatenate([train["web"].sample(i)[:-1] for i in range(len(train["web"]))])
    first = encoded(tokenizer_dir, en_texts[:1], eos=False)[0]
    assert stream[:len(first) + 1].tolist() == first + [EOS]  # EOD read after each document
    ended = write_prefix(tmp_path / "ended_text_document", encoded(tokenizer_dir, en_texts[:5]))
    cfg.data.domains["web"].megatron = str(ended)
    with pytest.raises(MegatronDataError, match="already end with EOD id 2.*append_eod=false"):
        prepare(cfg)


def test_a_hugging_face_tokenizer_declares_megatron_data(tmp_path, tokenizer_dir, en_texts):
    from tokenizer.export_hf import export_hf

    hf = tmp_path / "hf_tokenizer"
    export_hf(tokenizer_dir / "tokenizer.model", hf)
    declared = load_declared_tokenizer(hf)
    assert declared.kind == "huggingface" and declared.vocab_size == 600 and declared.eod_id == EOS
    docs = encoded(tokenizer_dir, en_texts[:10])
    assert [declared.encode(text) + [EOS] for text in en_texts[:10]] == docs  # same ids as SentencePiece
    prefix = write_prefix(tmp_path / "web_text_document", docs)
    root = tmp_path / "root"
    manifest = prepare(make_config(root, hf, {"web": megatron(str(prefix))}))
    assert manifest["tokenizer"]["sha256"] == declared.sha256 != load_declared_tokenizer(tokenizer_dir).sha256
    assert en_texts[0][:30].replace("\n", "⏎") in inspect_root(root, samples=1, chars=30)
    # The HF folder, and the bare .model, also tokenize text domains (through `tokenizers` / sentencepiece, in the
    # workers): the same shards, byte for byte, as the ayumi folder they come from; each root records its tokenizer.
    text = write_jsonl(tmp_path / "en.jsonl", en_texts[:40])
    model = tokenizer_dir / "tokenizer.model"
    for name, tokenizer in (("hf", hf), ("model", model), ("ayumi", tokenizer_dir)):
        made = prepare(make_config(tmp_path / name, tokenizer, {"en": domain([text], val_fraction=0.1)}, workers=1))
        assert made["tokenizer"]["sha256"] == load_declared_tokenizer(tokenizer).sha256
    for name in ("hf", "model"):
        for split in ("train", "val"):
            assert (tmp_path / name / "en" / split / "part_00000.bin").read_bytes() == \
                (tmp_path / "ayumi" / "en" / split / "part_00000.bin").read_bytes()


def test_a_megatron_prefix_changed_after_registration_is_refused_at_start(tmp_path, tokenizer_dir, en_texts):
    prefix = write_prefix(tmp_path / "web_text_document", encoded(tokenizer_dir, en_texts[:10]))
    prepare(make_config(tmp_path / "root", tokenizer_dir, {"web": megatron(str(prefix))}))
    write_prefix(prefix, encoded(tokenizer_dir, en_texts[:11]))  # the team re-ran preprocessing in place
    with pytest.raises(Exception, match=rf"{prefix}\.(bin|idx)"):
        open_run_data(tmp_path / "root", None, seq_len=16, vocab_size=640)
    record = json.loads((tmp_path / "root" / "manifest.json").read_text())["domains"]["web"]
    assert record["splits"]["train"]["docs"] == 10


def test_a_text_domain_can_validate_on_a_megatron_prefix(tmp_path, tokenizer_dir, en_texts):
    held_out = write_prefix(tmp_path / "held_out_text_document", encoded(tokenizer_dir, en_texts[100:110]))
    text = write_jsonl(tmp_path / "en.jsonl", en_texts[:80])
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([text], megatron_val=str(held_out))})
    record = prepare(cfg)["domains"]["en"]
    assert record["splits"]["val"]["docs"] == 10 and record["splits"]["val"]["shards"][0]["prefix"] == str(held_out)
    assert record["docs_kept"] == record["splits"]["train"]["docs"]  # the read-and-kept counts stay the text's
    _, train, val = open_run_data(tmp_path / "root", None, seq_len=16, vocab_size=640)
    assert val["en"].sample(0).tolist() == np.concatenate(encoded(tokenizer_dir, en_texts[100:102]))[:17].tolist()
    assert prepare(cfg)["domains"]["en"] == record  # nothing changed: skipped, same record
    cfg.data.domains["en"].val_fraction = 0.1
    with pytest.raises(Exception, match="megatron_val is this domain's validation set"):
        prepare(cfg)


def test_a_damaged_prefix_names_its_owners_fix_not_only_ayumi_data_prepare(tmp_path, tokenizer_dir, en_texts):
    """A registered prefix lives outside the data root: `ayumi data prepare` cannot remake it, its owner can."""
    prefix = write_prefix(tmp_path / "web_text_document", encoded(tokenizer_dir, en_texts[:10]))
    root = tmp_path / "root"
    manifest = prepare(make_config(root, tokenizer_dir, {"web": megatron(str(prefix))}))
    bin_path = Path(f"{prefix}.bin")
    raw = bytearray(bin_path.read_bytes())
    raw[0:2] = (int.from_bytes(raw[0:2], "little") + 1).to_bytes(2, "little")  # another id, still in the vocabulary
    bin_path.write_bytes(bytes(raw))
    fix = (f"Fix: restore or re-preprocess {prefix}, then re-run `ayumi data prepare` for this data root (a damaged "
           "disk? check it first)")
    with pytest.raises(Exception, match=rf"^{re.escape(str(bin_path))}: sha256 .* is not the recorded .*\. {re.escape(fix)}$"):
        open_run_data(root, None, seq_len=16, vocab_size=640, verify="full")
    assert verify_root(root, manifest)[0].endswith(fix)
    # Declared in a curriculum file instead: the curriculum's plan or training start registers it again.
    other = tmp_path / "other"
    declared = CurriculumConfig(name="mine", domains={"web": {"megatron": str(prefix)}})
    register_curriculum_domains(SimpleNamespace(curriculum=declared,
                                                data=SimpleNamespace(root=str(other), tokenizer_dir=str(tokenizer_dir))))
    Path(f"{prefix}.idx").unlink()
    with pytest.raises(Exception) as refused:
        open_run_data(other, None, seq_len=16, vocab_size=640)
    assert str(refused.value) == (
        f"shard index {prefix}.idx does not exist (its .bin does: an unfinished or damaged shard). Fix: restore or "
        f"re-preprocess {prefix}, then re-run `ayumi plan` or `ayumi train` with curriculum 'mine' (it registers the "
        "domain again)")


def test_large_prefixes_are_checked_on_sampled_windows_and_verify_says_so(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """Beyond FULL_CHECK_BYTES a prefix's ids are checked on evenly spaced windows and no sha256 is recorded: an id
    inside a window is refused at registration; one between windows is caught by the per-sample check and by
    `ayumi data verify`, which also lists the prefixes it could check by size, counts and ids only."""
    monkeypatch.setattr("data.megatron.FULL_CHECK_BYTES", 1024)  # the 2,000-byte prefixes below are "large"
    monkeypatch.setattr("data.megatron.WINDOW_TOKENS", 10)
    monkeypatch.setattr("data.megatron.SAMPLE_WINDOWS", 4)  # windows at tokens [0, 10), [330, 340), [660, 670), [990, 1000)

    def hundred_documents(name: str, bad_at: int | None = None) -> Path:
        tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, EOS] * 100
        if bad_at is not None:
            tokens[bad_at] = 650
        return write_prefix(tmp_path / name, [tokens[i:i + 10] for i in range(0, 1000, 10)], vocab=1000)

    in_window = hundred_documents("windowed_text_document", bad_at=335)
    with pytest.raises(MegatronDataError, match=rf"{in_window}\.bin holds id 650, outside the vocabulary \[0, 600\)"):
        prepare(make_config(tmp_path / "refused", tokenizer_dir, {"web": megatron(str(in_window))}))

    clean, between = hundred_documents("clean_text_document"), hundred_documents("between_text_document", bad_at=500)
    root = tmp_path / "root"
    manifest = prepare(make_config(root, tokenizer_dir, {"clean": megatron(str(clean)), "holed": megatron(str(between))}))
    shard = manifest["domains"]["holed"]["splits"]["train"]["shards"][0]
    assert (shard["ids_checked"], shard["sha256"], shard["max_id"]) == ("sampled 4 windows", None, 13)
    _, train, _ = open_run_data(root, None, seq_len=16, vocab_size=640)
    train["holed"].sample(30)  # tokens 480..496: clean
    with pytest.raises(CorruptShardError, match=rf"{between}\.bin: token 500 of the stream is id 650"):
        train["holed"].sample(31)  # tokens 496..512
    assert verify_main([str(root)]) == 1
    out, err = capsys.readouterr()
    assert f"{between}.bin: holds id 650" in err and "1 problem(s)" in err
    assert ("ayumi data verify: 2 Megatron prefix(es) checked by size, counts and ids only, not by sha256 "
            "(over 0.000976562 MiB when registered") in out and out.rstrip().endswith(f": {clean}, {between}")
