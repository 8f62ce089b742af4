"""A task list that mixes tasks given in full with tasks given by their file alone (issue 48, papercut 6):
`eval.downstream.tasks=[{path:A,delimiter:""},B]` for `ayumi train` and `ayumi plan`, `tasks=[...]` for `ayumi eval`.

Before, Hydra could not merge the plain B into a list of tasks and the message was about something else:
"eval.downstream.tasks has 1 entry (0), so there is no entry 1; an override changes an entry, it cannot add one".
Now B is the task {path:B} with default settings, and a mistake in the list is named as it was typed.
"""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from downstream.config import TaskConfig
from pretrain.config import ConfigError, compose_config
from pretrain.tools.eval import compose_settings

MIXED = '[{path:a.jsonl,delimiter:""},b.jsonl,{path:"c d.jsonl",num_fewshot:2}]'
EXPECTED = [TaskConfig(path="a.jsonl", delimiter=""), TaskConfig(path="b.jsonl"),
            TaskConfig(path="c d.jsonl", num_fewshot=2)]


def test_a_mixed_list_composes_for_training():
    cfg = OmegaConf.to_object(compose_config(["experiment=cpu_tiny", f"eval.downstream.tasks={MIXED}"]))
    assert cfg.eval.downstream.tasks == EXPECTED
    plain = OmegaConf.to_object(compose_config(["experiment=cpu_tiny", "eval.downstream.tasks=[a.jsonl,b.jsonl]"]))
    assert plain.eval.downstream.tasks == [TaskConfig(path="a.jsonl"), TaskConfig(path="b.jsonl")]


def test_a_mixed_list_composes_for_ayumi_eval():
    assert compose_settings({}, [f"tasks={MIXED}"]).tasks == EXPECTED
    assert compose_settings({}, [f"eval.downstream.tasks={MIXED}"]).tasks == EXPECTED


def test_a_mistake_in_a_mixed_list_is_named_as_typed():
    typed = 'eval.downstream.tasks=[{path:a.jsonl,delimitr:""},b.jsonl]'
    with pytest.raises(ConfigError) as raised:
        compose_config(["experiment=cpu_tiny", typed])
    assert str(raised.value) == (f"{typed}: an entry of eval.downstream.tasks has no key 'delimitr'; "
                                 "did you mean delimiter?")
