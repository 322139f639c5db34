# Two commands for learners and CI: `make course` and `make test` (see README).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CPU_TORCH := torch==2.13.0
# transformers releases the CPU tier also runs on, besides the one requirements.txt installs:
# the first without transformers#45242, and the one on the course's GPU image.
TRANSFORMERS_MATRIX ?= 5.5.2 5.17.0
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))

.PHONY: bench install lint test test-cpu test-notebooks test-matrix test-gpu test-gpu-tier test-gpu-notebooks test-gpu-cards course lab gpu-wheels clean

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	@# On a CUDA machine the venv sees the system's torch and leaves it alone.
	$(PYTHON) -m venv $(if $(HAS_CUDA),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if [ -z "$(HAS_CUDA)" ] && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "No CUDA here: installing the CPU build $(CPU_TORCH) first"; $(PY) -m pip install -q $(CPU_TORCH); fi
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

## make test: every tier this machine can run
test: install lint test-cpu test-notebooks test-matrix
	@if [ -n "$(HAS_CUDA)" ]; then $(MAKE) --no-print-directory test-gpu PYTHON_GPU=$(PY); fi

lint: install
	$(VENV)/bin/ruff check .

test-cpu: install
	$(PY) -m pytest tests -ra

test-notebooks: install
	@if [ -n "$(NOTEBOOKS)" ]; then $(PY) -m pytest --nbval-lax -p no:cacheprovider $(NOTEBOOKS); \
	else echo "no notebooks yet"; fi

test-matrix: install
	@for v in $(TRANSFORMERS_MATRIX); do \
		target=.cache/transformers-$$v; \
		if [ ! -f $$target/.installed ]; then \
			$(PY) -m pip install -q --target $$target "transformers==$$v" && touch $$target/.installed || exit 1; fi; \
		echo "== CPU tier on transformers $$v"; \
		PYTHONPATH=$$target $(PY) -m pytest tests -q -p no:cacheprovider -m "not gpu" || exit 1; \
	done

## make test-gpu: the GPU tier, then nbval on e4b-shape on the learners' cards, with the machine's own python
PYTHON_GPU ?= python3
GPU_NOTEBOOKS ?= $(NOTEBOOKS)
## the cards nbval runs the notebooks on: an RTX 4060, a Colab T4 and the whole GPU (empty = uncapped)
GPU_CARDS ?= 8 15 uncapped
## one run of both halves, timed; GPU_RECORD=1 also writes data/gpu-tier/make-test-gpu.json
test-gpu:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory test-gpu-tier; tier=$$?; \
	$(MAKE) --no-print-directory test-gpu-cards; notebooks=$$?; \
	seconds=$$(( $$(date +%s) - start )); echo "make test-gpu: $$seconds s (GPU tier exit $$tier, notebooks exit $$notebooks)"; \
	if [ "$${GPU_RECORD:-0}" = 1 ]; then $(PYTHON_GPU) tools/record_gpu_run.py --seconds $$seconds \
		--tier-status $$tier --notebooks-status $$notebooks; fi; \
	[ $$tier = 0 ] && [ $$notebooks = 0 ]

test-gpu-tier:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH GPU_RECORD=$${GPU_RECORD:-0} $(PYTHON_GPU) -m pytest tests -m gpu -v -ra

## nbval over every notebook under one card's memory (CARD_GB=8; empty: the whole GPU)
test-gpu-notebooks:
	mkdir -p build
	junit=build/nbval-gpu-$${CARD_GB:-uncapped}.xml; \
	PYTHONPATH=$(CURDIR):$$PYTHONPATH GEMMA_MODEL=$${GEMMA_MODEL:-e4b-shape} $(PYTHON_GPU) -m pytest --nbval-lax --nbval-cell-timeout=600 \
		--nbval-current-env -p no:cacheprovider -v --junitxml=$$junit $(GPU_NOTEBOOKS) > $$junit.log 2>&1; status=$$?; \
	tail -5 $$junit.log; \
	if [ "$${GPU_RECORD:-0}" = 1 ]; then PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) tools/record_nbval.py $$junit; fi; \
	exit $$status

## the notebooks on every card of GPU_CARDS at once: each process is capped, so they share one big GPU
test-gpu-cards:
	@# built once here: a build under an 8 GB cap would only wait on the others' lock
	@PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m helpers.synthetic $${GEMMA_MODEL:-e4b-shape}; \
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m helpers.synthetic e2b-shape; \
	pids=""; for card in $(GPU_CARDS); do \
		if [ $$card = uncapped ]; then card=; fi; \
		CARD_GB=$$card $(MAKE) --no-print-directory test-gpu-notebooks & pids="$$pids $$!"; done; \
	status=0; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

## make course: run every notebook top to bottom into build/ and summarise
course: install
	$(PY) tools/run_course.py $(NOTEBOOKS)

lab: install
	$(VENV)/bin/jupyter lab notebooks/

## make bench PRESET=quick|memory|cards|speed: the benchmark on a GPU (records under data/measurements/)
## BENCH_ARGS="--jobs 4": configurations side by side (memory figures only)
PRESET ?= quick
BENCH_ARGS ?=
bench:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m helpers.bench $(PRESET) $(BENCH_ARGS)

## make gpu-wheels: wheels to carry to a GPU box without a registry
gpu-wheels:
	tools/gpu_wheels.sh

clean:
	rm -rf build .cache .pytest_cache
