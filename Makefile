# CPU wheel of torch that lies on this machine's disk; a plain `torch` would pull a CUDA build.
TORCH ?= torch==2.13.0
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: demo demo-swarm test docs install clean

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

demo: $(STAMP)
	$(PY) -m continuous.demo

demo-swarm: $(STAMP)
	$(PY) -m continuous.demo --swarm

test: $(STAMP)
	$(PY) -m pytest -q

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site
