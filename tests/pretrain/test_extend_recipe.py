"""The context-extension recipe as documented: every `ayumi` command of docs/continued-pretraining.md's "Extending
the context to 32k" and of the header of conf/experiment/extend_32k.yaml composes as written, with a Llama-3.1-8B
config.json standing in for the base: two stages of 8192 then 32768 tokens under sequence parallelism 4 with document
masking, the curriculum fits the data command's domains, each stage's memory fits the planned GPUs (the loss chunked),
and the plan shows each stage's RoPE. The RoPE-base variant for a base without scaling runs against Llama-3-8B's own
config.json (8192 positions) and gives the long stage its base; the 3.1 commands on that base are refused with the
fix. Both config.json files hold the published fields of the models they stand for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.pretrain.test_continue_recipe import documented_commands

BASE = "/models/Llama-3.1-Swallow-8B"
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
              "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
              "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256}
"""config.json of meta-llama/Llama-3.1-8B, the architecture of the base the documents name (no weights are read)."""
LLAMA3_8B = {**LLAMA31_8B, "max_position_embeddings": 8192, "rope_scaling": None}
"""config.json of meta-llama/Meta-Llama-3-8B: Llama 3.1's architecture at 8192 positions, without RoPE scaling (the
base of the documented RoPE-base variant, e.g. a Llama 3 Swallow)."""


def docs_section() -> str:
    text = (REPO / "docs" / "continued-pretraining.md").read_text(encoding="utf-8")
    start = text.index("## Extending the context to 32k")
    return text[start:]


def yaml_header() -> str:
    lines = (REPO / "conf" / "experiment" / "extend_32k.yaml").read_text(encoding="utf-8").splitlines()
    comments = [line[1:] for line in lines if line.startswith("#") and not line.startswith("# @package")]
    return "```bash\n" + "\n".join(comments) + "\n```"


def bullets_commands(text: str) -> list[list[str]]:
    """`ayumi ...` commands quoted inline (`...`) in the text, e.g. the RoPE-base variant."""
    import re
    import shlex

    return [shlex.split(found)[1:] for found in re.findall(r"`(ayumi train [^`]+)`", text)]


def base_folder(tmp_path: Path, name: str, config: dict) -> str:
    """A base model's folder holding only its published config.json (the recipe reads nothing else at plan time)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def base(tmp_path) -> str:
    return base_folder(tmp_path, "Llama-3.1-Swallow-8B", LLAMA31_8B)


@pytest.mark.parametrize("document", ["docs", "yaml"])
def test_the_documented_extension_composes_and_each_stage_fits(document, base):
    from curriculum.config import config_problems
    from data.cli import compose as compose_data
    from data.config import check_prepare_config, prepare_config
    from pretrain.config import config_from_args
    from pretrain.model.flops import count_parameters
    from pretrain.plan.hardware import planned_hardware
    from pretrain.plan.run_plan import format_run_plan, run_plan
    from pretrain.stages import stage_problems

    text = docs_section() if document == "docs" else yaml_header()
    commands = [[arg.replace(BASE, base) for arg in args] for args in documented_commands(text)]
    verbs = [" ".join(args[:2]) if args[0] in ("data", "export") else args[0] for args in commands]
    assert {"data prepare", "plan", "train"} <= set(verbs), verbs
    prepared = prepare_config(compose_data(commands[verbs.index("data prepare")][2:]))
    check_prepare_config(prepared)
    assert prepared.tokenizer_dir == base  # the base's own tokenizer makes the data
    domains = list(prepared.data.domains)
    for args in (args for verb, args in zip(verbs, commands) if verb in ("plan", "train")):
        cfg = config_from_args(args[1:])
        assert cfg.model.init_from == base and cfg.data.tokenizer_dir == base and cfg.data.root == prepared.data.root
        assert (cfg.model.hidden_size, cfg.model.num_kv_heads, cfg.model.rope_scaling.type) == (4096, 8, "llama3")
        assert cfg.model.attention == "document" and cfg.parallel.sequence == 4
        assert [stage.seq_len or cfg.train.seq_len for stage in cfg.curriculum.stages] == [8192, 32768]
        assert cfg.curriculum.stages[1].min_document_tokens == {"ja": 8192}
        assert config_problems(cfg.curriculum, cfg.train.tokens, known_domains=domains) == []
        assert stage_problems(cfg.curriculum.stages, cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size) == []
        planned = run_plan(cfg, count_parameters(cfg.model), planned_hardware(cfg), free_bytes=2**50)
        assert [p.kind for p in planned.problems] == ["data"]  # only the data is missing here
        [(label, long_stage)] = planned.stage_memory
        assert label == "stage 2 'long_32k' (seq_len 32768, micro batch 1)"
        assert long_stage.required < 80 * 2**30
        text = format_run_plan(planned)  # papercut 4 of issue 39: each stage's RoPE and the attention, shown
        assert "parameters (8.03B), attention document, max_seq_len 131,072\n" in text
        llama3 = "theta 500,000, scaling llama3 x8 of 8192 positions (low/high frequency factors 1/4)"
        assert f"RoPE in stage 1 'ja_8k': {llama3}\nRoPE in stage 2 'long_32k': {llama3}\n" in text
        # Papercut 6: the loss stays chunked at a 128k vocabulary (it showed 9.8 GiB of whole fp32 logits).
        assert cfg.model.loss_chunk_tokens == 4096
        for estimate in (planned.memory, long_stage):
            [transients] = [term for term in estimate.terms if term.name == "transients"]
            assert transients.note == "loss: fused, chunked" and transients.bytes < 4 * 2**30


@pytest.fixture
def llama3_base(tmp_path) -> str:
    return base_folder(tmp_path, "Llama-3-Swallow-8B", LLAMA3_8B)


def test_the_rope_base_variant_works_with_a_real_llama3_base(llama3_base, capsys):
    """B4 of issue 39: the documented variant for a base without RoPE scaling, run against Llama-3-8B's own
    config.json (8192 positions), was refused: `curriculum.stages.1.seq_len=32768 exceeds model.max_seq_len=8192`
    (the test ran it against the 3.1 config, which has 131072). Through the CLI: `ayumi train ... --cfg job` takes
    it, and `ayumi plan` refuses only for the data this machine lacks, with each stage's RoPE in its output."""
    from pretrain.config import config_from_args
    from pretrain.stages import model_in_stage
    from pretrain.tools import launch, plan

    [variant] = bullets_commands(docs_section())
    args = [arg.replace("/models/Llama-3-Swallow-8B", llama3_base) for arg in variant][1:]
    assert launch.main([*args, "--cfg", "job"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""
    assert plan.main([*args, "--free-bytes", "1e15"]) == 1
    out, err = capsys.readouterr()
    assert "REFUSED:\n  [data] data root /data/shards/ja_en_l3 does not exist" in out and "(1 problem(s)" in err
    assert "RoPE in stage 1 'ja_8k': theta 500,000, scaling none" in out
    assert "RoPE in stage 2 'long_32k': theta 8,000,000 (curriculum.stages.1.rope_theta), scaling none" in out
    cfg = config_from_args(args)
    assert (cfg.model.hidden_size, cfg.model.rope_scaling.type, cfg.model.max_seq_len) == (4096, "none", 32768)
    stages = cfg.curriculum.stages
    assert [model_in_stage(cfg.model, stages, i).rope_theta for i in range(2)] == [500000.0, 8000000.0]


def test_the_31_recipe_on_a_llama3_base_is_refused_with_the_fix(llama3_base, capsys):
    """The main commands (a Llama 3.1 base) against Llama-3-8B: one line naming the stage, the limit and the fix."""
    from pretrain.tools import plan

    [args] = [[arg.replace(BASE, llama3_base) for arg in command] for command in documented_commands(docs_section())
              if command[0] == "plan"]
    assert plan.main(args[1:]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ayumi plan: curriculum.stages.1.seq_len=32768 exceeds model.max_seq_len=8192; raise model.max_seq_len "
        "(model.max_seq_len=32768) and give the stage a RoPE for that length (curriculum.stages.1.rope_theta or rope_scaling)"]
