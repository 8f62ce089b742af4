"""Interop with the real megatron-core (a test dependency): it reads ayumi's shards, and ayumi reads and
trains on shards its `IndexedDatasetBuilder` wrote, registered through `ayumi data prepare`."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from data.domains import open_run_data
from data.shards import ShardReader, ShardWriter
from tests.data.helpers import domain, make_config, write_jsonl
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides


def megatron_indexed():
    """megatron-core's own reader and builder (its import warns that Apex/TE are absent on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


@pytest.mark.parametrize("vocab", [600, 100_000])
def test_megatron_core_reads_ayumi_shards(tmp_path, vocab):
    rng = np.random.default_rng(vocab)
    docs = [rng.integers(0, vocab, size=int(n)) for n in rng.integers(1, 300, size=50)] + [np.zeros(0, np.int64)]
    with ShardWriter(tmp_path / "part", vocab) as writer:
        writer.add_documents(docs)
    dataset = megatron_indexed().IndexedDataset(str(tmp_path / "part"))
    assert len(dataset) == len(docs)
    assert dataset.index.dtype == megatron_indexed().DType.optimal_dtype(vocab)  # uint16 / int32 by its rule
    for index, doc in enumerate(docs):
        assert dataset[index].tolist() == doc.tolist()
    assert dataset.document_indices.tolist() == list(range(len(docs) + 1))


def test_megatron_core_reads_a_prepared_root(tmp_path, tokenizer_dir, en_texts):
    corpus = write_jsonl(tmp_path / "en" / "a.jsonl", en_texts)
    prepare_root(tmp_path / "root", tokenizer_dir, corpus)
    manifest = json.loads((tmp_path / "root" / "manifest.json").read_text())
    shards = manifest["domains"]["en"]["splits"]["train"]["shards"]
    indexed = megatron_indexed()
    seen = 0
    for shard in shards:
        prefix = tmp_path / "root" / "en" / "train" / shard["name"]
        ours, theirs = ShardReader(prefix), indexed.IndexedDataset(str(prefix))
        assert len(theirs) == ours.num_docs == shard["docs"]
        for index in range(len(theirs)):
            assert theirs[index].tolist() == ours[index].tolist()
            assert theirs[index][-1] == 2  # every document ends with the tokenizer's EOS
        seen += len(theirs)
    assert seen == manifest["domains"]["en"]["splits"]["train"]["docs"] > 20


def prepare_root(root: Path, tokenizer_dir: Path, corpus: Path) -> None:
    from data.prepare import prepare

    prepare(make_config(root, tokenizer_dir, {"en": domain([corpus], val_fraction=0.1)}))


def write_with_megatron(prefix: Path, documents: list[list[np.ndarray]], vocab: int) -> None:
    """megatron-core's builder, documents of one or more sequences (as preprocess_data.py's sentence split does)."""
    indexed = megatron_indexed()
    import torch

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = indexed.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=indexed.DType.optimal_dtype(vocab))
    for sequences in documents:
        for sequence in sequences:
            builder.add_item(torch.from_numpy(np.asarray(sequence, dtype=np.int64)))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")


def encoded_documents(tokenizer_dir: Path, texts: list[str], eos: int | None = 2) -> list[list[np.ndarray]]:
    """Real text through the real SentencePiece model: each document split in two sequences, EOS at its end
    (none with `eos=None`: preprocessed without --append-eod)."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    documents = []
    for text in texts:
        ids = processor.encode(text) + ([eos] if eos is not None else [])
        half = max(1, len(ids) // 2)
        documents.append([np.array(ids[:half]), np.array(ids[half:])])
    return documents


def test_ayumi_reads_what_megatron_core_wrote(tmp_path, tokenizer_dir, en_texts):
    documents = encoded_documents(tokenizer_dir, en_texts[:40])
    write_with_megatron(tmp_path / "web_text_document", documents, 600)
    reader = ShardReader(tmp_path / "web_text_document")
    assert reader.num_docs == 40 and reader.num_sequences == 80
    for index, sequences in enumerate(documents):
        assert reader[index].tolist() == np.concatenate(sequences).tolist()
    stream = np.concatenate([np.concatenate(sequences) for sequences in documents])
    assert reader.tokens.tolist() == stream.tolist()


@pytest.mark.slow
def test_train_20_steps_on_megatron_core_shards(tmp_path, tokenizer_dir, en_texts):
    """Registered with the real CLI (`ayumi data prepare data=megatron`), then 20 steps on 2 ranks."""
    third = len(en_texts) // 3
    write_with_megatron(tmp_path / "meg" / "a_text_document", encoded_documents(tokenizer_dir, en_texts[:third]), 600)
    write_with_megatron(tmp_path / "meg" / "b_text_document",
                        encoded_documents(tokenizer_dir, en_texts[third:2 * third]), 600)
    write_with_megatron(tmp_path / "meg" / "val_text_document", encoded_documents(tokenizer_dir, en_texts[-30:]), 600)
    root = tmp_path / "root"
    meg = tmp_path / "meg"
    prepared = subprocess.run(
        [sys.executable, "-m", "pretrain.tools.cli", "data", "prepare", "data=megatron", f"tokenizer_dir={tokenizer_dir}",
         f"data.root={root}", f"data.domains.web.megatron='0.7 {meg / 'a_text_document'} 0.3 {meg / 'b_text_document'}'",
         f"data.domains.web.megatron_val={meg / 'val_text_document'}"],
        cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stdout
    record = json.loads((root / "web" / "domain.json").read_text())
    assert [shard["weight"] for shard in record["splits"]["train"]["shards"]] == [0.7, 0.3]
    assert record["splits"]["train"]["docs"] == 2 * third and record["source"] == "megatron"
    assert not list((root / "web").glob("*/*.bin"))  # registered in place, nothing copied
    _, train, val = open_run_data(root, None, seq_len=64, vocab_size=640)
    assert len(train["web"]) > 0 and len(val["web"]) > 0

    run = run_training(tiny_overrides(root, tmp_path / "runs", "model.vocab_size=640", f"data.tokenizer_dir={tokenizer_dir}",
                                      "train.max_steps=20", "train.eval_interval=10"), nproc=2, launcher="fork")
    assert run.returncode == 0, run.stdout[-4000:]
    metrics = read_jsonl(tmp_path / "runs" / "cpu_tiny" / "metrics.jsonl")
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 20 and losses[-1] < losses[0]
    assert any("val/web/loss" in m for m in metrics)


@pytest.mark.slow
def test_a_curriculum_file_declares_megatron_core_shards_and_trains_on_them(tmp_path, tokenizer_dir, en_texts):
    """One curriculum file, in a site conf dir as users keep their own, names megatron-core-built prefixes as two
    domains (weighted prefixes with a validation prefix; a folder of prefixes made without --append-eod). `ayumi plan`
    registers and counts them; 2 training ranks on a fresh root register them themselves, switch stages, train."""
    meg, third = tmp_path / "meg", len(en_texts) // 3
    write_with_megatron(meg / "a_text_document", encoded_documents(tokenizer_dir, en_texts[:third]), 600)
    write_with_megatron(meg / "b_text_document", encoded_documents(tokenizer_dir, en_texts[third:2 * third]), 600)
    write_with_megatron(meg / "val_text_document", encoded_documents(tokenizer_dir, en_texts[-30:]), 600)
    rest = en_texts[2 * third:-30]
    for index, part in enumerate((rest[:len(rest) // 2], rest[len(rest) // 2:])):
        write_with_megatron(meg / "docs" / f"part{index}_text_document", encoded_documents(tokenizer_dir, part, None), 600)
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "curriculum" / "mine.yaml").write_text(f"""\
name: mine
default_max_repetition: 100.0
domains:
  web:
    megatron: "0.7 {meg / 'a_text_document'} 0.3 {meg / 'b_text_document'}"
    megatron_val: {meg / 'val_text_document'}
  docs:
    megatron: {meg / 'docs'}
    append_eod: true
stages:
  - name: web_first
    tokens: 8000
    weights: {{web: 0.8, docs: 0.2}}
  - name: docs_more
    tokens: 57536
    weights: {{web: 0.3, docs: 0.7}}
""")
    env = cpu_env(AYUMI_CONF_DIR=str(conf))
    common = ["curriculum=mine", f"data.tokenizer_dir={tokenizer_dir}", "model.vocab_size=640"]
    planned = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "plan",
                              *tiny_overrides(tmp_path / "planned", tmp_path / "runs", *common)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert planned.returncode == 0, planned.stdout
    rows = [line.split() for line in planned.stdout.splitlines() if line.split()[:1] in (["web"], ["docs"])]
    assert [row[:2] for row in rows] == [["web", "0.800"], ["docs", "0.200"], ["web", "0.300"], ["docs", "0.700"]]
    assert "plan ok" in planned.stdout
    manifest = json.loads((tmp_path / "planned" / "manifest.json").read_text())
    assert {name: record["curriculum"] for name, record in manifest["domains"].items()} == {"web": "mine", "docs": "mine"}
    docs = manifest["domains"]["docs"]["splits"]["train"]["shards"]
    assert [Path(s["prefix"]).name for s in docs] == ["part0_text_document", "part1_text_document"]
    assert all(s["append_eod"] for s in docs)

    root = tmp_path / "fresh"  # not planned: the ranks register the curriculum's domains (rank 0 writes)
    run = run_training(tiny_overrides(root, tmp_path / "runs", *common, "train.max_steps=24", "train.eval_interval=12"),
                       nproc=2, env=env, launcher="fork")
    assert run.returncode == 0, run.stdout[-4000:]
    assert json.loads((root / "manifest.json").read_text())["domains"] == manifest["domains"]
    run_dir = tmp_path / "runs" / "cpu_tiny"
    switches = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stage_switch"]
    assert [(e["step"], e["stage"]) for e in switches] == [(1, 1), (16, 2)]  # 8,000 tokens = sample 125, in step 16
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 24 and losses[-1] < losses[0]
    assert any("train/loss/docs" in m for m in metrics) and any("val/web/loss" in m for m in metrics)
