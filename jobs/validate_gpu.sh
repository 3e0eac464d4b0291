#!/usr/bin/env bash
#SBATCH --job-name=hpcvla-validate-gpu
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --cpus-per-task=16
#SBATCH --time=00:30:00
# PBS runs a job script with -S's shell, else the user's login shell: it reads no #! line.
#PBS -N hpcvla-validate-gpu
#PBS -S /bin/bash
#PBS -l select=1:ncpus=16:ngpus=1
#PBS -l walltime=00:30:00
#
# The GPU validation job: the users' job at its real size on one GPU, through `hpcvla train` as
# a user runs it (`hpcvla bench fullsize`: π0 at 3.3 B from a pretrained folder, streamer vs
# sync-disaggregated, LoRA, the π0 streamer under Open MPI, a SIGTERM stop, OpenVLA-OFT at
# 7.5 B with LoRA, `hpcvla sft` with LoRA, an overfilled world refused). Each of its steps
# (install, doctor, fullsize) writes its log into OUT as it goes and runs under `timeout -k`,
# so a job cut by its limit keeps what it did; each training run's own log goes to WORK (in
# OUT's runs.tgz at the end). docs/cluster.md, "Validating a GPU node".
#
#   jobs/validate_gpu.sh OUT [WHEELS]        (or sbatch it from the repository root, or with
#                                            HPCVLA_ROOT set; qsub passes no arguments:
#                                            OUT=... [WHEELS=...] qsub -V jobs/validate_gpu.sh)
#   jobs/validate_gpu.sh --download-wheels WHEELS [PYTHON_VERSION]
#                                            on a machine with the project's venv and an index:
#                                            the wheels a bare GPU image lacks (~32 MB), for
#                                            PYTHON_VERSION (default 3.12, the image's)
#
#   OUT     the output folder: validate.log, each step's log, fullsize.json, runs.tgz (the
#           runs' summaries, metrics and logs)
#   WHEELS  a folder of wheels to install first, on a bare node without the project's
#           environment (`pip download --no-deps --only-binary=:all: ...`): MPICH's wheel is
#           installed by --prefix (pip --target drops its lib/), and mpi4py is pointed at its
#           libmpi (MPI4PY_LIBMPI), else it loads whatever libmpi the system has. They go
#           into WORK/env, once: a job split over calls on one machine installs them once.
# Environment:
#   OUT, WHEELS              the arguments' values where none is given (qsub)
#   HPCVLA_VALIDATE_STEPS    fullsize steps, comma-separated (default: all; e.g.
#                            streamer,sync to split the job over two short calls)
#   HPCVLA_VALIDATE_UPDATES  policy versions per run (default 20; 2 with QUICK)
#   HPCVLA_VALIDATE_QUICK=1  the dry run: the same steps at the tiny sizes on the CPU
#   HPCVLA_VALIDATE_LIMIT_S  seconds each step may take (default 900; fullsize, every run of
#                            HPCVLA_VALIDATE_STEPS, is one step)
#   HPCVLA_PYTHON            the Python to run (default: python3 with WHEELS, else the
#                            project's .venv)
#   HPCVLA_VALIDATE_WORK     where the runs and the pretrained folders go (default OUT/work;
#                            ~25 GB at full size)
set -uo pipefail

ROOT=${HPCVLA_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [[ ! -f $ROOT/requirements.txt ]]; then  # sbatch/qsub run a spooled copy of this script
    ROOT=${SLURM_SUBMIT_DIR:-${PBS_O_WORKDIR:-$PWD}}
fi
# shellcheck source=lib/words.sh
source "$ROOT/jobs/lib/words.sh"  # bash 4.4 or newer, before the first array

if [[ ${1:-} == --download-wheels ]]; then
    # What a bare GPU image (torch, transformers, h5py, numpy, psutil, a system Open MPI) lacks:
    # MPICH and mpi4py, DeepSpeed (pure Python: built here) and its pydantic and hjson, the
    # pinned transformers (older ones lack activation_checkpointing_enable), simpy. Versions:
    # requirements.txt's pins, else this venv's.
    dir=${2:?usage: $0 --download-wheels DIR [PYTHON_VERSION]}
    venv=$ROOT/.venv/bin
    pinned() { grep -E "^$1==" "$ROOT/requirements.txt" ||
               "$venv/pip" freeze | grep -iE "^$1==" || echo "$1"; }
    mkdir -p "$dir"
    specs=()
    for name in mpich mpi4py transformers simpy hjson pydantic pydantic-core annotated-types \
                typing-inspection; do
        specs+=("$(pinned "$name")")
    done
    "$venv/pip" download --no-deps --only-binary=:all: --python-version "${3:-3.12}" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dir" "${specs[@]}" &&
        DS_BUILD_OPS=0 "$venv/pip" wheel --no-deps --no-build-isolation -w "$dir" \
            "$(pinned deepspeed)"
    exit
fi
OUT=${1:-${OUT:-}}
WHEELS=${2:-${WHEELS:-}}
[[ -n $OUT ]] || { echo "usage: $0 OUT [WHEELS]" >&2; exit 2; }
# relative to where it was submitted: PBS starts a batch job in the home folder
submitted=$PWD
[[ ${PBS_ENVIRONMENT:-} != PBS_BATCH ]] || submitted=${PBS_O_WORKDIR:-$PWD}
[[ $OUT == /* ]] || OUT=$submitted/$OUT
[[ -z $WHEELS || $WHEELS == /* ]] || WHEELS=$submitted/$WHEELS
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LIMIT=${HPCVLA_VALIDATE_LIMIT_S:-900}
log() { echo "[validate_gpu $(date +%T)] $*" | tee -a "$OUT/validate.log"; }
step() {  # step NAME COMMAND...: run under timeout -k, its output into OUT/NAME.log as it comes
    local name=$1 status
    shift
    log "$name: $*"
    timeout -k 20 "$LIMIT" "$@" 2>&1 | tee -a "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    log "$name: exit $status"
    return "$status"
}

WORK=${HPCVLA_VALIDATE_WORK:-$OUT/work}
mkdir -p "$WORK"
if [[ -n $WHEELS ]]; then  # a bare node: the image's Python, the carried wheels
    PYTHON=${HPCVLA_PYTHON:-python3}
    # into WORK/env, first on PYTHONPATH (the image's packages stay as they are; OUT keeps only
    # logs and results), once: a second call on the same machine finds them there
    ENVDIR=$WORK/env
    if [[ ! -f $ENVDIR/installed ]]; then
        mpich=("$WHEELS"/mpich-*.whl)
        others=()
        for wheel in "$WHEELS"/*.whl; do [[ $wheel == "${mpich[0]}" ]] || others+=("$wheel"); done
        step install "$PYTHON" -m pip install --no-deps --no-index --target "$ENVDIR/site" \
            "${others[@]}" || exit 1
        if [[ -f ${mpich[0]} ]]; then  # pip --target drops MPICH's lib/: by --prefix
            step install "$PYTHON" -m pip install --no-deps --no-index --prefix "$ENVDIR/mpich" \
                "${mpich[0]}" || exit 1
        fi
        touch "$ENVDIR/installed"
    fi
    if [[ -d $ENVDIR/mpich ]]; then
        export PATH="$ENVDIR/mpich/bin:$PATH" MPI4PY_LIBMPI="$ENVDIR/mpich/lib/libmpi.so.12"
    fi
    export PYTHONPATH="$ROOT/src:$ENVDIR/site${PYTHONPATH:+:$PYTHONPATH}"
else
    PYTHON=${HPCVLA_PYTHON:-$ROOT/.venv/bin/python}
    PATH="$(dirname "$PYTHON"):$PATH"  # its mpiexec (MPICH's wheel) first
    export PATH
fi
cd "$ROOT" || exit 1

{ command -v nvidia-smi > /dev/null && nvidia-smi; "$PYTHON" -c "import torch, mpi4py;
print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'mpi4py', mpi4py.__version__)"
} > "$OUT/inventory.log" 2>&1
step doctor "$PYTHON" -m hpcvla doctor configs/reach_flow.yaml

quick=()
[[ ${HPCVLA_VALIDATE_QUICK:-0} == 1 ]] && quick=(--quick)
steps=()
[[ -n ${HPCVLA_VALIDATE_STEPS:-} ]] && steps=(--steps "$HPCVLA_VALIDATE_STEPS")
step fullsize "$PYTHON" -m hpcvla bench fullsize --out "$WORK" "${quick[@]}" \
    "${steps[@]}" ${HPCVLA_VALIDATE_UPDATES:+--updates "$HPCVLA_VALIDATE_UPDATES"}
status=$?
# the results and the runs' small files beside the logs (not the folders' GBs)
cp "$WORK/fullsize.json" "$OUT/" 2> /dev/null
tar -czf "$OUT/runs.tgz" -C "$WORK" --exclude='*.safetensors' --exclude='*-folder' \
    --exclude=./env . 2> /dev/null
log "done (exit $status): $OUT/fullsize.json"
exit "$status"
