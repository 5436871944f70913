"""Trace replay: CSV or JSONL (optionally gzipped) with auto-detected columns.

Recognised formats (the benchmark contract):

- Azure LLM inference 2023: ``TIMESTAMP, ContextTokens, GeneratedTokens``;
- BurstGPT: ``Timestamp, Model, Request tokens, Response tokens, ...``;
- Mooncake: ``timestamp`` (milliseconds), ``input_length``, ``output_length``, and optionally
  ``hash_ids``: one id per 512-token block of the prompt, equal ids meaning an equal prefix up to
  and including that block (its rows must come in arrival order);
- generic: ``arrival_s`` or ``timestamp``, ``input_tokens`` or ``prompt_tokens``,
  ``output_tokens``; optional ``model``, ``class``, ``prompt``, ``response``.

Timestamps become seconds from the first arrival (rows may come unsorted).

A rate series (``window_start_s, rate_rps[, cv]``: one line per window, each lasting until the next
starts, the last as long as the one before it) describes arrivals without requests, and a lengths
file (output tokens, optionally input tokens, no arrival column: an output-length distribution)
requests without arrivals; ``read_trace`` tells the three kinds apart, and
``tessera.sim.workloads.series_arrivals`` samples a series.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

ARRIVAL_COLS = ("arrival_s", "timestamp", "TIMESTAMP", "Timestamp", "arrival", "time")
INPUT_COLS = ("input_tokens", "prompt_tokens", "ContextTokens", "Request tokens", "input_length")
OUTPUT_COLS = (
    "output_tokens",
    "GeneratedTokens",
    "Response tokens",
    "output_length",
    "completion_tokens",
    "output_token_length",  # the SSJF proxy-model data set's LMSYS-Chat output lengths
)
MODEL_COLS = ("model", "Model")
CLASS_COLS = ("class", "service_class", "request_class")


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace, arrival in seconds from the trace's first arrival."""

    arrival: float
    input_tokens: int
    output_tokens: int
    model: str | None = None
    service_class: str | None = None
    prompt: str | None = None
    response: str | None = None
    hash_ids: tuple[int, ...] | None = None  # prompt blocks of HASH_BLOCK_TOKENS tokens (Mooncake)


HASH_BLOCK_TOKENS = 512  # tokens per Mooncake hash_ids block


def _parse_hash_ids(value: object, input_tokens: int, where: str) -> tuple[int, ...]:
    """A Mooncake row's block ids: one non-negative integer per 512-token block of the prompt."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in value):  # fmt: skip
        shown = str(value)[:80]
        raise ValueError(f"{where}: hash_ids must be a list of non-negative integers (one per "
                         f"{HASH_BLOCK_TOKENS}-token block of the prompt), got {shown}")  # fmt: skip
    blocks = -(-input_tokens // HASH_BLOCK_TOKENS)
    if len(value) != blocks:
        raise ValueError(f"{where}: hash_ids has {len(value)} ids but input_length {input_tokens} makes "
                         f"{blocks} blocks of {HASH_BLOCK_TOKENS} tokens")  # fmt: skip
    return tuple(value)


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8", newline="")


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) pairs of a JSON-lines file, optionally gzipped; blank lines skipped.

    Raises ValueError naming the file and line for invalid JSON or a line that is not an object.
    """
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            yield lineno, rec


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) pairs."""
    if ".jsonl" in path.name or ".ndjson" in path.name or path.name.endswith(".json"):
        yield from read_jsonl(path)
        return
    with _open_text(path) as fh:
        yield from enumerate(csv.DictReader(fh), 2)


def _pick(columns: list[str], options: tuple[str, ...]) -> str | None:
    for name in options:
        if name in columns:
            return name
    return None


def _parse_time(value: object, where: str) -> float:
    """Seconds as a number, or an ISO-like wall-clock timestamp (Azure's 100 ns resolution included)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    if "." in text:  # Python parses at most 6 fractional digits; Azure has 7
        head, frac = text.rsplit(".", 1)
        if frac.isdigit():
            extra = float("0." + frac)
            try:
                return datetime.fromisoformat(head).timestamp() + extra
            except ValueError:
                pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError as exc:
        raise ValueError(f"{where}: arrival {text!r} is neither seconds nor a timestamp") from exc


def _parse_count(value: object, column: str, where: str) -> int:
    try:
        number = float(str(value).strip())
    except ValueError as exc:
        raise ValueError(f"{where}: {column} must be a non-negative integer, got {value!r}") from exc
    if number < 0 or number != int(number):
        raise ValueError(f"{where}: {column} must be a non-negative integer, got {value!r}")
    return int(number)


def load_trace(path: Path | str) -> list[TraceRow]:
    """Read a trace file into rows sorted by arrival (seconds from the first arrival)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path} does not exist")
    if _kind(path) == "series":
        raise ValueError(
            f"{path} is a rate series ({', '.join(SERIES_COLS)}), not a trace of requests: it has no "
            "token lengths; read it with read_trace"
        )
    rows: list[tuple[float, int, int, dict]] = []
    cols: tuple[str, str, str] | None = None
    time_scale = 1.0
    for lineno, rec in _records(path):
        where = f"{path}:{lineno}"
        if cols is None:
            names = list(rec)
            arr, inp, out = _pick(names, ARRIVAL_COLS), _pick(names, INPUT_COLS), _pick(names, OUTPUT_COLS)
            missing = [
                f"arrival ({' | '.join(ARRIVAL_COLS)})" if arr is None else None,
                f"input tokens ({' | '.join(INPUT_COLS)})" if inp is None else None,
                f"output tokens ({' | '.join(OUTPUT_COLS)})" if out is None else None,
            ]
            missing = [m for m in missing if m]
            if missing:
                raise ValueError(
                    f"{path}: missing columns: {'; '.join(missing)}. Found: {', '.join(names)}. "
                    "Rename the columns or use one of the supported formats (Azure 2023, BurstGPT, Mooncake)."
                )
            assert arr is not None and inp is not None and out is not None
            cols = (arr, inp, out)
            if arr == "timestamp" and "input_length" in names:
                time_scale = 1e-3  # Mooncake timestamps are milliseconds
        arr, inp, out = cols
        if rec.get(arr) in (None, "") or rec.get(inp) in (None, "") or rec.get(out) in (None, ""):
            raise ValueError(f"{where}: empty value in {arr}, {inp} or {out}")
        t = _parse_time(rec[arr], where) * time_scale
        count_in = _parse_count(rec[inp], inp, where)
        if "hash_ids" in rec:
            rec["hash_ids"] = _parse_hash_ids(rec["hash_ids"], count_in, where)
            if rows and t < rows[-1][0]:
                raise ValueError(f"{where}: timestamp {rec[arr]} is before the previous row's; a trace "
                                 "with hash_ids must list its requests in arrival order")  # fmt: skip
        rows.append((t, count_in, _parse_count(rec[out], out, where), rec))
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    model_col = _pick(list(rows[0][3]), MODEL_COLS)
    class_col = _pick(list(rows[0][3]), CLASS_COLS)
    return [
        TraceRow(
            arrival=t - t0,
            input_tokens=i,
            output_tokens=o,
            model=str(rec[model_col]) if model_col and rec.get(model_col) not in (None, "") else None,
            service_class=str(rec[class_col]) if class_col and rec.get(class_col) not in (None, "") else None,
            prompt=rec.get("prompt"),
            response=rec.get("response"),
            hash_ids=rec.get("hash_ids"),
        )
        for t, i, o, rec in rows
    ]


# ---- rate series --------------------------------------------------------------------------------
SERIES_COLS = ("window_start_s", "rate_rps", "cv")


@dataclass(frozen=True, slots=True)
class RateWindow:
    """One window of a rate series: from ``start_s`` (seconds from the series' start) at ``rate_rps``."""

    start_s: float
    rate_rps: float
    cv: float | None = None  # coefficient of variation of the inter-arrival gaps; None: not given


@dataclass(frozen=True, slots=True)
class RateSeries:
    """Per-window arrival rates; the last window ends at ``end_s``."""

    windows: tuple[RateWindow, ...]
    end_s: float

    @property
    def has_cv(self) -> bool:
        """Whether every window gives a coefficient of variation."""
        return all(w.cv is not None for w in self.windows)


@dataclass(frozen=True, slots=True)
class Trace:
    """What a trace file holds, one of: requests (``rows``), a rate series (``series``), or request
    lengths without arrival times (``lengths``: (input tokens or None, output tokens) each)."""

    path: Path
    rows: list[TraceRow] | None = None
    series: RateSeries | None = None
    lengths: list[tuple[int | None, int]] | None = None


def _kind(path: Path) -> str:
    """``series``, ``lengths`` (an output column and no arrival column) or ``requests``."""
    for _, rec in _records(path):
        names = list(rec)
        if SERIES_COLS[0] in rec and SERIES_COLS[1] in rec:
            return "series"
        if _pick(names, ARRIVAL_COLS) is None and _pick(names, OUTPUT_COLS) is not None:
            return "lengths"
        break
    return "requests"


def load_lengths(path: Path | str) -> list[tuple[int | None, int]]:
    """(input tokens or None, output tokens) per line of a file without arrival times, in file order."""
    path = Path(path)
    out: list[tuple[int | None, int]] = []
    cols: tuple[str | None, str] | None = None
    for lineno, rec in _records(path):
        where = f"{path}:{lineno}"
        if cols is None:
            out_col = _pick(list(rec), OUTPUT_COLS)
            if out_col is None:
                raise ValueError(f"{path}: no output tokens column ({' | '.join(OUTPUT_COLS)})")
            cols = (_pick(list(rec), INPUT_COLS), out_col)
        inp, outp = cols
        if rec.get(outp) in (None, "") or (inp is not None and rec.get(inp) in (None, "")):
            raise ValueError(f"{where}: empty value in {outp if inp is None else f'{inp} or {outp}'}")
        out.append(
            (
                None if inp is None else _parse_count(rec[inp], inp, where),
                _parse_count(rec[outp], outp, where),
            )
        )
    if not out:
        raise ValueError(f"trace {path} has no rows")
    return out


def _parse_number(value: object, column: str, where: str) -> float:
    try:
        number = float(str(value).strip())
    except ValueError as exc:
        raise ValueError(f"{where}: {column} must be a number, got {value!r}") from exc
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"{where}: {column} must be a finite number, got {value!r}")
    return number


def load_rate_series(path: Path | str) -> RateSeries:
    """Read a rate series: ``window_start_s`` strictly increasing, ``rate_rps`` >= 0 (some > 0), and
    optionally ``cv`` > 0 on every line. Starts become seconds from the first window's start."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path} does not exist")
    windows: list[RateWindow] = []
    for lineno, rec in _records(path):
        where = f"{path}:{lineno}"
        start = _parse_number(rec.get(SERIES_COLS[0]), SERIES_COLS[0], where)
        rate = _parse_number(rec.get(SERIES_COLS[1]), SERIES_COLS[1], where)
        if rate < 0:
            raise ValueError(f"{where}: rate_rps must be >= 0 requests/s, got {rate:g}")
        cv = None
        if rec.get("cv") not in (None, ""):
            cv = _parse_number(rec["cv"], "cv", where)
            if cv <= 0:
                raise ValueError(f"{where}: cv must be > 0 (1 is Poisson-like), got {cv:g}")
        if windows and start <= windows[-1].start_s:
            raise ValueError(f"{where}: window_start_s {start:g} must be after the previous window's "
                             f"{windows[-1].start_s:g} (list the windows in time order)")  # fmt: skip
        windows.append(RateWindow(start, rate, cv))
    if len(windows) < 2:
        raise ValueError(
            f"{path}: a rate series needs at least two windows (each lasts until the next starts)"
        )
    if not any(w.rate_rps > 0 for w in windows):
        raise ValueError(f"{path}: every window has rate_rps 0; no request would arrive")
    if len({w.cv is None for w in windows}) > 1:
        raise ValueError(f"{path}: give cv on every window or on none")
    t0 = windows[0].start_s
    shifted = tuple(RateWindow(w.start_s - t0, w.rate_rps, w.cv) for w in windows)
    last = shifted[-1].start_s + (shifted[-1].start_s - shifted[-2].start_s)
    return RateSeries(shifted, last)


def read_trace(path: Path | str) -> Trace:
    """The one reader of ``--trace`` files: a trace of requests (any format above), a rate series or
    a lengths file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path} does not exist")
    kind = _kind(path)
    if kind == "series":
        return Trace(path, series=load_rate_series(path))
    if kind == "lengths":
        return Trace(path, lengths=load_lengths(path))
    return Trace(path, rows=load_trace(path))
