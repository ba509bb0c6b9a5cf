# The two set-up commands: `make demo` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PYTEST_ARGS ?= -m "not gpu"

.PHONY: demo test install install-dev bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is installed first and pinned, so that machines with a local CPU wheel take it offline.
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(VENV)/bin/python
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/veil demo

test: install-dev
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install-dev
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
