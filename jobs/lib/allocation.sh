# shellcheck shell=bash
# Sourced by jobs/launch.sh: what the allocation gives the job. Sets SCHEDULER (slurm, pbs,
# none), HOSTS, NP, NODES, PER_NODE, JOB_ID (and exports HPCVLA_JOB_RANKS), activates the
# Python environment (PYTHON), finds the MPI (mpi_select's exports) and sets one BLAS/OpenMP
# thread pool size per rank (THREADS). Uses launch.sh's die.

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
        # A job submitted with --export=NONE would hand that to its steps: srun's ranks would
        # start without the environment built here (its MPI library, venv, HPCVLA_*).
        export SLURM_EXPORT_ENV=ALL
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
# The MPI: exports MPI4PY_LIBMPI (and for 4.x OMPI_MCA_osc) for Open MPI, HPCVLA_MPI_FLAVOUR,
# HPCVLA_MPIEXEC, HPCVLA_SRUN_MPI_DEFAULT, HPCVLA_SLURM_LAUNCHER_DEFAULT and
# HPCVLA_MPI_STOP_SIGNAL; exits naming the problem when none is found.
MPI_EXPORTS=$("$PYTHON" -m hpcvla.process.mpi_select "${HPCVLA_MPI:-auto}") ||
    die "no MPI to start the ranks with (HPCVLA_MPI=${HPCVLA_MPI:-auto}: the reason above)"
eval "$MPI_EXPORTS"

# ---- threads per rank ----------------------------------------------------------------------
# NODE_CPUS: the CPUs the job holds on its smallest node (Slurm's SLURM_JOB_CPUS_PER_NODE,
# "128(x2),64": the nodes of a mixed partition differ, and a step asking every node for the
# batch node's count fails on the others), else on this node. TASK_CPUS: each rank's, which an
# srun-started world asks its step for (the step's tasks otherwise get one CPU each, and a
# site that binds tasks to cores pins each rank's threads to one).
NODE_CPUS="" TASK_CPUS=""
if [[ $SCHEDULER == slurm ]]; then
    IFS=, read -ra parts <<< "${SLURM_JOB_CPUS_PER_NODE:-}"
    for part in "${parts[@]}"; do
        cpus=${part%%(*}
        [[ $cpus =~ ^[0-9]+$ ]] || continue
        if [[ -z $NODE_CPUS ]] || (( cpus < NODE_CPUS )); then NODE_CPUS=$cpus; fi
    done
    NODE_CPUS=${NODE_CPUS:-${SLURM_CPUS_ON_NODE:-}}
    TASK_CPUS=${SLURM_CPUS_PER_TASK:-}
    if [[ -z $TASK_CPUS && -n $NODE_CPUS ]]; then
        # Each rank's share in whole cores: with hyperthreads Slurm gives a task whole cores,
        # so an odd share (15 of a 2-thread core's CPUs) would ask a step for more CPUs than
        # the job holds. A core's hardware threads: cpu0's siblings ("0,64" or "0-1").
        siblings=$(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list \
                   2> /dev/null || echo 0)
        if [[ $siblings == *-* ]]; then
            per_core=$(( ${siblings#*-} - ${siblings%-*} + 1 ))
        else
            commas=${siblings//[^,]/}
            per_core=$(( ${#commas} + 1 ))
        fi
        TASK_CPUS=$(( NODE_CPUS / PER_NODE ))
        (( TASK_CPUS < per_core )) || TASK_CPUS=$(( TASK_CPUS / per_core * per_core ))
    fi
    [[ ${TASK_CPUS:-1} != 0 ]] || TASK_CPUS=1
fi
if [[ -n ${HPCVLA_THREADS:-} ]]; then
    THREADS=$HPCVLA_THREADS
elif [[ -n $TASK_CPUS ]]; then
    THREADS=$TASK_CPUS
elif [[ $SCHEDULER == pbs && -n ${NCPUS:-} ]]; then  # PBS Pro: ncpus of this chunk
    THREADS=$(( NCPUS / PER_NODE ))
else
    THREADS=$(( $(nproc) / PER_NODE ))
fi
(( THREADS >= 1 )) || THREADS=1
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS
# Mesa's CPU renderers (llvmpipe, lavapipe) size their pools to the node's cores otherwise:
# hundreds of threads per node of simulator ranks.
export LP_NUM_THREADS=$THREADS
# robosuite's numba functions are compiled with cache=True: beside the package, else in the
# home; a read-only environment and home on compute nodes make that an error, and a shared
# home gets every rank's writes at once. Each node compiles into its own /tmp (not TMPDIR,
# which a site may make on the batch node alone, or on a shared file system).
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-$(id -u)}
# One-sided windows across nodes register their memory with InfiniBand/RoCE adapters, which
# the locked-memory limit caps; Slurm copies the submitting shell's (often 64 KiB) into the
# job. The soft limit is raised to the hard one; the job log says what it is.
ulimit -S -l "$(ulimit -H -l)" 2> /dev/null || true
