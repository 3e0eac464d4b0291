#!/usr/bin/env bash
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
# activate the Python environment, set one BLAS/OpenMP thread pool size per rank, run the
# ranks, and pass the scheduler's signals on to them as SIGTERM (ranks stop cleanly). SIGUSR1
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
#                     host and across hosts (OMPI_MCA_osc=sm,ucx; src/hpcvla/process/mpi_select.py)
#   HPCVLA_LAUNCHER   srun | mpiexec (default: mpiexec, but srun for Open MPI under Slurm;
#                     srun with MPICH wires up through Slurm's PMI-2 server, which breaks
#                     MPI_Init on nodes with many network devices: src/hpcvla/process/mpi_select.py)
#   HPCVLA_SRUN_MPI   srun's PMI plugin (default: pmi2 for MPICH, pmix for Open MPI)
#   HPCVLA_THREADS    threads per rank (default: the scheduler's CPUs per task, else the
#                     node's allocated (or all) cores / ranks per node, at least 1)
#   HPCVLA_RANKS      ranks to start outside any job (default 4); inside a job the
#                     allocation decides
#   HPCVLA_JOB_RUNS   train, sft: run root of this job (run.root); when it already holds a
#                     run with a checkpoint short of its end (the job was requeued or rerun),
#                     that run is continued (run.resume)
#   HPCVLA_REQUEUE    1: requeue the Slurm job after the time-limit warning (SIGUSR1); with
#                     HPCVLA_JOB_RUNS (train, sft), as HPCVLA_RESTARTS and
#                     HPCVLA_END_GRACE_S
#   HPCVLA_RESTARTS   train, sft: when the world fails (a rank or a node died), start it
#                     again inside the allocation up to this many times (default 0): on the
#                     nodes that still start a process, from the newest checkpoint (Slurm jobs
#                     need --no-kill to keep their allocation when a node fails)
#   HPCVLA_END_GRACE_S  train, sft: a world whose ranks on this node died without finishing is
#                     ended this many seconds later if its launcher has not ended it (default
#                     30; after a node failure mpiexec/srun wait for the scheduler to declare
#                     the node down, minutes)
#   HPCVLA_AUTOPLAN   train: lay the run out as `hpcvla plan --auto --costs COSTS` finds best
#                     for the job's nodes (the scale model; its overrides follow the config's),
#                     at the start and at every restart. COSTS: config (the reach env probed,
#                     or the config's emulate.*), balanced, table3, pi0-libero; unset: off
#   HPCVLA_DOCTOR     train, sft: 0 skips `hpcvla doctor` on the first node (default 1)
#   HPCVLA_PBS_TM     PBS: 1 (default) starts the MPI launcher's processes on the other nodes
#                     through PBS's own `pbs_tmrsh` (TM) where the job finds one, 0 through ssh
#   HPCVLA_DRY_RUN    1: work out the launch (MPI, threads, the run it resumes, the auto plan)
#                     and print it and the command, but start no rank
set -euo pipefail

die() { echo "launch.sh: error: $*" >&2; exit 2; }
say() { echo "launch.sh $(date +%H:%M:%S): $*" >&2; }
# A signal while no world runs (the time-limit warning may come up to a minute early, a cancel
# during the node checks or between restarts) is remembered, not fatal: run_world then starts
# no world, and the job ends as one stopped by it.
EARLY=""
remember_signals() { trap 'EARLY=TERM' TERM; trap 'EARLY=INT' INT; trap 'EARLY=USR1' USR1; }
remember_signals

HPCVLA_ROOT=${HPCVLA_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export HPCVLA_ROOT
[[ $# -ge 1 ]] || die "usage: launch.sh COMMAND [ARGS...]   (e.g. train configs/default.yaml)"

# ---- scheduler, hosts, ranks ---------------------------------------------------------------
if [[ -n ${PBS_JOBID:-} && -n ${PBS_NODEFILE:-} ]]; then
    SCHEDULER=pbs
elif [[ -n ${SLURM_JOB_ID:-} ]]; then
    SCHEDULER=slurm
elif [[ -n ${PBS_JOBID:-} ]]; then
    die "PBS job $PBS_JOBID has no PBS_NODEFILE: cannot tell which nodes to use"
else
    SCHEDULER=none
fi

case $SCHEDULER in
    slurm)
        mapfile -t HOSTS < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")
        [[ -n ${SLURM_NTASKS:-} ]] || die "Slurm job without a task count: ask for tasks, " \
            "e.g. #SBATCH --ntasks-per-node=4"
        NP=$SLURM_NTASKS
        # SLURM_TASKS_PER_NODE is "8(x3)" when uniform; "8(x2),7" means uneven nodes.
        [[ ${SLURM_TASKS_PER_NODE:-$NP} =~ ^[0-9]+(\(x[0-9]+\))?$ ]] || die "nodes hold " \
            "different numbers of tasks (SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE): ask " \
            "for --ntasks-per-node instead of --ntasks"
        ;;
    pbs)
        [[ -r $PBS_NODEFILE ]] || die "PBS_NODEFILE=$PBS_NODEFILE is not readable"
        mapfile -t HOSTS < <(awk 'NF && !seen[$1]++ {print $1}' "$PBS_NODEFILE")
        NP=$(awk 'NF' "$PBS_NODEFILE" | wc -l)
        counts=$(awk 'NF {n[$1]++} END {for (h in n) print n[h]}' "$PBS_NODEFILE" | sort -u)
        [[ $counts =~ ^[0-9]+$ ]] || die "nodes hold different numbers of ranks in " \
            "$PBS_NODEFILE: ask for the same mpiprocs on every chunk (select=N:mpiprocs=M)"
        ;;
    none)
        HOSTS=("$(hostname)")
        NP=${HPCVLA_RANKS:-4}
        ;;
esac
NODES=${#HOSTS[@]}
(( NODES >= 1 && NP >= NODES && NP % NODES == 0 )) || die "$NP ranks cannot be spread " \
    "evenly over $NODES node(s) (${HOSTS[*]})"
PER_NODE=$(( NP / NODES ))
if [[ $SCHEDULER != none ]]; then
    # What each rank checks its MPI world against: inside Hydra's proxy steps SLURM_NTASKS
    # counts the proxies, not the job's tasks.
    export HPCVLA_JOB_RANKS=$NP
fi

JOB_ID=${SLURM_JOB_ID:-${PBS_JOBID:-0}}

# ---- environment ---------------------------------------------------------------------------
activate() {  # activation scripts read unset variables: not under `set -u`
    set +u
    # shellcheck disable=SC1090,SC1091
    source "$@"
    set -u
}
if [[ -n ${HPCVLA_CONDA_ENV:-} ]]; then
    command -v conda > /dev/null || die "HPCVLA_CONDA_ENV=$HPCVLA_CONDA_ENV but no conda " \
        "on PATH (module load conda?)"
    set +u
    eval "$(conda shell.bash hook)"
    conda activate "$HPCVLA_CONDA_ENV"
    set -u
elif [[ -n ${HPCVLA_VENV:-} ]]; then
    [[ -f $HPCVLA_VENV/bin/activate ]] || die "HPCVLA_VENV=$HPCVLA_VENV is not a venv"
    activate "$HPCVLA_VENV/bin/activate"
elif [[ -f $HPCVLA_ROOT/.venv/bin/activate ]]; then
    activate "$HPCVLA_ROOT/.venv/bin/activate"
fi
PYTHON=$(command -v python3 || command -v python) || die "no python on PATH"
"$PYTHON" -c "import hpcvla, mpi4py" 2> /dev/null || die "$PYTHON cannot import hpcvla " \
    "and mpi4py: run \`make install\` in $HPCVLA_ROOT, or set HPCVLA_VENV/HPCVLA_CONDA_ENV"
# The MPI: exports MPI4PY_LIBMPI and OMPI_MCA_osc for Open MPI, HPCVLA_MPI_FLAVOUR,
# HPCVLA_MPIEXEC, HPCVLA_SRUN_MPI_DEFAULT and HPCVLA_SLURM_LAUNCHER_DEFAULT; exits naming
# the problem when none is found.
MPI_EXPORTS=$("$PYTHON" -m hpcvla.process.mpi_select "${HPCVLA_MPI:-auto}") ||
    die "no MPI to start the ranks with (HPCVLA_MPI=${HPCVLA_MPI:-auto}: the reason above)"
eval "$MPI_EXPORTS"

# ---- threads per rank ----------------------------------------------------------------------
if [[ -n ${HPCVLA_THREADS:-} ]]; then
    THREADS=$HPCVLA_THREADS
elif [[ $SCHEDULER == slurm && -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    THREADS=$SLURM_CPUS_PER_TASK
elif [[ $SCHEDULER == slurm && -n ${SLURM_CPUS_ON_NODE:-} ]]; then  # this node's share
    THREADS=$(( SLURM_CPUS_ON_NODE / PER_NODE ))
elif [[ $SCHEDULER == pbs && -n ${NCPUS:-} ]]; then  # PBS Pro: ncpus of this chunk
    THREADS=$(( NCPUS / PER_NODE ))
else
    THREADS=$(( $(nproc) / PER_NODE ))
fi
(( THREADS >= 1 )) || THREADS=1
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS

# ---- the command ---------------------------------------------------------------------------
# The run of this job that a restart continues: the newest run directory under $1, if its
# newest checkpoint is short of the run's end (total_updates; sft.steps; nothing if it is done
# or has none).
resumable_run() { "$PYTHON" -m hpcvla.job.restarts resumable "$1"; }
# The commands whose ranks are one MPI world started here, one per allocated task.
in_a_world() { [[ $1 == train || $1 == sft || $1 == eval ]]; }
# The commands that make a run, which a requeued or rerun job continues from its checkpoint,
# and a failed world's restart inside the allocation too.
makes_a_run() { [[ $1 == train || $1 == sft ]]; }
# What a run's checkpoints are numbered by (train's policy versions, `hpcvla sft`'s steps), and
# the setting that makes them.
point_name() { [[ $1 == sft ]] && echo "SFT step" || echo "policy version"; }
interval_name() { [[ $1 == sft ]] && echo sft.checkpoint_every || echo learner.checkpoint_every; }

# PBS's start of a process on another node of the job (TM, by `pbs_tmrsh`, an rsh): what it
# starts is the job's (ended with it, accounted, in its cgroup), and the nodes need not accept
# ssh from each other. Without it (Torque, HPCVLA_PBS_TM=0): ssh.
PBS_RSH=""
if [[ $SCHEDULER == pbs && ${HPCVLA_PBS_TM:-1} == 1 ]]; then
    PBS_RSH=$(command -v pbs_tmrsh || true)
fi

# Run a shell command on a node of the job within 30 s (false if it did not start or failed).
# Under PBS this node runs it itself, as Hydra does its own ranks: a node need not accept ssh
# from itself (PBS_NODEFILE names it localhost, or by its name with or without the domain).
on_node() {  # HOST SHELL_COMMAND
    case $SCHEDULER in
        slurm) timeout 30 srun --overlap --nodes=1 --ntasks=1 --nodelist="$1" --mpi=none \
                   sh -c "$2" ;;
        pbs) if [[ $1 == localhost || ${1%%.*} == "$(hostname -s)" ]]; then
                 sh -c "$2"
             else
                 timeout 30 "${PBS_RSH:-ssh}" "$1" "$2"
             fi ;;
        none) sh -c "$2" ;;
    esac
}
# After a failed world (and, where srun launches, before a requeued job's first), on every node
# of HOSTS at once:
# remove the MPICH segments its killed ranks left in /dev/shm and its Hydra proxies' topology
# files in /tmp (hpcvla.job.segments), saying so on stderr, and print the nodes that ran it
# within 30 s, in HOSTS' order: a restart's nodes.
# A dead node costs its 30 s once, not per node. A node answers as long as it starts a
# process: a cleanup that fails there (ssh passes no environment) is said, not taken for a
# dead node.
clean_nodes() {  # run in a subshell: its `wait` waits for the nodes alone
    local host answers clean
    answers=$(mktemp -d)
    clean="$(printf '%q' "$PYTHON") -m hpcvla.job.segments remove-orphans 2>&1 ||
        echo \"\$(hostname): could not remove the failed world's MPICH leftovers (above)\""
    for host in "${HOSTS[@]}"; do
        { on_node "$host" "$clean" > "$answers/$host.out" 2> /dev/null &&
              touch "$answers/$host"; } &
    done
    wait
    for host in "${HOSTS[@]}"; do
        [[ -s $answers/$host.out ]] && cat "$answers/$host.out" >&2
        [[ -e $answers/$host ]] && echo "$host"
    done
    rm -rf "$answers"
}

ARGS=("$@")
COMMAND_ARGS=("$@")
set_command() {  # ARGS and COMMAND: the command, the job's run root, a resumable run
    ARGS=("${COMMAND_ARGS[@]}")
    if makes_a_run "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]]; then
        # The job's own run root: a requeued (Slurm) or rerun (PBS) job, or a restart after a
        # failure, finds the run an earlier start made there and continues it from its
        # checkpoint.
        ARGS+=("run.root=$HPCVLA_JOB_RUNS")
        RESUME=$(resumable_run "$HPCVLA_JOB_RUNS")
        if [[ -n $RESUME ]]; then
            say "continuing $RESUME from its newest checkpoint"
            ARGS+=("run.resume=$RESUME")
        fi
    fi
    if [[ $1 == train && -n ${HPCVLA_AUTOPLAN:-} ]]; then
        local best
        best=$("$PYTHON" -m hpcvla.job.restarts auto "${COMMAND_ARGS[@]:1}" --world "$NP" \
                --ranks-per-node "$PER_NODE" --costs "$HPCVLA_AUTOPLAN") ||
            die "hpcvla plan --auto found no layout for $NP rank(s) on $NODES node(s)"
        mapfile -t AUTO <<< "$best"
        ARGS+=("${AUTO[@]}")
        say "auto plan ($HPCVLA_AUTOPLAN costs) for $NP rank(s) on $NODES node(s): ${AUTO[*]}"
    fi
    COMMAND=("$PYTHON" -m mpi4py -m hpcvla "${ARGS[@]}")
    in_a_world "$1" || COMMAND=("$PYTHON" -m hpcvla "${ARGS[@]}")
}

set_launch() {  # LAUNCH and CLEAN_ENV: how to start NP ranks on HOSTS, PER_NODE each
    CLEAN_ENV=()
    if ! in_a_world "$1"; then  # starts its own worlds (bench modes) or no MPI
        LAUNCH=()
    elif [[ ${HPCVLA_LAUNCHER:-$([[ $SCHEDULER == slurm ]] && echo "$HPCVLA_SLURM_LAUNCHER_DEFAULT" ||
            echo mpiexec)} == srun ]]; then
        # pmi2: MPICH (PyPI or Debian) wires up through it; with a wrong plugin every rank
        # starts as its own 1-rank world (hpcvla then stops: launch.check_scheduler).
        # Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: pass it on.
        local nodes
        nodes=$(IFS=,; echo "${HOSTS[*]}")
        LAUNCH=(srun --mpi="${HPCVLA_SRUN_MPI:-$HPCVLA_SRUN_MPI_DEFAULT}" --kill-on-bad-exit=1 --ntasks="$NP"
                --ntasks-per-node="$PER_NODE" --distribution=block --nodes="$NODES" --nodelist="$nodes"
                ${SLURM_CPUS_PER_TASK:+"--cpus-per-task=$SLURM_CPUS_PER_TASK"} ${OVERLAP:+--overlap})
    else
        local host
        if [[ $HPCVLA_MPI_FLAVOUR == openmpi ]]; then
            for host in "${HOSTS[@]}"; do echo "$host slots=$PER_NODE"; done > "$HOSTFILE"
            LAUNCH=("$HPCVLA_MPIEXEC" -n "$NP" --hostfile "$HOSTFILE" --map-by "ppr:$PER_NODE:node"
                    ${PBS_RSH:+--mca plm_rsh_agent "$PBS_RSH"})
        else  # MPICH's Hydra (and derivatives): host:ranks, filled in block order
            for host in "${HOSTS[@]}"; do echo "$host:$PER_NODE"; done > "$HOSTFILE"
            LAUNCH=("$HPCVLA_MPIEXEC" -n "$NP" -f "$HOSTFILE"
                    ${PBS_RSH:+-launcher rsh -launcher-exec "$PBS_RSH"})
        fi
        if [[ $SCHEDULER == slurm ]]; then
            # Hydra starts one proxy per node as a 1-task-per-node srun step, which forks that
            # node's ranks: the step must hold the node's CPUs (srun would give it one per
            # task), and sbatch's tasks-per-node would contradict its 1 task per node.
            LAUNCH=(env -u SLURM_NTASKS_PER_NODE ${OVERLAP:+HYDRA_LAUNCHER_EXTRA_ARGS=--overlap}
                    "SRUN_CPUS_PER_TASK=${SLURM_CPUS_ON_NODE:-$(( PER_NODE * THREADS ))}" "${LAUNCH[@]}")
            if [[ $HPCVLA_MPI_FLAVOUR != openmpi ]]; then
                # Hydra passes its own environment to every rank, over each proxy's: the
                # batch node's GPUs would be every node's. Without them each node's ranks
                # keep what Slurm gave their node's step (Open MPI's mpirun forks its own
                # node's ranks and passes the others none: forwarded_env).
                LAUNCH=(env -u CUDA_VISIBLE_DEVICES -u ROCR_VISIBLE_DEVICES -u HIP_VISIBLE_DEVICES
                        -u GPU_DEVICE_ORDINAL "${LAUNCH[@]}")
            fi
        elif [[ $SCHEDULER == pbs ]]; then
            # A PBS layer on top of Slurm (as in tests/local_slurm.py) leaves Slurm's variables
            # in the job: Hydra would then start its proxies as 1-task srun steps, and the ranks
            # would check themselves against Slurm's counts. A PBS job's ranks see PBS only.
            mapfile -t slurm_vars < <(compgen -e | grep '^SLURM_' || true)
            CLEAN_ENV=(env "${slurm_vars[@]/#/--unset=}")
        fi
    fi
}

HOSTFILE=$(mktemp "${TMPDIR:-/tmp}/hpcvla-hosts.XXXXXX")
trap 'rm -f "$HOSTFILE"' EXIT
# After a node failure the failed world's step never completes (its dead node cannot say so)
# and holds its CPUs on the nodes left: a restart's steps must share them (srun --overlap).
OVERLAP=""
set_command "$1"
set_launch "$1"
say "scheduler $SCHEDULER, job $JOB_ID: $NP rank(s) on $NODES node(s)" \
    "(${HOSTS[*]}), $PER_NODE per node, $THREADS thread(s) per rank"
say "python: $PYTHON, MPI: $HPCVLA_MPI_FLAVOUR ($HPCVLA_MPIEXEC)"
say "running: ${LAUNCH[*]} ${COMMAND[*]}${CLEAN_ENV[*]:+ (without SLURM_* variables)}"
# A node that lacks what the job needs, or a layout that overfills its memory, fails the job
# here, in seconds, saying why (this node: the job's first; the others answer clean_nodes
# before a restart). It checks the command's settings as they run: the auto plan's included.
DOCTOR=()
if makes_a_run "$1" && [[ ${HPCVLA_DOCTOR:-1} == 1 ]]; then
    DOCTOR=("$PYTHON" -m hpcvla doctor --job "$1" --world "$NP" --ranks-per-node "$PER_NODE"
            "${ARGS[@]:1}")
    say "checking this node: ${DOCTOR[*]}"
fi
if [[ ${HPCVLA_DRY_RUN:-0} == 1 ]]; then
    exit 0
fi
if (( ${#DOCTOR[@]} )); then
    "${DOCTOR[@]}" >&2 || die "this node ($(hostname)) lacks what the job needs (hpcvla doctor, above)"
fi

# A restart continues from the run's newest checkpoint: without periodic ones there is none.
if makes_a_run "$1" && [[ ${HPCVLA_RESTARTS:-0} != 0 && -n ${HPCVLA_JOB_RUNS:-} ]] && [[ $(
        "$PYTHON" -m hpcvla.job.restarts checkpoint-every "$1" "${COMMAND_ARGS[@]:1}" \
        2>/dev/null) == 0 ]]; then
    say "HPCVLA_RESTARTS=$HPCVLA_RESTARTS, but $(interval_name "$1") is 0: a world that fails" \
        "has no checkpoint to continue from and is not restarted (set $(interval_name "$1")=K:" \
        "a restart then loses at most K $(point_name "$1")s)"
fi

# ---- run, forwarding the scheduler's signals -----------------------------------------------
if [[ $SCHEDULER == slurm && ${LAUNCH[0]:-} == srun && ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
    # A requeued job's steps get the ids of the killed ones again, and MPICH names its
    # shared-memory segments after them: a segment a killed rank left behind would be
    # joined by the new ranks (they hang or abort in MPI_Init). Remove this user's
    # segments that no process maps any more, on every node.
    mapfile -t answered < <(clean_nodes)
    (( ${#answered[@]} == NODES )) || say "could not remove the killed ranks' MPICH" \
        "segments on every node: answering ${answered[*]:-none} of ${HOSTS[*]}"
fi

# The batch shell gets the signals; the ranks must get SIGTERM to stop cleanly, and as long
# as they need: under srun it goes to the job's steps only (`scancel --signal`; signalling
# srun itself would make it kill the step after KillWait), mpiexec forwards it itself.
# SIGUSR1 is the time-limit warning (#SBATCH --signal=B:USR1@<grace>): after it the job
# requeues itself (HPCVLA_REQUEUE=1) to resume later. SIGTERM/SIGINT (scancel, qdel,
# preemption, which requeues on its own) only stop the ranks.
SIGNALLED=""
# shellcheck disable=SC2317  # called from the traps below
forward() {
    SIGNALLED=$1
    say "received SIG$1: sending SIGTERM to the ranks"
    if [[ ${LAUNCH[0]:-} == srun ]]; then
        scancel --signal=TERM "$SLURM_JOB_ID" || true
    else
        kill -TERM "$STEP" 2> /dev/null || true
    fi
}
# A world whose ranks here failed and that has not ended HPCVLA_END_GRACE_S later is ended:
# after a node failure, mpiexec and srun wait for the dead node until the scheduler declares
# it down (Slurm's SlurmdTimeout, 5 minutes by default) while the ranks left aborted long ago.
end_a_failed_world() {  # PID of the world's launcher; run in the background
    local failure grace=${HPCVLA_END_GRACE_S:-30}
    failure=$("$PYTHON" -m hpcvla.process.deathwatch first-failure "$HPCVLA_RANK_DIR" "$1") || return 0
    say "$failure"  # now: the MPI launcher's own report may name another rank
    sleep "$grace"
    kill -0 "$1" 2> /dev/null || return 0
    say "$failure, and the world has not ended $grace s later: ending its launcher"
    kill -TERM "$1" 2> /dev/null || true
    sleep 5
    kill -KILL "$1" 2> /dev/null || true
}
forwarded_env() {  # the MPI launcher's options: what it passes to the ranks on other nodes
    # The job's variables, as srun (--export=ALL) does, but for what is each node's own (its
    # GPUs, its scheduler and launcher variables). Open MPI's mpirun gives those ranks only
    # OMPI_* (ssh or PBS's TM start them with a login's environment): `-x NAME` each.
    # MPICH's Hydra passes its whole environment over each proxy's (-genvall): under PBS,
    # whose nodes' processes get their own node's GPUs (its cgroup hook; TM's tasks too),
    # the batch node's would be every node's. There it passes the list (-genvlist); its own
    # node's ranks inherit them from the proxy it forks here.
    local name names=()
    for name in $(compgen -e); do
        [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
        [[ $name =~ ^(CUDA_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|DISPLAY|TERM|TMUX|SLURM_.*|SLURMD_.*|PBS_.*|OMPI_.*|PMIX_.*|PMI_.*|HYDRA_.*|SSH_.*)$ ]] &&
            continue
        names+=("$name")
    done
    if [[ $HPCVLA_MPI_FLAVOUR == openmpi ]]; then
        printf -- '-x\n%s\n' "${names[@]}"
    else
        printf -- '-genvlist\n%s\n' "$(IFS=,; echo "${names[*]}")"
    fi
}
run_world() {  # start the ranks, forward signals while they run; sets `status`
    if [[ -n $EARLY ]]; then
        SIGNALLED=$EARLY status=0 NO_WORLD=1
        say "received SIG$EARLY before the ranks started: starting none"
        return
    fi
    if makes_a_run "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]]; then
        # Every rank leaves a card (rank, role, node, host, pid) here: if one dies without a
        # word (kill -9, OOM), srun names its task number and the cards say what it was.
        export HPCVLA_RANK_DIR=$HPCVLA_JOB_RUNS/.ranks
        rm -rf "$HPCVLA_RANK_DIR" && mkdir -p "$HPCVLA_RANK_DIR"
    fi
    # the ranks time their start and stop from here (summary.json's phases_s)
    HPCVLA_LAUNCHED_AT=$(date +%s.%N)
    export HPCVLA_LAUNCHED_AT
    local exports=()
    if [[ " ${LAUNCH[*]} " == *" $HPCVLA_MPIEXEC "* ]] &&
            [[ $HPCVLA_MPI_FLAVOUR == openmpi || $SCHEDULER == pbs ]]; then
        mapfile -t exports < <(forwarded_env)  # now: the world's own variables are set
    fi
    "${CLEAN_ENV[@]}" "${LAUNCH[@]}" ${exports[@]+"${exports[@]}"} "${COMMAND[@]}" &
    STEP=$!
    trap 'forward TERM' TERM
    trap 'forward INT' INT
    trap 'forward USR1' USR1
    if [[ -n $EARLY ]]; then  # it came as the world started, before these traps
        forward "$EARLY"
        EARLY=""
    fi
    local ender=""
    if [[ -n ${HPCVLA_RANK_DIR:-} ]]; then
        end_a_failed_world "$STEP" &
        ender=$!
    fi
    status=0
    while true; do  # `wait` returns early when a trapped signal arrives: wait again
        wait "$STEP" && status=0 || status=$?
        kill -0 "$STEP" 2> /dev/null || break
    done
    remember_signals
    if [[ -n $ender ]]; then
        kill "$ender" 2> /dev/null || true  # its deathwatch sees the launcher gone and ends
        wait "$ender" 2> /dev/null || true
    fi
    if [[ -n ${HPCVLA_RANK_DIR:-} ]]; then
        if [[ $status != 0 && -z $SIGNALLED ]]; then
            "$PYTHON" -m hpcvla.process.deathwatch describe "$HPCVLA_RANK_DIR" || true
        fi
        rm -rf "$HPCVLA_RANK_DIR"
    fi
}

# The overrides (FIT) that lay the run out on the NP ranks of the nodes left by the config's
# placement rules: fewer cells, and fewer learners (the others spare) where there are fewer
# producers than learner ranks; then the whole plan checked (`hpcvla plan`, memory included:
# LAYOUT). False, saying why, when nothing fits.
fit_to_nodes() {
    local fit
    FIT=()
    LAYOUT=""
    if ! fit=$("$PYTHON" -m hpcvla.job.restarts fit "${COMMAND_ARGS[@]:1}" --world "$NP" \
            --ranks-per-node "$PER_NODE" 2>&1); then
        printf '%s\n' "$fit" >&2
        return 1
    fi
    read -ra FIT <<< "$fit"
    if ! LAYOUT=$("$PYTHON" -m hpcvla plan "${COMMAND_ARGS[@]:1}" "${FIT[@]}" \
            --world "$NP" --ranks-per-node "$PER_NODE" 2>&1); then
        printf '%s\n' "$LAYOUT" >&2
        return 1
    fi
}

# A failed world (a rank or a node died; not a signal) is started again inside the allocation
# up to HPCVLA_RESTARTS times: on the nodes that still start a process, with as many ranks per
# node as before, laid out on them (train: fit_to_nodes, or the auto plan; sft: all learners),
# continuing from the newest checkpoint (any learner count and ZeRO stage resumes it). Not
# when the run has no checkpoint yet (a new world would start it over, in a new run
# directory), nor when the failure recurs before a newer checkpoint exists: that is no node
# failure, and trying again would not end.
restarts_left=${HPCVLA_RESTARTS:-0}
failed_at=""
LAYOUT=""
while true; do
    run_world "$1"
    [[ $status != 0 && -z $SIGNALLED ]] || break
    say "the world failed (status $status) at $(date -u +%H:%M:%S); checking the nodes"
    checked_at=$SECONDS
    mapfile -t usable < <(clean_nodes)
    say "$(( SECONDS - checked_at )) s to check the nodes; answering: ${usable[*]:-none}"
    if ! makes_a_run "$1" || [[ -z ${HPCVLA_JOB_RUNS:-} ]]; then break; fi
    if (( restarts_left <= 0 )); then
        (( ${HPCVLA_RESTARTS:-0} == 0 )) ||
            say "no restarts left (HPCVLA_RESTARTS=$HPCVLA_RESTARTS)"
        break
    fi
    version=$("$PYTHON" -m hpcvla.job.restarts newest-version "$HPCVLA_JOB_RUNS")
    if (( version < 0 )); then  # a new world would start the run over, in a new directory
        say "the run has no checkpoint to continue from ($(interval_name "$1")): not" \
            "restarting"
        break
    fi
    if [[ -z $("$PYTHON" -m hpcvla.job.restarts resumable "$HPCVLA_JOB_RUNS") ]]; then
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
    NP=$(( NODES * PER_NODE ))
    export HPCVLA_JOB_RANKS=$NP
    # (sft: learners only, as many as there are; the auto plan: set_command lays them out)
    if [[ $1 == train && -z ${HPCVLA_AUTOPLAN:-} ]]; then
        if ! fit_to_nodes; then
            say "the run does not fit the $NODES node(s) left (${HOSTS[*]}): not restarting"
            break
        fi
        if (( ${#FIT[@]} )); then  # the restarts after this one start from it
            COMMAND_ARGS+=("${FIT[@]}")
            say "fewer producers than learner ranks on the nodes left: ${FIT[*]}"
        fi
    fi
    restarts_left=$(( restarts_left - 1 ))
    OVERLAP=1
    say "restart $(( HPCVLA_RESTARTS - restarts_left ))/$HPCVLA_RESTARTS:" \
        "dropped node(s): ${dropped[*]:-none}; $NP rank(s) on $NODES node(s) (${HOSTS[*]})," \
        "from $(point_name "$1") $version"
    say "restart record: $("$PYTHON" -m hpcvla.job.restarts record "$HPCVLA_JOB_RUNS" "$status" \
        "${dropped[*]}" "${HOSTS[*]}" "$NP")"
    [[ -z $LAYOUT ]] || printf '%s\n' "$LAYOUT" | head -n 3 >&2
    set_command "$1"
    set_launch "$1"
    say "running: ${LAUNCH[*]} ${COMMAND[*]}"
done

if [[ -n $SIGNALLED ]]; then
    say "ranks exited with status $status after SIG$SIGNALLED"
    if [[ $SIGNALLED == USR1 && ${HPCVLA_REQUEUE:-0} == 1 && $SCHEDULER == slurm &&
            -n ${HPCVLA_JOB_RUNS:-} && -n $(resumable_run "$HPCVLA_JOB_RUNS") ]]; then
        say "requeueing job $SLURM_JOB_ID (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
        scontrol requeue "$SLURM_JOB_ID"
    elif (( status == 0 )) && { ! makes_a_run "$1" || [[ -n ${NO_WORLD:-} ||
            -z ${HPCVLA_JOB_RUNS:-} || -n $(resumable_run "$HPCVLA_JOB_RUNS") ||
            $("$PYTHON" -m hpcvla.job.restarts newest-version "$HPCVLA_JOB_RUNS") -lt 0 ]]; }; then
        # stopped short of its end (with its checkpoint): not a success for the scheduler,
        # whose `afterok` dependencies would start on it
        status=$(( 128 + $(kill -l "$SIGNALLED") ))
        say "stopped before its end by SIG$SIGNALLED: exit status $status"
    fi
fi
exit "$status"
