# shellcheck shell=bash
# launch/env.sh: the environment every ayumi launch shares; sourced by local.sh, multinode.sh and
# slurm.sbatch (not run on its own). Every variable is a default: a value already in the
# environment wins, so `NCCL_DEBUG=INFO launch/local.sh ...` just works.
#
# It also defines the small helpers the launch scripts share (ayumi_* functions).

AYUMI_ROOT="${AYUMI_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export AYUMI_ROOT

# ---- NCCL (GPU collectives) ------------------------------------------------------------------
# WARN prints problems only; INFO shows the chosen transport (IB / RoCE / sockets) and rings:
# the first thing to look at when a multi-node job hangs at start-up or is slow.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# export NCCL_DEBUG_SUBSYS=INIT,NET     # with NCCL_DEBUG=INFO: only start-up and network lines
#
# InfiniBand / RoCE. NCCL detects HCAs itself; these stay unset unless the cluster says otherwise.
# export NCCL_IB_HCA=mlx5               # restrict to these HCAs (e.g. skip a storage-only port)
# export NCCL_IB_DISABLE=1              # Ethernet-only clusters where IB probing misbehaves
# export NCCL_IB_GID_INDEX=3            # RoCE v2 fabrics usually need the GID index set
# The wait before an IB retransmit is 4.096 us x 2^value: 22 (~17 s) rides out transient fabric
# congestion on large jobs instead of failing the collective (NCCL's default is 20, ~4 s).
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
#
# Bootstrap / socket transport interface. NCCL skips lo and docker* by itself; pin it when nodes
# have several NICs and the default picks one that cannot reach the other nodes, e.g.:
# export NCCL_SOCKET_IFNAME=ib0         # or eth0, or ^docker,lo (a leading ^ excludes)
# (gloo, used on CPU, reads GLOO_SOCKET_IFNAME the same way.)

# ---- PyTorch distributed ---------------------------------------------------------------------
# A rank whose collective fails or times out aborts the communicator and exits, so the job dies
# with an error instead of hanging until the wall-clock limit.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# NCCL flight recorder: the last collectives of every rank, dumped when a collective times out, beside
# ayumi's own hang report (RUN_DIR/hang/; the watchdog speaks first, see docs/multinode.md).
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-${AYUMI_RUN_ROOT:-runs}/.nccl_trace/rank_}"
# torchrun forwards SIGTERM to the training processes and SIGKILLs them after this many seconds.
# ayumi saves on SIGTERM (checkpoint.save_on_signal), so give it most of SLURM's 120 s warning
# (slurm.sbatch asks for --signal=B:TERM@120). Older torch versions ignore it and wait 30 s.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}"
# Fewer out-of-memory failures from fragmentation when activation sizes vary (eval vs train).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# CUDA_DEVICE_MAX_CONNECTIONS is deliberately left at CUDA's default (8). Megatron sets it to 1 so
# tensor/sequence-parallel communication kernels launch in program order; ayumi is data-parallel
# only (ZeRO), where more hardware queues let gradient reduction overlap the backward pass.
# export CUDA_DEVICE_MAX_CONNECTIONS=1

# ---- Threads and logs --------------------------------------------------------------------------
# OMP_NUM_THREADS: set per launch by ayumi_default_threads (cores / processes on the node), since
# torch's default of one thread per core on every rank oversubscribes the CPU N times over.
# Line-buffered output so the ranks' log lines arrive promptly and in order under srun / pdsh.
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
# The ranks run `python -m pretrain.train` in the job's folder, which Python would put first on the import path: a
# folder there named tokenizer/, data/ or pretrain/ would hide ayumi's own package (Python >= 3.11 honours this).
export PYTHONSAFEPATH="${PYTHONSAFEPATH:-1}"
# The tokenizers library forks thread pools; in DataLoader workers that only produces warnings.
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
# `--module pretrain.train` must import from this checkout on every node, installed or not.
case ":${PYTHONPATH:-}:" in *":$AYUMI_ROOT:"*) ;; *) export PYTHONPATH="$AYUMI_ROOT${PYTHONPATH:+:$PYTHONPATH}" ;; esac

# Variables forwarded to other nodes by the deepspeed/pdsh launcher (it forwards NCCL_* and
# PYTHON* itself). WANDB_API_KEY is never forwarded: it would sit on every node's command line;
# use `wandb login` (a ~/.netrc on the shared home) instead. CUDA_VISIBLE_DEVICES is per node.
AYUMI_FORWARD_PREFIXES=(AYUMI_ WANDB_ HF_ TORCH_ PYTORCH_ CUDA_ OMP_ GLOO_ TOKENIZERS_ TRITON_ DS_)
AYUMI_NEVER_FORWARD=(WANDB_API_KEY CUDA_VISIBLE_DEVICES AYUMI_DRY_RUN AYUMI_GPUS)

# ---- Helpers ---------------------------------------------------------------------------------

# The launcher executable: the one beside this checkout's venv python, else the one on PATH.
ayumi_tool() {
    local name="$1"
    if [[ -x "$AYUMI_ROOT/.venv/bin/$name" ]]; then
        printf '%s\n' "$AYUMI_ROOT/.venv/bin/$name"
    elif command -v "$name" >/dev/null 2>&1; then
        command -v "$name"
    else
        printf '%s\n' "$name"
    fi
}

ayumi_python() {
    if [[ -n "${AYUMI_PYTHON:-}" ]]; then printf '%s\n' "$AYUMI_PYTHON"; return; fi
    if [[ -x "$AYUMI_ROOT/.venv/bin/python" ]]; then printf '%s\n' "$AYUMI_ROOT/.venv/bin/python"; return; fi
    command -v python3 || command -v python
}

# GPUs on this node: $AYUMI_GPUS (override), else CUDA_VISIBLE_DEVICES, else nvidia-smi, else 0.
ayumi_gpu_count() {
    if [[ -n "${AYUMI_GPUS:-}" ]]; then printf '%s\n' "$AYUMI_GPUS"; return; fi
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" ]]; then echo 0; return; fi
        local -a devices
        IFS=, read -ra devices <<<"$CUDA_VISIBLE_DEVICES"
        echo "${#devices[@]}"
        return
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
        return
    fi
    echo 0
}

# OMP_NUM_THREADS = usable cores / processes on this node (at least 1), unless already set.
ayumi_default_threads() {
    local procs="${1:-1}" cores
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
        cores="$(nproc 2>/dev/null || echo 1)"
        OMP_NUM_THREADS=$((cores / procs))
        ((OMP_NUM_THREADS >= 1)) || OMP_NUM_THREADS=1
        export OMP_NUM_THREADS
    fi
}

# Run and data roots as absolute paths: ranks on other nodes start in other directories, and the
# run dir (RUN_ROOT/NAME, no timestamp) must be the same folder on every rank and every requeue.
ayumi_pin_roots() {
    export AYUMI_RUN_ROOT="${AYUMI_RUN_ROOT:-$PWD/runs}"
    export AYUMI_DATA_ROOT="${AYUMI_DATA_ROOT:-$PWD/.cache}"
    [[ "$AYUMI_RUN_ROOT" == /* ]] || AYUMI_RUN_ROOT="$PWD/$AYUMI_RUN_ROOT"
    [[ "$AYUMI_DATA_ROOT" == /* ]] || AYUMI_DATA_ROOT="$PWD/$AYUMI_DATA_ROOT"
}

# The overrides, plus name=$AYUMI_RUN_NAME when that is set and no name= override is given.
# Result in the array AYUMI_OVERRIDES.
ayumi_overrides() {
    AYUMI_OVERRIDES=("$@")
    local arg
    if [[ -n "${AYUMI_RUN_NAME:-}" ]]; then
        for arg in "$@"; do [[ "$arg" == name=* ]] && return 0; done
        AYUMI_OVERRIDES+=("name=$AYUMI_RUN_NAME")
    fi
}

# The node names of a SLURM node list ("gpu[01-03,07],login1"), one per line: scontrol's
# expansion on a cluster; off one (a --dry-run on a laptop) a small expander of the same syntax.
ayumi_hostnames() {
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$1"
        return
    fi
    "$(ayumi_python)" - "$1" <<'PY'
import re
import sys


def top_level_items(spec):
    """Split at commas outside brackets: "a[1-2,5],b" -> ["a[1-2,5]", "b"]."""
    items, depth, current = [], 0, ""
    for char in spec:
        if char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += (char == "[") - (char == "]")
        current += char
    return items + [current] if current else items


def expand(name):
    """Expand the first [..] group (ranges keep their zero padding), then the rest recursively."""
    group = re.search(r"\[([^\]]*)\]", name)
    if not group:
        return [name]
    names = []
    for item in group.group(1).split(","):
        low, _, high = item.partition("-")
        values = [low] if not high else [str(i).zfill(len(low)) for i in range(int(low), int(high) + 1)]
        for value in values:
            names += expand(name[:group.start()] + value + name[group.end():])
    return names


for item in top_level_items(sys.argv[1]):
    print("\n".join(expand(item)))
PY
}

# A command as one shell-quoted line (what --dry-run prints): words that need quoting get single
# quotes, which keeps a `bash -c '...'` argument readable.
ayumi_quote() {
    local out="" arg
    for arg in "$@"; do
        if [[ -n "$arg" && "$arg" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+="$arg "
        else
            out+="'${arg//\'/\'\\\'\'}' "
        fi
    done
    printf '%s\n' "${out% }"
}

# Print "+ COMMAND"; unless AYUMI_DRY_RUN=1, replace this shell with it.
ayumi_exec() {
    printf '+ %s\n' "$(ayumi_quote "$@")"
    [[ "${AYUMI_DRY_RUN:-0}" == 1 ]] && exit 0
    exec "$@"
}

# KEY=VALUE lines of the variables to forward to other nodes (see AYUMI_FORWARD_PREFIXES).
ayumi_forward_env() {
    local name prefix skip
    while IFS= read -r name; do
        skip=1
        for prefix in "${AYUMI_FORWARD_PREFIXES[@]}"; do [[ "$name" == "$prefix"* ]] && skip=0; done
        for prefix in "${AYUMI_NEVER_FORWARD[@]}"; do [[ "$name" == "$prefix" ]] && skip=1; done
        ((skip)) || printf '%s=%s\n' "$name" "${!name}"
    done < <(compgen -e | sort)
}

# The script's header comment (from line 2 to the first line that is not a comment) as its --help.
ayumi_usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$1"
}

ayumi_die() {
    printf '%s: %s\n' "${0##*/}" "$*" >&2
    exit 2
}
