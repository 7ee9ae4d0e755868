# CPU wheel of torch that lies on this machine's disk; a plain `torch` would pull a CUDA build.
TORCH ?= torch==2.13.0
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m continuous.demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
