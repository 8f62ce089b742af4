#!/usr/bin/env bash
# One lent GPU session's prepared command (docs/performance.md, "The prepared GPU command"): on a GPU machine with no
# registry, from the repository's root, with the wheels of bench/gpu_wheels.sh in .whl (carried with the tree).
#
#   bash bench/gpu_session.sh OUT [BUDGET_S]      # OUT: the folder whose files come back; BUDGET_S: the acceptance run's
#
# 1. installs the carried wheels into /tmp/site (never over the machine's torch: --no-deps);
# 2. bench/gpu_acceptance.py, the prepared parts and both peers, within BUDGET_S (default 500);
# 3. bench/model_init.py: building and initialising the 7B preset on the GPU (issue 47's start-up target, <= 15 s);
# 4. the CUDA-only unit tests (tests/pretrain/model/test_cuda_paths_gpu.py).
# Each step has its own time limit, so the whole stays under the device tool's 10 minutes; every step's output goes
# to OUT (at most 8 files come back: results.json, results.md, parts.log, profile_1b.txt, driver.log, model_init.log,
# gpu_tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT folder}
budget=${2:-500}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu_tests.log" 2>&1
python3 bench/gpu_acceptance.py --out "$out" --work /tmp/acc --budget "$budget" \
    --parts correctness,long_context,peer,speed_1b_2048,speed_1b_4096,speed_7b_layers,profile_1b,peer_torchtitan \
    >"$out/driver.log" 2>&1
echo "gpu_acceptance exit $?" >>"$out/driver.log"
timeout 40 python3 bench/model_init.py --device cuda --model 7b --layers 0 --no-baseline --rounds 2 \
    >"$out/model_init.log" 2>&1
echo "model_init exit $?" >>"$out/model_init.log"
timeout 30 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/pretrain/model/test_cuda_paths_gpu.py \
    >>"$out/gpu_tests.log" 2>&1
echo "gpu tests exit $?" >>"$out/gpu_tests.log"
tail -40 "$out/driver.log"
