"""Hydra's config tree and the Compose-API glue every ayumi command shares.

It sits in the lowest package because imports follow the data flow (tokenizer → data →
curriculum → pretrain): `ayumi tokenizer`, `ayumi data` and training all compose through here,
so they find the same tree (AYUMI_CONF_DIR included) and report a bad override the same way.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The checkout ayumi runs from (installed editable, so conf/ sits beside the packages)."""

CONF_DIR = Path(os.environ.get("AYUMI_CONF_DIR", REPO_ROOT / "conf"))
"""Hydra's config root; AYUMI_CONF_DIR points elsewhere for a site-specific copy."""


class ConfigCompositionError(ValueError):
    """Hydra could not compose the config (unknown key, wrong type, missing group option)."""


def compose(config_name: str, overrides: Iterable[str], register: Callable[[], None], conf_dir: Path | None = None):
    """conf/<config_name>.yaml with Hydra overrides, as a DictConfig: no output dir, no cwd change.

    `register` puts the command's structured schemas into Hydra's ConfigStore first. Raises
    ConfigCompositionError with every message in Hydra's exception chain (the outer one often
    lacks the key, the value or the reason).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()  # an earlier in-process command may have left it initialized
    try:
        with initialize_config_dir(config_dir=str(conf_dir or CONF_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except Exception as err:  # Hydra and OmegaConf raise many types; all are configuration errors here
        raise ConfigCompositionError(describe_error(err)) from err


def describe_error(err: BaseException) -> str:
    """One message from an exception and its chained causes, each distinct text once."""
    parts: list[str] = []
    while err is not None:
        text = str(err).strip()
        if text and text not in parts and "$VALUE" not in text:
            parts.append(text)
        err = err.__cause__ or err.__context__
    return "invalid configuration: " + "\n  ".join(parts)
