# The two commands: `make demo` and `make test`. Both run the same set-up first
# (scripts/setup.sh: a venv, torch, the project, Horovod built once and cached).
# `make test-fast` runs the tests that start no launcher and no S3 server (the edit loop).
# PYTHON picks the interpreter (3.10, 3.11 or 3.12; default python3.11):
#   PYTHON=python3.12 make test      # venv .venv-3.12/, its own Horovod wheel
# VENV (or PKSAMPLER_VENV) overrides the venv folder.
SHELL := /bin/bash
PYTHON ?=
export PYTHON
ifeq ($(origin VENV), undefined)
VENV := $(shell ./scripts/setup.sh --print-venv)
endif
export PKSAMPLER_VENV := $(VENV)
PY := $(VENV)/bin/python
NP ?= 2
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast bench clean

setup:
	@./scripts/setup.sh

# On hosts with one core per rank, Horovod's default 1 ms coordination cycle
# steals compute time; 10 ms measured best here (benchmarks/scaling.py).
HOROVOD_CYCLE_TIME ?= 10

demo: setup
	HOROVOD_CYCLE_TIME=$(HOROVOD_CYCLE_TIME) OMP_NUM_THREADS=1 $(VENV)/bin/horovodrun -np $(NP) -H localhost:$(NP) $(PY) train/retrieval.py $(ARGS)

# The whole suite (CI's command). test-fast: what starts no launcher and no S3 server, for the edit loop.
test:
	@./scripts/test.sh $(PYTEST_ARGS)

test-fast:
	@./scripts/test.sh --fast $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/sampler_speed.py
	$(PY) benchmarks/eval_speed.py

# Every interpreter's venv (.venv for the default, .venv-3.X for the others).
clean:
	rm -rf .venv .venv-3.* $(VENV) .pytest_cache .hypothesis workspace
