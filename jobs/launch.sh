#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Start an hpcvla command on every rank of the current Slurm or PBS job (the one launch
# script all job scripts in jobs/slurm and jobs/pbs exec).
#
#   jobs/launch.sh train configs/default.yaml pipeline.total_updates=100
#   jobs/launch.sh sft configs/libero_spatial.yaml sft.demos=/data/libero
#   jobs/launch.sh bench modes --workload emulated --json bench.json
#
# `train`, `sft` and `eval` run one rank per allocated task: MPICH's `mpiexec` (Hydra) with
# the node list, its proxies started by srun under Slurm and under PBS by PBS's pbs_tmrsh
# (TM) where there is one, else ssh; `srun --mpi=pmix` for Open MPI under Slurm, its `mpirun`
# elsewhere (with `-x` for each of the job's variables: mpirun passes ranks on other nodes
# none). Every other command (`bench modes` starts its own MPI worlds) runs as one process on
# the first node.
#
# What it does: detect Slurm (SLURM_JOB_ID) or PBS (PBS_JOBID + PBS_NODEFILE), list the
# hosts, check that every node holds the same number of ranks (the rank plan needs it),
# activate the Python environment, set one BLAS/OpenMP thread pool size per rank, give an
# array job's task the seed of its index (train, sft: run.seed=<index>), run the ranks, and
# pass the scheduler's signals on to them as SIGTERM (ranks stop cleanly). SIGUSR1
# is the time-limit warning of the Slurm scripts (`#SBATCH --signal=B:USR1@<grace>`): with
# HPCVLA_REQUEUE=1 the job then requeues itself (`scontrol requeue`) once the ranks have
# exited with a checkpoint, and the next start continues the run.
#
# Settings (environment):
#   HPCVLA_ROOT       the repository the job runs in (default: this script's parent folder;
#                     the job scripts cd there, else to the folder the job was submitted from)
#   HPCVLA_VENV       venv to activate (default: <repo>/.venv when it exists)
#   HPCVLA_CONDA_ENV  conda environment (name or prefix) to activate instead
#   HPCVLA_MPI        mpich | openmpi | auto (default auto: the mpiexec beside the
#                     environment's Python, else PATH's). openmpi points mpi4py at Open MPI's
#                     libmpi (MPI4PY_LIBMPI) and picks one-sided components that work on one
#                     host and across hosts (4.x: OMPI_MCA_osc=sm,ucx; 5: its own choice;
#                     src/hpcvla/process/mpi_select.py)
#   HPCVLA_LAUNCHER   srun | mpiexec (default: mpiexec, but srun for Open MPI under Slurm;
#                     srun with MPICH wires up through Slurm's PMI-2 server, which breaks
#                     MPI_Init on nodes with many network devices: src/hpcvla/process/mpi_select.py)
#   HPCVLA_SRUN_MPI   srun's PMI plugin (default: pmi2 for MPICH, pmix for Open MPI)
#   HPCVLA_THREADS    threads per rank (default: the scheduler's CPUs per task, else the
#                     job's CPUs on its smallest node (or this node's cores) / ranks per
#                     node, at least 1): OMP/MKL/OpenBLAS/LP_NUM_THREADS, and the ranks' torch
#   HPCVLA_RANKS      ranks to start outside any job (default 4); inside a job the
#                     allocation decides
#   HPCVLA_JOB_RUNS   train, sft: run root of this job (run.root); when it already holds a
#                     run with a checkpoint short of its end (the job was requeued or rerun),
#                     that run is continued (run.resume); a job that names a run itself
#                     (run.resume=RUN) continues, restarts and requeues that one. train, sft,
#                     eval: its .ranks holds the ranks' cards while a world runs (a folder
#                     every node sees)
#   HPCVLA_REQUEUE    1: requeue the Slurm job after the time-limit warning (SIGUSR1); with
#                     HPCVLA_JOB_RUNS (train, sft), as HPCVLA_RESTARTS and
#                     HPCVLA_END_GRACE_S
#   HPCVLA_RESTARTS   train, sft: when the world fails (a rank or a node died), start it
#                     again inside the allocation up to this many times (default 0): on the
#                     nodes that still start a process, from the newest checkpoint (Slurm jobs
#                     need --no-kill to keep their allocation when a node fails)
#   HPCVLA_NODE_CHECK_S  after a failed world, how long each node has to start a process and
#                     clean up after it (default 60); one that takes longer is dropped from
#                     the restarts (at scale the controller and the shared file system are
#                     slow just then: a short limit drops healthy nodes)
#   HPCVLA_START_RETRIES  train, sft, eval: a world that failed while starting, before any
#                     rank registered, is started again on the same nodes this many times
#                     (default 2; a restart's world too)
#   HPCVLA_END_GRACE_S  train, sft, eval: a world whose ranks on this node died without
#                     finishing is ended this many seconds later if its launcher has not ended
#                     it (default 30; after a node failure mpiexec/srun wait for the scheduler
#                     to declare the node down, minutes)
#   HPCVLA_AUTOPLAN   train: lay the run out as `hpcvla plan --auto --costs COSTS` finds best
#                     for the job's nodes (the scale model; its overrides follow the config's),
#                     at the start and at every restart (a restart's keeps the first world's
#                     version batch: learner.micro_batches). COSTS: config (the reach env
#                     probed, or the config's emulate.*), balanced, table3, pi0-libero; unset: off
#   HPCVLA_DOCTOR     train, sft, eval: 0 skips `hpcvla doctor` on the first node and its
#                     node-only checks on the others, all at once (default 1)
#   HPCVLA_NODE_DOCTOR_S  how long each node's check may take (default 300: it imports the
#                     simulator): the first node's fails the job, another's is said and left
#                     to the world
#   HPCVLA_PBS_TM     PBS: 1 (default) starts the MPI launcher's processes on the other nodes
#                     through PBS's own `pbs_tmrsh` (TM) where the job finds one, 0 through ssh
#   HPCVLA_SWEEP      train, sft in an array job: a file of overrides, a line per task
#                     (the lines that hold any, from 0; `#` comment lines): task K adds line
#                     K's after its command's (below: its seed)
#   HPCVLA_DRY_RUN    1: work out the launch (MPI, threads, the run it resumes, the auto plan)
#                     and print it and the command, but start no rank (train, sft: their
#                     settings checked as the ranks would load them)
set -euo pipefail

# Bash reads a script as it runs it: a launch.sh rewritten in place while a job runs (an editor,
# `cp` over it) would be read on from the old offset of the new text. The script is therefore
# one compound command, read whole before any of it runs, ended by its own `exit`.
{

die() { echo "launch.sh: error: $*" >&2; exit 2; }
say() { echo "launch.sh $(date "+%F %T"): $*" >&2; }
# A command as a shell would take it back (a word holding blanks quoted): logs can be pasted.
shown() { local out; printf -v out '%q ' "$@"; printf '%s' "${out% }"; }
# A signal while no world runs (the time-limit warning may come up to a minute early, a cancel
# during the node checks or between restarts) is remembered, not fatal: run_world then starts
# no world, and the job ends as one stopped by it.
EARLY=""
remember_signals() { trap 'EARLY=TERM' TERM; trap 'EARLY=INT' INT; trap 'EARLY=USR1' USR1; }
remember_signals

HPCVLA_ROOT=${HPCVLA_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export HPCVLA_ROOT
[[ $# -ge 1 ]] || die "usage: launch.sh COMMAND [ARGS...]   (e.g. train configs/default.yaml)"
for name in HPCVLA_RESTARTS HPCVLA_START_RETRIES HPCVLA_END_GRACE_S HPCVLA_NODE_CHECK_S \
        HPCVLA_NODE_DOCTOR_S; do
    [[ ${!name:-0} =~ ^[0-9]+$ ]] || die "$name=${!name} is not a count: set a whole number" \
        "(0 or more), or unset it for its default"
done
for name in HPCVLA_THREADS HPCVLA_RANKS; do
    [[ ${!name:-1} =~ ^[1-9][0-9]*$ ]] || die "$name=${!name} is not a count: set a whole" \
        "number (1 or more), or unset it for its default"
done
for name in HPCVLA_DRY_RUN HPCVLA_DOCTOR HPCVLA_REQUEUE HPCVLA_PBS_TM; do  # 'true' is no 1
    [[ ${!name:-0} == [01] ]] || die "$name=${!name}: set 1 (on) or 0 (off), or unset it" \
        "for its default"
done
[[ ${HPCVLA_LAUNCHER:-srun} == srun || $HPCVLA_LAUNCHER == mpiexec ]] ||
    die "HPCVLA_LAUNCHER=$HPCVLA_LAUNCHER: set srun or mpiexec, or unset it for its default"
[[ ${HPCVLA_NODE_CHECK_S:-60} != 0 ]] ||
    die "HPCVLA_NODE_CHECK_S=0 would wait for a dead node for ever: set seconds (default 60)"
[[ ${HPCVLA_NODE_DOCTOR_S:-300} != 0 ]] ||
    die "HPCVLA_NODE_DOCTOR_S=0 would wait for a dead node for ever: set seconds (default 300)"

# ---- the allocation: scheduler, hosts, ranks per node, Python, MPI, threads per rank --------
LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib  # this script's own, whatever the root
# shellcheck source=lib/words.sh
source "$LIB/words.sh"  # bash 4.4 or newer, before the first array
# shellcheck source=lib/allocation.sh
source "$LIB/allocation.sh"
if ! refusal=$("$PYTHON" -m hpcvla "$1" --help 2>&1 > /dev/null); then  # before any work
    die "$1: hpcvla does not run it (${refusal##*$'\n'})"  # its last line: the reason
fi

# ---- the command ---------------------------------------------------------------------------
# The run of this job that a restart continues: the newest run directory under $1, if its
# newest checkpoint is short of the run's end (total_updates; sft.steps; nothing if it is done
# or has none).
resumable_run() { "$PYTHON" -m hpcvla.job.restarts resumable "$1"; }
# The commands whose ranks are one MPI world started here, one per allocated task
# (hpcvla.process.deathwatch.WORLD_COMMANDS).
in_a_world() { [[ $1 == train || $1 == sft || $1 == eval ]]; }
# The commands that make a run, which a requeued or rerun job continues from its checkpoint,
# and a failed world's restart inside the allocation too.
makes_a_run() { [[ $1 == train || $1 == sft ]]; }
# What a run's checkpoints are numbered by (train's policy versions, `hpcvla sft`'s steps), and
# the setting that makes them.
point_name() { [[ $1 == sft ]] && echo "SFT step" || echo "policy version"; }
interval_name() { [[ $1 == sft ]] && echo sft.checkpoint_every || echo learner.checkpoint_every; }
# ... and every setting that makes them (train's by the clock too)
interval_settings() {
    [[ $1 == sft ]] && echo sft.checkpoint_every ||
        echo "learner.checkpoint_every, learner.checkpoint_every_s"
}

# ---- starting, watching and ending a world on the job's nodes -------------------------------
# shellcheck source=lib/world.sh
source "$LIB/world.sh"

ARGS=("$@")
COMMAND_ARGS=("$@")
# A task of an array job (sbatch --array, qsub -J) that makes a run: with HPCVLA_SWEEP=FILE it
# adds the overrides on FILE's line <its index> (the lines that hold any, from 0; a line whose
# first word begins with `#` is a comment), split as a command line is; and it trains its own
# seed, the index (run.seed=<index>, over the config file's), unless its command or line
# names run.seed, or it continues a run it names (run.resume: that run's seed): the tasks
# would all run the config's one seed, their spread the timing's alone (docs/learning.md,
# "What a seed fixes"). A requeued task keeps its index: its run resumes as it began.
case $SCHEDULER in
    slurm) ARRAY_TASK=${SLURM_ARRAY_TASK_ID:-} ;;
    pbs) ARRAY_TASK=${PBS_ARRAY_INDEX:-${PBS_ARRAYID:-}} ;;  # PBS Pro/OpenPBS; Torque
    *) ARRAY_TASK="" ;;
esac
if [[ -n ${HPCVLA_SWEEP:-} ]]; then
    if [[ -z $ARRAY_TASK ]] || ! makes_a_run "$1"; then
        die "HPCVLA_SWEEP=$HPCVLA_SWEEP gives each task of an array job (sbatch --array=0-N," \
            "qsub -J 0-N) of train or sft a line of overrides: this job is none"
    fi
    # (a path relative to where the job was submitted, wherever the script went since)
    [[ $HPCVLA_SWEEP == /* ]] ||
        HPCVLA_SWEEP=${SLURM_SUBMIT_DIR:-${PBS_O_WORKDIR:-$PWD}}/$HPCVLA_SWEEP
    [[ -r $HPCVLA_SWEEP ]] || die "HPCVLA_SWEEP=$HPCVLA_SWEEP: no such file to read"
    mapfile -t SWEEP_LINES < <(tr -d '\r' < "$HPCVLA_SWEEP" |  # (a file saved on Windows)
        grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' || true)
    (( ${#SWEEP_LINES[@]} )) || die "HPCVLA_SWEEP=$HPCVLA_SWEEP holds no line of overrides"
    last=$(( ${#SWEEP_LINES[@]} - 1 ))
    (( ARRAY_TASK <= last )) || die "array task $ARRAY_TASK: HPCVLA_SWEEP=$HPCVLA_SWEEP has" \
        "${#SWEEP_LINES[@]} line(s) of overrides (tasks 0-$last): submit --array=0-$last"
    # shellcheck disable=SC2034 # words reads it by name
    SWEEP_LINE=${SWEEP_LINES[$ARRAY_TASK]}
    words SWEEP_LINE
    COMMAND_ARGS+=("${WORDS[@]}")
    say "array task $ARRAY_TASK: HPCVLA_SWEEP line $ARRAY_TASK: $(shown "${WORDS[@]}")"
fi
overrides_name() {  # SETTING ARGS...: whether ARGS hold an override of SETTING
    local setting=$1 arg
    shift
    for arg in "$@"; do [[ $arg == "$setting="* ]] && return 0; done
    return 1
}
if [[ -n $ARRAY_TASK ]] && makes_a_run "$1" &&
        ! overrides_name run.resume "${COMMAND_ARGS[@]:1}"; then
    if overrides_name run.seed "${@:2}"; then
        say "array task $ARRAY_TASK: its command names run.seed, which every task of the" \
            "array runs alike"
    elif ! overrides_name run.seed "${COMMAND_ARGS[@]:1}"; then  # (a sweep line's: said)
        COMMAND_ARGS+=("run.seed=$ARRAY_TASK")
        say "array task $ARRAY_TASK: its own seed, run.seed=$ARRAY_TASK"
    fi
fi
# The run a restart, a requeue and the job's exit status are about: the one the job names
# (run.resume, in its config or overrides: a run continued in a new job), else the newest
# under its run root; and that run's state against the command's end (JOB_RUN_STATE: '', none,
# resumable, complete). A config that cannot be read says so at the node check, below.
JOB_RUN=${HPCVLA_JOB_RUNS:-} JOB_RUN_STATE=""
if makes_a_run "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]] && found=$("$PYTHON" -m \
        hpcvla.job.restarts job-run "$HPCVLA_JOB_RUNS" "${COMMAND_ARGS[@]}" 2>/dev/null); then
    mapfile -t named <<< "$found"  # the run named (or an empty line), its state
    JOB_RUN=${named[0]:-$JOB_RUN} JOB_RUN_STATE=${named[1]:-}
fi
AUTO=() AUTO_FIRST_NP="" AUTO_FIRST=()
plan_auto() {  # AUTO: the scale model's layout for NP ranks (HPCVLA_AUTOPLAN, train); a
    # restart's keeps the version batch of the job's first world (AUTO_FIRST_NP, AUTO_FIRST)
    [[ $1 == train && -n ${HPCVLA_AUTOPLAN:-} ]] || return 0
    local best first=()
    if [[ -n $AUTO_FIRST_NP ]]; then
        first=(--first-world "$AUTO_FIRST_NP")
        for override in "${AUTO_FIRST[@]}"; do first+=(--first-layout "$override"); done
    fi
    best=$("$PYTHON" -m hpcvla.job.restarts auto "${COMMAND_ARGS[@]:1}" --world "$NP" \
            --ranks-per-node "$PER_NODE" --costs "$HPCVLA_AUTOPLAN" "${first[@]}") || return 1
    mapfile -t AUTO <<< "$best"
    if [[ -z $AUTO_FIRST_NP ]]; then
        AUTO_FIRST_NP=$NP AUTO_FIRST=("${AUTO[@]}")
    fi
}
set_command() {  # ARGS and COMMAND: the command, the job's run root, a resumable run
    ARGS=("${COMMAND_ARGS[@]}")
    if makes_a_run "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]]; then
        # The job's own run root: a requeued (Slurm) or rerun (PBS) job, or a restart after a
        # failure, finds the run an earlier start made there and continues it from its
        # checkpoint.
        ARGS+=("run.root=$HPCVLA_JOB_RUNS")
        RESUME=$(resumable_run "$JOB_RUN")
        if [[ -z $RESUME && $JOB_RUN != "$HPCVLA_JOB_RUNS" && $JOB_RUN_STATE == resumable ]]
        then  # a run it names and runs further than the run's own end
            RESUME=$JOB_RUN
        fi
        if [[ -n $RESUME ]]; then
            say "continuing $RESUME from its newest checkpoint"
            ARGS+=("run.resume=$RESUME")
        fi
    fi
    if [[ $1 == train && -n ${HPCVLA_AUTOPLAN:-} ]]; then  # (plan_auto's)
        ARGS+=("${AUTO[@]}")
        say "auto plan ($HPCVLA_AUTOPLAN costs) for $NP rank(s) on $NODES node(s): ${AUTO[*]}"
    fi
    COMMAND=("$PYTHON" -m mpi4py -m hpcvla "${ARGS[@]}")
    in_a_world "$1" || COMMAND=("$PYTHON" -m hpcvla "${ARGS[@]}")
}


HOSTFILE=$(mktemp "${TMPDIR:-/tmp}/hpcvla-hosts.XXXXXX")
trap 'rm -f "$HOSTFILE"' EXIT
# After a node failure the failed world's step never completes (its dead node cannot say so)
# and holds its CPUs on the nodes left: a restart's steps must share them (srun --overlap).
OVERLAP=""
# A job whose run is complete: started again (Slurm requeued it, PBS reran it) after the run's
# last checkpoint, or naming a run at its end. A world would train a second run from version 0
# beside it, or refuse the one named.
if [[ $JOB_RUN_STATE == complete ]]; then
    say "the job's run (${JOB_RUN}) has its checkpoint at the end this command runs to: nothing" \
        "left to train (to train it further, raise $( [[ $1 == sft ]] && echo sft.steps ||
        echo pipeline.total_updates) with run.resume=<the run>)"
    exit 0
fi
plan_auto "$1" || die "HPCVLA_AUTOPLAN=$HPCVLA_AUTOPLAN: no auto plan for $NP rank(s) on" \
    "$NODES node(s) (the reason above)"
set_command "$1"
set_launch "$1"
say "scheduler $SCHEDULER, job $JOB_ID: $NP rank(s) on $NODES node(s)" \
    "(${HOSTS[*]}), $PER_NODE per node, $THREADS thread(s) per rank"
MEMLOCK=$(ulimit -l)
[[ $MEMLOCK == unlimited ]] || MEMLOCK+=" KiB"
if [[ $MEMLOCK != unlimited ]] && (( NODES > 1 )); then  # (allocation.sh raised it)
    MEMLOCK+=" (windows across nodes register their memory with InfiniBand/RoCE adapters:"
    MEMLOCK+=" ask the site for an unlimited hard limit, e.g. Slurm's"
    MEMLOCK+=" PropagateResourceLimitsExcept=MEMLOCK)"
fi
say "python: $PYTHON, MPI: $HPCVLA_MPI_FLAVOUR ($HPCVLA_MPIEXEC), locked memory: $MEMLOCK"
say "running: $(shown "${LAUNCH[@]}" "${COMMAND[@]}")${CLEAN_ENV[*]:+ (without SLURM_* variables)}"
# PBS's cgroup hook gives a node's GPUs to the job's processes there; ranks ssh starts are
# none of them
if [[ $SCHEDULER == pbs && -z $PBS_RSH ]] && (( NODES > 1 )) &&
        [[ ! ${CUDA_VISIBLE_DEVICES:-} =~ ^(|-1|NoDevFiles)$ ]]; then
    say "warning: the ranks on the job's other nodes start by ssh (no pbs_tmrsh), outside the" \
        "job's cgroup: they see every GPU of their node, other jobs' too. Take whole nodes" \
        "(select=N:ngpus=<all of a node's>), or start them by PBS's TM (pbs_tmrsh on PATH," \
        "HPCVLA_PBS_TM=1)"
fi
# A node that lacks what the job needs, or a layout that overfills its memory, fails the job
# here, in seconds, saying why: this node, the job's first, every check; then the others what
# each has of its own (check_other_nodes; they answer clean_nodes before a restart). It checks
# the command's settings as they run: the auto plan's included.
DOCTOR=()
if in_a_world "$1" && [[ ${HPCVLA_DOCTOR:-1} == 1 ]]; then
    DOCTOR=("$PYTHON" -m hpcvla doctor --job "$1" --world "$NP" --ranks-per-node "$PER_NODE"
            -- "${ARGS[@]:1}")
    say "checking this node: $(shown "${DOCTOR[@]}")"
    (( NODES == 1 )) || say "and then nodes $(other_nodes | xargs): the same with --node-only"
fi
if [[ ${HPCVLA_DRY_RUN:-0} == 1 ]]; then
    # the settings as the ranks would load them (the doctor's first check, not its node
    # checks): a dry run of a job they would refuse fails as the job would
    if makes_a_run "$1"; then
        "$PYTHON" -m hpcvla config --job "$1" "${ARGS[@]:1}" > /dev/null ||
            die "the job's settings are refused (above): the job would end so"
    fi
    exit 0
fi
if [[ $SCHEDULER == slurm && ${SLURM_RESTART_COUNT:-0} -gt 0 ]] && in_a_world "$1"; then
    # A requeued job's ranks were killed with it: their shared-memory segments are still in
    # the nodes' /dev/shm (their memory; the doctor below would count it as taken), and under
    # srun its steps get the ids of the killed ones again, after which MPICH names its
    # segments: the new ranks would join the killed ones' (they hang or abort in MPI_Init).
    # Remove this user's segments that no process maps any more, on every node.
    mapfile -t answered < <(clean_nodes)
    (( ${#answered[@]} == NODES )) || say "could not remove the killed ranks' MPI" \
        "segments on every node: answering ${answered[*]:-none} of ${HOSTS[*]}"
fi
if (( ${#DOCTOR[@]} )); then
    # a cancel, preemption or the time limit's warning during the checks ends them at once
    # (until_signalled): the job ends as stopped (run_world starts no world), not as a node
    # that lacks something; a check that hangs (a renderer's driver, a file system) is ended
    # within HPCVLA_NODE_DOCTOR_S, as the other nodes' are
    doctor_status=0
    until_signalled timeout -k 10 "${HPCVLA_NODE_DOCTOR_S:-300}" "${DOCTOR[@]}" >&2 ||
        doctor_status=$?
    if (( doctor_status )) && [[ -z $EARLY ]]; then
        (( doctor_status != 124 && doctor_status != 137 )) ||
            die "hpcvla doctor did not finish on this node ($(hostname)) within" \
                "${HPCVLA_NODE_DOCTOR_S:-300} s (HPCVLA_NODE_DOCTOR_S): a check that hangs" \
                "(its last line above), or a slow import: set more seconds"
        die "this node ($(hostname)) lacks what the job needs, or the job's settings are" \
            "refused (hpcvla doctor, above)"
    fi
    (( NODES == 1 )) || [[ -n $EARLY ]] ||
        until_signalled check_other_nodes "${DOCTOR[@]:0:4}" --node-only "${DOCTOR[@]:4}" ||
        [[ -n $EARLY ]] || die "not every node of the job has what it needs (above)"
fi

# A restart continues from the run's newest checkpoint: without periodic ones there is none.
if makes_a_run "$1" && [[ ${HPCVLA_RESTARTS:-0} != 0 && -n ${HPCVLA_JOB_RUNS:-} ]] && [[ $(
        "$PYTHON" -m hpcvla.job.restarts checkpoint-every "$1" "${COMMAND_ARGS[@]:1}" \
        2>/dev/null) == 0 ]]; then
    say "HPCVLA_RESTARTS=$HPCVLA_RESTARTS, but no checkpoint is written before the run's end" \
        "($(interval_settings "$1"): 0): a world that fails has none to continue from and is" \
        "not restarted (set $(interval_name "$1")=K: a restart then loses at most K" \
        "$(point_name "$1")s)"
fi

# ---- run, forwarding the scheduler's signals -----------------------------------------------

# The overrides (FIT) that lay the run of command $1 out on the NP ranks of the nodes left.
# train: by the config's placement rules: fewer cells, and fewer learners (the others spare)
# where there are fewer producers than learner ranks, each then training more micro-batches a
# version, so that a version's batch stays that of the failed world of $2 ranks; then the
# whole plan checked (`hpcvla plan`, memory included: LAYOUT). sft: every rank a learner,
# each training more micro-batches a step, the step's chunks the failed world's. False,
# saying why, when nothing fits.
fit_to_nodes() {
    local fit
    FIT=()
    LAYOUT=""
    if ! fit=$("$PYTHON" -m hpcvla.job.restarts fit "${COMMAND_ARGS[@]:1}" --world "$NP" \
            --ranks-per-node "$PER_NODE" --from-world "$2" --command "$1" 2>&1); then
        printf '%s\n' "$fit" >&2
        return 1
    fi
    read -ra FIT <<< "$fit"
    [[ $1 == train ]] || return 0
    if ! LAYOUT=$("$PYTHON" -m hpcvla plan "${COMMAND_ARGS[@]:1}" "${FIT[@]}" \
            --world "$NP" --ranks-per-node "$PER_NODE" 2>&1); then
        printf '%s\n' "$LAYOUT" >&2
        return 1
    fi
}

# A failed world (a rank or a node died; not a signal) is started again inside the allocation
# up to HPCVLA_RESTARTS times: on the nodes that still start a process, with as many ranks per
# node as before, laid out on them (fit_to_nodes, or train's auto plan),
# continuing from the newest checkpoint (any learner count and ZeRO stage resumes it). Not
# when the run has no checkpoint yet (a new world would start it over, in a new run
# directory), nor when the failure recurs before a newer checkpoint exists: that is no node
# failure, and trying again would not end.
#
# A world that failed while starting, before any rank registered and before a run directory
# existed (MPI_Init: Open MPI's ranks can crash there when a peer's first message arrives
# early, open-mpi/ompi#12495), is started again on the same nodes, HPCVLA_START_RETRIES
# times (default 2: on loaded nodes a second start crashed too), and so is each restart's
# world: nothing ran, so nothing is lost or trained twice. Not when a node stopped answering.
# One that failed so every time ends the job, saying so.
#
# A world that refused to run (exit 2: every rank's one verdict, such as a run that another
# job's world holds) is neither restarted nor started again: its verdict would be the same,
# and a restart would record itself in the other job's run.
restarts_left=${HPCVLA_RESTARTS:-0}
START_RETRIES=${HPCVLA_START_RETRIES:-2}  # as job/launch.py
# The run this job continues (set_command's RESUME) and its newest checkpoint as the job
# begins: a time-limit requeue of that run needs a checkpoint past it (a job whose time runs
# out before its next checkpoint would requeue, and end so, for ever).
START_RUN=${RESUME:-} START_VERSION=-1
if [[ ${HPCVLA_REQUEUE:-0} == 1 && $SCHEDULER == slurm && -n $START_RUN ]]; then
    START_VERSION=$("$PYTHON" -m hpcvla.job.restarts newest-version "$JOB_RUN")
fi
start_retries_left=$START_RETRIES
failed_at=""
LAYOUT=""
while true; do
    run_world "$1"
    [[ $status != 0 && -z $SIGNALLED ]] || break
    if [[ $status == 2 ]]; then  # every rank's one verdict (they ended together), a restart's
        say "the world refused to run (exit status 2: its ranks' message is above): the job" \
            "ends, its world not started again"  # would be the same
        break
    fi
    if [[ $status == 3 && $1 == eval ]]; then  # hpcvla eval's verdict: none on the policy
        say "the evaluation gave no verdict (exit status 3: every episode ended by an env" \
            "fault, its lines above): the job ends"
        break
    fi
    say "the world failed (status $status) at $(date +%T); checking the nodes"
    checked_at=$SECONDS
    mapfile -t usable < <(clean_nodes)
    say "$(( SECONDS - checked_at )) s to check the nodes; answering: ${usable[*]:-none}"
    if [[ -n $NEVER_STARTED && ${#usable[@]} == "${#HOSTS[@]}" ]]; then
        if (( start_retries_left == 0 )); then
            say "the world failed while starting, before any rank registered," \
                "$((START_RETRIES + 1)) time(s) in a row: not starting it again" \
                "(HPCVLA_START_RETRIES=$START_RETRIES; the ranks' first error is above)"
            break
        fi
        start_retries_left=$(( start_retries_left - 1 ))
        OVERLAP=1
        set_launch "$1"
        say "the world failed while starting, before any rank registered: starting it again" \
            "($(( START_RETRIES - start_retries_left ))/$START_RETRIES)"
        say "running: $(shown "${LAUNCH[@]}" "${COMMAND[@]}")"
        continue
    fi
    if ! makes_a_run "$1" || [[ -z ${HPCVLA_JOB_RUNS:-} ]]; then break; fi
    if (( restarts_left <= 0 )); then
        (( ${HPCVLA_RESTARTS:-0} == 0 )) ||
            say "no restarts left (HPCVLA_RESTARTS=$HPCVLA_RESTARTS)"
        break
    fi
    version=$("$PYTHON" -m hpcvla.job.restarts newest-version "$JOB_RUN")
    if (( version < 0 )); then  # a new world would start the run over, in a new directory
        say "the run has no checkpoint to continue from ($(interval_settings "$1")): not" \
            "restarting"
        break
    fi
    if [[ -z $("$PYTHON" -m hpcvla.job.restarts resumable "$JOB_RUN") ]]; then
        say "the run wrote its last checkpoint ($(point_name "$1") $version) before the" \
            "world failed: nothing left to restart"
        break
    fi
    if [[ $version == "$failed_at" ]]; then
        say "the world failed again before a checkpoint newer than $(point_name "$1")" \
            "$version: not restarting"
        break
    fi
    failed_at=$version
    dropped=()
    for host in "${HOSTS[@]}"; do
        [[ " ${usable[*]} " == *" $host "* ]] || dropped+=("$host")
    done
    if (( ${#usable[@]} == 0 )); then
        say "no node of the job starts a process: not restarting"
        break
    fi
    HOSTS=("${usable[@]}")
    NODES=${#HOSTS[@]}
    FAILED_NP=$NP
    NP=$(( NODES * PER_NODE ))
    export HPCVLA_JOB_RANKS=$NP
    if [[ $1 == train && -n ${HPCVLA_AUTOPLAN:-} ]]; then  # laid out afresh
        if ! plan_auto "$1"; then
            say "no auto plan for the $NODES node(s) left (${HOSTS[*]}): not restarting"
            break
        fi
    else
        if ! fit_to_nodes "$1" "$FAILED_NP"; then
            say "the run does not fit the $NODES node(s) left (${HOSTS[*]}): not restarting"
            break
        fi
        if (( ${#FIT[@]} )); then  # the restarts after this one start from it
            COMMAND_ARGS+=("${FIT[@]}")
            say "fewer producers or learners on the nodes left: ${FIT[*]}"
        fi
    fi
    restarts_left=$(( restarts_left - 1 ))
    start_retries_left=$START_RETRIES  # the restart's world starts afresh
    OVERLAP=1
    say "restart $(( HPCVLA_RESTARTS - restarts_left ))/$HPCVLA_RESTARTS:" \
        "dropped node(s): ${dropped[*]:-none}; $NP rank(s) on $NODES node(s) (${HOSTS[*]})," \
        "from $(point_name "$1") $version"
    say "restart record: $("$PYTHON" -m hpcvla.job.restarts record "$JOB_RUN" "$status" \
        "${dropped[*]}" "${HOSTS[*]}" "$NP")"
    [[ -z $LAYOUT ]] || sed -n 1,3p <<< "$LAYOUT" >&2  # (head would break printf's pipe)
    set_command "$1"
    set_launch "$1"
    say "running: $(shown "${LAUNCH[@]}" "${COMMAND[@]}")"
done

if [[ -n $SIGNALLED ]]; then
    say "ranks exited with status $status after SIG$SIGNALLED"
    REQUEUED_RUN=""  # the run a time-limit requeue would continue
    if [[ $SIGNALLED == USR1 && ${HPCVLA_REQUEUE:-0} == 1 && $SCHEDULER == slurm &&
            -n ${HPCVLA_JOB_RUNS:-} ]]; then
        REQUEUED_RUN=$(resumable_run "$JOB_RUN") || REQUEUED_RUN=""
    fi
    if [[ -n $REQUEUED_RUN && $REQUEUED_RUN == "$START_RUN" ]] && (( $("$PYTHON" -m \
            hpcvla.job.restarts newest-version "$JOB_RUN") <= START_VERSION )); then
        status=$(( 128 + $(kill -l USR1) ))
        say "no checkpoint past $(point_name "$1") $START_VERSION in this job: the time-limit" \
            "warning came first, and a requeued start would end the same way, so the job is" \
            "not requeued. Give it more time (--time, and the warning's lead in --signal)," \
            "or checkpoint more often ($(interval_settings "$1")), and continue the run in a new" \
            "job with run.resume=$REQUEUED_RUN; exit status $status"
    elif [[ -n $REQUEUED_RUN ]]; then
        say "requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
        scontrol requeue "$SLURM_JOB_ID" || {
            status=$(( 128 + $(kill -l USR1) ))
            say "could not requeue job $SLURM_JOB_ID (--no-requeue, or the site's policy):" \
                "continue its run in a new job with run.resume=$REQUEUED_RUN; exit status" \
                "$status"; }
    elif (( status == 0 )) && { ! makes_a_run "$1" || [[ -n ${NO_WORLD:-} ||
            -z ${HPCVLA_JOB_RUNS:-} || -n $(resumable_run "$JOB_RUN") ||
            $("$PYTHON" -m hpcvla.job.restarts newest-version "$JOB_RUN") -lt 0 ]]; }; then
        # stopped short of its end (with its checkpoint): not a success for the scheduler,
        # whose `afterok` dependencies would start on it
        status=$(( 128 + $(kill -l "$SIGNALLED") ))
        say "stopped before its end by SIG$SIGNALLED: exit status $status"
    fi
elif (( status == 0 )) && makes_a_run "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]] &&
        STOPPED=$("$PYTHON" -m hpcvla.job.restarts stopped "$JOB_RUN") &&
        [[ -n $STOPPED ]]; then
    # the ranks stopped on a signal this shell never got (`scancel --signal` without
    # --batch, `--signal=USR1@..` without B:), their run short of its end: no success
    status=$(( 128 + $(kill -l TERM) ))
    say "the ranks stopped on a signal to them alone, the run short of its end (continue it" \
        "with run.resume=$STOPPED): exit status $status"
fi
exit "$status"
}
