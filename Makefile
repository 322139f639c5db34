# Two commands for learners and CI: `make course` and `make test` (see README).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# transformers releases the CPU tier also runs on, besides the one requirements.txt installs:
# the first without transformers#45242, and the one on the course's GPU image.
TRANSFORMERS_MATRIX ?= 5.5.2 5.17.0
MATRIX_VENV := .cache/matrix-transformers
# what the matrix leaves out: tests of the course's own bookkeeping (notebook contracts, records and the pages rendered
# from them, the benchmark's and the card sweep's orchestration), whose outcome no transformers release can change
MATRIX_SKIP ?= tests/test_notebooks.py tests/test_repository.py tests/test_bench.py tests/test_card_sweep.py
# accelerate releases the hook tests also run on: the last whose AlignDevicesHook is a graph break
ACCELERATE_MATRIX ?= 1.15.0
ACCELERATE_TESTS ?= tests/test_decoding.py tests/test_placement.py
HAS_CUDA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
NOTEBOOKS := $(sort $(wildcard notebooks/*.ipynb))
# The llama.cpp route (notebook 08): llama-cpp-python compiles llama.cpp from its source distribution,
# several minutes on two cores, so `make llama-cpp` builds the wheel once into $(LLAMA_CPP_DIR) and
# reuses it; the converter comes out of the same source distribution. Pins match helpers/gguf_route.py.
LLAMA_CPP_PYTHON := 0.3.36
GGUF := 0.19.0
LLAMA_CPP_DIR := .cache/llama-cpp-python-$(LLAMA_CPP_PYTHON)
LLAMA_CPP_SDIST := $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
# x86-64 with AVX2 rather than -march=native, so the cached wheel runs on any recent x86 machine it is copied to; the
# course's route is text only, so libmtmd (images and audio, a fifth of the build) is left out
LLAMA_CPP_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
export LLAMA_CPP_SOURCE := $(CURDIR)/$(LLAMA_CPP_DIR)/llama.cpp

.PHONY: bench install lint llama-cpp test test-mutations test-cpu test-kernels test-triton test-notebooks test-matrix test-colab classroom-load browser-check docs test-gpu test-gpu-tier test-gpu-notebooks test-gpu-cards test-gpu-sweep course lab gpu-wheels clean

$(VENV)/.installed: requirements.txt requirements-local.txt requirements-dev.txt pyproject.toml helpers/course.py
	@# the same set-up as `python -m helpers.course setup --dev` from PowerShell: a CUDA torch where nvidia-smi
	@# finds a GPU (a CUDA torch already in $(PYTHON) is lent to the venv), else the CPU build first
	$(PYTHON) -m helpers.course setup --dev
	touch $@

install: $(VENV)/.installed

## make llama-cpp: llama-cpp-python and gguf in the venv, the wheel built once and cached, the converter extracted
llama-cpp: $(VENV)/.llama-cpp-$(LLAMA_CPP_PYTHON)

$(VENV)/.llama-cpp-$(LLAMA_CPP_PYTHON): $(VENV)/.installed
	@mkdir -p $(LLAMA_CPP_DIR)
	@if [ ! -f $(LLAMA_CPP_SDIST) ]; then \
		$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP_DIR) || exit 1; fi
	@if ! ls $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl >/dev/null 2>&1; then \
		echo "Building llama-cpp-python $(LLAMA_CPP_PYTHON) from source, once (several minutes on two cores; cached in $(LLAMA_CPP_DIR))"; \
		start=$$(date +%s); \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip wheel -q --no-deps -w $(LLAMA_CPP_DIR) $(LLAMA_CPP_SDIST) || exit 1; \
		echo "llama-cpp-python wheel built in $$(( $$(date +%s) - start )) s"; fi
	$(PY) -m pip install -q $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl gguf==$(GGUF)
	$(PY) -c "from helpers import gguf_route; gguf_route.extract_converter('$(LLAMA_CPP_SDIST)', '$(LLAMA_CPP_SOURCE)')"
	touch $@

## make test: every tier this machine can run
test: install lint llama-cpp test-cpu test-kernels test-triton test-notebooks test-matrix test-mutations test-colab
	@if [ -n "$(HAS_CUDA)" ]; then $(MAKE) --no-print-directory test-gpu PYTHON_GPU=$(PY); fi

lint: install
	$(VENV)/bin/ruff check .

## make test-mutations: break the code in named ways (tools/mutations.py) and check that a test notices each
test-mutations: install
	$(PY) tools/mutations.py

test-cpu: install
	$(PY) -m pytest tests -ra

## make test-triton: the Triton kernels' tests (their bits in Triton's interpreter, their PTX for each learner's
## card) with triton installed beside the CPU venv, at the version PyTorch's CUDA wheel of the GPU tier brings
TRITON_VERSION ?= 3.6.0
TRITON_SITE ?= .cache/triton-$(TRITON_VERSION)
TRITON_TESTS ?= tests/test_exact_nf4.py tests/test_exact_norm.py tests/test_exact_rotary.py tests/test_exact_layer.py \
	tests/test_exact_cache.py
$(TRITON_SITE)/.installed:
	$(PY) -m pip install -q --no-deps --upgrade --target $(TRITON_SITE) "triton==$(TRITON_VERSION)"
	touch $@

test-triton: install $(TRITON_SITE)/.installed
	COURSE_TRITON_TIER=1 PYTHONPATH=$(TRITON_SITE) $(PY) -m pytest -q -p no:cacheprovider $(TRITON_TESTS)

## make test-kernels: the numerics, decoding and same-bytes tests again under other CPUs' kernels (PyTorch's
## ATEN_CPU_CAPABILITY picks the vector kernels of an older instruction set on this machine); the set this machine
## picks itself is the CPU tier's, so it is not run twice
KERNEL_CAPABILITIES ?= default avx2
KERNEL_TESTS ?= tests/test_numerics.py tests/test_decoding.py tests/test_synthetic.py
test-kernels: install
	@native=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for capability in $(KERNEL_CAPABILITIES); do \
		if [ "$$capability" = "$$native" ]; then echo "== ATEN_CPU_CAPABILITY=$$capability is this CPU's own: the CPU tier ran it"; continue; fi; \
		echo "== $(KERNEL_TESTS) with ATEN_CPU_CAPABILITY=$$capability"; \
		ATEN_CPU_CAPABILITY=$$capability $(PY) -m pytest $(KERNEL_TESTS) -q -p no:cacheprovider -m "not gpu" || exit 1; done

test-notebooks: install
	@if [ -n "$(NOTEBOOKS)" ]; then $(PY) -m pytest --nbval-lax -p no:cacheprovider $(NOTEBOOKS); \
	else echo "no notebooks yet"; fi

## a venv of its own per transformers release, resolved by pip as a learner's would be: an older transformers laid
## over .venv would also see what only the newer one pulls in (transformers 5.25 brings kernels 0.19, which 5.5.2
## cannot import beside). The same torch as .venv, the course's requirements otherwise; tools/probe_plain_strings.py
## builds its releases here too.
$(MATRIX_VENV)-%/.installed: $(VENV)/.installed $(VENV)/.llama-cpp-$(LLAMA_CPP_PYTHON)
	rm -rf $(@D) && $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q -r requirements-dev.txt "torch==$$($(PY) -c 'import torch; print(torch.__version__)')" \
		"transformers==$*" $(LLAMA_CPP_DIR)/llama_cpp_python-$(LLAMA_CPP_PYTHON)-*.whl gguf==$(GGUF)
	$(@D)/bin/python -m pip install -q --no-deps -e .
	touch $@

test-matrix: install $(foreach v,$(TRANSFORMERS_MATRIX),$(MATRIX_VENV)-$(v)/.installed)
	@for v in $(TRANSFORMERS_MATRIX); do \
		python=$(MATRIX_VENV)-$$v/bin/python; \
		echo "== CPU tier on transformers $$v ($$($$python -m pip freeze | grep -i -E '^(huggingface.hub|kernels)==' | tr '\n' ' '))"; \
		$$python -m pytest tests -q -p no:cacheprovider -m "not gpu" $(addprefix --ignore=,$(MATRIX_SKIP)) || exit 1; \
		echo "== notebook 07 (chat templates) on transformers $$v"; \
		$$python -m pytest --nbval-lax --nbval-current-env -p no:cacheprovider -q notebooks/07_chat.ipynb || exit 1; \
	done
	@for v in $(ACCELERATE_MATRIX); do \
		target=.cache/accelerate-$$v; \
		if [ ! -f $$target/.installed ]; then \
			$(PY) -m pip install -q --no-deps --target $$target "accelerate==$$v" && touch $$target/.installed || exit 1; fi; \
		echo "== accelerate's hooks on accelerate $$v"; \
		PYTHONPATH=$$target $(PY) -m pytest $(ACCELERATE_TESTS) -q -p no:cacheprovider -m "not gpu" || exit 1; \
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

## nbval over every notebook under one card's memory (CARD_GB=8; empty: the whole GPU); a kernel may take minutes to
## start where eight start at once on a cold box (nbval's own wait, 60 s, once failed a whole notebook)
test-gpu-notebooks:
	mkdir -p build
	junit=build/nbval-gpu-$${CARD_GB:-uncapped}$${GPU_GROUP}.xml; \
	PYTHONPATH=$(CURDIR):$$PYTHONPATH GEMMA_MODEL=$${GEMMA_MODEL:-e4b-shape} $(PYTHON_GPU) -m pytest --nbval-lax --nbval-cell-timeout=600 \
		--nbval-kernel-startup-timeout=300 --nbval-current-env -p no:cacheprovider -v --junitxml=$$junit $(GPU_NOTEBOOKS) > $$junit.log 2>&1; status=$$?; \
	tail -5 $$junit.log; \
	if [ "$${GPU_RECORD:-0}" = 1 ]; then PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) tools/record_nbval.py $$junit \
		$${NBVAL_COMMAND:+--command "$$NBVAL_COMMAND"}; fi; \
	exit $$status

## the notebooks on every card of GPU_CARDS at once, each card's notebooks in GPU_NOTEBOOK_GROUPS side by side:
## every process is capped, so they share one big GPU and the CPU cores (OMP_NUM_THREADS split between them)
GPU_NOTEBOOK_GROUPS ?= 0[0-3] 0[4-6] 0[7-9] 1[0-9]
test-gpu-cards:
	@# built once here, both at once (each by worker processes side by side): a build under an 8 GB cap would only wait on the others' lock
	@PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m helpers.synthetic $${GEMMA_MODEL:-e4b-shape} & first=$$!; \
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m helpers.synthetic e2b-shape & second=$$!; \
	wait $$first && wait $$second || exit 1; \
	groups=0; for group in $(GPU_NOTEBOOK_GROUPS); do groups=$$((groups + 1)); done; \
	cards=0; for card in $(GPU_CARDS); do cards=$$((cards + 1)); done; \
	threads=$$(( $$(nproc) / (groups * cards) )); [ $$threads -ge 1 ] || threads=1; \
	pids=""; for card in $(GPU_CARDS); do \
		if [ $$card = uncapped ]; then card=; fi; i=0; \
		for group in $(GPU_NOTEBOOK_GROUPS); do i=$$((i + 1)); \
			NBVAL_COMMAND="GPU_RECORD=1 GEMMA_MODEL=$${GEMMA_MODEL:-e4b-shape} GPU_CARDS='$(GPU_CARDS)' GPU_NOTEBOOK_GROUPS='$(GPU_NOTEBOOK_GROUPS)' make test-gpu-cards" \
			CARD_GB=$$card GPU_GROUP=-$$i OMP_NUM_THREADS=$$threads GPU_NOTEBOOKS="$$(echo notebooks/$$group*.ipynb)" \
				$(MAKE) --no-print-directory test-gpu-notebooks & pids="$$pids $$!"; done; done; \
	status=0; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

## make test-gpu-sweep SWEEP_PART=k: part k of the notebooks on every card size from 4 GB up, the whole GPU and the
## planner's edge cards, both shapes, a few cards per part so that each fits one 10-minute call (python tools/card_sweep.py --list names them)
SWEEP_PART ?=
test-gpu-sweep:
	$(PYTHON_GPU) tools/card_sweep.py $(SWEEP_PART)

## make course: run every notebook top to bottom into build/ and summarise
course: install
	$(PY) tools/run_course.py $(NOTEBOOKS)

lab: install
	$(PY) -m helpers.course lab

## make test-colab: a fresh venv with Colab's versions (tools/colab-versions.txt), the notebooks' install cell run in it,
## then part of the CPU tier there (a few minutes; packages come from pip's cache after the first run)
test-colab: install
	COURSE_COLAB_VENV=1 $(PY) -m pytest tests/test_colab_versions.py -ra -p no:cacheprovider

## make classroom-load: 20 learners download e2b-shape (10 GB) from the classroom mirror at once (minutes; data/classroom/)
CLASSROOM_ARGS ?= e2b-shape --clients 20 --resume-every 5 --control --record
classroom-load: install
	$(PY) -m lab.classroom load $(CLASSROOM_ARGS)

## make browser-check: JupyterLab in headless Chromium runs notebooks 00, 04 and 06 (Debian: apt-get install chromium);
## screenshots and a summary in build/browser/ (minutes; not part of make test)
browser-check: install
	$(PY) -m pip install -q playwright
	$(PY) tools/browser_check.py $(BROWSER_NOTEBOOKS)

## make docs: the README's results, the instructor guide's timings and the figures, rendered from data/
docs: install
	$(PY) tools/render_results.py
	$(PY) tools/render_docs.py

## make bench PRESET=<preset>: the benchmark on a GPU (records under data/measurements/); python -m lab.bench --help
## lists the presets (quick, memory, long-context, decode-speed, decode-goal, ...)
## BENCH_ARGS="--jobs 4": configurations side by side (memory figures only)
PRESET ?= quick
BENCH_ARGS ?=
bench:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PYTHON_GPU) -m lab.bench $(PRESET) $(BENCH_ARGS)

## make gpu-wheels: wheels to carry to a GPU box without a registry
gpu-wheels:
	tools/gpu_wheels.sh

clean:
	rm -rf build .cache .pytest_cache
