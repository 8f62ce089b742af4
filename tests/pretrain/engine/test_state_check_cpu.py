"""TrainEngine.state_problem, the check a loaded state passes before the first step (pretrain/checkpoint/trust.py):
under each ZeRO layout a sound state passes, and a non-finite weight, a non-finite Adam moment or a negative second
moment is found and named. One process, one rank, an engine per stage."""

import pytest

from tests.helpers import REPO, run_one_rank_script

pytestmark = pytest.mark.slow

CHECK = r"""
import json, os, sys, torch
sys.path.insert(0, {repo!r})
from pretrain.config import compose_config, to_object
from pretrain.engine.distributed import exit_process, init_distributed
from pretrain.engine.train_engine import TrainEngine
from pretrain.model.llama import Llama

dist = init_distributed("cpu")
ids = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1))
found = {{}}
for stage, precision in ((0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32")):
    cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", f"deepspeed.zero_stage={{stage}}",
                                    f"deepspeed.precision={{precision}}"]))
    torch.manual_seed(0)
    engine = TrainEngine(Llama(cfg.model), cfg, dist)
    for micro in range(engine.grad_accum):
        engine.backward(engine.forward(ids[:, :-1], ids[:, 1:]).loss)
        engine.micro_step()
    said = [engine.state_problem()]
    name, param = next(iter(engine.module.named_parameters()))
    weight = getattr(param, "ds_tensor", param)
    with torch.no_grad():
        kept = weight.view(-1)[0].item()
        weight.view(-1)[0] = float("inf")
        said.append(engine.state_problem())
        weight.view(-1)[0] = kept
        state = next(iter(engine.client_optimizer.state.values()))
        state["exp_avg"].view(-1)[0] = float("nan")
        said.append(engine.state_problem())
        state["exp_avg"].view(-1)[0] = 0.0
        state["exp_avg_sq"].view(-1)[-1] = -1e-3
        said.append(engine.state_problem())
    found[stage] = dict(name=name, said=said)
print("RESULT " + json.dumps(found))
exit_process(0)
"""


def test_a_sound_state_passes_and_each_kind_of_damage_is_named_under_each_zero_layout():
    result = run_one_rank_script(CHECK.format(repo=str(REPO)))
    assert sorted(result) == ["0", "1", "2", "3"]
    for stage, found in result.items():
        sound, weight, moment, second = found["said"]
        assert sound is None, (stage, sound)
        assert weight == f"weight {found['name']} holds non-finite values", (stage, weight)
        assert moment.startswith("Adam exp_avg of ") and moment.endswith(" holds non-finite values"), (stage, moment)
        assert second.startswith("Adam exp_avg_sq of ") and second.endswith(
            " holds negative values (a second moment never is)"), (stage, second)
        if stage == "0":
            assert moment == f"Adam exp_avg of {found['name']} holds non-finite values"  # named: the module's own
