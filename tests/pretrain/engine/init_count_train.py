"""TEST-ONLY entry: pretrain.train, each rank printing how many parameters its model build drew an initial value for.

Llama.init_parameter (the one place an initial weight is drawn) is counted while `pretrain.train.build_model` runs;
each rank prints `init draws on rank R: N of M parameters` once the model is built.
"""
import pretrain.train as train
from pretrain.model.llama import Llama

_build = train.build_model
_init_parameter = Llama.init_parameter
_calls: list[str] = []


def _counted(self, name, p, seed):
    _calls.append(name)
    return _init_parameter(self, name, p, seed)


def _counting_build(factory, cfg, dist_info, *args, **kwargs):
    _calls.clear()
    model = _build(factory, cfg, dist_info, *args, **kwargs)
    total = sum(1 for _ in model.named_parameters())
    print(f"init draws on rank {dist_info.rank}: {len(_calls)} of {total} parameters", flush=True)
    return model


Llama.init_parameter = _counted
train.build_model = _counting_build

if __name__ == "__main__":
    train.exit_now(train.main())
