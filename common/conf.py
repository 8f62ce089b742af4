"""Hydra's config tree and the Compose-API glue every ayumi command shares.

It lives in `common/`, below the data flow (tokenizer → data → curriculum → pretrain), because
`ayumi tokenizer`, `ayumi data` and training all compose through here,
so they find the same tree (AYUMI_CONF_DIR included) and report a bad override the same way.
The help helpers below make every command answer -h/--help alike: its usage and the config it reads.
"""
from __future__ import annotations

import os
import re
import textwrap
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


ENV_ONLY = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")
"""An environment variable without a default (`${oc.env:NAME}`): the value must come from somewhere."""


def unset_environment(cfg) -> list[str]:
    """One line per value of a composed config taken from an environment variable that is not set.

    An experiment may name a required path as `${oc.env:NAME}` (conf/experiment/continue_ja.yaml);
    left unset, OmegaConf reports it as a KeyError, once per chained exception, without the key.
    Checked before anything resolves, so the user reads which key to give and which variable.
    """
    from omegaconf import OmegaConf

    problems: list[str] = []

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, f"{key}[{index}]")
        elif isinstance(node, str):
            for name in ENV_ONLY.findall(node):
                if name not in os.environ:
                    hint = _placeholder(key)
                    problems.append(f"{key} is not set: give {key}={hint} on the command line, or set the "
                                    f"environment variable {name} (export {name}={hint})")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return problems


def _placeholder(key: str) -> str:
    """How a message names the value to give: DIR for a *_dir key, PATH for other paths, else VALUE."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf.endswith("_dir"):
        return "DIR"
    return "PATH" if leaf.endswith(("_from", "_path", "_file", "root")) else "VALUE"


# -- help: every `ayumi` command answers -h/--help alike, and says which config it reads ----------

HELP_FLAGS = ("-h", "--help")


def asks_for_help(argv: Iterable[str]) -> bool:
    """-h or --help anywhere among the arguments.

    Commands check this before Hydra sees the arguments (it reads `--help` as a malformed
    override), so a command asked for help prints it and starts nothing.
    """
    return any(arg in HELP_FLAGS for arg in argv)


def group_options(group: str, conf_dir: Path | None = None) -> list[str]:
    """The options of a config group: the YAML names under conf/<group>/, sorted."""
    return sorted(path.stem for path in (Path(conf_dir or CONF_DIR) / group).glob("*.yaml"))


def conf_label(conf_dir: Path | None = None) -> str:
    """How help texts name the config root: `conf/` in the checkout, else its full path (AYUMI_CONF_DIR)."""
    root = Path(conf_dir or CONF_DIR)
    return "conf/" if root == REPO_ROOT / "conf" else f"{root}/"


def composed_from(config_name: str, group: str, conf_dir: Path | None = None) -> str:
    """'conf/NAME.yaml + GROUP=NAME from conf/GROUP/ (a, b, c)': what a Hydra command composes."""
    conf = conf_label(conf_dir)
    options = ", ".join(group_options(group, conf_dir))
    return f"{conf}{config_name}.yaml + {group}=NAME from {conf}{group}/ ({options})"


def config_help(reads: str, overrides: bool = True, cfg_job: bool = True) -> str:
    """The `config:` paragraph that ends every command's help, so each says alike what it reads.

    reads: what the command takes its settings from, e.g. composed_from(...), or for a command
    that composes nothing, "no config from conf/: RUN_DIR/metrics.jsonl ..." with overrides=False.
    cfg_job: whether the command takes `--cfg job`.
    """
    if not overrides:
        text = f"config: reads {reads}; takes no key=value overrides."
    else:
        text = f"config: reads {reads}; overrides key=value (e.g. a.b=3, list=[x,y])"
        text += "; `--cfg job` prints the resolved config and exits." if cfg_job else "."
    return textwrap.fill(text, width=100, subsequent_indent="  ", break_on_hyphens=False)


def command_help(usage: str, about: str, reads: str, overrides: bool = True) -> str:
    """The whole help of a command without an argparse parser: usage line, what it does, config."""
    return f"usage: {usage}\n\n{about.strip()}\n\n{config_help(reads, overrides)}"
