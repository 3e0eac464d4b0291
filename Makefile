# hpcvla: the two commands a newcomer needs.
#   make install   create .venv and install the pinned stack (CPU torch where there is no GPU)
#   make test      run the whole test suite, multi-rank MPI tests included
PYTHON ?= python3.11
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: install test clean

install:
	$(PYTHON) -m venv $(VENV)
	# torch alone first: a later bare requirement must not pull a multi-GB CUDA build.
	$(BIN)/pip install $$(grep -E '^torch==' requirements.txt)
	# DeepSpeed builds no C++ ops at install time; it JIT-compiles what it uses.
	DS_BUILD_OPS=0 $(BIN)/pip install -r requirements.txt
	$(BIN)/pip install --no-deps -e .
	$(BIN)/hpcvla --help > /dev/null

test:
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
