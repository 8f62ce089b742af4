"""A curriculum file that brings its own Megatron data (`domains:` in conf/curriculum): registered into the data
root by the code `ayumi data prepare` runs for conf/data's Megatron domains, at plan and training start, and refused,
one line naming the key or file, where it cannot be trusted. (The end-to-end run through `ayumi plan` and 2 training
ranks on megatron-core's own shards is in test_megatron_interop.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from curriculum.config import CurriculumConfig, CurriculumError, Stage, config_problems
from curriculum.declared import register_curriculum_domains
from curriculum.plan import plan_from_config
from data.config import DomainConfig
from data.domains import open_run_data
from data.megatron import MegatronDataError
from data.prepare import prepare
from data.shards import TokenizerMismatchError
from pretrain.config import compose_config, to_object
from pretrain.model.flops import count_parameters
from tests.data.helpers import domain, make_config, write_jsonl
from tests.data.test_megatron_domains import EOS, encoded, write_prefix
from tests.helpers import REPO, cpu_env, run_training, tiny_overrides


def declaring(root, tokenizer_dir, domains: dict, name: str = "mine") -> SimpleNamespace:
    """What register_curriculum_domains reads of a training config."""
    return SimpleNamespace(curriculum=CurriculumConfig(name=name, domains=domains),
                           data=SimpleNamespace(root=str(root), tokenizer_dir=str(tokenizer_dir)))


def without_origin(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in ("curriculum", "record_sha256")}


@pytest.fixture
def web(tmp_path, tokenizer_dir, en_texts) -> dict:
    """A weighted pair of prefixes and a validation prefix, as a curriculum declares them."""
    docs = encoded(tokenizer_dir, en_texts[:60])
    a = write_prefix(tmp_path / "meg" / "a_text_document", docs[:30])
    b = write_prefix(tmp_path / "meg" / "b_text_document", docs[30:50])
    val = write_prefix(tmp_path / "meg" / "val_text_document", docs[50:])
    return {"megatron": f"0.25 {a} 0.75 {b}", "megatron_val": str(val)}


def test_a_curriculum_domain_joins_a_prepared_root_as_conf_data_would_register_it(tmp_path, tokenizer_dir, en_texts,
                                                                                    web, monkeypatch):
    root = tmp_path / "root"
    text_cfg = make_config(root, tokenizer_dir, {"en": domain([write_jsonl(tmp_path / "en.jsonl", en_texts[60:140])],
                                                              val_fraction=0.1)})
    before = prepare(text_cfg)
    manifest = register_curriculum_domains(declaring(root, tokenizer_dir, {"web": web}))
    assert list(manifest["domains"]) == ["en", "web"]
    assert manifest["domains"]["en"] == before["domains"]["en"] and manifest["overlap_check"] == before["overlap_check"]
    record = manifest["domains"]["web"]
    reference = prepare(make_config(tmp_path / "ref", tokenizer_dir, {"web": DomainConfig(**web)}))["domains"]["web"]
    assert without_origin(record) == without_origin(reference)  # the same checks and record as conf/data's form
    assert record["curriculum"] == "mine" and record["fingerprint"] == reference["fingerprint"]
    assert [s["weight"] for s in record["splits"]["train"]["shards"]] == [0.25, 0.75]
    _, train, val = open_run_data(root, None, seq_len=32, vocab_size=640)  # checked as training checks it
    assert set(train) == set(val) == {"en", "web"} and len(train["web"]) > 0

    # Nothing changed: the prefixes are not read again and the root is not written.
    def no_reading(*args, **kwargs):
        raise AssertionError("an up-to-date domain was checked again")

    monkeypatch.setattr("data.megatron.megatron_record", no_reading)
    written = (root / "manifest.json").stat()
    assert register_curriculum_domains(declaring(root, tokenizer_dir, {"web": web})) == manifest
    assert (root / "manifest.json").stat().st_mtime_ns == written.st_mtime_ns
    # `ayumi data prepare` writes its own domains' manifest; the next start adds the curriculum's back, unread.
    assert list(prepare(text_cfg)["domains"]) == ["en"]
    assert register_curriculum_domains(declaring(root, tokenizer_dir, {"web": web}))["domains"]["web"] == record


def test_a_fresh_root_is_made_of_the_declared_domains_and_the_plan_counts_them(tmp_path, tokenizer_dir, web):
    root = tmp_path / "fresh" / "root"
    cfg = to_object(compose_config(tiny_overrides(root, tmp_path / "runs", f"data.tokenizer_dir={tokenizer_dir}",
                                                  "model.vocab_size=640")))
    cfg.curriculum = CurriculumConfig(name="mine", domains={"web": web}, default_max_repetition=1000,
                                      stages=[Stage("only", cfg.train.tokens, {"web": 1.0})])
    plan = plan_from_config(cfg, count_parameters(cfg.model), free_bytes=2**40)
    assert plan.problems == [], plan.problems
    web_tokens = json.loads((root / "manifest.json").read_text())["domains"]["web"]["splits"]["train"]["tokens"]
    assert [(row.domain, row.available_tokens) for row in plan.domains] == [("web", web_tokens)]
    assert sorted(path.name for path in root.iterdir()) == ["manifest.json", "web"]  # no .partial left behind
    # A misdeclared domain is a config problem of the plan, one line naming the key; nothing is registered.
    cfg.curriculum.domains = {"code": {"megatron_val": "/data/code_val"}}
    refused = plan_from_config(cfg, count_parameters(cfg.model), free_bytes=2**40)
    assert [p.kind for p in refused.problems][:1] == ["config"]
    assert refused.problems[0].message.startswith("curriculum.domains.code.megatron is not set")
    assert not (root / "code").exists()


def test_declared_data_that_cannot_be_trusted_is_refused_naming_the_key(tmp_path, tokenizer_dir, other_tokenizer_dir,
                                                                         en_texts, web):
    bad = write_prefix(tmp_path / "bad_text_document", [[5, 7, EOS], [650, EOS]], vocab=1000)
    with pytest.raises(MegatronDataError, match=rf"^curriculum\.domains\.web\.megatron: {bad}\.bin holds id 650, outside "
                                                r"the vocabulary \[0, 600\)"):
        register_curriculum_domains(declaring(tmp_path / "r1", tokenizer_dir, {"web": {"megatron": str(bad)}}))
    assert not (tmp_path / "r1" / "manifest.json").exists()

    plain = write_prefix(tmp_path / "plain_text_document", encoded(tokenizer_dir, en_texts[:10], eos=False))
    with pytest.raises(MegatronDataError, match=r"do not end with EOD id 2.*set curriculum\.domains\.web\.append_eod=true"):
        register_curriculum_domains(declaring(tmp_path / "r2", tokenizer_dir, {"web": {"megatron": str(plain)}}))

    with pytest.raises(MegatronDataError, match=r"^curriculum\.domains declares Megatron data \(web\).*data\.tokenizer_dir "
                                                r"is not set"):
        register_curriculum_domains(declaring(tmp_path / "r3", "", {"web": web}))

    text = write_jsonl(tmp_path / "en.jsonl", en_texts[60:100])
    other = tmp_path / "other"
    prepare(make_config(other, other_tokenizer_dir, {"en": domain([text])}))
    with pytest.raises(TokenizerMismatchError, match=rf"^curriculum\.domains: data root {other} holds data made with "
                                                     r"tokenizer .*a data root has one tokenizer"):
        register_curriculum_domains(declaring(other, tokenizer_dir, {"web": web}))

    same = tmp_path / "same"
    prepared = prepare(make_config(same, tokenizer_dir, {"en": domain([text])}))
    with pytest.raises(MegatronDataError, match=r"^curriculum\.domains\.en: data root .* already has a domain 'en' made by "
                                                r"`ayumi data prepare` \(from corpus files\)"):
        register_curriculum_domains(declaring(same, tokenizer_dir, {"en": web}))
    assert open_run_data(same, None, seq_len=16)[0] == prepared  # the prepared domain is untouched


@pytest.mark.parametrize("node, fragment", [
    ({"inputs": ["/data/code/*.jsonl"]}, "curriculum.domains.code.inputs: a curriculum declares existing Megatron "
                                         "data only. Fix: prepare corpus files from conf/data"),
    ({"append_eod": True}, "curriculum.domains.code.megatron is not set: a curriculum declares existing Megatron data "
                           "only. Fix: curriculum.domains.code.megatron='0.7 /data/a_text_document"),
    ({"megatron": "/p", "megatrn_val": "/q"}, "curriculum.domains.code.megatrn_val: Key 'megatrn_val' not in"),
    ({"megatron": "/p", "append_eod": True, "val_fraction": 0.1, "megatron_val": "/q"},
     "curriculum.domains.code: megatron_val is this domain's validation set"),
])
def test_a_misdeclared_domain_is_a_curriculum_problem_naming_the_key(node, fragment):
    cfg = CurriculumConfig(name="mine", domains={"code": node}, stages=[Stage("s", 10, {"code": 1.0})])
    problems = config_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith(fragment), problems
    with pytest.raises(CurriculumError, match="curriculum 'mine' is invalid"):
        register_curriculum_domains(SimpleNamespace(curriculum=cfg, data=SimpleNamespace(root="/nowhere",
                                                                                         tokenizer_dir="/nowhere")))


def test_ayumi_train_refuses_a_declared_prefix_that_is_gone_with_one_line(tmp_path, tokenizer_dir, web):
    """Through the real entry: the launching process registers the curriculum's domains before any rank starts."""
    prefix = web["megatron"].split()[1]
    os.unlink(prefix + ".idx")
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.tools.cli", "train", *tiny_overrides(tmp_path / "root", tmp_path / "runs"),
         f"data.tokenizer_dir={tokenizer_dir}", "model.vocab_size=640", f"+curriculum.domains.web.megatron={prefix}"],
        cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"ayumi train: curriculum.domains.web.megatron: shard index {prefix}.idx does not exist (its .bin does: an "
        f"unfinished or damaged shard). Fix: check the prefix in curriculum.domains.web.megatron, or restore or "
        f"re-preprocess {prefix}"]
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_training_ranks_refuse_a_declared_prefix_that_is_gone_once(tmp_path, tokenizer_dir, web):
    """A job a scheduler starts (no `ayumi train` check before it): rank 0 registers and says why, once; the other
    rank waits for its answer and leaves without a message or a traceback of ours."""
    prefix = web["megatron"].split()[1]
    os.unlink(prefix + ".idx")
    proc = run_training(tiny_overrides(tmp_path / "root", tmp_path / "runs", f"data.tokenizer_dir={tokenizer_dir}",
                                       "model.vocab_size=640", f"+curriculum.domains.web.megatron={prefix}"), nproc=2)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pretrain.train:")]
    assert lines == [
        f"pretrain.train: curriculum.domains.web.megatron: shard index {prefix}.idx does not exist (its .bin does: an "
        f"unfinished or damaged shard). Fix: check the prefix in curriculum.domains.web.megatron, or restore or "
        f"re-preprocess {prefix}"], proc.stdout[-3000:]
    ours = [line for line in proc.stdout.splitlines()  # torchrun reports its failed children; our code prints no traceback
            if line.strip().startswith(tuple(f'File "{REPO / package}' for package in ("data", "curriculum", "pretrain")))]
    assert ours == [] and not (tmp_path / "root" / "manifest.json").exists()
