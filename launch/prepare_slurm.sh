#!/bin/bash
# launch/prepare_slurm.sh: `ayumi data prepare` as a SLURM array of N tasks, then a finish job that waits for them.
#
#   cd ayumi && bash launch/prepare_slurm.sh --tasks N [--cpus C] [--logs DIR] [--sched-arg '-p cpu -t 12:00:00']
#                                            [--dry-run] data=NAME tokenizer_dir=DIR [key=value ...]
#
# Submits (sbatch --wrap, so no other file is needed on the nodes):
#   sbatch --array=0-999 ... 'ayumi data prepare ... --tasks N'        each task reads SLURM_ARRAY_TASK_ID
#   sbatch --dependency=afterok:JOBS ... 'ayumi data prepare ... --tasks N --finish'
# More tasks than one array may hold (AYUMI_MAX_ARRAY, default 1000, below SLURM's usual MaxArraySize of 1001)
# are split into several arrays, each with AYUMI_TASK_OFFSET. A failed task fails the finish's dependency:
# resubmit the same command (completed tasks are skipped). Options: launch/prepare_common.sh.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare_common.sh"
prepare_parse "$@"
max_array="${AYUMI_MAX_ARRAY:-1000}"
((dry_run)) || mkdir -p "$logs"
jobs=()
for ((offset = 0; offset < tasks; offset += max_array)); do
    last=$((tasks - offset < max_array ? tasks - offset - 1 : max_array - 1))
    jobs+=("$(prepare_submit sbatch --parsable --job-name=ayumi-prepare --array="0-$last" --cpus-per-task="$cpus" \
        --export="ALL,AYUMI_TASK_OFFSET=$offset" --output="$logs/task-%A_%a.out" ${sched_args[@]+"${sched_args[@]}"} \
        --wrap "$(prepare_command)")")
done
depend="afterok$(printf ':%s' "${jobs[@]%%;*}")"
finish="$(prepare_submit sbatch --parsable --job-name=ayumi-prepare-finish --dependency="$depend" \
    --cpus-per-task=1 --output="$logs/finish-%j.out" ${sched_args[@]+"${sched_args[@]}"} --wrap "$(prepare_command --finish)")"
echo "# ${#jobs[@]} array job(s) of $tasks tasks: ${jobs[*]}; finish job $finish; logs in $logs"
