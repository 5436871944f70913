"""What a batch may be: completion windows, limits, and the checks of an input file (pure, no I/O).

Limits (OpenAI's, except the size, which is half theirs: a file is read whole into memory):

- an input file holds at most ``MAX_LINES`` (50,000) requests and ``MAX_FILE_BYTES`` (100 MiB);
- ``completion_window`` is ``24h`` as OpenAI's, or any shorter window written ``<N>h``, ``<N>m`` or
  ``<N>s`` (``1h``, ``30m``, ``90s``; at least ``1s``): a job's lines carry its expiry as their deadline,
  so a short window asks the pool to serve them sooner.

An input line is ``{"custom_id": str, "method": "POST", "url": <the batch's endpoint>, "body": {...}}``.
A file that breaks a rule fails the batch at validation with one error per offending line (``line`` is
1-based, as OpenAI's); a body the model server refuses later is answered in the error file instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_LINES = 50_000
MAX_FILE_BYTES = 100 * 1024 * 1024
MAX_CUSTOM_ID_CHARS = 512
MAX_WINDOW_S = 24 * 3600
MAX_ERRORS = 100  # validation errors reported per batch (the rest are counted in the last one)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([hms])$")
_UNIT_S = {"h": 3600, "m": 60, "s": 1}


class WindowError(ValueError):
    """A completion window this component does not offer."""


def window_seconds(window: str) -> int:
    """Seconds of a ``completion_window``; WindowError saying which windows exist."""
    match = _WINDOW.match(window)
    seconds = int(match.group(1)) * _UNIT_S[match.group(2)] if match else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise WindowError(f"completion_window {window!r} is not offered: use '24h' or a shorter window "
                          "written <N>h, <N>m or <N>s (e.g. '1h', '30m', '90s')")  # fmt: skip
    return seconds


@dataclass(frozen=True, slots=True)
class LineError:
    """One validation error, as OpenAI's batch ``errors.data`` items."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_json(self) -> dict[str, Any]:
        """OpenAI's form."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a valid input file."""

    index: int  # 0-based position in the file
    custom_id: str
    body: dict[str, Any]

    @property
    def model(self) -> str:
        """The model the body names."""
        return str(self.body["model"])


def _body_error(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why the endpoint refuses ``body`` before any model server sees it (None: it may go)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "body.model must be a non-empty string"
    if body.get("stream"):
        return "body.stream must be false or absent: a batch collects whole answers"
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "body.messages must be a non-empty list of message objects"
    elif "prompt" not in body:
        return "body.prompt is required by /v1/completions"
    return None


def parse_input(
    data: bytes, endpoint: str, models: frozenset[str] | None
) -> tuple[list[InputLine], list[LineError]]:
    """The lines of an input file for a batch on ``endpoint`` and every reason it is refused (at most
    ``MAX_ERRORS``; any error refuses the whole file). ``models``: those the tenant may use that are
    served (None: unchecked)."""
    if len(data) > MAX_FILE_BYTES:
        return [], [LineError("file_too_large", f"the input file has {len(data)} bytes; at most "
                                            f"{MAX_FILE_BYTES} are allowed")]  # fmt: skip
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [LineError("invalid_encoding", f"the input file is not UTF-8: {exc}")]
    rows = [(n, raw) for n, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not rows:
        return [], [LineError("empty_file", "the input file has no requests")]
    if len(rows) > MAX_LINES:
        return [], [LineError("too_many_requests", f"the input file has {len(rows)} requests; at most "
                                               f"{MAX_LINES} are allowed per batch")]  # fmt: skip
    errors: list[LineError] = []
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for n, raw in rows:
        problem = _line_error(n, raw, endpoint, models, seen)
        if isinstance(problem, LineError):
            errors.append(problem)
        else:
            lines.append(InputLine(len(lines), *problem))
    if len(errors) > MAX_ERRORS:
        extra = len(errors) - MAX_ERRORS + 1
        errors = [*errors[: MAX_ERRORS - 1], LineError("too_many_errors", f"{extra} more invalid lines")]
    return lines, errors


def _line_error(
    n: int, raw: str, endpoint: str, models: frozenset[str] | None, seen: dict[str, int]
) -> LineError | tuple[str, dict[str, Any]]:
    """The error of line ``n`` (1-based), or its custom_id and body."""
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        return LineError("invalid_json_line", f"line {n} is not valid JSON: {exc.msg}", n)
    if not isinstance(item, dict):
        return LineError("invalid_json_line", f"line {n} is not a JSON object", n)
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError("missing_custom_id", f"line {n} has no custom_id (a non-empty string)", n,
                         "custom_id")  # fmt: skip
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return LineError("invalid_custom_id", f"line {n}: custom_id is longer than {MAX_CUSTOM_ID_CHARS} "
                                              "characters", n, "custom_id")  # fmt: skip
    if custom_id in seen:
        return LineError("duplicate_custom_id", f"line {n} repeats the custom_id {custom_id!r} of line "
                                                f"{seen[custom_id]}; every custom_id must be unique", n,
                         "custom_id")  # fmt: skip
    seen[custom_id] = n
    if item.get("method", "POST") != "POST":
        return LineError("invalid_method", f"line {n}: method must be POST, got {item.get('method')!r}", n,
                         "method")  # fmt: skip
    if item.get("url") != endpoint:
        return LineError("mismatched_endpoint", f"line {n}: url {item.get('url')!r} differs from the "
                                                f"batch's endpoint {endpoint}", n, "url")  # fmt: skip
    body = item.get("body")
    if not isinstance(body, dict):
        return LineError("invalid_request", f"line {n}: body must be a JSON object", n, "body")
    problem = _body_error(endpoint, body)
    if problem is not None:
        return LineError("invalid_request", f"line {n}: {problem}", n, "body")
    if models is not None and body["model"] not in models:
        known = ", ".join(sorted(models)) or "(none)"
        return LineError("model_not_found", f"line {n}: the model {body['model']!r} is not served here or "
                                            f"not allowed for this API key; models: {known}", n,
                         "body.model")  # fmt: skip
    return custom_id, body
