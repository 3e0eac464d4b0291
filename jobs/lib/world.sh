# shellcheck shell=bash
# Sourced by jobs/launch.sh: starting a world of NP ranks on HOSTS, watching it and ending
# it: a command on one node (on_node), on every other node before the first world
# (check_other_nodes, until_signalled) and on every node after a failure (clean_nodes), the
# MPI launcher's command line (set_launch), the scheduler's signals passed on as SIGTERM
# (forward) and a failed world's end (end_a_failed_world), the variables passed to other
# nodes' ranks (forwarded_env), and the run itself (run_world, which sets `status` and
# NEVER_STARTED). Uses launch.sh's say, in_a_world, makes_a_run, remember_signals and the
# allocation's variables.

# PBS's start of a process on another node of the job (TM, by `pbs_tmrsh`): what it starts is
# the job's (ended with it, accounted, in its cgroup), and the nodes need not accept ssh from
# each other. It runs no shell, so the launchers take it through jobs/lib/tmrsh, an rsh.
# Without it (Torque, HPCVLA_PBS_TM=0): ssh.
PBS_RSH=""
if [[ $SCHEDULER == pbs && ${HPCVLA_PBS_TM:-1} == 1 ]] &&
        HPCVLA_PBS_TMRSH=$(command -v pbs_tmrsh); then
    export HPCVLA_PBS_TMRSH
    PBS_RSH=$LIB/tmrsh
fi

# Run a shell command on a node of the job within LIMIT seconds (default HPCVLA_NODE_CHECK_S,
# 60; false if it did not start or failed).
# Under PBS this node runs it itself, as Hydra does its own ranks: a node need not accept ssh
# from itself (PBS_NODEFILE names it localhost, or by its name with or without the domain).
# bash reads it, over ssh too (from its stdin: ssh hands a command line to the user's login
# shell, which may be csh or a POSIX sh): its callers quote by printf %q, whose $'..' (a tab
# or a newline in an override) only bash reads.
# Whether HOST names this node: localhost, or its name with or without the domain (its short
# name asked once: other_nodes asks of every host).
this_node() {  # HOST
    [[ $1 == localhost || ${1%%.*} == "${THIS_NODE:=$(hostname -s)}" ]]
}
on_node() {  # HOST SHELL_COMMAND [LIMIT]
    local limit=${3:-${HPCVLA_NODE_CHECK_S:-60}}
    case $SCHEDULER in
        slurm) timeout "$limit" srun --overlap --nodes=1 --ntasks=1 --nodelist="$1" --mpi=none \
                   bash -c "$2" ;;
        pbs) if this_node "$1"; then
                 timeout "$limit" bash -c "$2"
             elif [[ -n $PBS_RSH ]]; then
                 timeout "$limit" "$PBS_RSH" "$1" "$2"
             else  # a host key or password prompt would take the whole limit: none
                 timeout "$limit" ssh -o BatchMode=yes "$1" bash -s <<< "$2"
             fi ;;
        none) timeout "$limit" bash -c "$2" ;;
    esac
}
# SHELL_COMMAND on each HOST at once within LIMIT seconds (on_node): its stdout into
# DIR/HOST, its stderr into DIR/HOST.err and its exit status into DIR/HOST.status (caught,
# not ended on: launch.sh's `set -e` reaches the background group). A dead node costs the
# limit once, not per node. Its callers run in a subshell: `wait` waits for the nodes alone.
on_each_node() {  # DIR LIMIT SHELL_COMMAND HOST...
    local dir=$1 limit=$2 command=$3 host
    shift 3
    for host in "$@"; do
        { code=0
          on_node "$host" "$command" "$limit" > "$dir/$host" 2> "$dir/$host.err" || code=$?
          echo "$code" > "$dir/$host.status"; } &
    done
    wait
}

# After a failed world (and before a requeued job's first), on every node of HOSTS at once:
# remove the MPI segments its killed ranks left in /dev/shm and its Hydra proxies' topology
# files in /tmp (hpcvla.job.leftovers), saying so on stderr, and print the nodes that ran it
# within HPCVLA_NODE_CHECK_S, in HOSTS' order: a restart's nodes. A node answers as long as
# it starts a process: a cleanup that fails there (ssh passes no environment) is said, not
# taken for a dead node.
clean_nodes() {  # run in a subshell
    local host answers clean
    answers=$(mktemp -d)
    clean="$(printf '%q' "$PYTHON") -m hpcvla.job.leftovers remove-orphans 2>&1 ||
        echo \"\$(hostname): could not remove the failed world's MPI leftovers (above)\""
    on_each_node "$answers" "${HPCVLA_NODE_CHECK_S:-60}" "$clean" "${HOSTS[@]}"
    for host in "${HOSTS[@]}"; do  # what the cleanup said (a dead node's launcher: not)
        [[ -s $answers/$host ]] && cat "$answers/$host" >&2
        [[ $(< "$answers/$host.status") == 0 ]] && echo "$host"
    done
    rm -rf "$answers"
}

# COMMAND in the background, waited for until it ends or a signal is remembered (launch.sh's
# remember_signals sets EARLY): bash runs a trap only once a foreground command has returned,
# so a check of minutes in the foreground would hold a cancel, or the time limit's warning,
# that long. After a signal (one before the call too: COMMAND is not started) COMMAND and
# every process under it (srun, ssh, timeout) are sent SIGTERM, then SIGKILL 5 s later, and it
# returns 1: the job ends as one stopped.
until_signalled() {  # COMMAND...: COMMAND's exit status, or 1 after a signal
    local pid code tree=() alive=() p
    [[ -z $EARLY ]] || return 1
    "$@" &
    pid=$!
    while :; do
        code=0
        # (a signal trapped between the fork and here: EARLY is set, and no wait)
        [[ -n $EARLY ]] || wait "$pid" || code=$?
        if [[ -n $EARLY ]]; then
            say "received SIG$EARLY: ending the checks (${*:1:3} ...), which would hold it"
            mapfile -t tree < <(process_tree "$pid")
            kill -TERM "${tree[@]}" 2> /dev/null || true
            for _ in 1 2 3 4 5 6 7 8 9 10; do  # a hung srun or ssh: killed 5 s later
                alive=()
                for p in "${tree[@]}"; do
                    kill -0 "$p" 2> /dev/null && alive+=("$p")
                done
                (( ${#alive[@]} )) || break
                sleep 0.5
            done
            (( ${#alive[@]} == 0 )) || kill -KILL "${alive[@]}" 2> /dev/null || true
            wait "$pid" 2> /dev/null || true
            return 1
        fi
        kill -0 "$pid" 2> /dev/null || return "$code"  # ended (else: another trap's signal)
    done
}
process_tree() {  # PID: it and every process under it, parents first
    local child
    echo "$1"
    for child in $(ps -o pid= --ppid "$1" 2> /dev/null); do process_tree "$child"; done
}

# Before the first world, on the job's nodes after its first (whose doctor passed), at once:
# `hpcvla doctor --node-only` (argv: the doctor's command), what each node has of its own
# (/dev/shm, the renderer), within HPCVLA_NODE_DOCTOR_S (default 300: the renderer's check
# imports the simulator). Each
# node whose checks failed is said with its lines; false if one did. A node that could not
# run the check (it did not answer, a launch error) is said and left to the world's start: a
# dead node there is a failed world, which HPCVLA_RESTARTS continues without it. PBS's
# pbs_tmrsh returns its command's exit status but none of its output: a doctor's exit 1
# (its checks failed) with no lines is a failed node too.
check_other_nodes() {  # run in a subshell
    local host answers command name status assignments=() failed=() checked=() others=()
    answers=$(mktemp -d)
    trap 'rm -rf "$answers"' EXIT  # ended by a signal (until_signalled) too
    command=$(printf '%q ' "$@")
    if [[ $SCHEDULER == pbs ]]; then  # ssh and TM start it in the home folder, with a login's
        # environment: the job's folder and the variables its ranks get (forwarded_names)
        for name in $(forwarded_names); do
            assignments+=("$name=${!name}")
        done
        command="cd $(printf '%q' "$PWD") && env $(printf '%q ' "${assignments[@]}")$command"
    fi
    mapfile -t others < <(other_nodes)
    on_each_node "$answers" "${HPCVLA_NODE_DOCTOR_S:-300}" "$command" "${others[@]}"
    for host in "${others[@]}"; do
        status=$(< "$answers/$host.status")
        if grep -q '^FAIL' "$answers/$host"; then
            failed+=("$host")
            sed "s/^/$host: /" "$answers/$host" "$answers/$host.err" >&2
        elif [[ -n $PBS_RSH && $status == 1 && ! -s $answers/$host && ! -s $answers/$host.err ]]
        then
            failed+=("$host")
            say "$host: its checks failed (hpcvla doctor's exit 1); their lines did not come" \
                "back (PBS's pbs_tmrsh returns a node's exit status, not its output): run" \
                "\`hpcvla doctor --node-only\` there to see them"
        elif [[ $status != 0 ]]; then
            sed "s/^/$host: /" "$answers/$host" "$answers/$host.err" >&2
            say "could not check node $host (exit status $status, above)"
        else
            checked+=("$host")
        fi
    done
    rm -rf "$answers"
    if (( ${#failed[@]} )); then
        say "node(s) ${failed[*]} lack what the job needs (above)"
        return 1
    fi
    (( ${#checked[@]} == 0 )) || say "checked nodes ${checked[*]} (hpcvla doctor --node-only)"
}

# The job's nodes but this one, whose doctor ran in full: HOSTS less the one `hostname -s`
# names (Slurm runs the batch script on the allocation's first node in its own order, which
# `scontrol show hostnames` need not share), or HOSTS after the first where none is.
other_nodes() {
    local host others=()
    for host in "${HOSTS[@]}"; do
        this_node "$host" || others+=("$host")
    done
    (( ${#others[@]} < ${#HOSTS[@]} )) || others=("${HOSTS[@]:1}")
    for host in "${others[@]}"; do echo "$host"; done
}

set_launch() {  # LAUNCH and CLEAN_ENV: how to start NP ranks on HOSTS, PER_NODE each
    CLEAN_ENV=()
    if ! in_a_world "$1"; then  # starts its own worlds (bench modes) or no MPI
        LAUNCH=()
    elif [[ ${HPCVLA_LAUNCHER:-$([[ $SCHEDULER == slurm ]] && echo "$HPCVLA_SLURM_LAUNCHER_DEFAULT" ||
            echo mpiexec)} == srun ]]; then
        # pmi2: MPICH (PyPI or Debian) wires up through it; with a wrong plugin every rank
        # starts as its own 1-rank world (hpcvla then stops: launch.check_scheduler).
        # Since Slurm 22.05 srun does not inherit sbatch's --cpus-per-task: each rank's CPUs
        # (TASK_CPUS: --cpus-per-task, else the node's share) are passed on.
        local nodes
        nodes=$(IFS=,; echo "${HOSTS[*]}")
        LAUNCH=(srun --mpi="${HPCVLA_SRUN_MPI:-$HPCVLA_SRUN_MPI_DEFAULT}" --kill-on-bad-exit=1 --ntasks="$NP"
                --ntasks-per-node="$PER_NODE" --distribution=block --nodes="$NODES" --nodelist="$nodes"
                ${TASK_CPUS:+"--cpus-per-task=$TASK_CPUS"} ${OVERLAP:+--overlap})
    else
        local host
        if [[ $HPCVLA_MPI_FLAVOUR == openmpi ]]; then
            # an Open MPI without TM takes its rsh agent as a command line ("ssh -x"): split
            # at blanks, a path with one names no program (one with TM never runs it)
            [[ $PBS_RSH != *[[:blank:]]* ]] || say "warning: the repository's path holds a" \
                "blank ($PBS_RSH): an Open MPI without TM support splits its rsh agent" \
                "(plm_rsh_agent) at blanks and cannot start the other nodes; if it fails so," \
                "run the job from a path without one (a link to it will do), or with" \
                "HPCVLA_MPI=mpich"
            for host in "${HOSTS[@]}"; do echo "$host slots=$PER_NODE"; done > "$HOSTFILE"
            LAUNCH=("$HPCVLA_MPIEXEC" -n "$NP" --hostfile "$HOSTFILE" --map-by "ppr:$PER_NODE:node"
                    ${PBS_RSH:+--mca plm_rsh_agent "$PBS_RSH"})
        else  # MPICH's Hydra (and derivatives): host:ranks, filled in block order
            for host in "${HOSTS[@]}"; do echo "$host:$PER_NODE"; done > "$HOSTFILE"
            LAUNCH=("$HPCVLA_MPIEXEC" -n "$NP" -f "$HOSTFILE"
                    ${PBS_RSH:+-launcher rsh -launcher-exec "$PBS_RSH"})
        fi
        if [[ $SCHEDULER == slurm ]]; then
            # Hydra (and Open MPI's mpirun) start one proxy per node as a 1-task-per-node srun
            # step, which forks that node's ranks: the step must hold the node's CPUs (srun
            # would give it one task's) and GPUs (a step that names none gets the job's
            # --gpus-per-task or --ntasks-per-gpu request: one task's). sbatch's per-task and
            # per-GPU options would contradict its 1 task per node. Its CPUs and GPUs go on
            # srun's command line, which every Slurm reads (SRUN_CPUS_PER_TASK only
            # 22.05-23.02), appended to what a site's MPI module set: Hydra reads
            # HYDRA_LAUNCHER_EXTRA_ARGS, Open MPI 4.x OMPI_MCA_plm_slurm_args, 5
            # PRTE_MCA_plm_slurm_args.
            local step="--cpus-per-task=${NODE_CPUS:-$(( PER_NODE * THREADS ))}"
            step+=${OVERLAP:+ --overlap}
            if [[ -n ${SLURM_GPUS_PER_TASK:-}${SLURM_NTASKS_PER_GPU:-} &&
                    -n ${SLURM_GPUS_ON_NODE:-} ]]; then  # (nodes alike: equal tasks per node)
                step+=" --gres=gpu:$SLURM_GPUS_ON_NODE"
            fi
            LAUNCH=(env -u SLURM_NTASKS_PER_NODE -u SLURM_GPUS_PER_TASK -u SLURM_NTASKS_PER_GPU
                    -u SLURM_CPUS_PER_GPU -u SLURM_MEM_PER_GPU -u SLURM_TRES_PER_TASK
                    -u SLURM_GPU_BIND
                    "HYDRA_LAUNCHER_EXTRA_ARGS=${HYDRA_LAUNCHER_EXTRA_ARGS:+$HYDRA_LAUNCHER_EXTRA_ARGS }$step"
                    "OMPI_MCA_plm_slurm_args=${OMPI_MCA_plm_slurm_args:+$OMPI_MCA_plm_slurm_args }$step"
                    "PRTE_MCA_plm_slurm_args=${PRTE_MCA_plm_slurm_args:+$PRTE_MCA_plm_slurm_args }$step"
                    "${LAUNCH[@]}")
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


# The batch shell gets the signals; the ranks must get a stop signal (SIGTERM or SIGUSR1:
# process/preempt.py) and as long as they need: under srun SIGTERM goes to the job's steps
# only (`scancel --signal`; signalling srun itself would make it kill the step after
# KillWait); MPICH's mpiexec passes SIGTERM on, Open MPI's mpirun SIGUSR1 (a SIGTERM it
# follows with SIGKILL a second later): HPCVLA_MPI_STOP_SIGNAL, from process/mpi_select.py.
# SIGUSR1 is the time-limit warning (#SBATCH --signal=B:USR1@<grace>): after it the job
# requeues itself (HPCVLA_REQUEUE=1) to resume later. SIGTERM/SIGINT (scancel, qdel,
# preemption, which requeues on its own) only stop the ranks.
SIGNALLED=""
# shellcheck disable=SC2317  # called from the traps below
forward() {
    SIGNALLED=$1
    if [[ ${LAUNCH[0]:-} == srun ]]; then
        say "received SIG$1: sending SIGTERM to the ranks"
        scancel --signal=TERM "$SLURM_JOB_ID" || true
    else
        say "received SIG$1: sending SIG$HPCVLA_MPI_STOP_SIGNAL to the ranks"
        kill -"$HPCVLA_MPI_STOP_SIGNAL" "$STEP" 2> /dev/null || true
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
# The job's variables, as srun (--export=ALL) passes them, but for what is each node's own
# (its GPUs, its scheduler and launcher variables): one name a line.
forwarded_names() {
    local name
    for name in $(compgen -e); do
        [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
        [[ $name =~ ^(CUDA_VISIBLE_DEVICES|ROCR_VISIBLE_DEVICES|HIP_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|HOSTNAME|HOST|PWD|OLDPWD|SHLVL|_|DISPLAY|TERM|TMUX|SLURM_.*|SLURMD_.*|PBS_.*|OMPI_.*|PMIX_.*|PMI_.*|HYDRA_.*|SSH_.*)$ ]] &&
            continue
        echo "$name"
    done
}
forwarded_env() {  # the MPI launcher's options: what it passes to the ranks on other nodes
    # forwarded_names. Open MPI's mpirun gives those ranks only OMPI_* (ssh or PBS's TM start
    # them with a login's environment): `-x NAME` each.
    # MPICH's Hydra passes its whole environment over each proxy's (-genvall): under PBS,
    # whose nodes' processes get their own node's GPUs (its cgroup hook; TM's tasks too),
    # the batch node's would be every node's. There it passes the list (-genvlist); its own
    # node's ranks inherit them from the proxy it forks here.
    local names
    mapfile -t names < <(forwarded_names)
    if [[ $HPCVLA_MPI_FLAVOUR == openmpi ]]; then
        printf -- '-x\n%s\n' "${names[@]}"
    else
        printf -- '-genvlist\n%s\n' "$(IFS=,; echo "${names[*]}")"
    fi
}
run_world() {  # start the ranks, forward signals while they run; sets `status`, and
    # NEVER_STARTED where the launcher failed before any rank registered (deathwatch)
    NEVER_STARTED=""
    if [[ -n $EARLY ]]; then
        SIGNALLED=$EARLY status=0 NO_WORLD=1
        say "received SIG$EARLY before the ranks started: starting none"
        return
    fi
    if in_a_world "$1" && [[ -n ${HPCVLA_JOB_RUNS:-} ]]; then
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
        local why
        if [[ $status == 0 && -z $SIGNALLED ]] && ! why=$("$PYTHON" -m \
                hpcvla.process.deathwatch unfinished "$HPCVLA_RANK_DIR"); then
            say "the launcher exited 0, but the world did not run to its end: $why"
            status=1
        elif [[ $status != 0 && -z $SIGNALLED ]] && "$PYTHON" -m \
                hpcvla.process.deathwatch never-started "$HPCVLA_RANK_DIR"; then
            NEVER_STARTED=1  # a launcher's failure before any rank registered
        fi
        if [[ $status != 0 && -z $SIGNALLED ]]; then
            "$PYTHON" -m hpcvla.process.deathwatch describe "$HPCVLA_RANK_DIR" || true
        fi
        rm -rf "$HPCVLA_RANK_DIR"
        makes_a_run "$1" || rmdir "$HPCVLA_JOB_RUNS" 2> /dev/null || true  # eval's: empty
    fi
}
