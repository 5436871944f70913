"""The model cache: one folder per known model, a manifest with the checksums written at build time.

``<root>/<name>/`` holds the Hugging Face folder and ``tessera-model.json``, written last: a folder
without it is partial. The manifest lists every file with its size and SHA-256, so a later use finds
a truncated or altered file. The root is ``--cache-dir``, else ``$TESSERA_MODEL_CACHE``, else
``~/.cache/tessera/models``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tessera.models.registry import KNOWN, KnownModel

CACHE_ENV = "TESSERA_MODEL_CACHE"
MANIFEST = "tessera-model.json"
CHUNK = 1 << 20

State = Literal["ok", "missing", "partial", "corrupt"]


class ModelCacheError(ValueError):
    """A cached model cannot be used; the message says what is wrong and the command that fixes it."""


@dataclass(frozen=True, slots=True)
class FolderState:
    """What a model folder holds: ``ok``, or what is wrong with it (``detail``)."""

    state: State
    detail: str = ""

    @property
    def ok(self) -> bool:
        """The folder is complete (and, when checked fully, matches its checksums)."""
        return self.state == "ok"


def cache_root(override: Path | str | None = None) -> Path:
    """Where models are cached: ``override``, else ``$TESSERA_MODEL_CACHE``, else ~/.cache/tessera/models."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tessera" / "models"


def model_folder(name: str, root: Path | str | None = None) -> Path:
    """The cache folder of the model called ``name``."""
    return cache_root(root) / name


def sha256_of(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, model: KnownModel, check_answer: str | None) -> dict[str, Any]:
    """Checksum every file of ``folder`` and write the manifest (the last file of a build)."""
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "name": model.name,
        "summary": model.summary,
        "dtype": model.dtype,
        "builtAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "check": {"prompt": model.check_prompt, "expect": model.check_expect, "answer": check_answer},
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    """The folder's manifest; ModelCacheError when absent or unreadable."""
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelCacheError(f"{path} is missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelCacheError(f"{path} is unreadable ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or not data["files"]:
        raise ModelCacheError(f"{path} lists no files")
    return data


def inspect_folder(folder: Path, *, checksums: bool = True) -> FolderState:
    """The state of a model folder: every listed file present with its size (and checksum if asked)."""
    if not folder.is_dir():
        return FolderState("missing", f"{folder} does not exist")
    if not (folder / MANIFEST).exists():
        return FolderState("partial", f"{folder} has no {MANIFEST} (the build did not finish)")
    try:
        files = read_manifest(folder)["files"]
    except ModelCacheError as exc:
        return FolderState("corrupt", str(exc))
    for rel, meta in files.items():
        path = folder / rel
        if not path.is_file():
            return FolderState("partial", f"{path} is missing")
        size = path.stat().st_size
        if size != meta.get("bytes"):
            return FolderState("corrupt", f"{path} has {size} bytes, {meta.get('bytes')} when built")
    if checksums:
        for rel, meta in files.items():
            if sha256_of(folder / rel) != meta.get("sha256"):
                return FolderState("corrupt", f"{folder / rel} does not match its checksum from the build")
    return FolderState("ok")


def pull_hint(name: str) -> str:
    """The command that builds the model called ``name``."""
    return f"tessera models pull {name}"


def cached_model(name: str, root: Path | str | None = None) -> Path:
    """The verified cache folder of the known model ``name``; ModelCacheError naming the pull command."""
    folder = model_folder(name, root)
    state = inspect_folder(folder)
    if not state.ok:
        raise ModelCacheError(
            f"model {name!r} is {state.state} in the cache: {state.detail}; build it with `{pull_hint(name)}`"
        )
    return folder


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model argument resolved to a folder; ``known`` when it named a known model."""

    path: Path
    known: KnownModel | None = None

    @property
    def dtype(self) -> str:
        """The dtype vLLM serves it with: a known model's, else ``auto``."""
        return self.known.dtype if self.known is not None else "auto"

    def worker_profile(self) -> dict[str, float] | None:
        """Its step profile measured on the CPU, as a worker's ProfileSpec JSON (None: none measured)."""
        from tessera.api.worker_config import ProfileSpec
        from tessera.core.profiles import PROFILES

        if self.known is None or self.known.cpu_profile is None:
            return None
        return ProfileSpec.from_profile(PROFILES[self.known.cpu_profile]).to_json()


def resolve_model(value: str, root: Path | str | None = None) -> ResolvedModel:
    """A ``--model`` value as a folder: a known model name (its verified cache folder) or a model folder.

    A known name wins over a folder of the same name in the working directory; write ``./NAME`` for
    the folder. ModelCacheError says what is wrong: a known model not built (or damaged), a path
    that is not a Hugging Face model folder.
    """
    if value in KNOWN:
        return ResolvedModel(cached_model(value, root), KNOWN[value])
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ModelCacheError(
            f"--model {value!r} is neither a model folder nor a known model; known models: "
            f"{', '.join(sorted(KNOWN))} (build one with `tessera models pull NAME`)"
        )
    if not (path / "config.json").is_file():
        raise ModelCacheError(
            f"--model {value!r}: {path} has no config.json (not a Hugging Face model folder)"
        )
    return ResolvedModel(path.resolve())


def resolve_adapter(name: str, base_model: str, root: Path | str | None = None) -> Path:
    """The verified cache folder of the known adapter ``name``, to serve on the model ``base_model``.

    ModelCacheError says what is wrong: not a known adapter (the known ones listed), an adapter of
    another base model, or not built (with the command that builds it).
    """
    adapters = sorted(m.name for m in KNOWN.values() if m.base is not None)
    known = KNOWN.get(name)
    if known is None or known.base is None:
        raise ModelCacheError(
            f"adapter source {name!r} is not an adapter that `tessera models pull` builds; known adapters: "
            f"{', '.join(adapters)} (else give the adapter's folder as an absolute path)"
        )
    if known.base != base_model:
        raise ModelCacheError(
            f"adapter {name!r} was trained on the model {known.base!r}, but its base serves {base_model!r}; "
            f"name {known.base!r} as the base LLMService's model"
        )
    return cached_model(name, root)
