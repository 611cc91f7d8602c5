# The two documented commands are `make demo` and `make test`. Each sets everything up itself:
# where torch and triton already import (e.g. the GPU machine, which has no network) it uses
# that Python with src/ on the path; otherwise it creates and reuses a local .venv.
SHELL := /bin/bash
SYSTEM_HAS_TORCH := $(shell python3 -c "import torch, triton" >/dev/null 2>&1 && echo yes)

ifeq ($(SYSTEM_HAS_TORCH),yes)
PY := python3
SETUP :=
export PYTHONPATH := $(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH))
else
PY := $(CURDIR)/.venv/bin/python
SETUP := .venv/.installed
endif

.PHONY: gpu-wheels demo test test-gpu lint info bench-flash bench-matmul bench-memory bench-all report tune setup

setup: $(SETUP)

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	# CPU-only machines: torch==2.13.0 resolves to the local CPU build (no CUDA download).
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e ".[dev,bench,transformers]"
	touch $@

demo: $(SETUP)
	$(PY) -m diyfa.cli demo

test: $(SETUP)
	$(PY) -m pytest -q tests

test-gpu: $(SETUP)
	$(PY) -m pytest -q -m gpu tests

# Kernels keep hand-wrapped argument lists (# fmt: skip), so lint is `ruff check`, not format.
lint: $(SETUP)
	$(PY) -m ruff check src tests examples benchmarks

info: $(SETUP)
	$(PY) -m diyfa.cli info

bench-flash: $(SETUP)
	$(PY) -m diyfa.cli bench flash

bench-matmul: $(SETUP)
	$(PY) -m diyfa.cli bench matmul

bench-memory: $(SETUP)
	$(PY) -m diyfa.cli bench memory

bench-all: $(SETUP)
	$(PY) -m diyfa.cli bench all

report: $(SETUP)
	$(PY) -m diyfa.cli report

tune: $(SETUP)
	$(PY) -m diyfa.cli tune

# Wheels the GPU machine (no network) lacks, for benchmarks/gpu_tests.sh: carry .whl there.
gpu-wheels:
	mkdir -p .whl && python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform any -d .whl hypothesis "transformers>=4.56"
