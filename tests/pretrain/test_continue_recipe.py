"""The continued-pretraining recipe as documented: every `ayumi` command of README's "Continue from an existing
model", docs/continued-pretraining.md and the header of conf/experiment/continue_ja.yaml composes as written,
and the curriculum fits the domains its data command prepares (an `unknown domain(s)` refusal once shipped).
Also `ayumi plan experiment=continue_ja` without a base: one line per missing setting, exit status 2."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO

BASE = "/models/Llama-2-7b-hf"
TOKENIZER = "runs/tok_ja43k"
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
             "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
             "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
             "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
             "torch_dtype": "float16", "vocab_size": 32000}
"""config.json of meta-llama/Llama-2-7b-hf, the base the documents name (no weights are read to compose)."""


def readme_section() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("## Continue from an existing model")
    return text[start:text.index("\n## ", start + 1)]


def yaml_header() -> str:
    """The comment lines that open the experiment, as a shell block (the leading '#' dropped)."""
    lines = (REPO / "conf" / "experiment" / "continue_ja.yaml").read_text(encoding="utf-8").splitlines()
    comments = [line[1:] for line in lines if line.startswith("#") and not line.startswith("# @package")]
    return "```bash\n" + "\n".join(comments) + "\n```"


DOCUMENTS = {
    "README.md": readme_section,
    # The page up to its context-extension recipe (tests/pretrain/test_extend_recipe.py composes that one).
    "docs/continued-pretraining.md": lambda: (REPO / "docs" / "continued-pretraining.md").read_text(
        encoding="utf-8").split("## Extending the context to 32k")[0],
    "conf/experiment/continue_ja.yaml": yaml_header,
}


def documented_commands(text: str) -> list[list[str]]:
    """Every `ayumi ...` command line of the ```bash blocks, continuation lines joined, split as a shell would."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("ayumi "):
                commands.append(shlex.split(line)[1:])
    return commands


@pytest.fixture
def stand_ins(tmp_path) -> dict[str, str]:
    """Paths the documents name -> stand-ins: the base's config.json, the expanded tokenizer's record."""
    base = tmp_path / "Llama-2-7b-hf"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(LLAMA2_7B))
    tokenizer = tmp_path / "tok_ja43k"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_meta.json").write_text(json.dumps({"vocab_size": 43008}))
    return {BASE: str(base), TOKENIZER: str(tokenizer)}


def with_stand_ins(args: list[str], stand_ins: dict[str, str]) -> list[str]:
    for documented, here in stand_ins.items():
        args = [arg.replace(documented, here) for arg in args]
    return args


@pytest.mark.parametrize("document", sorted(DOCUMENTS))
def test_the_documented_recipe_composes_and_its_curriculum_fits_its_data(document, stand_ins):
    from curriculum.config import config_problems
    from data.cli import compose as compose_data
    from data.config import check_prepare_config, prepare_config
    from pretrain.config import config_from_args

    commands = documented_commands(DOCUMENTS[document]())
    verbs = [" ".join(args[:2]) if args[0] in ("tokenizer", "data", "export") else args[0] for args in commands]
    assert {"tokenizer expand", "data prepare", "train"} <= set(verbs), verbs

    expand = commands[verbs.index("tokenizer expand")]
    assert expand[2] == BASE and expand[expand.index("--out") + 1] == TOKENIZER

    prepared = prepare_config(compose_data(with_stand_ins(commands[verbs.index("data prepare")][2:], stand_ins)))
    check_prepare_config(prepared)  # every domain has inputs: nothing left as "..."
    domains = list(prepared.data.domains)
    assert domains == ["ja", "en"]

    runs = [args for verb, args in zip(verbs, commands) if verb in ("train", "plan")]
    for args in runs:
        cfg = config_from_args(with_stand_ins(args[1:], stand_ins))
        assert cfg.model.init_from == stand_ins[BASE] and cfg.model.vocab_size == 43008  # grown to the tokenizer
        assert cfg.data.tokenizer_dir == prepared.tokenizer_dir == stand_ins[TOKENIZER]  # the data's tokenizer
        assert cfg.data.root == prepared.data.root  # reads what the data command wrote
        assert [stage.name for stage in cfg.curriculum.stages] == ["japanese", "mix_back"]
        assert config_problems(cfg.curriculum, cfg.train.tokens, known_domains=domains) == []


def test_a_curriculum_naming_other_domains_is_refused():
    """The check above can fail: continue_ja's weights against data=ja_en_math_code's domains."""
    from curriculum.config import config_problems
    from data.cli import compose as compose_data
    from pretrain.config import compose_config, to_object

    cfg = to_object(compose_config(["experiment=continue_ja", "model.init_from=/m", "data.tokenizer_dir=/t"]))
    other = list(compose_data(["data=ja_en_math_code"]).data.domains)
    problems = config_problems(cfg.curriculum, cfg.train.tokens, known_domains=other)
    assert len(problems) == 2 and all("unknown domain(s) ja;" in line for line in problems), problems


def plan(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("AYUMI_BASE_MODEL", "AYUMI_TOKENIZER_DIR")}
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "plan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_plan_without_a_base_names_the_setting_in_one_line():
    proc = plan("experiment=continue_ja", "data.tokenizer_dir=/tok")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "ayumi plan: model.init_from is not set: give model.init_from=PATH on the command line, or set the "
        "environment variable AYUMI_BASE_MODEL (export AYUMI_BASE_MODEL=PATH)"]
    neither = plan("experiment=continue_ja")
    assert neither.returncode == 2
    lines = neither.stderr.splitlines()
    assert len(lines) == 2 and "model.init_from=PATH" in lines[0] and "data.tokenizer_dir=DIR" in lines[1], lines
    assert "AYUMI_TOKENIZER_DIR" in lines[1] and "KeyError" not in neither.stderr
