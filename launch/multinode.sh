#!/usr/bin/env bash
# launch/multinode.sh: train on several nodes from one shell, through the deepspeed launcher (ssh + pdsh).
#
#   launch/multinode.sh --hostfile H [--master-addr ADDR] [--master-port P] [--ssh-port P]
#                       [--launcher pdsh|openmpi|mvapich|...] [--dry-run] [key=value ...]
#
# runs   deepspeed --hostfile H --master_addr ADDR --master_port P --no_local_rank \
#                  [--venv_script .venv/bin/activate] --module pretrain.train key=value ...
#
# H lists "HOSTNAME slots=GPUS" lines (launch/hostfile.example; default $AYUMI_HOSTFILE). ADDR
# defaults to the hostfile's first host. Needs passwordless ssh to every host, pdsh on this node,
# and the same paths on every node (shared filesystem). The deepspeed launcher forwards only
# NCCL_* and PYTHON* variables itself; the rest of launch/env.sh's environment (OMP_NUM_THREADS,
# TORCH_*, AYUMI_*, WANDB_* but never WANDB_API_KEY, ...) goes through a DS_ENV_FILE written to
# $AYUMI_RUN_ROOT/.launch/deepspeed_env. Run and data roots are made absolute so every rank
# uses the same run dir (RUN_ROOT/NAME); AYUMI_RUN_NAME=NAME adds name=NAME.
# --dry-run prints the environment file and the command and exits 0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

hostfile="${AYUMI_HOSTFILE:-}" master_addr="${MASTER_ADDR:-}" master_port="${MASTER_PORT:-29500}"
ssh_port="" ds_launcher=pdsh
args=()
while (($#)); do
    case "$1" in
        --dry-run) export AYUMI_DRY_RUN=1 ;;
        --hostfile) hostfile="${2:?--hostfile needs a file}"; shift ;;
        --master-addr) master_addr="${2:?--master-addr needs a host}"; shift ;;
        --master-port) master_port="${2:?--master-port needs a port}"; shift ;;
        --ssh-port) ssh_port="${2:?--ssh-port needs a port}"; shift ;;
        --launcher) ds_launcher="${2:?--launcher needs a name}"; shift ;;
        -h | --help) ayumi_usage "$0"; exit 0 ;;
        *) args+=("$1") ;;
    esac
    shift
done

[[ -n "$hostfile" ]] || ayumi_die "no hostfile: pass --hostfile H (lines 'HOSTNAME slots=GPUS', see launch/hostfile.example) or set AYUMI_HOSTFILE"
[[ -f "$hostfile" ]] || ayumi_die "hostfile '$hostfile' does not exist (see launch/hostfile.example)"
hostfile="$(cd "$(dirname "$hostfile")" && pwd)/$(basename "$hostfile")"
hosts=()
while read -r host _; do hosts+=("$host"); done < <(grep -Ev '^[[:space:]]*(#|$)' "$hostfile")
((${#hosts[@]} > 0)) || ayumi_die "hostfile '$hostfile' lists no hosts"
master_addr="${master_addr:-${hosts[0]}}"
slots="$(grep -Ev '^[[:space:]]*(#|$)' "$hostfile" | head -n1 | sed -n 's/.*slots=\([0-9]*\).*/\1/p')"

ayumi_pin_roots
ayumi_default_threads "${slots:-1}"
ayumi_overrides ${args[@]+"${args[@]}"}

env_file="$AYUMI_RUN_ROOT/.launch/deepspeed_env"
if [[ "${AYUMI_DRY_RUN:-0}" == 1 ]]; then
    echo "# $env_file would hold:"
    ayumi_forward_env | sed 's/^/#   /'
else
    [[ "$ds_launcher" != pdsh ]] || command -v pdsh >/dev/null ||
        ayumi_die "pdsh is not installed on this node (Debian/Ubuntu: apt-get install pdsh), or pick another --launcher (openmpi, mvapich, slurm)"
    mkdir -p "$(dirname "$env_file")"
    (umask 077 && ayumi_forward_env >"$env_file")
fi
export DS_ENV_FILE="$env_file"

cmd=("$(ayumi_tool deepspeed)" --hostfile "$hostfile" --master_addr "$master_addr" --master_port "$master_port")
cmd+=(--launcher "$ds_launcher" --no_local_rank)
[[ -n "$ssh_port" ]] && cmd+=(--ssh_port "$ssh_port")
[[ -f "$AYUMI_ROOT/.venv/bin/activate" ]] && cmd+=(--venv_script "$AYUMI_ROOT/.venv/bin/activate")
cmd+=(--module pretrain.train)

echo "# ${#hosts[@]} node(s): ${hosts[*]}; master $master_addr:$master_port; run root $AYUMI_RUN_ROOT"
cd "$AYUMI_ROOT"  # the launcher runs `cd $PWD` on every node: make that the checkout
ayumi_exec "${cmd[@]}" ${AYUMI_OVERRIDES[@]+"${AYUMI_OVERRIDES[@]}"}
