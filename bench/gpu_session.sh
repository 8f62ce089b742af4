#!/usr/bin/env bash
# A lent GPU session's one command (docs/performance.md, "The prepared GPU command"), at most 10 minutes: on a GPU
# machine with no registry, from the repository's root, with the wheels of bench/gpu_wheels.sh in .whl (carried).
#
#   bash bench/gpu_session.sh OUT      # OUT: the folder whose files come back (the device tool's $OUT)
#
# 1. the carried wheels into /tmp/site (--no-deps: never over the machine's torch);
# 2. the prepared command: bench/gpu_acceptance.py's default parts, 360 s (results in OUT);
# 3. the session's second run: the 7B layers, the 1b profile and torchtitan, 185 s (results in OUT/more);
# 4. bench/model_init.py: building and initialising the 7B preset on the GPU (target <= 15 s).
# (The CUDA-only unit tests, tests/pretrain/model/test_cuda_paths_gpu.py, passed on an H200 on 2026-11-28; run them
# with `python3 -m pytest -m gpu tests/pretrain/model/test_cuda_paths_gpu.py` when that code changes.)
# Each step has its own limit and the sum stays under the device tool's 10 minutes. At most 8 files come back:
# results.json, results.md, parts.log, session.log, more/results.json, more/results.md, more/parts.log,
# more/profile_1b.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT folder}
mkdir -p "$out/more"
log="$out/session.log"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$log" 2>&1
step() {  # step NAME SECONDS COMMAND...: the command under its limit, its output and exit status in the log
  local name=$1 limit=$2
  shift 2
  echo "===== $name (limit ${limit} s) =====" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "===== $name: exit $? =====" >>"$log"
}
step acceptance 370 python3 bench/gpu_acceptance.py --out "$out" --work /tmp/acc
step acceptance_more 195 python3 bench/gpu_acceptance.py --out "$out/more" --work /tmp/acc_more --budget 185 \
    --parts speed_7b_layers,profile_1b,peer_torchtitan
step model_init_7b 15 python3 bench/model_init.py --device cuda --model 7b --layers 0 --no-baseline --rounds 1
grep -E "^RESULT|=====" "$log"
