"""Hydra composition: every shipped experiment composes, bad keys/types/batches/ranges/names fail with names."""
import pytest

from pretrain.config import (
    AyumiConfig, ConfigError, TrainConfig, check_config, compose_config, config_problems, data_parallel_grad_accum,
    default_run_notice, split_cli_args, to_object, total_steps,
)
from pretrain.ranges import unknown_rule_keys
from common.conf import CONF_DIR, group_options
from tests.helpers import write_tiny_corpus

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


STARTS_FROM_A_MODEL = {"continue_ja": 4096, "extend_32k": 131072}
"""Experiments whose shape comes from model.init_from's config.json (a base model folder), with the base's length
(extend_32k trains a 32k stage: its base must reach that far, as Llama 3.1's 131,072 positions do)."""


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_checks(name, tmp_path):
    if name in STARTS_FROM_A_MODEL:
        from transformers import LlamaConfig

        from pretrain.config import config_from_args

        LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, max_position_embeddings=STARTS_FROM_A_MODEL[name]
                    ).save_pretrained(tmp_path / "base")
        cfg = config_from_args([f"experiment={name}", f"model.init_from={tmp_path / 'base'}",
                                f"data.tokenizer_dir={tmp_path / 'no_tokenizer_yet'}"])
        assert cfg.model.max_seq_len == STARTS_FROM_A_MODEL[name] and cfg.model.vocab_size == 32000
    else:
        cfg = to_object(compose_config([f"experiment={name}"]))
        if cfg.model.vocab_size == 0:  # follows the tokenizer: composed as every command composes it, on data
            from pretrain.config import config_from_args

            cfg = config_from_args([f"experiment={name}", f"data.root={write_tiny_corpus(tmp_path / 'data')}"])
            assert cfg.model.vocab_size == 512  # the test corpus's 512 ids, already a multiple of 128
    assert isinstance(cfg, AyumiConfig)
    check_config(cfg)
    assert cfg.name and total_steps(cfg.train) > 0


GROUPS = ("model", "deepspeed", "optim", "logging", "stability", "stability/inject", "curriculum")
NEEDS = {("curriculum", "megatron_example"): ["data.tokenizer_dir=/models/tokenizer.model"],
         ("curriculum", "extend_32k"): ["train.seq_len=8192", "train.micro_batch_size=4", "model.max_seq_len=32768"]}
"""What an option needs beside it to be a valid run (the template declares Megatron data, checked against a tokenizer;
the context extension's stages are 8k and 32k tokens long, so the run's length and micro batch must suit them)."""
GROUP_OPTIONS = [(group, option) for group in GROUPS for option in group_options(group, CONF_DIR)]


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_passes_the_checks(group, option):
    """Each option of each group, over conf/config.yaml's defaults, passes every check `ayumi train` runs without
    hardware (config_problems: ranges, names, shapes; check_config: the cross-field rules)."""
    cfg = to_object(compose_config([f"{group}={option}", *NEEDS.get((group, option), [])]))
    assert config_problems(cfg) == []
    check_config(cfg)


def test_the_group_option_check_catches_a_broken_option(tmp_path, monkeypatch):
    """The test above fails for an option that composes but breaks a rule (here a ZeRO-0 optimizer offload)."""
    import shutil

    import pretrain.config as config_module

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "deepspeed" / "broken.yaml").write_text("zero_stage: 0\noffload_optimizer: true\n")
    monkeypatch.setattr(config_module, "CONF_DIR", conf)
    with pytest.raises(ConfigError, match="deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1"):
        test_every_group_option_composes_and_passes_the_checks("deepspeed", "broken")


def test_the_demo_experiment_states_its_parameter_count():
    """conf/experiment/demo.yaml's header says how big the demo model is: the count the plan prints."""
    import re

    from pretrain.model.flops import count_parameters

    stated = re.search(r"a small Llama \(([\d,]+) parameters", (CONF_DIR / "experiment" / "demo.yaml").read_text())
    assert stated, "demo.yaml's header no longer states the parameter count"
    model = to_object(compose_config(["experiment=demo"])).model
    assert int(stated.group(1).replace(",", "")) == count_parameters(model)


def test_presets_have_the_promised_shapes():
    seven = to_object(compose_config(["model=7b"])).model
    assert (seven.hidden_size, seven.num_layers, seven.num_heads, seven.intermediate_size, seven.vocab_size) == \
        (4096, 32, 32, 11008, 32000)
    assert to_object(compose_config(["experiment=llama_1b_example"])).model.name == "1b"


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match=r"train\.bogus"):
        compose_config(["train.bogus=1"])


def test_wrong_type_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match=r"train\.seq_len"):
        compose_config(["train.seq_len=abc"])


def test_unknown_key_in_a_group_file_is_rejected(tmp_path, monkeypatch):
    import shutil

    import pretrain.config as config_module

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "broken.yaml").write_text("hidden_size: 64\nhiden_layers: 3\n")
    monkeypatch.setattr(config_module, "CONF_DIR", conf)
    with pytest.raises(ConfigError, match="hiden_layers"):
        compose_config(["model=broken"])


def test_batch_arithmetic():
    train = TrainConfig(micro_batch_size=4, global_batch_size=32)
    assert data_parallel_grad_accum(train, 2) == 4
    with pytest.raises(ConfigError, match=r"global_batch_size=32 is not a multiple of .*micro_batch_size=4 x 3"):
        data_parallel_grad_accum(train, 3)
    explicit = TrainConfig(micro_batch_size=4, global_batch_size=32, grad_accum=2)
    with pytest.raises(ConfigError, match=r"global_batch_size=32 != .*grad_accum=2 x 2 .* = 16"):
        data_parallel_grad_accum(explicit, 2)


def test_steps_are_derived_from_tokens():
    train = TrainConfig(tokens=1_000_000, seq_len=128, global_batch_size=8)
    assert total_steps(train) == 977  # ceil(1e6 / 1024)
    with pytest.raises(ConfigError, match="train.tokens"):
        total_steps(TrainConfig(tokens=0))


def test_cross_checks():
    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", "train.seq_len=4096"]))
    with pytest.raises(ConfigError, match="model.max_seq_len"):
        check_config(cfg)
    cfg = to_object(compose_config(["deepspeed.offload_param=true", "deepspeed.zero_stage=2"]))
    with pytest.raises(ConfigError, match="offload_param needs"):
        check_config(cfg)


def test_cli_args_drop_the_launchers_local_rank():
    overrides, print_cfg = split_cli_args(["--local_rank=1", "experiment=cpu_tiny", "--cfg", "job"])
    assert overrides == ["experiment=cpu_tiny"] and print_cfg
    assert split_cli_args(["--local_rank", "0", "a=1"]) == (["a=1"], False)
    with pytest.raises(ConfigError, match="--bogus"):
        split_cli_args(["--bogus"])


# -- every mistake caught before anything starts: ranges, names, shapes, one line each ----------------

TINY = ["experiment=cpu_tiny", "model.vocab_size=512"]
"""cpu_tiny with its test corpus's vocabulary: compose_config alone does not fill in model.vocab_size=0."""


def problems_of(*overrides: str) -> list[str]:
    return config_problems(to_object(compose_config([*TINY, *overrides])))


@pytest.mark.parametrize("override,message", [
    ("optim.lr=-0.001", "optim.lr=-0.001 must be > 0"),
    ("optim.min_lr=-1e-5", "optim.min_lr=-1e-05 must be >= 0"),
    ("optim.warmup_steps=-10", "optim.warmup_steps=-10 must be >= 0"),
    ("optim.beta2=1.0", "optim.beta2=1.0 must be in [0, 1)"),
    ("optim.eps=0", "optim.eps=0.0 must be > 0"),
    ("train.seq_len=-64", "train.seq_len=-64 must be >= 1"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0 must be >= 1"),
    ("train.eval_interval=-1", "train.eval_interval=-1 must be >= 0 (0 = only at the end)"),
    ("train.log_interval=0", "train.log_interval=0 must be >= 1"),
    ("checkpoint.interval=-100", "checkpoint.interval=-100 must be >= 0 (0 = only on signals and at the end)"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last=-1 must be >= 0 (0 = keep every checkpoint)"),
    ("model.hidden_size=0", "model.hidden_size=0 must be >= 1"),
    ("model.num_kv_heads=3", "model.num_heads=4 must divide by model.num_kv_heads=3"),
    ("model.num_heads=6", "model.hidden_size=64 must divide by model.num_heads=6"),
    ("model.hidden_size=20", "head_dim = model.hidden_size / model.num_heads = 5 must be even for RoPE"),
    ("deepspeed.loss_scale_window=0", "deepspeed.loss_scale_window=0 must be >= 1"),
    ("stability.clip.percentile=100", "stability.clip.percentile=100.0 must be in (0, 100)"),
    ("name=", "name='' is empty: the run would write straight into run_root; give the run a name, e.g. name=my_run"),
    ("name=../elsewhere", "name=../elsewhere must be one folder name (no / or \\, not . or ..): the run dir is "
                          "run_root/name; e.g. name=elsewhere"),
    ("name=..", "name=.. must be one folder name (no / or \\, not . or ..): the run dir is run_root/name; "
                "e.g. name=my_run"),
])
def test_each_mistake_is_one_line_naming_key_value_and_range(override, message):
    assert problems_of(override) == [message]
    with pytest.raises(ConfigError) as raised:
        check_config(to_object(compose_config([*TINY, override])))
    assert str(raised.value) == message


def test_all_mistakes_are_reported_at_once():
    assert problems_of("optim.lr=-1", "train.seq_len=0", "checkpoint.keep_last=-2", "name=a/b") == [
        "name=a/b must be one folder name (no / or \\, not . or ..): the run dir is run_root/name; e.g. name=a_b",
        "optim.lr=-1.0 must be > 0",
        "train.seq_len=0 must be >= 1",
        "checkpoint.keep_last=-2 must be >= 0 (0 = keep every checkpoint)",
    ]


def test_boundary_values_that_mean_something_are_accepted():
    assert problems_of("checkpoint.keep_last=0", "checkpoint.interval=0", "train.eval_interval=0", "optim.grad_clip=0",
                       "optim.warmup_steps=0", "optim.min_lr=0", "optim.beta1=0", "train.grad_accum=0") == []


def test_every_range_rule_names_a_field_and_the_defaults_pass():
    from dataclasses import fields, is_dataclass

    def classes(cls):
        yield cls
        for f in fields(cls):
            if is_dataclass(f.default_factory if callable(f.default_factory) else None):
                yield from classes(f.default_factory)

    checked = [cls for cls in classes(AyumiConfig) if getattr(cls, "RANGES", None)]
    assert {"OptimConfig", "TrainConfig", "CheckpointConfig", "ModelConfig", "DetectorConfig"} <= {c.__name__ for c in checked}
    assert all(unknown_rule_keys(cls) == [] for cls in checked)
    assert config_problems(AyumiConfig()) == []


def test_model_rules_are_shared_with_the_model():
    """The Llama refuses the same shapes with the same words (pretrain/model/config.py holds the rules)."""
    from pretrain.model.config import ModelConfig, model_problems

    assert model_problems(ModelConfig(num_heads=3, num_layers=0)) == [
        "model.num_layers=0 must be >= 1",
        "model.hidden_size=64 must divide by model.num_heads=3",
        "model.num_heads=3 must divide by model.num_kv_heads=2",
    ]


@pytest.mark.parametrize("override,message", [
    ("optim.lrr=1", "optim.lrr=1: optim has no key 'lrr'; did you mean optim.lr?"),
    ("trian.seq_len=64", "trian.seq_len=64: the config has no key 'trian'; did you mean train?"),
    ("optim.lr=abc", "optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
    ("model=tiny", "model=tiny: no such option in conf/model/; choose one of 125m, 1b, 7b, debug"),
])
def test_composition_mistakes_are_one_line(override, message):
    with pytest.raises(ConfigError) as raised:
        compose_config([override])
    assert str(raised.value) == message


ROPE = "curriculum.stages.1.rope_scaling={type:yarn,factor:4}"


@pytest.mark.parametrize("override,message", [
    # papercut 3 of issue 39: a key new to a stage's mapping needs Hydra's '+', and the message says so
    (ROPE, f"{ROPE}: curriculum.stages.1.rope_scaling has no key 'type': a new key needs Hydra's '+' (+{ROPE})"),
    ("curriculum.stages.0.min_document_tokens={en:8192}",
     "curriculum.stages.0.min_document_tokens={en:8192}: curriculum.stages.0.min_document_tokens has no key 'en': "
     "a new key needs Hydra's '+' (+curriculum.stages.0.min_document_tokens={en:8192})"),
    ("curriculum.stages.1.weights.xx=1",
     "curriculum.stages.1.weights.xx=1: curriculum.stages.1.weights has no key 'xx': a new key needs Hydra's '+' "
     "(+curriculum.stages.1.weights.xx=1)"),
    # a typo inside a list entry: the entry's own keys, not the top level's
    ("curriculum.stages.1.rop_scaling=3",
     "curriculum.stages.1.rop_scaling=3: curriculum.stages.1 has no key 'rop_scaling'; did you mean "
     "curriculum.stages.1.rope_scaling?"),
    ("curriculum.stages=[{name:a,tokns:3}]",
     "curriculum.stages=[{name:a,tokns:3}]: an entry of curriculum.stages has no key 'tokns'; did you mean tokens?"),
    ('eval.downstream.tasks=[{path:a.jsonl,delimter:""}]',
     'eval.downstream.tasks=[{path:a.jsonl,delimter:""}]: an entry of eval.downstream.tasks has no key \'delimter\'; '
     "did you mean delimiter?"),
])
def test_keys_of_stages_and_list_entries_are_named_with_their_fix(override, message):
    with pytest.raises(ConfigError) as raised:
        compose_config(["experiment=ja_en_4stage", override])
    assert str(raised.value) == message


def test_the_plus_the_message_advises_composes():
    cfg = to_object(compose_config(["experiment=ja_en_4stage", f"+{ROPE}", "+curriculum.stages.1.weights.xx=1"]))
    assert cfg.curriculum.stages[1].rope_scaling == {"type": "yarn", "factor": 4}
    assert cfg.curriculum.stages[1].weights["xx"] == 1


def test_running_without_an_experiment_says_what_runs():
    cfg = to_object(compose_config([]))
    notice = default_run_notice("ayumi train", [], cfg)
    assert notice == ("ayumi train: no experiment= given: running the defaults of conf/config.yaml (model=debug, "
                      f"name=debug); pick a run with experiment=NAME ({', '.join(EXPERIMENTS)})")
    assert default_run_notice("ayumi train", ["experiment=cpu_tiny"], cfg) is None
    assert default_run_notice("ayumi train", ["+experiment=cpu_tiny"], cfg) is None
    assert "name=mine" in default_run_notice("ayumi train", ["name=mine"], to_object(compose_config(["name=mine"])))


def test_training_entry_refuses_before_distributed_init(monkeypatch, capsys):
    """`deepspeed --module pretrain.train` / torchrun users get the same check, on rank 0 only, before init."""
    import pretrain.train as train

    def no_init(*args, **kwargs):
        raise AssertionError("init_distributed was reached with a bad config")

    monkeypatch.setattr(train, "init_distributed", no_init)
    monkeypatch.setenv("RANK", "0")
    assert train.main([*TINY, "optim.lr=-0.001", "checkpoint.keep_last=-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pretrain.train: optim.lr=-0.001 must be > 0",
        "pretrain.train: checkpoint.keep_last=-1 must be >= 0 (0 = keep every checkpoint)",
    ]
    monkeypatch.setenv("RANK", "1")  # the other ranks exit the same way, silently
    assert train.main([*TINY, "optim.lr=-0.001"]) == 2
    assert capsys.readouterr().err == ""


# -- model.vocab_size=0 follows the tokenizer, padded to model.vocab_multiple (pretrain/model/vocabulary.py) ----------

def vocab_of(tmp_path, *overrides: str) -> int:
    """model.vocab_size of cpu_tiny as every command composes it (composed_from_args, then check_config)."""
    from pretrain.config import config_from_args

    return config_from_args(["experiment=cpu_tiny", f"run_root={tmp_path / 'runs'}", *overrides]).model.vocab_size


def test_the_vocabulary_follows_the_data_roots_tokenizer_padded_to_128(tmp_path, capsys):
    """A manifest recording 2,000 ids gives 2,048 rows, in the config and in what `--cfg job` prints; 512 stays 512."""
    from omegaconf import OmegaConf

    from pretrain.startup.checks import config_before_launch

    root = write_tiny_corpus(tmp_path / "c2000", vocab_size=2000)
    assert vocab_of(tmp_path, f"data.root={root}") == 2048
    assert vocab_of(tmp_path, f"data.root={root}", "model.vocab_multiple=1") == 2000
    assert config_before_launch(["experiment=cpu_tiny", f"data.root={root}", "--cfg", "job"]) is None
    assert OmegaConf.create(capsys.readouterr().out).model.vocab_size == 2048
    assert vocab_of(tmp_path, f"data.root={write_tiny_corpus(tmp_path / 'c512')}") == 512


def test_without_a_manifest_the_vocabulary_follows_data_tokenizer_dir(tmp_path):
    """No data prepared yet: data.tokenizer_dir's 600 pieces give 640 rows. The data root's record comes first."""
    from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_tokenizer

    tokenizer = write_tokenizer(tmp_path / "tok", english_texts()[:100] + JA_PARAGRAPHS)  # 600 pieces
    assert vocab_of(tmp_path, f"data.root={tmp_path / 'not_prepared'}", f"data.tokenizer_dir={tokenizer}") == 640
    root = write_tiny_corpus(tmp_path / "c2000", vocab_size=2000)
    assert vocab_of(tmp_path, f"data.root={root}", f"data.tokenizer_dir={tokenizer}") == 2048
    edit_manifest_vocabulary(root, 4000)  # no longer readable (its checksum): the tokenizer is what is left
    assert vocab_of(tmp_path, f"data.root={root}", f"data.tokenizer_dir={tokenizer}") == 640


def edit_manifest_vocabulary(root, vocab: int) -> None:
    """The root's manifest.json with another vocabulary, by hand (its record_sha256 no longer matches)."""
    import json

    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = vocab
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_with_nothing_to_follow_the_vocabulary_is_one_line_naming_the_fix(tmp_path):
    fix = ("Fix: prepare the data (`ayumi data prepare`) or give its data.root, set data.tokenizer_dir, or set "
           "model.vocab_size")
    root = tmp_path / "not_prepared"
    with pytest.raises(ConfigError) as raised:
        vocab_of(tmp_path, f"data.root={root}")
    assert str(raised.value) == (f"model.vocab_size=0 follows the tokenizer, but data.root={root} does not exist and "
                                 f"data.tokenizer_dir is unset. {fix}")
    root.mkdir()  # a folder, but no finished data root in it
    with pytest.raises(ConfigError) as raised:
        vocab_of(tmp_path, f"data.root={root}", f"data.tokenizer_dir={tmp_path / 'no_tok'}")
    assert str(raised.value) == (f"model.vocab_size=0 follows the tokenizer, but data.root={root} has no readable "
                                 f"manifest.json and data.tokenizer_dir={tmp_path / 'no_tok'} cannot be read. {fix}")
    damaged = write_tiny_corpus(tmp_path / "damaged")
    edit_manifest_vocabulary(damaged, 4000)
    with pytest.raises(ConfigError) as raised:  # the manifest's own line, not "no manifest"
        vocab_of(tmp_path, f"data.root={damaged}")
    assert str(raised.value).startswith(f"model.vocab_size=0 follows the tokenizer, but {damaged / 'manifest.json'} "
                                        "was changed after `ayumi data prepare` wrote it")
    assert len(str(raised.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=r"^model.vocab_multiple=0 must be >= 1 \(1 = no padding\)$"):
        vocab_of(tmp_path, f"data.root={write_tiny_corpus(tmp_path / 'c512')}", "model.vocab_multiple=0")


def test_a_vocabulary_set_by_hand_is_kept(tmp_path):
    """An explicit number is the model's, whatever the tokenizer (check_vocabulary refuses one too small)."""
    root = write_tiny_corpus(tmp_path / "c2000", vocab_size=2000)
    assert vocab_of(tmp_path, f"data.root={root}", "model.vocab_size=4000") == 4000
    assert vocab_of(tmp_path, f"data.root={tmp_path / 'not_prepared'}", "model.vocab_size=512") == 512
