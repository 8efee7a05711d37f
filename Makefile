# Two entry points on a fresh machine: `make run` and `make test`. Both create .venv on demand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml

.PHONY: install run test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch's CPU build first, from the wheel on these machines: an unpinned torch pulls CUDA.
	$(PIP) install --quiet torch==2.13.0
	# megatron-core (numpy, packaging, torch) too, so its CPU tests run rather than skip.
	$(PIP) install --quiet -e ".[torch,dev,ray,megatron]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem run $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/overlap.py
	$(PY) benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
