"""Hydra composition: every shipped experiment composes, bad keys/types/batches fail with names."""
import pytest

from pretrain.config import (
    AyumiConfig, ConfigError, TrainConfig, check_config, compose_config, data_parallel_grad_accum,
    split_cli_args, to_object, total_steps,
)
from tokenizer.conf import CONF_DIR

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_checks(name):
    cfg = to_object(compose_config([f"experiment={name}"]))
    assert isinstance(cfg, AyumiConfig)
    check_config(cfg)
    assert cfg.name and total_steps(cfg.train) > 0


@pytest.mark.parametrize("group", ["model", "deepspeed", "optim", "logging", "stability"])
def test_every_group_option_composes(group):
    for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
        cfg = to_object(compose_config([f"{group}={option}"]))
        assert isinstance(cfg, AyumiConfig)


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
    cfg = to_object(compose_config(["experiment=cpu_tiny", "train.seq_len=4096"]))
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
