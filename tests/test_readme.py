"""What the README says about conf/, checked against conf/ itself, so the two cannot drift apart."""
from __future__ import annotations

import re

import pytest

from common.conf import CONF_DIR, group_options
from tests.helpers import REPO

README = (REPO / "README.md").read_text()


def table_row(group: str) -> str:
    """The options cell of README's `| `group/` | options |` row (Configuration section)."""
    match = re.search(rf"^\| `{re.escape(group)}/` \| (.+) \|$", README, re.MULTILINE)
    assert match, f"README has no row for {group}/"
    return match.group(1)


@pytest.mark.parametrize("group", ["model", "deepspeed", "optim", "logging", "curriculum", "experiment", "tokenizer",
                                   "data"])
def test_the_configuration_table_lists_every_option_of_each_group(group):
    named = set(re.findall(r"`([a-z0-9_]+)`", table_row(group)))
    assert named == set(group_options(group, CONF_DIR)), table_row(group)


def test_the_stability_row_lists_its_options_and_the_inject_ones():
    named = set(re.findall(r"`([a-z0-9_]+)`", table_row("stability")))
    assert named == set(group_options("stability", CONF_DIR)) | set(group_options("stability/inject", CONF_DIR))
