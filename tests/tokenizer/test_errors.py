"""Bad input: each case gets a clear message naming the domain/file/key and a fix; outputs stay atomic."""
from __future__ import annotations

import pytest

from common.status import BAD_INPUT
from tests.tokenizer.conftest import tiny_overrides
from tokenizer.cli import compose, main, to_object


def run(overrides, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["build", *overrides])
    return code, capsys.readouterr().err


def test_missing_domain_inputs(corpus, tmp_path, capsys):
    overrides = [o for o in tiny_overrides(corpus, tmp_path / "o") if not o.startswith("tokenizer.inputs.math")]
    code, err = run(overrides, capsys)
    assert code == BAD_INPUT and "domain 'math' has no inputs" in err and "tokenizer.inputs.math=" in err


def test_pattern_matching_nothing(corpus, tmp_path, capsys):
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + [f"tokenizer.inputs.en={tmp_path}/none/*.jsonl"], capsys)
    assert code == BAD_INPUT and "domain 'en'" in err and "matches no readable file" in err


def test_empty_domain(corpus, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + [f"tokenizer.inputs.en={tmp_path}/empty.jsonl"], capsys)
    assert code == BAD_INPUT and "domain 'en' has no usable training text" in err and "empty_file=1" in err


def test_malformed_lines_strict_names_file_and_line(corpus, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(corpus["en"].read_bytes() + b"{broken\n" + b'{"text": "\xff"}\n')
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + [f"tokenizer.inputs.en={bad}", "tokenizer.strict=true"], capsys)
    assert code == BAD_INPUT and f"{bad}:" in err and "malformed JSON" in err and "strict=false" in err


@pytest.mark.slow
def test_malformed_lines_skipped_and_counted(corpus, tmp_path, capsys):
    import json

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(corpus["en"].read_bytes() + b"{broken\n" + b'{"text": "\xff"}\n')
    out = tmp_path / "o"
    args = tiny_overrides(corpus, out, **{"tokenizer.evaluate.baseline": "false", "tokenizer.merge.em_iterations": 0})
    code, _ = run(args + [f"tokenizer.inputs.en={bad}"], capsys)
    assert code == 0
    skipped = json.loads((out / "tokenizer_meta.json").read_text())["samples"]["en"]["read"]["skipped"]
    assert skipped == {"malformed_json": 1, "invalid_utf8": 1}


def test_vocab_larger_than_data_supports(corpus, tmp_path, capsys):
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + ["tokenizer.domains.math.vocab_size=5000"], capsys)
    assert code == BAD_INPUT and "domain 'math'" in err and "more than its sample supports" in err and "Fix" in err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.tmp-*")), "no partial output may remain"


@pytest.mark.parametrize("override,message", [
    ("tokenizer.specials.eos='<s>'", "duplicates specials.bos"),
    ("tokenizer.specials.user_defined=['<ja>','<ja>']", "duplicates specials.user_defined[0]"),
    ("tokenizer.specials.pad='<0x41>'", "collides with the byte piece"),
    ("tokenizer.specials.pad_id=1", "must be 0, 1, 2 and 3"),
])
def test_special_token_collisions(corpus, tmp_path, capsys, override, message):
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + [override], capsys)
    assert code == BAD_INPUT and message in err


def test_unknown_key_and_wrong_type_rejected_by_name(corpus, tmp_path, capsys):
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + ["tokenizer.total_vocabb=3"], capsys)
    assert code == BAD_INPUT and "total_vocabb" in err
    code, err = run(tiny_overrides(corpus, tmp_path / "o") + ["tokenizer.total_vocab=lots"], capsys)
    assert code == BAD_INPUT and "total_vocab" in err


def test_interrupted_build_leaves_nothing_that_looks_complete(corpus, tmp_path, monkeypatch):
    import tokenizer.export_hf as export_hf
    from tokenizer.build import build_tokenizer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_hf, "export_hf", interrupted)
    job = to_object(compose(tiny_overrides(corpus, tmp_path / "o", **{"tokenizer.merge.em_iterations": 0})))
    with pytest.raises(KeyboardInterrupt):
        build_tokenizer(job.tokenizer, tmp_path / "o", log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


def test_cfg_job_prints_resolved_config(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AYUMI_DATA_ROOT", str(tmp_path / "root"))
    assert main(["build", "tokenizer=ja_en_math_code_50k", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert f"output_dir: {tmp_path}/root/tokenizers/ja_en_math_code_50k" in out
    assert "total_vocab: 50000" in out and "vocab_size: 30000" in out


def test_shipped_presets_compose_and_pass_checks(corpus):
    from tokenizer.config import check_tokenizer_config

    for preset in ("tiny", "ja_en_math_code_50k"):
        job = to_object(compose([f"tokenizer={preset}"] + [f"tokenizer.inputs.{d}={p}" for d, p in corpus.items()]))
        check_tokenizer_config(job.tokenizer)


def test_sweep_expands_comma_overrides_into_candidates():
    from tokenizer.cli import sweep_candidates

    combos = sweep_candidates(["tokenizer=tiny", "tokenizer.total_vocab=1000,2000", "tokenizer.model_type=unigram,bpe"])
    assert len(combos) == 4
    assert ["tokenizer=tiny", "tokenizer.total_vocab=2000", "tokenizer.model_type=bpe"] in combos


def test_a_misspelt_key_gets_one_line_with_did_you_mean_through_ayumi(capsys):
    """Issue 39, item 2: `ayumi tokenizer build` gave Hydra's raw five lines for a typo; now one line as `train`
    gives it: the override as typed, "did you mean", or the '+' a key new to a mapping needs."""
    from pretrain.tools.cli import main as ayumi

    cases = {
        "tokenizer.total_vocb=100": "ayumi tokenizer build: config error: tokenizer.total_vocb=100: tokenizer has no "
                                    "key 'total_vocb'; did you mean tokenizer.total_vocab?",
        "tokenizr.total_vocab=100": "ayumi tokenizer build: config error: tokenizr.total_vocab=100: the config has no "
                                    "key 'tokenizr'; did you mean tokenizer?",
        "tokenizer.domains.xx.vocab_size=100": "ayumi tokenizer build: config error: tokenizer.domains.xx.vocab_size="
                                               "100: tokenizer.domains has no key 'xx': a new key needs Hydra's '+' "
                                               "(+tokenizer.domains.xx.vocab_size=100)",
    }
    for override, line in cases.items():
        capsys.readouterr()
        assert ayumi(["tokenizer", "build", override, "--cfg", "job"]) == BAD_INPUT
        assert capsys.readouterr().err.splitlines() == [line]
