"""Reading the JSON or YAML files users hand to Tessera (worker configurations, backends, API keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def read_json_or_yaml(path: Path, what: str, error: type[Exception]) -> Any:
    """The parsed content of ``path``: JSON when it ends in ``.json``, YAML otherwise. ``error`` (a
    ValueError subclass) names ``what`` and the path when the file cannot be read or parsed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise error(f"{what} {path} is not valid JSON/YAML: {exc}") from None
