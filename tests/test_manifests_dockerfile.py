"""The Dockerfile: two non-root targets on pinned bases, copying only files the build context sends."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from tessera.api.serving_pool import DEFAULT_VLLM_IMAGE

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _stages() -> dict[str, list[str]]:
    """Instructions of each named stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            name = line.split(" AS ")[-1]
            current = stages.setdefault(name, [line])
        elif line and not line.startswith("#") and current is not None:
            current.append(line)
    return stages


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, flags=re.M))


def test_targets_use_pinned_official_bases() -> None:
    stages, args = _stages(), _args()
    assert {"operator", "worker"} <= stages.keys()
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert stages["operator"][0] == "FROM ${PYTHON_IMAGE} AS operator"
    assert stages["worker"][0] == "FROM ${VLLM_IMAGE} AS worker"
    image, tag = args["VLLM_IMAGE"].split(":")
    assert image == "vllm/vllm-openai" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)
    assert args["VLLM_IMAGE"] == DEFAULT_VLLM_IMAGE  # the pool's default vLLM matches the worker's


def test_targets_run_tessera_as_non_root() -> None:
    for name in ("operator", "worker"):
        instructions = _stages()[name]
        users = [i.split()[1] for i in instructions if i.startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("0", "root"), name
        assert 'ENTRYPOINT ["tessera"]' in instructions, name
    assert 'CMD ["worker"]' in _stages()["worker"]
    assert _stages()["operator"][-1].startswith('CMD ["operator"')


def test_copied_paths_exist_and_pass_dockerignore() -> None:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]

    def sent(path: str) -> bool:
        keep = True
        for pattern in patterns:  # last match wins, as in Docker
            negate = pattern.startswith("!")
            pattern = pattern.removeprefix("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
                keep = negate
        return keep

    sources = [
        src
        for line in _stages()["source"]
        if line.startswith("COPY ") and "--from" not in line
        for src in line.split()[1:-1]
    ]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert sent(src), f"{src} is excluded by .dockerignore"
    assert not sent(".venv") and not sent(".git")
