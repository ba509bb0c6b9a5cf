# The two set-up commands: `make demo` and `make test`. Both create .venv and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
PYTEST_ARGS ?= -m "not gpu"

.PHONY: demo test install install-dev bench frameworks gpu-wheels clean

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

# The client libraries applications call Veil with (scripts/frameworks_check.py), each on its newest release. Their
# newest releases cannot share one environment (instructor pins jiter below what openai needs), so each gets a
# virtual environment of its own under .venv-frameworks/, beside the one holding Veil that runs the fleet; .venv
# and `make test` never depend on them. Downloads from PyPI; a library that fails to install is named in the table.
FRAMEWORKS_VENV := .venv-frameworks
FRAMEWORKS_PIP := -m pip --disable-pip-version-check -q install --upgrade
FRAMEWORKS := openai openai-agents langchain-openai instructor litellm \
	llama-index:llama-index-core,llama-index-llms-openai-like,llama-index-embeddings-openai-like \
	pydantic-ai:pydantic-ai-slim[openai]
frameworks:
	test -x $(FRAMEWORKS_VENV)/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python $(FRAMEWORKS_PIP) "torch==2.13.0"
	$(FRAMEWORKS_VENV)/bin/python $(FRAMEWORKS_PIP) -e .
	for spec in $(FRAMEWORKS); do name=$${spec%%:*}; packages=$$(echo $${spec#*:} | tr , ' '); \
		(test -x $(FRAMEWORKS_VENV)/$$name/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)/$$name) && \
		$(FRAMEWORKS_VENV)/$$name/bin/python $(FRAMEWORKS_PIP) $$packages || echo "$$name: not installed"; done
	$(FRAMEWORKS_VENV)/bin/python scripts/frameworks_check.py --venvs $(FRAMEWORKS_VENV)

# The wheels a lent GPU machine lacks (benchmarks/gpu_wheels.txt), for benchmarks/gpu_session.py to install there:
# CPython 3.12 on x86-64, whatever this machine is. Downloads; nothing else in the project does.
GPU_PLATFORMS := $(foreach n,2014 1,--platform manylinux$(n)_x86_64) \
	$(foreach n,17 24 27 28 31 34,--platform manylinux_2_$(n)_x86_64)
gpu-wheels: | $(VENV)/bin/python
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
		-d .whl -r benchmarks/gpu_wheels.txt

clean:
	rm -rf $(VENV) $(FRAMEWORKS_VENV) build *.egg-info
