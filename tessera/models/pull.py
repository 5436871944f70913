"""``tessera models pull``: build a known model into the cache once, verify it, reuse it after.

A build goes into a hidden sibling folder and is renamed into place only once its answer check has
passed and its manifest is written, so the cache never shows a half-built model under its name. A
lock file serialises concurrent pulls of the same model.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tessera.models.cache import cache_root, inspect_folder, write_manifest
from tessera.models.check import check_answer
from tessera.models.registry import KnownModel, known_model


@dataclass(frozen=True, slots=True)
class PullResult:
    """Where the model is, whether this pull built it, the check answer, and how long it took."""

    folder: Path
    built: bool
    answer: str | None
    seconds: float


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pull(
    model: KnownModel,
    root: Path | str | None = None,
    *,
    force: bool = False,
    report: Callable[[str], None] = print,
) -> PullResult:
    """Build ``model`` into ``<root>/<name>`` unless a verified copy is there; return where it is.

    A present folder is checked against its build-time checksums only; a missing, partial or corrupt
    one (or ``force``) is rebuilt and its answer checked. An adapter's base is pulled first.
    """
    started = time.monotonic()
    root = cache_root(root)
    folder = root / model.name
    with _locked(root / f".{model.name}.lock"):
        if not force:
            state = inspect_folder(folder)
            if state.ok:
                return PullResult(folder, False, None, time.monotonic() - started)
            if state.state != "missing":
                report(f"{model.name}: {state.state} ({state.detail}); rebuilding")
        building = root / f".{model.name}.building-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        try:
            report(f"{model.name}: building {model.summary} into {folder}")
            if model.base is None:
                model.build(building)
            else:  # an adapter: its base first, into the same cache
                model.build(building, pull(known_model(model.base), root, report=report).folder)
            answer = check_answer(building, model)
            write_manifest(building, model, answer)
            shutil.rmtree(folder, ignore_errors=True)
            building.rename(folder)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return PullResult(folder, True, answer, time.monotonic() - started)
