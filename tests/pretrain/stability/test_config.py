"""Stability config: documented fields, shipped YAML (incl. the nested stability/inject group), checks."""
import ast
import inspect
import shutil
from dataclasses import dataclass, field

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

import pretrain.stability.config as config_module
from common.conf import CONF_DIR
from pretrain.stability.config import (
    DetectorConfig, InjectConfig, RecoveryConfig, StabilityConfig, StabilityConfigError, check_stability_config,
)

STABILITY_DIR = CONF_DIR / "stability"


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    undocumented = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Config")):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str) and nxt.value.value.strip()
                if not documented:
                    undocumented.append(f"{cls.name}.{node.target.id}")
    assert undocumented == []


def test_defaults_pass_the_checks_and_match_the_issue():
    cfg = StabilityConfig()
    check_stability_config(cfg)
    assert (cfg.recovery.rollback_steps, cfg.recovery.skip_batches, cfg.clip.percentile) == (100, 200, 90.0)
    assert cfg.action == "recover" and cfg.enabled
    inject = cfg.inject
    assert not (inject.lr_multiply or inject.random_batch_steps or inject.nan_loss_steps or inject.fp16_overflow_steps)


def _merged(*names: str) -> StabilityConfig:
    """The schema merged with YAML files (group defaults lists stripped, as Hydra would consume them)."""
    node = OmegaConf.structured(StabilityConfig)
    for name in names:
        data = OmegaConf.load(STABILITY_DIR / f"{name}.yaml")
        data.pop("defaults", None)
        if name.startswith("inject/"):
            data = OmegaConf.create({"inject": data})
        node = OmegaConf.merge(node, data)
    return OmegaConf.to_object(node)


@pytest.mark.parametrize("names", [("default",), ("off",), ("default", "inject/none"), ("default", "inject/demo"),
                                   ("default", "inject/repeat"), ("default", "inject/fp16_overflow")])
def test_shipped_yaml_fits_the_schema_and_passes_the_checks(names):
    cfg = _merged(*names)
    check_stability_config(cfg)


def test_the_demo_injects_a_spike_and_a_nan():
    demo = _merged("default", "inject/demo").inject
    assert demo.lr_multiply == {300: 50.0, 301: 50.0, 302: 50.0} and demo.nan_loss_steps == [120]
    assert not demo.replay and _merged("default", "inject/repeat").inject.replay
    assert len(_merged("default", "inject/fp16_overflow").inject.fp16_overflow_steps) == 60


def test_off_turns_the_machinery_off_but_still_skips_nan():
    off = _merged("off")
    assert not off.enabled and not off.watchdog.enabled and off.recovery.ring_interval == 0
    assert off.skip_nonfinite_loss


@pytest.mark.parametrize("bad, field_name", [
    (StabilityConfig(action="panic"), "stability.action"),
    (StabilityConfig(recovery=RecoveryConfig(lr_cooldown_factor=2.0)), "lr_cooldown_factor"),
    (StabilityConfig(recovery=RecoveryConfig(lr_cooldown_shape="cosine")), "lr_cooldown_shape"),
    (StabilityConfig(inject=InjectConfig(lr_multiply={3: -1.0})), "stability.inject.lr_multiply"),
    (StabilityConfig(detector=DetectorConfig(domain_min_steps=30)), "stability.detector.domain_min_steps"),
])
def test_bad_values_name_their_field(bad, field_name):
    with pytest.raises(StabilityConfigError, match=field_name.replace(".", r"\.")):
        check_stability_config(bad)


# -- Hydra composition of the nested group, under a private schema ------------------------------
@dataclass
class _StabilityOnly:
    stability: StabilityConfig = field(default_factory=StabilityConfig)


SCHEMA = "_test_stability_only_schema"


@pytest.fixture
def compose_stability(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(STABILITY_DIR, conf / "stability")
    (conf / "primary.yaml").write_text(f"defaults:\n  - {SCHEMA}\n  - stability: default\n  - _self_\n")
    ConfigStore.instance().store(name=SCHEMA, node=_StabilityOnly)

    def compose_with(*overrides: str) -> StabilityConfig:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            return OmegaConf.to_object(compose(config_name="primary", overrides=list(overrides))).stability
    yield compose_with
    GlobalHydra.instance().clear()


def test_hydra_composes_the_nested_inject_group(compose_stability):
    assert compose_stability().inject == InjectConfig()
    demo = compose_stability("stability/inject=demo")
    assert demo.inject.lr_multiply[300] == 50.0 and demo.recovery.rollback_steps == 100
    off_demo = compose_stability("stability=off", "stability/inject=demo")
    assert not off_demo.enabled and off_demo.inject.nan_loss_steps == [120]
    tuned = compose_stability("stability.recovery.rollback_steps=40", "stability.inject.nan_loss_steps=[5,6]")
    assert tuned.recovery.rollback_steps == 40 and tuned.inject.nan_loss_steps == [5, 6]


def test_hydra_rejects_unknown_stability_keys(compose_stability):
    with pytest.raises(Exception) as info:
        compose_stability("stability.recovery.rolback_steps=40")
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(e, ConfigKeyError) or "rolback_steps" in str(e) for e in chain)
