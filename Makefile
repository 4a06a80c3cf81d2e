# The two commands: `make demo` and `make test`. Both run the same set-up first
# (scripts/setup.sh: .venv, torch CPU, the project, Horovod built once and cached).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test bench clean

setup:
	@./scripts/setup.sh

demo: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) train/retrieval.py $(ARGS)

test:
	@./scripts/test.sh $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/sampler_speed.py
	$(PY) benchmarks/eval_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis workspace
