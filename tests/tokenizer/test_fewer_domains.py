"""A preset with fewer domains: tokenizer.domains.X.enabled=false, one override per dropped domain,
the remaining domains' shares renormalised (issue 14.5); through the real `ayumi` entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.status import BAD_INPUT
from tests.tokenizer.conftest import tiny_overrides
from tokenizer.cli import compose, to_object
from tokenizer.config import NUM_BYTE_PIECES, TokenizerConfigError, check_tokenizer_config, enabled_domains

REPO = Path(__file__).resolve().parents[2]


def ayumi(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "tokenizer", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_japanese_and_english_from_the_tiny_preset(tmp_path):
    job = to_object(compose(["tokenizer=tiny", "tokenizer.domains.code.enabled=false",
                             "tokenizer.domains.math.enabled=false", f"tokenizer.inputs.ja={tmp_path}/ja.txt",
                             f"tokenizer.inputs.en={tmp_path}/en.txt"]))
    tok = enabled_domains(job.tokenizer)
    check_tokenizer_config(tok)  # no complaint about the preset's code/math inputs
    assert list(tok.domains) == ["ja", "en"] and list(tok.inputs) == ["ja", "en"]
    fixed = NUM_BYTE_PIECES + 5  # bytes + unk/bos/eos/pad + "\n"
    before = {d: c.vocab_size - fixed for d, c in job.tokenizer.domains.items()}
    after = {d: c.vocab_size - fixed for d, c in tok.domains.items()}
    assert sum(after.values()) == pytest.approx(sum(before.values()), abs=1)  # learned pieces kept in all
    assert after["ja"] / after["en"] == pytest.approx(before["ja"] / before["en"], rel=0.01)  # ratio kept
    assert enabled_domains(tok) is tok  # idempotent
    unscaled = to_object(compose(["tokenizer=tiny"] + [f"tokenizer.domains.{d}.{k}" for d in ("code", "math")
                                                       for k in ("enabled=false", "vocab_size=16")]))
    assert {d: c.vocab_size for d, c in enabled_domains(unscaled.tokenizer).domains.items()} == {"ja": 1200, "en": 800}


def test_every_domain_disabled_is_one_clear_error():
    job = to_object(compose(["tokenizer=tiny"] + [f"tokenizer.domains.{d}.enabled=false" for d in ("ja", "en", "code", "math")]))
    with pytest.raises(TokenizerConfigError, match="every domain .* is disabled"):
        enabled_domains(job.tokenizer)


@pytest.mark.slow
def test_cli_builds_without_two_preset_domains(corpus, tmp_path):
    out = tmp_path / "en_code"
    args = [o for o in tiny_overrides(corpus, out) if not o.startswith(("tokenizer.inputs.ja", "tokenizer.inputs.math"))]
    result = ayumi("build", *args, "tokenizer.domains.ja.enabled=false", "tokenizer.domains.math.enabled=false",
                   "tokenizer.evaluate.baseline=false")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "without ja, math: domain vocab sizes renormalised" in result.stdout
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    assert set(meta["samples"]) == {"en", "code"} and meta["vocab_size"] == 1000
    sizes = {d: c["vocab_size"] for d, c in meta["config"]["domains"].items()}
    assert set(sizes) == {"en", "code"} and sizes["en"] > 600 and sizes["code"] > 500  # grown from 600 / 500
    assert all(r["mismatches"] == 0 for r in meta["hf_parity"].values())


def test_cli_removing_a_preset_domain_points_to_enabled(corpus, tmp_path):
    args = [o for o in tiny_overrides(corpus, tmp_path / "o") if not o.startswith("tokenizer.inputs.code")]
    result = ayumi("build", *args, "~tokenizer.domains.code")
    assert result.returncode == BAD_INPUT
    assert "tokenizer.domains.code.enabled=false" in result.stderr and len(result.stderr.strip().splitlines()) == 1
