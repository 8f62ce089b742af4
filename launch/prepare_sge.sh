#!/bin/bash
# launch/prepare_sge.sh: `ayumi data prepare` as a Grid Engine array job of N tasks (Altair Grid Engine on
# TSUBAME 4.0, Son of Grid Engine, UGE), then a finish job held until the array is done.
#
#   cd ayumi && bash launch/prepare_sge.sh --tasks N [--cpus C] [--logs DIR] [--sched-arg '-g GROUP -l NODE_TYPE=1 -l h_rt=12:00:00']
#                                          [--dry-run] data=NAME tokenizer_dir=DIR [key=value ...]
#
# Submits:
#   qsub -t 1-N -b y ... /bin/bash -c 'ayumi data prepare ... --tasks N'       (task SGE_TASK_ID - 1)
#   qsub -hold_jid ARRAY_JOB -b y ... /bin/bash -c 'ayumi data prepare ... --tasks N --finish'
# Cores are a site's resource (a parallel environment, or a node type such as TSUBAME's): ask for them with --sched-arg;
# --cpus sets the workers. -hold_jid waits for the array to end, failed or not: the finish then refuses,
# naming the tasks to resubmit. Options: launch/prepare_common.sh.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/prepare_common.sh"
prepare_parse "$@"
((dry_run)) || mkdir -p "$logs"
job="$(prepare_submit qsub -terse -N ayumi-prepare -t "1-$tasks" -j y -o "$logs/" -b y \
    ${sched_args[@]+"${sched_args[@]}"} /bin/bash -c "$(prepare_command)")"
job="${job%%.*}"  # -terse prints JOBID.1-N:1 for an array
finish="$(prepare_submit qsub -terse -N ayumi-prepare-finish -hold_jid "$job" -j y -o "$logs/" -b y \
    ${sched_args[@]+"${sched_args[@]}"} /bin/bash -c "$(prepare_command --finish)")"
echo "# array job $job of $tasks tasks; finish job $finish; logs in $logs"
