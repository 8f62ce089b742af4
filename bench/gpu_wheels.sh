#!/usr/bin/env bash
# Wheels for running bench/gpu_acceptance.py (or any ayumi training) on a GPU machine that reaches no package
# registry and already has torch, transformers, sentencepiece and safetensors (docs/performance.md, "Running on a
# machine without a registry"). Run here, where pip reaches a registry; carry the folder (about 14 MiB).
#
#   bash bench/gpu_wheels.sh [FOLDER] [PYTHON_VERSION]     # default: .whl and 3.12
#
# There: python3 -m pip install --no-index --no-deps --target /tmp/site FOLDER/*.whl && export PYTHONPATH=/tmp/site:$PWD
# Versions are this venv's, so both machines run what the tests here ran. W&B is left out (large): use logging=none.
# torchao (model.fp8): 0.18's compiled kernels are built for torch 2.11, the GPU machine's; float8 training is
# plain PyTorch on top of them.
# The acceptance run's peer part needs nothing more: transformers' LlamaForCausalLM and torch.compile (triton comes
# with the machine's CUDA torch) are already there, and it reads ayumi's config through the Hydra wheels below.
# The torchtitan part needs the wheels bench/torchtitan-requirements.txt lists (added below, about 2.5 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
py=${2:-3.12}
pip=(.venv/bin/python -m pip)
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p "$out"
binary=(hjson pydantic pydantic_core annotated-types typing-inspection hydra-core omegaconf zstandard xxhash torchao)
specs=()
for name in "${binary[@]}"; do specs+=("$name==$(version "$name")"); done
platforms=()
for n in 17 24 27 28 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$out" "${specs[@]}"
# The second peer (bench/torchtitan_peer.py): torchtitan and what its modules import, as ./ayumi test installs them
# (the machine's CUDA torch brings triton, and it has tensorboard).
mapfile -t titan < <(grep -v '^#' bench/torchtitan-requirements.txt | grep .)
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$out" "${titan[@]}"
# Source-only on PyPI: built into pure-Python wheels here (DeepSpeed compiles its ops on first use, if ever).
"${pip[@]}" wheel -q --no-deps -w "$out" "deepspeed==$(version deepspeed)" \
    "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
ls -l "$out"
du -sh "$out"
