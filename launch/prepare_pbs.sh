#!/bin/bash
# launch/prepare_pbs.sh: `ayumi data prepare` as a PBS Pro array job of N tasks (ABCI 3.0), then a finish job.
#
#   cd ayumi && bash launch/prepare_pbs.sh --tasks N [--cpus C] [--logs DIR] [--sched-arg '-P GROUP -q QUEUE -l walltime=12:00:00']
#                                          [--dry-run] data=NAME tokenizer_dir=DIR [key=value ...]
#
# Submits:
#   qsub -J 0-(N-1) -l select=1:ncpus=C ... -- /bin/bash -c 'ayumi data prepare ... --tasks N'   (PBS_ARRAY_INDEX)
#   qsub -W depend=afterok:ARRAY_JOB ... -- /bin/bash -c 'ayumi data prepare ... --tasks N --finish'
# PBS has no variable for the array's size, so every task gets --tasks N. An array needs two subjobs or more:
# one task is one plain job (--task 0). Options: launch/prepare_common.sh.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare_common.sh"
prepare_parse "$@"
((dry_run)) || mkdir -p "$logs"
if ((tasks > 1)); then
    array=(-J "0-$((tasks - 1))") task_flag=()
else
    array=() task_flag=(--task 0)
fi
job="$(prepare_submit qsub -N ayumi-prepare ${array[@]+"${array[@]}"} -l "select=1:ncpus=$cpus" -j oe -o "$logs/" \
    ${sched_args[@]+"${sched_args[@]}"} -- /bin/bash -c "$(prepare_command ${task_flag[@]+"${task_flag[@]}"})")"
finish="$(prepare_submit qsub -N ayumi-prepare-finish -W "depend=afterok:$job" -l select=1:ncpus=1 -j oe -o "$logs/" \
    ${sched_args[@]+"${sched_args[@]}"} -- /bin/bash -c "$(prepare_command --finish)")"
echo "# array job $job of $tasks tasks; finish job $finish; logs in $logs"
