#!/usr/bin/env bash
# launch/local.sh: train on this machine, one process per GPU (or 2 CPU processes without one).
#
#   launch/local.sh [--nproc N] [--launcher deepspeed|torchrun] [--master-port P] [--dry-run] [key=value ...]
#
#   GPUs:   deepspeed --num_gpus N --no_local_rank --module pretrain.train key=value ...
#   no GPU: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 -m pretrain.train key=value ...
#           (torchrun starts faster than the deepspeed launcher on CPU and gives the same losses;
#            --launcher deepspeed picks the latter.)
#
# --no_local_rank: the deepspeed launcher would append --local_rank=N, which Hydra rejects; ranks
# come from the environment instead. Everything that is not an option here goes to pretrain.train
# (Hydra overrides, --cfg job). --dry-run prints the command and exits 0. `ayumi train` is the same
# launch from Python (pretrain/tools/launch.py). AYUMI_GPUS=N overrides GPU detection.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

nproc=0 launcher=auto master_port="${MASTER_PORT:-}"
args=()
while (($#)); do
    case "$1" in
        --dry-run) export AYUMI_DRY_RUN=1 ;;
        --nproc) nproc="${2:?--nproc needs a number}"; shift ;;
        --launcher) launcher="${2:?--launcher needs deepspeed or torchrun}"; shift ;;
        --master-port) master_port="${2:?--master-port needs a port}"; shift ;;
        -h | --help) ayumi_usage "$0"; exit 0 ;;
        *) args+=("$1") ;;
    esac
    shift
done
[[ "$nproc" =~ ^[0-9]+$ ]] || ayumi_die "--nproc must be a number, got '$nproc'"

gpus="$(ayumi_gpu_count)"
if ((gpus > 0)); then
    ((nproc > 0)) || nproc="$gpus"
    [[ "$launcher" == auto ]] && launcher=deepspeed
else
    ((nproc > 0)) || nproc=2
    [[ "$launcher" == auto ]] && launcher=torchrun
    export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
ayumi_default_threads "$nproc"
ayumi_overrides ${args[@]+"${args[@]}"}

case "$launcher" in
    deepspeed)
        cmd=("$(ayumi_tool deepspeed)" --num_gpus "$nproc" --no_local_rank)
        [[ -n "$master_port" ]] && cmd+=(--master_port "$master_port")
        cmd+=(--module pretrain.train)
        ;;
    torchrun)
        cmd=("$(ayumi_tool torchrun)" --nproc_per_node "$nproc")
        if [[ -n "$master_port" ]]; then
            cmd+=(--master_addr 127.0.0.1 --master_port "$master_port")
        else
            cmd+=(--standalone)
        fi
        cmd+=(-m pretrain.train)
        ;;
    *) ayumi_die "--launcher must be deepspeed or torchrun, got '$launcher'" ;;
esac

echo "# $( ((gpus > 0)) && echo "$gpus GPU(s)" || echo "no GPU: DS_ACCELERATOR=$DS_ACCELERATOR") OMP_NUM_THREADS=$OMP_NUM_THREADS NCCL_DEBUG=$NCCL_DEBUG"
ayumi_exec "${cmd[@]}" ${AYUMI_OVERRIDES[@]+"${AYUMI_OVERRIDES[@]}"}
