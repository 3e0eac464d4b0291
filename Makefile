# hpcvla: the two commands a newcomer needs.
#   make install   create .venv and install the pinned stack (CPU torch where there is no GPU),
#                  plus the Debian packages of the cluster tests (install-cluster)
#   make test      run the whole test suite, multi-rank MPI tests included
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin

# A single-node Slurm with its PBS wrappers (qsub/qstat), munge, and shellcheck: what
# tests/test_slurm.py runs the job scripts in jobs/ with. Needs root (CI is root).
CLUSTER_PACKAGES = slurm-wlm slurmctld slurmd slurm-client slurm-wlm-torque munge shellcheck

.PHONY: install install-cluster test clean

install: install-cluster
	$(PYTHON) -m venv $(VENV)
	# torch alone first: a later bare requirement must not pull a multi-GB CUDA build.
	$(BIN)/pip install $$(grep -E '^torch==' requirements.txt)
	# DeepSpeed builds no C++ ops at install time; it JIT-compiles what it uses.
	DS_BUILD_OPS=0 $(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	$(BIN)/hpcvla --help > /dev/null

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

test:
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
