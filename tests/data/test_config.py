"""The data configs: every shipped YAML composes, unknown keys and wrong types are rejected by name."""
from pathlib import Path

import pytest

from data.cli import compose, resolved_yaml
from data.config import ConfigError, DomainConfig, check_prepare_config, prepare_config

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("preset", sorted(path.stem for path in (CONF / "data").glob("*.yaml")))
def test_every_data_preset_composes(preset):
    cfg = compose([f"data={preset}", "tokenizer_dir=/tok"] +
                  [f"data.domains.{name}.inputs=['/x/{name}/*.jsonl']" for name in compose([f"data={preset}"]).data.domains])
    prepared = prepare_config(cfg)
    check_prepare_config(prepared)
    assert prepared.data.name == preset
    assert all(isinstance(domain, DomainConfig) for domain in prepared.data.domains.values())
    assert prepared.data.root.endswith(f"shards/{preset}")


def test_ja_en_math_code_has_the_curriculum_domains():
    cfg = compose(["data=ja_en_math_code"])
    assert list(cfg.data.domains) == ["ja_raw", "ja_clean", "en", "math", "code"]


def test_root_follows_env_and_name(monkeypatch):
    monkeypatch.setenv("AYUMI_DATA_ROOT", "/big/disk")
    cfg = prepare_config(compose(["tokenizer_dir=/t", "data.name=mine", "data.domains.en.inputs=[a]", "data.domains.ja.inputs=[b]"]))
    assert cfg.data.root == "/big/disk/shards/mine"


def test_new_domain_from_command_line():
    cfg = prepare_config(compose(["tokenizer_dir=/t", "+data.domains.code.inputs=['/c/*.py.jsonl']",
                                  "+data.domains.code.clean.normalize=none"]))
    assert cfg.data.domains["code"].inputs == ["/c/*.py.jsonl"]
    assert cfg.data.domains["code"].clean.normalize == "none"
    assert cfg.data.domains["code"].clean.min_chars == 1  # defaults filled in


@pytest.mark.parametrize("override, message", [
    ("data.domains.en.bogus=1", "data.domains.en.bogus"),  # Hydra: not in the domain's schema
    ("+data.domains.en.bogus=1", "data.domains.en.bogus"),  # forced in: our check names it
    ("+data.domains.en.clean.bogus=1", "data.domains.en.clean.bogus"),
    ("data.domains.en.val_fraction=abc", "data.domains.en.val_fraction"),  # Hydra: wrong type
    ("+data.domains.x.inputs=3", "data.domains.x.inputs"),  # untyped new domain: our check
])
def test_bad_domain_keys_are_named(override, message):
    with pytest.raises(Exception, match=message.replace(".", r"\.")):
        prepare_config(compose(["tokenizer_dir=/t", override]))


def test_unknown_top_level_key_rejected():
    with pytest.raises(Exception, match="bogus"):
        compose(["bogus=1"])
    with pytest.raises(Exception, match="workers"):
        compose(["workers=many"])


def test_missing_tokenizer_dir_is_named():
    with pytest.raises(ConfigError, match="tokenizer_dir"):
        prepare_config(compose([]))


@pytest.mark.parametrize("overrides, message", [
    (["data.domains.en.inputs=[]"], "data.domains.en.inputs is empty"),
    (["data.domains.en.val_fraction=1.5"], "val_fraction"),
    (["data.domains.en.clean.normalize=NFD"], "normalize"),
    (["data.domains.en.clean.dedup=fuzzy"], r"data\.domains\.en\.clean\.dedup='fuzzy' is not one of exact, normalized, off"),
    (["data.domains.en.clean.dedup=true"], r"data\.domains\.en\.clean\.dedup=True is a switch.*normalized \(what true used to mean"),
    (["data.domains.en.clean.script=none", "data.domains.en.clean.min_script_share=0.5"], "needs data.domains.en.clean.script"),
    (["workers=-1"], "workers"),
])
def test_cross_checks(overrides, message):
    base = ["tokenizer_dir=/t", "data.domains.en.inputs=[a]", "data.domains.ja.inputs=[b]"]
    with pytest.raises(ConfigError, match=message):
        check_prepare_config(prepare_config(compose(base + overrides)))


def test_cfg_job_prints_resolved_config_with_defaults():
    text = resolved_yaml(compose(["tokenizer_dir=/t", "data.root=/r/${data.name}"]))
    assert "root: /r/tiny" in text and "max_symbol_share: 1.0" in text and "tokenizer_dir: /t" in text


def test_val_count_alone_replaces_the_presets_fraction():
    """Issue 48, papercut 3: data=ja_en holds out val_fraction=0.001, none of a small corpus;
    data.domains.ja.val_count=20 was refused ("set val_fraction or val_count, not both") until the fraction was also set to 0. val_count alone
    now makes the fraction 0; the other domain keeps the preset's."""
    cfg = prepare_config(compose(["data=ja_en", "tokenizer_dir=/t", "data.domains.ja.inputs=[a]",
                                  "data.domains.en.inputs=[b]", "data.domains.ja.val_count=20"]))
    check_prepare_config(cfg)
    ja, en = cfg.data.domains["ja"], cfg.data.domains["en"]
    assert (ja.val_count, ja.val_fraction) == (20, 0.0)
    assert (en.val_count, en.val_fraction) == (0, 0.001)


def test_new_typed_domain_from_command_line():
    cfg = compose(["tokenizer_dir=/t", "+data_domain@data.domains.legal=schema", "data.domains.legal.inputs=[l]",
                   "data.domains.legal.val_count=7"])
    assert prepare_config(cfg).data.domains["legal"].val_count == 7
