# shellcheck shell=bash
# launch/prepare_common.sh: what the array-job templates of `ayumi data prepare` share (prepare_slurm.sh,
# prepare_pbs.sh, prepare_sge.sh source it). Not run on its own.
#
# Options every template reads (the rest are `ayumi data prepare` overrides, passed to every task as given):
#   --tasks N         how many tasks the corpus is cut into (required; the same N for every task and the finish)
#   --cpus C          cores per task (default 8): asked of the scheduler, and workers=C unless an override sets workers
#   --logs DIR        one log file per task (default: prepare-logs in the submit folder)
#   --sched-arg ARGS  more options for every submission, split at spaces (a partition, a project, a time limit)
#   --dry-run         print the submissions, submit nothing

source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/env.sh"

prepare_parse() {
    tasks="" cpus=8 logs="$PWD/prepare-logs" dry_run=0
    sched_args=() overrides=()
    while (($#)); do
        case "$1" in
            --tasks) tasks="${2:?--tasks needs a number}"; shift ;;
            --cpus) cpus="${2:?--cpus needs a number}"; shift ;;
            --logs) logs="${2:?--logs needs a folder}"; shift ;;
            --sched-arg) read -ra words <<<"${2:?--sched-arg needs options}"; sched_args+=("${words[@]}"); shift ;;
            --dry-run) dry_run=1 ;;
            -h | --help) ayumi_usage "$0"; exit 0 ;;
            *) overrides+=("$1") ;;
        esac
        shift
    done
    [[ "$tasks" =~ ^[1-9][0-9]*$ ]] || ayumi_die "--tasks N is required (a whole number >= 1), got '${tasks}'"
    [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || ayumi_die "--cpus must be a whole number >= 1, got '$cpus'"
    local override
    for override in ${overrides[@]+"${overrides[@]}"}; do
        [[ "$override" == workers=* ]] && return 0
    done
    overrides+=("workers=$cpus")
}

# The shell command a task (or the finish, with --finish) runs: in the submit folder (relative paths in the
# overrides mean what they meant here), this checkout's ayumi, and AYUMI_DATA_ROOT when it is set here (PBS and
# Grid Engine do not pass the environment on).
prepare_command() {
    local data_root=""
    if [[ -n "${AYUMI_DATA_ROOT:-}" ]]; then
        [[ "$AYUMI_DATA_ROOT" == /* ]] || AYUMI_DATA_ROOT="$PWD/$AYUMI_DATA_ROOT"
        data_root="AYUMI_DATA_ROOT=$(printf '%q' "$AYUMI_DATA_ROOT") "
    fi
    printf 'cd %q && %sexec %s' "$PWD" "$data_root" \
        "$(ayumi_quote "$(ayumi_tool ayumi)" data prepare ${overrides[@]+"${overrides[@]}"} --tasks "$tasks" "$@")"
}

# Print a submission, and run it unless --dry-run; its output (the job id) goes to stdout.
prepare_submit() {
    printf '+ %s\n' "$(ayumi_quote "$@")" >&2
    if ((dry_run)); then
        echo "JOBID"
    else
        "$@"
    fi
}
